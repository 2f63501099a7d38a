"""Collectives that move no data: barrier, the ranks' agreement on a composite's global
shape (`agree_on`), and holding values at a point of the program's order (`hold`,
`fence`); each op's spec and public function together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._bind import bind
from ._derive import define, partner
from ._mpi import as_comm
from ._primitive import PRIMITIVES, Collective, like
from ._validate import array

__all__ = ["barrier", "agree_on", "hold", "fence"]


# ------------------------------------------------------------------ barrier --
define(Collective("barrier", lambda p: []))


def barrier(*, comm=None):
    """Block until every rank of `comm` has reached the barrier.

    MPI_Barrier. It carries no data, so it has nothing to differentiate.

    Args:
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (None): nothing.

    Raises:
        TypeError: when `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (its place in their sequence).

    Shape:
        nothing -> nothing.

    Transpose:
        barrier (it carries no data).
    """
    bind(PRIMITIVES["barrier"], [], as_comm(comm, "barrier"))


# -------------------------------------------------------------------- agree --
# No data moves, the ranks agree on a zero-size array's shape and dtype (a composite's
# global array: vjpmpi.fft); transpose: itself.
define(Collective("agree", like(0), transpose=partner("agree")))


def agree_on(shape, dtype, comm, op: str, *, note: str, invalid: str | None = None) -> None:
    """Every rank of `comm` must pass the same global `shape` and `dtype` here (a collective
    with no data: the ranks' agreement compares them before the composite's first data
    moves); `note` describes this rank's view in the message, `invalid` refuses (every
    rank fails). For composites whose global shape each rank infers from its own block."""
    c = as_comm(comm, op)
    if c.size == 1:
        if invalid is not None:
            raise ValueError(invalid)
        return
    x = jnp.zeros((*shape, 0), dtype)
    bind(PRIMITIVES["agree"], [x], c, invalid=invalid, note=note)


# --------------------------------------------------------------- hold, fence --
# The identity at this point of the program's order (no MPI call, no trace, never
# asynchronous), opaque to XLA's fusion: vjpmpi.nn's pipeline holds values there;
# transpose: itself. (Pairs with nothing: no part in the agreement.)
define(Collective("hold", like(0), alias=(0, 0), transpose=partner("hold"), local=True,
                  point_to_point=True))


def hold(x, comm):
    """`x` as it is at this point of the program's order on `comm` (a private identity
    that XLA's fusion cannot cross; no message). Shape: x's. Transpose: hold."""
    (y,) = bind(PRIMITIVES["hold"], [x], as_comm(comm, "hold"))
    return y


def fence(tree, *, comm=None):
    """The arrays of `tree` as they are at this point of the program's order.

    XLA computes them before every later vjpmpi call (a `wait`, say), and what it computes
    from the result after every earlier one (a `start`); nothing is fused across. No
    message: no MPI call is made and the ranks need not agree on it. Use it around the
    computation that should overlap a started call (`vjpmpi.start`).

    Args:
        tree (Any): a pytree of arrays (or values convertible to arrays, of dtypes MPI can
            carry).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (Any): The same tree, each leaf the array it held (same shape and dtype).

    Raises:
        TypeError: when a leaf of `tree` is not an array (or convertible to one) of a dtype
            MPI can carry, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, or when called from inside a host
            callback.

    Shape:
        `tree` -> the same tree.

    Transpose:
        fence.
    """
    c = as_comm(comm, "fence")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [hold(array(a, "fence", "tree"), c) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)
