"""mpi4jax 0.9's API, with mpi4jax's differentiation conventions, on vjpmpi's kernels.

    import vjpmpi.compat.mpi4jax as mpi4jax

Port a program by changing that one import: values, signatures and gradients stay
those of mpi4jax. It differs from the top-level `vjpmpi` in one rule, mpi4jax's:
`allreduce(x, MPI.SUM)` treats its result as one value replicated on every rank, so
its transpose is the identity (this is `vjpmpi.sum_replicated`), where
`vjpmpi.allreduce` transposes to allreduce(SUM), the exact adjoint. `sendrecv`'s
adjoint (the cotangent goes back to the sender) is the same in both. What mpi4jax
cannot differentiate or batch (allreduce with MAX/MIN/PROD, reduce, bcast, gather,
scatter, allgather, alltoall, scan, send, recv, `jax.jvp` of sendrecv, `vmap` of most
ops) gets vjpmpi's exact rules instead of an error. Everything else is vjpmpi:
ordering on one token chain, float16/bfloat16, checks at trace time with vjpmpi's
messages, the CUDA backend. docs/guides/mpi4jax.md lists every difference.
"""

from mpi4py import MPI

from .. import _kernels, _movement, _mpi, _p2p, _reductions, _replicated, _sync

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv",
           "reduce", "scan", "scatter", "send", "sendrecv", "has_cuda_support",
           "has_sycl_support"]


class _NotSet:
    def __repr__(self):
        return "NOTSET"


NOTSET = _NotSet()  # the default of `token`, as in mpi4jax


def _no_token(op, token):
    if token is not NOTSET:
        raise RuntimeError(
            f"vjpmpi.compat.mpi4jax.{op}: explicit token management is not supported (nor "
            "by mpi4jax >= 0.8); collectives are ordered automatically, so drop the `token` "
            "argument")


def allreduce(x, op, *, comm=None, token=NOTSET):
    """Reduce `x` over all ranks with `op`; every rank gets the result.

    With `MPI.SUM` this is `vjpmpi.sum_replicated`, mpi4jax's gradient; other ops are
    `vjpmpi.allreduce`.

    Args:
        x (ArrayLike): this rank's contribution, any shape.
        op (MPI.Op | str): the reduction (`MPI.SUM`, `PROD`, `MAX`, `MIN`, the logical and
            bitwise ones), or its name.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): The reduction of every rank's `x`, on every rank.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.allreduce` does.
        ValueError: for an unknown `op` or a freed `comm`, as `vjpmpi.allreduce` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        (SUM, mpi4jax's convention) the identity: the result is one value replicated on
        every rank. Other ops: vjpmpi's derivatives (mpi4jax has none).
    """
    _no_token("allreduce", token)
    if _mpi.as_red(op, "allreduce") == _mpi.SUM:
        return _replicated.sum_replicated(x, comm=comm)
    return _reductions.allreduce(x, op, comm=comm)


def reduce(x, op, root, *, comm=None, token=NOTSET):
    """Reduce `x` over all ranks with `op` onto `root`; other ranks get `x` back unchanged.

    Args:
        x (ArrayLike): this rank's contribution, any shape.
        op (MPI.Op | str): the reduction, as in `allreduce`.
        root (int): the rank that gets the result.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): On `root` the reduction of every rank's `x`; elsewhere `x`.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.reduce` does.
        ValueError: for an unknown `op` or a `root` outside the communicator, as
            `vjpmpi.reduce` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        (SUM) bcast from `root`, plus the identity elsewhere (mpi4jax has none).
    """
    _no_token("reduce", token)
    return _reductions.reduce(x, op, root, comm=comm)


def bcast(x, root, *, comm=None, token=NOTSET):
    """`root`'s `x` on every rank; `root` gets its own `x` back, others' `x` is a template.

    Args:
        x (ArrayLike): on `root`, the array to send; elsewhere a template of its shape and
            dtype.
        root (int): the sending rank.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): `root`'s `x`, on every rank.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.bcast` does.
        ValueError: for a `root` outside the communicator, as `vjpmpi.bcast` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        reduce(SUM) onto `root` (mpi4jax has none).
    """
    _no_token("bcast", token)
    return _movement.bcast(x, root, comm=comm)


def allgather(x, *, comm=None, token=NOTSET):
    """Every rank's `x`, stacked in rank order, on every rank.

    Args:
        x (ArrayLike): this rank's block, the same shape and dtype on every rank.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): Row `r` is rank `r`'s `x`.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.allgather` does.
        ValueError: for a freed `comm`, as `vjpmpi.allgather` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `(size, *s)`.

    Transpose:
        reduce_scatter(SUM) (mpi4jax has none).
    """
    _no_token("allgather", token)
    return _movement.allgather(x, comm=comm)


def gather(x, root, *, comm=None, token=NOTSET):
    """Every rank's `x`, stacked in rank order, on `root`; other ranks get `x` back.

    Args:
        x (ArrayLike): this rank's block, the same shape and dtype on every rank.
        root (int): the rank that gets the stack.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): On `root`, row `r` is rank `r`'s `x`; elsewhere `x`.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.gather` does.
        ValueError: for a `root` outside the communicator, as `vjpmpi.gather` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `(size, *s)` on `root`, `s` elsewhere.

    Transpose:
        scatter from `root`, plus the identity elsewhere (mpi4jax has none).
    """
    _no_token("gather", token)
    return _movement.gather(x, root, comm=comm)


def scatter(x, root, *, comm=None, token=NOTSET):
    """Block `rank` of `root`'s `x` on each rank (other ranks' `x` is a template).

    Args:
        x (ArrayLike): on `root`, the blocks, one row per rank; elsewhere a template of one
            block.
        root (int): the sending rank.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): This rank's block.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.scatter` does.
        ValueError: for a `root` outside the communicator, or on `root` a leading axis other
            than the communicator's size, as `vjpmpi.scatter` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `(size, *s)` -> `s` on `root`; `s` -> `s` elsewhere.

    Transpose:
        gather onto `root` (mpi4jax has none).
    """
    _no_token("scatter", token)
    return _movement.scatter(x, root, comm=comm)


def alltoall(x, *, comm=None, token=NOTSET):
    """Block `j` of `x` goes to rank `j`; block `i` of the result came from rank `i`.

    Args:
        x (ArrayLike): one block per rank along the leading axis.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): The blocks received, in rank order.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.alltoall` does.
        ValueError: for a leading axis other than the communicator's size, as
            `vjpmpi.alltoall` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `(size, *s)` -> `(size, *s)`.

    Transpose:
        alltoall (mpi4jax has none).
    """
    _no_token("alltoall", token)
    return _movement.alltoall(x, comm=comm)


def scan(x, op, *, comm=None, token=NOTSET):
    """Inclusive prefix reduction over the ranks: rank `r` gets `x_0 op ... op x_r`.

    Args:
        x (ArrayLike): this rank's contribution, any shape.
        op (MPI.Op | str): the reduction, as in `allreduce`.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): On rank `r`, the reduction of the `x` of ranks `0..r`.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.scan` does.
        ValueError: for an unknown `op` or a freed `comm`, as `vjpmpi.scan` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> `s`.

    Transpose:
        (SUM) the inclusive suffix sum (mpi4jax has none).
    """
    _no_token("scan", token)
    return _reductions.scan(x, op, comm=comm)


def send(x, dest, *, tag=0, comm=None, token=NOTSET):
    """Send `x` to rank `dest`.

    Args:
        x (ArrayLike): the array to send.
        dest (int): the receiving rank.
        tag (int): the message tag.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (list): An empty list, as mpi4jax returns.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.send` does.
        ValueError: for a `dest` outside the communicator or a `tag` out of range, as
            `vjpmpi.send` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `s` -> nothing.

    Transpose:
        recv from `dest` (mpi4jax has none).
    """
    _no_token("send", token)
    _p2p.send(x, dest, tag=tag, comm=comm)
    return []


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=NOTSET):
    """Receive an array shaped like the template `x` from `source`.

    Args:
        x (ArrayLike): a template of the shape and dtype to receive.
        source (int): the sending rank, or `MPI.ANY_SOURCE` (the default).
        tag (int): the tag to match, or `MPI.ANY_TAG` (the default).
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        status (MPI.Status | None): if given, filled on completion.
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): The array received, with `x`'s shape and dtype.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.recv` does.
        ValueError: for a `source` outside the communicator or a `tag` out of range, as
            `vjpmpi.recv` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        template `s` -> `s`.

    Transpose:
        send to `source` (needs an explicit `source`; mpi4jax has none).
    """
    _no_token("recv", token)
    return _p2p.recv(x, source, tag=tag, comm=comm, status=status)


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None, token=NOTSET):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    Args:
        sendbuf (ArrayLike): the array to send.
        recvbuf (ArrayLike): a template of the shape and dtype to receive (the same dtype
            as `sendbuf`).
        source (int): the sending rank.
        dest (int): the receiving rank.
        sendtag (int): the tag of the message sent.
        recvtag (int): the tag to match, or `MPI.ANY_TAG` (the default).
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        status (MPI.Status | None): if given, filled on completion.
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (jax.Array): The array received, with `recvbuf`'s shape and dtype.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.sendrecv` does.
        ValueError: for a `source` or `dest` outside the communicator or a tag out of range,
            as `vjpmpi.sendrecv` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.

    Shape:
        `sendbuf` any, template `recvbuf` `t` -> `t`.

    Transpose:
        sendrecv with `source` and `dest` swapped, as in mpi4jax (the cotangent goes back
        to the sender); `jax.jvp` and `vmap` work too (not in mpi4jax).
    """
    _no_token("sendrecv", token)
    return _p2p.sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag,
                         comm=comm, status=status)


def barrier(*, comm=None, token=NOTSET):
    """Wait until every rank of `comm` has reached it.

    Args:
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's private duplicate of
            COMM_WORLD).
        token (object): not supported, as in mpi4jax 0.9: leave it out (any value raises).

    Returns:
        (list): An empty list, as mpi4jax returns.

    Raises:
        TypeError: for an argument of the wrong type, as `vjpmpi.barrier` does.
        ValueError: for a freed `comm`, as `vjpmpi.barrier` does.
        RuntimeError: when `token` is given (any value, None included), when MPI has been
            finalized, or when called from inside a host callback.
    """
    _no_token("barrier", token)
    _sync.barrier(comm=comm)
    return []


def has_cuda_support() -> bool:
    """Whether vjpmpi was built with its CUDA backend (collectives on GPU buffers).

    Returns:
        (bool): True where the CUDA backend is built.
    """
    return _kernels.cuda is not None


def has_sycl_support() -> bool:
    """Always False: vjpmpi has no SYCL (Intel GPU) backend.

    Returns:
        (bool): False.
    """
    return False
