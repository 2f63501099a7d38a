"""Generic machinery: one `Collective` spec in, one JAX primitive out.

A spec says what is particular to a collective (its FFI target, output
shapes, which operand its result may alias, where the communicator's rank
axis sits for batching).  Everything else is derived here, once, for all
collectives: abstract evaluation, eager dispatch, lowering to an XLA FFI
custom call on the ordering token chain, batching, and protection from dead
code elimination.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import threading
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core, dispatch, effects, source_info_util
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from . import _kernels  # noqa: F401  (registers the FFI targets)
from ._mpi import RED_NAMES, CommRef

_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple(str(pathlib.Path(m.__file__).resolve().parent)
                      for m in (jax, np)) + (_PACKAGE_DIR, "<frozen")

# Static parameters every collective primitive carries (unused ones are 0).
PARAMS = ("comm", "red", "root", "peer", "peer2", "tag", "tag2", "status")


@dataclasses.dataclass(frozen=True)
class Collective:
    """Everything particular to one collective.

    **Arguments:**

    - `name`: primitive name suffix and FFI target (`vjpmpi_<name>`).
    - `out_avals`: `(params, *in_avals) -> list of output avals`.
    - `alias`: `(operand, result)` that may share a buffer (in place), or None.
    - `rank_axis`: `params -> (input_has_rank_axis, output_has_rank_axis)`: whether
      the leading axis of operand 0 / result 0 enumerates the communicator's ranks
      (used to place the batch axis behind it).
    - `target`: the FFI handler it runs (default: `name`); None lowers to the identity.
    - `linear`: `params -> bool`, whether the op is linear in its array operands for
      these parameters (then its JVP is the op applied to the tangents).
    - `transpose`: `(cts, args, params) -> cotangents of args`, the adjoint of the global
      linear map; `args` holds `UndefinedPrimal`s for the linear operands.
    - `nonlinear_jvp`: `(primals, tangents, params) -> tangents out` when not linear.
    """

    name: str
    out_avals: Callable[..., list[core.ShapedArray]]
    alias: tuple[int, int] | None = None
    rank_axis: Callable[[dict], tuple[bool, bool]] = lambda params: (False, False)
    target: str | None = dataclasses.field(default="", compare=False)
    linear: Callable[[dict], bool] = lambda params: True
    transpose: Callable | None = None
    nonlinear_jvp: Callable | None = None

    def ffi_target(self) -> str | None:
        return self.name if self.target == "" else self.target


# ------------------------------------------------- dead code elimination --
# Collectives communicate, so one whose result is unused must still run (its
# peers wait for it).  The forward primitives carry no JAX effect (an effect would
# send every jitted call down JAX's slow dispatch path), so we keep them alive
# ourselves: a rule that never drops them, and a guard on every higher-order
# primitive (loops, conditionals, nested jit, remat, custom derivatives) that
# keeps the whole equation when its body contains a collective.
_PRIMITIVES: set[core.Primitive] = set()
_contains_cache: "weakref.WeakKeyDictionary[core.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def _keep_eqn(used_outputs, eqn):
    return [True] * len(eqn.invars), eqn


def contains_collective(jaxpr: core.Jaxpr) -> bool:
    """Whether `jaxpr` (or any jaxpr nested in it) binds a vjpmpi collective."""
    hit = _contains_cache.get(jaxpr)
    if hit is None:
        hit = any(_communicates(eqn) for eqn in jaxpr.eqns)
        _contains_cache[jaxpr] = hit
    return hit


def _body_communicates(eqn) -> bool:
    return any(contains_collective(j) for j in core.jaxprs_in_params(eqn.params))


def _guarded(rule):
    def dce_rule(used_outputs, eqn):
        if not any(used_outputs) and _body_communicates(eqn):
            if not used_outputs:  # nothing to keep alive but the equation itself
                return [True] * len(eqn.invars), eqn
            used_outputs = [True] * len(used_outputs)
        return rule(used_outputs, eqn)

    dce_rule.vjpmpi_guard = True
    return dce_rule


def _communicates(eqn) -> bool:
    return eqn.primitive in _PRIMITIVES or _body_communicates(eqn)


def _keep_traced_eqns() -> None:
    """Jaxpr tracing with auto-DCE (JAX's linearize / vjp tangent traces) holds
    effect-free equations weakly and forgets those whose outputs die; hold the
    ones that communicate strongly, as JAX does for effectful equations."""
    frame = pe.JaxprStackFrame
    if getattr(frame.add_eqn, "vjpmpi_guard", False):
        return
    original = frame.add_eqn

    def add_eqn(self, eqn):
        if self.auto_dce and not eqn.effects and _communicates(eqn):
            self.tracing_eqns.append(eqn)
        else:
            original(self, eqn)

    add_eqn.vjpmpi_guard = True
    frame.add_eqn = add_eqn


def _guard_higher_order_primitives() -> None:
    from jax._src.lax.control_flow import loops

    extra = {loops.while_p: pe._default_dce_rule}
    for prim, rule in [*pe.dce_rules.items(), *extra.items()]:
        if prim in _PRIMITIVES or getattr(rule, "vjpmpi_guard", False):
            continue
        pe.dce_rules[prim] = _guarded(rule)


# ------------------------------------------------------------- ordering --
class _Chain(threading.local):
    module: object = None
    tokens: dict = {}


_chain = _Chain()


def _block_tokens(ctx: mlir.LoweringRuleContext) -> dict:
    module = ctx.module_context.module
    if _chain.module is not module:
        _chain.module, _chain.tokens = module, {}
    return _chain.tokens


def _int64(v: int) -> np.int64:
    # Handles and addresses travel as int64 bit patterns (mpi4py may report an
    # MPICH handle sign-extended to 64 unsigned bits).
    return np.int64(v - (1 << 64) if v >= (1 << 63) else v)


def _user_frame() -> str:
    """`file:line (function)` of the user code that issued the collective being lowered."""
    tb = source_info_util.current().traceback
    for frame in source_info_util.user_frames(tb) if tb is not None else ():
        if not frame.file_name.startswith(_PACKAGE_DIR):
            return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    # eager calls: the Python stack of the call being compiled
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY_DIRS):
        f = f.f_back
    if f is None:
        return "an unknown location"
    return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"


def _site(ctx, spec: Collective, params) -> int:
    """Register a description of this call site with the kernels (check/timeout on)."""
    name = spec.ffi_target()
    detail = []
    if name in ("allreduce", "reduce", "reduce_scatter", "scan", "exscan"):
        detail.append(RED_NAMES[params["red"]])
    if name in ("reduce", "bcast", "gather", "scatter"):
        detail.append(f"root={params['root']}")
    if name in ("send", "sendrecv"):
        detail.append(f"dest={params['peer']}")
    if name in ("recv", "sendrecv"):
        detail.append(f"source={params['peer2']}")
    avals = ", ".join(f"{a.dtype}{list(a.shape)}" for a in ctx.avals_in)
    stage = " [backward]" if "transpose" in str(ctx.name_stack) else ""
    return _kernels.register_site(
        f"{name}({', '.join(detail)}) on {avals or 'no data'}{stage} at {_user_frame()}")


def _lower(ctx, *args, spec: Collective, **params):
    """Lower to `vjpmpi_<target>` taking the block's last token and returning the next."""
    if spec.ffi_target() is None:
        return list(args)
    tokens = _block_tokens(ctx)
    block = ir.InsertionPoint.current.block
    token = tokens.get(block)
    if token is None:
        token = hlo.create_token()
    aliases = {}
    if spec.alias is not None:
        i, j = spec.alias
        a, b = ctx.avals_in[i], ctx.avals_out[j]
        if a.shape == b.shape and a.dtype == b.dtype:
            aliases = {i: j}
    rule = jax.ffi.ffi_lowering(
        f"vjpmpi_{spec.ffi_target()}", has_side_effect=True, operand_output_aliases=aliases
    )
    sub = ctx.replace(
        avals_in=[*ctx.avals_in, core.abstract_token],
        avals_out=[*ctx.avals_out, core.abstract_token],
    )
    attrs = {k: _int64(params[k].handle if k == "comm" else params[k]) for k in PARAMS}
    attrs["site"] = np.int64(_site(ctx, spec, params) if _kernels.CHECK or _kernels.TIMEOUT else 0)
    outs = rule(sub, *args, token, **attrs)
    tokens[block] = outs[-1]
    return outs[:-1]


# ------------------------------------------------------------- batching --
def _batch(prim, spec: Collective, args, dims, **params):
    in_ax, out_ax = spec.rank_axis(params)
    mapped = [(a, d) for a, d in zip(args, dims) if d is not None]
    n = mapped[0][0].shape[mapped[0][1]]
    same = len(mapped) == len(args) and len({d for _, d in mapped}) == 1
    if same and not in_ax:
        b = mapped[0][1]  # elementwise: keep the batch axis where it is
    else:
        b = 1 if in_ax else 0
    moved = []
    for a, d in zip(args, dims):
        if d is None:
            a = jnp.broadcast_to(jnp.expand_dims(a, b), (*a.shape[:b], n, *a.shape[b:]))
        elif d != b:
            a = jnp.moveaxis(a, d, b)
        moved.append(a)
    outs = prim.bind(*moved, **params)
    return outs, [b + int(out_ax) - int(in_ax)] * len(outs)


def _partial_eval(prim, trace, *tracers, **params):
    """JaxprTrace rule: like the default, but the staged equation is always kept.

    The old-style partial evaluator (`jax.linear_transpose`, `jax.linearize`) builds
    its jaxpr from what the outputs reach; a collective with no used output (a send,
    or a rank that ignores a result) would vanish on that rank only.
    """
    known = [t.pval.get_known() for t in tracers]
    if all(k is not None for k in known):
        return prim.bind_with_trace(trace.parent_trace, known, tuple(t.aval for t in tracers),
                                    params)
    tracers = [trace.instantiate_const(t) for t in tracers]
    out_avals, effs = prim.abstract_eval(*[t.aval for t in tracers], **params)
    outs = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None) for a in out_avals]
    source = source_info_util.current().replace(name_stack=trace._current_truncated_name_stack())
    eqn = pe.new_eqn_recipe(trace, tracers, outs, prim, params, effs, source)
    trace.effect_handles.append(pe.EffectHandle(tracers, eqn))
    for t in outs:
        t.recipe = eqn
    return outs


# ------------------------------------------------------- differentiation --
def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _jvp(prim, lin, spec: Collective, primals, tangents, **params):
    outs = prim.bind(*primals, **params)
    avals = [core.typeof(o) for o in outs]
    if not any(_is_float(core.typeof(a)) for a in [*primals, *outs]):
        # integer / bool data: float0 tangents, nothing to communicate
        return outs, [ad.Zero(a.to_tangent_aval()) for a in avals]
    if spec.linear(params):
        # Zero tangents become real zeros: the tangent collective must run on every
        # rank, whether or not this rank's input depends on what is differentiated.
        ts = [ad.instantiate_zeros(t) for t in tangents]
        t_outs = lin.bind(*ts, **params)
    else:
        t_outs = spec.nonlinear_jvp(primals, tangents, params)
    return outs, t_outs


def _transpose(spec: Collective, cts, *args, **params):
    # A zero cotangent still takes part: every rank runs every transposed collective.
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return spec.transpose(cts, args, params)


# --------------------------------------------------------------- derive --
class Linearized(effects.Effect):
    """Carried by the tangent (linearized) form of a collective.

    JAX skips the backward pass of a linear program whose output cotangents are all
    zero, and forgets effect-free equations nothing depends on; a rank whose loss
    does not depend on a collective would then skip its transpose while its peers
    wait. The effect keeps every linearized collective, and its transpose, on every
    rank. It never appears in forward programs or in `jit(grad(f))`, whose backward
    is built from the effect-free forward primitives.
    """

    def __repr__(self):
        return "vjpmpi.Linearized"


LINEARIZED = Linearized()
for _kind in (effects.lowerable_effects, effects.control_flow_allowed_effects,
              effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects,
              effects.partial_eval_kept_effects):
    _kind.add_type(Linearized)


def make_primitive(spec: Collective) -> tuple[core.Primitive, core.Primitive]:
    """Build a collective's primitive and its linearized (tangent) twin from its spec."""
    prim = core.Primitive(f"vjpmpi_{spec.name}")
    lin = core.Primitive(f"vjpmpi_{spec.name}_lin")

    def abstract_eval(*avals, **params):
        return spec.out_avals(params, *avals)

    prim.def_abstract_eval(abstract_eval)
    lin.def_effectful_abstract_eval(lambda *a, **p: (abstract_eval(*a, **p), {LINEARIZED}))
    for p in (prim, lin):
        p.multiple_results = True
        p.def_impl(functools.partial(dispatch.apply_primitive, p))
        # Not cacheable: each call site must join the token chain of its own block.
        mlir.register_lowering(
            p, functools.partial(_lower, spec=spec), platform="cpu", cacheable=False
        )
        batching.primitive_batchers[p] = functools.partial(_batch, p, spec)
        ad.primitive_jvps[p] = functools.partial(_jvp, p, lin, spec)
        if spec.transpose is not None:
            ad.primitive_transposes[p] = functools.partial(_transpose, spec)
        pe.dce_rules[p] = _keep_eqn
        pe.custom_partial_eval_rules[p] = functools.partial(_partial_eval, p)
        _PRIMITIVES.add(p)
    _guard_higher_order_primitives()
    _keep_traced_eqns()
    return prim, lin


def bind(prim: core.Primitive, args: Sequence, comm: CommRef, **params) -> list:
    full = dict.fromkeys(PARAMS, 0)
    full.update(params, comm=comm)
    return prim.bind(*args, **full)
