"""A mixture of experts split over the ranks, trained, against one process.

    mpiexec -n 2 python -m mpi4py examples/moe.py
    mpiexec -n 2 python -m mpi4py examples/moe.py --sync allreduce sync zero

A small model (a replicated input layer, an `ExpertParallelMoE`, a replicated head)
learns a regression. Each rank holds its own tokens and 1/size of the experts. Each
gradient sync (`--sync`: allreduce_gradients by default, sync_gradients,
sharded_optimizer; one run each) applies to the whole model: `vjpmpi.nn.layout` tells
it which leaves are experts. Each run is checked against the same model on one
process (every expert, MPI.COMM_SELF) trained on every rank's tokens. Then a layer
with a capacity factor is checked against the one-process layer on each rank's
tokens alone.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import vjpmpi.nn as vnn

D, H, T = 8, 16, 32  # width, each expert's hidden width, tokens per rank
ALPHA = 0.01  # the weight of the load-balancing loss
# allreduce_gradients, sync_gradients, sharded_optimizer
SYNCS = ("allreduce", "sync", "zero")


class Net(eqx.Module):
    embed: eqx.nn.Linear  # replicated: every rank holds it whole
    moe: vnn.ExpertParallelMoE  # the router replicated, the experts split
    head: eqx.nn.Linear  # replicated

    def __call__(self, x):  # this rank's tokens, (tokens, D)
        h = jax.vmap(self.embed)(x)
        y, aux = self.moe(h)  # aux: the same on every rank
        return jax.vmap(self.head)(h + y), aux


def build(comm, key, experts, **moe):
    """The model: the same global weights on any communicator (one key everywhere)."""
    k1, k2, k3 = jax.random.split(key, 3)
    experts = vnn.ExpertParallelMoE(D, H, experts, top_k=2, comm=comm, key=k2, **moe)
    return Net(eqx.nn.Linear(D, D, key=k1), experts, eqx.nn.Linear(D, 1, key=k3))


def loss_fn(net, x, t):
    y, aux = net(x)
    return jnp.mean((y[:, 0] - t) ** 2) + ALPHA * aux  # aux as it is: no scaling


def data(size, seed=0):
    """Every rank's tokens and targets: size * T rows, rank r's from row r * T."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size * T, D))
    t = np.sin(x @ rng.standard_normal(D))
    dtype = jnp.zeros(0).dtype  # float32, or float64 with jax_enable_x64
    return jnp.asarray(x, dtype), jnp.asarray(t, dtype)


def train(net, x, t, steps, sync, comm):
    """`steps` Adam steps on (x, t), the gradient synced by `sync` over `comm`;
    returns the model and the losses."""
    if sync == "zero":
        opt = vnn.sharded_optimizer(optax.adam(1e-2), comm=comm)
    else:
        opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(net, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(net, state):
        if sync == "sync":  # the allreduce runs inside the backward pass
            loss, g = eqx.filter_value_and_grad(
                lambda m: loss_fn(vnn.sync_gradients(m, comm=comm), x, t))(net)
        else:
            loss, g = eqx.filter_value_and_grad(loss_fn)(net, x, t)
            if sync == "allreduce":  # after the backward pass
                g = vnn.allreduce_gradients(g, comm=comm)
            # ("zero": sharded_optimizer's update syncs this rank's gradient)
        params = eqx.filter(net, eqx.is_inexact_array)
        updates, state = opt.update(g, state, params)
        return eqx.apply_updates(net, updates), state, loss

    losses = []
    for _ in range(steps):
        net, state, loss = step(net, state)
        losses.append(loss)
    return net, losses


def max_diff(a, b):
    a, b = (jax.tree_util.tree_leaves(eqx.filter(v, eqx.is_array)) for v in (a, b))
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(a, b, strict=True))


def main(steps=5, syncs=("allreduce",), comm=MPI.COMM_WORLD):
    """Train with each gradient sync of `syncs`; returns, per sync, the ranks' mean
    losses and the largest differences from one process, and the capacity check."""
    rank, size = comm.rank, comm.size
    key = jax.random.PRNGKey(0)
    x, t = data(size)
    mine = slice(rank * T, (rank + 1) * T)  # this rank's tokens
    experts = 2 * size  # a multiple of the number of ranks

    # expert parallel: each rank its tokens and its experts
    net = build(comm, key, experts)
    where = vnn.layout(net)  # where each parameter lives
    assert isinstance(where.moe.w1, vnn.Split)
    assert isinstance(where.moe.router, vnn.Replicated)
    # one process: every expert (the same key: the same layer), every rank's tokens
    one = build(MPI.COMM_SELF, key, experts)
    assert max_diff(net.moe.to_dense(), one.moe) == 0.0
    one, one_losses = train(one, x, t, steps, "none", MPI.COMM_SELF)  # (each rank)

    result = {}
    for sync in syncs:
        trained, losses = train(net, x[mine], t[mine], steps, sync, comm)
        # the mean of the ranks' losses is the one-process loss
        losses = [float(vjpmpi.allreduce(v, MPI.SUM, comm=comm)) / size
                  for v in losses]
        # every expert here, to compare
        whole = eqx.tree_at(lambda n: n.moe, trained, trained.moe.to_dense())
        result[sync] = {
            "losses": losses,
            "max_loss_diff": max(abs(a - float(b))
                                 for a, b in zip(losses, one_losses, strict=True)),
            "max_param_diff": max_diff(whole, one)}
        if rank == 0:
            print(f"{sync}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; parameters "
                  f"within {result[sync]['max_param_diff']:.0e} of one process")

    # a capacity factor: each expert takes at most its capacity from each rank
    forward = eqx.filter_jit(lambda n, v: n(v)[0])
    capped = forward(build(comm, key, experts, capacity_factor=1.0), x[mine])
    # (one process, this rank's tokens alone)
    alone = forward(build(MPI.COMM_SELF, key, experts, capacity_factor=1.0), x[mine])
    dropless = forward(net, x[mine])
    lost = float(jnp.mean(jnp.any(capped != dropless, axis=-1)))  # this rank's
    result["capacity"] = {"max_diff": max_diff(capped, alone),
                          "tokens_capped": comm.allreduce(lost) / size}
    if rank == 0:
        capacity = result["capacity"]
        print(f"capacity_factor=1.0: {capacity['tokens_capped']:.0%} of the tokens "
              "lose an expert;")
        print(f"    outputs within {capacity['max_diff']:.0e} of one process on each "
              "rank's tokens alone")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sync", choices=SYNCS, nargs="+", default=["allreduce"],
                        help="one or more of allreduce (allreduce_gradients), sync "
                        "(sync_gradients), zero (sharded_optimizer)")
    args = parser.parse_args()
    main(steps=args.steps, syncs=args.sync)
