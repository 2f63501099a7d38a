"""The replicated-value pair, JAX's psum / pvary, Megatron's g / f: `sum_replicated`
(allreduce forward, identity backward) and `use_replicated` (identity forward,
allreduce backward), each the other's transpose.
"""

from __future__ import annotations

from ._bind import bind
from ._derive import define, partner
from ._mpi import SUM, as_comm, check_red_dtype
from ._primitive import PRIMITIVES, Collective, like
from ._validate import array

__all__ = ["sum_replicated", "use_replicated"]

define(Collective("sum_replicated", like(0), {"red": "red"}, alias=(0, 0), target="allreduce",
                  transpose=partner("use_replicated")),
       Collective("use_replicated", like(0), target=None,
                  transpose=partner("sum_replicated", red=SUM)))


def sum_replicated(x, *, comm=None):
    """Sum `x` over ranks into one value that every rank holds (Megatron's g, JAX's psum).

    Forward: allreduce(SUM). The result is treated as a single replicated value, so its
    cotangent is taken as already replicated and the backward pass does no communication.

    Use it when every rank goes on to compute the *same* thing from the sum, e.g. a
    data-parallel mean loss `sum_replicated(local_loss) / size` differentiated on every
    rank: with `allreduce` each rank's gradient would also collect the identical
    cotangents of the other `size - 1` ranks' copies of the loss, `size` times too large.

    Args:
        x (ArrayLike): this rank's contribution, any shape; a dtype with a sum (integer,
            float or complex; not bool).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): The sum of every rank's `x`, with `x`'s shape and dtype, on every rank.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, its dtype is bool, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (dtype, shape, or its place in their sequence).

    Shape:
        `s` -> `s`.

    Transpose:
        `use_replicated` (the identity on each rank).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        x = jnp.full(2, r + 1.0)  # this rank's data; the weights w are replicated
        loss = lambda w: vjpmpi.sum_replicated(jnp.dot(w, x)) / n  # the mean over ranks
        g = jax.grad(loss)(jnp.ones(2))
        assert (g == (r + 1.0) / n).all()  # this rank's share of the gradient, no message
        assert (vjpmpi.allreduce(g, MPI.SUM) == 1.5).all()  # at 2 ranks: (1 + 2) / 2
        ```
    """
    x = array(x, "sum_replicated")
    c = as_comm(comm, "sum_replicated")
    check_red_dtype(SUM, x.dtype, "sum_replicated")
    (y,) = bind(PRIMITIVES["sum_replicated"], [x], c, red=SUM)
    return y


def use_replicated(x, *, comm=None):
    """Mark a replicated value (the same on every rank) that each rank uses differently.

    Forward: the identity, no communication (Megatron's f, JAX's pvary). Backward: the
    cotangents of all ranks are summed (allreduce(SUM)), because the one replicated value
    influenced every rank's result.

    Use it on replicated parameters entering rank-local work, e.g. the input of a
    tensor-parallel layer whose weight columns live on different ranks: without it each
    rank's gradient for the input holds only its own shard's contribution (a factor of up
    to `size` missing, and different on every rank).

    Args:
        x (ArrayLike): the replicated value, any shape; the same on every rank.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): `x` itself (same shape and dtype).

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.

    Shape:
        `s` -> `s`.

    Transpose:
        `sum_replicated`.
    """
    x = array(x, "use_replicated")
    c = as_comm(comm, "use_replicated")
    (y,) = bind(PRIMITIVES["use_replicated"], [x], c)
    return y
