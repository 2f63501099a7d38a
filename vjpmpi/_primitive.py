"""What a collective is: its `Collective` spec, its primitives' registry, and which
equations communicate (the bookkeeping that dead code elimination and ordering read).

A spec says what is particular to a collective (its FFI target, output shapes, which
operand its result may alias, where the communicator's rank axis sits for batching,
its derivative rules). `_derive.make_primitive` turns one into a primitive pair;
`_lowering`, `_rules` and `_bind` hold the machinery every collective shares.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

from . import _jax_compat as jc

# The attributes every FFI handler takes (csrc/bindings.h), besides `comm`
# (vjpmpi's number for the communicator), `site` (the call-site hash), `sig` (the
# program's signature on the communicator) and `invalid` (an argument error found at
# trace time, raised at run time on every rank). A primitive carries only the
# parameters its spec declares; each maps onto one of these, the others are lowered as 0.
FFI_ATTRS = ("red", "root", "peer", "peer2", "tag", "tag2", "status", "reverse")

# A rank parameter (root, dest, source) that each device computes itself (inside a
# shard_map, from its axis index, on a device communicator): its value is one of these,
# naming an entry of one more operand of the primitive, `ranks` (int32[3]: root,
# destination, source; its last operand), which holds the call's three ranks.
RANK_SLOTS = {"root": 0, "peer": 1, "peer2": 2}  # FFI attribute -> entry of `ranks`
DYNAMIC = (-(1 << 40), -(1 << 40) - 1, -(1 << 40) - 2)  # entry 0, 1, 2


def dynamic_ranks(params) -> bool:
    """Whether a call with `params` takes its ranks from its `ranks` operand."""
    return any(type(v) is int and v in DYNAMIC for v in params.values())


@dataclasses.dataclass(frozen=True)
class Collective:
    """Everything particular to one collective.

    Attributes:
        name: primitive name suffix and FFI target (`vjpmpi_<name>`).
        params: the static parameters besides `comm`, each `name: FFI attribute`
            (one of `FFI_ATTRS`); the primitive carries exactly these.
        fixed: FFI attributes with a value of this spec's own (`{"reverse": 1}`: a
            scan over the ranks in reverse order).
        out_avals: `(params, *in_avals) -> list of output avals`.
        alias: `(operand, result)` that may share a buffer (in place), or None.
        alias_apart: `params -> operand or None`: an operand that, where it is the
            aliased operand's own value, keeps the result in a buffer of its own
            (`sendrecv(x, x)` from a rank: the array sent is its own template, which XLA
            would copy before the call, and again into a loop's carry); None: the alias
            holds (a receive from MPI.PROC_NULL, which leaves the result the template).
        rank_axis: `params -> (input_has_rank_axis, output_has_rank_axis)`: whether
            the leading axis of operand 0 / result 0 enumerates the communicator's ranks
            (used to place the batch axis behind it).
        target: the FFI handler it runs (default: `name`); None lowers to the identity.
        linear: `params -> bool`, whether the op is linear in its array operands for
            these parameters (then its JVP is the op applied to the tangents).
        transpose: `(cts, args, params) -> cotangents of args`, the adjoint of the global
            linear map; `args` holds `UndefinedPrimal`s for the linear operands.
        nonlinear_jvp: `(primals, tangents, outs, params) -> tangents out` when not
            linear (`outs`: the primal results).
        point_to_point: the op pairs with one peer's op (send, recv, sendrecv), not with
            a collective of every rank: it takes no part in the ranks' agreement on collectives.
        refuse_derivative: `params -> None, or why` these parameters have no derivative
            (a receive from `MPI.ANY_SOURCE`): the tangent op is then bound refused (see `bind`).
        block: `(params, in_avals) -> tuple`, what the ranks agree on as the per-rank
            block, where it is not operand 0's shape (less its rank axis).
        batch: `(prim, args, dims, params) -> (outs, out_dims)`, a batching rule of the
            op's own, where moving the batch axis into each rank's block is not it.
        host_only: the kernel exists for host memory only (no CUDA handler yet).
        describe: `params -> text`, how a call site names the call (default: the target
            and the parameters `_lowering` knows how to show), where one kernel serves several ops.
        local: the kernel exchanges nothing with other ranks (`hold`): a program on several
            devices runs the same kernel on each (no device call).
        split: whether a call in a program that XLA partitions may take its arrays apart
            along their per-rank block's axes (`_placement.layout`); False: whole on every
            device.
        pairs: on a device communicator it sends point to point between devices (the
            ragged exchange), as `point_to_point` ops do (duplicates per device pair).
        varies: `(params, vma) -> vma`, the mesh axes its results vary over inside
            shard_map, from those of its operands and its device communicator's axis
            (default: those).
    """

    name: str
    out_avals: Callable[..., list[jc.ShapedArray]]
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    fixed: dict[str, int] = dataclasses.field(default_factory=dict)
    alias: tuple[int, int] | None = None
    alias_apart: Callable[[dict], int | None] = lambda params: None
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
    local: bool = False
    split: bool = True
    varies: Callable[[dict, frozenset], frozenset] | None = None
    pairs: bool = False

    def ffi_target(self) -> str | None:
        return self.name if self.target == "" else self.target



# ------------------------------------------------------------ spec helpers --
def like(i: int) -> Callable:
    """`out_avals` of an op whose one result is shaped like operand `i`."""
    return lambda params, *avals: [avals[i]]


def with_shape(aval, shape) -> jc.ShapedArray:
    """`aval` with another shape (dtype, weak type, shard_map typing and an explicit
    sharding's split of the axes it keeps)."""
    return jc.reshaped(aval, tuple(shape))


def is_root(params) -> bool:
    """Whether this rank is the call's `root` (a process communicator's: a device
    communicator's rank is each device's own, `_rules.on_root`)."""
    return params["comm"].rank == params["root"]


# ----------------------------------------------------------------- effects --
class Ordered(jc.Effect):
    """Program order: the one XLA token chain through all collectives of a program.

    An *ordered* effect, so JAX's lowering threads a token for it through loop
    carries, branch operands and results, nested calls, remat and custom
    derivatives, in program order.  Traced jaxprs never carry it (any effect in a
    jitted function sends its calls down JAX's slow dispatch path): it is added to a
    copy of the jaxpr when lowering starts (`_ordering.mark`), and the chain starts
    with a fresh token and ends inside the program.
    """

    def __repr__(self):
        return "vjpmpi.Ordered"


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


ORDERED = Ordered()
LINEARIZED = Linearized()


# ---------------------------------------------------------------- registry --
COLLECTIVES: set[jc.Primitive] = set()  # every primitive of vjpmpi's calls
SPEC_OF: dict[jc.Primitive, Collective] = {}  # a call's primitive -> its spec
LIN_OF: dict[jc.Primitive, jc.Primitive] = {}  # a collective's primitive -> its tangent twin
# The ops of the package by name (`_derive.define`): spec, primitive, tangent twin.
SPECS: dict[str, Collective] = {}
PRIMITIVES: dict[str, jc.Primitive] = {}
LINEARIZED_PRIMITIVES: dict[str, jc.Primitive] = {}


def register(p: jc.Primitive, spec: Collective) -> None:
    """`p` is one of vjpmpi's calls (described by `spec`): on the ordering chain, never
    dropped by dead code elimination or partial evaluation."""
    jc.keep_alive_in_dce(p)
    jc.keep_in_partial_eval(p)
    COLLECTIVES.add(p)
    SPEC_OF[p] = spec


# ------------------------------------------------- dead code elimination --
# Collectives communicate, so one whose result is unused must still run (its
# peers wait for it).  The forward primitives carry no JAX effect (an effect would
# send every jitted call down JAX's slow dispatch path), so we keep them alive
# ourselves: a rule that never drops them, and a guard on every higher-order
# primitive (loops, conditionals, nested jit, remat, custom derivatives) that
# keeps the whole equation when its body contains a collective (the JAX seam,
# installed once: `_seam.install`).
_contains_cache: "weakref.WeakKeyDictionary[jc.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def contains_collective(jaxpr: jc.Jaxpr) -> bool:
    """Whether `jaxpr` (or any jaxpr nested in it) binds a vjpmpi collective."""
    hit = _contains_cache.get(jaxpr)
    if hit is None:
        hit = any(communicates(eqn) for eqn in jaxpr.eqns)
        _contains_cache[jaxpr] = hit
    return hit


def binds_collective(prim, params) -> bool:
    """Whether `prim` is a collective or holds one in a jaxpr of its `params`."""
    return prim in COLLECTIVES or any(contains_collective(j) for j in jc.jaxprs_in_params(params))


def communicates(eqn) -> bool:
    """Whether the equation `eqn` communicates (binds, holds or calls a collective)."""
    return binds_collective(eqn.primitive, eqn.params) or is_exported_call(eqn)


_exported_cache: dict = {}


def is_exported_call(eqn) -> bool:
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


def members(jaxpr: jc.Jaxpr) -> tuple[int, int]:
    """(collective equations, calls of exported collective functions) in `jaxpr`, nested."""
    own = exported = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive in COLLECTIVES:
            own += 1
        elif is_exported_call(eqn):
            exported += 1
        for j in jc.jaxprs_in_params(eqn.params):
            if contains_collective(j):
                o, e = members(j)
                own, exported = own + o, exported + e
    return own, exported


def first_collective(jaxpr: jc.Jaxpr) -> str | None:
    """The op name of the first collective in `jaxpr` (nested), for error messages."""
    for eqn in jaxpr.eqns:
        if eqn.primitive in COLLECTIVES:
            return eqn.primitive.name.removeprefix("vjpmpi_").removesuffix("_lin")
        for j in jc.jaxprs_in_params(eqn.params):
            found = first_collective(j)
            if found:
                return found
    return None
