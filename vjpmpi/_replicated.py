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

    Shape: `s` -> `s`. Forward: allreduce(SUM). The result is treated as a single
    replicated value, so its cotangent is taken as already replicated and the
    backward pass does no communication.
    Transpose: `use_replicated` (the identity on each rank).

    Use it when every rank goes on to compute the *same* thing from the sum, e.g. a
    data-parallel mean loss `sum_replicated(local_loss) / size` differentiated on every
    rank: with `allreduce` each rank's gradient would also collect the identical
    cotangents of the other `size - 1` ranks' copies of the loss, `size` times too large.
    """
    x = array(x, "sum_replicated")
    c = as_comm(comm, "sum_replicated")
    check_red_dtype(SUM, x.dtype, "sum_replicated")
    (y,) = bind(PRIMITIVES["sum_replicated"], [x], c, red=SUM)
    return y


def use_replicated(x, *, comm=None):
    """Mark a replicated value (the same on every rank) that each rank uses differently.

    Shape: `s` -> `s`. Forward: the identity, no communication (Megatron's f, JAX's pvary).
    Backward: the cotangents of all ranks are summed (allreduce(SUM)), because the one
    replicated value influenced every rank's result.
    Transpose: `sum_replicated`.

    Use it on replicated parameters entering rank-local work, e.g. the input of a
    tensor-parallel layer whose weight columns live on different ranks: without it each
    rank's gradient for the input holds only its own shard's contribution (a factor of
    up to `size` missing, and different on every rank).
    """
    x = array(x, "use_replicated")
    c = as_comm(comm, "use_replicated")
    (y,) = bind(PRIMITIVES["use_replicated"], [x], c)
    return y
