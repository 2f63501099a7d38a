"""The collectives: one `Collective` spec each, and the public functions.

Signatures, positional arguments and forward results follow mpi4jax 0.9, so
`import vjpmpi as mpi4jax` works for existing code.  `comm=None` means
vjpmpi's private duplicate of `COMM_WORLD`.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import _kernels
from ._collective import Collective, bind, make_primitive, refusal, refuse_here
from ._jax_compat import ShapedArray, Zero, instantiate_zeros, is_undefined_primal
from ._mpi import MAX, MIN, PROD, RED_NAMES, SUM, as_comm, as_red, check_dtype, check_red_dtype

__all__ = [
    "allreduce", "reduce", "bcast", "allgather", "gather", "scatter", "alltoall",
    "reduce_scatter", "scan", "exscan", "send", "recv", "sendrecv", "barrier",
    "sum_replicated", "use_replicated",
]


# ------------------------------------------------------------ the specs --
def _like(i):
    return lambda params, *avals: [avals[i]]


def _with_shape(aval, shape):
    return ShapedArray(shape, aval.dtype, weak_type=aval.weak_type)


def _is_root(params):
    return params["comm"].rank == params["root"]


def _gather_out(params, x):
    return [_with_shape(x, (params["comm"].size, *x.shape))] if _is_root(params) else [x]


def _scatter_out(params, x):  # (a refused root's input may lack the rank axis)
    return [_with_shape(x, x.shape[1:])] if _is_root(params) and x.ndim else [x]


# ------------------------------------------------------- the transposes --
# Each is the adjoint of the global linear map the forward computes, with the
# inner product summed over ranks (the dot-product tests are the judge).
def _call(name, x, params, *, tangent=False, invalid=0, **changes):
    """Bind collective `name` on `x` (or a list of operands); its parameters are `changes`,
    else the caller's `params` of the same name. `tangent=True` binds its linearized twin
    (for tangents inside a JVP rule); `invalid`: a refusal (`_collective.refusal`)."""
    full = {k: changes[k] if k in changes else params[k] for k in ("comm", *SPECS[name].params)}
    if invalid:
        full["invalid"] = invalid
    prim = (LINEARIZED if tangent else PRIMITIVES)[name]
    outs = prim.bind(*(x if isinstance(x, list) else [x]), **full)
    return outs[0] if outs else None


def _zeros(arg):
    return jnp.zeros(arg.aval.shape, arg.aval.dtype) if is_undefined_primal(arg) else jnp.zeros_like(arg)


def _only_linear(args, cts):
    """Cotangents for the linear operands, None for the constant ones."""
    return [ct if is_undefined_primal(a) else None for a, ct in zip(args, cts)]


def _t_reduce(cts, args, p):  # y_root = sum_s x_s, y_r = x_r elsewhere
    (ct,) = cts
    b = _call("bcast", ct, p)
    return [b if _is_root(p) else b + ct]


def _t_bcast(cts, args, p):  # y_r = x_root everywhere; other ranks' x unused
    (ct,) = cts
    total = _call("reduce", ct, p, red=SUM)  # a collective: every rank takes part
    return [total if _is_root(p) else jnp.zeros_like(ct)]


def _t_gather(cts, args, p):  # y_root = stack(x_s), y_r = x_r elsewhere
    (ct,) = cts
    block = _call("scatter", ct, p)
    return [block if _is_root(p) else block + ct]


def _t_scatter(cts, args, p):  # y_r = x_root[r]; other ranks' x is a template
    (ct,) = cts
    g = _call("gather", ct, p)
    return [g if _is_root(p) else jnp.zeros(args[0].aval.shape, args[0].aval.dtype)]


def _t_scan(cts, args, p):  # suffix sum: sum_{r >= s} = own + sum_{r > s}
    (ct,) = cts
    return [ct + _call("exscan_reversed", ct, p, red=SUM)]


def _t_exscan(reverse):  # exclusive sums in one rank order: those in the other
    return lambda cts, args, p: [_call("exscan" if reverse else "exscan_reversed", cts[0], p,
                                       red=SUM)]


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


def _t_send(cts, args, p):  # the cotangent comes back from dest
    (x,) = args
    return [_call("recv", _zeros(x), p, source=p["dest"], tag=MPI.ANY_TAG, status=0)]


def _t_recv(cts, args, p):  # send the cotangent back to source; PROC_NULL keeps the template
    (ct,) = cts
    source, refused = _transposed_source(p, "recv")
    _call("send", ct, p, dest=source, tag=_back_tag(p, "tag"), invalid=refused)
    kept = source == MPI.PROC_NULL and not refused
    return _only_linear(args, [ct if kept else jnp.zeros_like(ct)])


def _t_sendrecv(cts, args, p):  # sendrecv with the peers swapped
    (ct,) = cts
    source, refused = _transposed_source(p, "sendrecv")
    send_ct = _call("sendrecv", [ct, _zeros(args[0])], p, dest=source, source=p["dest"],
                    sendtag=_back_tag(p, "recvtag"), recvtag=MPI.ANY_TAG, status=0,
                    invalid=refused)
    kept = source == MPI.PROC_NULL and not refused
    tmpl_ct = ct if kept else jnp.zeros_like(ct)
    return _only_linear(args, [send_ct, tmpl_ct])


def _partner(name, **changes):
    return lambda cts, args, p: [_call(name, cts[0], p, **changes)]


# --------------------------------------------- nonlinear reductions (JVP) --
# MAX/MIN: the tangent of the ranks that attain the extremum, averaged (ties split
# equally). PROD: the sum over ranks of the tangent times the product of the *other*
# ranks' values, from exclusive products in both rank orders (zeros need no division).
# Each rule takes a fixed number of collectives of the operand's size, whatever the
# number of ranks; its tangent part is SUM collectives and the linear recurrence scan,
# with x and the results as constants, so transposes follow from those.
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
    return _call("recurrence_reversed" if reverse else "recurrence", [a, b], p, tangent=tangent)


def _jvp_others_product(primals, tangents, outs, p):  # d(pre * post), each a recurrence
    (x,), t = primals, instantiate_zeros(tangents[0])
    pre, post = _call("exscan", x, p, red=PROD), _call("exscan_reversed", x, p, red=PROD)
    return [_recurrence(x, t * pre, p, tangent=True) * post
            + pre * _recurrence(x, t * post, p, reverse=True, tangent=True)]


def _jvp_sum_over_ranks(name, everywhere=lambda y, p: y):
    """JVP of allreduce, reduce, reduce_scatter: a SUM by `name` itself over the ranks
    the result reduces. PROD: of t times the product of the other ranks' values.
    MAX/MIN: of t where x attains the result (`everywhere(y, p)`: the results x
    contributes to, on this rank), divided by the number of ranks that do. reduce's
    result off the root is x itself."""
    def jvp(primals, tangents, outs, p):
        (x,), (t,), (y,) = primals, tangents, outs
        total = lambda v, tangent: _call(name, v, p, red=SUM, tangent=tangent)  # noqa: E731
        if p["red"] == PROD:
            out = total(t * _call("others_product", x, p), True)
        else:
            hit = x == everywhere(y, p)
            n = total(hit.astype(_count_dtype(p)), False)
            out = total(jnp.where(hit, t, 0), True) / n
        return [out if "root" not in p or _is_root(p) else t]
    return jvp


def _carried(keep, hit, t, p, reverse):
    """MAX/MIN, over the ranks q before this one (in the scan's order): the sum of t_q
    and the number of ranks, over the q with hit_q whose extremum every rank between
    kept (keep_r): a linear recurrence each (the count in float32, exact to 2**24)."""
    n = _recurrence(keep.astype(jnp.float32), hit.astype(jnp.float32), p, reverse=reverse)
    s = _recurrence(keep.astype(t.dtype), jnp.where(hit, t, 0), p, reverse=reverse, tangent=True)
    return s, n


def _jvp_exscan(reverse):
    def jvp(primals, tangents, outs, p):
        (x,), (t,), (y,) = primals, tangents, outs
        if p["red"] == PROD:  # d y_s = sum_{q < s} t_q y_q prod_{q < r < s} x_r
            return [_recurrence(x, t * y, p, reverse=reverse, tangent=True)]
        through = (jnp.maximum if p["red"] == MAX else jnp.minimum)(y, x)
        s, n = _carried(y == through, x == through, t, p, reverse)
        first = p["comm"].rank == (p["comm"].size - 1 if reverse else 0)
        return [s if first else s / n.astype(t.dtype)]  # s is 0 on the first rank
    return jvp


def _jvp_scan(primals, tangents, outs, p):  # y = (exscan result) "through" x
    (x,), (t,), (y,) = primals, tangents, outs
    before = _call("exscan", x, p)
    if p["red"] == PROD:
        return [t * before + x * _recurrence(x, t * before, p, tangent=True)]
    keep, hit = before == y, x == y
    s, n = _carried(keep, hit, t, p, False)
    total = jnp.where(hit, t, 0) + jnp.where(keep, s, 0)
    return [total / (hit + jnp.where(keep, n, 0)).astype(t.dtype)]


def _checked(jvp):
    """A reduction's JVP rule for PROD, MAX and MIN; zero tangents made real (every
    rank runs the tangent collectives)."""
    def rule(primals, tangents, outs, p):
        if p["red"] not in (PROD, MAX, MIN):
            raise _not_differentiable(p["red"])
        return jvp(primals, [instantiate_zeros(t) for t in tangents], outs, p)
    return rule


def _jvp_recurrence(reverse):
    def jvp(primals, tangents, outs, p):  # de = E(a, da * e + db)
        (a, b), (da, db), (e,) = primals, tangents, outs
        u = instantiate_zeros(db)
        if type(da) is not Zero:
            u = u + da * e
        return [_recurrence(a, u, p, reverse=reverse, tangent=True)]
    return jvp


def _t_recurrence(reverse):  # linear in b: the same recurrence in the other order
    def transpose(cts, args, p):
        return _only_linear(args, [None, _recurrence(args[0], cts[0], p, reverse=not reverse)])
    return transpose


def _sum_linear(p):
    return p["red"] == SUM


_RED = {"red": "red"}
_ROOT = {"root": "root"}
_REVERSED = {"reverse": 1}


def _reduction_spec(name, out_avals, jvp, params=_RED, **kw):
    return Collective(name, out_avals, params=params, alias=kw.pop("alias", (0, 0)),
                      linear=_sum_linear, nonlinear_jvp=_checked(jvp), **kw)


SPECS = {
    spec.name: spec
    for spec in [
        _reduction_spec("allreduce", _like(0), _jvp_sum_over_ranks("allreduce"),
                        transpose=_partner("allreduce")),
        _reduction_spec("reduce", _like(0),  # the root's result, on every rank:
                        _jvp_sum_over_ranks("reduce", lambda y, p: _call("bcast", y, p)),
                        {**_RED, **_ROOT}, transpose=_t_reduce),
        Collective("bcast", _like(0), _ROOT, alias=(0, 0), transpose=_t_bcast),
        Collective(
            "allgather",
            lambda p, x: [_with_shape(x, (p["comm"].size, *x.shape))],
            rank_axis=lambda p: (False, True), transpose=_partner("reduce_scatter", red=SUM),
        ),
        Collective("gather", _gather_out, _ROOT, alias=(0, 0),
                   rank_axis=lambda p: (False, _is_root(p)), transpose=_t_gather),
        Collective("scatter", _scatter_out, _ROOT, alias=(0, 0),
                   rank_axis=lambda p: (_is_root(p), False), transpose=_t_scatter),
        Collective("alltoall", _like(0), alias=(0, 0), rank_axis=lambda p: (True, True),
                   transpose=_partner("alltoall")),
        _reduction_spec(
            "reduce_scatter", lambda p, x: [_with_shape(x, x.shape[1:])],
            _jvp_sum_over_ranks("reduce_scatter", lambda y, p: _call("allgather", y, p)),
            alias=None, rank_axis=lambda p: (True, False), transpose=_partner("allgather"),
        ),
        _reduction_spec("scan", _like(0), _jvp_scan, transpose=_t_scan),
        _reduction_spec("exscan", _like(0), _jvp_exscan(False), transpose=_t_exscan(False)),
        Collective("send", lambda p, x: [], {"dest": "peer", "tag": "tag"}, transpose=_t_send,
                   point_to_point=True),
        Collective("recv", _like(0), {"source": "peer2", "tag": "tag2", "status": "status"},
                   alias=(0, 0), transpose=_t_recv, point_to_point=True,
                   refuse_derivative=_refuse_any_source),
        Collective("sendrecv", _like(1),
                   {"dest": "peer", "source": "peer2", "sendtag": "tag", "recvtag": "tag2",
                    "status": "status"},
                   alias=(1, 0), transpose=_t_sendrecv, point_to_point=True,
                   refuse_derivative=_refuse_any_source),
        Collective("barrier", lambda p: []),
        # Private: no data moves, the ranks agree on a zero-size array's shape and dtype
        # (a composite's global array: vjpmpi.fft); transpose: itself.
        Collective("agree", _like(0), transpose=_partner("agree")),
        # Private: the identity at this point of the program's order (no MPI call, no
        # trace, never asynchronous), opaque to XLA's fusion: vjpmpi.nn's pipeline holds
        # values there; transpose: itself. (Pairs with nothing: no part in the agreement.)
        Collective("hold", _like(0), alias=(0, 0), transpose=_partner("hold"),
                   point_to_point=True),
        # The replicated-value pair (JAX's psum / pvary, Megatron's g / f).
        Collective("sum_replicated", _like(0), _RED, alias=(0, 0), target="allreduce",
                   transpose=_partner("use_replicated")),
        Collective("use_replicated", _like(0), target=None,
                   transpose=_partner("sum_replicated", red=SUM)),
        # Private, for the derivatives: scans from the last rank down, the product of
        # the other ranks' values, and the linear recurrence e_s = sum_{q before s} b_q prod_{q < r < s} a_r (linear in b).
        _reduction_spec("exscan_reversed", _like(0), _jvp_exscan(True), target="exscan",
                        fixed=_REVERSED, transpose=_t_exscan(True)),
        Collective("others_product", _like(0), linear=lambda p: False,
                   nonlinear_jvp=_jvp_others_product),
        *[Collective(name, _like(1), fixed=fixed, alias=(1, 0), target="recurrence",
                     linear=lambda p: False, nonlinear_jvp=_jvp_recurrence(bool(fixed)),
                     transpose=_t_recurrence(bool(fixed)))
          for name, fixed in [("recurrence", {}), ("recurrence_reversed", _REVERSED)]],
    ]
}
PRIMITIVES, LINEARIZED = {}, {}
for _name, _spec in SPECS.items():
    PRIMITIVES[_name], LINEARIZED[_name] = make_primitive(_spec)


# ------------------------------------------------------------ validation --
def _array(x: Any, op: str, arg: str = "x"):
    if isinstance(x, jax.Array):  # already a JAX array (or tracer): no conversion
        check_dtype(x.dtype, op, arg)
        return x
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.kind in "OSUMm":
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' has dtype {dtype}, which MPI cannot "
                        f"carry (use a bool, integer, float or complex array)")
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' must be an array or convertible to one, "
                        f"got {type(x).__name__} ({err})") from err
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


# Receive statuses: a program names an `MPI.Status` by a slot number (never reused), not
# by its address, and the kernels fill the slot's status only while the object is alive.
_STATUS_SLOTS: dict[int, int] = {}  # id(status) -> slot, while it lives
_next_slot = itertools.count(1)


def _release_status(key: int, slot: int) -> None:
    _STATUS_SLOTS.pop(key, None)
    _kernels.cpu.release_status(slot)


def _status(status: Any, op: str) -> int:
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(
            f"vjpmpi.{op}: argument 'status' must be an mpi4py MPI.Status or None, "
            f"got {type(status).__name__}"
        )
    slot = _STATUS_SLOTS.get(id(status))
    if slot is None:
        slot = _STATUS_SLOTS[id(status)] = next(_next_slot)
        _kernels.cpu.register_status(slot, MPI._addressof(status))
        weakref.finalize(status, _release_status, id(status), slot)
    return slot


def _rank_axis(x, comm, op: str) -> None:
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(
            f"vjpmpi.{op}: argument 'x' must have a leading axis of length comm size "
            f"{comm.size}, got shape {tuple(x.shape)}"
        )


_PEER = {MPI.PROC_NULL: "PROC_NULL"}
_SOURCE = {MPI.PROC_NULL: "PROC_NULL", MPI.ANY_SOURCE: "ANY_SOURCE"}


def _reduction(name: str, x, op, comm, root=None):
    x = _array(x, name)
    c = as_comm(comm, name)
    red = check_red_dtype(as_red(op, name), x.dtype, name)
    extra = {} if root is None else {"root": _rank(root, c, name, "root")}
    (y,) = bind(PRIMITIVES[name], [x], c, red=red, **extra)
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
    return _reduction("reduce", x, op, comm, root)


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


def scatter(x, root, *, comm=None) -> jax.Array:
    """Send block `r` of `root`'s `x` to rank `r`.

    Args:
        x (ArrayLike): on `root`, the blocks stacked on a leading axis of the
            communicator's size; elsewhere a template of one block's shape and dtype.
        root (int): the rank that sends.
        comm (MPI.Intracomm | None): the communicator (None: vjpmpi's default).

    Returns:
        This rank's block.

    Raises:
        ValueError: on `root`, at trace time, for an `x` without that leading axis (only
            the root can check it: the ranks that wait in the scatter for it stop with
            the same message), or a `root` outside the communicator.
        TypeError: an argument of the wrong type or dtype.

    Shape: on `root` `(size, *s)` -> `s`; elsewhere `x` is an `s`-shaped template -> `s`.
    Transpose: gather onto `root`.
    """
    x = _array(x, "scatter")
    c = as_comm(comm, "scatter")
    root = _rank(root, c, "scatter", "root")
    # Only the root can check its input: it raises here, and the ranks that wait in the
    # scatter for it stop there with its message (`_collective.refuse_here`).
    if c.rank == root and (x.ndim == 0 or x.shape[0] != c.size):
        refuse_here(c, "scatter", f"argument 'x' on the root (rank {root}) must have a "
                    f"leading axis of length comm size {c.size}, got shape {tuple(x.shape)}",
                    root=root)
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
        dest=_rank(dest, c, "send", "dest", _PEER), tag=_tag(tag, "send", "tag"),
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
        source=_rank(source, c, "recv", "source", _SOURCE),
        tag=_tag(tag, "recv", "tag", any_ok=True), status=_status(status, "recv"),
    )
    return y


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    Shape: (`s`, template `t`) -> `t`.
    Transpose: sendrecv with `source` and `dest` swapped.
    """
    return _sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag,
                     comm=comm, status=status)


def _sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
              status=None, invalid=None):
    """`sendrecv`; `invalid`: an argument error found by a caller on this rank only (a
    refusal, `_collective.bind`: the job ends with it when the exchange runs)."""
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
        dest=_rank(dest, c, "sendrecv", "dest", _PEER),
        source=_rank(source, c, "sendrecv", "source", _SOURCE),
        sendtag=_tag(sendtag, "sendrecv", "sendtag"),
        recvtag=_tag(recvtag, "sendrecv", "recvtag", any_ok=True),
        status=_status(status, "sendrecv"), invalid=invalid,
    )
    return y


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
    as_comm(comm, "fence")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [hold(_array(a, "fence", "tree"), comm) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


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


def barrier(*, comm=None):
    """Block until every rank of `comm` has reached the barrier. Returns None.

    Transpose: barrier (it carries no data).
    """
    bind(PRIMITIVES["barrier"], [], as_comm(comm, "barrier"))


# ------------------------------------------------ the replicated-value pair --
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
    x = _array(x, "sum_replicated")
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
    x = _array(x, "use_replicated")
    c = as_comm(comm, "use_replicated")
    (y,) = bind(PRIMITIVES["use_replicated"], [x], c)
    return y
