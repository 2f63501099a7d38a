"""vjpmpi.nn halo layers: every rank's block equals the slice of the single-process result.

Cost: XLA compiles (a jax.random shape alone takes a second or more on CPU), so the
fields and conv weights are drawn with NumPy, and the single-process references
(values and gradients) are NumPy too.
"""


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn as vnn

from helpers import WORLD, fresh

jax.config.update("jax_enable_x64", True)

size = WORLD.size
N = 12  # global extent per axis: divisible by the block counts at 1-4 ranks
CASES = [(nd, periodic) for nd in (1, 2) for periodic in (True, False)]
IDS = [f"{nd}d-{'periodic' if p else 'zero'}" for nd, p in CASES]


def close(a, b, tol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def make_cart(nd, periodic):
    """A vjpmpi.ProcessGrid (the layers take it or its .cart, a Cartesian communicator)."""
    return vjpmpi.ProcessGrid.create(nd, WORLD, periodic)


def block_slices(cart, nd, rank=None):
    """`rank`'s block (default: this rank's) of the global (N,)*nd field, as slices
    (vjpmpi.ProcessGrid.block: the grid logic HaloExchange and vjpmpi.fft share)."""
    return cart.block((N,) * nd, rank=rank)


def padded_slices(cart, nd, w, rank=None):
    """`rank`'s block plus `w` halo cells per side, inside the globally padded field."""
    return tuple(slice(s.start, s.stop + 2 * w) for s in block_slices(cart, nd, rank))


def all_padded_slices(cart, nd, w):
    """padded_slices of every rank of `cart` (for single-process references)."""
    return [padded_slices(cart, nd, w, r) for r in range(cart.cart.size)]


def global_field(shape, seed):
    """A NumPy field, the same on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)


def np_pad(u, nd, w, periodic):
    """Pad the trailing nd axes of u by w, periodic or with zeros (NumPy)."""
    return np.pad(u, [(0, 0)] * (u.ndim - nd) + [(w, w)] * nd,
                  mode="wrap" if periodic else "constant")


def np_pad_transpose(g, nd, w, periodic):
    """The transpose of np_pad (NumPy): the padded field's cotangent `g` summed back onto
    the cells it was copied from (periodic), or cropped (zeros)."""
    for ax in range(g.ndim - nd, g.ndim):
        g = np.moveaxis(g, ax, 0)
        core = g[w:-w].copy()
        if periodic:
            core[:w] += g[-w:]  # the high halo holds copies of the first w cells
            core[-w:] += g[:w]  # the low halo, of the last w cells
        g = np.moveaxis(core, 0, ax)
    return g


@pytest.mark.parametrize("nd,periodic", CASES, ids=IDS)
def test_halo_exchange(nd, periodic):
    width = 2 if nd == 1 else 1  # (HaloConv's kernel-5 tests cover width 2 in 2-D)
    cart = make_cart(nd, periodic)
    try:
        layer = vnn.HaloExchange(cart, width)
        assert layer.dims == cart.dims
        assert layer.periodic == (periodic,) * nd
        U = global_field((N,) * nd, seed=10 + nd)
        bs, ps = block_slices(cart, nd), padded_slices(cart, nd, width)
        u = jnp.asarray(U[bs])

        want = np_pad(U, nd, width, periodic)[ps]
        close(layer(u), want)
        close(eqx.filter_jit(lambda m, x: m(x))(layer, u), want)

        # A leading (channel) axis is carried along.
        close(layer(jnp.asarray(np.stack([U[bs], 2 * U[bs]]))), np.stack([want, 2 * want]))

        # Gradient of sum over ranks of sum(sin(c * halo(u))): the halo cotangents
        # come back to the owning cells.
        c = global_field((N + 2 * width,) * nd, seed=99)
        mine = c[ps]

        def local_loss(x):
            return jnp.sum(jnp.sin(mine * layer(x)))

        # single process: d/dV of sum over the ranks' padded slices s of
        # sum(sin(c[s] * np_pad(V)[s])), by hand
        P = np_pad(U, nd, width, periodic)
        dP = np.zeros_like(P)
        for s in all_padded_slices(cart, nd, width):
            dP[s] += c[s] * np.cos(c[s] * P[s])
        ref_g = np_pad_transpose(dP, nd, width, periodic)[bs]
        close(jax.grad(local_loss)(u), ref_g)
        close(eqx.filter_jit(jax.grad(local_loss))(u), ref_g)
    finally:
        cart.free()


def value_and_grads(m, x):
    """(m(x), gradient of sum(sin(m(x))) w.r.t. the layer's parameters, w.r.t. the
    input): one forward and one backward pass."""

    def loss(mx):
        y = mx[0](mx[1])
        return jnp.sum(jnp.sin(y)), y

    (_, y), (g, gx) = eqx.filter_value_and_grad(loss, has_aux=True)((m, x))
    return y, g, gx


def conv_reference(weight, bias, U, w, periodic):
    """The single-process results, by NumPy: the conv (a cross-correlation, as
    eqx.nn.Conv with padding 0) of the globally padded field U, and the gradients of
    the sum of its sin w.r.t. the weight, the bias and U."""
    nd = U.ndim - 1
    P = np_pad(U, nd, w, periodic)
    kernel = weight.shape[2:]
    windows = np.lib.stride_tricks.sliding_window_view(P, kernel, axis=tuple(range(1, nd + 1)))
    xs, ks = "xy"[:nd], "ab"[:nd]  # spatial and kernel-offset axes
    out = np.einsum(f"oi{ks},i{xs}{ks}->o{xs}", weight, windows) + bias
    c = np.cos(out)  # d sum(sin(out)) / d out
    g_weight = np.einsum(f"o{xs},i{xs}{ks}->oi{ks}", c, windows)
    g_bias = c.sum(axis=tuple(range(1, nd + 1))).reshape(bias.shape)
    g_P = np.zeros_like(P)
    for offset in np.ndindex(*kernel):  # each kernel tap reads the field shifted by it
        cells = tuple(slice(a, a + n) for a, n in zip(offset, c.shape[1:], strict=True))
        g_P[(slice(None),) + cells] += np.einsum(f"oi,o{xs}->i{xs}",
                                                 weight[(slice(None),) * 2 + offset], c)
    return out, g_weight, g_bias, np_pad_transpose(g_P, nd, w, periodic)


@pytest.mark.parametrize("kernel,jit", [(3, False), (5, True)], ids=["k3-eager", "k5-jit"])
@pytest.mark.parametrize("nd,periodic", CASES, ids=IDS)
def test_halo_conv(nd, periodic, kernel, jit):
    cart = make_cart(nd, periodic)
    try:
        cin, cout, w = 2, 3, (kernel - 1) // 2
        dense = fresh(eqx.nn.Conv, nd, cin, cout, kernel, padding=0, seed=nd)
        assert dense.weight.dtype == jnp.float64
        layer = vnn.HaloConv.from_dense(dense, cart.cart)  # a plain Cartcomm works too
        assert layer.halo.width == w
        U = global_field((cin,) + (N,) * nd, seed=20 + nd)
        bs = (slice(None),) + block_slices(cart, nd)
        u = jnp.asarray(U[bs])

        # Reference for 'SAME' padding: the same weights on the globally padded field.
        want, ref_g_weight, ref_g_bias, ref_g_u = conv_reference(
            np.asarray(dense.weight), np.asarray(dense.bias), U, w, periodic)
        assert want.shape == (cout,) + (N,) * nd
        if not periodic:  # zero padding is exactly equinox's own 'SAME' conv
            same = eqx.tree_at(lambda cv: (cv.weight, cv.bias),
                               fresh(eqx.nn.Conv, nd, cin, cout, kernel, padding=w, seed=0),
                               (dense.weight, dense.bias))
            close(same(jnp.asarray(U)), want)

        if jit:  # the call and its gradients, one program
            out, g_layer, g_u = eqx.filter_jit(value_and_grads)(layer, u)
        else:  # op by op
            out = layer(u)
            _, g_layer, g_u = value_and_grads(layer, u)
        assert out.shape == (cout,) + u.shape[1:]
        close(out, want[bs])

        close(g_u, ref_g_u[bs])
        # Replicated weights: each rank holds its own block's contribution.
        gw = WORLD.allreduce(np.asarray(g_layer.conv.weight), op=MPI.SUM)
        gb = WORLD.allreduce(np.asarray(g_layer.conv.bias), op=MPI.SUM)
        close(gw, ref_g_weight)
        close(gb, ref_g_bias)
    finally:
        cart.free()


def test_halo_conv_rejects_bad_convs():
    cart = make_cart(1, True)
    try:
        with pytest.raises(ValueError, match="padding"):
            vnn.HaloConv.from_dense(fresh(eqx.nn.Conv, 1, 1, 1, 3, padding=1, seed=0), cart)
        with pytest.raises(ValueError, match="odd"):
            vnn.HaloConv.from_dense(fresh(eqx.nn.Conv, 1, 1, 1, 4, seed=0), cart)
        with pytest.raises(ValueError, match="spatial dims"):
            vnn.HaloConv.from_dense(fresh(eqx.nn.Conv, 2, 1, 1, 3, seed=0), cart)
        with pytest.raises(TypeError, match="Cartesian"):
            vnn.HaloExchange(WORLD, 1)
    finally:
        cart.free()
