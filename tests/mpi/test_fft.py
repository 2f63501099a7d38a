"""vjpmpi.fft: every rank's block equals the slice of numpy.fft on the global array, the
transposes pass dot tests, and grad/jvp/vmap/jit match single-process JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import fft as vfft

from helpers import WORLD
from hlo_order import assert_ordered, collective_sequence

jax.config.update("jax_enable_x64", True)

size = WORLD.size
TOL = 1e-12

# (name, grid dims, complex global shape, real global shape). Every split axis is
# divisible by the grids of 1-4 ranks; the real shapes' half spectra (9 -> 5, 12 -> 7)
# split unevenly where the layout splits them (2-D slab, 3-D pencil).
LAYOUTS = {
    "slab-2d": (lambda: [size], (12, 12), (12, 9)),
    "slab-3d": (lambda: [size], (12, 12, 6), (12, 12, 9)),
    "pencil-3d": (lambda: MPI.Compute_dims(size, 2), (12, 12, 6), (12, 12, 12)),
    "pencil-3d-1xP": (lambda: [1, size], (12, 12, 12), (4, 12, 12)),
}


def make_layout(name):
    dims, cshape, rshape = LAYOUTS[name]
    grid = vjpmpi.ProcessGrid.create(len(dims()), WORLD, dims=dims())
    return grid, cshape, rshape


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    grid, cshape, rshape = make_layout(request.param)
    yield grid, cshape, rshape
    grid.free()


# grad/jvp/vmap and dtypes: the two layouts whose half spectrum splits (unevenly)
@pytest.fixture(scope="module", params=["slab-2d", "pencil-3d"])
def split_layout(request):
    grid, cshape, rshape = make_layout(request.param)
    yield grid, cshape, rshape
    grid.free()


def phys(grid):
    return tuple(range(grid.ndim))


def spec(grid):
    return tuple(range(1, grid.ndim + 1))


def half(shape):
    return tuple(shape[:-1]) + (shape[-1] // 2 + 1,)


def rand(shape, seed, complex_=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    return x + 1j * rng.standard_normal(shape) if complex_ else x


def close(got, want, tol=TOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale
    assert err <= tol, f"max error {err:.3g} (relative to {scale:.3g}) > {tol}"


def allsum(v):
    """Sum of a scalar over all ranks (the global inner product of distributed arrays)."""
    return WORLD.allreduce(complex(v))


@pytest.mark.parametrize("transposed,norm", [(True, None), (False, "ortho"), (True, "forward")],
                         ids=["spectral", "physical-ortho", "spectral-forward"])
def test_matches_numpy(layout, transposed, norm):
    grid, cshape, rshape = layout
    out_axes = spec(grid) if transposed else phys(grid)
    X, K = rand(cshape, 1), rand(cshape, 2)
    k = jax.jit(lambda x: vfft.fftn(x, grid, norm=norm, transposed=transposed))(
        grid.local(X, phys(grid)))
    close(grid.gather(k, cshape, out_axes), np.fft.fftn(X, norm=norm))
    x = jax.jit(lambda k: vfft.ifftn(k, grid, norm=norm, transposed=transposed))(
        grid.local(K, out_axes))
    close(grid.gather(x, cshape, phys(grid)), np.fft.ifftn(K, norm=norm))

    R, H = rand(rshape, 3, False), rand(half(rshape), 4)
    h = jax.jit(lambda r: vfft.rfftn(r, grid, norm=norm, transposed=transposed))(
        grid.local(R, phys(grid)))
    close(grid.gather(h, half(rshape), out_axes), np.fft.rfftn(R, norm=norm))
    n = rshape[-1]
    r = jax.jit(lambda h: vfft.irfftn(h, grid, n=n, norm=norm, transposed=transposed))(
        grid.local(H, out_axes))
    close(grid.gather(r, rshape, phys(grid)), np.fft.irfftn(H, s=rshape, axes=range(len(rshape)), norm=norm))
    # round trips, in this rank's blocks
    close(vfft.ifftn(k, grid, norm=norm, transposed=transposed), grid.local(X, phys(grid)))
    close(vfft.irfftn(h, grid, n=n, norm=norm, transposed=transposed), grid.local(R, phys(grid)))


def transforms(grid, cshape, rshape):
    """(name, f, input global shape, input dtype is complex, input axes, output axes,
    output global shape) for each transform in its default (spectral) layout."""
    n = rshape[-1]
    return [
        ("fftn", lambda x: vfft.fftn(x, grid), cshape, True, phys(grid), spec(grid), cshape),
        ("ifftn", lambda k: vfft.ifftn(k, grid), cshape, True, spec(grid), phys(grid), cshape),
        ("rfftn", lambda r: vfft.rfftn(r, grid), rshape, False, phys(grid), spec(grid),
         half(rshape)),
        ("irfftn", lambda h: vfft.irfftn(h, grid, n=n), half(rshape), True, spec(grid),
         phys(grid), rshape),
    ]


def test_dot_products(layout):
    """<f(x), y> == <x, f^T(y)> summed over ranks (bilinear; its real part where the
    map is only real-linear), and f^T equals single-process JAX's transpose."""
    grid, cshape, rshape = layout
    global_fns = {"fftn": jnp.fft.fftn, "ifftn": jnp.fft.ifftn, "rfftn": jnp.fft.rfftn,
                  "irfftn": lambda h: jnp.fft.irfftn(h, s=rshape, axes=range(len(rshape)))}
    for i, (name, f, shape, cplx, in_axes, out_axes, oshape) in enumerate(
            transforms(grid, cshape, rshape)):
        X = rand(shape, 10 + i, cplx)
        Y = rand(oshape, 20 + i, name != "irfftn")
        x, y = grid.local(X, in_axes), grid.local(Y, out_axes)
        fx = jax.jit(f)(x)
        (ft_y,) = jax.jit(jax.linear_transpose(f, x))(y)
        lhs, rhs = allsum(jnp.sum(fx * y)), allsum(jnp.sum(x * ft_y))
        if name in ("rfftn", "irfftn"):
            lhs, rhs = lhs.real, rhs.real
        assert abs(lhs - rhs) <= TOL * max(1.0, abs(lhs)), (name, lhs, rhs)
        (want,) = jax.linear_transpose(global_fns[name], jnp.asarray(X))(jnp.asarray(Y))
        close(grid.gather(ft_y, shape, in_axes), want)


def test_grad_jvp_vmap(split_layout):
    """A real loss of the spectrum: grad and jvp equal single-process JAX on the
    global array; vmap over a batch equals the transform of each member."""
    grid, cshape, rshape = split_layout
    W_ = rand(half(rshape), 30, False)
    R, T = rand(rshape, 31, False), rand(rshape, 32, False)

    def loss_global(r):
        return jnp.sum(W_ * jnp.abs(jnp.fft.rfftn(r)) ** 2)

    w = grid.local(W_, spec(grid))

    def loss(r):  # the same scalar on every rank
        return vjpmpi.sum_replicated(jnp.sum(w * jnp.abs(vfft.rfftn(r, grid)) ** 2), comm=grid.cart)

    r, t = grid.local(R, phys(grid)), grid.local(T, phys(grid))
    value, g = jax.jit(jax.value_and_grad(loss))(r)
    close(value, loss_global(R))
    close(grid.gather(g, rshape, phys(grid)), jax.grad(loss_global)(jnp.asarray(R)))
    _, tangent = jax.jit(lambda r, t: jax.jvp(loss, (r,), (t,)))(r, t)
    close(tangent, jax.jvp(loss_global, (jnp.asarray(R),), (jnp.asarray(T),))[1])

    X = np.stack([rand(cshape, 33), rand(cshape, 34)])
    xs = jnp.stack([grid.local(v, phys(grid)) for v in X])
    ks = jax.jit(jax.vmap(lambda x: vfft.fftn(x, grid)))(xs)
    for b in range(2):
        close(grid.gather(ks[b], cshape, spec(grid)), np.fft.fftn(X[b]))


def test_dtypes(split_layout):
    """float32/complex64 in, complex64 out (at float32 accuracy); float64 promotes to
    complex128."""
    grid, cshape, rshape = split_layout
    X = rand(cshape, 40)
    k = vfft.fftn(grid.local(X, phys(grid)).astype(jnp.complex64), grid)
    assert k.dtype == jnp.complex64
    close(grid.gather(k, cshape, spec(grid)), np.fft.fftn(X.astype(np.complex64)), 1e-5)
    R = rand(rshape, 41, False)
    h = vfft.rfftn(grid.local(R, phys(grid)).astype(jnp.float32), grid)
    assert h.dtype == jnp.complex64
    close(grid.gather(h, half(rshape), spec(grid)), np.fft.rfftn(R), 1e-5)
    r = vfft.irfftn(h, grid, n=rshape[-1])
    assert r.dtype == jnp.float32
    k64 = vfft.fftn(grid.local(X.real, phys(grid)), grid)
    assert k64.dtype == jnp.complex128
    close(grid.gather(k64, cshape, spec(grid)), np.fft.fftn(X.real))


def test_rank_dependent_use_and_compiled_order():
    """Rank 0's loss uses the spectrum, the others' do not: the backward transposes still
    run on every rank (no hang) and the gradient equals the global one. What XLA compiles
    holds the alltoalls in program order: forward transposes, then their adjoints."""
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        shape = (12, 12, 6)
        X = rand(shape, 50, False)
        W_ = rand(shape, 51, False)
        mine = grid.block(shape, spec(grid), rank=0)  # the block rank 0 holds

        def global_loss(x):  # rank 0's term, plus every other rank's sum(x) of its block
            term = jnp.sum(W_[mine] * jnp.abs(jnp.fft.fftn(x)[mine]) ** 2)
            rest = [jnp.sum(x[grid.block(shape, phys(grid), rank=q)])
                    for q in range(1, size)]
            return term + sum(rest)

        w = grid.local(W_, spec(grid))

        def loss(x):
            k = vfft.fftn(x, grid)
            local = jnp.sum(w * jnp.abs(k) ** 2) if WORLD.rank == 0 else jnp.sum(x)
            return vjpmpi.sum_replicated(local, comm=grid.cart)

        x = grid.local(X, phys(grid))
        f = jax.jit(jax.value_and_grad(loss))
        value, g = f(x)
        close(value, global_loss(jnp.asarray(X)))
        close(grid.gather(g, shape, phys(grid)), jax.grad(global_loss)(jnp.asarray(X)))

        compiled = f.lower(x).compile().as_text()
        assert_ordered(compiled)
        steps = ["alltoall"] * sum(d > 1 for d in grid.dims)  # one per split grid dim
        # forward transposes, the loss's allreduce, then the adjoint transposes
        assert collective_sequence(compiled) == steps + ["allreduce"] + steps
    finally:
        grid.free()


def test_errors_name_the_op_and_argument():
    slab = WORLD
    if size > 1:  # (one rank splits nothing)
        with pytest.raises(ValueError, match=r"fft\.fftn: axis 1 of the global array "
                           r"\(\d+, \d+\) has \d+ entries, not divisible by the process "
                           r"grid's dimension 0"):
            vfft.fftn(jnp.zeros((3, 4 * size + 1)), slab)
    with pytest.raises(ValueError, match=r"fft\.fftn: argument 'x' has shape \(4,\)"):
        vfft.fftn(jnp.zeros(4), slab)
    with pytest.raises(TypeError, match=r"fft\.rfftn: argument 'x' has dtype complex"):
        vfft.rfftn(jnp.zeros((4, 4), jnp.complex128), slab)
    with pytest.raises(TypeError, match=r"fft\.fftn: argument 'x' has dtype int32"):
        vfft.fftn(jnp.zeros((4, 4), jnp.int32), slab)
    with pytest.raises(ValueError, match=r"fft\.ifftn: argument 'norm'"):
        vfft.ifftn(jnp.zeros((4, 4), jnp.complex128), slab, norm="unitary")
    with pytest.raises(TypeError, match=r"fft\.fftn: argument 'grid' must be"):
        vfft.fftn(jnp.zeros((4, 4)), "world")
    cart = WORLD.Create_cart(MPI.Compute_dims(size, 2))
    try:
        with pytest.raises(TypeError, match=r"fft\.fftn: argument 'grid' is a 2-D Cartesian"):
            vfft.fftn(jnp.zeros((4, 4, 4)), cart)
    finally:
        cart.Free()
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        with pytest.raises(ValueError, match=r"fft\.fftn: .* 2-D process grid needs at least 3"):
            vfft.fftn(jnp.zeros((4, 4)), grid)
        with pytest.raises(ValueError, match=r"fft\.irfftn: argument 'n' .* is needed"):
            vfft.irfftn(jnp.zeros((12, 12 // grid.dims[0], 3), jnp.complex128), grid)
    finally:
        grid.free()
    with pytest.raises(ValueError, match=r"fft\.irfftn: argument 'n'=7 needs 4"):
        vfft.irfftn(jnp.zeros((4, 3), jnp.complex128), slab, n=7, transposed=False)


def test_process_grid_blocks():
    """ProcessGrid.block/local/gather: uneven splits (the first blocks one longer), any
    axes, and gather(local) is the identity."""
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        shape = (7, 5, 3)
        A = np.arange(np.prod(shape)).reshape(shape)
        for axes in [(0, 1), (2, 0)]:
            sl = [grid.block(shape, axes, rank=r) for r in range(size)]
            cover = np.zeros(shape, int)
            for s in sl:
                cover[s] += 1
            assert (cover == 1).all()  # the blocks tile the array exactly once
            for i, a in enumerate(axes):
                lengths = sorted({s[a].stop - s[a].start for s in sl}, reverse=True)
                assert lengths[0] - lengths[-1] <= 1 and len(lengths) <= 2
                first = grid.block(shape, axes, rank=grid.cart.Get_cart_rank(
                    [0] * grid.ndim))[a]
                assert first.stop - first.start == -(-shape[a] // grid.dims[i])
            np.testing.assert_array_equal(grid.gather(grid.local(A, axes), shape, axes), A)
        with pytest.raises(ValueError, match=r"ProcessGrid.block: 'axes' must name 2"):
            grid.block(shape, (0,))
    finally:
        grid.free()
