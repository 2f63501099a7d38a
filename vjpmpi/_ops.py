"""The collectives: one `Collective` spec each, and the public functions.

Signatures, positional arguments and forward results follow mpi4jax 0.9, so
`import vjpmpi as mpi4jax` works for existing code.  `comm=None` means
vjpmpi's private duplicate of `COMM_WORLD`.
"""

from __future__ import annotations

import operator
from typing import Any

import jax.numpy as jnp
from jax._src import core
from mpi4py import MPI

from ._collective import Collective, bind, make_primitive
from ._mpi import as_comm, as_red, check_dtype, check_red_dtype

__all__ = [
    "allreduce", "reduce", "bcast", "allgather", "gather", "scatter", "alltoall",
    "reduce_scatter", "scan", "exscan", "send", "recv", "sendrecv", "barrier",
]


# ------------------------------------------------------------ the specs --
def _like(i):
    return lambda params, *avals: [avals[i]]


def _with_shape(aval, shape):
    return core.ShapedArray(shape, aval.dtype, weak_type=aval.weak_type)


def _is_root(params):
    return params["comm"].rank == params["root"]


def _gather_out(params, x):
    return [_with_shape(x, (params["comm"].size, *x.shape))] if _is_root(params) else [x]


def _scatter_out(params, x):
    return [_with_shape(x, x.shape[1:])] if _is_root(params) else [x]


SPECS = {
    spec.name: spec
    for spec in [
        Collective("allreduce", _like(0), alias=(0, 0)),
        Collective("reduce", _like(0), alias=(0, 0)),
        Collective("bcast", _like(0), alias=(0, 0)),
        Collective(
            "allgather",
            lambda p, x: [_with_shape(x, (p["comm"].size, *x.shape))],
            rank_axis=lambda p: (False, True),
        ),
        Collective("gather", _gather_out, alias=(0, 0), rank_axis=lambda p: (False, _is_root(p))),
        Collective("scatter", _scatter_out, alias=(0, 0), rank_axis=lambda p: (_is_root(p), False)),
        Collective("alltoall", _like(0), alias=(0, 0), rank_axis=lambda p: (True, True)),
        Collective(
            "reduce_scatter",
            lambda p, x: [_with_shape(x, x.shape[1:])],
            rank_axis=lambda p: (True, False),
        ),
        Collective("scan", _like(0), alias=(0, 0)),
        Collective("exscan", _like(0), alias=(0, 0)),
        Collective("send", lambda p, x: []),
        Collective("recv", _like(0), alias=(0, 0)),
        Collective("sendrecv", _like(1), alias=(1, 0)),
        Collective("barrier", lambda p: []),
    ]
}
PRIMITIVES = {name: make_primitive(spec) for name, spec in SPECS.items()}


# ------------------------------------------------------------ validation --
def _array(x: Any, op: str, arg: str = "x"):
    try:
        x = jnp.asarray(x)
    except TypeError as err:
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' must be an array, got {type(x).__name__}") from err
    check_dtype(x.dtype, op, arg)
    return x


def _int(value: Any, op: str, arg: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"vjpmpi.{op}: argument '{arg}' must be a Python int, got {type(value).__name__}"
        ) from None


def _rank(value: Any, comm, op: str, arg: str, special: dict[int, str] | None = None) -> int:
    """A rank of `comm` (or one of the `special` MPI constants) for argument `arg`."""
    special = special or {}
    r = _int(value, op, arg)
    if r in special or 0 <= r < comm.size:
        return r
    allowed = "".join(f" or MPI.{name}" for name in special.values())
    raise ValueError(
        f"vjpmpi.{op}: argument '{arg}'={r} is outside the communicator "
        f"(size {comm.size}: expected 0..{comm.size - 1}{allowed})"
    )


def _tag(value: Any, op: str, arg: str, any_ok: bool = False) -> int:
    t = _int(value, op, arg)
    if (any_ok and t == MPI.ANY_TAG) or 0 <= t <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB):
        return t
    raise ValueError(
        f"vjpmpi.{op}: argument '{arg}'={t} is not a valid tag "
        f"(expected 0..MPI.TAG_UB{' or MPI.ANY_TAG' if any_ok else ''})"
    )


def _status(status: Any, op: str) -> int:
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(
            f"vjpmpi.{op}: argument 'status' must be an mpi4py MPI.Status or None, "
            f"got {type(status).__name__}"
        )
    return MPI._addressof(status)


def _rank_axis(x, comm, op: str) -> None:
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(
            f"vjpmpi.{op}: argument 'x' must have a leading axis of length comm size "
            f"{comm.size}, got shape {tuple(x.shape)}"
        )


_PEER = {MPI.PROC_NULL: "PROC_NULL"}
_SOURCE = {MPI.PROC_NULL: "PROC_NULL", MPI.ANY_SOURCE: "ANY_SOURCE"}


def _reduction(name: str, x, op, comm):
    x = _array(x, name)
    c = as_comm(comm, name)
    red = check_red_dtype(as_red(op, name), x.dtype, name)
    (y,) = bind(PRIMITIVES[name], [x], c, red=red)
    return y


# -------------------------------------------------------- public functions --
def allreduce(x, op, *, comm=None):
    """Reduce `x` over all ranks with `op`; every rank gets the result.

    Shape: `x` of shape `s` -> shape `s` on every rank.
    Transpose (SUM): allreduce(SUM) of the cotangents.
    """
    return _reduction("allreduce", x, op, comm)


def reduce(x, op, root, *, comm=None):
    """Reduce `x` over all ranks with `op` onto `root`; other ranks get `x` back unchanged.

    Shape: `s` -> `s` on every rank.
    Transpose (SUM): bcast from `root` (plus the identity on non-root ranks).
    """
    x = _array(x, "reduce")
    c = as_comm(comm, "reduce")
    red = check_red_dtype(as_red(op, "reduce"), x.dtype, "reduce")
    (y,) = bind(PRIMITIVES["reduce"], [x], c, red=red, root=_rank(root, c, "reduce", "root"))
    return y


def bcast(x, root, *, comm=None):
    """Broadcast `root`'s `x` to every rank (other ranks' `x` is a shape/dtype template).

    Shape: `s` -> `s` on every rank.
    Transpose: reduce(SUM) onto `root`.
    """
    x = _array(x, "bcast")
    c = as_comm(comm, "bcast")
    (y,) = bind(PRIMITIVES["bcast"], [x], c, root=_rank(root, c, "bcast", "root"))
    return y


def allgather(x, *, comm=None):
    """Gather every rank's `x` onto every rank, stacked in rank order.

    Shape: `s` -> `(size, *s)` on every rank.
    Transpose: reduce_scatter(SUM).
    """
    x = _array(x, "allgather")
    (y,) = bind(PRIMITIVES["allgather"], [x], as_comm(comm, "allgather"))
    return y


def gather(x, root, *, comm=None):
    """Gather every rank's `x` onto `root`, stacked in rank order; others get `x` back.

    Shape: `s` -> `(size, *s)` on `root`, `s` elsewhere.
    Transpose: scatter from `root`.
    """
    x = _array(x, "gather")
    c = as_comm(comm, "gather")
    (y,) = bind(PRIMITIVES["gather"], [x], c, root=_rank(root, c, "gather", "root"))
    return y


def scatter(x, root, *, comm=None):
    """Send block `r` of `root`'s `x` to rank `r`.

    Shape: on `root` `(size, *s)` -> `s`; elsewhere `x` is an `s`-shaped template -> `s`.
    Transpose: gather onto `root`.
    """
    x = _array(x, "scatter")
    c = as_comm(comm, "scatter")
    root = _rank(root, c, "scatter", "root")
    if c.rank == root:
        _rank_axis(x, c, "scatter")
    (y,) = bind(PRIMITIVES["scatter"], [x], c, root=root)
    return y


def alltoall(x, *, comm=None):
    """Send block `j` of `x` to rank `j`; block `i` of the result comes from rank `i`.

    Shape: `(size, *s)` -> `(size, *s)`.
    Transpose: alltoall.
    """
    x = _array(x, "alltoall")
    c = as_comm(comm, "alltoall")
    _rank_axis(x, c, "alltoall")
    (y,) = bind(PRIMITIVES["alltoall"], [x], c)
    return y


def reduce_scatter(x, op, *, comm=None):
    """Reduce `x` over ranks with `op`; rank `r` gets block `r` of the reduction.

    Shape: `(size, *s)` -> `s`.
    Transpose (SUM): allgather.
    """
    x = _array(x, "reduce_scatter")
    c = as_comm(comm, "reduce_scatter")
    _rank_axis(x, c, "reduce_scatter")
    red = check_red_dtype(as_red(op, "reduce_scatter"), x.dtype, "reduce_scatter")
    (y,) = bind(PRIMITIVES["reduce_scatter"], [x], c, red=red)
    return y


def scan(x, op, *, comm=None):
    """Inclusive prefix reduction: rank `r` gets `op` over the `x` of ranks `0..r`.

    Shape: `s` -> `s`.
    Transpose (SUM): inclusive suffix sum over ranks.
    """
    return _reduction("scan", x, op, comm)


def exscan(x, op, *, comm=None):
    """Exclusive prefix reduction over ranks `0..r-1`; rank 0 gets the identity of `op`.

    Shape: `s` -> `s`.
    Transpose (SUM): exclusive suffix sum over ranks.
    """
    return _reduction("exscan", x, op, comm)


def send(x, dest, *, tag=0, comm=None):
    """Send `x` to rank `dest` (blocking standard-mode send). Returns None.

    Shape: `s` -> nothing.
    Transpose: recv from `dest`.
    """
    x = _array(x, "send")
    c = as_comm(comm, "send")
    bind(
        PRIMITIVES["send"], [x], c,
        peer=_rank(dest, c, "send", "dest", _PEER), tag=_tag(tag, "send", "tag"),
    )


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None):
    """Receive an array shaped like the template `x` from `source`.

    Shape: template `s` -> `s`.  `status` (an `MPI.Status`) is filled on completion.
    Transpose: send to `source`.
    """
    x = _array(x, "recv")
    c = as_comm(comm, "recv")
    (y,) = bind(
        PRIMITIVES["recv"], [x], c,
        peer2=_rank(source, c, "recv", "source", _SOURCE),
        tag2=_tag(tag, "recv", "tag", any_ok=True), status=_status(status, "recv"),
    )
    return y


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    Shape: (`s`, template `t`) -> `t`.
    Transpose: sendrecv with `source` and `dest` swapped.
    """
    sendbuf = _array(sendbuf, "sendrecv", "sendbuf")
    recvbuf = _array(recvbuf, "sendrecv", "recvbuf")
    if sendbuf.dtype != recvbuf.dtype:
        raise TypeError(
            f"vjpmpi.sendrecv: arguments 'sendbuf' ({sendbuf.dtype}) and 'recvbuf' "
            f"({recvbuf.dtype}) must have the same dtype"
        )
    c = as_comm(comm, "sendrecv")
    (y,) = bind(
        PRIMITIVES["sendrecv"], [sendbuf, recvbuf], c,
        peer=_rank(dest, c, "sendrecv", "dest", _PEER),
        peer2=_rank(source, c, "sendrecv", "source", _SOURCE),
        tag=_tag(sendtag, "sendrecv", "sendtag"),
        tag2=_tag(recvtag, "sendrecv", "recvtag", any_ok=True),
        status=_status(status, "sendrecv"),
    )
    return y


def barrier(*, comm=None):
    """Block until every rank of `comm` has reached the barrier. Returns None.

    Transpose: barrier (it carries no data).
    """
    bind(PRIMITIVES["barrier"], [], as_comm(comm, "barrier"))
