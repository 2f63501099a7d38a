"""Where a call runs: the one decision about devices, threads and peers that the
lowering and the kernels consult.

- One device (a single-device program): the call is the process's, on its communicator.
- Several devices of this process, inside `shard_map` (a manual mesh): each device's part
  of the program makes its own call, on a thread of its own (a "device call", kernel
  `vjpmpi_<op>_dev`, csrc/device_ops.h). With a process communicator, each device is a
  group of its own: device `i` of every process exchanges with device `i` of the others
  (the process is the rank, each device moves its own shard). With a device communicator
  (`vjpmpi.device_comm`), the devices along its mesh axis are ranks of one group:
  `process rank * D + axis index`.
- Several devices, partitioned by XLA (a jit of sharded arrays, `auto`): the call is
  wrapped in a `shard_map` over the program's devices (`wrap`), its arrays split along
  one axis that every device can take a part of, so that each device moves its own part.
- pmap: refused.

A device call gets `where` (int32[4]: its partition, then the call's root, destination
and source) and the `dev` attribute (`Placement.attribute`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

from . import _jax_compat as jc
from ._mpi import DeviceCommRef

__all__ = ["Placement", "placement", "auto_devices", "layout", "wrap", "needs_pairs",
           "sharded_call"]

# The split axis of an array that a call takes apart itself (`wrap`, eager calls).
AXIS = "vjpmpi_devices"


@dataclasses.dataclass(frozen=True)
class Placement:
    """A device call's layout: the program's devices `parts` (N), the group's devices per
    process `local` (D: 1 for a process communicator), the group axis's `stride` in the
    partition order, `layout`, a hash of the mesh and the axis (what the processes
    must agree on), and `group`: a device communicator's call."""

    parts: int
    local: int
    stride: int
    layout: int
    group: bool

    def attribute(self, level: int, split: int = 0) -> np.ndarray:
        """The `dev` attribute (csrc/device_ops.h); `level` 2: the program's point-to-point
        calls cross processes between devices of a group (duplicates per device pair);
        `split`: a hash of how the enclosing shard_map splits its arrays (the processes
        agree on it with the layout)."""
        layout = _hash(f"{self.layout}/{split}") if split else self.layout
        return np.array([self.parts, self.local, self.stride, layout, level,
                         int(self.group), len(jax.local_devices())], np.int64)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _multiple_threads(op: str) -> None:
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise NotImplementedError(
            f"vjpmpi.{op}: a program on several devices of this process calls MPI from each "
            f"device's thread, which needs MPI_THREAD_MULTIPLE (mpi4py's default); this MPI "
            f"was initialized at level {MPI.Query_thread()}. Let mpi4py initialize MPI "
            "(mpi4py.rc.thread_level = 'multiple'), or run one device per process.")


def placement(ctx, op: str, comm) -> Placement | None | str:
    """Where the call of `op` on `comm` being lowered runs: None (one device), "auto"
    (several devices partitioned by XLA: `wrap` it), or a device call's Placement."""
    kind, *info = jc.lowering_devices(ctx)
    device = isinstance(comm, DeviceCommRef)
    if kind == "one" or (kind == "auto" and not device):
        if device:
            raise ValueError(
                f"vjpmpi.{op}: a device communicator (vjpmpi.device_comm('{comm.axis}')) is "
                "used outside the jax.shard_map it was made in: its ranks are that "
                "shard_map's devices. Make the call inside the shard_map body.")
        return None if kind == "one" else "auto"
    if kind == "replica":
        raise NotImplementedError(
            f"vjpmpi.{op}: jax.pmap runs one program per device of this process; vjpmpi "
            "runs in programs on one device per process, jax.shard_map and jit over several "
            "devices. Use jax.shard_map instead of jax.pmap.")
    mesh, manual = info
    names = tuple(mesh.axis_names)
    if manual != frozenset(names):
        raise NotImplementedError(
            f"vjpmpi.{op}: called inside a jax.shard_map that leaves mesh axes "
            f"{sorted(set(names) - manual)} to XLA (axis_names=...): vjpmpi needs every "
            "device's own call, in a shard_map over all of the mesh's axes.")
    _multiple_threads(op)
    sizes = tuple(int(mesh.shape[a]) for a in names)
    if math.prod(sizes) > len(jax.local_devices()):
        raise NotImplementedError(
            f"vjpmpi.{op}: called in a jax.shard_map over {math.prod(sizes)} devices, more "
            f"than this process's {len(jax.local_devices())}: a mesh of a multi-process "
            "jax.distributed run. vjpmpi's ranks are MPI processes, each with its own "
            "devices: shard_map over a mesh of jax.local_devices().")
    if device:
        if comm.axis not in names:
            raise ValueError(
                f"vjpmpi.{op}: device communicator of mesh axis '{comm.axis}', called inside "
                f"a jax.shard_map over a mesh with axes {names}")
        k = names.index(comm.axis)
        local, stride = sizes[k], math.prod(sizes[k + 1:])
        if local != comm.local:
            raise ValueError(
                f"vjpmpi.{op}: device communicator of {comm.local} devices along "
                f"'{comm.axis}', called in a shard_map whose mesh has {local} there")
    else:
        local, stride = 1, 1
    text = f"{names}{sizes}{comm.axis if device else ''}"
    return Placement(math.prod(sizes), local, stride, _hash(text), device)


def needs_pairs(comms) -> bool:
    """Whether a program's point-to-point calls on `comms` may cross processes between
    devices of a group (the `dev` attribute's level 2)."""
    return any(isinstance(c, DeviceCommRef) for c in comms)


# -------------------------------------- a call XLA partitions: split by devices --
def layout(spec, params, avals_in, avals_out, parts: int, block_spec: tuple | None = None,
           axis_names=None):
    """`(in_specs, out_specs)` of a call of `spec` whose arrays each device takes a part of:
    one axis of the per-rank block (the operand's shape without the communicator's rank
    axis), split over the devices (`block_spec`: given, from a sharded array; else the
    first axis whose length the `parts` devices divide, over the mesh axes `axis_names`),
    in every operand and result of that block's shape; the others whole on every
    device."""
    if getattr(spec, "split", True) is False or not avals_in:
        return tuple(P() for _ in avals_in), tuple(P() for _ in avals_out)
    in_ax, out_ax = spec.rank_axis(params)
    first = avals_in[0]
    block = tuple(first.shape[1:] if in_ax else first.shape)
    if block_spec is None:
        dims = [k for k, n in enumerate(block) if n and n % parts == 0]
        axis = AXIS if axis_names is None else axis_names
        block_spec = tuple(axis if dims and k == dims[0] else None for k in range(len(block)))
    block_spec = tuple(block_spec) + (None,) * (len(block) - len(block_spec))

    def spec_of(aval, lead: int):
        if tuple(aval.shape[lead:]) != block or len(aval.shape) != lead + len(block):
            return P()
        return P(*([None] * lead), *block_spec)

    ins = tuple(spec_of(a, 1 if (i == 0 and in_ax) else 0) for i, a in enumerate(avals_in))
    outs = tuple(spec_of(a, 1 if (i == 0 and out_ax) else 0) for i, a in enumerate(avals_out))
    return ins, outs


def _split_hash(spec, params, mesh, first) -> int:
    """How a call split by vjpmpi splits the per-rank block of its first operand over
    `mesh` (what the processes must agree on: their devices' parts must correspond)."""
    lead = 1 if spec.rank_axis(params)[0] else 0
    block = tuple(first)[lead:]
    while block and block[-1] is None:
        block = block[:-1]
    return _hash(repr((mesh, block)))


def auto_devices(ctx) -> int:
    """The devices of the program being lowered (auto: several)."""
    kind, n = jc.lowering_devices(ctx)[:2]
    local = len(jax.local_devices())
    if n > local:
        raise NotImplementedError(
            f"vjpmpi: the program being compiled runs on {n} devices, more than this "
            f"process's {local}: a jit over a multi-process jax.distributed mesh. vjpmpi's "
            "ranks are MPI processes, each with its own devices; run the program on this "
            "process's devices (a mesh of jax.local_devices()).")
    return n


def wrap(ctx, prim, spec, params, args):
    """Lower a call in a program that XLA partitions over several devices: the call inside
    a `shard_map` over those devices, each device's part of its arrays (`layout`) moved
    by that device's own call."""
    n = auto_devices(ctx)
    mesh = jc.context_mesh(ctx.avals_in)
    if mesh is None or mesh.size != n:
        # (axes of the automatic type: JAX 0.12's default is explicit)
        mesh = jax.sharding.AbstractMesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        names, explicit = None, False
    else:  # (a mesh the program names: split over all of its axes)
        names, explicit = tuple(mesh.axis_names), jc.explicit_axes(mesh)
    block = None
    if explicit:
        # Arrays typed by their split (jax.make_mesh's default axis type): each device's
        # part as the first array is split, the others and the results resharded to match
        # its parts, then to their own types.
        first = ctx.avals_in[0]
        lead = 1 if spec.rank_axis(params)[0] else 0
        given = tuple(first.sharding.spec) + (None,) * len(first.shape)
        block = given[lead:len(first.shape)] if any(given[lead:]) else None
    ins, outs = layout(spec, params, ctx.avals_in, ctx.avals_out, n, block, names)
    key = n if names is None else tuple(mesh.shape.items())
    split = {**params, "layout": _split_hash(spec, params, key, ins[0])}
    body = lambda *xs: prim.bind(*xs, **split)  # noqa: E731

    def fn(*xs):
        if explicit:
            xs = [jc.reshard(x, mesh, s) for x, s in zip(xs, ins, strict=True)]
        ys = jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=list(outs),
                           check_vma=False)(*xs)
        if explicit:
            ys = [jc.reshard(y, mesh, a.sharding.spec) for y, a in zip(ys, ctx.avals_out, strict=True)]
        return ys
    return jc.lower_fun(fn, ctx, args)


_SHARDED: dict = {}


def sharded_call(prim, spec, params: dict, args):
    """The eager call of `prim` on `args` when its first array is sharded over several
    devices of this process (a NamedSharding): each device's call on its own part, in a
    `shard_map` over the array's mesh, the array's split kept (the communicator's rank
    axis is whole on every device); None for an array on one device."""
    sharding = getattr(args[0], "sharding", None) if args else None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "size", 1) < 2 or not hasattr(sharding, "spec"):
        return None
    for a in args:
        if not getattr(a, "is_fully_addressable", True):
            raise ValueError(
                f"vjpmpi.{spec.name}: an argument is a global jax.Array with devices of other "
                "processes (a multi-process jax.distributed array); vjpmpi's ranks are MPI "
                "processes: pass this process's part (a jax.Array of its own devices)")
    shapes = tuple((tuple(a.shape), str(a.dtype)) for a in args)
    key = (prim, *params.items(), mesh, tuple(sharding.spec), shapes)
    fn = _SHARDED.get(key)
    if fn is None:
        in_avals = [jax.typeof(a) for a in args]
        out_avals = prim.abstract_eval(*in_avals, **params)[0]
        in_ax = spec.rank_axis(params)[0]
        given = tuple(sharding.spec)
        block = given[1 if in_ax else 0:]
        if not any(block):  # (split along the rank axis only: split the block as jit does)
            block = None if any(given) else ()
        ins, outs = layout(spec, params, in_avals, out_avals, mesh.size, block,
                           tuple(mesh.axis_names))
        split = {**params, "layout": _split_hash(spec, params, tuple(mesh.shape.items()), ins[0])}
        body = lambda *xs: prim.bind(*xs, **split)  # noqa: E731
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=list(outs),
                                   check_vma=False))
        if len(_SHARDED) > 256:
            _SHARDED.clear()
        _SHARDED[key] = fn
    return jc.block_for_errors(fn(*args))  # (a failure raised at the call: a ValueError)
