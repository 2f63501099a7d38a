"""vjpmpi.nn halo layers: every rank's block equals the slice of the single-process result."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn as vnn

from helpers import WORLD

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
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def gpad(u, nd, w, periodic):
    """Pad the trailing nd axes of u (numpy or jax) by w, periodic or with zeros."""
    pw = [(0, 0)] * (u.ndim - nd) + [(w, w)] * nd
    return jnp.pad(u, pw, mode="wrap" if periodic else "constant")


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
        u = U[bs]

        want = np.pad(np.asarray(U), width, mode="wrap" if periodic else "constant")[ps]
        close(layer(u), want)
        close(eqx.filter_jit(lambda m, x: m(x))(layer, u), want)

        # A leading (channel) axis is carried along.
        u2 = jnp.stack([u, 2 * u])
        close(layer(u2), np.stack([want, 2 * want]))

        # Gradient of sum over ranks of sum(sin(c * halo(u))): the halo cotangents
        # come back to the owning cells.
        c = global_field((N + 2 * width,) * nd, seed=99)

        def local_loss(x):
            return jnp.sum(jnp.sin(c[ps] * layer(x)))

        def ref_loss(V):
            P = gpad(V, nd, width, periodic)
            return sum(jnp.sum(jnp.sin(c[s] * P[s]))
                       for s in all_padded_slices(cart, nd, width))

        ref_g = jax.jit(jax.grad(ref_loss))(U)[bs]
        close(jax.grad(local_loss)(u), ref_g)
        close(eqx.filter_jit(jax.grad(local_loss))(u), ref_g)
    finally:
        cart.free()


def loss_of(layer, x):
    return jnp.sum(jnp.sin(layer(x)))


def grads(m, x, loss):
    """(gradient w.r.t. the layer's parameters, gradient w.r.t. the input)."""
    return eqx.filter_grad(loss)(m, x), jax.grad(lambda v: loss(m, v))(x)


@pytest.mark.parametrize("kernel,jit", [(3, False), (5, True)], ids=["k3-eager", "k5-jit"])
@pytest.mark.parametrize("nd,periodic", CASES, ids=IDS)
def test_halo_conv(nd, periodic, kernel, jit):
    cart = make_cart(nd, periodic)
    try:
        cin, cout, w = 2, 3, (kernel - 1) // 2
        dense = eqx.nn.Conv(nd, cin, cout, kernel, padding=0, key=jax.random.PRNGKey(nd))
        dense = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), dense)
        layer = vnn.HaloConv.from_dense(dense, cart.cart)  # a plain Cartcomm works too
        assert layer.halo.width == w
        U = global_field((cin,) + (N,) * nd, seed=20 + nd)
        bs = (slice(None),) + block_slices(cart, nd)
        u = U[bs]

        def ref(conv, V):
            return conv(gpad(V, nd, w, periodic))

        # Reference for 'SAME' padding: the same weights on the globally padded field.
        want = eqx.filter_jit(ref)(dense, U)
        assert want.shape == (cout,) + (N,) * nd
        if not periodic:  # zero padding is exactly equinox's own 'SAME' conv
            same = eqx.nn.Conv(nd, cin, cout, kernel, padding=w, key=jax.random.PRNGKey(nd))
            same = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), same)
            close(same(U), want)

        call = (eqx.filter_jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x)))
        out = call(layer, u)
        assert out.shape == (cout,) + u.shape[1:]
        close(out, want[bs])

        g_layer, g_u = (eqx.filter_jit(grads) if jit else grads)(layer, u, loss_of)
        ref_g_conv, ref_g_u = eqx.filter_jit(grads)(
            dense, U, lambda c, V: jnp.sum(jnp.sin(ref(c, V))))

        close(g_u, ref_g_u[bs])
        # Replicated weights: each rank holds its own block's contribution.
        gw = WORLD.allreduce(np.asarray(g_layer.conv.weight), op=MPI.SUM)
        gb = WORLD.allreduce(np.asarray(g_layer.conv.bias), op=MPI.SUM)
        close(gw, ref_g_conv.weight)
        close(gb, ref_g_conv.bias)
    finally:
        cart.free()


def test_halo_conv_rejects_bad_convs():
    cart = make_cart(1, True)
    try:
        key = jax.random.PRNGKey(0)
        with pytest.raises(ValueError, match="padding"):
            vnn.HaloConv.from_dense(eqx.nn.Conv(1, 1, 1, 3, padding=1, key=key), cart)
        with pytest.raises(ValueError, match="odd"):
            vnn.HaloConv.from_dense(eqx.nn.Conv(1, 1, 1, 4, key=key), cart)
        with pytest.raises(ValueError, match="spatial dims"):
            vnn.HaloConv.from_dense(eqx.nn.Conv(2, 1, 1, 3, key=key), cart)
        with pytest.raises(TypeError, match="Cartesian"):
            vnn.HaloExchange(WORLD, 1)
    finally:
        cart.free()
