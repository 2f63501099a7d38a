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

    What enters a tensor-parallel region in Megatron-LM's sequence-parallel mode.

    Args:
        x (Array): this rank's block of the sequence, `(seq // size, ...)`, the same
            shape and dtype on every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            (None: vjpmpi's private duplicate of COMM_WORLD; a `vjpmpi.device_comm` inside a
            `jax.shard_map` body: its devices are the ranks).

    Returns:
        The whole sequence, `(seq, ...)`, the same on every rank.

    Raises:
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.
        ValueError: when run, on every rank, where the ranks' blocks
            differ in shape or dtype (vjpmpi's agreement on the allgather).

    Shape:
        `(seq // size, ...)` -> `(seq, ...)` on every rank.

    Transpose:
        `scatter_sequence_sum` (reduce_scatter(SUM) of the cotangents).

    Example:
        ```python
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi, vjpmpi.nn as vnn

        rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        block = jnp.full((2, 3), float(rank))       # this rank's 2 positions of the sequence
        full = vnn.gather_sequence(block)           # (2 * size, 3), the same on every rank
        assert full.shape == (2 * size, 3) and jnp.all(full[2 * rank:2 * rank + 2] == rank)
        back = vnn.scatter_sequence_sum(full)       # the sum of size copies, this rank's block
        assert jnp.allclose(back, size * block)
        ```
    """
    ref = comm_ref(comm, "gather_sequence")
    return allgather(x, comm=ref).reshape(-1, *x.shape[1:])


def scatter_sequence_sum(x: Float[Array, "seq ..."], comm=None) -> Float[Array, "seq_block ..."]:
    """The sum over ranks of `x`, of which each rank keeps its block of the sequence.

    A reduce_scatter: what replaces the allreduce after a row-parallel layer in
    Megatron-LM's sequence-parallel mode.

    Args:
        x (Array): this rank's term, `(seq, ...)`, `seq` divisible by the
            communicator's size; the same shape and dtype on every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            (None: vjpmpi's private duplicate of COMM_WORLD; a `vjpmpi.device_comm` inside a
            `jax.shard_map` body: its devices are the ranks).

    Returns:
        Block `rank` of the sum over the ranks, `(seq // size, ...)`.

    Raises:
        ValueError: `seq` (`x.shape[0]`) is not divisible by the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        `(seq, ...)` -> `(seq // size, ...)` on each rank.

    Transpose:
        `gather_sequence`.
    """
    ref = comm_ref(comm, "scatter_sequence_sum")
    if x.shape[0] % ref.size:
        raise ValueError(
            f"vjpmpi.nn.scatter_sequence_sum: a sequence of length {x.shape[0]} is not "
            f"divisible by the communicator size {ref.size}")
    return reduce_scatter(x.reshape(ref.size, -1, *x.shape[1:]), SUM, comm=ref)


def replicated(module, comm=None):
    """`module` with every inexact array marked by `use_replicated`.

    For replicated parameters that each rank applies to its own block (LayerNorm in a
    sequence-parallel region), so that their gradients sum over the ranks.

    Args:
        module (PyTree): a pytree (an `eqx.Module`), the same on every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            (None: vjpmpi's private duplicate of COMM_WORLD; a `vjpmpi.device_comm` inside a
            `jax.shard_map` body: its devices are the ranks).

    Returns:
        (PyTree): `module` with the same values, each inexact-array leaf marked by
            `use_replicated` (other leaves unchanged).

    Raises:
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        the module, unchanged (the identity forward).

    Transpose:
        allreduce(SUM) of each array's cotangent.
    """
    ref = comm_ref(comm, "replicated")
    return jax.tree_util.tree_map(
        lambda a: use_replicated(a, comm=ref) if eqx.is_inexact_array(a) else a, module)
