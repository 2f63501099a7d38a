"""The reductions over ranks: allreduce, reduce, reduce_scatter, scan, exscan; each op's
spec, derivative rules and public function together, and the private collectives their
nonlinear derivatives use (scans in reverse rank order, the product of the other
ranks' values, a linear recurrence over ranks).

Linear for SUM (their JVP is the op on the tangents; each transpose is the adjoint of the
global linear map, the inner product summed over ranks: the dot-product tests judge).
MAX/MIN: the tangent of the ranks that attain the extremum, averaged (ties split
equally). PROD: the sum over ranks of the tangent times the product of the *other*
ranks' values, from exclusive products in both rank orders (zeros need no division).
Each nonlinear rule takes a fixed number of collectives of the operand's size, whatever
the number of ranks; its tangent part is SUM collectives and the linear recurrence,
with x and the results as constants, so transposes follow from those.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _jax_compat as jc
from ._bind import bind
from ._derive import call, define, partner
from ._mpi import MAX, MIN, PROD, RED_NAMES, SUM, as_comm, as_red, check_red_dtype
from ._primitive import PRIMITIVES, Collective, like, with_shape
from ._rules import on_root, only_linear
from ._validate import array, check_rank_axis, rank

__all__ = ["allreduce", "reduce", "reduce_scatter", "scan", "exscan"]

_RED = {"red": "red"}
_REVERSED = {"reverse": 1}


# ------------------------------------------------- shared derivative rules --
def _not_differentiable(red):
    return TypeError(
        f"reduction MPI.{RED_NAMES[red]} is not differentiable (it is logical or bitwise); "
        "only SUM, PROD, MAX and MIN have derivatives")


def _count_dtype(p):
    """The smallest unsigned integer that counts up to the communicator's size."""
    size = p["comm"].size
    return jnp.uint8 if size < 2**8 else jnp.uint16 if size < 2**16 else jnp.uint32


def _recurrence(a, b, p, *, reverse=False, tangent=False):
    """e_s = sum_{q before s} b_q prod_{q < r < s} a_r (rank order, or reversed)."""
    return call("recurrence_reversed" if reverse else "recurrence", [a, b], p, tangent=tangent)


def _checked(jvp):
    """A reduction's JVP rule for PROD, MAX and MIN; zero tangents made real (every
    rank runs the tangent collectives)."""
    def rule(primals, tangents, outs, p):
        if p["red"] not in (PROD, MAX, MIN):
            raise _not_differentiable(p["red"])
        return jvp(primals, [jc.instantiate_zeros(t) for t in tangents], outs, p)
    return rule


def _jvp_sum_over_ranks(name, everywhere=lambda y, p: y):
    """JVP of allreduce, reduce, reduce_scatter: a SUM by `name` itself over the ranks
    the result reduces. PROD: of t times the product of the other ranks' values.
    MAX/MIN: of t where x attains the result (`everywhere(y, p)`: the results x
    contributes to, on this rank), divided by the number of ranks that do. reduce's
    result off the root is x itself."""
    def jvp(primals, tangents, outs, p):
        (x,), (t,), (y,) = primals, tangents, outs
        total = lambda v, tangent: call(name, v, p, red=SUM, tangent=tangent)  # noqa: E731
        if p["red"] == PROD:
            out = total(t * call("others_product", x, p), True)
        else:
            hit = x == everywhere(y, p)
            n = total(hit.astype(_count_dtype(p)), False)
            out = total(jnp.where(hit, t, 0), True) / n
        return [out if "root" not in p else on_root(p, out, t)]
    return jvp


def _carried(keep, hit, t, p, reverse):
    """MAX/MIN, over the ranks q before this one (in the scan's order): the sum of t_q
    and the number of ranks, over the q with hit_q whose extremum every rank between
    kept (keep_r): a linear recurrence each (the count in float32, exact to 2**24)."""
    n = _recurrence(keep.astype(jnp.float32), hit.astype(jnp.float32), p, reverse=reverse)
    s = _recurrence(keep.astype(t.dtype), jnp.where(hit, t, 0), p, reverse=reverse, tangent=True)
    return s, n


def _reduction_spec(name, out_avals, jvp, params=_RED, **kw):
    return Collective(name, out_avals, params=params, alias=kw.pop("alias", (0, 0)),
                      linear=lambda p: p["red"] == SUM, nonlinear_jvp=_checked(jvp), **kw)


def _reduction(name: str, x, op, comm, root=None):
    """The public call of reduction `name`: arguments checked, converted once, bound."""
    x = array(x, name)
    c = as_comm(comm, name)
    red = check_red_dtype(as_red(op, name), x.dtype, name)
    extra = {} if root is None else {"root": rank(root, c, name, "root")}
    (y,) = bind(PRIMITIVES[name], [x], c, red=red, **extra)
    return y


# ---------------------------------------------------------------- allreduce --
define(_reduction_spec("allreduce", like(0), _jvp_sum_over_ranks("allreduce"),
                       transpose=partner("allreduce")))

def allreduce(x, op, *, comm=None):
    """Reduce `x` over all ranks with `op`; every rank gets the result.

    MPI_Allreduce. Differentiable for SUM (linear), PROD, MAX and MIN (MAX/MIN: the tangent of the
    ranks that attain the extremum, averaged over ties); logical and bitwise reductions
    have no derivative.

    Args:
        x (ArrayLike): this rank's contribution, any shape; a bool, integer, float or
            complex dtype for which `op` is defined.
        op (MPI.Op | str): the reduction: `MPI.SUM`, `PROD`, `MAX`, `MIN`, `LAND`, `LOR`,
            `LXOR`, `BAND`, `BOR`, `BXOR`, or its name (`"sum"`, any case).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): The reduction of every rank's `x`, with `x`'s shape and dtype, on every
            rank.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `op` is not defined for that dtype (e.g. MAX on complex, SUM on bool),
            or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `op` is not one of those reductions (or its name), or
            `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (op, dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        (SUM) allreduce(SUM) of the cotangents (the true adjoint of the global linear map).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r = MPI.COMM_WORLD.Get_rank()
        y = vjpmpi.allreduce(jnp.full(3, r + 1.0), MPI.SUM)
        assert (y == 3.0).all()  # at 2 ranks: 1 + 2
        g = jax.grad(lambda x: vjpmpi.allreduce(x, MPI.SUM).sum())(jnp.ones(3))
        assert (g == 2.0).all()  # every rank's sum depends on this rank's x
        ```
    """
    return _reduction("allreduce", x, op, comm)


# ------------------------------------------------------------------- reduce --
def _t_reduce(cts, args, p):  # y_root = sum_s x_s, y_r = x_r elsewhere
    (ct,) = cts
    b = call("bcast", ct, p)
    return [on_root(p, b, b + ct)]


define(_reduction_spec("reduce", like(0),  # the root's result, on every rank:
                       _jvp_sum_over_ranks("reduce", lambda y, p: call("bcast", y, p)),
                       {**_RED, "root": "root"}, transpose=_t_reduce))

def reduce(x, op, root, *, comm=None):
    """Reduce `x` over all ranks with `op` onto `root`; other ranks get `x` back unchanged.

    MPI_Reduce. Differentiable for SUM (linear), PROD, MAX and MIN (MAX/MIN: the tangent of the
    ranks that attain the extremum, averaged over ties); logical and bitwise reductions
    have no derivative.

    Args:
        x (ArrayLike): this rank's contribution, any shape; a bool, integer, float or
            complex dtype for which `op` is defined.
        op (MPI.Op | str): the reduction: `MPI.SUM`, `PROD`, `MAX`, `MIN`, `LAND`, `LOR`,
            `LXOR`, `BAND`, `BOR`, `BXOR`, or its name (`"sum"`, any case).
        root (int | jax.Array): the rank that receives the reduction.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): On `root`, the reduction of every rank's `x`; elsewhere `x` itself.
            Shape and dtype of `x`.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `op` is not defined for that dtype (e.g. MAX on complex, SUM on bool),
            `root` is not an int, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `op` is not one of those reductions (or its name), `root` is
            outside the communicator, or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (op, dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `s` on every rank.

    Transpose:
        (SUM) bcast from `root` (plus the identity on non-root ranks).
    """
    return _reduction("reduce", x, op, comm, root)


# ----------------------------------------------------------- reduce_scatter --
define(_reduction_spec(
    "reduce_scatter", lambda p, x: [with_shape(x, x.shape[1:])],
    _jvp_sum_over_ranks("reduce_scatter", lambda y, p: call("allgather", y, p)),
    alias=None, rank_axis=lambda p: (True, False), transpose=partner("allgather")))

def reduce_scatter(x, op, *, comm=None):
    """Reduce `x` over ranks with `op`; rank `r` gets block `r` of the reduction.

    MPI_Reduce_scatter_block.
    Differentiable for SUM (linear), PROD, MAX and MIN (MAX/MIN: the tangent of the
    ranks that attain the extremum, averaged over ties); logical and bitwise reductions
    have no derivative.

    Args:
        x (ArrayLike): the blocks for each rank stacked on a leading axis whose length is
            the communicator's size; a dtype for which `op` is defined.
        op (MPI.Op | str): the reduction: `MPI.SUM`, `PROD`, `MAX`, `MIN`, `LAND`, `LOR`,
            `LXOR`, `BAND`, `BOR`, `BXOR`, or its name (`"sum"`, any case).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): This rank's block of the reduction: `x[r]` reduced over the ranks, of
            shape `x.shape[1:]` and `x`'s dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `op` is not defined for that dtype (e.g. MAX on complex, SUM on bool),
            or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `op` is not one of those reductions (or its name), `x` has no
            leading axis of the communicator's size, or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (op, dtype, shape, root, or its place in their sequence).

    Shape:
        `(size, *s)` -> `s`.

    Transpose:
        (SUM) allgather.
    """
    x = array(x, "reduce_scatter")
    c = as_comm(comm, "reduce_scatter")
    check_rank_axis(x, c, "reduce_scatter")
    red = check_red_dtype(as_red(op, "reduce_scatter"), x.dtype, "reduce_scatter")
    (y,) = bind(PRIMITIVES["reduce_scatter"], [x], c, red=red)
    return y


# --------------------------------------------------------------- scan, exscan --
def _t_scan(cts, args, p):  # suffix sum: sum_{r >= s} = own + sum_{r > s}
    (ct,) = cts
    return [ct + call("exscan_reversed", ct, p, red=SUM)]


def _jvp_scan(primals, tangents, outs, p):  # y = (exscan result) "through" x
    (x,), (t,), (y,) = primals, tangents, outs
    before = call("exscan", x, p)
    if p["red"] == PROD:
        return [t * before + x * _recurrence(x, t * before, p, tangent=True)]
    keep, hit = before == y, x == y
    s, n = _carried(keep, hit, t, p, False)
    total = jnp.where(hit, t, 0) + jnp.where(keep, s, 0)
    return [total / (hit + jnp.where(keep, n, 0)).astype(t.dtype)]


def _t_exscan(reverse):  # exclusive sums in one rank order: those in the other
    return lambda cts, args, p: [call("exscan" if reverse else "exscan_reversed", cts[0], p,
                                      red=SUM)]


def _jvp_exscan(reverse):
    def jvp(primals, tangents, outs, p):
        (x,), (t,), (y,) = primals, tangents, outs
        if p["red"] == PROD:  # d y_s = sum_{q < s} t_q y_q prod_{q < r < s} x_r
            return [_recurrence(x, t * y, p, reverse=reverse, tangent=True)]
        through = (jnp.maximum if p["red"] == MAX else jnp.minimum)(y, x)
        s, n = _carried(y == through, x == through, t, p, reverse)
        first = p["comm"].rank == (p["comm"].size - 1 if reverse else 0)
        if isinstance(first, bool):
            return [s if first else s / n.astype(t.dtype)]  # s is 0 on the first rank
        return [jnp.where(first, s, s / jnp.where(first, 1, n).astype(t.dtype))]  # (devices)
    return jvp


define(_reduction_spec("scan", like(0), _jvp_scan, transpose=_t_scan),
       _reduction_spec("exscan", like(0), _jvp_exscan(False), transpose=_t_exscan(False)),
       # private: the exclusive scan from the last rank down
       _reduction_spec("exscan_reversed", like(0), _jvp_exscan(True), target="exscan",
                       fixed=_REVERSED, transpose=_t_exscan(True)))

def scan(x, op, *, comm=None):
    """Inclusive prefix reduction: rank `r` gets `op` over the `x` of ranks `0..r`.

    MPI_Scan. Differentiable for SUM (linear), PROD, MAX and MIN (MAX/MIN: the tangent of the
    ranks that attain the extremum, averaged over ties); logical and bitwise reductions
    have no derivative.

    Args:
        x (ArrayLike): this rank's contribution, any shape; a dtype for which `op` is
            defined.
        op (MPI.Op | str): the reduction: `MPI.SUM`, `PROD`, `MAX`, `MIN`, `LAND`, `LOR`,
            `LXOR`, `BAND`, `BOR`, `BXOR`, or its name (`"sum"`, any case).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): On rank `r`, the reduction of the `x` of ranks `0..r`, with `x`'s shape
            and dtype.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `op` is not defined for that dtype (e.g. MAX on complex, SUM on bool),
            or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `op` is not one of those reductions (or its name), or
            `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (op, dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `s`.

    Transpose:
        (SUM) inclusive suffix sum over ranks.

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r = MPI.COMM_WORLD.Get_rank()
        y = vjpmpi.scan(jnp.array([r + 1.0]), MPI.SUM)
        assert y[0] == [1.0, 3.0][r]  # rank r: 1 + ... + (r + 1)
        g = jax.grad(lambda x: vjpmpi.scan(x, MPI.SUM).sum())(jnp.ones(1))
        assert g[0] == 2 - r  # this rank's x enters the sums of ranks r..1
        ```
    """
    return _reduction("scan", x, op, comm)


def exscan(x, op, *, comm=None):
    """Exclusive prefix reduction over ranks `0..r-1`; rank 0 gets the identity of `op`.

    MPI_Exscan (whose rank 0 result MPI leaves undefined; here it is `op`'s identity).
    Differentiable for SUM (linear), PROD, MAX and MIN (MAX/MIN: the tangent of the
    ranks that attain the extremum, averaged over ties); logical and bitwise reductions
    have no derivative.

    Args:
        x (ArrayLike): this rank's contribution, any shape; a dtype for which `op` is
            defined.
        op (MPI.Op | str): the reduction: `MPI.SUM`, `PROD`, `MAX`, `MIN`, `LAND`, `LOR`,
            `LXOR`, `BAND`, `BOR`, `BXOR`, or its name (`"sum"`, any case).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): On rank `r > 0`, the reduction of the `x` of ranks `0..r-1`; on rank 0,
            the identity of `op`. Shape and dtype of `x`.

    Raises:
        TypeError: when `x` is not an array (or convertible to one) of a dtype MPI can
            carry, `op` is not defined for that dtype (e.g. MAX on complex, SUM on bool),
            or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `op` is not one of those reductions (or its name), or
            `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host
            callback, or when another thread already runs collectives on `comm`.
        ValueError: when it runs, on every rank, if the ranks disagree on
            the collective (op, dtype, shape, root, or its place in their sequence).

    Shape:
        `s` -> `s`.

    Transpose:
        (SUM) exclusive suffix sum over ranks.
    """
    return _reduction("exscan", x, op, comm)


# ------------------------------------- private collectives of the derivatives --
def _jvp_others_product(primals, tangents, outs, p):  # d(pre * post), each a recurrence
    (x,), t = primals, jc.instantiate_zeros(tangents[0])
    pre, post = call("exscan", x, p, red=PROD), call("exscan_reversed", x, p, red=PROD)
    return [_recurrence(x, t * pre, p, tangent=True) * post
            + pre * _recurrence(x, t * post, p, reverse=True, tangent=True)]


def _jvp_recurrence(reverse):
    def jvp(primals, tangents, outs, p):  # de = E(a, da * e + db)
        (a, b), (da, db), (e,) = primals, tangents, outs
        u = jc.instantiate_zeros(db)
        if type(da) is not jc.Zero:
            u = u + da * e
        return [_recurrence(a, u, p, reverse=reverse, tangent=True)]
    return jvp


def _t_recurrence(reverse):  # linear in b: the same recurrence in the other order
    def transpose(cts, args, p):
        return only_linear(args, [None, _recurrence(args[0], cts[0], p, reverse=not reverse)])
    return transpose


# The product of the other ranks' values, and the linear recurrence
# e_s = sum_{q before s} b_q prod_{q < r < s} a_r (linear in b), in both rank orders.
define(Collective("others_product", like(0), linear=lambda p: False,
                  nonlinear_jvp=_jvp_others_product),
       *[Collective(name, like(1), fixed=fixed, alias=(1, 0), target="recurrence",
                    linear=lambda p: False, nonlinear_jvp=_jvp_recurrence(bool(fixed)),
                    transpose=_t_recurrence(bool(fixed)))
         for name, fixed in [("recurrence", {}), ("recurrence_reversed", _REVERSED)]])
