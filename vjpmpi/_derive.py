"""One `Collective` spec in, one JAX primitive pair out: the primitive and its
linearized (tangent) twin, with abstract evaluation, impl, lowering, batching,
differentiation and transposition derived from the spec, and registered.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from . import _jax_compat as jc
from ._bind import apply
from ._lowering import lower
from ._mpi import DeviceCommRef
from ._primitive import (DYNAMIC, LIN_OF, LINEARIZED, LINEARIZED_PRIMITIVES, ORDERED,
                         PRIMITIVES, RANK_SLOTS, SPECS, Collective, dynamic_ranks, register)
from ._rules import batch, jvp, transpose


def make_primitive(spec: Collective) -> tuple[jc.Primitive, jc.Primitive]:
    """Build a collective's primitive and its linearized (tangent) twin from its spec."""
    prim = jc.Primitive(f"vjpmpi_{spec.name}")
    lin = jc.Primitive(f"vjpmpi_{spec.name}_lin")
    LIN_OF[prim] = LIN_OF[lin] = lin

    def abstract_eval(*avals, ordered=False, sig=0, invalid=0, note=0, level=1, layout=0,
                      **params):
        arrays = avals[:-1] if dynamic_ranks(params) else avals  # (less `ranks`)
        outs = [typed(spec, o, arrays, params) for o in spec.out_avals(params, *arrays)]
        return outs, {ORDERED} if ordered else jc.no_effects

    def lin_abstract_eval(*avals, **params):
        outs, effs = abstract_eval(*avals, **params)
        return outs, {*effs, LINEARIZED}

    prim.def_effectful_abstract_eval(abstract_eval)
    lin.def_effectful_abstract_eval(lin_abstract_eval)
    for p in (prim, lin):
        p.multiple_results = True
        p.def_impl(functools.partial(apply, p))
        # Not cacheable: each call site registers its own description (check, timeout).
        # One rule for every platform (it says which it cannot serve): a multi-platform
        # lowering then needs no per-platform switch, which JAX cannot build around an
        # ordered effect.
        jc.register_lowering(p, functools.partial(lower, prim=p, spec=spec), cacheable=False)
        jc.primitive_batchers[p] = functools.partial(batch, p, spec)
        jc.primitive_jvps[p] = functools.partial(jvp, p, lin, spec)
        if spec.transpose is not None:
            jc.primitive_transposes[p] = functools.partial(transpose, spec)
        register(p, spec)
    return prim, lin


def define(*specs: Collective) -> None:
    """Make the primitives of the package's ops `specs`, found by name by `call`."""
    for spec in specs:
        SPECS[spec.name] = spec
        PRIMITIVES[spec.name], LINEARIZED_PRIMITIVES[spec.name] = make_primitive(spec)


def typed(spec: Collective, out, arrays, params):
    """A result's aval inside shard_map: varying over the mesh axes its operands vary over,
    and a device communicator's axis (its ranks' results differ); `spec.varies` may say
    otherwise."""
    vma = frozenset().union(*(jc.vma_of(a) for a in arrays))
    if isinstance(params["comm"], DeviceCommRef) and jc.check_vma():
        vma |= {params["comm"].axis}
        if spec.varies is not None:
            vma = spec.varies(params, vma)
    return jc.with_vma(out, vma)


def call(name: str, x, params: dict, *, tangent: bool = False, invalid: int = 0, **changes):
    """Bind the op `name` on `x` (or a list of operands), inside a rule; its parameters are
    `changes`, else the caller's `params` of the same name. `tangent=True` binds its
    linearized twin (for tangents inside a JVP rule); `invalid`: a refusal
    (`_bind.refusal`). Ranks that each device computes (`DYNAMIC`) come from the caller's
    `ranks` operand (`params["_ranks"]`), rearranged for the op's own. Returns its one
    result (None for none)."""
    spec = SPECS[name]
    full = {k: changes[k] if k in changes else params[k] for k in ("comm", *spec.params)}
    if invalid:
        full["invalid"] = invalid
    operands = list(x) if isinstance(x, list) else [x]
    if dynamic_ranks(full):
        full, ranks = _own_ranks(spec, full, params["_ranks"])
        operands.append(ranks)
    prim = (LINEARIZED_PRIMITIVES if tangent else PRIMITIVES)[name]
    outs = prim.bind(*operands, **full)
    return outs[0] if outs else None


def _own_ranks(spec: Collective, params: dict, ranks):
    """`params` naming the entries of a new `ranks` operand in the op's own order, and that
    operand (from the caller's `ranks` and static values)."""
    params, entries = dict(params), [0, 0, 0]
    for name, attr in spec.params.items():
        slot = RANK_SLOTS.get(attr)
        if slot is None:
            continue
        v = params[name]
        entries[slot] = ranks[DYNAMIC.index(v)] if v in DYNAMIC else v
        if v in DYNAMIC:
            params[name] = DYNAMIC[slot]
    return params, jnp.stack([jnp.asarray(e, jnp.int32) for e in entries])


def partner(name: str, **changes):
    """A transpose that is the op `name` on the cotangent (with `changes` to the
    parameters): a collective whose adjoint is its dual."""
    return lambda cts, args, p: [call(name, cts[0], p, **changes)]
