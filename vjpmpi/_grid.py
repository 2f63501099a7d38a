"""`ProcessGrid`: ranks on a Cartesian grid and the blocks of a global array they hold.

The one place for grid logic: `nn.HaloExchange` takes its neighbours from it,
`vjpmpi.fft` its axis communicators and block sizes, tests and examples their
scatter/gather of global arrays.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ._mpi import CommRef, as_comm


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Sizes of the `parts` blocks of an axis of length `n`: as equal as they can be,
    the first `n % parts` blocks one longer."""
    q, r = divmod(n, parts)
    return tuple(q + (i < r) for i in range(parts))


def split_start(n: int, parts: int, i: int) -> int:
    """Start of block `i` of `split_sizes(n, parts)`."""
    q, r = divmod(n, parts)
    return i * q + min(i, r)


def topology(cart: Any, op: str) -> tuple[CommRef, tuple, tuple, tuple, tuple]:
    """(record, dims, periodic, coords, neighbours) of a Cartesian communicator;
    neighbours[a] = cart.Shift(a, 1) = (source, dest). Local: no communication."""
    if not isinstance(cart, MPI.Cartcomm):
        raise TypeError(
            f"vjpmpi.{op}: argument 'cart' must be an mpi4py Cartesian communicator "
            f"(comm.Create_cart(dims, periods=...)), got {type(cart).__name__}"
        )
    ref = as_comm(cart, op)
    dims, periods, coords = cart.Get_topo()
    neighbours = tuple(tuple(int(r) for r in cart.Shift(a, 1)) for a in range(len(dims)))
    return (ref, tuple(int(d) for d in dims), tuple(bool(p) for p in periods),
            tuple(int(c) for c in coords), neighbours)


class ProcessGrid:
    """The ranks of a communicator as a Cartesian grid, and who holds which block.

    `ProcessGrid(cart)` wraps an mpi4py Cartesian communicator;
    `ProcessGrid.create(ndim, comm)` makes one with `MPI.Compute_dims(comm.size, ndim)`.
    Grid dimension `i` splits array axis `axes[i]` (default: axis `i`) into
    `dims[i]` blocks, as equal as they can be (the first `n % dims[i]` one longer).
    Constructing it is collective over `cart` (it makes the axis communicators).

    Args:
        cart (MPI.Cartcomm): the Cartesian communicator (`comm.Create_cart(dims,
            periods=...)`); the grid uses it and does not free it.

    Raises:
        TypeError: when `cart` is not an mpi4py Cartesian communicator.
        ValueError: when `cart` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized.
    """

    def __init__(self, cart: MPI.Cartcomm):
        (self.ref, self.dims, self.periodic, self.coords,
         self.neighbours) = topology(cart, "ProcessGrid")
        self.cart = cart
        self.ndim = len(self.dims)
        self._owns_cart = False
        # The ranks that differ from this one only in coordinate `i`, ranked by it.
        self.axis_comms = tuple(
            cart if self.ndim == 1 else cart.Sub([j == i for j in range(self.ndim)])
            for i in range(self.ndim))

    @classmethod
    def create(cls, ndim: int, comm: MPI.Intracomm | None = None,
               periodic: bool | Sequence[bool] = True,
               dims: Sequence[int] | None = None) -> ProcessGrid:
        """A grid of `ndim` dimensions over `comm`. Collective over `comm`.

        Args:
            ndim (int): the number of grid dimensions.
            comm (MPI.Intracomm | None): the communicator whose ranks make the grid (None:
                `MPI.COMM_WORLD`).
            periodic (bool | Sequence[bool]): whether each dimension wraps around (one bool:
                all of them).
            dims (Sequence[int] | None): the number of ranks along each dimension (default
                `MPI.Compute_dims(comm.size, ndim)`).

        Returns:
            (ProcessGrid): The grid, on a new Cartesian communicator that `free` frees.

        Raises:
            ValueError: when `dims` does not have `ndim` entries whose product is the
                communicator's size.
        """
        comm = MPI.COMM_WORLD if comm is None else comm
        dims = list(MPI.Compute_dims(comm.size, ndim) if dims is None else dims)
        if len(dims) != ndim or int(np.prod(dims)) != comm.size:
            raise ValueError(f"vjpmpi.ProcessGrid.create: dims {dims} must have {ndim} "
                             f"entries whose product is the communicator size {comm.size}")
        periods = [periodic] * ndim if isinstance(periodic, bool) else list(periodic)
        grid = cls(comm.Create_cart(dims, periods=periods))
        grid._owns_cart = True
        return grid

    def __repr__(self) -> str:
        return f"ProcessGrid(dims={self.dims}, coords={self.coords})"

    def _axes(self, ndim: int, axes: Sequence[int] | None, op: str) -> tuple[int, ...]:
        axes = tuple(range(self.ndim)) if axes is None else tuple(a % ndim for a in axes)
        if len(axes) != self.ndim or len(set(axes)) != self.ndim:
            raise ValueError(f"vjpmpi.ProcessGrid.{op}: 'axes' must name {self.ndim} distinct "
                             f"axes of the array (one per grid dimension), got {axes}")
        return axes

    def block(self, shape: Sequence[int], axes: Sequence[int] | None = None,
              rank: int | None = None) -> tuple[slice, ...]:
        """The slices of a global array of `shape` that `rank` holds.

        Local: no communication.

        Args:
            shape (Sequence[int]): the global array's shape.
            axes (Sequence[int] | None): the array axis each grid dimension splits, one per
                dimension (negative ones count from the end; default: axis `i` for dimension
                `i`).
            rank (int | None): a rank of the grid's communicator (default: this rank).

        Returns:
            (tuple[slice, ...]): One slice per axis of `shape` (the whole axis where no grid
                dimension splits it).

        Raises:
            ValueError: when `axes` does not name one distinct axis per grid dimension, or a
                split axis has fewer entries than its grid dimension has ranks.
        """
        coords = self.coords if rank is None else tuple(self.cart.Get_coords(rank))
        out = [slice(0, int(n)) for n in shape]
        for i, a in enumerate(self._axes(len(shape), axes, "block")):
            n, p = int(shape[a]), self.dims[i]
            if n < p:
                raise ValueError(f"vjpmpi.ProcessGrid.block: axis {a} of shape {tuple(shape)} "
                                 f"has fewer entries than grid dimension {i} ({p})")
            start = split_start(n, p, coords[i])
            out[a] = slice(start, start + split_sizes(n, p)[coords[i]])
        return tuple(out)

    def local(self, global_array, axes: Sequence[int] | None = None):
        """This rank's block of `global_array` (which every rank holds), as a JAX array.

        Local: no communication.

        Args:
            global_array (ArrayLike): the whole array, the same on every rank.
            axes (Sequence[int] | None): the array axis each grid dimension splits (default:
                axis `i` for dimension `i`).

        Returns:
            (jax.Array): The block `block(global_array.shape, axes)` of it, as a JAX array.

        Raises:
            ValueError: as `block`.
        """
        return jnp.asarray(np.asarray(global_array)[self.block(np.shape(global_array), axes)])

    def gather(self, local, shape: Sequence[int], axes: Sequence[int] | None = None) -> np.ndarray:
        """The global array of `shape` assembled from every rank's block, on every rank.

        Eager (mpi4py's `allgather` on the grid's communicator), for tests and examples:
        collective over the grid, not differentiable.

        Args:
            local (ArrayLike): this rank's block, `block(shape, axes)`'s shape.
            shape (Sequence[int]): the global array's shape.
            axes (Sequence[int] | None): the array axis each grid dimension splits (default:
                axis `i` for dimension `i`).

        Returns:
            (np.ndarray): The global array, a NumPy array of `shape` with the blocks' dtype
                (rank 0's).

        Raises:
            ValueError: as `block`, or when a rank's block does not have its slices' shape.
        """
        blocks = self.cart.allgather(np.asarray(local))
        out = np.empty(tuple(shape), blocks[0].dtype)
        for r, b in enumerate(blocks):
            out[self.block(shape, axes, rank=r)] = b
        return out

    def free(self) -> None:
        """Free the communicators the grid made (collective); a `cart` passed in stays.

        Returns:
            (None): nothing.
        """
        for c in self.axis_comms:
            if c is not self.cart:
                c.Free()
        if self._owns_cart:
            self.cart.Free()
