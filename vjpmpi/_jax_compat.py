"""Every use of JAX internals in vjpmpi, in one place.

JAX's public API has no hooks for what a communicating primitive needs (to be kept
through dead-code elimination, ordered across loops, branches and nested calls), so
vjpmpi uses a few private modules and rules; a JAX upgrade that breaks vjpmpi breaks
here first. Tested with JAX 0.7.1 to 0.12.0.1 (CI runs both ends).

`install` puts the patches in, once, at import (`_seam.install`). JAX calls them for
every program in the process; each leaves a program without vjpmpi primitives as it
was (tests/test_no_side_effects.py); each one's docstring says why no scoped hook serves.

Names come from JAX's public modules where they re-export one (`jax.extend.core`,
`jax.interpreters.*`, `jax.extend.source_info_util`, `jax.core`, `jax.ffi`, `jax.typeof`,
`jax.lax.while_p`, jaxlib's `stablehlo`), and a name public on newer JAX only from its
public home where the installed JAX has one (`_public`); `jax._src` where none does. The
package imports names from here, never a JAX module (tests/test_jax_seam.py). Private,
with what each is for and the JAX versions with a public home:

- `jax._src.core`: `jaxprs_in_params` (an equation's nested jaxprs; `jax.extend.core`
  from 0.10), `abstract_token` (the chain token's aval; `jax.core` to 0.9, `jax.ffi`
  from 0.11), `set_current_trace` (`_run_tangent_rules`; `jax.extend.core` from 0.10),
  `trace_state_clean` (`outside_traces`).
- `jax._src.interpreters.ad`: `LinearizeTrace`, `LinearizeTracer` (`_run_tangent_rules`).
- `jax._src.interpreters.mlir`: `jaxpr_subcomp`, the attribute JAX's rules look up.
- `jax._src.interpreters.partial_eval`: `JaxprStackFrame` (`_keep_traced_equations`;
  public in 0.7.1 only), `_default_dce_rule` (`_guard_dce_rules`; JAX's removable
  effects change between releases, so it is not copied), `EffectHandle` and
  `new_eqn_recipe` (`keep_in_partial_eval`; the latter public in 0.7.1 and 0.11.1+).
- `jax._src.effects`: `Effect` (`jax.extend.core` from 0.10) and the effect-type sets
  `control_flow_allowed_effects`, `custom_derivatives_allowed_effects`,
  `remat_allowed_effects`, `ordered_effects`, `partial_eval_kept_effects`
  (`_register_effect`; `lowerable_effects` is public in `jax.interpreters.mlir`).
- `jax._src.source_info_util`: `user_frames` (the user's frames of a call site).
- `jax._src.xla_bridge`: `backends_are_initialized` (`cpu_client_started`).
- `jax._src.callback`: `_FlatCallback`; `jax._src.debugging`: `debug_callback_impl`
  (`_track_host_callbacks`).
- `jax._src.export._export`: `call_exported_p`, the primitive that calls a deserialized
  `jax.export` function (its `exported` parameter is the `Exported`).
- `jax._src.interpreters.pxla`: `ExecuteReplicated` (`_one_error_type`).

Of these 23, JAX 0.7.1 runs 20 (`abstract_token`, `JaxprStackFrame`, `new_eqn_recipe`
public), 0.10 20 (`Effect`, `jaxprs_in_params`, `set_current_trace`), 0.12 18 (those
three, `abstract_token`, `new_eqn_recipe`). Undocumented attributes of public objects:
a lowering context's `module_context.axis_context` (`lowering_devices`) and
`module_context.lowering_parameters.for_export` (`lowering_for_export`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax.core import ShapedArray, eval_jaxpr
from jax.extend import core as _extend_core
from jax.extend import source_info_util
from jax.extend.core import Jaxpr, Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe
from jax.interpreters.ad import (Zero, instantiate_zeros, is_undefined_primal, primitive_jvps,
                                 primitive_transposes)
from jax.interpreters.batching import primitive_batchers
from jax.interpreters.mlir import register_lowering
from jaxlib.mlir.dialects import stablehlo as hlo

# no public module re-exports these (the module docstring says what each is for)
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import source_info_util as _source_info
from jax._src import xla_bridge as _xla_bridge
from jax._src.export._export import call_exported_p
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla

# the sharding half of the seam (its own module: shard_map, device layouts)
from ._jax_shard import (axis_rank, check_vma, device_where, extend_axes, lower_fun,
                         lowering_devices, manual_axis_size, named_axes, pvary, reshaped,
                         reshard, explicit_axes, context_mesh, vma_of,
                         with_vma)

# The names the rest of the package uses: rule tables, types and helpers, never a module.
__all__ = [
    "Primitive", "Jaxpr", "ShapedArray", "Zero", "instantiate_zeros", "is_undefined_primal",
    "primitive_jvps", "primitive_transposes", "primitive_batchers", "register_lowering",
    "abstract_token", "no_effects", "jaxprs_in_params", "outside_traces", "user_frames",
    "Effect", "cpu_client_started", "install", "keep_alive_in_dce", "keep_in_partial_eval",
    "chain_token", "set_chain_token", "lowering_devices", "lowering_for_export", "ClosedJaxpr",
    "check_vma", "vma_of", "with_vma", "pvary", "device_where", "lower_fun", "axis_rank",
    "manual_axis_size", "named_axes", "reshaped", "reshard", "explicit_axes", "context_mesh",
    "inside_host_callback", "exported_text", "call_exported_p", "trace_state", "eval_jaxpr",
    "RunError", "block_for_errors",
]


def _public(module, name: str):
    """`module.name` where the installed JAX has it (without a deprecation), else None."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return getattr(module, name, None)
        except DeprecationWarning:
            return None


Effect = _public(_extend_core, "Effect") or _effects.Effect
abstract_token = (_public(jax.ffi, "abstract_token") or _public(jax.core, "abstract_token")
                  or _core.abstract_token)
no_effects: frozenset = frozenset()  # (JAX's `core.no_effects` is this)
jaxprs_in_params = _public(_extend_core, "jaxprs_in_params") or _core.jaxprs_in_params
_set_current_trace = _public(_extend_core, "set_current_trace") or _core.set_current_trace
_JaxprStackFrame = _public(pe, "JaxprStackFrame") or _pe.JaxprStackFrame
_new_eqn_recipe = _public(pe, "new_eqn_recipe") or _pe.new_eqn_recipe
outside_traces = _core.trace_state_clean  # () -> whether no JAX trace is active
# () -> the active trace, compared by identity (jax.core's in 0.7.1)
trace_state = (_public(_extend_core, "get_opaque_trace_state")
               or jax.core.get_opaque_trace_state)


def user_frames() -> list:
    """The user's frames of the call JAX traces or lowers now (none outside a trace)."""
    tb = source_info_util.current().traceback
    return [] if tb is None else list(_source_info.user_frames(tb))


def _register_effect(effect_type: type, *, ordered: bool) -> None:
    """Allow an effect type wherever JAX checks effects; `ordered`: with an XLA token."""
    kinds = [mlir.lowerable_effects, _effects.control_flow_allowed_effects,
             _effects.custom_derivatives_allowed_effects, _effects.remat_allowed_effects]
    kinds.append(_effects.ordered_effects if ordered else _effects.partial_eval_kept_effects)
    for kind in kinds:
        kind.add_type(effect_type)


def cpu_client_started() -> bool:
    """Whether JAX has created its backends (then CPU dispatch settings are fixed)."""
    return _xla_bridge.backends_are_initialized()


def keep_alive_in_dce(prim: Primitive) -> None:
    """DCE never drops an equation of `prim` (a rule's last argument is the equation:
    `(used_outputs, eqn)`, from JAX 0.12 `(used_outputs, live_ins, eqn)`)."""
    pe.dce_rules[prim] = lambda used_outputs, *rest: ([True] * len(rest[-1].invars), rest[-1])


def _guard_dce_rules(communicates: Callable, skip: Callable) -> None:
    """Wrap every registered DCE rule of a higher-order primitive (loops, conditionals,
    jit, remat, custom derivatives, ...): an equation that `communicates` is kept whole
    even when none of its outputs is used (`skip`: vjpmpi's own). `while_p` and
    `call_exported_p` get JAX's default rule, wrapped. Idempotent. Relies on
    `pe.dce_rules` and `pe._default_dce_rule`."""
    # no entry in `pe.dce_rules`: JAX applies its default rule to these
    extra = {p: _pe._default_dce_rule for p in (jax.lax.while_p, call_exported_p)
             if p not in pe.dce_rules}
    for prim, rule in [*pe.dce_rules.items(), *extra.items()]:
        if skip(prim) or getattr(rule, "vjpmpi_guard", False):
            continue
        pe.dce_rules[prim] = _guarded(rule, communicates)


def _guarded(rule, communicates):
    def dce_rule(used_outputs, *rest):  # (rest: `eqn`, or `live_ins, eqn` from JAX 0.12)
        eqn = rest[-1]
        if not any(used_outputs) and communicates(eqn):
            if not used_outputs:  # nothing to keep alive but the equation itself
                return [True] * len(eqn.invars), eqn
            used_outputs = [True] * len(used_outputs)
        return rule(used_outputs, *rest)

    dce_rule.vjpmpi_guard = True
    return dce_rule


def _keep_traced_equations(communicates: Callable) -> None:
    """Auto-DCE tracing (linearize / vjp) holds effect-free equations weakly; hold those
    that communicate strongly (`add_eqn` with `auto_dce` off, as for effectful ones)."""
    frame = _JaxprStackFrame
    if getattr(frame.add_eqn, "vjpmpi_guard", False):
        return
    original = frame.add_eqn

    def add_eqn(self, eqn):
        if self.auto_dce and not eqn.effects and communicates(eqn):
            self.auto_dce = False  # JAX stores the equation strongly, as it does then
            try:
                original(self, eqn)
            finally:
                self.auto_dce = True
        else:
            original(self, eqn)

    add_eqn.vjpmpi_guard = True
    frame.add_eqn = add_eqn


def _run_tangent_rules(wanted: Callable) -> None:
    """Forward-mode and linearize traces skip a primitive's rule when every input tangent
    is a symbolic zero: the tangent collective (and its transpose) of a collective, or of
    a call, loop, branch or remat holding one (`wanted(primitive, params)`), would vanish
    on the ranks whose inputs do not depend on what is differentiated. Its first
    floating input gets a real zero tangent, *linear* (`linear_zeros_p` of the trace's
    first non-zero tangent: a zero from constants would run in the forward sweep, out of
    turn; plain zeros where the trace has seen none). Idempotent. Relies on the traces'
    `process_primitive`, `to_primal_tangent_pair`, `parent_trace` / `tangent_trace`,
    instance `__dict__` and their tracers' `__init__(self, trace, primal, tangent)`."""
    for trace_type, tracer_type, tangents_of in [
        (ad.JVPTrace, ad.JVPTracer, lambda trace: trace.parent_trace),
        (_ad.LinearizeTrace, _ad.LinearizeTracer, lambda trace: trace.tangent_trace),
    ]:
        original = trace_type.process_primitive
        if getattr(original, "vjpmpi_guard", False):
            continue

        def process_primitive(self, primitive, tracers, params, /, _original=original,
                              _tracer=tracer_type, _tangents_of=tangents_of):
            if wanted(primitive, params):
                tracers = _with_a_real_tangent(self, tracers, _tracer, _tangents_of(self))
            return _original(self, primitive, tracers, params)

        process_primitive.vjpmpi_guard = True
        trace_type.process_primitive = process_primitive
        tracer_type.__init__ = _recording_anchor(tracer_type.__init__)


def _recording_anchor(init):
    def __init__(self, trace, primal, tangent):
        init(self, trace, primal, tangent)
        if type(tangent) is not ad.Zero and "_vjpmpi_anchor" not in trace.__dict__:
            trace.__dict__["_vjpmpi_anchor"] = tangent

    return __init__


def _with_a_real_tangent(trace, tracers, tracer_type, tangent_trace):
    pairs = [trace.to_primal_tangent_pair(t) for t in tracers]
    if any(type(t) is not ad.Zero for _, t in pairs):
        return tracers
    for i, (primal, _) in enumerate(pairs):
        aval = jax.typeof(primal)
        if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.inexact):
            anchor = trace.__dict__.get("_vjpmpi_anchor")
            with _set_current_trace(tangent_trace):
                zero = (ad.instantiate_zeros(ad.Zero(aval.to_tangent_aval())) if anchor is None
                        else linear_zeros_p.bind(anchor, aval=aval.to_tangent_aval()))
            return [*tracers[:i], tracer_type(trace, primal, zero), *tracers[i + 1:]]
    return tracers


# zeros of `aval`, linear in (and independent of) its operand (a zero cotangent back)
linear_zeros_p = Primitive("vjpmpi_linear_zeros")
linear_zeros_p.def_impl(lambda anchor, *, aval: _zeros(aval))
linear_zeros_p.def_abstract_eval(lambda anchor, *, aval: aval)  # (its shard_map typing too)
mlir.register_lowering(linear_zeros_p, mlir.lower_fun(lambda anchor, *, aval: _zeros(aval),
                                                      multiple_results=False))
ad.primitive_jvps[linear_zeros_p] = lambda primals, tangents, *, aval: (_zeros(aval), ad.Zero(aval))
ad.primitive_transposes[linear_zeros_p] = lambda ct, anchor, *, aval: [ad.Zero(anchor.aval)]
batching.primitive_batchers[linear_zeros_p] = (
    lambda args, dims, *, aval: (_zeros(aval), None))  # not batched


def _zeros(aval):
    return jnp.zeros(aval.shape, aval.dtype)


def keep_in_partial_eval(prim: Primitive) -> None:
    """JaxprTrace rule for `prim`: JAX's default, but the staged equation is always kept
    (`jax.linear_transpose` / `jax.linearize` keep what the outputs reach: a collective
    with no used output would vanish on that rank only). Relies on `pe.JaxprTracer`,
    `pe.PartialVal`, `new_eqn_recipe`, `EffectHandle` and the trace's internals."""

    def rule(trace, *tracers, **params):
        known = [t.pval.get_known() for t in tracers]
        if all(k is not None for k in known):
            return trace.parent_trace.process_primitive(prim, known, params)
        tracers = [trace.instantiate_const(t) for t in tracers]
        out_avals, effs = prim.abstract_eval(*[t.aval for t in tracers], **params)
        outs = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None) for a in out_avals]
        source = source_info_util.current().replace(
            name_stack=trace._current_truncated_name_stack())
        eqn = _new_eqn_recipe(trace, tracers, outs, prim, params, effs, source)
        trace.effect_handles.append(_pe.EffectHandle(tracers, eqn))
        for t in outs:
            t.recipe = eqn
        return outs

    pe.custom_partial_eval_rules[prim] = rule


ClosedJaxpr = getattr(_extend_core, "ClosedJaxpr", Jaxpr)  # (0.11: = Jaxpr, 0.12: gone)


class _Chains(threading.local):
    def __init__(self):
        self.modules = []  # MLIR modules whose main function started a chain


_chains = _Chains()


def _ordered_lowering(effect, mark: Callable, contains: Callable,
                     unchained: Callable) -> None:
    """Make JAX's lowering thread one XLA token for `effect` through a whole module.

    Wraps `mlir.jaxpr_subcomp` (it lowers every jaxpr: main function, loop bodies,
    branches, calls). Its first call for a module whose jaxpr `contains` a collective
    lowers `mark(jaxpr)` (the ordered `effect` on every collective and every equation
    holding one) with a fresh token, which JAX's rules pass through loops, branches and
    calls as for `io_callback(ordered=True)`; the last one is dropped in the main
    function (no token in or out: JAX's fast dispatch stays). A collective lowered in the
    chain without the token raises `unchained(jaxpr, name_stack)`. Relies on
    `jaxpr_subcomp`'s signature, `ctx.module`, `mlir.TokenSet` and on JAX's rules looking
    the function up as a module global at call time. Idempotent."""
    original = _mlir.jaxpr_subcomp
    if getattr(original, "vjpmpi_guard", False):
        return

    def jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, consts, *args, **kwargs):
        module = ctx.module
        chained = any(m is module for m in _chains.modules)
        if effect in tokens.effects() or not contains(jaxpr):
            return original(ctx, jaxpr, name_stack, tokens, consts, *args, **kwargs)
        if chained:  # a construct lowers a marked jaxpr without passing the token on
            try:
                return original(ctx, jaxpr, name_stack, tokens, consts, *args, **kwargs)
            except KeyError as err:  # (JAX < 0.8 looks the missing token up itself)
                if err.args != (effect,):
                    raise
                raise unchained(jaxpr, name_stack) from None
        tokens = mlir.TokenSet({**dict(tokens.items()), effect: hlo.create_token()})
        _chains.modules.append(module)
        try:
            outs, tokens_out = original(ctx, mark(jaxpr), name_stack, tokens, consts,
                                        *args, **kwargs)
        finally:
            _chains.modules.pop()
        return outs, mlir.TokenSet({e: t for e, t in tokens_out.items() if e is not effect})

    jaxpr_subcomp.vjpmpi_guard = True
    jaxpr_subcomp.__wrapped__ = original
    _mlir.jaxpr_subcomp = jaxpr_subcomp


def chain_token(ctx: mlir.LoweringRuleContext, effect):
    """The token of `effect` this equation receives (None outside a chain)."""
    return ctx.tokens_in.get(effect) if effect in ctx.tokens_in.effects() else None


def set_chain_token(ctx: mlir.LoweringRuleContext, effect, token) -> None:
    """Hand the next token of `effect` on to the following equations."""
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))


def lowering_for_export(ctx: mlir.LoweringRuleContext) -> bool:
    """Whether the program being lowered is being exported (`jax.export`)."""
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def _carry_while_predicate(cond_communicates: Callable, batched: Callable) -> None:
    """vmap of a `while_loop` whose condition communicates: `batched(axis_data, args,
    dims, **params)`, a loop that carries its predicate. JAX lowers a condition holding
    an ordered effect by moving it into the body, which drops the per-member select of a
    batched predicate (members done would go on); its rule for a carried predicate keeps
    it. Relies on `batching.fancy_primitive_batchers` and `while_p`'s params. Idempotent."""
    original = batching.fancy_primitive_batchers[jax.lax.while_p]
    if getattr(original, "vjpmpi_guard", False):
        return

    def rule(axis_data, args, dims, **params):
        if cond_communicates(params["cond_jaxpr"].jaxpr):
            return batched(axis_data, args, dims, **params)
        return original(axis_data, args, dims, **params)

    rule.vjpmpi_guard = True
    batching.fancy_primitive_batchers[jax.lax.while_p] = rule


class _Callbacks(threading.local):
    depth = 0  # the host callbacks running on this thread


_callbacks = _Callbacks()


def _counting(fn):
    def wrapper(*args, **kwargs):
        _callbacks.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _callbacks.depth -= 1

    wrapper.vjpmpi_guard = True
    return wrapper


def _track_host_callbacks() -> None:
    """Count the host callbacks running on this thread: pure_callback and io_callback
    run through `_FlatCallback.__call__`, jax.debug.callback through
    `debug_callback_impl` (a module global looked up at call time). Idempotent."""
    from jax._src import callback, debugging

    if not getattr(callback._FlatCallback.__call__, "vjpmpi_guard", False):
        callback._FlatCallback.__call__ = _counting(callback._FlatCallback.__call__)
    if not getattr(debugging.debug_callback_impl, "vjpmpi_guard", False):
        debugging.debug_callback_impl = _counting(debugging.debug_callback_impl)


def inside_host_callback() -> bool:
    """Whether this thread is running a JAX host callback."""
    return _callbacks.depth > 0


def exported_text(exported) -> str:
    """The StableHLO text of a `jax.export.Exported` (public API: `mlir_module()`)."""
    return str(exported.mlir_module())


class RunError(jax.errors.JaxRuntimeError, ValueError):
    """A vjpmpi call that failed when it ran, raised by JAX's compile path: a ValueError,
    as JAX's compiled-call fast path raises the same failure, and a JaxRuntimeError, as
    JAX raised it there before."""


def _one_error_type() -> None:
    """A compiled program whose vjpmpi call fails raises a ValueError on every path.

    JAX raises a failed run as `jax.errors.JaxRuntimeError` (a RuntimeError) where the
    call compiles or dispatches from Python, and as a plain ValueError from its C++ fast
    path (a program already compiled: jaxlib's PjitFunction turns any failed status into
    ValueError). A rank on each path would need two `except` clauses, and a user who catches
    the first type leaves an uncaught error on a rank where the other came, while the
    others go on. The Python path's executions all run through
    `ExecuteReplicated.__call__`: a failure whose text is vjpmpi's (the kernels' errors
    start "vjpmpi.<op>:" or "vjpmpi:") leaves it as `RunError`, which is both types. No
    public hook turns a run's error into another type; programs without vjpmpi calls
    raise as before."""
    call = _pxla.ExecuteReplicated.__call__

    def execute(self, *args):
        try:
            return call(self, *args)
        except jax.errors.JaxRuntimeError as err:
            if isinstance(err, ValueError) or not _is_vjpmpi_failure(str(err)):
                raise
            raise RunError(*err.args).with_traceback(err.__traceback__) from None

    execute.__wrapped__ = call
    _pxla.ExecuteReplicated.__call__ = execute


def _is_vjpmpi_failure(text: str) -> bool:
    """Whether a failed run's text is a vjpmpi kernel's error (after XLA's status code)."""
    head = text[:40]
    return "vjpmpi." in head or "vjpmpi:" in head


def block_for_errors(outs):
    """`outs` once ready; a vjpmpi failure of the program that computes them raised here as
    `RunError`. A program over several devices of a process reports a failure when its
    results are used (`block_until_ready`, `np.asarray`), as JaxRuntimeError: vjpmpi's
    eager calls on sharded arrays wait here, so that they raise at the call as every
    eager call does."""
    try:
        return jax.block_until_ready(outs)
    except jax.errors.JaxRuntimeError as err:
        if isinstance(err, ValueError) or not _is_vjpmpi_failure(str(err)):
            raise
        raise RunError(*err.args).with_traceback(err.__traceback__) from None


_installed = False


def install(*, ordered, linearized, communicates: Callable,
            binds_collective: Callable, is_own: Callable, contains: Callable, mark: Callable,
            unchained: Callable, batched_while: Callable, extended: Callable,
            extended_psum: Callable) -> None:
    """Put vjpmpi's patches into JAX (the module docstring lists them), once; a second
    call does nothing. `ordered` / `linearized`: the chain's effect and that of tangent
    collectives; `communicates(eqn)`, `binds_collective(prim, params)`, `is_own(prim)`,
    `contains(jaxpr)`: what holds a collective; `mark(jaxpr)`: the program on the chain;
    `unchained(jaxpr, where)`: the error for a collective lowered off the chain;
    `batched_while`: vmap of a loop whose condition communicates; `extended(axis)`: whether
    vjpmpi extends a mesh axis across processes, `extended_psum(x, axis)` the sum there."""
    global _installed
    if _installed:
        return
    # (the wrappers here sit between the user's code and JAX's: like JAX's own files, this
    # one is left out of programs' source locations and of filtered tracebacks)
    source_info_util.register_exclusion(__file__)
    _register_effect(type(ordered), ordered=True)
    _register_effect(type(linearized), ordered=False)
    _guard_dce_rules(communicates, is_own)  # (the one scan of JAX's DCE rules)
    _keep_traced_equations(communicates)
    # Every rank runs every tangent collective (and so its transpose), also where its
    # inputs do not depend on what is differentiated.
    _run_tangent_rules(binds_collective)
    _track_host_callbacks()
    _one_error_type()
    _ordered_lowering(ordered, mark, contains, unchained)
    _carry_while_predicate(contains, batched_while)
    extend_axes(extended, extended_psum)
    _installed = True
