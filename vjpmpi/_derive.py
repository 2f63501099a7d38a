"""One `Collective` spec in, one JAX primitive pair out: the primitive and its
linearized (tangent) twin, with abstract evaluation, impl, lowering, batching,
differentiation and transposition derived from the spec, and registered.
"""

from __future__ import annotations

import functools

from . import _jax_compat as jc
from ._bind import apply
from ._lowering import lower
from ._primitive import (LIN_OF, LINEARIZED, LINEARIZED_PRIMITIVES, ORDERED, PRIMITIVES,
                         SPECS, Collective, register)
from ._rules import batch, jvp, transpose


def make_primitive(spec: Collective) -> tuple[jc.Primitive, jc.Primitive]:
    """Build a collective's primitive and its linearized (tangent) twin from its spec."""
    prim = jc.Primitive(f"vjpmpi_{spec.name}")
    lin = jc.Primitive(f"vjpmpi_{spec.name}_lin")
    LIN_OF[prim] = LIN_OF[lin] = lin

    def abstract_eval(*avals, ordered=False, sig=0, invalid=0, note=0, **params):
        return spec.out_avals(params, *avals), {ORDERED} if ordered else jc.no_effects

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
        jc.register_lowering(p, functools.partial(lower, spec=spec), cacheable=False)
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


def call(name: str, x, params: dict, *, tangent: bool = False, invalid: int = 0, **changes):
    """Bind the op `name` on `x` (or a list of operands), inside a rule; its parameters are
    `changes`, else the caller's `params` of the same name. `tangent=True` binds its
    linearized twin (for tangents inside a JVP rule); `invalid`: a refusal
    (`_bind.refusal`). Returns its one result (None for none)."""
    full = {k: changes[k] if k in changes else params[k] for k in ("comm", *SPECS[name].params)}
    if invalid:
        full["invalid"] = invalid
    prim = (LINEARIZED_PRIMITIVES if tangent else PRIMITIVES)[name]
    outs = prim.bind(*(x if isinstance(x, list) else [x]), **full)
    return outs[0] if outs else None


def partner(name: str, **changes):
    """A transpose that is the op `name` on the cotangent (with `changes` to the
    parameters): a collective whose adjoint is its dual."""
    return lambda cts, args, p: [call(name, cts[0], p, **changes)]
