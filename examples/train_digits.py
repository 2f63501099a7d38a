"""Train a tensor-parallel MLP on scikit-learn's digits, and check it against one process.

    mpiexec -n 2 python examples/train_digits.py
    mpiexec -n 2 python examples/train_digits.py --devices-per-process 2

The hidden layer of the MLP is split over the ranks (vjpmpi.nn.ParallelMLP: one
allreduce forward, one backward). Rank 0 shows a progress bar with the loss,
prints the test accuracy and the largest parameter difference from the same
training run done by a plain equinox MLP on one process, and writes a loss-curve
PNG. The dataset ships inside scikit-learn: nothing is downloaded.

With `--devices-per-process N` each process runs N CPU devices, and the ranks are the
devices: the training step runs in a `jax.shard_map` over this process's N devices, its
communicator `vjpmpi.device_comm` (P processes x N devices = P * N ranks). The program
each rank runs is the same, so the run equals the one on P * N processes (up to the
order of the sums' rounding).
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI
from sklearn.datasets import load_digits

import vjpmpi.nn as vnn
from plots import save_loss_curves
from progress import StepBar
from single_process import on_one_rank

COMM = MPI.COMM_WORLD
HIDDEN = 96  # divisible by 1, 2, 3, 4, 6, 8 and 12 ranks
AXIS = "ranks"  # the mesh axis whose devices are ranks (--devices-per-process)
DEVICE_COUNT = "--xla_force_host_platform_device_count"


def use_cpu_devices(n):
    """Give JAX `n` CPU devices in this process: XLA's flag, read when JAX starts its CPU
    backend, so call this before anything makes a JAX array (vjpmpi's import does not)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT}={n}"])


def device_mesh(n):
    """A mesh of this process's first `n` devices along AXIS (each a rank)."""
    devices = jax.local_devices()
    if len(devices) < n:
        raise RuntimeError(
            f"--devices-per-process {n}: JAX has {len(devices)} device(s) in this process; "
            f"call use_cpu_devices({n}) before JAX starts (before any array exists)")
    return Mesh(np.array(devices[:n]), (AXIS,))


def on_devices(mesh, fn, whole=0):
    """`fn` run on every device of `mesh`, each a rank of `vjpmpi.device_comm(AXIS)`, as
    one jitted `shard_map`. Its first arguments hold one entry per device along their
    arrays' leading axis (models, optimizer states: each device's own), its last `whole`
    ones are the same on every device (data); its results' arrays get a leading device
    axis. (Leaves that are not arrays, an MLP's activation, pass around the shard_map.)"""
    def run(*args):
        arrays, static = eqx.partition(args, eqx.is_array)
        split = len(args) - whole
        out_static = []

        def body(arrays):
            mine = jax.tree.map(lambda a: a[0], arrays[:split])  # this device's entries
            out = fn(*eqx.combine((*mine, *arrays[split:]), static))
            out_arrays, rest = eqx.partition(out, eqx.is_array)
            out_static.append(rest)
            return jax.tree.map(lambda a: a[None], out_arrays)

        specs = (P(AXIS),) * split + (P(),) * whole
        out = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P(AXIS))(arrays)
        return eqx.combine(out, out_static[0])

    return eqx.filter_jit(run)


def first_device(tree):
    """Device 0's entry of every leaf of an `on_devices` result."""
    return jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, tree)


def load_data(seed=0):
    """(train, test) sets, the same on every process. Every rank uses the whole minibatch
    (the model, not the data, is split): each device gets all of it, as each process of a
    run on P * N processes does."""
    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def cross_entropy(model, x, y):
    logits = jax.vmap(model)(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def train(model, data, steps, batch, lr, progress=None, mesh=None):
    """Adam on minibatches drawn identically on every rank; returns (model, losses).

    With `mesh`, every device of it is a rank: `model` (holding one entry per device along
    each array's leading axis) and the optimizer state are split over the devices, the
    minibatch goes whole to each."""
    (x, y), _ = data
    opt = optax.adam(lr)

    def init(model):
        return opt.init(eqx.filter(model, eqx.is_inexact_array))

    def step(model, state, xb, yb):
        loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, xb, yb)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    if mesh is None:
        state, step = init(model), eqx.filter_jit(step)
    else:
        state, step = on_devices(mesh, init)(model), on_devices(mesh, step, whole=2)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(y), batch, replace=False)
        model, state, loss = step(model, state, x[idx], y[idx])
        losses.append(float(loss if mesh is None else loss[0]))
        if progress is not None:
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
            progress.update()
    return model, losses


def accuracy(model, data, mesh=None):
    _, (x, y) = data
    if mesh is None:
        logits = jax.vmap(model)(x)
    else:
        logits = first_device(on_devices(mesh, lambda m, v: jax.vmap(m)(v), whole=1)(model, x))
    return float(jnp.mean(jnp.argmax(logits, axis=-1) == y))


def max_param_diff(a, b):
    """The largest difference between two models' parameters (same structure required)."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten(eqx.filter(m, eqx.is_inexact_array))
                          for m in (a, b))
    if ta != tb or not la:
        raise ValueError(f"the models differ in structure:\n{ta}\n{tb}")
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(la, lb, strict=True))


def main(steps=300, batch=128, lr=3e-3, out="examples/out/train_digits.png", show=True,
         devices_per_process=None):
    """Train on COMM's ranks, or with `devices_per_process` on that many devices of each
    process (each a rank); returns the results (every rank), the trained MLP gathered
    into one `eqx.nn.MLP` under "trained"."""
    data = load_data()
    key = jax.random.PRNGKey(0)
    dense = eqx.nn.MLP(64, 10, HIDDEN, depth=1, activation=jax.nn.gelu, key=key)
    if devices_per_process is None:  # a rank per process
        mesh, ranks = None, f"{COMM.size} ranks"
        parallel = vnn.ParallelMLP.from_dense(dense, comm=COMM)
    else:  # a rank per device: each device slices its block of `dense` by its rank
        mesh = device_mesh(devices_per_process)
        ranks = (f"{COMM.size * devices_per_process} ranks ({COMM.size} "
                 f"process{'es' if COMM.size > 1 else ''} x {devices_per_process} devices)")
        parallel = on_devices(mesh, lambda d: vnn.ParallelMLP.from_dense(
            d, comm=vjpmpi.device_comm(AXIS, COMM)), whole=1)(dense)

    progress = None
    if show and COMM.rank == 0:
        progress = StepBar(steps, f"tensor-parallel MLP on {ranks}")
    parallel, losses = train(parallel, data, steps, batch, lr, progress, mesh)
    if progress is not None:
        progress.close()
    if mesh is None:
        trained = parallel.to_dense()  # (a collective: every rank)
    else:
        trained = first_device(on_devices(mesh, lambda m: m.to_dense())(parallel))

    def reference_run():  # one process, plain equinox
        reference, ref_losses = train(dense, data, steps, batch, lr)
        return {"reference_accuracy": accuracy(reference, data), "ref_losses": ref_losses,
                "max_param_diff": max_param_diff(trained, reference)}

    ref = on_one_rank(reference_run, COMM)
    ref_losses = ref["ref_losses"]
    result = {
        "test_accuracy": accuracy(parallel, data, mesh),
        "reference_accuracy": ref["reference_accuracy"],
        "max_param_diff": ref["max_param_diff"],
        "max_loss_diff": float(np.max(np.abs(np.array(losses) - np.array(ref_losses)))),
        "final_loss": losses[-1],
        "losses": losses,
        "trained": trained,
    }
    if COMM.rank == 0:
        print(f"test accuracy {result['test_accuracy']:.4f} "
              f"(single process: {result['reference_accuracy']:.4f})")
        print(f"largest parameter difference from the single-process run: "
              f"{result['max_param_diff']:.3e}; largest loss difference: {result['max_loss_diff']:.3e}")
        if out:
            save_loss_curves(out, {f"vjpmpi, {ranks}": losses, "single process": ref_losses},
                             "Tensor-parallel MLP on digits", "cross-entropy", log=True)
    return result


def save_result(path, result):
    """Write the accuracy, the losses and the trained parameters (in tree order) to the
    .npz file `path` (rank 0), for comparing runs."""
    if COMM.rank == 0:
        leaves = jax.tree_util.tree_leaves(eqx.filter(result["trained"], eqx.is_inexact_array))
        np.savez(path, test_accuracy=result["test_accuracy"], losses=np.array(result["losses"]),
                 **{f"param{i}": np.asarray(a) for i, a in enumerate(leaves)})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="examples/out/train_digits.png")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                        help="run N CPU devices per process, each a rank")
    parser.add_argument("--save", default=None, metavar="NPZ",
                        help="write the accuracy, losses and trained parameters there")
    args = parser.parse_args()
    if args.devices_per_process is not None:
        use_cpu_devices(args.devices_per_process)  # (before JAX starts its CPU backend)
    result = main(steps=args.steps, out=args.out, devices_per_process=args.devices_per_process)
    if args.save:
        save_result(args.save, result)
