"""Argument checks at the public edge: arrays and their dtypes, ranks, tags, receive
statuses, a leading rank axis. Each error names the op, the argument, what was
expected and what was given.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import _kernels
from ._mpi import DeviceCommRef, check_dtype


def array(x: Any, op: str, arg: str = "x"):
    if isinstance(x, jax.Array):  # already a JAX array (or tracer): no conversion
        check_dtype(x.dtype, op, arg)
        return x
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.kind in "OSUMm":
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' has dtype {dtype}, which MPI cannot "
                        f"carry (use a bool, integer, float or complex array)")
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' must be an array or convertible to one, "
                        f"got {type(x).__name__} ({err})") from err
    check_dtype(x.dtype, op, arg)
    return x


def as_int(value: Any, op: str, arg: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"vjpmpi.{op}: argument '{arg}' must be a Python int, got {type(value).__name__}"
        ) from None


def rank(value: Any, comm, op: str, arg: str, special: dict[int, str] | None = None) -> int:
    """A rank of `comm` (or one of the `special` MPI constants) for argument `arg`; on a
    device communicator also a traced int scalar (each device's own: checked when it runs)."""
    special = special or {}
    device = isinstance(comm, DeviceCommRef)
    if device and isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.integer):
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"vjpmpi.{op}: argument '{arg}' must be an int or an integer "
                            f"scalar, got {value.dtype}{list(value.shape)}")
        return value
    if device and MPI.ANY_SOURCE in special and value == MPI.ANY_SOURCE:
        raise ValueError(f"vjpmpi.{op}: argument '{arg}'=MPI.ANY_SOURCE on a device "
                         "communicator: name the rank it receives from")
    r = as_int(value, op, arg)
    if r in special or 0 <= r < comm.size:
        return r
    allowed = "".join(f" or MPI.{name}" for name in special.values())
    raise ValueError(
        f"vjpmpi.{op}: argument '{arg}'={r} is outside the communicator "
        f"(size {comm.size}: expected 0..{comm.size - 1}{allowed})"
    )


def check_tag(value: Any, op: str, arg: str, any_ok: bool = False) -> int:
    t = as_int(value, op, arg)
    if (any_ok and t == MPI.ANY_TAG) or 0 <= t <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB):
        return t
    raise ValueError(
        f"vjpmpi.{op}: argument '{arg}'={t} is not a valid tag "
        f"(expected 0..MPI.TAG_UB{' or MPI.ANY_TAG' if any_ok else ''})"
    )


# Receive statuses: a program names an `MPI.Status` by a slot number (never reused), not
# by its address, and the kernels fill the slot's status only while the object is alive.
_STATUS_SLOTS: dict[int, int] = {}  # id(status) -> slot, while it lives
_next_slot = itertools.count(1)


def _release_status(key: int, slot: int) -> None:
    _STATUS_SLOTS.pop(key, None)
    _kernels.cpu.release_status(slot)


def check_status(status: Any, op: str) -> int:
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(
            f"vjpmpi.{op}: argument 'status' must be an mpi4py MPI.Status or None, "
            f"got {type(status).__name__}"
        )
    slot = _STATUS_SLOTS.get(id(status))
    if slot is None:
        slot = _STATUS_SLOTS[id(status)] = next(_next_slot)
        _kernels.cpu.register_status(slot, MPI._addressof(status))
        weakref.finalize(status, _release_status, id(status), slot)
    return slot


def check_rank_axis(x, comm, op: str) -> None:
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(
            f"vjpmpi.{op}: argument 'x' must have a leading axis of length comm size "
            f"{comm.size}, got shape {tuple(x.shape)}"
        )


PEER = {MPI.PROC_NULL: "PROC_NULL"}
SOURCE = {MPI.PROC_NULL: "PROC_NULL", MPI.ANY_SOURCE: "ANY_SOURCE"}
