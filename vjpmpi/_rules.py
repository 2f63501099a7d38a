"""The transformation rules every collective shares: batching, differentiation (JVP,
tangents of linear and nonlinear ops) and transposition, derived from a spec; and the
helpers the ops' own transposes use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _jax_compat as jc
from ._bind import refusal
from ._mpi import DeviceCommRef
from ._primitive import DYNAMIC, Collective, dynamic_ranks, is_root


# ------------------------------------------------------------- batching --
def batch(prim, spec: Collective, args, dims, **params):
    """The batching rule of a call of `spec` (the op's own, or the batch axis moved into
    each rank's block)."""
    ranks = []
    if dynamic_ranks(params):  # (the ranks each device computes: one per device, not batched)
        if dims[-1] is not None:
            raise NotImplementedError(
                f"vjpmpi.{spec.name}: its root, destination or source is batched (vmap over "
                "ranks that differ per batch member): vmap the data, not the ranks")
        args, dims, ranks = args[:-1], dims[:-1], [args[-1]]
    if spec.batch is not None:  # (the ragged exchange: no ranks of its own)
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
    outs = prim.bind(*moved, *ranks, **params)
    return outs, [b + int(out_ax) - int(in_ax)] * len(outs)


# ------------------------------------------------------- differentiation --
def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def jvp(prim, lin, spec: Collective, primals, tangents, **params):
    """The JVP rule of `prim` (a call of `spec`; `lin`, its linearized twin)."""
    outs = prim.bind(*primals, **params)
    avals = [jax.typeof(o) for o in outs]
    return outs, tangents_out(lin, spec, primals, tangents, avals, params, outs)


def tangents_out(lin, spec: Collective, primals, tangents, avals, params, outs=None) -> list:
    """The tangents of a call of `spec` (results of `avals`; `outs`, the results, for a
    nonlinear op): for a linear op, its linearized twin `lin` on the tangents, run on
    every rank. (A `ranks` operand, last, has no tangent: the tangent call takes it as it is.)"""
    ranks = []
    if dynamic_ranks(params):
        primals, tangents, ranks = primals[:-1], tangents[:-1], [primals[-1]]
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
        return lin.bind(*ts, *ranks, **params)
    p = {**params, "_ranks": ranks[0]} if ranks else params
    return spec.nonlinear_jvp(primals, tangents, outs, p)


def transpose(spec: Collective, cts, *args, **params):
    """The transpose rule of a call of `spec`: its spec's, on real cotangents."""
    # A zero cotangent still takes part: every rank runs every transposed collective.
    cts = [jc.instantiate_zeros(ct) for ct in cts]
    if dynamic_ranks(params):  # (the `ranks` operand, last: no cotangent)
        out = spec.transpose(cts, args[:-1], {**params, "_ranks": args[-1]})
        return [*out, None]
    return spec.transpose(cts, args, params)


# ------------------------------------------------- helpers of transposes --
def zeros_for(arg):
    """Zeros shaped like `arg`, an operand or an `UndefinedPrimal`."""
    if jc.is_undefined_primal(arg):
        return jnp.zeros(arg.aval.shape, arg.aval.dtype)
    return jnp.zeros_like(arg)


def only_linear(args, cts):
    """Cotangents for the linear operands, None for the constant ones."""
    return [ct if jc.is_undefined_primal(a) else None for a, ct in zip(args, cts)]


def on_root(p, yes, no):
    """`yes` on the call's root, `no` elsewhere: chosen here for a process communicator, by
    each device (`jnp.where` on its rank) for a device communicator."""
    comm = p["comm"]
    if not isinstance(comm, DeviceCommRef):
        return yes if is_root(p) else no
    root = p["_ranks"][0] if p["root"] in DYNAMIC else p["root"]
    return jnp.where(comm.rank == root, yes, no)


def device_comm(p) -> bool:
    """Whether the call's communicator is a device communicator (its ranks devices)."""
    return isinstance(p["comm"], DeviceCommRef)
