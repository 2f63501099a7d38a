"""Train a tensor-parallel MLP on scikit-learn's digits, and check it against one process.

    mpiexec -n 2 python examples/train_digits.py

The hidden layer of the MLP is split over the ranks (vjpmpi.nn.ParallelMLP: one
allreduce forward, one backward). Rank 0 shows a progress bar with the loss,
prints the test accuracy and the largest parameter difference from the same
training run done by a plain equinox MLP on one process, and writes a loss-curve
PNG. The dataset ships inside scikit-learn: nothing is downloaded.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI
from sklearn.datasets import load_digits

import vjpmpi.nn as vnn
from plots import save_loss_curves
from progress import StepBar
from single_process import on_one_rank

COMM = MPI.COMM_WORLD
HIDDEN = 96  # divisible by 1, 2, 3 and 4 ranks


def load_data(seed=0):
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


def train(model, data, steps, batch, lr, progress=None):
    """Adam on minibatches drawn identically on every rank; returns (model, losses)."""
    (x, y), _ = data
    opt = optax.adam(lr)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, xb, yb):
        loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, xb, yb)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(y), batch, replace=False)
        model, state, loss = step(model, state, x[idx], y[idx])
        losses.append(float(loss))
        if progress is not None:
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
            progress.update()
    return model, losses


def accuracy(model, data):
    _, (x, y) = data
    return float(jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y))


def max_param_diff(a, b):
    """The largest difference between two models' parameters (same structure required)."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten(eqx.filter(m, eqx.is_inexact_array))
                          for m in (a, b))
    if ta != tb or not la:
        raise ValueError(f"the models differ in structure:\n{ta}\n{tb}")
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(la, lb, strict=True))


def main(steps=300, batch=128, lr=3e-3, out="examples/out/train_digits.png", show=True):
    data = load_data()
    key = jax.random.PRNGKey(0)
    dense = eqx.nn.MLP(64, 10, HIDDEN, depth=1, activation=jax.nn.gelu, key=key)
    parallel = vnn.ParallelMLP.from_dense(dense, comm=COMM)

    progress = None
    if show and COMM.rank == 0:
        progress = StepBar(steps, f"tensor-parallel MLP on {COMM.size} ranks")
    parallel, losses = train(parallel, data, steps, batch, lr, progress)
    if progress is not None:
        progress.close()
    trained = parallel.to_dense()  # (a collective: every rank)

    def reference_run():  # one process, plain equinox
        reference, ref_losses = train(dense, data, steps, batch, lr)
        return {"reference_accuracy": accuracy(reference, data), "ref_losses": ref_losses,
                "max_param_diff": max_param_diff(trained, reference)}

    ref = on_one_rank(reference_run, COMM)
    ref_losses = ref["ref_losses"]
    result = {
        "test_accuracy": accuracy(parallel, data),
        "reference_accuracy": ref["reference_accuracy"],
        "max_param_diff": ref["max_param_diff"],
        "max_loss_diff": float(np.max(np.abs(np.array(losses) - np.array(ref_losses)))),
        "final_loss": losses[-1],
    }
    if COMM.rank == 0:
        print(f"test accuracy {result['test_accuracy']:.4f} "
              f"(single process: {result['reference_accuracy']:.4f})")
        print(f"largest parameter difference from the single-process run: "
              f"{result['max_param_diff']:.3e}; largest loss difference: {result['max_loss_diff']:.3e}")
        if out:
            save_loss_curves(out, {f"vjpmpi, {COMM.size} ranks": losses, "single process": ref_losses},
                             "Tensor-parallel MLP on digits", "cross-entropy", log=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="examples/out/train_digits.png")
    args = parser.parse_args()
    main(steps=args.steps, out=args.out)
