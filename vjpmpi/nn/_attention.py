"""Tensor-parallel multi-head attention: heads split over the ranks."""

from __future__ import annotations

import copy

import equinox as eqx
from jaxtyping import Array, Float, PRNGKeyArray

from .._mpi import CommRef
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._shard import comm_ref


def _with_num_heads(mha: eqx.nn.MultiheadAttention, num_heads: int):
    """A copy of `mha` with another (static) head count."""
    out = copy.copy(mha)
    object.__setattr__(out, "num_heads", num_heads)
    return out


class ParallelMultiheadAttention(eqx.Module):
    """`eqx.nn.MultiheadAttention` with its heads split over `comm`.

    Same call signature and results as `eqx.nn.MultiheadAttention`: replicated
    `(q_seq, query_size)`, `(kv_seq, key_size)`, `(kv_seq, value_size)` ->
    replicated `(q_seq, output_size)`. Each rank holds `num_heads / size` heads: the
    query/key/value projections are column-parallel (inputs marked `use_replicated`),
    the output projection row-parallel (one `sum_replicated`).
    Transpose: one allreduce per projection input backward, none for the output.
    """

    local: eqx.nn.MultiheadAttention  # this rank's heads, with parallel projections
    num_heads: int = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, num_heads: int, query_size: int, *, comm=None,
                 key: PRNGKeyArray | None = None,
                 dense: eqx.nn.MultiheadAttention | None = None, **kwargs):
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.ParallelMultiheadAttention: pass `key=` or use "
                                 "`from_dense`")
            dense = eqx.nn.MultiheadAttention(num_heads, query_size, key=key, **kwargs)
        self.comm = comm_ref(comm, "ParallelMultiheadAttention")
        if dense.num_heads % self.comm.size:
            raise ValueError(
                f"vjpmpi.nn.ParallelMultiheadAttention: num_heads={dense.num_heads} is not "
                f"divisible by the communicator size {self.comm.size}"
            )
        self.num_heads = dense.num_heads
        local = _with_num_heads(dense, dense.num_heads // self.comm.size)
        c = self.comm.comm
        self.local = eqx.tree_at(
            lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj), local, (
                ColumnParallelLinear.from_dense(dense.query_proj, c),
                ColumnParallelLinear.from_dense(dense.key_proj, c),
                ColumnParallelLinear.from_dense(dense.value_proj, c),
                RowParallelLinear.from_dense(dense.output_proj, c, input_is_parallel=True),
            ))

    @classmethod
    def from_dense(cls, layer: eqx.nn.MultiheadAttention, comm=None):
        """Split the heads of a standard `eqx.nn.MultiheadAttention` (same on every rank)."""
        return cls(layer.num_heads, layer.query_size, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.MultiheadAttention:
        """Gather the heads back into an `eqx.nn.MultiheadAttention` on every rank."""
        m = self.local
        dense = _with_num_heads(m, self.num_heads)
        return eqx.tree_at(
            lambda t: (t.query_proj, t.key_proj, t.value_proj, t.output_proj), dense,
            (m.query_proj.to_dense(), m.key_proj.to_dense(), m.value_proj.to_dense(),
             m.output_proj.to_dense()))

    def __call__(self, query: Float[Array, "q_seq q_size"], key_: Float[Array, "kv_seq k_size"],
                 value: Float[Array, "kv_seq v_size"], mask=None, *, key=None, inference=None,
                 **kwargs) -> Float[Array, "q_seq o_size"]:
        return self.local(query, key_, value, mask, key=key, inference=inference, **kwargs)


