"""Data movement between ranks: bcast, allgather, gather, scatter, alltoall; each op's
spec, transpose and public function together. All are linear: a JVP is the op on the
tangents, a transpose the adjoint of the global linear map (the dual collective).

Signatures, positional arguments and forward results follow mpi4jax 0.9, so
`import vjpmpi as mpi4jax` works for existing code.  `comm=None` means
vjpmpi's private duplicate of `COMM_WORLD`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._bind import bind, refuse_here
from ._derive import call, define, partner
from ._mpi import SUM, DeviceCommRef, as_comm
from ._primitive import PRIMITIVES, Collective, is_root, like, with_shape
from ._rules import device_comm, on_root
from ._validate import array, check_rank_axis, rank

__all__ = ["bcast", "allgather", "gather", "scatter", "alltoall"]

_ROOT = {"root": "root"}


# -------------------------------------------------------------------- bcast --
def _t_bcast(cts, args, p):  # y_r = x_root everywhere; other ranks' x unused
    (ct,) = cts
    total = call("reduce", ct, p, red=SUM)  # a collective: every rank takes part
    return [on_root(p, total, jnp.zeros_like(ct))]


define(Collective("bcast", like(0), _ROOT, alias=(0, 0), transpose=_t_bcast))


def bcast(x, root, *, comm=None):
    """Broadcast `root`'s `x` to every rank (other ranks' `x` is a shape/dtype template).

    MPI_Bcast. Linear: its JVP is the bcast of the tangents.

    Args:
        x (ArrayLike): on `root`, the array to send; elsewhere a template of the same
            shape and dtype (its values are not used).
        root (int | jax.Array): the rank that sends.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): `root`'s `x`, on every rank.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `root` is not an int, or `comm` is not an mpi4py intracommunicator or
            None.
        ValueError: when `root` is outside the communicator, or `comm` is `MPI.COMM_NULL` or
            freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        reduce(SUM) onto `root` (the other ranks' templates get a zero cotangent).

    Example:
        ```python
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r = MPI.COMM_WORLD.Get_rank()
        x = jnp.arange(3.0) if r == 0 else jnp.zeros(3)  # elsewhere: a template
        y = vjpmpi.bcast(x, 0)
        assert (y == jnp.arange(3.0)).all()  # on every rank
        ```
    """
    x = array(x, "bcast")
    c = as_comm(comm, "bcast")
    (y,) = bind(PRIMITIVES["bcast"], [x], c, root=rank(root, c, "bcast", "root"))
    return y


# ---------------------------------------------------------------- allgather --
define(Collective("allgather", lambda p, x: [with_shape(x, (p["comm"].size, *x.shape))],
                  rank_axis=lambda p: (False, True),
                  transpose=partner("reduce_scatter", red=SUM)))


def allgather(x, *, comm=None):
    """Gather every rank's `x` onto every rank, stacked in rank order.

    MPI_Allgather. Linear: its JVP is the allgather of the tangents.

    Args:
        x (ArrayLike): this rank's block, any shape (the same on every rank).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): Every rank's `x` stacked on a new leading axis, in rank order (row `i`
            from rank `i`), on every rank; `x`'s dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `(size, *s)` on every rank.

    Transpose:
        reduce_scatter(SUM).

    Example:
        ```python
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r = MPI.COMM_WORLD.Get_rank()
        y = vjpmpi.allgather(jnp.full(2, float(r)))
        assert y.shape == (2, 2)  # at 2 ranks: (size, 2)
        assert (y[0] == 0.0).all() and (y[1] == 1.0).all()  # row i from rank i
        ```
    """
    x = array(x, "allgather")
    (y,) = bind(PRIMITIVES["allgather"], [x], as_comm(comm, "allgather"))
    return y


# ------------------------------------------------------------------- gather --
def _stacked(params) -> bool:
    """Whether this rank's gather result (scatter operand) is stacked over the ranks: the
    root's; every device's on a device communicator (one shape for all: zeros off the
    root)."""
    return device_comm(params) or is_root(params)


def _gather_out(params, x):
    return [with_shape(x, (params["comm"].size, *x.shape))] if _stacked(params) else [x]


def _t_gather(cts, args, p):  # y_root = stack(x_s), y_r = x_r elsewhere (devices: 0)
    (ct,) = cts
    block = call("scatter", ct, p)
    return [block if device_comm(p) or is_root(p) else block + ct]


define(Collective("gather", _gather_out, _ROOT, alias=(0, 0),
                  rank_axis=lambda p: (False, _stacked(p)), transpose=_t_gather))


def gather(x, root, *, comm=None):
    """Gather every rank's `x` onto `root`, stacked in rank order; others get `x` back.

    MPI_Gather. Linear: its JVP is the gather of the tangents.

    Args:
        x (ArrayLike): this rank's block, any shape (the same on every rank).
        root (int | jax.Array): the rank that receives.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): On `root`, every rank's `x` stacked on a new leading axis in rank
            order; elsewhere `x` itself (on a device communicator, zeros of the stacked
            shape: every device has one shape). `x`'s dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `root` is not an int, or `comm` is not an mpi4py intracommunicator or
            None.
        ValueError: when `root` is outside the communicator, or `comm` is `MPI.COMM_NULL` or
            freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `(size, *s)` on `root`, `s` elsewhere (a device communicator: `(size, *s)`
        on every device).

    Transpose:
        scatter from `root` (plus the identity on non-root ranks).
    """
    x = array(x, "gather")
    c = as_comm(comm, "gather")
    (y,) = bind(PRIMITIVES["gather"], [x], c, root=rank(root, c, "gather", "root"))
    return y


# ------------------------------------------------------------------ scatter --
def _scatter_out(params, x):  # (a refused root's input may lack the rank axis)
    return [with_shape(x, x.shape[1:])] if _stacked(params) and x.ndim else [x]


def _t_scatter(cts, args, p):  # y_r = x_root[r]; other ranks' x is a template
    (ct,) = cts
    g = call("gather", ct, p)  # (devices: zeros off the root already)
    return [g if _stacked(p) else jnp.zeros(args[0].aval.shape, args[0].aval.dtype)]


define(Collective("scatter", _scatter_out, _ROOT, alias=(0, 0),
                  rank_axis=lambda p: (_stacked(p), False), transpose=_t_scatter))


def scatter(x, root, *, comm=None) -> jax.Array:
    """Send block `r` of `root`'s `x` to rank `r`.

    MPI_Scatter. Linear: its JVP is the scatter of the tangents.

    Args:
        x (ArrayLike): on `root`, the blocks stacked on a leading axis of the
            communicator's size; elsewhere a template of one block's shape and dtype (on a
            device communicator every device passes the stacked shape; only the root's
            values are sent).
        root (int | jax.Array): the rank that sends.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): This rank's block of `root`'s `x`, with the template's shape and dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `root` is not an int, or `comm` is not an mpi4py intracommunicator or
            None.
        ValueError: when `root` is outside the communicator, `comm` is `MPI.COMM_NULL` or
            freed, or, on `root` only, at trace time, `x` has no leading axis of the
            communicator's size (only the root can check it: the ranks that wait in the
            scatter for it stop with the same message).
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, root, or its place in their sequence).

    Shape:
        On `root` `(size, *s)` -> `s`; elsewhere `x` is an `s`-shaped template -> `s` (a
        device communicator: `(size, *s)` -> `s` on every device).

    Transpose:
        gather onto `root` (the other ranks' templates get a zero cotangent).
    """
    x = array(x, "scatter")
    c = as_comm(comm, "scatter")
    root = rank(root, c, "scatter", "root")
    # Only the root can check its input: it raises here, and the ranks that wait in the
    # scatter for it stop there with its message (`_bind.refuse_here`).
    if isinstance(c, DeviceCommRef):  # (every device passes the stacked shape)
        check_rank_axis(x, c, "scatter")
    elif c.rank == root and (x.ndim == 0 or x.shape[0] != c.size):
        refuse_here(c, "scatter", f"argument 'x' on the root (rank {root}) must have a "
                    f"leading axis of length comm size {c.size}, got shape {tuple(x.shape)}",
                    root=root)
    (y,) = bind(PRIMITIVES["scatter"], [x], c, root=root)
    return y


# ----------------------------------------------------------------- alltoall --
define(Collective("alltoall", like(0), alias=(0, 0), rank_axis=lambda p: (True, True),
                  transpose=partner("alltoall")))


def alltoall(x, *, comm=None):
    """Send block `j` of `x` to rank `j`; block `i` of the result comes from rank `i`.

    MPI_Alltoall. Linear: its JVP is the alltoall of the tangents.

    Args:
        x (ArrayLike): the blocks for each rank stacked on a leading axis whose length is
            the communicator's size.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): The blocks received, stacked in source-rank order: row `i` is rank
            `i`'s `x[r]`; `x`'s shape and dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `x` has no leading axis of the communicator's size, or `comm` is
            `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, root, or its place in their sequence).

    Shape:
        `(size, *s)` -> `(size, *s)`.

    Transpose:
        alltoall.
    """
    x = array(x, "alltoall")
    c = as_comm(comm, "alltoall")
    check_rank_axis(x, c, "alltoall")
    (y,) = bind(PRIMITIVES["alltoall"], [x], c)
    return y
