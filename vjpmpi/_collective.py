"""Generic machinery: one `Collective` spec in, one JAX primitive out.

A spec says what is particular to a collective (its FFI target, output
shapes, which operand its result may alias, where the communicator's rank
axis sits for batching).  Everything else is derived here, once, for all
collectives: abstract evaluation, eager dispatch, lowering to an XLA FFI
custom call on the program's ordering token chain, batching, differentiation
and protection from dead code elimination.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import pathlib
import sys
import threading
import weakref
from typing import Callable, NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as jc
from . import _kernels  # noqa: F401  (registers the FFI targets)
from ._mpi import ANY_TAG, RED_NAMES, CommRef

_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple(str(pathlib.Path(m.__file__).resolve().parent)
                      for m in (jax, np)) + (_PACKAGE_DIR, "<frozen")

# The attributes every FFI handler takes (csrc/vjpmpi_handlers.h), besides `comm`
# (vjpmpi's number for the communicator), `site` (the call-site hash), `sig` (the
# program's signature on the communicator) and `invalid` (an argument error found at
# trace time, raised at run time on every rank). A primitive carries only the
# parameters its spec declares; each maps onto one of these, the others are lowered as 0.
FFI_ATTRS = ("red", "root", "peer", "peer2", "tag", "tag2", "status", "reverse")

# How a call-site description (VJPMPI_CHECK, VJPMPI_TIMEOUT) shows a parameter.
def _tag_text(name):
    return lambda t: f"{name}=ANY_TAG" if t == ANY_TAG else f"{name}={t}"


_DESCRIBE = {"red": lambda v: RED_NAMES[v], "root": "root={}".format,
             "dest": "dest={}".format, "source": "source={}".format,
             **{k: _tag_text(k) for k in ("tag", "sendtag", "recvtag")}}


@dataclasses.dataclass(frozen=True)
class Collective:
    """Everything particular to one collective.

    **Arguments:**

    - `name`: primitive name suffix and FFI target (`vjpmpi_<name>`).
    - `params`: the static parameters besides `comm`, each `name: FFI attribute`
      (one of `FFI_ATTRS`); the primitive carries exactly these.
    - `fixed`: FFI attributes with a value of this spec's own (`{"reverse": 1}`: a
      scan over the ranks in reverse order).
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
    - `nonlinear_jvp`: `(primals, tangents, outs, params) -> tangents out` when not
      linear (`outs`: the primal results).
    - `point_to_point`: the op pairs with one peer's op (send, recv, sendrecv), not with
      a collective of every rank: it takes no part in the ranks' agreement on collectives.
    - `refuse_derivative`: `params -> None, or why` these parameters have no derivative
      (a receive from `MPI.ANY_SOURCE`): the tangent op is then bound refused (see `bind`).
    - `block`: `(params, in_avals) -> tuple`, what the ranks agree on as the per-rank
      block, where it is not operand 0's shape (less its rank axis).
    - `batch`: `(prim, args, dims, params) -> (outs, out_dims)`, a batching rule of the
      op's own, where moving the batch axis into each rank's block is not it.
    - `host_only`: the kernel exists for host memory only (no CUDA handler yet).
    - `describe`: `params -> text`, how a call site names the call (default: the target
      and the parameters `_DESCRIBE` knows), where one kernel serves several ops.
    """

    name: str
    out_avals: Callable[..., list[jc.ShapedArray]]
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    fixed: dict[str, int] = dataclasses.field(default_factory=dict)
    alias: tuple[int, int] | None = None
    rank_axis: Callable[[dict], tuple[bool, bool]] = lambda params: (False, False)
    target: str | None = dataclasses.field(default="", compare=False)
    linear: Callable[[dict], bool] = lambda params: True
    transpose: Callable | None = None
    nonlinear_jvp: Callable | None = None
    point_to_point: bool = False
    refuse_derivative: Callable[[dict], str | None] = lambda params: None
    block: Callable | None = None
    batch: Callable | None = None
    host_only: bool = False
    describe: Callable[[dict], str] | None = None

    def ffi_target(self) -> str | None:
        return self.name if self.target == "" else self.target


# ------------------------------------------------- dead code elimination --
# Collectives communicate, so one whose result is unused must still run (its
# peers wait for it).  The forward primitives carry no JAX effect (an effect would
# send every jitted call down JAX's slow dispatch path), so we keep them alive
# ourselves: a rule that never drops them, and a guard on every higher-order
# primitive (loops, conditionals, nested jit, remat, custom derivatives) that
# keeps the whole equation when its body contains a collective.
_PRIMITIVES: set[jc.Primitive] = set()
_contains_cache: "weakref.WeakKeyDictionary[jc.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def contains_collective(jaxpr: jc.Jaxpr) -> bool:
    """Whether `jaxpr` (or any jaxpr nested in it) binds a vjpmpi collective."""
    hit = _contains_cache.get(jaxpr)
    if hit is None:
        hit = any(_communicates(eqn) for eqn in jaxpr.eqns)
        _contains_cache[jaxpr] = hit
    return hit


def _binds_collective(prim, params) -> bool:
    """Whether `prim` is a collective or holds one in a jaxpr of its `params`."""
    return prim in _PRIMITIVES or any(contains_collective(j) for j in jc.jaxprs_in_params(params))


def _communicates(eqn) -> bool:
    return _binds_collective(eqn.primitive, eqn.params) or _is_exported_call(eqn)


_exported_cache: dict = {}


def _is_exported_call(eqn) -> bool:
    """Whether `eqn` calls a `jax.export`ed function whose program runs vjpmpi collectives.

    Such a function was compiled with a chain of its own and takes no token, so it can
    be ordered against nothing else in the calling program.
    """
    if eqn.primitive is not jc.call_exported_p:
        return False
    exported = eqn.params["exported"]
    hit = _exported_cache.get(id(exported))
    if hit is None:  # (the object is kept so that its id stays its own)
        hit = _exported_cache[id(exported)] = (exported, "vjpmpi_" in jc.exported_text(exported))
    return hit[1]


def _members(jaxpr: jc.Jaxpr) -> tuple[int, int]:
    """(collective equations, calls of exported collective functions) in `jaxpr`, nested."""
    own = exported = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive in _PRIMITIVES:
            own += 1
        elif _is_exported_call(eqn):
            exported += 1
        for j in jc.jaxprs_in_params(eqn.params):
            if contains_collective(j):
                o, e = _members(j)
                own, exported = own + o, exported + e
    return own, exported


# ------------------------------------------------------------- ordering --
class Ordered(jc.Effect):
    """Program order: the one XLA token chain through all collectives of a program.

    An *ordered* effect, so JAX's lowering threads a token for it through loop
    carries, branch operands and results, nested calls, remat and custom
    derivatives, in program order.  Traced jaxprs never carry it (any effect in a
    jitted function sends its calls down JAX's slow dispatch path): it is added to a
    copy of the jaxpr when lowering starts (`_jax_compat.ordered_lowering`), and the
    chain starts with a fresh token and ends inside the program.
    """

    def __repr__(self):
        return "vjpmpi.Ordered"


ORDERED = Ordered()
jc.register_effect(Ordered, ordered=True)
_SPEC_OF: dict[jc.Primitive, "Collective"] = {}


# More checks of a program before it is lowered: `check(jaxpr)` raises (vjpmpi.start's).
LOWERING_CHECKS: list[Callable[[jc.Jaxpr], None]] = []


def _mark(jaxpr: jc.Jaxpr) -> jc.Jaxpr:
    for check in LOWERING_CHECKS:
        check(jaxpr)
    own, exported = _members(jaxpr)
    if exported and own + exported > 1:
        raise NotImplementedError(
            "vjpmpi: this program calls a jax.export-ed function that runs vjpmpi "
            f"collectives, next to {own + exported - 1} other collective call(s). An "
            "exported function carries its own ordering chain and cannot be ordered "
            "against the rest of the program; call it in a program of its own, or export "
            "the whole program.")
    sigs = signatures(jaxpr)

    def own_params(eqn):
        if eqn.primitive not in _PRIMITIVES:
            return None
        return {"ordered": True, "sig": sigs.get(eqn.params["comm"], 0)}

    return jc.mark_jaxpr(jaxpr, ORDERED, own_params, contains_collective, {})


# ---------------------------------------------------- program signatures --
# A program's signature on a communicator: a hash of the structure of its collectives
# there (each one's op, parameters, dtype and per-rank block, and the loops and branches
# around them). The kernels compare the ranks' collectives when a rank runs a program
# whose signature it has not yet seen verified (csrc/vjpmpi_agree.h); ranks that run the
# same collectives have the same signature, whatever else their programs compute.
_structures: "weakref.WeakKeyDictionary[jc.Jaxpr, dict]" = weakref.WeakKeyDictionary()


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
    hit = _structures.get(jaxpr)
    if hit is not None:
        return hit
    seq = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        spec = _SPEC_OF.get(eqn.primitive)
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
            else:  # calls, remat, custom derivatives: their bodies, in order
                for sub in subs:
                    seq[comm].extend(sub)
    out = {c: tuple(v) for c, v in seq.items()}
    _structures[jaxpr] = out
    return out


_DTYPE_NAMES: dict = {}


def _item(spec: "Collective", eqn) -> tuple:
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


def _first_collective(jaxpr: jc.Jaxpr) -> str | None:
    for eqn in jaxpr.eqns:
        if eqn.primitive in _PRIMITIVES:
            return eqn.primitive.name.removeprefix("vjpmpi_").removesuffix("_lin")
        for j in jc.jaxprs_in_params(eqn.params):
            found = _first_collective(j)
            if found:
                return found
    return None


def _unchained(name: str | None, where) -> NotImplementedError:
    """The error for a collective that a JAX construct lowers without the chain's token."""
    return NotImplementedError(
        f"vjpmpi.{name or 'collective'}: collective lowered outside vjpmpi's ordering chain "
        f"(in '{where}'): a JAX construct around it does not pass XLA tokens on, so its "
        "order against the program's other collectives could differ between ranks. Please "
        "report this with the construct used.")


jc.ordered_lowering(ORDERED, _mark, contains_collective,
                    lambda jaxpr, where: _unchained(_first_collective(jaxpr), where))
jc.carry_while_predicate(contains_collective)


def _int64(v: int) -> np.int64:
    # Handles and addresses travel as int64 bit patterns (mpi4py may report an
    # MPICH handle sign-extended to 64 unsigned bits).
    return np.int64(v - (1 << 64) if v >= (1 << 63) else v)


def _user_frame() -> str:
    """`file:line (function)` of the user code that issued the collective being lowered."""
    for frame in jc.user_frames():
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
    """Register a description of this call site with the kernels (what the watchdog, the
    check and the timeout name); the hash of its text, the same in every process that
    lowers the same call."""
    if spec.describe is not None:
        call = spec.describe(params)
    else:
        detail = [_DESCRIBE[k](params[k]) for k in spec.params if k in _DESCRIBE]
        detail += ["from the last rank down"] if spec.fixed.get("reverse") else []
        call = f"{spec.ffi_target()}({', '.join(detail)})"
    avals = ", ".join(f"{a.dtype}{list(a.shape)}" for a in ctx.avals_in)
    stage = " [backward]" if "transpose" in str(ctx.name_stack) else ""
    return _kernels.register_site(
        f"{call} on {avals or 'no data'}{stage} at {_user_frame()}")


def _lower(ctx, *args, spec: Collective, **params):
    """Lower to `vjpmpi_<target>`, taking the program's chain token and handing on the next.

    The chain runs through every collective of the program in program order, into and
    out of loops, branches and nested calls (see `Ordered`), so XLA cannot reorder two
    collectives, whatever the data dependencies between them on each rank.
    """
    if spec.ffi_target() is None:  # no communication: the identity, token passed on
        token = jc.chain_token(ctx, ORDERED)
        if token is not None:
            jc.set_chain_token(ctx, ORDERED, token)
        return list(args)
    aliases = {}
    if spec.alias is not None:
        i, j = spec.alias
        a, b = ctx.avals_in[i], ctx.avals_out[j]
        if a.shape == b.shape and a.dtype == b.dtype:
            aliases = {i: j}
    return chained_call(ctx, spec, f"vjpmpi_{spec.ffi_target()}", args, ctx.avals_in,
                        ctx.avals_out, ffi_attrs(ctx, spec, params), aliases)


def chained_call(ctx, spec: Collective, target: str, args, avals_in, avals_out, attrs: dict,
                 aliases: dict | None = None) -> list:
    """The FFI custom call `target` (a call of `spec`) on the program's ordering chain:
    `args` (of `avals_in`) and the chain's token in, results of `avals_out` and the next
    token out; returns the results."""
    token = _chain_start(ctx, spec)
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True,
                                operand_output_aliases=aliases or {})
    sub = ctx.replace(avals_in=[*avals_in, jc.abstract_token],
                      avals_out=[*avals_out, jc.abstract_token])
    outs = rule(sub, *args, token, **attrs)
    jc.set_chain_token(ctx, ORDERED, outs[-1])
    return outs[:-1]


# The communicators whose numbers are the same in every process (the default one,
# COMM_WORLD, COMM_SELF: vjpmpi._mpi.default_comm), the only ones an exported program
# may name.
_EXPORTABLE_COMMS = (1, 2, 3)


def ffi_attrs(ctx, spec: Collective, params) -> dict:
    """The FFI attributes of one call of `spec` with `params` (every handler's set)."""
    if params["comm"].id not in _EXPORTABLE_COMMS and jc.lowering_for_export(ctx):
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: a program exported with jax.export names its communicator "
            f"by vjpmpi's number for it, given in order of first use (this one is "
            f"#{params['comm'].id}): in the process that loads it, that number could be "
            "another communicator's. Export programs on the default communicator, "
            "MPI.COMM_WORLD or MPI.COMM_SELF (#1-#3 in every process).")
    attrs = dict.fromkeys(FFI_ATTRS, np.int64(0))
    attrs.update({attr: _int64(params[k]) for k, attr in spec.params.items()})
    attrs.update({attr: np.int64(v) for attr, v in spec.fixed.items()})
    attrs["comm"] = np.int64(params["comm"].id)
    # (what the watchdog's warnings, VJPMPI_CHECK and VJPMPI_TIMEOUT name; a note describes
    # the call instead)
    attrs["site"] = np.int64(params.get("note", 0) or _site(ctx, spec, params))
    attrs["sig"] = np.int64(params.get("sig", 0))
    attrs["invalid"] = np.int64(params.get("invalid", 0))
    return attrs


def _chain_start(ctx, spec: Collective):
    """The chain's token for a call of `spec` being lowered, after the checks that the
    program can run it (platform, backend built, one device per process)."""
    platforms = set(ctx.module_context.platforms)
    for other in sorted(platforms - {"cpu", "cuda"}):
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: vjpmpi has no {_BACKEND_NAMES.get(other, other)} backend "
            "(it has CPU and CUDA ones), so a program with collectives cannot be compiled for "
            f"{_BACKEND_NAMES.get(other, other)}")
    if "cuda" in platforms and spec.host_only:
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: has no CUDA kernel yet (host memory only), so a program "
            "with it cannot be compiled for a GPU; run it on the CPU backend")
    if "cuda" in platforms and _kernels.cuda is None:
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: vjpmpi was built without its CUDA backend (no CUDA toolkit "
            "was found at build time), so it cannot run on a GPU. Rebuild it on a machine "
            "with the CUDA headers: VJPMPI_CUDA=1 pip install --no-cache-dir --force-reinstall "
            "vjpmpi")
    devices = jc.program_devices(ctx)
    if devices > 1:
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: the program being compiled runs on {devices} devices of "
            "this process (a multi-device sharding, shard_map or pmap); vjpmpi runs one "
            "collective per process, so each device would call MPI on its own. Use one "
            "device per MPI rank (see vjpmpi.local_device()).")
    token = jc.chain_token(ctx, ORDERED)
    if token is None:
        raise _unchained(spec.name, ctx.name_stack)
    return token


_BACKEND_NAMES = {"rocm": "ROCm", "tpu": "TPU", "METAL": "Metal"}


# ------------------------------------------------------------- batching --
def _batch(prim, spec: Collective, args, dims, **params):
    if spec.batch is not None:
        return spec.batch(prim, args, dims, params)
    # The batch axis goes to one fixed place, first within each rank's block, whatever
    # this rank's batching (axes, unbatched operands): the buffers MPI pairs across
    # ranks must have one layout on every rank, and another rank may batch differently.
    in_ax, out_ax = spec.rank_axis(params)
    mapped = [(a, d) for a, d in zip(args, dims) if d is not None]
    n = mapped[0][0].shape[mapped[0][1]]
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


# ------------------------------------------------------- differentiation --
def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _jvp(prim, lin, spec: Collective, primals, tangents, **params):
    outs = prim.bind(*primals, **params)
    avals = [jax.typeof(o) for o in outs]
    return outs, tangents_out(lin, spec, primals, tangents, avals, params, outs)


def tangents_out(lin, spec: Collective, primals, tangents, avals, params, outs=None) -> list:
    """The tangents of a call of `spec` (results of `avals`; `outs`, the results, for a
    nonlinear op): for a linear op, its linearized twin `lin` on the tangents, run on
    every rank."""
    if not any(_is_float(a) for a in [*map(jax.typeof, primals), *avals]):
        # integer / bool data: float0 tangents, nothing to communicate
        return [jc.Zero(a.to_tangent_aval()) for a in avals]
    if spec.linear(params):
        # Zero tangents become real zeros: the tangent collective must run on every
        # rank, whether or not this rank's input depends on what is differentiated.
        ts = [jc.instantiate_zeros(t) for t in tangents]
        why = spec.refuse_derivative(params)
        if why is not None:
            params = {**params, "invalid": refusal(spec.name, why)}
        return lin.bind(*ts, **params)
    return spec.nonlinear_jvp(primals, tangents, outs, params)


def transpose(spec: Collective, cts, *args, **params):
    # A zero cotangent still takes part: every rank runs every transposed collective.
    cts = [jc.instantiate_zeros(ct) for ct in cts]
    return spec.transpose(cts, args, params)


# --------------------------------------------------------------- derive --
class Linearized(jc.Effect):
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
jc.register_effect(Linearized, ordered=False)
LIN_OF: dict[jc.Primitive, jc.Primitive] = {}  # a collective's primitive -> its tangent twin


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
        p.def_impl(functools.partial(_apply, p))
        # Not cacheable: each call site registers its own description (check, timeout).
        # One rule for every platform (it says which it cannot serve): a multi-platform
        # lowering then needs no per-platform switch, which JAX cannot build around an
        # ordered effect.
        jc.register_lowering(p, functools.partial(_lower, spec=spec), cacheable=False)
        jc.primitive_batchers[p] = functools.partial(_batch, p, spec)
        jc.primitive_jvps[p] = functools.partial(_jvp, p, lin, spec)
        if spec.transpose is not None:
            jc.primitive_transposes[p] = functools.partial(transpose, spec)
        register(p, spec)
    return prim, lin


def register(p: jc.Primitive, spec: Collective) -> None:
    """`p` is one of vjpmpi's calls (described by `spec`): on the ordering chain, never
    dropped by dead code elimination or partial evaluation."""
    jc.keep_alive_in_dce(p)
    jc.keep_in_partial_eval(p)
    _PRIMITIVES.add(p)
    _SPEC_OF[p] = spec
    jc.guard_dce_rules(_communicates, _PRIMITIVES.__contains__)
    jc.keep_traced_equations(_communicates)


# Every rank runs every tangent collective (and so its transpose), also where its
# inputs do not depend on what is differentiated.
jc.run_tangent_rules(_binds_collective)
jc.track_host_callbacks()

_IN_CALLBACK = (
    "vjpmpi.{op}: called from inside a host callback (jax.pure_callback, io_callback or "
    "debug.callback). The callback runs in the middle of another compiled program, "
    "ordered only by data dependencies, so its collectives could pair with different "
    "collectives on different ranks. Call vjpmpi in the traced program instead.")


# Eager calls: one jitted function per (primitive, parameters), kept, so that a call
# outside any trace goes straight to JAX's compiled-call fast path (by shape and
# dtype) instead of dispatching the primitive on its own.
_EAGER: dict = {}
_EAGER_MAX = 512


# Communicator number -> the Python thread that owns its collectives (the first that
# traced or ran one on it; the kernels hold the same record, see `claim_thread`).
_OWNERS: dict[int, int] = {}


def _claim(comm: CommRef, op: str) -> None:
    """This thread may run collectives on `comm` only if it owns it (the first thread to
    ask does): MPI leaves collectives issued from several threads on one communicator
    in no defined order across ranks."""
    me = threading.get_native_id()
    if _OWNERS.get(comm.id) == me:
        return
    owner, error = _kernels.cpu.claim_thread(comm.id, me)
    if error:
        raise RuntimeError(f"vjpmpi.{op}: {error}")
    _OWNERS[comm.id] = owner


def refusal(op: str, why: str) -> int:
    """An argument error that must reach every rank it concerns: the op is bound with it
    (parameter `invalid`, the hash of its text) instead of raising here, on one rank while
    the others would wait for this one forever. When the op runs, a collective fails on
    every rank of its communicator (the ranks' agreement carries the text), and a
    point-to-point op, whose peers cannot be told, ends the job with the text."""
    return _kernels.register_site(why if why.startswith("vjpmpi.") else f"vjpmpi.{op}: {why}")


# Whether this process has a note of a collective it refused at trace time (`refuse_here`):
# it goes at this rank's next call on a communicator of the same ranks.
_REFUSAL_NOTED = False


def refuse_here(comm: CommRef, op: str, why: str, *, root: int = -1) -> NoReturn:
    """Raise `ValueError(why)` for an argument error that only this rank can see (the
    ranks that pair with it cannot check it), at trace time: this rank does not enter the
    collective. The ranks that do wait in it (their collective there one past this rank's
    count) stop with the same text: this rank's note in the default communicator's window
    says what it refused (op, `root`; -1: an op without one), and a rank that waits for
    this one there, reading the note unchanged for a second, raises it (or, inside MPI
    already, ends the job with it). The note goes when this rank calls anything else on
    a communicator of the same ranks, so ranks that skipped the refused call are not taken
    for ones that make it (a rank that waits in it is told only if the refusing rank does
    not go on there within that second: then its next call there is compared with the
    refused one, a mismatch error, or the job's end where a rank is inside MPI)."""
    global _REFUSAL_NOTED
    text = why if why.startswith("vjpmpi.") else f"vjpmpi.{op}: {why}"
    _REFUSAL_NOTED = _kernels.cpu.note_refusal(comm.id, op, root, text)
    raise ValueError(text)


def _clear_refusal(comm: CommRef) -> None:
    global _REFUSAL_NOTED
    _REFUSAL_NOTED = _kernels.cpu.note_refusal(comm.id, "", -1, "")


# vjpmpi.start sets `hook` while it calls the op: the op's bind hands it the call
# (primitive, arrays, communicator, parameters) instead of binding it (see `captured`).
_CAPTURE = threading.local()


class captured:
    """`with captured(hook):` the binds of this thread go to `hook(prim, args, comm,
    params)`, which returns what `bind` returns."""

    def __init__(self, hook: Callable):
        self.hook = hook

    def __enter__(self):
        self.before = getattr(_CAPTURE, "hook", None)
        _CAPTURE.hook = self.hook

    def __exit__(self, *exc):
        _CAPTURE.hook = self.before


def bind(prim: jc.Primitive, args: Sequence, comm: CommRef, *, invalid: str | None = None,
         note: str | None = None, **params) -> list:
    """Bind `prim` on `args` with its static parameters (exactly those its spec declares);
    `invalid`: an argument error for `refusal`; `note`: what this rank's call is, shown
    for it when the ranks disagree (instead of its call site; not compared)."""
    if invalid is not None:
        params["invalid"] = refusal(prim.name.removeprefix("vjpmpi_"), invalid)
    if note is not None:
        params["note"] = _kernels.register_site(note)
    if jc.inside_host_callback():
        raise RuntimeError(_IN_CALLBACK.format(op=prim.name.removeprefix("vjpmpi_")))
    if _REFUSAL_NOTED:  # (this rank goes on: its refusal note goes, if about these ranks)
        _clear_refusal(comm)
    if not _SPEC_OF[prim].point_to_point:
        _claim(comm, prim.name.removeprefix("vjpmpi_"))
    capture = getattr(_CAPTURE, "hook", None)
    if capture is not None:  # inside vjpmpi.start
        return capture(prim, args, comm, params)
    if not jc.outside_traces():
        return prim.bind(*args, comm=comm, **params)
    return _eager(prim, {"comm": comm, **params})(*args)


def _eager(prim: jc.Primitive, params: dict) -> Callable:
    """The jitted call of `prim` with `params` that eager calls run (kept while its
    communicator lives: a communicator's programs are its own)."""
    key = (prim, *params.items())  # (bind and JAX both pass `comm` first)
    call = _EAGER.get(key)
    if call is None:
        _forget_freed()
        if len(_EAGER) >= _EAGER_MAX:  # e.g. a fresh MPI.Status object on every call
            _EAGER.clear()
        call = _EAGER[key] = jax.jit(functools.partial(prim.bind, **params))
    return call


def _forget_freed() -> None:
    """Drop the eager programs of freed communicators (they can never run again)."""
    alive: dict[int, bool] = {}
    for key in list(_EAGER):
        number = dict(key[1:])["comm"].id
        if number not in alive:
            alive[number] = _kernels.cpu.comm_alive(number)
        if not alive[number]:
            del _EAGER[key]


def _apply(prim: jc.Primitive, *args, **params) -> list:
    """`prim` on concrete arrays, bound outside any trace by JAX itself (an eager
    backward pass, or the body of a jit that `jax.disable_jit()` runs as Python)."""
    with jax.disable_jit(False):  # compiled whatever the caller's setting, as JAX's own
        return _eager(prim, params)(*args)
