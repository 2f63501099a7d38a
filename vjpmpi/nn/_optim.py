"""Optimizer state sharded over the data-parallel ranks (ZeRO stages 1 and 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import RED_NAMES, SUM
from .._ops import allgather, reduce_scatter
from ._shard import comm_ref, concat, dtype_groups, split_into


def _blocks(leaves, idx, size):
    """The leaves at `idx` in one vector, zero-padded to a multiple of `size`, as
    `(size, block)`: row r is rank r's shard."""
    flat = concat(leaves, idx)
    return jnp.pad(flat, (0, -flat.size % size)).reshape(size, -1)


def _check_elementwise(inner):
    """Refuse an optimizer whose update of one element depends on others (a global
    norm, a per-leaf trust ratio): on shards it would silently differ."""
    gen = np.random.default_rng(0)
    p, g1, g2 = (jnp.asarray(gen.standard_normal(8), jnp.float32) for _ in range(3))

    def steps(params, grads):
        state = inner.init(params)
        out = []
        for g in grads:
            u, state = inner.update(g, state, params)
            out.append(u)
        return out

    try:
        whole = steps(p, [g1, g2])
        halves = [steps(p[s], [g1[s], g2[s]]) for s in (slice(0, 3), slice(3, 8))]
    except Exception as err:  # noqa: BLE001 (any failure: the probe cannot vouch for it)
        raise ValueError(
            "vjpmpi.nn.sharded_optimizer: could not check that the optimizer acts "
            f"element-wise (probe update failed: {err!r})") from err
    for k, u in enumerate(whole):
        if not np.allclose(u, jnp.concatenate([h[k] for h in halves]), rtol=1e-5, atol=1e-7):
            raise ValueError(
                "vjpmpi.nn.sharded_optimizer: the optimizer does not act element-wise (an "
                "update depends on other elements, e.g. clip_by_global_norm or a per-leaf "
                "norm), so its shards would give different steps; apply it to the "
                "allreduce_gradients of a plain optimizer instead")


def sharded_optimizer(inner, *, mean: bool = True, comm=None):
    """Wrap an optax optimizer so that each rank keeps and updates 1/size of its state.

    ZeRO stages 1 and 2 for data parallelism: `update` reduce-scatters the ranks' local
    gradients (summed, or averaged with `mean`), so each rank gets the reduced gradient
    of its block of every parameter (flattened per dtype); it runs `inner` on that
    block alone, whose state is the only one it keeps (1/size of `inner`'s); and it
    allgathers the blocks' updates. The result equals `inner` applied to
    `allreduce_gradients(grads, mean=mean)`, step for step, for an element-wise
    `inner` (sgd, momentum, adam, adamw, rmsprop, ...); one whose update mixes elements
    (e.g. `optax.clip_by_global_norm`) is refused when the wrapper is made.
    Shape: local gradients (a pytree) -> replicated updates (the same pytree).
    Transpose: (not differentiated) one reduce_scatter and one allgather per dtype.
    """
    import optax

    ref = comm_ref(comm, "sharded_optimizer")
    _check_elementwise(inner)

    def shards(tree):
        leaves, _, groups = dtype_groups(tree)
        return {name: _blocks(leaves, idx, ref.size)[ref.rank] for name, idx in groups.items()}

    def init(params):
        return inner.init(shards(params))

    def update(grads, state, params=None):
        leaves, treedef, groups = dtype_groups(grads)
        summed = {}
        for name, idx in groups.items():
            block = reduce_scatter(_blocks(leaves, idx, ref.size), RED_NAMES[SUM], comm=ref.comm)
            summed[name] = block / ref.size if mean else block
        updates, state = inner.update(summed, state, None if params is None else shards(params))
        out = list(leaves)
        for name, idx in groups.items():
            split_into(out, leaves, idx, allgather(updates[name], comm=ref.comm).reshape(-1))
        return jax.tree_util.tree_unflatten(treedef, out), state

    return optax.GradientTransformation(init, update)
