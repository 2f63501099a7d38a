"""Shared helpers: block partitions of a feature axis over a communicator."""

from __future__ import annotations

import jax.numpy as jnp

from .._mpi import CommRef, as_comm
from .._ops import allgather


def comm_ref(comm, layer: str) -> CommRef:
    return as_comm(comm, f"nn.{layer}")


def block(n: int, ref: CommRef, layer: str, what: str) -> tuple[int, int]:
    """[start, stop) of this rank's block of `n` features; n must divide evenly."""
    if n % ref.size:
        raise ValueError(
            f"vjpmpi.nn.{layer}: {what}={n} is not divisible by the communicator size "
            f"{ref.size}; choose a size that divides it"
        )
    k = n // ref.size
    return ref.rank * k, (ref.rank + 1) * k


def gather_blocks(x, ref: CommRef, axis: int):
    """Concatenate every rank's `x` along `axis` (eager helper for to_dense)."""
    stacked = allgather(x, comm=ref.comm)
    return jnp.concatenate(list(stacked), axis=axis)
