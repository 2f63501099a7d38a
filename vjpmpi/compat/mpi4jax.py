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

    Shape: `s` -> `s` on every rank.
    Transpose (SUM, mpi4jax's convention): the identity, the result being one replicated
    value (`vjpmpi.sum_replicated`); other ops: vjpmpi's derivatives (mpi4jax has none).
    """
    _no_token("allreduce", token)
    if _mpi.as_red(op, "allreduce") == _mpi.SUM:
        return _replicated.sum_replicated(x, comm=comm)
    return _reductions.allreduce(x, op, comm=comm)


def reduce(x, op, root, *, comm=None, token=NOTSET):
    """Reduce `x` over all ranks with `op` onto `root`; other ranks get `x` back unchanged.

    Shape: `s` -> `s` on every rank.
    Transpose (SUM): bcast from `root`, plus the identity elsewhere (mpi4jax has none).
    """
    _no_token("reduce", token)
    return _reductions.reduce(x, op, root, comm=comm)


def bcast(x, root, *, comm=None, token=NOTSET):
    """`root`'s `x` on every rank; `root` gets its own `x` back, others' `x` is a template.

    Shape: `s` -> `s` on every rank.
    Transpose: reduce(SUM) onto `root` (mpi4jax has none).
    """
    _no_token("bcast", token)
    return _movement.bcast(x, root, comm=comm)


def allgather(x, *, comm=None, token=NOTSET):
    """Every rank's `x`, stacked in rank order, on every rank.

    Shape: `s` -> `(size, *s)`.
    Transpose: reduce_scatter(SUM) (mpi4jax has none).
    """
    _no_token("allgather", token)
    return _movement.allgather(x, comm=comm)


def gather(x, root, *, comm=None, token=NOTSET):
    """Every rank's `x`, stacked in rank order, on `root`; other ranks get `x` back.

    Shape: `s` -> `(size, *s)` on `root`, `s` elsewhere.
    Transpose: scatter from `root`, plus the identity elsewhere (mpi4jax has none).
    """
    _no_token("gather", token)
    return _movement.gather(x, root, comm=comm)


def scatter(x, root, *, comm=None, token=NOTSET):
    """Block `rank` of `root`'s `x` on each rank (other ranks' `x` is a template).

    Shape: `(size, *s)` -> `s` on `root`; `s` -> `s` elsewhere.
    Transpose: gather onto `root` (mpi4jax has none).
    """
    _no_token("scatter", token)
    return _movement.scatter(x, root, comm=comm)


def alltoall(x, *, comm=None, token=NOTSET):
    """Block `j` of `x` goes to rank `j`; block `i` of the result came from rank `i`.

    Shape: `(size, *s)` -> `(size, *s)`.
    Transpose: alltoall (mpi4jax has none).
    """
    _no_token("alltoall", token)
    return _movement.alltoall(x, comm=comm)


def scan(x, op, *, comm=None, token=NOTSET):
    """Inclusive prefix reduction over the ranks: rank `r` gets `x_0 op ... op x_r`.

    Shape: `s` -> `s`.
    Transpose (SUM): the inclusive suffix sum (mpi4jax has none).
    """
    _no_token("scan", token)
    return _reductions.scan(x, op, comm=comm)


def send(x, dest, *, tag=0, comm=None, token=NOTSET):
    """Send `x` to rank `dest`. Returns an empty list, as mpi4jax does.

    Shape: `s` -> nothing.
    Transpose: recv from `dest` (mpi4jax has none).
    """
    _no_token("send", token)
    _p2p.send(x, dest, tag=tag, comm=comm)
    return []


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=NOTSET):
    """Receive an array shaped like the template `x` from `source`.

    Shape: template `s` -> `s`.
    Transpose: send to `source` (needs an explicit `source`; mpi4jax has none).
    """
    _no_token("recv", token)
    return _p2p.recv(x, source, tag=tag, comm=comm, status=status)


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None, token=NOTSET):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    Shape: `sendbuf` any, template `recvbuf` `t` -> `t`.
    Transpose: sendrecv with `source` and `dest` swapped, as in mpi4jax (the cotangent
    goes back to the sender); `jax.jvp` and `vmap` work too (not in mpi4jax).
    """
    _no_token("sendrecv", token)
    return _p2p.sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag,
                         comm=comm, status=status)


def barrier(*, comm=None, token=NOTSET):
    """Wait until every rank of `comm` has reached it. Returns an empty list, as mpi4jax does."""
    _no_token("barrier", token)
    _sync.barrier(comm=comm)
    return []


def has_cuda_support() -> bool:
    """Whether vjpmpi was built with its CUDA backend (collectives on GPU buffers)."""
    return _kernels.cuda is not None


def has_sycl_support() -> bool:
    """Always False: vjpmpi has no SYCL (Intel GPU) backend."""
    return False
