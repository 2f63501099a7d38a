"""`vjpmpi.lax`: JAX's named-axis collectives with the named axis extended across the
processes of the default communicator, inside `jax.shard_map` over this process's devices.

An axis `i` of `D` devices in each of `P` processes is one axis of `P * D` devices
(`vjpmpi.device_comm(i)`: device `axis_index` of process `p` is `p * D + axis_index`).
Each function has `jax.lax`'s signature and JAX's AD conventions for it: `psum`'s
transpose is `pvary` (no communication) under `check_vma` (JAX's default) and `psum`
without it; `all_gather` and `psum_scatter` transpose to each other, `all_to_all` to
itself with its axes swapped, `ppermute` to the inverse permutation. JAX's own implicit
sums over an extended axis (the transposes of `pvary`) sum over every process's devices
(`_jax_compat.install`), so the gradient of a value replicated over the axis is the one
JAX computes on `P * D` devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import _jax_compat as jc
from ._bind import bind
from ._derive import call, define
from ._devices import EXTENDED_AXES, device_comm
from ._movement import allgather, alltoall
from ._mpi import MAX, MIN, SUM, as_red, check_red_dtype
from ._ordering import LOWERING_CHECKS
from ._p2p import sendrecv
from ._primitive import PRIMITIVES, Collective, like
from ._ragged import ragged_alltoall
from ._reductions import allreduce, reduce_scatter
from ._validate import array

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "psum_scatter",
           "ppermute", "ragged_all_to_all", "axis_index", "axis_size", "extended_psum"]


def _jvp_extremum(primals, tangents, outs, p):
    """pmax / pmin (which JAX does not differentiate): the tangent of the devices that
    attain the extremum, averaged over ties, by sums that do not vary over the axis."""
    (x,), (t,), (y,) = primals, tangents, outs
    hit = x == y
    total = lambda v, tangent: call("lax_reduce_invariant", v, p, red=SUM, tangent=tangent)  # noqa: E731
    n = total(hit.astype(t.dtype), False)
    return [total(jnp.where(hit, jc.instantiate_zeros(t), 0), True) / n]


# The reduction over an extended axis whose result does not vary over it (JAX's
# psum_invariant, pmax, pmin under check_vma): the allreduce kernel on the axis's device
# communicator; transpose (SUM): `pvary`, the identity on each device.
define(Collective("lax_reduce_invariant", like(0), {"red": "red"}, alias=(0, 0),
                  target="allreduce", varies=lambda p, vma: vma - {p["comm"].axis},
                  linear=lambda p: p["red"] == SUM, nonlinear_jvp=_jvp_extremum,
                  transpose=lambda cts, args, p: [jc.pvary(cts[0], (p["comm"].axis,))]))


def _axis(axis_name, op: str) -> str:
    """The one axis name of `axis_name` (a name or a 1-tuple), now extended."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(
            f"vjpmpi.lax.{op}: argument 'axis_name' must name one mesh axis (the one it extends "
            f"across processes), got {axis_name!r}; reduce over the others with jax.lax first")
    return names[0]


def _groups(axis_index_groups, op: str) -> None:
    if axis_index_groups is not None:
        raise NotImplementedError(f"vjpmpi.lax.{op}: axis_index_groups is not supported")


def axis_size(axis_name) -> int:
    """The number of devices along `axis_name` in every process together: `P * D`.

    Args:
        axis_name (str): a mesh axis of the `shard_map` being traced.

    Returns:
        (int): `P * D` (a Python int).

    Raises:
        ValueError: outside a `shard_map` body, or for an axis its mesh lacks.
    """
    return device_comm(_axis(axis_name, "axis_size")).size


def axis_index(axis_name):
    """This device's index along `axis_name` extended across processes:
    `process rank * D + jax.lax.axis_index(axis_name)`.

    Args:
        axis_name (str): a mesh axis of the `shard_map` being traced.

    Returns:
        (jax.Array): An int32 scalar, each device's own.

    Raises:
        ValueError: outside a `shard_map` body, or for an axis its mesh lacks.
    """
    return device_comm(_axis(axis_name, "axis_index")).rank


def extended_psum(x, axis: str):
    """The sum of `x` over every process's devices along `axis`, not varying over it (what
    JAX's implicit sums over an extended axis become: `_jax_compat.install`)."""
    comm = device_comm(axis)
    if jc.check_vma() and axis not in jc.vma_of(jax.typeof(x)):
        x = jc.pvary(x, (axis,))
    (y,) = bind(PRIMITIVES["lax_reduce_invariant"], [x], comm._device_ref, red=SUM)
    return y


def _reduce(op: str, red, x, axis_name, axis_index_groups):
    _groups(axis_index_groups, op)
    axis = _axis(axis_name, op)
    comm = device_comm(axis)

    total = as_red(red, f"lax.{op}") == SUM

    def leaf(v):
        if not isinstance(v, jax.core.Tracer):  # a constant: the same on every device
            return v * comm.size if total else v
        v = array(v, f"lax.{op}")
        if v.dtype == np.bool_:
            v = v.astype(np.int32)
        code = check_red_dtype(as_red(red, f"lax.{op}"), v.dtype, f"lax.{op}")
        if not jc.check_vma():  # (JAX's psum without vma: its transpose is psum)
            return allreduce(v, code, comm=comm)
        if axis not in jc.vma_of(jax.typeof(v)):
            v = jc.pvary(v, (axis,))
        (y,) = bind(PRIMITIVES["lax_reduce_invariant"], [v], comm._device_ref, red=code)
        return y

    return jax.tree.map(leaf, x)


def psum(x, axis_name, *, axis_index_groups=None):
    """`jax.lax.psum` over the extended axis `axis_name` (every process's devices).

    Args:
        x (Any): a pytree of arrays (bool is summed as int32); a non-traced constant is
            multiplied by the axis size, as in JAX.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.

    Returns:
        (Any): The sum over the `P * D` devices, like `x`; under `check_vma`, not varying
            over the axis.

    Raises:
        ValueError: for more than one axis, or one the mesh lacks.
        NotImplementedError: for `axis_index_groups`.
        TypeError: for a dtype MPI cannot carry.

    Transpose:
        `pvary` under `check_vma` (JAX's default), else `psum`.
    """
    return _reduce("psum", MPI.SUM, x, axis_name, axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
    """`jax.lax.pmean` over the extended axis: `psum(x) / axis_size`.

    Args:
        x (Any): a pytree of arrays.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.

    Returns:
        (Any): The mean over the `P * D` devices, like `x`.

    Raises:
        ValueError: for more than one axis, or one the mesh lacks.
        NotImplementedError: for `axis_index_groups`.
    """
    n = axis_size(_axis(axis_name, "pmean"))
    return jax.tree.map(lambda v: v / n, psum(x, axis_name, axis_index_groups=axis_index_groups))


def pmax(x, axis_name, *, axis_index_groups=None):
    """`jax.lax.pmax` over the extended axis (differentiable: the tangent of the devices
    that attain the maximum, averaged over ties; JAX's is not differentiable).

    Args:
        x (Any): a pytree of arrays.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.

    Returns:
        (Any): The maximum over the `P * D` devices, like `x`.

    Raises:
        ValueError: for more than one axis, or one the mesh lacks.
        NotImplementedError: for `axis_index_groups`.
    """
    return _reduce("pmax", MAX, x, axis_name, axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
    """`jax.lax.pmin` over the extended axis (differentiable as `pmax`).

    Args:
        x (Any): a pytree of arrays.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.

    Returns:
        (Any): The minimum over the `P * D` devices, like `x`.

    Raises:
        ValueError: for more than one axis, or one the mesh lacks.
        NotImplementedError: for `axis_index_groups`.
    """
    return _reduce("pmin", MIN, x, axis_name, axis_index_groups)


def _merge(x, k: int):
    """`x` with axes `k` and `k + 1` made one."""
    return x.reshape(*x.shape[:k], x.shape[k] * x.shape[k + 1], *x.shape[k + 2:])


def _split(x, k: int, n: int, op: str, what: str):
    """`x` with axis `k` made two, `(n, x.shape[k] // n)`."""
    if x.shape[k] % n:
        raise ValueError(f"vjpmpi.lax.{op}: {what} of length {x.shape[k]} does not divide "
                         f"into the axis size {n}")
    return x.reshape(*x.shape[:k], n, x.shape[k] // n, *x.shape[k + 1:])


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False):
    """`jax.lax.all_gather` over the extended axis: every device's `x` stacked (or, `tiled`,
    concatenated) along `axis`, in order of the extended index.

    Args:
        x (Any): a pytree of arrays.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.
        axis (int): where the gathered axis goes.
        tiled (bool): concatenate along `axis` instead of stacking a new one.

    Returns:
        (Any): Like `x`, with an axis of `P * D` (or `axis` `P * D` times longer).

    Raises:
        ValueError: for more than one axis, or one the mesh lacks.
        NotImplementedError: for `axis_index_groups`.

    Transpose:
        `psum_scatter` (JAX's).
    """
    _groups(axis_index_groups, "all_gather")
    comm = device_comm(_axis(axis_name, "all_gather"))

    def leaf(v):
        v = array(v, "lax.all_gather")
        k = axis % (v.ndim + (0 if tiled else 1))
        y = jnp.moveaxis(allgather(v, comm=comm), 0, k)
        return _merge(y, k) if tiled else y

    return jax.tree.map(leaf, x)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False):
    """`jax.lax.psum_scatter` over the extended axis: the sum over every device, block
    `axis_index` of `scatter_dimension` on each.

    Args:
        x (Any): a pytree of arrays; `scatter_dimension` of length `P * D` (or, `tiled`, a
            multiple of it).
        axis_name (str): one mesh axis of the `shard_map` being traced.
        scatter_dimension (int): the axis to scatter.
        axis_index_groups (None): not supported.
        tiled (bool): keep the scattered axis (its length divided by `P * D`).

    Returns:
        (Any): This device's block of the sum.

    Raises:
        ValueError: for more than one axis, one the mesh lacks, or a length that does not
            fit.
        NotImplementedError: for `axis_index_groups`.

    Transpose:
        `all_gather` (JAX's).
    """
    _groups(axis_index_groups, "psum_scatter")
    comm = device_comm(_axis(axis_name, "psum_scatter"))

    def leaf(v):
        v = array(v, "lax.psum_scatter")
        k = scatter_dimension % v.ndim
        if tiled:
            v = _split(v, k, comm.size, "psum_scatter", "scatter_dimension")
        elif v.shape[k] != comm.size:
            raise ValueError(f"vjpmpi.lax.psum_scatter: scatter_dimension of length "
                             f"{v.shape[k]}, not the axis size {comm.size}")
        return reduce_scatter(jnp.moveaxis(v, k, 0), MPI.SUM, comm=comm)

    return jax.tree.map(leaf, x)


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False):
    """`jax.lax.all_to_all` over the extended axis: chunk `j` of `split_axis` to device `j`,
    the chunks received along `concat_axis` in order of their senders.

    Args:
        x (Any): a pytree of arrays; `split_axis` of length `P * D` (or, `tiled`, a
            multiple of it).
        axis_name (str): one mesh axis of the `shard_map` being traced.
        split_axis (int): the axis split into chunks.
        concat_axis (int): where the received chunks go.
        axis_index_groups (None): not supported.
        tiled (bool): concatenate into `concat_axis` rather than insert a new axis there.

    Returns:
        (Any): Shape `np.insert(np.delete(x.shape, split_axis), concat_axis, P * D)`; tiled,
            `split_axis` divided and `concat_axis` multiplied by `P * D`.

    Raises:
        ValueError: for more than one axis, one the mesh lacks, or a length that does not
            fit.
        NotImplementedError: for `axis_index_groups`.

    Transpose:
        `all_to_all` with the two axes swapped (JAX's).
    """
    _groups(axis_index_groups, "all_to_all")
    comm = device_comm(_axis(axis_name, "all_to_all"))

    def leaf(v):
        v = array(v, "lax.all_to_all")
        n = comm.size
        s = split_axis % v.ndim
        if tiled:
            v = _split(v, s, n, "all_to_all", "split_axis")
        elif v.shape[s] != n:
            raise ValueError(f"vjpmpi.lax.all_to_all: split_axis of length {v.shape[s]}, not "
                             f"the axis size {n}")
        z = alltoall(jnp.moveaxis(v, s, 0), comm=comm)  # z[i]: device i's chunk for this one
        c = concat_axis % (z.ndim - 1 if tiled else z.ndim)
        z = jnp.moveaxis(z, 0, c)
        return _merge(z, c) if tiled else z

    return jax.tree.map(leaf, x)


def ppermute(x, axis_name, perm):
    """`jax.lax.ppermute` over the extended axis: device `src` sends to `dst` for each pair
    of `perm` (indices `0 .. P * D - 1`); a device that receives nothing gets zeros.

    Args:
        x (Any): a pytree of arrays.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        perm (Sequence[tuple[int, int]]): `(source index, destination index)` pairs, each
            index at most once as a source and once as a destination.

    Returns:
        (Any): What this device receives, like `x`.

    Raises:
        ValueError: for more than one axis, one the mesh lacks, or a `perm` with an index
            outside the axis or used twice.

    Transpose:
        `ppermute` with the inverse permutation (JAX's).
    """
    comm = device_comm(_axis(axis_name, "ppermute"))
    n = comm.size
    dest, source = [MPI.PROC_NULL] * n, [MPI.PROC_NULL] * n
    for pair in perm:
        s, d = (int(v) for v in pair)
        if not (0 <= s < n and 0 <= d < n) or dest[s] != MPI.PROC_NULL or source[d] != MPI.PROC_NULL:
            raise ValueError(f"vjpmpi.lax.ppermute: argument 'perm' {tuple(perm)} must pair "
                             f"indices of 0..{n - 1} at most once each")
        dest[s], source[d] = d, s
    r = comm.rank
    to, frm = jnp.asarray(dest, np.int32)[r], jnp.asarray(source, np.int32)[r]
    return jax.tree.map(lambda v: sendrecv(v, jnp.zeros_like(v), source=frm, dest=to, comm=comm),
                        x)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` over the extended axis (`vjpmpi.ragged_alltoall` on its
    device communicator).

    Args:
        operand (jax.Array): the rows to send.
        output (jax.Array): the output, rows not received kept.
        input_offsets (jax.Array): int32, per destination device.
        send_sizes (jax.Array): int32, per destination device.
        output_offsets (jax.Array): int32, where each slice goes in its receiver's output.
        recv_sizes (jax.Array): int32, per source device.
        axis_name (str): one mesh axis of the `shard_map` being traced.
        axis_index_groups (None): not supported.

    Returns:
        (jax.Array): `output` with the rows received.

    Raises:
        ValueError: for more than one axis, or one the mesh lacks; bad sizes or offsets
            (when it runs, on every device).
        NotImplementedError: for `axis_index_groups`.

    Transpose:
        the exchange back (JAX's convention).
    """
    _groups(axis_index_groups, "ragged_all_to_all")
    comm = device_comm(_axis(axis_name, "ragged_all_to_all"))
    return ragged_alltoall(operand, output, input_offsets, send_sizes, output_offsets,
                           recv_sizes, comm=comm)


def _no_local_collectives(jaxpr) -> None:
    """A program with vjpmpi collectives that also calls a JAX collective over an extended
    axis is refused when lowered: JAX's would stay in this process."""
    for eqn in jaxpr.eqns:
        axes = [a for a in jc.named_axes(eqn) if a in EXTENDED_AXES]
        if axes:
            name = eqn.primitive.name.replace("_invariant", "")
            raise ValueError(
                f"vjpmpi.lax: this program calls jax.lax's {name} over mesh axis '{axes[0]}', "
                "which vjpmpi extends across processes (a device communicator or vjpmpi.lax "
                "has used it): JAX's would reach this process's devices only. Use "
                f"vjpmpi.lax.{name} there (or another axis name for a collective within "
                "the process).")
        for sub in jc.jaxprs_in_params(eqn.params):
            _no_local_collectives(sub)


LOWERING_CHECKS.append(_no_local_collectives)


def extended(axis) -> int:
    """Over how many processes vjpmpi extends mesh axis `axis` (0: it does not; a device
    communicator or `vjpmpi.lax` has used it)."""
    return EXTENDED_AXES.get(axis, 0)
