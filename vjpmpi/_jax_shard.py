"""The JAX seam's sharding half (imported by `_jax_compat` only, which hands its names to
the package): where a program being lowered runs (one device, XLA-partitioned devices,
a `shard_map`'s manual mesh, pmap), JAX's typing of values by the mesh axes they vary
over (`check_vma`), a device call's `where` operand, and the patches that extend a mesh
axis across processes (`extend_axes`, installed by `_jax_compat.install`).

Private, with what each is for:

- `jax._src.config`: `_check_vma` (`check_vma`: whether the shard_map being traced types
  values by the axes they vary over).
- `jax._src.core`: `pvary_p` (`extend_axes`: the transpose of JAX's implicit `pvary`).
- `jax._src.shard_map`: `shard_map_p` (`extend_axes`: its transpose) and the module global
  `lax_parallel` (`extend_axes`: the sums its transpose makes without check_vma).
- `jax._src.interpreters.ad`: `fancy_transposes` (`extend_axes`: where JAX 0.12 keeps
  shard_map's transpose; `jax.interpreters.ad` does not export it).

Public names it relies on: a lowering context's `module_context.axis_context` (its class's
name and `mesh`, `manual_axes`, `num_devices`), `jax.sharding.get_abstract_mesh`,
`jax.lax.pcast` (`pvary` to 0.7), `mlir.lower_fun`, aval `.mat` (`.vma` to 0.7).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir
from jax.interpreters.ad import Zero, instantiate_zeros
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

# no public module re-exports these (the module docstring says what each is for)
from jax._src import config as _config
from jax._src import core as _core

__all__ = ["lowering_devices", "device_where", "lower_fun", "axis_rank", "manual_axis_size",
           "check_vma", "vma_of", "with_vma", "reshaped", "reshard", "explicit_axes", "context_mesh", "pvary", "named_axes", "extend_axes"]


def lowering_devices(ctx: mlir.LoweringRuleContext) -> tuple:
    """Where the program being lowered runs: `("one", 1)` (one device), `("auto", n)` (a
    jit over n devices, partitioned by XLA), `("manual", mesh, manual_axes)` (inside a
    `shard_map` over `mesh`), `("replica", n)` (pmap). Reads the context's
    `module_context.axis_context` (its class's name: ShardingContext, SPMDAxisContext,
    ReplicaAxisContext)."""
    axis = ctx.module_context.axis_context
    kind = type(axis).__name__
    if kind == "SPMDAxisContext":
        return "manual", axis.mesh, frozenset(axis.manual_axes)
    if kind == "ReplicaAxisContext":
        return "replica", int(getattr(axis.axis_env, "nreps", 0) or 0)
    n = int(getattr(axis, "num_devices", 1) or 1)
    return ("one" if n == 1 else "auto"), n


def device_where(ranks_operand, root: int, dest: int, source: int):
    """The `where` operand (int32[4]) of a device call being lowered: the device's
    partition (`partition_id`), then the call's root, destination and source: the int32[3]
    operand `ranks_operand` where they are each device's own, else these constants."""
    i32 = ir.IntegerType.get_signless(32)
    pid = hlo.convert(ir.RankedTensorType.get([], i32), hlo.partition_id())
    pid = hlo.reshape(ir.RankedTensorType.get([1], i32), pid)
    if ranks_operand is None:
        ranks_operand = hlo.constant(ir.DenseElementsAttr.get(
            np.array([root, dest, source], np.int32)))
    return hlo.concatenate([pid, ranks_operand], ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), 0))


def lower_fun(fn: Callable, ctx: mlir.LoweringRuleContext, args) -> list:
    """Lower `fn` on the operands `args` of the equation being lowered (`mlir.lower_fun`:
    traced at the equation's avals, tokens passed through)."""
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def axis_rank(axis: str, offset: int):
    """`offset + jax.lax.axis_index(axis)`, int32 (a device's rank inside shard_map)."""
    return jax.lax.axis_index(axis).astype(np.int32) + np.int32(offset)


def manual_axis_size(axis: str) -> int | None:
    """The size of mesh axis `axis` of the shard_map being traced (None: no such manual
    axis here)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if axis not in names:
        return None
    types = getattr(mesh, "axis_types", None)
    if types is not None:
        kind = dict(zip(names, types)).get(axis)
        if kind is not None and "Manual" not in str(kind):
            return None
    return int(mesh.shape[axis])


def check_vma() -> bool:
    """Whether the `shard_map` being traced types values by the mesh axes they vary over
    (JAX's default `check_vma=True`); `jax._src.config._check_vma`."""
    return bool(_config._check_vma.value)


def vma_of(aval) -> frozenset:
    """The mesh axes a value varies over inside `shard_map` (empty elsewhere): JAX 0.7's
    `aval.vma`, from 0.8 `aval.mat.varying`."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def with_vma(aval, vma: frozenset):
    """`aval` varying over the mesh axes `vma` (`aval.update`, as JAX's own rules)."""
    if vma == vma_of(aval) or not hasattr(aval, "update"):
        return aval
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=frozenset(vma)))
    return aval.update(vma=frozenset(vma))


def reshaped(aval, shape: tuple):
    """`aval` with another shape. An explicit sharding (`jax.make_mesh`'s default axis type)
    keeps its spec for the trailing axes of the old shape that the new one keeps (right
    aligned: a rank axis added or dropped in front), any other axis unsplit."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or getattr(sharding.mesh, "empty", True):
        return aval.update(shape=shape)
    old = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
    new = [None] * len(shape)
    for k in range(1, min(len(shape), len(aval.shape)) + 1):
        if shape[-k] == aval.shape[-k]:
            new[-k] = old[-k]
    return aval.update(shape=shape, sharding=sharding.update(spec=jax.sharding.PartitionSpec(*new)))


def context_mesh(avals):
    """The mesh a program being lowered names: its arguments' (their shardings' abstract
    mesh) or `jax.set_mesh`'s; None when it names none."""
    for a in avals:
        mesh = getattr(getattr(a, "sharding", None), "mesh", None)
        if mesh is not None and not getattr(mesh, "empty", True):
            return mesh
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def explicit_axes(mesh) -> bool:
    """Whether all of `mesh`'s axes are of the explicit type (arrays typed by their split:
    `jax.make_mesh`'s default from JAX 0.7)."""
    types = getattr(mesh, "axis_types", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return bool(types) and explicit is not None and all(t == explicit for t in types)


def reshard(x, mesh, spec):
    """`x` split as `spec` over `mesh` (explicit axes: `jax.sharding.reshard`; nothing
    moves when it is split so already)."""
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def pvary(x, axes: tuple):
    """`x` cast to vary over the mesh axes `axes` (no data moves): `jax.lax.pvary` to JAX
    0.7, `jax.lax.pcast(..., to="varying")` from 0.8."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def extend_axes(extended: Callable, psum: Callable) -> None:
    """JAX's implicit sums over a mesh axis that vjpmpi extends across processes
    (`extended(axis)`: its processes, 0 for an axis it does not extend) sum over every
    process's devices (`psum(x, axis)`): the transpose of `pvary` (JAX's typing of a value
    replicated over the axis, under check_vma), and shard_map's transpose without
    check_vma, which sums the cotangents of inputs not split over an axis (through
    `lax_parallel.psum` in `jax._src.shard_map`, here a wrapper module there only) and
    divides those of results not split over it by its size (here: its devices in every
    process). Other axes' as before. Relies on `core.pvary_p` and its `axes` parameter,
    `ad.primitive_transposes` (shard_map's in `jax._src.interpreters.ad.fancy_transposes`
    from 0.12, with the same arguments), shard_map's `mesh`, `out_specs` and `check_vma` parameters, and its
    module global `lax_parallel`, looked up at call time. Idempotent."""
    from jax._src import shard_map as _shard_map

    pvary_p = _core.pvary_p
    original = ad.primitive_transposes[pvary_p]
    if not getattr(original, "vjpmpi_guard", False):
        def transpose(cts, *args, **params):
            axes = tuple(params["axes"])
            ext = [a for a in axes if extended(a)]
            multi = pvary_p.multiple_results
            if not ext or all(type(c) is Zero for c in (cts if multi else [cts])):
                return original(cts, *args, **params)
            local = tuple(a for a in axes if a not in ext)
            out = list(cts) if multi else [cts]
            out = [instantiate_zeros(c) for c in out]
            if local:
                out = list(original(out if multi else out[0], *args, **{**params, "axes": local}))
            for a in ext:
                out = [psum(c, a) for c in out]
            return out

        transpose.vjpmpi_guard = True
        ad.primitive_transposes[pvary_p] = transpose

    module = _shard_map.lax_parallel
    if not getattr(module, "vjpmpi_guard", False):
        class _Parallel:  # lax_parallel, with psum over extended axes across processes
            vjpmpi_guard = True

            def __getattr__(self, name):
                return getattr(module, name)

            @staticmethod
            def psum(x, axis_name, *, axis_index_groups=None):
                names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
                ext = [a for a in names if extended(a)]
                if not ext or axis_index_groups is not None:
                    return module.psum(x, axis_name, axis_index_groups=axis_index_groups)
                local = tuple(a for a in names if a not in ext)
                if local:
                    x = module.psum(x, local)
                for a in ext:
                    x = jax.tree.map(lambda v, a=a: psum(v, a), x)
                return x

        _shard_map.lax_parallel = _Parallel()

    from jax._src.interpreters import ad as _ad  # (0.12's fancy table: not in jax.interpreters.ad)
    fancy = _ad.fancy_transposes if hasattr(_ad, "fancy_transposes") else {}
    table = fancy if _shard_map.shard_map_p in fancy else ad.primitive_transposes
    original_sm = table[_shard_map.shard_map_p]
    if not getattr(original_sm, "vjpmpi_guard", False):
        def shard_map_transpose(out_cts, *args, **params):
            mesh = params["mesh"]
            ext = {a: extended(a) for a in mesh.axis_names if extended(a)}
            if ext and not params.get("check_vma", True):
                out_cts = [c if type(c) is Zero or jnp.dtype(c.dtype) == jax.dtypes.float0
                           else c / np.prod([n for a, n in ext.items()
                                             if a not in _mentioned(sp)])
                           for sp, c in zip(params["out_specs"], out_cts)]
            return original_sm(out_cts, *args, **params)

        shard_map_transpose.vjpmpi_guard = True
        table[_shard_map.shard_map_p] = shard_map_transpose


def _mentioned(spec) -> set:
    """The mesh axes a shard_map in/out spec splits over."""
    spec = spec.to_ct_spec() if hasattr(spec, "to_ct_spec") else spec
    out = set()
    for entry in spec:
        if isinstance(entry, (tuple, list)):
            out.update(entry)
        elif entry is not None:
            out.add(entry)
    return out


# JAX's named-axis collectives (primitive name -> the parameter naming its axes).
_NAMED_COLLECTIVES = {"psum": "axes", "psum_invariant": "axes", "pmax": "axes", "pmin": "axes",
                      "all_gather": "axis_name", "all_gather_invariant": "axis_name",
                      "all_to_all": "axis_name", "reduce_scatter": "axis_name",
                      "ppermute": "axis_name", "ragged_all_to_all": "axis_name",
                      "psum_scatter": "axis_name"}


def named_axes(eqn) -> tuple:
    """The mesh axes a JAX named-axis collective equation `eqn` communicates over (none for
    another equation)."""
    key = _NAMED_COLLECTIVES.get(eqn.primitive.name)
    if key is None:
        return ()
    axes = eqn.params.get(key, ())
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
