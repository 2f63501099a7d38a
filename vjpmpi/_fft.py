"""Distributed FFTs: local FFTs along the axes a rank holds whole, alltoall transposes
between them (slab: a 1-D process grid; pencil: a 2-D one).

Layouts, for an array of d axes on a grid of g dimensions (g < d):
  physical  axis i (i < g) split over grid dimension i; axes g.. whole
  spectral  axis 0 whole; axis i + 1 (i < g) split over grid dimension i; the rest whole
Every split is `split_sizes` (equal blocks; only rfftn's half-spectrum axis may be
uneven, its first blocks one longer).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ._composite import ordered_collective
from ._grid import ProcessGrid, split_sizes, split_start
from ._mpi import as_comm
from ._ops import alltoall

_NORMS = (None, "backward", "ortho", "forward")


def _plan(grid: Any, op: str):
    """(dims, coords, axis communicators) of `grid`."""
    if isinstance(grid, ProcessGrid):
        return grid.dims, grid.coords, grid.axis_comms
    if isinstance(grid, MPI.Cartcomm) and grid.Get_dim() > 1:
        raise TypeError(
            f"vjpmpi.fft.{op}: argument 'grid' is a {grid.Get_dim()}-D Cartesian communicator; "
            "wrap it once, on every rank, in vjpmpi.ProcessGrid(cart) (that makes its axis "
            "communicators, a collective) and pass the grid")
    if grid is not None and not isinstance(grid, MPI.Comm):
        raise TypeError(
            f"vjpmpi.fft.{op}: argument 'grid' must be a vjpmpi.ProcessGrid (pencil or slab), "
            f"an mpi4py communicator (slab) or None (slab over vjpmpi's COMM_WORLD), "
            f"got {type(grid).__name__}")
    ref = as_comm(grid, f"fft.{op}")
    return (ref.size,), (ref.rank,), (ref.comm,)


def _input(x, op: str, real: bool):
    x = jnp.asarray(x)
    kinds = ("float32", "float64") if real else (
        "float32", "float64", "complex64", "complex128")
    if x.dtype.name not in kinds:
        raise TypeError(f"vjpmpi.fft.{op}: argument 'x' has dtype {x.dtype}; supported: "
                        + ", ".join(kinds))
    if not real and x.dtype.kind == "f":
        x = x.astype(jnp.complex64 if x.dtype == jnp.float32 else jnp.complex128)
    return x


def _check(op: str, x, g: int, norm) -> None:
    if norm not in _NORMS:
        raise ValueError(f"vjpmpi.fft.{op}: argument 'norm' must be one of {_NORMS}, got {norm!r}")
    if x.ndim < g + 1:
        raise ValueError(
            f"vjpmpi.fft.{op}: argument 'x' has shape {tuple(x.shape)}; a {g}-D process grid "
            f"needs at least {g + 1} axes (one axis must stay whole on every rank)")


def _divides(op: str, n: list[int], axis: int, dims, dim: int, what: str) -> None:
    if n[axis] % dims[dim]:
        raise ValueError(
            f"vjpmpi.fft.{op}: axis {axis} of the global {what} {tuple(n)} has {n[axis]} "
            f"entries, not divisible by the process grid's dimension {dim} ({dims[dim]}); "
            f"choose sizes that the grid {tuple(dims)} divides")


def _swap(x, comm, p: int, coord: int, gather: int, split: int, n_gather: int, n_split: int):
    """One alltoall within `comm` (p ranks, this one at `coord`): axis `gather` goes from
    this rank's block (of n_gather) to whole, axis `split` from whole (n_split) to this
    rank's block. Uneven blocks travel padded to the longest one."""
    if p == 1:
        return x
    bg, bs = -(-n_gather // p), -(-n_split // p)
    if n_gather % p:  # pad my block of the gather axis to bg
        pad = [(0, 0)] * x.ndim
        pad[gather] = (0, bg - x.shape[gather])
        x = jnp.pad(x, pad)
    if n_split % p:  # block j's entries, then zeros (index n_split is out of range)
        idx = np.full((p, bs), n_split, np.int32)
        for j, size in enumerate(split_sizes(n_split, p)):
            idx[j, :size] = split_start(n_split, p, j) + np.arange(size)
        x = jnp.take(x, idx.ravel(), axis=split, mode="fill", fill_value=0)
    shape = x.shape
    x = jnp.moveaxis(x.reshape(shape[:split] + (p, bs) + shape[split + 1:]), split, 0)
    y = alltoall(x, comm=comm)  # y[j]: rank j's block of the gather axis, my block of split
    y = jnp.moveaxis(y, 0, gather)
    y = y.reshape(y.shape[:gather] + (p * bg,) + y.shape[gather + 2:])
    if n_gather % p:
        idx = np.concatenate([j * bg + np.arange(size)
                              for j, size in enumerate(split_sizes(n_gather, p))])
        y = jnp.take(y, idx.astype(np.int32), axis=gather)
    if n_split % p:
        y = jnp.moveaxis(jnp.moveaxis(y, split, 0)[:split_sizes(n_split, p)[coord]], 0, split)
    return y


def _to_spectral(x, plan, n):
    dims, coords, comms = plan
    for s in reversed(range(len(dims))):
        x = _swap(x, comms[s], dims[s], coords[s], s, s + 1, n[s], n[s + 1])
    return x


def _to_physical(x, plan, n):
    dims, coords, comms = plan
    for s in range(len(dims)):
        x = _swap(x, comms[s], dims[s], coords[s], s + 1, s, n[s + 1], n[s])
    return x


def _physical_shape(op, x, plan, real: bool) -> list[int]:
    """The global shape of `x` in the physical layout; checks the grid divides it."""
    dims = plan[0]
    g = len(dims)
    n = [x.shape[i] * (dims[i] if i < g else 1) for i in range(x.ndim)]
    half = real and x.ndim - 1 == g  # rfftn's half spectrum gets split (over dim g - 1)
    for s in range(g):
        if not (half and s + 1 == x.ndim - 1):
            _divides(op, n, s + 1, dims, s, "array")
    return n


@ordered_collective(name="fftn")
def _fftn(x, plan, norm, transposed, inverse):
    g = len(plan[0])
    if inverse and transposed:  # spectral in: the global shape from the spectral layout
        n = [x.shape[0]] + [x.shape[i + 1] * (plan[0][i] if i < g else 1)
                            for i in range(x.ndim - 1)]
        for s in range(g):
            _divides("ifftn", n, s, plan[0], s, "array")
    else:
        n = _physical_shape("ifftn" if inverse else "fftn", x, plan, False)
    if inverse:
        if not transposed:
            x = _to_spectral(x, plan, n)
        for s in range(g):
            x = jnp.fft.ifft(x, axis=s, norm=norm)
            x = _swap(x, plan[2][s], plan[0][s], plan[1][s], s + 1, s, n[s + 1], n[s])
        return jnp.fft.ifftn(x, axes=tuple(range(g, x.ndim)), norm=norm)
    x = jnp.fft.fftn(x, axes=tuple(range(g, x.ndim)), norm=norm)
    for s in reversed(range(g)):
        x = _swap(x, plan[2][s], plan[0][s], plan[1][s], s, s + 1, n[s], n[s + 1])
        x = jnp.fft.fft(x, axis=s, norm=norm)
    return x if transposed else _to_physical(x, plan, n)


@ordered_collective(name="rfftn")
def _rfftn(x, plan, norm, transposed):
    g = len(plan[0])
    n = _physical_shape("rfftn", x, plan, True)
    n[-1] = n[-1] // 2 + 1
    split = x.ndim - 1 == g  # the half spectrum is split over grid dimension g - 1
    if split and n[-1] < plan[0][-1]:
        raise ValueError(
            f"vjpmpi.fft.rfftn: the last axis has {n[-1]} frequencies, fewer than the process "
            f"grid's dimension {g - 1} ({plan[0][-1]}) that splits them")
    x = jnp.fft.rfft(x, axis=-1, norm=norm)
    if x.ndim - 1 > g:
        x = jnp.fft.fftn(x, axes=tuple(range(g, x.ndim - 1)), norm=norm)
    for s in reversed(range(g)):
        x = _swap(x, plan[2][s], plan[0][s], plan[1][s], s, s + 1, n[s], n[s + 1])
        x = jnp.fft.fft(x, axis=s, norm=norm)
    return x if transposed else _to_physical(x, plan, n)


@ordered_collective(name="irfftn")
def _irfftn(k, plan, norm, transposed, last):
    dims, coords, _ = plan
    g = len(dims)
    split = transposed and k.ndim - 1 == g
    if transposed:
        n = [k.shape[0]] + [k.shape[i + 1] * (dims[i] if i < g else 1)
                            for i in range(k.ndim - 1)]
    else:
        n = [k.shape[i] * (dims[i] if i < g else 1) for i in range(k.ndim)]
    if split:
        if last is None:
            raise ValueError(
                "vjpmpi.fft.irfftn: argument 'n' (the global length of the output's last "
                "axis) is needed: in this layout the half spectrum is split over ranks")
        n[-1] = last // 2 + 1
        want = split_sizes(n[-1], dims[-1])[coords[-1]]
        if k.shape[-1] != want:
            raise ValueError(
                f"vjpmpi.fft.irfftn: argument 'k' has {k.shape[-1]} entries on its last axis; "
                f"for n={last} this rank's block of the {n[-1]} frequencies has {want}")
    else:
        if last is not None and last // 2 + 1 != n[-1]:
            raise ValueError(f"vjpmpi.fft.irfftn: argument 'n'={last} needs {last // 2 + 1} "
                             f"frequencies on the last axis, 'k' has {n[-1]}")
        last = 2 * (n[-1] - 1) if last is None else last
    for s in range(g):
        if not (s + 1 == k.ndim - 1):
            _divides("irfftn", n, s + 1, dims, s, "spectrum")
        _divides("irfftn", n, s, dims, s, "spectrum")
    if not transposed:
        k = _to_spectral(k, plan, n)
    for s in range(g):
        k = jnp.fft.ifft(k, axis=s, norm=norm)
        k = _swap(k, plan[2][s], dims[s], coords[s], s + 1, s, n[s + 1], n[s])
    if k.ndim - 1 > g:
        k = jnp.fft.ifftn(k, axes=tuple(range(g, k.ndim - 1)), norm=norm)
    return jnp.fft.irfft(k, n=last, axis=-1, norm=norm)


def fftn(x, grid=None, *, norm=None, transposed=True):
    """N-D FFT of a block-distributed array (all axes), like `numpy.fft.fftn` on the
    global array.

    Shape: this rank's block in the physical layout (axis i split over grid dimension
    i) -> its block in the spectral layout (axis 0 whole, axis i + 1 split over grid
    dimension i), or the physical layout with `transposed=False` (more alltoalls).
    `grid`: a `vjpmpi.ProcessGrid` (1-D: slab, 2-D: pencil), a communicator (slab) or
    None. float inputs are promoted to complex.
    Transpose: the same transform's transpose (an FFT and the reverse alltoalls).
    """
    plan = _plan(grid, "fftn")
    x = _input(x, "fftn", real=False)
    _check("fftn", x, len(plan[0]), norm)
    return _fftn(x, plan, norm, transposed, False)


def ifftn(k, grid=None, *, norm=None, transposed=True):
    """Inverse of `fftn`: `ifftn(fftn(x, g), g) == x`.

    Shape: this rank's block in the spectral layout (physical with `transposed=False`)
    -> its block in the physical layout.
    Transpose: the same transform's transpose.
    """
    plan = _plan(grid, "ifftn")
    k = _input(k, "ifftn", real=False)
    _check("ifftn", k, len(plan[0]), norm)
    return _fftn(k, plan, norm, transposed, True)


def rfftn(x, grid=None, *, norm=None, transposed=True):
    """N-D FFT of a real block-distributed array, like `numpy.fft.rfftn` (the last axis
    keeps n // 2 + 1 frequencies).

    Shape: this rank's real block in the physical layout -> its complex block in the
    spectral layout (physical with `transposed=False`); where the spectral layout splits
    the half-spectrum axis (2-D slab, 3-D pencil) its blocks may be uneven, the first
    ones one longer (`ProcessGrid.block`).
    Transpose: the real transform's transpose (an inverse real FFT and the reverse
    alltoalls).
    """
    plan = _plan(grid, "rfftn")
    x = _input(x, "rfftn", real=True)
    _check("rfftn", x, len(plan[0]), norm)
    return _rfftn(x, plan, norm, transposed)


def irfftn(k, grid=None, *, n=None, norm=None, transposed=True):
    """Inverse of `rfftn`: `irfftn(rfftn(x, g), g, n=x's last global size) == x`.

    Shape: this rank's complex block in the spectral layout (physical with
    `transposed=False`) -> its real block in the physical layout; `n` is the global
    length of the output's last axis (default 2 * (frequencies - 1); needed where the
    layout splits the half spectrum).
    Transpose: the real inverse transform's transpose.
    """
    plan = _plan(grid, "irfftn")
    k = _input(k, "irfftn", real=False)
    _check("irfftn", k, len(plan[0]), norm)
    if n is not None and (not isinstance(n, (int, np.integer)) or n < 1):
        raise ValueError(f"vjpmpi.fft.irfftn: argument 'n' must be a positive int, got {n!r}")
    return _irfftn(k, plan, norm, transposed, None if n is None else int(n))
