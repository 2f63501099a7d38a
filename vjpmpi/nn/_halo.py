"""Domain-decomposed halo layers on a Cartesian communicator (1-D or 2-D)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float
from mpi4py import MPI

from .._composite import ordered_collective
from .._grid import ProcessGrid, topology
from .._mpi import CommRef
from .._p2p import prepare_sendrecv


def _cart_topology(cart, layer: str):
    """(record, dims, periodic, neighbours) of a 1-D or 2-D Cartesian communicator or
    `vjpmpi.ProcessGrid` (`_grid.topology`, the grid logic every decomposition shares)."""
    if isinstance(cart, ProcessGrid):
        cart = cart.cart
    ref, dims, periodic, _, neighbours = topology(cart, f"nn.{layer}")
    if len(dims) not in (1, 2):
        raise ValueError(
            f"vjpmpi.nn.{layer}: the Cartesian communicator must have 1 or 2 dimensions, "
            f"got {len(dims)}"
        )
    return ref, dims, periodic, neighbours


def _edge(u, axis: int, start: int, stop: int):
    idx = [slice(None)] * u.ndim
    idx[axis] = slice(start, stop)
    return u[tuple(idx)]


@ordered_collective(name="halo_exchange")
def _exchange(u, *, comm, width, neighbours, ndim, invalid=None):
    """Pad the trailing `ndim` axes of `u` with `width` cells from the neighbours;
    `invalid`: this rank's block is too small (the exchanges end the job when they run:
    the neighbours, which cannot check this rank's block, wait for its messages)."""
    for axis, (source, dest) in enumerate(neighbours):
        ax = u.ndim - ndim + axis
        n = u.shape[ax]
        high = _edge(u, ax, n - width, n)   # my last `width` cells: go to `dest`
        low = _edge(u, ax, 0, width)        # my first `width` cells: go to `source`
        # Templates derived from `u` (zeros where the partner is PROC_NULL, so the
        # boundary halo is zero-filled) keep the result differentiable in `u`.
        tmpl_lo = low if source != MPI.PROC_NULL else 0 * low
        tmpl_hi = high if dest != MPI.PROC_NULL else 0 * high
        # Shift +1: send high edge to dest, receive my low halo from source.
        (halo_lo,) = prepare_sendrecv(high, tmpl_lo, source, dest, sendtag=2 * axis,
                                      recvtag=2 * axis, comm=comm, invalid=invalid).run()
        # Shift -1: send low edge to source, receive my high halo from dest.
        (halo_hi,) = prepare_sendrecv(low, tmpl_hi, dest, source, sendtag=2 * axis + 1,
                                      recvtag=2 * axis + 1, comm=comm, invalid=invalid).run()
        # Axis 1 pads the array already padded on axis 0, so corners get filled.
        u = jnp.concatenate([halo_lo, u, halo_hi], axis=ax)
    return u


class HaloExchange(eqx.Module):
    """Halo exchange of a block-decomposed field over a Cartesian communicator.

    Pads each decomposed axis of this rank's block with `width` cells from each
    neighbour. Halo cells come from the neighbours given by `cart.Shift(axis, 1)`; at a
    non-periodic boundary (neighbour MPI.PROC_NULL) they are zero. Corners are filled
    (axis 1 is exchanged after axis 0, on the axis-0-padded array). A block smaller
    than `width` on some rank ends the job (`MPI_Abort`) with a message when the
    exchange runs: its neighbours, which wait for its halos, cannot check it.

    Args:
        cart (MPI.Cartcomm | vjpmpi.ProcessGrid): an mpi4py Cartesian communicator of 1
            or 2 dimensions, or a `vjpmpi.ProcessGrid` (whose `block` gives each rank's
            block).
        width (int): the halo's width in cells, >= 0 (0: the identity).

    Raises:
        TypeError: `cart` is neither an mpi4py Cartesian communicator nor a
            `vjpmpi.ProcessGrid`.
        ValueError: `cart` has other than 1 or 2 dimensions, or `width` < 0.

    Shape:
        this rank's block `(..., n0)` (1-D cart) or `(..., n0, n1)` (2-D cart) ->
        `(..., n0 + 2*width)` / `(..., n0 + 2*width, n1 + 2*width)`; the trailing axes
        are the decomposed ones (leading axes, e.g. channels, are carried along).

    Transpose:
        the reverse exchange, which adds the halo cotangents back into the cells that
        own them (done automatically by vjpmpi's sendrecv transposes).

    Example:
        ```python
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi, vjpmpi.nn as vnn

        size = MPI.COMM_WORLD.size
        cart = MPI.COMM_WORLD.Create_cart([size], periods=[True])  # a periodic ring of ranks
        halo = vnn.HaloExchange(cart, width=1)
        u = jnp.arange(4.0) + 4 * cart.rank          # this rank's 4 cells of the global field
        padded = halo(u)                             # (6,): one neighbour's cell on each side
        want = jnp.take(jnp.arange(4.0 * size), jnp.arange(-1, 5) + 4 * cart.rank, mode="wrap")
        assert jnp.allclose(padded, want)
        ```
    """

    comm: CommRef = eqx.field(static=True)
    width: int = eqx.field(static=True)
    dims: tuple[int, ...] = eqx.field(static=True)
    periodic: tuple[bool, ...] = eqx.field(static=True)
    neighbours: tuple[tuple[int, int], ...] = eqx.field(static=True)

    def __init__(self, cart, width: int = 1):
        self.comm, self.dims, self.periodic, self.neighbours = _cart_topology(
            cart, "HaloExchange")
        width = int(width)
        if width < 0:
            raise ValueError(f"vjpmpi.nn.HaloExchange: width must be >= 0, got {width}")
        self.width = width

    def __call__(self, u: Float[Array, "..."], *, key=None) -> Float[Array, "..."]:
        """Pad this rank's block with its neighbours' cells.

        Args:
            u (Array): this rank's block, the decomposed axes last: `(..., n0)` or
                `(..., n0, n1)`, each at least `width` long.
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            The padded block, `(..., n0 + 2*width)` or
                `(..., n0 + 2*width, n1 + 2*width)`.

        Raises:
            ValueError: `u` has fewer axes than the communicator has dimensions.
        """
        nd = len(self.dims)
        if u.ndim < nd:
            raise ValueError(
                f"vjpmpi.nn.HaloExchange: expected at least {nd} axes (the decomposed "
                f"ones last), got shape {tuple(u.shape)}"
            )
        if self.width == 0:
            return u
        # A block smaller than the width on this rank: only this rank can see it, and its
        # neighbours wait for its halos; the exchange ends the job with this text when it
        # runs (the other ranks cannot check this rank's block).
        block = tuple(u.shape[u.ndim - nd:])
        invalid = None
        if min(block) < self.width:
            invalid = (f"vjpmpi.nn.HaloExchange: on rank {self.comm.rank}, the block shape "
                       f"{block} is smaller than the halo width {self.width} (the neighbours "
                       "that wait for its halos cannot check it)")
        return _exchange(u, comm=self.comm, width=self.width,
                         neighbours=self.neighbours, ndim=nd, invalid=invalid)


class HaloConv(eqx.Module):
    """Domain-decomposed `eqx.nn.Conv` (stride 1, odd kernel) over a Cartesian communicator.

    A `HaloExchange` of width `(kernel_size - 1) // 2`, then the conv on the padded
    block: the blocks together equal the single-process conv of the global field with
    'SAME' padding (circular where the cart is periodic, zeros where it is not). The
    conv weights are replicated: each rank's weight gradient holds its own block's
    contribution (sum them over ranks, e.g. with an allreduce, for the global gradient).

    Args:
        conv (eqx.nn.Conv): the conv, the same on every rank, built with padding 0
            ('VALID'), stride 1, dilation 1, an odd kernel size equal on every axis and
            as many spatial dimensions as `cart`.
        cart (MPI.Cartcomm | vjpmpi.ProcessGrid): an mpi4py Cartesian communicator of 1
            or 2 dimensions, or a `vjpmpi.ProcessGrid`.

    Raises:
        TypeError: `cart` is neither an mpi4py Cartesian communicator nor a
            `vjpmpi.ProcessGrid`.
        ValueError: `cart` has other than 1 or 2 dimensions, or `conv` has another
            number of spatial dimensions, a kernel size that is even or differs between
            axes, a stride or dilation other than 1, or a padding other than 0.

    Shape:
        this rank's block `(in_channels, n0[, n1])` -> `(out_channels, n0[, n1])`.

    Transpose:
        the conv's transpose, then the reverse halo exchange, which adds the halo
        cotangents back into the owning cells (vjpmpi's sendrecv transposes).
    """

    conv: eqx.nn.Conv
    halo: HaloExchange

    def __init__(self, conv: eqx.nn.Conv, cart):
        nd = len(_cart_topology(cart, "HaloConv")[1])
        if conv.num_spatial_dims != nd:
            raise ValueError(
                f"vjpmpi.nn.HaloConv: conv has {conv.num_spatial_dims} spatial dims but the "
                f"Cartesian communicator has {nd}"
            )
        ks = tuple(int(k) for k in conv.kernel_size)
        if len(set(ks)) != 1 or ks[0] % 2 != 1:
            raise ValueError(
                f"vjpmpi.nn.HaloConv: kernel_size must be odd and equal on every axis, got {ks}"
            )
        if any(int(s) != 1 for s in conv.stride) or any(int(d) != 1 for d in conv.dilation):
            raise ValueError("vjpmpi.nn.HaloConv: stride and dilation must be 1")
        if any(tuple(p) != (0, 0) for p in conv.padding):
            raise ValueError(
                "vjpmpi.nn.HaloConv: the conv must be built with padding=0 ('VALID'); "
                f"got padding {conv.padding}"
            )
        self.conv = conv
        self.halo = HaloExchange(cart, (ks[0] - 1) // 2)

    @classmethod
    def from_dense(cls, conv: eqx.nn.Conv, cart) -> HaloConv:
        """Wrap a standard `eqx.nn.Conv` built with padding 0 (same weights on every rank).

        Args:
            conv (eqx.nn.Conv): the conv, as the constructor takes it.
            cart (MPI.Cartcomm | vjpmpi.ProcessGrid): the Cartesian communicator or grid.

        Returns:
            `HaloConv(conv, cart)`.

        Raises:
            TypeError: as the constructor.
            ValueError: as the constructor.
        """
        return cls(conv, cart)

    def __call__(self, u: Float[Array, "c ..."], *, key=None) -> Float[Array, "o ..."]:
        """The conv of this rank's block, with its neighbours' cells as the halo.

        Args:
            u (Array): this rank's block, `(in_channels, n0[, n1])`, each spatial axis at
                least the halo's width long.
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            This rank's block of the conv, `(out_channels, n0[, n1])`.

        Raises:
            ValueError: `u` is not `(channels, *block)` with one axis per dimension of
                the communicator.
        """
        nd = len(self.halo.dims)
        if u.ndim != nd + 1:
            raise ValueError(
                f"vjpmpi.nn.HaloConv: expected shape (channels, *block) with {nd} spatial "
                f"axes, got {tuple(u.shape)}"
            )
        return self.conv(self.halo(u))
