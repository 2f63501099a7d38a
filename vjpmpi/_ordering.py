"""Program order: the token chain through a program's collectives, and its signatures.

When lowering starts, a copy of the program's jaxpr is marked (`mark`): every collective
and every construct holding one carries the ordered effect `ORDERED`, so JAX's lowering
threads one XLA token through them in program order, and every collective gets its
program's signature on its communicator (`signatures`), which the kernels compare across
ranks before a program runs for the first time.
"""

from __future__ import annotations

import collections
import hashlib
import weakref
from typing import Callable

import jax

from . import _jax_compat as jc
from ._mpi import CommRef, DeviceCommRef
from ._primitive import (COLLECTIVES, ORDERED, SPEC_OF, Collective, contains_collective,
                         first_collective, members)

# More checks of a program before it is lowered: `check(jaxpr)` raises (vjpmpi.start's).
LOWERING_CHECKS: list[Callable[[jc.Jaxpr], None]] = []
# Parameters that calls take from their whole program (the module's jaxpr): `f(jaxpr)`
# gives {primitive: {name: value}} for every call of that primitive (vjpmpi.start's buffers).
PROGRAM_PARAMS: list[Callable[[jc.Jaxpr], dict]] = []


def mark(jaxpr: jc.Jaxpr) -> jc.Jaxpr:
    """A copy of the program `jaxpr` on the chain: the ordered effect on every collective
    and every equation holding one, each collective's signature parameter set."""
    for check in LOWERING_CHECKS:
        check(jaxpr)
    check_device_branches(jaxpr)
    own, exported = members(jaxpr)
    if exported and own + exported > 1:
        raise NotImplementedError(
            "vjpmpi: this program calls a jax.export-ed function that runs vjpmpi "
            f"collectives, next to {own + exported - 1} other collective call(s). An "
            "exported function carries its own ordering chain and cannot be ordered "
            "against the rest of the program; call it in a program of its own, or export "
            "the whole program.")
    sigs = signatures(jaxpr)
    # (2: point-to-point calls between devices of a group, which may cross processes)
    level = 2 if _device_p2p(jaxpr) else 1
    layouts: dict[int, int] = {}  # (a collective inside a shard_map: its mesh)
    _shard_map_layouts(jaxpr, 0, layouts)
    program: dict = {}
    for params_of in PROGRAM_PARAMS:
        for prim, p in params_of(jaxpr).items():
            program.setdefault(prim, {}).update(p)

    def own_params(eqn):
        if eqn.primitive not in COLLECTIVES:
            return None
        return {"ordered": True, "sig": sigs.get(eqn.params["comm"], 0), "level": level,
                "layout": eqn.params.get("layout") or layouts.get(id(eqn), 0),
                **program.get(eqn.primitive, {})}

    return mark_jaxpr(jaxpr, ORDERED, own_params, contains_collective, {})


def check_device_branches(jaxpr: jc.Jaxpr, checked: bool = False) -> None:
    """Refuse, when lowering, a branch or loop whose devices could make different
    collectives on a device communicator: a `cond` whose predicate varies over its axis and
    whose branches differ in their collectives there, a `while` whose condition varies over
    it and whose body makes one (its devices would call different collectives, and those
    that wait would wait for ever). Seen where JAX types values by the axes they vary over
    (`checked`: inside a shard_map with check_vma)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = checked
        if name == "shard_map":
            inner = bool(eqn.params.get("check_vma", eqn.params.get("check_rep", False)))
        subs = [j for j in jc.jaxprs_in_params(eqn.params)]
        if checked and name in ("cond", "while") and any(contains_collective(j) for j in subs):
            if name == "cond":
                varies = jc.vma_of(eqn.invars[0].aval)
                parts = [_structure(j) for j in subs]
                bad = {c for part in parts for c in part
                       if isinstance(c, DeviceCommRef) and c.axis in varies
                       and any(p.get(c, ()) != parts[0].get(c, ()) for p in parts)}
            else:
                cond = eqn.params["cond_jaxpr"].jaxpr
                varies = jc.vma_of(cond.outvars[0].aval)
                bad = {c for j in subs for c in _structure(j)
                       if isinstance(c, DeviceCommRef) and c.axis in varies}
            if bad:
                axis = sorted(c.axis for c in bad)[0]
                raise ValueError(
                    f"vjpmpi: a lax.{'cond' if name == 'cond' else 'while_loop'} whose "
                    f"{'predicate' if name == 'cond' else 'condition'} varies over mesh axis "
                    f"'{axis}' {'has different collectives in its branches' if name == 'cond' else 'makes collectives in its body'} "
                    f"on a device communicator of that axis: its devices would call different "
                    "collectives. Make the same collectives on every device (select the data "
                    "with jnp.where, or compute the predicate from a reduction over the axis).")
        for j in subs:
            check_device_branches(j, inner)


def _shard_map_layouts(jaxpr: jc.Jaxpr, layout: int, out: dict) -> None:
    """{id(collective equation): the mesh of the shard_map it is in, hashed} (a call that
    vjpmpi splits itself carries how in its own `layout` parameter: `_placement`)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive in COLLECTIVES:
            if layout:
                out[id(eqn)] = layout
            continue
        inner = layout
        if eqn.primitive.name == "shard_map":
            mesh = eqn.params.get("mesh")
            text = repr(tuple(getattr(mesh, "shape", {}).items()) if mesh is not None else ())
            inner = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                                   "little", signed=True)
        for j in jc.jaxprs_in_params(eqn.params):
            if contains_collective(j):
                _shard_map_layouts(j, inner, out)


def _device_p2p(jaxpr: jc.Jaxpr) -> bool:
    """Whether `jaxpr` (nested) holds a point-to-point call on a device communicator."""
    for eqn in jaxpr.eqns:
        spec = SPEC_OF.get(eqn.primitive)
        if spec is not None:
            if (spec.point_to_point or spec.pairs) and isinstance(eqn.params["comm"], DeviceCommRef):
                return True
        elif any(_device_p2p(j) for j in jc.jaxprs_in_params(eqn.params) if contains_collective(j)):
            return True
    return False


def _map_param(value, fn):
    if isinstance(value, jc.Jaxpr):
        return fn(value)
    if isinstance(value, jc.ClosedJaxpr):
        return value.replace(jaxpr=fn(value.jaxpr))
    if isinstance(value, tuple):  # also namedtuples (custom_linear_solve's `jaxprs`)
        items = [_map_param(v, fn) for v in value]
        return value._make(items) if hasattr(value, "_make") else type(value)(items)
    return value


def mark_jaxpr(jaxpr: jc.Jaxpr, effect, own_params: Callable, contains: Callable,
               memo: dict) -> jc.Jaxpr:
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
        elif any(contains(j) for j in jc.jaxprs_in_params(eqn.params)):
            params = {k: _map_param(v, mark) for k, v in eqn.params.items()}
            eqn = eqn.replace(params=params, effects={*eqn.effects, effect})
        eqns.append(eqn)
    out = jaxpr.replace(eqns=eqns, effects={*jaxpr.effects, effect})
    memo[jaxpr] = out
    return out


def unchained(name: str | None, where) -> NotImplementedError:
    """The error for a collective that a JAX construct lowers without the chain's token."""
    return NotImplementedError(
        f"vjpmpi.{name or 'collective'}: collective lowered outside vjpmpi's ordering chain "
        f"(in '{where}'): a JAX construct around it does not pass XLA tokens on, so its "
        "order against the program's other collectives could differ between ranks. Please "
        "report this with the construct used.")


def unchained_jaxpr(jaxpr: jc.Jaxpr, where) -> NotImplementedError:
    """`unchained` for the first collective of `jaxpr`."""
    return unchained(first_collective(jaxpr), where)


# ---------------------------------------------------- program signatures --
# A program's signature on a communicator: a hash of the structure of its collectives
# there (each one's op, parameters, dtype and per-rank block, and the loops and branches
# around them). The kernels compare the ranks' collectives when a rank runs a program
# whose signature it has not yet seen verified (csrc/agree.h); ranks that run the
# same collectives have the same signature, whatever else their programs compute.
STRUCTURES: "weakref.WeakKeyDictionary[jc.Jaxpr, dict]" = weakref.WeakKeyDictionary()


def signatures(jaxpr: jc.Jaxpr) -> dict[CommRef, int]:
    """{communicator: signature} of the program `jaxpr` (a nonzero int64, the same in
    every process: not Python's per-process `hash`)."""
    out = {}
    for comm, items in _structure(jaxpr).items():
        digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
        out[comm] = int.from_bytes(digest, "little", signed=True) or 1
    return out


def _structure(jaxpr: jc.Jaxpr) -> dict[CommRef, tuple]:
    if not contains_collective(jaxpr):
        return {}
    hit = STRUCTURES.get(jaxpr)
    if hit is not None:
        return hit
    seq = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        spec = SPEC_OF.get(eqn.primitive)
        if spec is not None:
            if not spec.point_to_point and spec.ffi_target() is not None:
                seq[eqn.params["comm"]].append(_item(spec, eqn))
            continue
        parts = [_structure(j) for j in jc.jaxprs_in_params(eqn.params)]
        name = eqn.primitive.name
        for comm in {c for part in parts for c in part}:
            subs = [part.get(comm, ()) for part in parts]
            if name == "cond" and any(sub != subs[0] for sub in subs):
                seq[comm].append(("cond", tuple(subs)))
            elif name == "cond":
                seq[comm].extend(subs[0])
            elif name in ("while", "scan"):
                seq[comm].append((name, eqn.params.get("length"), tuple(subs)))
            elif name == "shard_map":  # (its devices' layout: processes must agree on it)
                seq[comm].append((name, _layout(eqn.params), tuple(subs)))
            else:  # calls, remat, custom derivatives: their bodies, in order
                for sub in subs:
                    seq[comm].extend(sub)
    out = {c: tuple(v) for c, v in seq.items()}
    STRUCTURES[jaxpr] = out
    return out


def _layout(params) -> str:
    """A shard_map's mesh and how its operands are split (its `mesh` and in/out specs)."""
    mesh = params.get("mesh")
    shape = tuple(getattr(mesh, "shape", {}).items()) if mesh is not None else ()
    specs = [params.get(k) for k in ("in_specs", "out_specs", "in_names", "out_names")]
    return repr((shape, *[s for s in specs if s is not None]))


_DTYPE_NAMES: dict = {}


def _item(spec: Collective, eqn) -> tuple:
    """What the ranks must agree on about one collective: its op and parameters, dtype
    and per-rank block (the operand without the communicator's rank axis)."""
    params = eqn.params
    detail = tuple(int(params[k]) for k in spec.params)  # (in the spec's order)
    if not eqn.invars:
        return (spec.name, detail)
    aval = eqn.invars[0].aval
    name = _DTYPE_NAMES.get(aval.dtype)
    if name is None:
        name = _DTYPE_NAMES[aval.dtype] = str(aval.dtype)
    if spec.block is not None:
        shape = spec.block(params, [v.aval for v in eqn.invars])
    else:
        shape = aval.shape[1:] if spec.rank_axis(params)[0] else aval.shape
    return (spec.name, detail, name, tuple(shape))


# ----------------------------------------------------------------- batching --
def batched_while(axis_data, args, dims, *, cond_nconsts, cond_jaxpr, body_nconsts,
                  body_jaxpr):
    """vmap of a `while_loop` whose condition communicates: the equivalent loop that
    evaluates the condition at the end of the body and carries the predicate,
    `p = cond(c); while any(p): c = where(p, body(c), c); p = where(p, cond(c), p)`,
    batched (JAX's rule for a carried predicate keeps the per-member select, and the
    condition's collectives then sit in the body, on the chain; every rank evaluates the
    condition as often as before)."""
    def loop(*vals):
        cconsts = vals[:cond_nconsts]
        bconsts = vals[cond_nconsts:cond_nconsts + body_nconsts]
        init = vals[cond_nconsts + body_nconsts:]

        def pred(carry):
            return jc.eval_jaxpr(cond_jaxpr.jaxpr, cond_jaxpr.consts, *cconsts, *carry)[0]

        def body(state):
            carry = jc.eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, *bconsts, *state[1])
            return pred(carry), carry

        return jax.lax.while_loop(lambda state: state[0], body, (pred(init), list(init)))[1]

    outs = jax.vmap(loop, in_axes=tuple(dims), axis_size=axis_data.size,
                    axis_name=axis_data.name, spmd_axis_name=axis_data.spmd_name)(*args)
    return outs, [0] * len(outs)
