"""Distributed FFTs: local FFTs along the axes a rank holds whole, alltoall transposes
between them (slab: a 1-D process grid; pencil: a 2-D one).

Layouts, for an array of d axes on a grid of g dimensions (g < d):
  physical  axis i (i < g) split over grid dimension i; axes g.. whole
  spectral  axis 0 whole; axis i + 1 (i < g) split over grid dimension i; the rest whole
Every split is `split_sizes` (`ProcessGrid.block`: as equal as can be, the first blocks
one longer). The global shape is the `shape` argument, or else each rank's block times
the grid (equal blocks). Before its first alltoall a transform has the ranks of the
grid agree on that global shape (`_sync.agree_on`, a collective that moves no data), so
ranks that infer different global shapes from uneven blocks fail together, saying so.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ._composite import ordered_collective
from ._grid import ProcessGrid, split_sizes, split_start
from ._mpi import as_comm
from ._movement import alltoall
from ._sync import agree_on

_NORMS = (None, "backward", "ortho", "forward")


def _plan(grid: Any, op: str):
    """(dims, coords, axis communicators, the whole grid's communicator) of `grid`, the
    communicators resolved (`as_comm`) here, once for the transform."""
    if isinstance(grid, ProcessGrid):
        axes = tuple(as_comm(c, f"fft.{op}") for c in grid.axis_comms)
        return grid.dims, grid.coords, axes, as_comm(grid.cart, f"fft.{op}")
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
    return (ref.size,), (ref.rank,), (ref,), ref


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


def _shape_arg(op: str, shape, ndim: int) -> list[int] | None:
    if shape is None:
        return None
    try:
        n = [int(v) for v in shape]
    except (TypeError, ValueError):
        n = None
    if n is None or len(n) != ndim or any(v < 1 for v in n):
        raise ValueError(f"vjpmpi.fft.{op}: argument 'shape' must be the global shape of the "
                         f"input, {ndim} positive ints, got {shape!r}")
    return n


def _blocks(n, plan, split: tuple[int, ...]) -> tuple[int, ...]:
    """This rank's block of a global shape `n` whose axes `split[i]` are split over grid
    dimension i (`ProcessGrid.block`)."""
    dims, coords = plan[0], plan[1]
    out = list(n)
    for i, a in enumerate(split):
        out[a] = split_sizes(n[a], dims[i])[coords[i]]
    return tuple(out)


def _global(op: str, x, plan, shape, split: tuple[int, ...], given="argument 'shape'"):
    """(global shape, refusal or None, note) of the input `x`, whose axes `split` are
    split: `shape` when given (this rank's block must then be its block of it), else this
    rank's block times the grid, which only equal blocks give alike on every rank."""
    dims, rank = plan[0], plan[3].rank
    grid = " x ".join(str(d) for d in dims)
    n = _shape_arg(op, shape, x.ndim)
    if n is not None:
        want = _blocks(n, plan, split)
        refused = None if tuple(x.shape) == want else (
            f"vjpmpi.fft.{op}: argument 'x' on rank {rank} has shape {tuple(x.shape)}, but its "
            f"block of the global shape {tuple(n)} ({given}) on the {grid} process grid is "
            f"{want} (ProcessGrid.block gives each rank's)")
        return n, refused, f"vjpmpi.fft.{op} of the global shape {tuple(n)} ({given})"
    n = list(x.shape)
    for i, a in enumerate(split):
        n[a] *= dims[i]
    note = (f"vjpmpi.fft.{op}: global shape {tuple(n)}, from this rank's block "
            f"{tuple(x.shape)} on the {grid} process grid (blocks of other sizes need the "
            "argument 'shape')")
    return n, None, note


def _agree(op: str, n, dtype, plan, refused, note) -> bool:
    """Every rank of the grid agrees on the global shape before the first alltoall; False
    where this rank refused (it then computes nothing: the transform fails everywhere)."""
    agree_on(n, dtype, plan[3], f"fft.{op}", note=note, invalid=refused)
    return refused is None


def _phys(g):
    return tuple(range(g))


def _spec(g):
    return tuple(range(1, g + 1))


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
    dims, coords, comms = plan[:3]
    for s in reversed(range(len(dims))):
        x = _swap(x, comms[s], dims[s], coords[s], s, s + 1, n[s], n[s + 1])
    return x


def _to_physical(x, plan, n):
    dims, coords, comms = plan[:3]
    for s in range(len(dims)):
        x = _swap(x, comms[s], dims[s], coords[s], s + 1, s, n[s + 1], n[s])
    return x


@ordered_collective(name="fftn")
def _fftn(x, plan, norm, transposed, inverse, shape):
    g = len(plan[0])
    op = "ifftn" if inverse else "fftn"
    spectral_in = inverse and transposed
    n, refused, note = _global(op, x, plan, shape, _spec(g) if spectral_in else _phys(g))
    if not _agree(op, n, x.dtype, plan, refused, note):
        out = _phys(g) if inverse or not transposed else _spec(g)
        return jnp.zeros(_blocks(n, plan, out), x.dtype)
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
def _rfftn(x, plan, norm, transposed, shape):
    g = len(plan[0])
    n, refused, note = _global("rfftn", x, plan, shape, _phys(g))
    half = [*n[:-1], n[-1] // 2 + 1]
    if x.ndim - 1 == g and half[-1] < plan[0][-1]:  # (the whole last axis: every rank alike)
        raise ValueError(
            f"vjpmpi.fft.rfftn: the last axis has {half[-1]} frequencies, fewer than the "
            f"process grid's dimension {g - 1} ({plan[0][-1]}) that splits them")
    if not _agree("rfftn", n, x.dtype, plan, refused, note):
        out_dtype = jnp.complex64 if x.dtype == jnp.float32 else jnp.complex128
        return jnp.zeros(_blocks(half, plan, _spec(g) if transposed else _phys(g)), out_dtype)
    x = jnp.fft.rfft(x, axis=-1, norm=norm)
    if x.ndim - 1 > g:
        x = jnp.fft.fftn(x, axes=tuple(range(g, x.ndim - 1)), norm=norm)
    for s in reversed(range(g)):
        x = _swap(x, plan[2][s], plan[0][s], plan[1][s], s, s + 1, half[s], half[s + 1])
        x = jnp.fft.fft(x, axis=s, norm=norm)
    return x if transposed else _to_physical(x, plan, half)


@ordered_collective(name="irfftn")
def _irfftn(k, plan, norm, transposed, last, shape):
    dims, coords = plan[0], plan[1]
    g = len(dims)
    split_in = _spec(g) if transposed else _phys(g)
    # where the spectral layout splits the half spectrum, its global length can't be
    # read off this rank's block: it comes from `shape` or the output length `n`
    half_split = transposed and k.ndim - 1 == g
    if half_split and shape is None:
        if last is None:
            raise ValueError(
                "vjpmpi.fft.irfftn: argument 'n' (the global length of the output's last "
                "axis) is needed: in this layout the half spectrum is split over ranks")
        n_in = list(k.shape)
        for i, a in enumerate(split_in[:-1]):
            n_in[a] *= dims[i]
        n_in[-1] = last // 2 + 1
        n, refused, note = _global("irfftn", k, plan, n_in, split_in, "with argument 'n'")
    else:
        n, refused, note = _global("irfftn", k, plan, shape, split_in)
    if last is None:
        last = 2 * (n[-1] - 1)
    elif last // 2 + 1 != n[-1]:
        raise ValueError(f"vjpmpi.fft.irfftn: argument 'n'={last} needs {last // 2 + 1} "
                         f"frequencies on the last axis, 'k' has {n[-1]}")
    if not _agree("irfftn", n, k.dtype, plan, refused, note):
        real = jnp.float32 if k.dtype == jnp.complex64 else jnp.float64
        return jnp.zeros(_blocks([*n[:-1], last], plan, _phys(g)), real)
    if not transposed:
        k = _to_spectral(k, plan, n)
    for s in range(g):
        k = jnp.fft.ifft(k, axis=s, norm=norm)
        k = _swap(k, plan[2][s], dims[s], coords[s], s + 1, s, n[s + 1], n[s])
    if k.ndim - 1 > g:
        k = jnp.fft.ifftn(k, axes=tuple(range(g, k.ndim - 1)), norm=norm)
    return jnp.fft.irfft(k, n=last, axis=-1, norm=norm)



def fftn(x, grid=None, *, norm=None, transposed=True, shape=None):
    """N-D FFT of a block-distributed array (all axes), like `numpy.fft.fftn` on the
    global array.

    Local FFTs along the axes a rank holds whole, alltoall transposes between them.
    Float inputs are promoted to complex. Works under `jit`, `vmap`, `grad`, `jvp` and
    `linear_transpose`.

    Args:
        x (Array): this rank's block of the global array in the physical layout (axis i
            split over grid dimension i), float32, float64, complex64 or complex128, with
            more axes than the grid has dimensions.
        grid (vjpmpi.ProcessGrid | MPI.Intracomm | None): the process grid: a
            `vjpmpi.ProcessGrid` (1-D: slab, 2-D: pencil), an mpi4py communicator (slab)
            or None (slab over vjpmpi's private duplicate of COMM_WORLD).
        norm (str | None): the normalisation, as `numpy.fft`: None or "backward"
            (the inverse scaled by 1/N), "ortho", "forward".
        transposed (bool): True: return the spectral layout (axis 0 whole, axis i + 1
            split over grid dimension i); False: the physical layout (more alltoalls).
        shape (Sequence[int] | None): the global shape of the input (optional; needed
            where the blocks are not all equal: each rank's block is then its
            `ProcessGrid.block` of it). Without it the global shape is this rank's block
            times the grid; before any data moves the ranks compare the global shapes
            they use, and raise together if they differ.

    Returns:
        (Array): this rank's block of the global FFT (complex64 from float32 or
            complex64, complex128 from float64 or complex128), in the spectral layout
            (physical with `transposed=False`).

    Raises:
        TypeError: `grid` is a Cartesian communicator of more than one dimension (wrap
            it in `vjpmpi.ProcessGrid`), not a grid, communicator or None, or an
            intercommunicator; the input's dtype is not supported.
        ValueError: `norm` is not one of None, "backward", "ortho", "forward"; the input
            has fewer than (grid dimensions + 1) axes; `shape` is not the input's number
            of positive ints; on a one-rank grid, the refusals below, at once.
        ValueError: when run, on every rank: this rank's block is not
            its block of `shape`, or (without `shape`) the ranks' global shapes differ
            (uneven blocks).

    Shape:
        this rank's block in the physical layout -> its block in the spectral layout
        (physical with `transposed=False`); slab 2-D: `(N0/P, N1)` -> `(N0, N1/P)`.

    Transpose:
        the same transform's transpose (an FFT and the reverse alltoalls): the true
        adjoint of the global transform.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi

        rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        x = jax.random.normal(jax.random.PRNGKey(0), (8, 6))  # the global array, on every rank
        n0, n1 = 8 // size, 6 // size
        block = x[rank * n0:(rank + 1) * n0]          # physical layout: axis 0 split
        k = vjpmpi.fft.fftn(block)                    # spectral layout: axis 1 split
        assert jnp.allclose(k, jnp.fft.fftn(x)[:, rank * n1:(rank + 1) * n1], atol=1e-4)
        assert jnp.allclose(vjpmpi.fft.ifftn(k), block, atol=1e-5)
        ```
    """
    plan = _plan(grid, "fftn")
    x = _input(x, "fftn", real=False)
    _check("fftn", x, len(plan[0]), norm)
    return _fftn(x, plan, norm, transposed, False, shape)


def ifftn(k, grid=None, *, norm=None, transposed=True, shape=None):
    """Inverse of `fftn`: `ifftn(fftn(x, g), g) == x`.

    Like `numpy.fft.ifftn` on the global array (all axes). Float inputs are promoted to
    complex.

    Args:
        k (Array): this rank's block of the global spectrum in the spectral layout
            (physical with `transposed=False`), float32, float64, complex64 or
            complex128.
        grid (vjpmpi.ProcessGrid | MPI.Intracomm | None): the process grid: a
            `vjpmpi.ProcessGrid` (1-D: slab, 2-D: pencil), an mpi4py communicator (slab)
            or None (slab over vjpmpi's private duplicate of COMM_WORLD).
        norm (str | None): the normalisation, as `numpy.fft`: None or "backward"
            (the inverse scaled by 1/N), "ortho", "forward".
        transposed (bool): True: `k` is in the spectral layout (as `fftn` returns it by
            default); False: in the physical layout (more alltoalls).
        shape (Sequence[int] | None): the global shape of the input (optional; needed
            where the blocks are not all equal: each rank's block is then its
            `ProcessGrid.block` of it). Without it the global shape is this rank's block
            times the grid; before any data moves the ranks compare the global shapes
            they use, and raise together if they differ.

    Returns:
        (Array): this rank's block of the global inverse FFT (complex), in the physical
            layout.

    Raises:
        TypeError: `grid` is a Cartesian communicator of more than one dimension (wrap
            it in `vjpmpi.ProcessGrid`), not a grid, communicator or None, or an
            intercommunicator; the input's dtype is not supported.
        ValueError: `norm` is not one of None, "backward", "ortho", "forward"; the input
            has fewer than (grid dimensions + 1) axes; `shape` is not the input's number
            of positive ints; on a one-rank grid, the refusals below, at once.
        ValueError: when run, on every rank: this rank's block is not
            its block of `shape`, or (without `shape`) the ranks' global shapes differ
            (uneven blocks).

    Shape:
        this rank's block in the spectral layout (physical with `transposed=False`) ->
        its block in the physical layout.

    Transpose:
        the same transform's transpose.
    """
    plan = _plan(grid, "ifftn")
    k = _input(k, "ifftn", real=False)
    _check("ifftn", k, len(plan[0]), norm)
    return _fftn(k, plan, norm, transposed, True, shape)


def rfftn(x, grid=None, *, norm=None, transposed=True, shape=None):
    """N-D FFT of a real block-distributed array, like `numpy.fft.rfftn` (the last axis
    keeps n // 2 + 1 frequencies).

    Args:
        x (Array): this rank's real block (float32 or float64) of the global array in
            the physical layout.
        grid (vjpmpi.ProcessGrid | MPI.Intracomm | None): the process grid: a
            `vjpmpi.ProcessGrid` (1-D: slab, 2-D: pencil), an mpi4py communicator (slab)
            or None (slab over vjpmpi's private duplicate of COMM_WORLD).
        norm (str | None): the normalisation, as `numpy.fft`: None or "backward"
            (the inverse scaled by 1/N), "ortho", "forward".
        transposed (bool): True: return the spectral layout; False: the physical layout
            (more alltoalls).
        shape (Sequence[int] | None): the global shape of the input (optional; needed
            where the blocks are not all equal: each rank's block is then its
            `ProcessGrid.block` of it). Without it the global shape is this rank's block
            times the grid; before any data moves the ranks compare the global shapes
            they use, and raise together if they differ.

    Returns:
        (Array): this rank's complex block (complex64, or complex128 from float64) of
            the global half spectrum, in the spectral layout (physical with
            `transposed=False`).

    Raises:
        TypeError: `grid` is a Cartesian communicator of more than one dimension (wrap
            it in `vjpmpi.ProcessGrid`), not a grid, communicator or None, or an
            intercommunicator; `x` is not float32 or float64.
        ValueError: `norm` is not one of None, "backward", "ortho", "forward"; the input
            has fewer than (grid dimensions + 1) axes; `shape` is not the input's number
            of positive ints; the spectral layout splits the half-spectrum axis and it
            has fewer frequencies than the grid dimension that splits it; on a
            one-rank grid, the refusals below, at once.
        ValueError: when run, on every rank: this rank's block is not
            its block of `shape`, or (without `shape`) the ranks' global shapes differ
            (uneven blocks).

    Shape:
        this rank's real block in the physical layout -> its complex block in the
        spectral layout (physical with `transposed=False`); where the spectral layout
        splits the half-spectrum axis (2-D slab, 3-D pencil) its blocks may be uneven,
        the first ones one longer (`ProcessGrid.block`).

    Transpose:
        the real transform's transpose (an inverse real FFT and the reverse alltoalls).
    """
    plan = _plan(grid, "rfftn")
    x = _input(x, "rfftn", real=True)
    _check("rfftn", x, len(plan[0]), norm)
    return _rfftn(x, plan, norm, transposed, shape)


def irfftn(k, grid=None, *, n=None, norm=None, transposed=True, shape=None):
    """Inverse of `rfftn`: `irfftn(rfftn(x, g), g, n=x's last global size) == x`.

    Like `numpy.fft.irfftn` on the global half spectrum.

    Args:
        k (Array): this rank's block of the global half spectrum (complex64 or
            complex128; floats are promoted) in the spectral layout (physical with
            `transposed=False`).
        grid (vjpmpi.ProcessGrid | MPI.Intracomm | None): the process grid: a
            `vjpmpi.ProcessGrid` (1-D: slab, 2-D: pencil), an mpi4py communicator (slab)
            or None (slab over vjpmpi's private duplicate of COMM_WORLD).
        n (int | None): the global length of the output's last axis (default
            2 * (frequencies - 1); needed where the layout splits the half spectrum and
            `shape` is not given).
        norm (str | None): the normalisation, as `numpy.fft`: None or "backward"
            (the inverse scaled by 1/N), "ortho", "forward".
        transposed (bool): True: `k` is in the spectral layout (as `rfftn` returns it by
            default); False: in the physical layout (more alltoalls).
        shape (Sequence[int] | None): the global shape of the input (optional; needed
            where the blocks are not all equal: each rank's block is then its
            `ProcessGrid.block` of it). Without it the global shape is this rank's block
            times the grid; before any data moves the ranks compare the global shapes
            they use, and raise together if they differ.

    Returns:
        (Array): this rank's real block (float32 from complex64 or float32, float64 from
            complex128 or float64) of the global inverse, in the physical layout.

    Raises:
        TypeError: `grid` is a Cartesian communicator of more than one dimension (wrap
            it in `vjpmpi.ProcessGrid`), not a grid, communicator or None, or an
            intercommunicator; the input's dtype is not supported.
        ValueError: `norm` is not one of None, "backward", "ortho", "forward"; the input
            has fewer than (grid dimensions + 1) axes; `shape` is not the input's number
            of positive ints; `n` is not a positive int, or missing where the layout
            splits the half spectrum and `shape` is not given, or `n // 2 + 1` is not
            the number of frequencies on the last axis; on a one-rank grid, the
            refusals below, at once.
        ValueError: when run, on every rank: this rank's block is not
            its block of `shape`, or (without `shape`) the ranks' global shapes differ
            (uneven blocks).

    Shape:
        this rank's complex block in the spectral layout (physical with
        `transposed=False`) -> its real block in the physical layout.

    Transpose:
        the real inverse transform's transpose.
    """
    plan = _plan(grid, "irfftn")
    k = _input(k, "irfftn", real=False)
    _check("irfftn", k, len(plan[0]), norm)
    if n is not None and (not isinstance(n, (int, np.integer)) or n < 1):
        raise ValueError(f"vjpmpi.fft.irfftn: argument 'n' must be a positive int, got {n!r}")
    return _irfftn(k, plan, norm, transposed, None if n is None else int(n), shape)
