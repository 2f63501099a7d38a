"""Point-to-point messages: send, recv, sendrecv; each op's spec, transpose and public
function together, and its "prepare" half: the call's arguments checked and converted,
what `vjpmpi.start` starts instead of binding it.

Transposes: a send's is a receive from its destination, a receive's a send back to its
source, a sendrecv's a sendrecv with the peers swapped. A receive from MPI.ANY_SOURCE
has no derivative (no rank is named to send the cotangent back to).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from mpi4py import MPI

from . import _jax_compat as jc
from ._bind import enter, refusal, run
from ._derive import call, define
from ._mpi import CommRef, as_comm
from ._primitive import DYNAMIC, PRIMITIVES, Collective, like
from ._rules import only_linear, zeros_for
from ._validate import PEER, SOURCE, array, check_status, check_tag, rank

__all__ = ["send", "recv", "sendrecv", "prepare", "Call"]


@dataclasses.dataclass(frozen=True)
class Call:
    """A point-to-point call, checked and ready to bind (`_bind.run`) or start:
    its primitive, operands, communicator and parameters (as `_bind.enter` gave them)."""

    prim: jc.Primitive
    arrays: list
    comm: CommRef
    params: dict

    def run(self) -> list:
        return run(self.prim, self.arrays, self.comm, self.params)


_ANY_SOURCE_REFUSED = (
    "differentiating a receive needs an explicit 'source': with MPI.ANY_SOURCE the "
    "tangent and cotangent messages could pair with another sender's, and no rank is "
    "named to send the cotangent back to")


def _refuse_any_source(p):
    return _ANY_SOURCE_REFUSED if p["source"] == MPI.ANY_SOURCE else None


def _transposed_source(p, op):
    """(the rank a receive's cotangent goes back to, a refusal or 0). A receive from
    MPI.ANY_SOURCE names none: its transpose is a refused send that ends the job when it
    runs (the senders wait for their cotangents; they cannot be told)."""
    if p["source"] == MPI.ANY_SOURCE:
        return MPI.PROC_NULL, refusal(op, _ANY_SOURCE_REFUSED)
    return p["source"], 0


def _back_tag(p, key):
    """The tag a cotangent travels back with: the receive's tag (0 for MPI.ANY_TAG)."""
    return 0 if p[key] == MPI.ANY_TAG else p[key]


# --------------------------------------------------------------------- send --
def _t_send(cts, args, p):  # the cotangent comes back from dest
    (x,) = args
    return [call("recv", zeros_for(x), p, source=p["dest"], tag=MPI.ANY_TAG, status=0)]


define(Collective("send", lambda p, x: [], {"dest": "peer", "tag": "tag"}, transpose=_t_send,
                  point_to_point=True))


def prepare_send(x, dest, *, tag=0, comm=None) -> Call:
    """`send`'s arguments checked and converted: the call, not yet bound."""
    x = array(x, "send")
    c = as_comm(comm, "send")
    prim = PRIMITIVES["send"]
    return Call(prim, [x], c, enter(prim, c, dest=rank(dest, c, "send", "dest", PEER),
                                    tag=check_tag(tag, "send", "tag")))


def send(x, dest, *, tag=0, comm=None):
    """Send `x` to rank `dest` (blocking standard-mode send).

    MPI_Send. Linear: its JVP sends the tangent; in reverse mode the cotangent comes back
    from `dest`, so `dest` must run the matching `recv` (or `sendrecv`) under the same
    transformation.

    Args:
        x (ArrayLike): the array to send, any shape, a dtype MPI can carry.
        dest (int | jax.Array): the receiving rank of `comm`, or `MPI.PROC_NULL` (no message).
        tag (int): the message tag, `0..MPI.TAG_UB`.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (None): nothing.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `dest` or `tag` is not an int, or `comm` is not an mpi4py
            intracommunicator or None.
        ValueError: when `dest` is outside the communicator (and not `MPI.PROC_NULL`),
            `tag` is outside `0..MPI.TAG_UB`, or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, or when called from inside a host
            callback.

    Shape:
        `s` -> nothing.

    Transpose:
        recv from `dest`.
    """
    prepare_send(x, dest, tag=tag, comm=comm).run()


# --------------------------------------------------------------------- recv --
def _t_recv(cts, args, p):  # send the cotangent back to source; PROC_NULL keeps the template
    (ct,) = cts
    source, refused = _transposed_source(p, "recv")
    call("send", ct, p, dest=source, tag=_back_tag(p, "tag"), invalid=refused)
    kept = source == MPI.PROC_NULL and not refused
    return only_linear(args, [ct if kept else jnp.zeros_like(ct)])


define(Collective("recv", like(0), {"source": "peer2", "tag": "tag2", "status": "status"},
                  alias=(0, 0), transpose=_t_recv, point_to_point=True,
                  refuse_derivative=_refuse_any_source))


def prepare_recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None) -> Call:
    """`recv`'s arguments checked and converted: the call, not yet bound."""
    x = array(x, "recv")
    c = as_comm(comm, "recv")
    prim = PRIMITIVES["recv"]
    return Call(prim, [x], c, enter(
        prim, c, source=rank(source, c, "recv", "source", SOURCE),
        tag=check_tag(tag, "recv", "tag", any_ok=True), status=check_status(status, "recv")))


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None):
    """Receive an array shaped like the template `x` from `source`.

    MPI_Recv. Linear: in reverse mode the cotangent goes back to `source` (a send), so
    `source` must run the matching `send` under the same transformation. A receive from
    `MPI.ANY_SOURCE` has no derivative: no rank is named to send the cotangent back to
    (differentiating one ends the job with an error when it runs).

    Args:
        x (ArrayLike): a template of the shape and dtype to receive (its values are not
            sent; with `source=MPI.PROC_NULL` they are the result).
        source (int | jax.Array): the sending rank of `comm`, `MPI.ANY_SOURCE` (the default) or
            `MPI.PROC_NULL` (no message).
        tag (int): the tag to match, `0..MPI.TAG_UB`, or `MPI.ANY_TAG` (the default).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).
        status (MPI.Status | None): if given, filled on completion (source, tag, count).

    Returns:
        (jax.Array): The array received, with `x`'s shape and dtype (`x` itself from
            `MPI.PROC_NULL`).

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `source` or `tag` is not an int, `status` is not an `MPI.Status` or
            None, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `source` is outside the communicator (and not `MPI.ANY_SOURCE`
            or `MPI.PROC_NULL`), `tag` is outside `0..MPI.TAG_UB` (and not
            `MPI.ANY_TAG`), or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, or when called from inside a host
            callback.

    Shape:
        template `s` -> `s`.

    Transpose:
        send to `source`.
    """
    (y,) = prepare_recv(x, source, tag=tag, comm=comm, status=status).run()
    return y


# ----------------------------------------------------------------- sendrecv --
def _t_sendrecv(cts, args, p):  # sendrecv with the peers swapped
    (ct,) = cts
    source, refused = _transposed_source(p, "sendrecv")
    send_ct = call("sendrecv", [ct, _back_template(ct, args[0], p["dest"])], p, dest=source,
                   source=p["dest"], sendtag=_back_tag(p, "recvtag"), recvtag=MPI.ANY_TAG,
                   status=0, invalid=refused)
    kept = source == MPI.PROC_NULL and not refused
    tmpl_ct = ct if kept else jnp.zeros_like(ct)
    return only_linear(args, [send_ct, tmpl_ct])


def _back_template(ct, x, source):
    """The template a transposed sendrecv receives `x`'s cotangent into, from `source`:
    the cotangent itself where the message is sure to fill it (`source` a rank, `x`
    shaped as the cotangent; `_apart` then gives the result a buffer of its own, and
    nothing is filled), else zeros. (A zero template per call is computed where XLA:CPU
    likes, at the start of the compiled backward, all of them live at once: 8 chained
    1 MiB calls took 11 MiB of temporaries with them, 32 calls 34 MiB; 2 MiB without.)"""
    aval = x.aval if jc.is_undefined_primal(x) else x
    if (source not in DYNAMIC and source != MPI.PROC_NULL and ct.shape == aval.shape
            and ct.dtype == aval.dtype):
        return ct
    return zeros_for(x)


def _apart(p):
    """The array sent, where it is its own template, keeps the result apart from it
    (no copy of it), where a message is sure to fill the result: a source that is a rank
    (not MPI.PROC_NULL, nor one computed when the program runs)."""
    source = p["source"]
    return 0 if source not in DYNAMIC and source != MPI.PROC_NULL else None


define(Collective("sendrecv", like(1),
                  {"dest": "peer", "source": "peer2", "sendtag": "tag", "recvtag": "tag2",
                   "status": "status"},
                  alias=(1, 0), alias_apart=_apart, transpose=_t_sendrecv, point_to_point=True,
                  refuse_derivative=_refuse_any_source))


def prepare_sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG,
                     comm=None, status=None, invalid=None) -> Call:
    """`sendrecv`'s arguments checked and converted: the call, not yet bound. `invalid`:
    an argument error found by a caller on this rank only (a refusal, `_bind.enter`: the
    job ends with it when the exchange runs)."""
    sendbuf = array(sendbuf, "sendrecv", "sendbuf")
    recvbuf = array(recvbuf, "sendrecv", "recvbuf")
    if sendbuf.dtype != recvbuf.dtype:
        raise TypeError(
            f"vjpmpi.sendrecv: arguments 'sendbuf' ({sendbuf.dtype}) and 'recvbuf' "
            f"({recvbuf.dtype}) must have the same dtype"
        )
    c = as_comm(comm, "sendrecv")
    prim = PRIMITIVES["sendrecv"]
    return Call(prim, [sendbuf, recvbuf], c, enter(
        prim, c,
        dest=rank(dest, c, "sendrecv", "dest", PEER),
        source=rank(source, c, "sendrecv", "source", SOURCE),
        sendtag=check_tag(sendtag, "sendrecv", "sendtag"),
        recvtag=check_tag(recvtag, "sendrecv", "recvtag", any_ok=True),
        status=check_status(status, "sendrecv"), invalid=invalid,
    ))


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    MPI_Sendrecv: both in one call, so that ranks exchanging with one another cannot
    deadlock. Linear in `sendbuf`: in reverse mode the cotangents travel back the other
    way (a receive from `MPI.ANY_SOURCE` has no derivative; differentiating one ends the
    job with an error when it runs).

    Args:
        sendbuf (ArrayLike): the array to send, any shape.
        recvbuf (ArrayLike): a template of the shape and dtype to receive, the same dtype
            as `sendbuf` (its values are not sent; with `source=MPI.PROC_NULL` they are the
            result).
        source (int | jax.Array): the rank to receive from, `MPI.ANY_SOURCE` or `MPI.PROC_NULL`.
        dest (int | jax.Array): the rank to send to, or `MPI.PROC_NULL`.
        sendtag (int): the tag of the message sent, `0..MPI.TAG_UB`.
        recvtag (int): the tag to match, `0..MPI.TAG_UB`, or `MPI.ANY_TAG` (the default).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).
        status (MPI.Status | None): if given, filled on completion of the receive.

    Returns:
        (jax.Array): The array received, with `recvbuf`'s shape and dtype (`recvbuf` itself
            from `MPI.PROC_NULL`).

    Raises:
        TypeError: when `sendbuf` or `recvbuf` is not an array (or convertible to one) of
            a dtype MPI can carry, their dtypes differ, `source`, `dest` or a tag is not an
            int, `status` is not an `MPI.Status` or None, or `comm` is not an mpi4py
            intracommunicator or None.
        ValueError: when `source` or `dest` is outside the communicator (and not one of
            the MPI constants above), a tag is outside `0..MPI.TAG_UB` (`recvtag` may be
            `MPI.ANY_TAG`), or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, or when called from inside a host
            callback.

    Shape:
        (`s`, template `t`) -> `t`.

    Transpose:
        sendrecv with `source` and `dest` swapped.

    Example:
        ```python
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        x = jnp.full(2, float(r))
        y = vjpmpi.sendrecv(x, jnp.zeros(2), source=(r - 1) % n, dest=(r + 1) % n)
        assert (y == (r - 1) % n).all()  # a ring shift: each rank gets its left neighbour's
        ```
    """
    (y,) = prepare_sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag,
                            comm=comm, status=status).run()
    return y


# What vjpmpi.start calls for each public op: its prepare half.
prepare = {send: prepare_send, recv: prepare_recv, sendrecv: prepare_sendrecv}
