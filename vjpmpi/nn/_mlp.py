"""A tensor-parallel MLP block and the data-parallel gradient all-reduce."""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._mpi import RED_NAMES, SUM, as_comm
from .._ops import allreduce
from ._linear import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(eqx.Module):
    """Column-parallel linear -> activation -> row-parallel linear (hidden units split).

    Shape: replicated `Float[Array, "in"]` -> replicated `Float[Array, "out"]`.
    Transpose: one allreduce forward (the row layer's sum) and one backward (the
    column layer's input), as in Megatron-LM.
    """

    column: ColumnParallelLinear
    row: RowParallelLinear
    activation: Callable = eqx.field(static=True)

    def __init__(self, in_size: int, out_size: int, width_size: int,
                 activation: Callable = jax.nn.gelu, *, comm=None,
                 key: PRNGKeyArray | None = None, dense: eqx.nn.MLP | None = None):
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.ParallelMLP: pass `key=` or use `from_dense`")
            dense = eqx.nn.MLP(in_size, out_size, width_size, depth=1, activation=activation,
                               key=key)
        if len(dense.layers) != 2:
            raise ValueError(
                f"vjpmpi.nn.ParallelMLP: needs an eqx.nn.MLP of depth 1, got depth "
                f"{len(dense.layers) - 1}"
            )
        self.column = ColumnParallelLinear.from_dense(dense.layers[0], comm)
        self.row = RowParallelLinear.from_dense(dense.layers[1], comm, input_is_parallel=True)
        self.activation = dense.activation if activation is None else activation

    @classmethod
    def from_dense(cls, mlp: eqx.nn.MLP, comm=None):
        """Shard a depth-1 `eqx.nn.MLP` (same on every rank); its final activation must be identity."""
        return cls(mlp.in_size, mlp.out_size, mlp.width_size, mlp.activation, comm=comm, dense=mlp)

    def to_dense(self) -> eqx.nn.MLP:
        col, row = self.column.to_dense(), self.row.to_dense()
        mlp = eqx.nn.MLP(col.in_features, row.out_features, col.out_features, depth=1,
                         activation=self.activation, key=jax.random.PRNGKey(0))
        return eqx.tree_at(lambda m: m.layers, mlp, (col, row))

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        return self.row(self.activation(self.column(x)))


def allreduce_gradients(grads: PyTree, *, mean: bool = True, comm=None) -> PyTree:
    """All-reduce (mean or sum) every inexact-array leaf of `grads` over `comm`.

    Leaves of one dtype are flattened into one buffer, so a pytree of any number of
    leaves costs one MPI call per dtype. Non-array leaves pass through unchanged.
    Works on gradients from `eqx.filter_grad` and as a step before `optax` updates.
    Transpose: allreduce(SUM) (scaled by 1/size for the mean).
    """
    ref = as_comm(comm, "nn.allreduce_gradients")
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        if eqx.is_inexact_array(leaf):
            groups.setdefault(jnp.result_type(leaf), []).append(i)
    out = list(leaves)
    for dtype, idx in groups.items():
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
        total = allreduce(flat, RED_NAMES[SUM], comm=ref.comm)
        if mean:
            total = total / ref.size
        offset = 0
        for i in idx:
            n = leaves[i].size
            out[i] = total[offset:offset + n].reshape(leaves[i].shape).astype(dtype)
            offset += n
    return jax.tree_util.tree_unflatten(treedef, out)
