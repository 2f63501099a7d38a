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
import threading
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from . import _kernels  # noqa: F401  (registers the FFI targets)
from ._mpi import CommRef

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
    """

    name: str
    out_avals: Callable[..., list[core.ShapedArray]]
    alias: tuple[int, int] | None = None
    rank_axis: Callable[[dict], tuple[bool, bool]] = lambda params: (False, False)


# ------------------------------------------------- dead code elimination --
# Collectives communicate, so one whose result is unused must still run (its
# peers wait for it).  Our primitives carry no JAX effect (an effect would send
# every jitted call down JAX's slow dispatch path), so we keep them alive
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
        hit = any(
            eqn.primitive in _PRIMITIVES
            or any(contains_collective(j) for j in core.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns
        )
        _contains_cache[jaxpr] = hit
    return hit


def _guarded(rule):
    def dce_rule(used_outputs, eqn):
        if not any(used_outputs) and any(
            contains_collective(j) for j in core.jaxprs_in_params(eqn.params)
        ):
            if not used_outputs:  # nothing to keep alive but the equation itself
                return [True] * len(eqn.invars), eqn
            used_outputs = [True] * len(used_outputs)
        return rule(used_outputs, eqn)

    dce_rule.vjpmpi_guard = True
    return dce_rule


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


def _lower(ctx, *args, spec: Collective, **params):
    """Lower to `vjpmpi_<name>` taking the block's last token and returning the next."""
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
        f"vjpmpi_{spec.name}", has_side_effect=True, operand_output_aliases=aliases
    )
    sub = ctx.replace(
        avals_in=[*ctx.avals_in, core.abstract_token],
        avals_out=[*ctx.avals_out, core.abstract_token],
    )
    attrs = {k: _int64(params[k].handle if k == "comm" else params[k]) for k in PARAMS}
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


# --------------------------------------------------------------- derive --
def make_primitive(spec: Collective) -> core.Primitive:
    """Build the JAX primitive of a collective from its spec."""
    prim = core.Primitive(f"vjpmpi_{spec.name}")
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(lambda *avals, **params: spec.out_avals(params, *avals))
    # Not cacheable: each call site must join the token chain of its own block.
    mlir.register_lowering(
        prim, functools.partial(_lower, spec=spec), platform="cpu", cacheable=False
    )
    batching.primitive_batchers[prim] = functools.partial(_batch, prim, spec)
    pe.dce_rules[prim] = _keep_eqn
    _PRIMITIVES.add(prim)
    _guard_higher_order_primitives()
    return prim


def bind(prim: core.Primitive, args: Sequence, comm: CommRef, **params) -> list:
    full = dict.fromkeys(PARAMS, 0)
    full.update(params, comm=comm)
    return prim.bind(*args, **full)
