"""vjpmpi.fft: every rank's block equals the slice of numpy.fft on the global array, the
transposes pass dot tests, and grad/jvp/vmap/jit match the single-process derivatives.

Cost: each transform program is compiled once per layout and shared by the tests that
run it (`compiled`); the single-process references are NumPy (np.fft, and the
transposes and derivatives written out with it), never eager JAX on the global array."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import fft as vfft

from helpers import WORLD, compiled, forget
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

# One process grid per layout for the whole module (the compiled programs below hold
# its communicators), made on first use and freed at the end, in the same order on
# every rank (both are collective).
_GRIDS = {}
def make_layout(name):
    dims, cshape, rshape = LAYOUTS[name]
    if name not in _GRIDS:
        _GRIDS[name] = vjpmpi.ProcessGrid.create(len(dims()), WORLD, dims=dims())
    return name, _GRIDS[name], cshape, rshape


@pytest.fixture(scope="module", autouse=True)
def _free_grids():
    yield
    forget("fft")
    for grid in _GRIDS.values():
        grid.free()
    _GRIDS.clear()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    return make_layout(request.param)


# grad/jvp/vmap and dtypes: the two layouts whose half spectrum splits (unevenly)
@pytest.fixture(scope="module", params=["slab-2d", "pencil-3d"])
def split_layout(request):
    return make_layout(request.param)


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


def local(grid, X, axes):
    """This rank's block of X as a NumPy array: what the compiled programs take (a
    `grid.local` JAX array costs a compile per shape and dtype here, `jnp.asarray`
    staging it)."""
    return np.asarray(X)[grid.block(np.shape(X), axes)]


def allsum(v):
    """Sum of a scalar over all ranks (the global inner product of distributed arrays)."""
    return WORLD.allreduce(complex(v))


def padded(half_spectrum, shape):
    """The half spectrum in a full spectrum of `shape`, zeros in the other half."""
    out = np.zeros(shape, np.result_type(half_spectrum, np.complex128))
    out[..., : half_spectrum.shape[-1]] = half_spectrum
    return out


# The transposes, in NumPy (JAX's convention: <f(x), y> == <x, f^T(y)>, bilinear, its
# real part where f is only real-linear). The DFT matrix is symmetric, so fftn and
# ifftn are their own transposes; rfftn is the full fftn of real input, then a slice;
# irfftn's transpose weighs the frequencies its output counts twice by 2.
def rfftn_transpose(y, shape):
    return np.fft.fftn(padded(y, shape)).real


def irfftn_transpose(y):
    n, m = y.shape[-1], y.shape[-1] // 2 + 1
    weight = np.full(m, 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0  # the Nyquist frequency
    return np.conj(weight * np.fft.rfftn(y) / y.size)


def four_transforms(grid, rshape, norm=None, transposed=True):
    """The program that every test of a layout shares: fftn, ifftn, rfftn and irfftn,
    each of its own input."""
    n = rshape[-1]

    def program(x, k, r, h):
        kw = dict(norm=norm, transposed=transposed)
        return (vfft.fftn(x, grid, **kw), vfft.ifftn(k, grid, **kw), vfft.rfftn(r, grid, **kw),
                vfft.irfftn(h, grid, n=n, **kw))
    return program


@pytest.mark.parametrize("transposed,norm", [(True, None), (False, "ortho"), (True, "forward")],
                         ids=["spectral", "physical-ortho", "spectral-forward"])
def test_matches_numpy(layout, transposed, norm):
    name, grid, cshape, rshape = layout
    out_axes = spec(grid) if transposed else phys(grid)
    X, K = rand(cshape, 1), rand(cshape, 2)
    R, H = rand(rshape, 3, False), rand(half(rshape), 4)
    x, K_, r, H_ = (local(grid, X, phys(grid)), local(grid, K, out_axes),
                    local(grid, R, phys(grid)), local(grid, H, out_axes))
    run = compiled(("fft", "transforms", name, transposed, norm),
                   four_transforms(grid, rshape, norm, transposed), x, K_, r, H_)
    k, x_of_K, h, r_of_H = run(x, K_, r, H_)
    close(grid.gather(k, cshape, out_axes), np.fft.fftn(X, norm=norm))
    close(grid.gather(x_of_K, cshape, phys(grid)), np.fft.ifftn(K, norm=norm))
    close(grid.gather(h, half(rshape), out_axes), np.fft.rfftn(R, norm=norm))
    close(grid.gather(r_of_H, rshape, phys(grid)),
          np.fft.irfftn(H, s=rshape, axes=range(len(rshape)), norm=norm))
    # round trips, in this rank's blocks: the same program's inverses of k and h
    _, x_back, _, r_back = run(x, k, r, h)
    close(x_back, x)
    close(r_back, r)


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
    map is only real-linear), and f^T equals the single-process transpose (NumPy)."""
    name, grid, cshape, rshape = layout
    global_transposes = {"fftn": np.fft.fftn, "ifftn": np.fft.ifftn,
                         "rfftn": lambda y: rfftn_transpose(y, rshape),
                         "irfftn": irfftn_transpose}
    fns = transforms(grid, cshape, rshape)
    Xs = [rand(shape, 10 + i, cplx) for i, (_, _, shape, cplx, *_) in enumerate(fns)]
    Ys = [rand(oshape, 20 + i, fname != "irfftn") for i, (fname, *_, oshape) in enumerate(fns)]
    xs = [local(grid, X, f[4]) for X, f in zip(Xs, fns, strict=True)]
    ys = [local(grid, Y, f[5]) for Y, f in zip(Ys, fns, strict=True)]
    # the forward transforms: the program test_matches_numpy[spectral] runs
    forward = compiled(("fft", "transforms", name, True, None), four_transforms(grid, rshape),
                       *xs)
    fxs = forward(*xs)[:4]
    # their transposes, in one program (jax.linear_transpose traced inside it: outside
    # a trace it would compile each jitted piece of the transform it partially evaluates)
    def transposes(*ys):
        return [jax.linear_transpose(f[1], jax.ShapeDtypeStruct(x.shape, x.dtype))(y)[0]
                for f, x, y in zip(fns, xs, ys, strict=True)]
    ft_ys = compiled(("fft", "transposes", name), transposes, *ys)(*ys)
    for i, (fname, f, shape, cplx, in_axes, out_axes, oshape) in enumerate(fns):
        x, y, fx, ft_y = (np.asarray(v) for v in (xs[i], ys[i], fxs[i], ft_ys[i]))
        lhs, rhs = allsum(np.sum(fx * y)), allsum(np.sum(x * ft_y))
        if fname in ("rfftn", "irfftn"):
            lhs, rhs = lhs.real, rhs.real
        assert abs(lhs - rhs) <= TOL * max(1.0, abs(lhs)), (fname, lhs, rhs)
        close(grid.gather(ft_y, shape, in_axes), global_transposes[fname](Ys[i]))


def test_grad_jvp_vmap(split_layout):
    """A real loss of the spectrum: grad and jvp equal the single-process derivatives
    on the global array (NumPy: the gradient of sum(W |rfftn(r)|^2) is
    2 Re fftn(W conj(rfftn(r)), zero-padded to the full spectrum)); vmap over a batch
    equals the transform of each member."""
    name, grid, cshape, rshape = split_layout
    W_ = rand(half(rshape), 30, False)
    R, T = rand(rshape, 31, False), rand(rshape, 32, False)
    H = np.fft.rfftn(R)
    value_global = np.sum(W_ * np.abs(H) ** 2)
    grad_global = 2 * np.fft.fftn(padded(W_ * np.conj(H), rshape)).real
    jvp_global = 2 * np.sum(W_ * np.real(np.conj(H) * np.fft.rfftn(T)))

    w = local(grid, W_, spec(grid))

    def loss(r):  # the same scalar on every rank
        return vjpmpi.sum_replicated(jnp.sum(w * jnp.abs(vfft.rfftn(r, grid)) ** 2), comm=grid.cart)

    def program(r, t, xs):  # grad, jvp and vmap: one program
        return (jax.value_and_grad(loss)(r), jax.jvp(loss, (r,), (t,)),
                jax.vmap(lambda x: vfft.fftn(x, grid))(xs))

    r, t = local(grid, R, phys(grid)), local(grid, T, phys(grid))
    X = np.stack([rand(cshape, 33), rand(cshape, 34)])
    xs = np.stack([local(grid, v, phys(grid)) for v in X])
    run = compiled(("fft", "grad_jvp_vmap", name), program, r, t, xs)
    (value, g), (primal, tangent), ks = run(r, t, xs)
    close(value, value_global)
    close(grid.gather(g, rshape, phys(grid)), grad_global)
    close(primal, value_global)
    close(tangent, jvp_global)

    ks = np.asarray(ks)
    for b in range(2):
        close(grid.gather(ks[b], cshape, spec(grid)), np.fft.fftn(X[b]))


def test_dtypes(split_layout):
    """float32/complex64 in, complex64 out (at float32 accuracy); float64 promotes to
    complex128. (One compiled program of the four calls.)"""
    name, grid, cshape, rshape = split_layout
    X = rand(cshape, 40)
    R = rand(rshape, 41, False)

    def program(x32, r32, x64):
        h = vfft.rfftn(r32, grid)
        return (vfft.fftn(x32, grid), h, vfft.irfftn(h, grid, n=rshape[-1]),
                vfft.fftn(x64, grid))

    args = (local(grid, X, phys(grid)).astype(np.complex64),
            local(grid, R, phys(grid)).astype(np.float32), local(grid, X.real, phys(grid)))
    k, h, r, k64 = compiled(("fft", "dtypes", name), program, *args)(*args)
    assert k.dtype == jnp.complex64
    close(grid.gather(k, cshape, spec(grid)), np.fft.fftn(X.astype(np.complex64)), 1e-5)
    assert h.dtype == jnp.complex64
    H32 = grid.gather(h, half(rshape), spec(grid))
    close(H32, np.fft.rfftn(R), 1e-5)
    assert r.dtype == jnp.float32
    # its values: numpy's inverse of the half spectrum it got, and the round trip to R
    close(grid.gather(r, rshape, phys(grid)),
          np.fft.irfftn(H32.astype(np.complex128), s=rshape, axes=range(len(rshape))), 1e-5)
    close(r, local(grid, R, phys(grid)), 1e-5)
    assert k64.dtype == jnp.complex128
    close(grid.gather(k64, cshape, spec(grid)), np.fft.fftn(X.real))


def test_rank_dependent_use_and_compiled_order():
    """Rank 0's loss uses the spectrum, the others' do not: the backward transposes still
    run on every rank (no hang) and the gradient equals the global one. What XLA compiles
    holds the collectives in program order: the agreement on the global shape, forward
    transposes, then their adjoints."""
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        shape = (12, 12, 6)
        X = rand(shape, 50, False)
        W_ = rand(shape, 51, False)
        mine = grid.block(shape, spec(grid), rank=0)  # the block rank 0 holds

        # rank 0's term sum(W |fftn(x)|^2) over its block, plus every other rank's sum(x)
        # of its block; the first term's gradient is 2 Re fftn(W conj(fftn(x))) (the DFT
        # matrix is symmetric), W zero outside rank 0's block
        K = np.fft.fftn(X)
        W0 = np.zeros(shape)
        W0[mine] = W_[mine]
        others = np.zeros(shape)
        for q in range(1, size):
            others[grid.block(shape, phys(grid), rank=q)] = 1.0
        value_global = np.sum(W0 * np.abs(K) ** 2) + np.sum(X * others)
        grad_global = 2 * np.fft.fftn(W0 * np.conj(K)).real + others

        w = local(grid, W_, spec(grid))

        def loss(x):
            k = vfft.fftn(x, grid)
            mine_ = jnp.sum(w * jnp.abs(k) ** 2) if WORLD.rank == 0 else jnp.sum(x)
            return vjpmpi.sum_replicated(mine_, comm=grid.cart)

        x = local(grid, X, phys(grid))
        f = jax.jit(jax.value_and_grad(loss)).lower(x).compile()  # run and read: one compile
        value, g = f(x)
        close(value, value_global)
        close(grid.gather(g, shape, phys(grid)), grad_global)

        compiled = f.as_text()
        assert_ordered(compiled)
        steps = ["alltoall"] * sum(d > 1 for d in grid.dims)  # one per split grid dim
        # the ranks' agreement on the global shape (no data), forward transposes, the
        # loss's allreduce, then the adjoint transposes and the agreement's transpose
        agree = ["agree"] if size > 1 else []
        assert collective_sequence(compiled) == agree + steps + ["allreduce"] + steps + agree
    finally:
        grid.free()


def zeros(shape, dtype=np.float64):
    """A JAX array of zeros made without a compile (jnp.zeros compiles a broadcast per
    shape and dtype)."""
    return jax.device_put(np.zeros(shape, dtype))


def test_errors_name_the_op_and_argument():
    slab = WORLD
    with pytest.raises(ValueError, match=r"fft\.fftn: argument 'shape' must be the global "
                       r"shape of the input, 2 positive ints, got \(4,\)"):
        vfft.fftn(zeros((3, 4)), slab, shape=(4,))
    with pytest.raises(ValueError, match=r"fft\.fftn: argument 'x' has shape \(4,\)"):
        vfft.fftn(zeros(4), slab)
    with pytest.raises(TypeError, match=r"fft\.rfftn: argument 'x' has dtype complex"):
        vfft.rfftn(zeros((4, 4), jnp.complex128), slab)
    with pytest.raises(TypeError, match=r"fft\.fftn: argument 'x' has dtype int32"):
        vfft.fftn(zeros((4, 4), jnp.int32), slab)
    with pytest.raises(ValueError, match=r"fft\.ifftn: argument 'norm'"):
        vfft.ifftn(zeros((4, 4), jnp.complex128), slab, norm="unitary")
    with pytest.raises(TypeError, match=r"fft\.fftn: argument 'grid' must be"):
        vfft.fftn(zeros((4, 4)), "world")
    cart = WORLD.Create_cart(MPI.Compute_dims(size, 2))
    try:
        with pytest.raises(TypeError, match=r"fft\.fftn: argument 'grid' is a 2-D Cartesian"):
            vfft.fftn(zeros((4, 4, 4)), cart)
    finally:
        cart.Free()
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        with pytest.raises(ValueError, match=r"fft\.fftn: .* 2-D process grid needs at least 3"):
            vfft.fftn(zeros((4, 4)), grid)
        with pytest.raises(ValueError, match=r"fft\.irfftn: argument 'n' .* is needed"):
            vfft.irfftn(zeros((12, 12 // grid.dims[0], 3), jnp.complex128), grid)
    finally:
        grid.free()
    with pytest.raises(ValueError, match=r"fft\.irfftn: argument 'n'=7 needs 4"):
        vfft.irfftn(zeros((4, 3), jnp.complex128), slab, n=7, transposed=False)


def test_uneven_blocks_need_the_global_shape():
    """Blocks of unequal sizes (ProcessGrid.local of an array the grid does not divide):
    with `shape` every transform equals NumPy's; without it each rank would infer another
    global shape from its own block, and the ranks raise together before any data moves,
    each rank's view in the message (they used to return wrong shapes, or the right shape
    with wrong values); a rank whose block is not its block of `shape` fails them all."""
    if size == 1:
        pytest.skip("one rank holds the whole array")
    grid = vjpmpi.ProcessGrid.create(2, WORLD)
    try:
        shape = (2 * grid.dims[0] + 1, 2 * grid.dims[1] + 1, 4)  # neither split axis even
        X = rand(shape, 70)
        x = local(grid, X, phys(grid))
        k = vfft.fftn(x, grid, shape=shape)
        K = np.fft.fftn(X)
        close(grid.gather(k, shape, spec(grid)), K)
        close(grid.gather(vfft.ifftn(k, grid, shape=shape), shape, phys(grid)), X)
        R = X.real
        h = vfft.rfftn(local(grid, R, phys(grid)), grid, shape=shape)
        close(grid.gather(h, half(shape), spec(grid)), np.fft.rfftn(R))
        back = vfft.irfftn(h, grid, n=shape[-1], shape=half(shape))
        close(grid.gather(back, shape, phys(grid)), R)

        with pytest.raises(Exception) as info:  # without `shape`: every rank raises
            jax.block_until_ready(vfft.fftn(x, grid))
        text = str(info.value)
        assert re.search(r"vjpmpi: (the ranks disagree|collective mismatch "
                         r"\(VJPMPI_CHECK\)) on a communicator of \d+ ranks .*: the arguments "
                         r"differ",
                         text), text
        for r in range(size):  # each rank's inferred global shape, and its block
            block = tuple(s_.stop - s_.start for s_ in grid.block(shape, phys(grid), rank=r))
            inferred = (block[0] * grid.dims[0], block[1] * grid.dims[1], block[2])
            assert (f"\n  rank {r}: vjpmpi.fft.fftn: global shape {inferred}, from this rank's "
                    f"block {block}") in text, text

        # a block that is not this rank's block of `shape` (on the ranks of grid row 0; a
        # shape not run before, so every rank compares: see test_agreement.py)
        shape2 = (shape[0] + grid.dims[0], *shape[1:])
        x2 = local(grid, rand(shape2, 71), phys(grid))
        wrong = x2[:-1] if grid.coords[0] == 0 else x2
        with pytest.raises(Exception) as info:
            jax.block_until_ready(vfft.fftn(wrong, grid, shape=shape2))
        assert re.search(r"vjpmpi\.fft\.fftn: argument 'x' on rank 0 has shape \(\d+, \d+, 4\), "
                         rf"but its block of the global shape \({shape2[0]}, {shape2[1]}, 4\) "
                         r"\(argument 'shape'\)", str(info.value)), str(info.value)
        assert "alone can check it" in str(info.value)
    finally:
        grid.free()


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
