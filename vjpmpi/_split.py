"""`vjpmpi.start` / `vjpmpi.wait`: a point-to-point call split in two, so that what the
program computes between them runs while the message travels.

The start is one custom call on the ordering chain that posts the call's messages
(nonblocking) and returns at once; the wait is another, later on the chain, that
completes when they are done (csrc/async.h, `Started`). Where only vjpmpi calls can stop
the program (`_buffers`), MPI reads and writes XLA's own buffers: the start's result is
the buffer received into (the wait's result aliases it) and the wait takes the array
sent, so that XLA keeps both until then; elsewhere the call copies into buffers of its
own. In a jaxpr the pair is two primitives around a *state*, the call's operands passed
through:

- `start_p(*operands) -> state`, `wait_p(*state) -> results` (the op's results);
- as a linear map, the state is the operands with the op's result in the slot of the
  operand its result aliases (the receive template), so the tangent or cotangent
  collective runs at the start, in the program's order of calls (the backward pass
  reverses it on every rank, whatever the order of the waits).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import jax
import numpy as np
from mpi4py import MPI

from . import _jax_compat as jc
from ._bind import eager
from . import _placement
from ._bind import ranks_operand
from ._lowering import WHERE, chained_call, device_where, ffi_attrs
from ._lowering import same_value
from ._ordering import LOWERING_CHECKS, PROGRAM_PARAMS
from ._p2p import prepare
from ._mpi import DeviceCommRef
from ._primitive import (LIN_OF, ORDERED, SPEC_OF, Collective, contains_collective,
                         dynamic_ranks, register)
from ._rules import batch, tangents_out, transpose

_SLOTS = itertools.count(1)  # (the start's number in this process: its wait names it)
_LOCK = threading.Lock()


class Pending:
    """A point-to-point call that `vjpmpi.start` began; `vjpmpi.wait` ends it (once).

    Made by `vjpmpi.start`, not by the user, and passed as it is to `vjpmpi.wait`; its
    fields are private (`_name`, `_state`, ...), and its repr shows the op and whether it
    was waited for (`vjpmpi.Pending(sendrecv, pending)`).

    Attributes:
        name (str): the op: `"send"`, `"recv"` or `"sendrecv"`.
        state (list): the started call's state: its operands passed through (in a trace,
            the start's results, which the wait consumes).
        params (dict): the start's parameters (the op's primitive and parameters, its
            slot and communicator).
        trace (Any): the trace the call was started in (None for an eager start); the
            wait must be in the same one.
        eager (bool): whether it was started outside any trace (then the wait blocks
            until the call has ended).
    """

    def __init__(self, name, state, params, trace=None, eager=False):
        self._name, self._state, self._params = name, state, params
        self._trace, self._eager, self._waited = trace, eager, False

    def __repr__(self):
        done = "waited" if self._waited else "pending"
        return f"vjpmpi.Pending({self._name}, {done})"


def start(op: Callable, *args: Any, **kwargs: Any) -> Pending:
    """Begin the point-to-point call `op(*args, **kwargs)` (`vjpmpi.send`, `recv` or `sendrecv`).

    `vjpmpi.wait` gives its result. As MPI's Isend / Irecv: the messages are posted and the
    program goes on (the next call, the matching receive say, does not wait for them), and
    what it computes before the wait may run while they travel (on CPU). Outside `jit` too:
    the start returns once the call is posted, and the wait blocks until it has ended.
    XLA:CPU fuses and schedules freely: put the independent computation between `fence`s.

    Args:
        op (Callable): `vjpmpi.send`, `vjpmpi.recv` or `vjpmpi.sendrecv` itself.
        *args (Any): `op`'s positional arguments.
        **kwargs (Any): `op`'s keyword arguments (not `status`; a receive names its
            `source`).

    Returns:
        (Pending): A `Pending` call, for `vjpmpi.wait`.

    Raises:
        TypeError: when `op` is not a vjpmpi function, or for `op`'s own argument errors
            (an array, dtype, rank, tag or communicator of the wrong type).
        NotImplementedError: when `op` is another vjpmpi function (a collective, say), a
            `status` is given, or the receive's `source` is `MPI.ANY_SOURCE`; and, when the
            program is lowered for GPU, always (a started call runs on CPU only).
        ValueError: for `op`'s own argument errors (a rank, tag or communicator out of
            range); and, when the program is lowered, if the start has no `vjpmpi.wait` in
            the same function (or loop or branch body).
        RuntimeError: when MPI has been finalized, or when called from inside a host
            callback.

    Shape:
        `op`'s, at the wait.

    Transpose:
        `op`'s transpose, at the start (the backward pass reverses the order of the
        starts on every rank, whatever the order of the waits).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        def step(u):  # a ring shift, and local work while the message travels
            p = vjpmpi.start(vjpmpi.sendrecv, u, jnp.zeros_like(u), (r - 1) % n, (r + 1) % n)
            local = vjpmpi.fence(2 * u)
            return vjpmpi.wait(p) + local
        y = jax.jit(step)(jnp.full(3, float(r)))
        assert (y == (r - 1) % n + 2 * r).all()
        ```
    """
    prepare_call = next((f for o, f in prepare.items() if op is o), None)
    if prepare_call is None:
        if _name(op).startswith("vjpmpi."):
            raise NotImplementedError(
                f"vjpmpi.start: {_name(op)} cannot be split; only vjpmpi.send, recv and "
                "sendrecv can. Large collectives overlap computation without a split: see "
                "vjpmpi.async_threshold.")
        raise TypeError(f"vjpmpi.start: argument 'op' must be vjpmpi.send, vjpmpi.recv or "
                        f"vjpmpi.sendrecv itself (its result is the call's), not {_name(op)}")
    started = prepare_call(*args, **kwargs)  # (checked, converted: not bound)
    prim, arrays, comm, params = started.prim, started.arrays, started.comm, started.params
    spec = SPEC_OF[prim]
    if params.get("status", 0):
        raise NotImplementedError(
            f"vjpmpi.start: argument 'status' of vjpmpi.{spec.name} is not supported "
            "in a started call")
    if isinstance(params.get("source"), int) and params["source"] == MPI.ANY_SOURCE:  # (the
        raise NotImplementedError(  # check's header and the data could come from two senders)
            f"vjpmpi.start: argument 'source' of vjpmpi.{spec.name} must name a rank "
            "(or MPI.PROC_NULL) in a started call, not MPI.ANY_SOURCE")
    name = spec.name
    if jc.outside_traces():
        state, params = _start_eagerly(prim, arrays, comm, params)
        return Pending(name, state, params, eager=True)
    with _LOCK:
        slot = next(_SLOTS)
    if isinstance(comm, DeviceCommRef):  # (ranks each device computes: the `ranks` operand)
        if jc.check_vma():  # (each device's call is its own: its arrays vary over the axis)
            arrays = [a if comm.axis in jc.vma_of(jax.typeof(a)) else jc.pvary(a, (comm.axis,))
                      for a in arrays]
        params, ranks = ranks_operand(spec, params)
        arrays = [*arrays, *ranks]
    params = {"inner": prim, "slot": slot, "comm": comm, **params}
    state = start_p.bind(*arrays, **params)
    return Pending(name, state, params, trace=jc.trace_state())


def wait(pending: Pending) -> Any:
    """End the call that `pending` began: the array received (`recv`, `sendrecv`) or None (`send`).

    Call it once, in the function that called `vjpmpi.start` (outside `jit`: after it,
    anywhere; it blocks until the call has ended).

    Args:
        pending (Pending): what `vjpmpi.start` returned.

    Returns:
        (jax.Array | None): The op's result: the array received (the template's shape and
            dtype), or None for a send.

    Raises:
        TypeError: when `pending` is not a `Pending`.
        ValueError: when it was waited for already, or started in another function or
            trace (jit, a loop or branch body, a transformation); and, when the program is
            lowered, if the start is in another function (or loop or branch body).

    Shape:
        the op's result.

    Transpose:
        none (the op's transpose runs at the start).
    """
    if not isinstance(pending, Pending):
        raise TypeError(f"vjpmpi.wait: argument 'pending' must be what vjpmpi.start "
                        f"returned, not {type(pending).__name__}")
    if pending._waited:
        raise ValueError(f"vjpmpi.wait: {pending._name} was already waited for; wait once "
                         "for each vjpmpi.start")
    if pending._eager:
        pending._waited = True
        outs = _wait_eagerly(pending._state, pending._params)
        return outs[0] if SPEC_OF[pending._params["inner"]].alias is not None else None
    if jc.outside_traces() or jc.trace_state() != pending._trace:
        raise ValueError(
            f"vjpmpi.wait: the {pending._name} was started in another function or trace "
            "(jit, a loop or branch body, a transformation); call vjpmpi.wait in the one "
            "that called vjpmpi.start")
    outs = wait_p.bind(*pending._state, **pending._params)
    pending._waited = True
    return outs[0] if outs else None


def _name(op) -> str:
    name = getattr(op, "__qualname__", None) or repr(op)
    return f"vjpmpi.{name}" if getattr(op, "__module__", "").startswith("vjpmpi") else name


# ----------------------------------------------------------------- primitives --
start_p = jc.Primitive("vjpmpi_start")
wait_p = jc.Primitive("vjpmpi_wait")
start_p.multiple_results = wait_p.multiple_results = True


def _effects(ordered):
    return {ORDERED} if ordered else jc.no_effects


def _start_abstract(*avals, ordered=False, **params):
    return list(avals), _effects(ordered)


def _wait_abstract(*avals, inner, ordered=False, sig=0, invalid=0, note=0, slot=0, comm=None,
                   **params):
    outs = SPEC_OF[inner].out_avals(params, *(avals[:-1] if dynamic_ranks(params) else avals))
    if slot < 0 and not outs:  # (an eager send's wait: a result to block on)
        outs = [jc.ShapedArray((0,), np.uint8)]
    return outs, _effects(ordered)


start_p.def_effectful_abstract_eval(_start_abstract)
wait_p.def_effectful_abstract_eval(_wait_abstract)


# Eager starts: the call started by a program of its own and ended by another (the
# kernels key it by its slot alone: a negative one), the wait blocking until it has
# ended. Slots come from a pool, so that each one's two programs compile once per shape;
# a slot goes back once its wait has ended (a later start can then take it).
_EAGER_FREE: list[int] = []
_EAGER_NEXT = itertools.count(1)


def _start_eagerly(prim, arrays, comm, params) -> tuple[list, dict]:
    """Start `prim`'s call on `arrays` now; (its state, the start's parameters)."""
    with _LOCK:
        slot = _EAGER_FREE.pop() if _EAGER_FREE else -next(_EAGER_NEXT)
    params = {"inner": prim, "slot": slot, "comm": comm, **params}
    try:
        with jax.disable_jit(False):  # (compiled whatever the caller's setting)
            state = eager(start_p, params)(*arrays)
    except BaseException:
        _release(slot)
        raise
    return state, params


def _wait_eagerly(state, params) -> list:
    try:
        with jax.disable_jit(False):
            return jax.block_until_ready(eager(wait_p, params)(*state))
    finally:
        _release(params["slot"])


def _release(slot: int) -> None:
    with _LOCK:
        _EAGER_FREE.append(slot)


# Outside a compiled program (an eager backward pass, `jax.disable_jit`): the same.
_EAGER_STARTS: dict[int, dict] = {}


def _start_impl(*args, **params):
    spec, inner = _inner(params)
    state, _EAGER_STARTS[params["slot"]] = _start_eagerly(params["inner"], args,
                                                          inner.pop("comm"), inner)
    return state


def _wait_impl(*state, **params):
    outs = _wait_eagerly(state, _EAGER_STARTS.pop(params["slot"]))
    return outs if _slot_of_result(_inner(params)[0]) is not None else []


start_p.def_impl(_start_impl)
wait_p.def_impl(_wait_impl)


def _inner(params):
    """(the op's spec, its own parameters) from a start_p/wait_p equation's."""
    p = dict(params)
    spec = SPEC_OF[p.pop("inner")]
    p.pop("slot")
    p.pop("own", None)
    return spec, p


def _lower_start(ctx, *args, **params):
    """-> vjpmpi_<op>_start: (operands, token) -> ([r,] token), r where the array received
    lands (the state's result slot; the wait's result aliases it)."""
    spec, inner = _inner(params)
    _cpu_only(ctx, spec)
    where = _placement.placement(ctx, spec.name, inner["comm"])
    if where == "auto":  # (each device starts its own part's call)
        return _placement.wrap(ctx, start_p, SPEC_OF[start_p], params, args)
    attrs = {**ffi_attrs(ctx, spec, inner), "slot": np.int64(params["slot"])}
    arrays = list(args[:-1] if dynamic_ranks(inner) else args)
    target = f"vjpmpi_{spec.ffi_target()}_start"
    if where is None:
        # (own: the call copies from and into buffers of its own; else MPI uses XLA's)
        attrs["own"] = np.int64(params.get("own", 1) or params["slot"] < 0)
        k = _slot_of_result(spec)
        if k is None:
            chained_call(ctx, spec, target, arrays, ctx.avals_in[:len(arrays)], [], attrs)
            return list(args)
        # r takes the template's buffer (holding it where nothing arrives), except where
        # the array sent is the template's own value and a message is sure to come (as
        # the op's own lowering: the two buffers are then read and written at once)
        apart = spec.alias_apart(inner) if spec.alias_apart else None
        alias = {} if apart is not None and same_value(arrays[apart], arrays[k]) else {k: 0}
        (r,) = chained_call(ctx, spec, target, arrays, ctx.avals_in[:len(arrays)],
                            [ctx.avals_in[k]], attrs, alias)
        return [r if i == k else a for i, a in enumerate(args)]
    else:
        attrs["dev"] = where.attribute(inner.get("level", 1), inner.get("layout", 0))
        chained_call(ctx, spec, target + "_dev", [device_where(spec, inner, args), *arrays],
                     [WHERE, *ctx.avals_in[:len(arrays)]], [], attrs)
    return list(args)


def _lower_wait(ctx, *state, **params):
    """-> vjpmpi_wait(_sendrecv, _send): (the arrays the call uses, token) -> ([y,] token):
    the array sent (XLA keeps it until here) and the start's r, which y aliases."""
    spec, inner = _inner(params)
    _cpu_only(ctx, spec)
    where = _placement.placement(ctx, spec.name, inner["comm"])
    if where == "auto":
        return _placement.wrap(ctx, wait_p, SPEC_OF[wait_p], params, state)
    attrs = {"comm": np.int64(inner["comm"].id), "slot": np.int64(params["slot"])}
    if where is None:
        k = _slot_of_result(spec)
        if k is None:  # (a send: its array; an eager one's wait has a result to block on)
            target = "vjpmpi_wait" if ctx.avals_out else "vjpmpi_wait_send"
            return chained_call(ctx, spec, target, [state[0]], ctx.avals_in[:1],
                                ctx.avals_out, attrs)
        if len(state) == 1:  # (a receive: r)
            return chained_call(ctx, spec, "vjpmpi_wait", [state[0]], ctx.avals_in[:1],
                                ctx.avals_out, attrs, {0: 0})
        used = [0, k]  # (a sendrecv: the array sent, r)
        return chained_call(ctx, spec, "vjpmpi_wait_sendrecv", [state[i] for i in used],
                            [ctx.avals_in[i] for i in used], ctx.avals_out, attrs, {1: 0})
    attrs["dev"] = where.attribute(inner.get("level", 1), inner.get("layout", 0))
    w = jc.device_where(None, 0, 0, 0)  # (a wait needs the device's partition only)
    target = "vjpmpi_wait_dev" if ctx.avals_out else "vjpmpi_wait_send_dev"
    return chained_call(ctx, spec, target, [w], [WHERE], ctx.avals_out, attrs)


def _cpu_only(ctx, spec: Collective):
    if "cuda" in ctx.module_context.platforms:
        raise NotImplementedError(
            f"vjpmpi.start: a started {spec.name} runs on CPU only; on GPU call "
            f"vjpmpi.{spec.name} (large calls overlap by vjpmpi.async_threshold)")


jc.register_lowering(start_p, _lower_start, cacheable=False)
jc.register_lowering(wait_p, _lower_wait, cacheable=False)


def _slot_of_result(spec: Collective) -> int | None:
    """The state's slot that holds the op's result in the linear map (None: a send)."""
    return None if spec.alias is None else spec.alias[0]


def _start_jvp(primals, tangents, **params):
    spec, inner = _inner(params)
    state = start_p.bind(*primals, **params)
    arrays = primals[:-1] if dynamic_ranks(inner) else primals  # (less `ranks`)
    avals = spec.out_avals(inner, *[jax.typeof(p) for p in arrays])
    t_outs = tangents_out(LIN_OF[params["inner"]], spec, primals, tangents, avals,
                             inner)
    t_state = list(tangents)
    k = _slot_of_result(spec)
    if k is not None:
        t_state[k] = t_outs[0]
    return state, t_state


def _wait_jvp(primals, tangents, **params):
    spec, _ = _inner(params)
    outs = wait_p.bind(*primals, **params)
    k = _slot_of_result(spec)
    return outs, ([] if k is None else [tangents[k]])


def _start_transpose(cts, *args, **params):
    spec, inner = _inner(params)
    k = _slot_of_result(spec)
    back = transpose(spec, [] if k is None else [cts[k]], *args, **inner)
    out = []
    for i, (a, b) in enumerate(zip(args, back, strict=True)):  # (+ what passed through)
        passed = cts[i] if i != k and jc.is_undefined_primal(a) else None
        if passed is None or type(passed) is jc.Zero:
            out.append(b)
        else:
            out.append(passed if b is None or type(b) is jc.Zero else b + passed)
    return out


def _wait_transpose(cts, *state, **params):
    spec, _ = _inner(params)
    k = _slot_of_result(spec)
    out = []
    for i, s in enumerate(state):
        if not jc.is_undefined_primal(s):
            out.append(None)
        elif i == k:
            out.append(jc.instantiate_zeros(cts[0]))
        else:
            out.append(jc.Zero(s.aval.to_tangent_aval()))
    return out


def _batch(prim, args, dims, **params):
    spec, _ = _inner(params)
    return batch(prim, spec, args, dims, **params)


for _p, _jvp, _t in [(start_p, _start_jvp, _start_transpose),
                     (wait_p, _wait_jvp, _wait_transpose)]:
    jc.primitive_jvps[_p] = _jvp
    jc.primitive_transposes[_p] = _t
    jc.primitive_batchers[_p] = lambda args, dims, _p=_p, **params: _batch(_p, args, dims,
                                                                         **params)
    register(_p, Collective(_p.name.removeprefix("vjpmpi_"), lambda p, *a: [],
                               point_to_point=True))


# ------------------------------------------------------------- pairing check --
def _check_pairs(jaxpr: jc.Jaxpr) -> None:
    """Every start in a program has its wait in the same jaxpr (body), once."""
    starts, waits = {}, {}
    for eqn in jaxpr.eqns:
        if eqn.primitive in (start_p, wait_p) and eqn.params["slot"] < 0:
            continue  # (an eager start or wait: a program of its own)
        if eqn.primitive is start_p:
            starts[eqn.params["slot"]] = eqn
        elif eqn.primitive is wait_p:
            waits[eqn.params["slot"]] = eqn
        for j in jc.jaxprs_in_params(eqn.params):
            if contains_collective(j):
                _check_pairs(j)
    for slot in starts.keys() - waits.keys():
        name = SPEC_OF[starts[slot].params["inner"]].name
        raise ValueError(
            f"vjpmpi.start: a started {name} has no vjpmpi.wait in the same function (or "
            "loop or branch body); every started call must be waited for there, on every "
            "rank")
    for slot in waits.keys() - starts.keys():
        name = SPEC_OF[waits[slot].params["inner"]].name
        raise ValueError(f"vjpmpi.wait: the started {name}'s vjpmpi.start is in another "
                         "function (or loop or branch body); call both in the same one")


LOWERING_CHECKS.append(_check_pairs)


# ---------------------------------------------------------------- buffers --
# What can stop a run other than a vjpmpi call: host callbacks, other libraries' custom
# calls, an exported function's (unseen) contents.
_MAY_FAIL = ("pure_callback", "io_callback", "debug_callback", "ffi_call", "call_exported")


def _may_fail_elsewhere(jaxpr: jc.Jaxpr) -> bool:
    """Whether something in the program other than a vjpmpi call can stop its run."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MAY_FAIL or "callback" in eqn.primitive.name:
            return True
        if any(_may_fail_elsewhere(j) for j in jc.jaxprs_in_params(eqn.params)):
            return True
    return False


def _buffers(jaxpr: jc.Jaxpr) -> dict:
    """A started call's buffers: XLA's own (`own=0`: no copies) where only vjpmpi calls can
    stop the program (a failing one waits until the started calls' messages are done,
    csrc/async.cc ForgetRun, before XLA frees its buffers); else its own (`own=1`), so that
    a run stopped by a host callback that raised leaves MPI nothing of XLA's to write."""
    own = int(_may_fail_elsewhere(jaxpr))
    return {start_p: {"own": own}}


PROGRAM_PARAMS.append(_buffers)
