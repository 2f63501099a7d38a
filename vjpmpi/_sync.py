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
    """Block until every rank of `comm` has reached the barrier. Returns None.

    Transpose: barrier (it carries no data).
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
define(Collective("hold", like(0), alias=(0, 0), transpose=partner("hold"),
                  point_to_point=True))


def hold(x, comm):
    """`x` as it is at this point of the program's order on `comm` (a private identity
    that XLA's fusion cannot cross; no message). Shape: x's. Transpose: hold."""
    (y,) = bind(PRIMITIVES["hold"], [x], as_comm(comm, "hold"))
    return y


def fence(tree, *, comm=None):
    """The arrays of `tree` as they are at this point of the program's order: XLA computes
    them before every later vjpmpi call (a `wait`, say), and what it computes from the
    result after every earlier one (a `start`); nothing is fused across. No message.

    Shape: `tree` -> the same tree. Transpose: fence.
    """
    c = as_comm(comm, "fence")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [hold(array(a, "fence", "tree"), c) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)
