"""Every use of JAX internals in vjpmpi, in one place.

JAX's public API has no hooks for what a communicating primitive needs (to be kept
through dead-code elimination, and ordered across loops, branches and nested
calls), so vjpmpi uses a few private modules and rules. Each entry below says what
it relies on; a JAX upgrade that breaks vjpmpi breaks here first. Tested with
JAX 0.7.1 to 0.12.0.1 (CI runs both ends; 0.11 and newer on Python 3.13).

Patches that JAX calls for every program in the process, collectives or not (ten
attributes of JAX's, under six functions here; each
leaves a program without vjpmpi primitives unchanged, jaxpr, lowering and result:
tests/test_no_side_effects.py), and why no scoped form exists:

- `guard_dce_rules` wraps the DCE rule of every higher-order primitive (cond, while,
  jit, remat, scan, custom derivatives, ...): JAX picks a rule by the equation's
  primitive, and a loop or branch that holds a collective has no primitive of its
  own to register for.
- `keep_traced_equations` wraps `JaxprStackFrame.add_eqn`: the weak references of
  auto-DCE tracing are kept per frame, not per primitive.
- `run_tangent_rules` wraps `JVPTrace` / `LinearizeTrace.process_primitive` and the
  tracers' `__init__`: JAX skips a rule whose input tangents are all zero before any
  rule of the primitive runs. (JAX 0.11's `ad.linearize_on_zero_tangents` is a set of
  primitives, so it cannot name a jit or loop that holds a collective either.)
- `ordered_lowering` wraps `mlir.jaxpr_subcomp`: the token chain starts at a module's
  main function and passes through every construct's lowering rule; no hook sees a
  module before its first equation.
- `carry_while_predicate` replaces while's batching rule: one rule serves every loop.
- `track_host_callbacks` wraps the functions that run host callbacks: a collective
  called from inside one must know, and JAX has no callback-entry hook.

Names: JAX's public modules where they re-export one (`jax.extend.core`,
`jax.interpreters.*`, `jax.extend.source_info_util`, `jax.core.ShapedArray`,
`jax.typeof`, `jax.lax.while_p`, jaxlib's `stablehlo` dialect), `jax._src` where none
does. The rest of the package imports names from here, never a JAX module, so this
list is the whole seam (tests/test_jax_seam.py holds it to the code). Private, each
with what it is for:

- `jax._src.core`: `jaxprs_in_params` (the nested jaxprs of an equation),
  `abstract_token` (the aval of the chain token an FFI call takes), `set_current_trace`
  and `trace_state_clean` (tracing state: see `run_tangent_rules` and `outside_traces`).
- `jax._src.interpreters.ad`: `LinearizeTrace`, `LinearizeTracer` (see
  `run_tangent_rules`; `JVPTrace`/`JVPTracer` are public).
- `jax._src.interpreters.mlir`: `jaxpr_subcomp`, as the module attribute JAX's rules
  look up (see `ordered_lowering`).
- `jax._src.interpreters.partial_eval`: `JaxprStackFrame` (see `keep_traced_equations`),
  `_default_dce_rule` (see `guard_dce_rules`; JAX's notion of a removable effect
  changes between releases, so it is not copied), `EffectHandle` and
  `new_eqn_recipe` (see `keep_in_partial_eval`; `jax.interpreters.partial_eval`
  re-exports the latter in 0.7.1 and 0.11.1+ only).
- `jax._src.effects`: `Effect` and the effect-type sets `lowerable_effects`,
  `control_flow_allowed_effects`, `custom_derivatives_allowed_effects`,
  `remat_allowed_effects`, `ordered_effects`, `partial_eval_kept_effects` (see
  `register_effect`).
- `jax._src.source_info_util`: `user_frames` (the user's frames of a call site).
- `jax._src.xla_bridge`: `backends_are_initialized` (see `cpu_client_started`).
- `jax._src.callback`: `_FlatCallback` and `jax._src.debugging`: `debug_callback_impl`
  (see `track_host_callbacks`).
- `jax._src.export._export`: `call_exported_p`, the primitive that calls a deserialized
  `jax.export` function (its `exported` parameter is the `Exported`).

Attributes of public objects that JAX does not document: a lowering context's
`module_context.axis_context` (see `program_devices`) and
`module_context.lowering_parameters.for_export` (see `lowering_for_export`).
"""

from __future__ import annotations

import threading
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

# The names the rest of the package uses: rule tables, types and helpers, never a module.
__all__ = [
    "Primitive", "Jaxpr", "ShapedArray", "Zero", "instantiate_zeros", "is_undefined_primal",
    "primitive_jvps", "primitive_transposes", "primitive_batchers", "register_lowering",
    "abstract_token", "no_effects", "jaxprs_in_params", "outside_traces", "user_frames",
    "Effect", "register_effect", "cpu_client_started", "keep_traced_equations",
    "guard_dce_rules", "keep_alive_in_dce", "keep_in_partial_eval", "ordered_lowering",
    "chain_token", "set_chain_token", "program_devices", "lowering_for_export", "mark_jaxpr",
    "track_host_callbacks", "inside_host_callback", "exported_text", "call_exported_p",
    "carry_while_predicate", "run_tangent_rules", "trace_state",
]

Effect = _effects.Effect
abstract_token = _core.abstract_token  # the aval of an XLA token
no_effects: frozenset = frozenset()  # (JAX's `core.no_effects` is this)
jaxprs_in_params = _core.jaxprs_in_params  # every Jaxpr in an equation's params
outside_traces = _core.trace_state_clean  # () -> whether no JAX trace is active
# () -> the active trace, compared by identity (jax.extend.core has it in JAX 0.10 and
# 0.12, jax.core in 0.7.1)
trace_state = (getattr(_extend_core, "get_opaque_trace_state", None)
               or jax.core.get_opaque_trace_state)


def user_frames() -> list:
    """The frames, outside JAX's own files, of the call that JAX is tracing or lowering
    now (`file_name`, `start_line`, `function_name`); none outside a trace."""
    tb = source_info_util.current().traceback
    return [] if tb is None else list(_source_info.user_frames(tb))


# The wrappers below sit between a user's code and JAX's on the Python stack; like JAX's
# own files, this one is left out of the source locations recorded in programs (HLO
# metadata) and of filtered tracebacks.
source_info_util.register_exclusion(__file__)


def register_effect(effect_type: type, *, ordered: bool) -> None:
    """Allow an effect type wherever JAX checks effects (loops, conditionals, custom
    derivatives, remat, lowering); `ordered` also makes JAX's lowering thread an XLA
    token for it. Relies on the effect-type sets of `jax._src.effects`."""
    kinds = [_effects.lowerable_effects, _effects.control_flow_allowed_effects,
             _effects.custom_derivatives_allowed_effects, _effects.remat_allowed_effects]
    kinds.append(_effects.ordered_effects if ordered else _effects.partial_eval_kept_effects)
    for kind in kinds:
        kind.add_type(effect_type)


def cpu_client_started() -> bool:
    """Whether JAX has created its backends (then CPU dispatch settings are fixed).
    Relies on `xla_bridge.backends_are_initialized`."""
    return _xla_bridge.backends_are_initialized()


# --------------------------------------------------- dead code elimination --
def keep_alive_in_dce(prim: Primitive) -> None:
    """DCE never drops an equation of `prim`, used or not. Relies on `pe.dce_rules`
    (rule signature `(used_outputs, eqn)`, from JAX 0.12 `(used_outputs, live_ins, eqn)`,
    `-> (used_inputs, eqn or None)`: the equation is the last argument)."""
    pe.dce_rules[prim] = lambda used_outputs, *rest: ([True] * len(rest[-1].invars), rest[-1])


def guard_dce_rules(communicates: Callable, skip: Callable) -> None:
    """Wrap every registered DCE rule of a higher-order primitive (loops, conditionals,
    jit, remat, custom derivatives, ...) so that an equation that `communicates` is
    kept whole even when none of its outputs is used. `while_p` and `call_exported_p`
    have no entry in `pe.dce_rules` (JAX applies the default rule), so one is added.
    Idempotent. Relies on `pe.dce_rules`, `pe._default_dce_rule` and `loops.while_p`."""
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


def keep_traced_equations(communicates: Callable) -> None:
    """Jaxpr tracing with auto-DCE (JAX's linearize / vjp tangent traces) holds
    effect-free equations weakly and forgets those whose outputs die; hold the ones
    that communicate strongly, as JAX does for effectful equations. Idempotent.
    Relies on `pe.JaxprStackFrame.add_eqn` keeping every equation while `auto_dce` is off."""
    frame = _pe.JaxprStackFrame
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


def run_tangent_rules(wanted: Callable) -> None:
    """Forward-mode and linearize traces skip a primitive's differentiation rule when
    every input tangent is a symbolic zero. For a collective, or a call, loop, branch or
    remat holding one, that would drop the tangent collective (and so its transpose) on
    the ranks whose inputs do not depend on what is differentiated, while the other
    ranks run it. For the primitives `wanted(primitive, params)` names, the first
    floating input then gets a real zero tangent, so the rule runs on every rank.

    That zero must be *linear* (made from the trace's tangents): JAX's backward pass
    evaluates an equation with only constant inputs in its forward sweep instead of
    transposing it, and partial evaluation moves it to the forward program, which
    would run the collective out of turn. So it is `linear_zeros` of a tangent the
    trace has seen (its first non-zero one, recorded as its tracers are made); a
    trace that has seen none gets plain zeros (pure forward mode needs no more).

    Idempotent. Relies on `ad.JVPTrace` / `ad.LinearizeTrace` (`process_primitive`,
    `to_primal_tangent_pair`, `parent_trace`, `tangent_trace`, an instance `__dict__`)
    and `ad.JVPTracer` / `ad.LinearizeTracer.__init__(self, trace, primal, tangent)`."""
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
            with _core.set_current_trace(tangent_trace):
                zero = (ad.instantiate_zeros(ad.Zero(aval.to_tangent_aval())) if anchor is None
                        else linear_zeros_p.bind(anchor, aval=aval.to_tangent_aval()))
            return [*tracers[:i], tracer_type(trace, primal, zero), *tracers[i + 1:]]
    return tracers


# zeros of `aval`, linear in (and independent of) its operand: the transpose gives the
# operand a zero cotangent.
linear_zeros_p = Primitive("vjpmpi_linear_zeros")
linear_zeros_p.def_impl(lambda anchor, *, aval: _zeros(aval))
linear_zeros_p.def_abstract_eval(lambda anchor, *, aval: ShapedArray(aval.shape, aval.dtype))
mlir.register_lowering(linear_zeros_p, mlir.lower_fun(lambda anchor, *, aval: _zeros(aval),
                                                      multiple_results=False))
ad.primitive_jvps[linear_zeros_p] = lambda primals, tangents, *, aval: (_zeros(aval), ad.Zero(aval))
ad.primitive_transposes[linear_zeros_p] = lambda ct, anchor, *, aval: [ad.Zero(anchor.aval)]
batching.primitive_batchers[linear_zeros_p] = (
    lambda args, dims, *, aval: (_zeros(aval), None))  # not batched


def _zeros(aval):
    return jnp.zeros(aval.shape, aval.dtype)


def keep_in_partial_eval(prim: Primitive) -> None:
    """JaxprTrace rule for `prim`: like JAX's default, but the staged equation is
    always kept. The old-style partial evaluator (`jax.linear_transpose`,
    `jax.linearize`) builds its jaxpr from what the outputs reach; a collective with
    no used output (a send, or a rank that ignores a result) would vanish on that
    rank only. Relies on `pe.custom_partial_eval_rules`, `pe.JaxprTracer`,
    `pe.PartialVal`, `pe.new_eqn_recipe`, `pe.EffectHandle`, the trace's
    `effect_handles`, `parent_trace`, `instantiate_const` and
    `_current_truncated_name_stack`."""

    def rule(trace, *tracers, **params):
        known = [t.pval.get_known() for t in tracers]
        if all(k is not None for k in known):
            return trace.parent_trace.process_primitive(prim, known, params)
        tracers = [trace.instantiate_const(t) for t in tracers]
        out_avals, effs = prim.abstract_eval(*[t.aval for t in tracers], **params)
        outs = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None) for a in out_avals]
        source = source_info_util.current().replace(
            name_stack=trace._current_truncated_name_stack())
        eqn = _pe.new_eqn_recipe(trace, tracers, outs, prim, params, effs, source)
        trace.effect_handles.append(_pe.EffectHandle(tracers, eqn))
        for t in outs:
            t.recipe = eqn
        return outs

    pe.custom_partial_eval_rules[prim] = rule


# ---------------------------------------------------------------- ordering --
# JAX 0.11 made ClosedJaxpr an alias of Jaxpr (which holds its consts), 0.12 removed it
_CLOSED_JAXPR = getattr(_extend_core, "ClosedJaxpr", Jaxpr)


def _map_param(value, fn):
    if isinstance(value, Jaxpr):
        return fn(value)
    if isinstance(value, _CLOSED_JAXPR):
        return value.replace(jaxpr=fn(value.jaxpr))
    if isinstance(value, tuple):  # also namedtuples (custom_linear_solve's `jaxprs`)
        items = [_map_param(v, fn) for v in value]
        return value._make(items) if hasattr(value, "_make") else type(value)(items)
    return value


def mark_jaxpr(jaxpr: Jaxpr, effect, own_params: Callable, contains: Callable,
               memo: dict) -> Jaxpr:
    """A copy of `jaxpr` in which every equation for which `own_params(eqn)` gives a dict
    of parameters (the own primitives) gets those parameters and `effect`, and every
    equation whose nested jaxprs `contain` one gets `effect` and marked copies of those
    jaxprs. Relies on `Jaxpr.replace`, `JaxprEqn.replace`, `ClosedJaxpr.replace` and on
    nested jaxprs sitting in equation params as Jaxpr, ClosedJaxpr or tuples of them
    (`core.jaxprs_in_params` looks at the same places)."""
    if not contains(jaxpr):
        return jaxpr
    hit = memo.get(jaxpr)
    if hit is not None:
        return hit

    def mark(j):
        return mark_jaxpr(j, effect, own_params, contains, memo)

    eqns = []
    for eqn in jaxpr.eqns:
        extra = own_params(eqn)
        if extra is not None:
            eqn = eqn.replace(params={**eqn.params, **extra}, effects={*eqn.effects, effect})
        elif any(contains(j) for j in jaxprs_in_params(eqn.params)):
            params = {k: _map_param(v, mark) for k, v in eqn.params.items()}
            eqn = eqn.replace(params=params, effects={*eqn.effects, effect})
        eqns.append(eqn)
    out = jaxpr.replace(eqns=eqns, effects={*jaxpr.effects, effect})
    memo[jaxpr] = out
    return out


class _Chains(threading.local):
    def __init__(self):
        self.modules = []  # MLIR modules whose main function started a chain


_chains = _Chains()


def ordered_lowering(effect, mark: Callable, contains: Callable,
                     unchained: Callable) -> None:
    """Make JAX's lowering thread one XLA token for `effect` through a whole module.

    Wraps `mlir.jaxpr_subcomp`, the function that lowers every jaxpr (a module's main
    function, loop bodies and conditions, branches, nested calls, the traced helpers
    of `lower_fun` rules). Its first call for a module whose jaxpr `contains` a
    collective replaces the jaxpr by `mark(jaxpr)`, which carries the ordered
    `effect` on every collective and on every equation containing one, and adds a
    fresh token for `effect` to the token set. JAX's own rules for while, cond, scan,
    jit, remat, custom_jvp/vjp, custom_linear_solve then pass that token through
    loop carries, branch operands and results, and call arguments and results, as
    they do for `io_callback(ordered=True)`; the last token is dropped at the end of
    the main function, so the compiled program takes and returns no token and keeps
    JAX's fast dispatch. A jaxpr with a collective lowered inside the chain without
    the token (a construct that does not pass tokens on) raises
    `unchained(jaxpr, name_stack)`, on every JAX version. Relies on `jaxpr_subcomp`'s signature
    `(ctx, jaxpr, name_stack, tokens, consts, *args, **kw) -> (outs, tokens)`,
    `ctx.module`, `mlir.TokenSet` and on every JAX rule looking the function up as
    `mlir.jaxpr_subcomp` / a module global at call time. Idempotent."""
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
    """The token of `effect` that this equation receives, or None outside a chain.
    Relies on `LoweringRuleContext.tokens_in` (a `TokenSet`)."""
    return ctx.tokens_in.get(effect) if effect in ctx.tokens_in.effects() else None


def set_chain_token(ctx: mlir.LoweringRuleContext, effect, token) -> None:
    """Hand the next token of `effect` on to the following equations. Relies on
    `LoweringRuleContext.set_tokens_out` and `TokenSet.update_tokens`."""
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))


def program_devices(ctx: mlir.LoweringRuleContext) -> int:
    """How many devices the program being lowered runs on (>1 under a multi-device
    jit sharding, shard_map or pmap). Relies on `module_context.axis_context` being a
    `ShardingContext` (`num_devices`) or an `SPMDAxisContext` (`mesh`)."""
    axis = ctx.module_context.axis_context
    n = getattr(axis, "num_devices", None)
    if n is None and getattr(axis, "mesh", None) is not None:
        n = axis.mesh.size
    return int(n or 1)


def lowering_for_export(ctx: mlir.LoweringRuleContext) -> bool:
    """Whether the program being lowered is being exported (`jax.export`). Relies on
    `module_context.lowering_parameters.for_export` (0.7.1 and later)."""
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def carry_while_predicate(cond_communicates: Callable) -> None:
    """vmap of a `while_loop` whose condition communicates: batch an equivalent loop
    that evaluates the condition at the end of the body and carries the predicate,
    `p = cond(c); while any(p): c = where(p, body(c), c); p = where(p, cond(c), p)`.

    JAX lowers a condition holding an ordered effect (vjpmpi's chain) by moving it
    into the body, which drops the per-member select of a batched predicate: members
    already done would go on iterating. Its batching rule for a carried predicate
    (a condition with no collective) keeps the select, and the condition's
    collectives then sit in the body, on the chain; every rank evaluates the
    condition as often as before. Relies on `batching.fancy_primitive_batchers`,
    `loops.while_p` and its params (`cond_jaxpr`, `body_jaxpr`, `cond_nconsts`,
    `body_nconsts`), `batching.AxisData` (`size`, `name`, `spmd_name`) and
    `core.eval_jaxpr`. Idempotent."""
    original = batching.fancy_primitive_batchers[jax.lax.while_p]
    if getattr(original, "vjpmpi_guard", False):
        return

    def rule(axis_data, args, dims, *, cond_nconsts, cond_jaxpr, body_nconsts, body_jaxpr):
        if not cond_communicates(cond_jaxpr.jaxpr):
            return original(axis_data, args, dims, cond_nconsts=cond_nconsts,
                            cond_jaxpr=cond_jaxpr, body_nconsts=body_nconsts,
                            body_jaxpr=body_jaxpr)

        def loop(*vals):
            cconsts = vals[:cond_nconsts]
            bconsts = vals[cond_nconsts:cond_nconsts + body_nconsts]
            init = vals[cond_nconsts + body_nconsts:]

            def pred(carry):
                return eval_jaxpr(cond_jaxpr.jaxpr, cond_jaxpr.consts, *cconsts, *carry)[0]

            def body(state):
                carry = eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, *bconsts, *state[1])
                return pred(carry), carry

            return jax.lax.while_loop(lambda state: state[0], body, (pred(init), list(init)))[1]

        outs = jax.vmap(loop, in_axes=tuple(dims), axis_size=axis_data.size,
                        axis_name=axis_data.name, spmd_axis_name=axis_data.spmd_name)(*args)
        return outs, [0] * len(outs)

    rule.vjpmpi_guard = True
    batching.fancy_primitive_batchers[jax.lax.while_p] = rule


# ----------------------------------------------------- outside the chain --
class _Callbacks(threading.local):
    depth = 0


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


def track_host_callbacks() -> None:
    """Count the host callbacks running on this thread, so that `inside_host_callback`
    can tell. pure_callback and io_callback run the user's function through
    `callback._FlatCallback.__call__`; jax.debug.callback through
    `debugging.debug_callback_impl`, which JAX's lowering looks up as a module global
    at call time. Idempotent."""
    from jax._src import callback, debugging

    if not getattr(callback._FlatCallback.__call__, "vjpmpi_guard", False):
        callback._FlatCallback.__call__ = _counting(callback._FlatCallback.__call__)
    if not getattr(debugging.debug_callback_impl, "vjpmpi_guard", False):
        debugging.debug_callback_impl = _counting(debugging.debug_callback_impl)


def inside_host_callback() -> bool:
    """Whether this thread is running a JAX host callback (see `track_host_callbacks`)."""
    return _callbacks.depth > 0


def exported_text(exported) -> str:
    """The StableHLO text of a `jax.export.Exported` (public API: `mlir_module()`)."""
    return str(exported.mlir_module())
