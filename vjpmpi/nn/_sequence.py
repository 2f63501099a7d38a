"""Sequence parallelism (Megatron-LM's sequence-parallel mode): activations outside
the tensor-parallel layers are split along the sequence."""

from __future__ import annotations

import equinox as eqx
import jax
from jaxtyping import Array, Float

from .._mpi import SUM
from .._movement import allgather
from .._reductions import reduce_scatter
from .._replicated import use_replicated
from ._shard import comm_ref


def gather_sequence(x: Float[Array, "seq_block ..."], comm=None) -> Float[Array, "seq ..."]:
    """Every rank's block of the sequence, concatenated in rank order (an allgather).

    Shape: `(seq / size, ...)` -> `(seq, ...)` on every rank.
    Transpose: `scatter_sequence_sum` (reduce_scatter(SUM) of the cotangents).
    """
    ref = comm_ref(comm, "gather_sequence")
    return allgather(x, comm=ref).reshape(-1, *x.shape[1:])


def scatter_sequence_sum(x: Float[Array, "seq ..."], comm=None) -> Float[Array, "seq_block ..."]:
    """The sum over ranks of `x`, of which each rank keeps its block of the sequence
    (a reduce_scatter: what replaces the allreduce after a row-parallel layer).

    Shape: `(seq, ...)` (seq divisible by the size) -> `(seq / size, ...)`.
    Transpose: `gather_sequence`.
    """
    ref = comm_ref(comm, "scatter_sequence_sum")
    if x.shape[0] % ref.size:
        raise ValueError(
            f"vjpmpi.nn.scatter_sequence_sum: a sequence of length {x.shape[0]} is not "
            f"divisible by the communicator size {ref.size}")
    return reduce_scatter(x.reshape(ref.size, -1, *x.shape[1:]), SUM, comm=ref)


def replicated(module, comm=None):
    """`module` with every inexact array marked by `use_replicated`: replicated
    parameters that each rank applies to its own block (LayerNorm in a
    sequence-parallel region), so that their gradients sum over the ranks.

    Shape: the module, unchanged (the identity forward).
    Transpose: allreduce(SUM) of each array's cotangent.
    """
    ref = comm_ref(comm, "replicated")
    return jax.tree_util.tree_map(
        lambda a: use_replicated(a, comm=ref) if eqx.is_inexact_array(a) else a, module)
