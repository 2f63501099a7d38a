"""Derivatives of the nonlinear reductions (MAX, MIN, PROD of allreduce, reduce, scan,
exscan and reduce_scatter): exact against a single-process reference, adjoint-consistent,
with ties and zeros, and O(n) per rank in what XLA compiles. Also run at 8 ranks
(tests/test_multirank.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import _ops

from helpers import BF16, WORLD, gdot, normal, rng

rank, size = WORLD.rank, WORLD.size
last = size - 1

OPS = {
    "allreduce": lambda v, op: vjpmpi.allreduce(v, op),
    "reduce": lambda v, op: vjpmpi.reduce(v, op, last),
    "scan": lambda v, op: vjpmpi.scan(v, op),
    "exscan": lambda v, op: vjpmpi.exscan(v, op),
    "reduce_scatter": lambda v, op: vjpmpi.reduce_scatter(v, op),
}
NONLINEAR = [f"{name}_{red}" for red in ("MAX", "MIN", "PROD") for name in OPS]


def _nl(name):
    op, red = name.rsplit("_", 1)
    shape = (size, 3) if op == "reduce_scatter" else (5,)
    return (lambda v: OPS[op](v, getattr(MPI, red))), shape


def reference(name, stack, r=rank):
    """Rank `r`'s result of `name` from every rank's input (stack[q]), in jnp: its
    derivative is the reference (jnp's max/min split ties equally, its prod is exact
    with zeros)."""
    op, red = name.rsplit("_", 1)
    fold = {"MAX": lambda a: a.max(0), "MIN": lambda a: a.min(0), "PROD": lambda a: a.prod(0)}[red]
    if op == "allreduce":
        return fold(stack)
    if op == "reduce":
        return fold(stack) if r == last else stack[r]
    if op == "scan":
        return fold(stack[: r + 1])
    if op == "exscan":  # rank 0 holds the identity, a constant
        return fold(stack[:r]) if r else jnp.zeros_like(stack[0])
    return fold(stack)[r]  # reduce_scatter


def stacked(a):
    return jnp.asarray(np.stack(WORLD.allgather(np.asarray(a))))


def tied(shape, salt):
    """Small integers: many ties between ranks and many zeros."""
    return jnp.asarray(rng(salt).integers(-2, 3, shape).astype(np.float64))


def cotangent(name, shape, salt):
    w = normal(shape, salt)
    if name.startswith("exscan") and rank == 0:
        w = jnp.zeros_like(w)  # rank 0 holds the identity (+-inf for MAX/MIN): constant
    return w


# ------------------------------------------------------------- exactness --
@pytest.mark.parametrize("name", NONLINEAR)
def test_nonlinear_jvp_vjp_agree_and_match_finite_differences(name):
    f, shape = _nl(name)
    x = normal(shape, 4)
    if name.endswith("PROD"):
        x = x.at[0].set(0.0) if rank == 0 else x  # a zero factor: no division allowed
    w = cotangent(name, jax.eval_shape(f, x).shape, 5)
    d = normal(shape, 6)
    y, jv = jax.jit(lambda a, b: jax.jvp(f, (a,), (b,)))(x, d)
    _, vjp = jax.vjp(f, x)
    (xt,) = vjp(w)
    assert abs(gdot(jv, w) - gdot(d, xt)) <= 1e-12 * max(1.0, abs(gdot(jv, w)))
    eps = 1e-6
    fin = lambda y: jnp.where(jnp.isfinite(y), y, 0.0)  # noqa: E731
    fd = (gdot(fin(f(x + eps * d)), w) - gdot(fin(f(x - eps * d)), w)) / (2 * eps)
    assert abs(fd - gdot(d, xt)) <= 1e-6 * max(1.0, abs(fd)), (fd, gdot(d, xt))


@pytest.mark.parametrize("name", NONLINEAR)
def test_ties_and_zeros_match_the_single_process_derivative(name):
    f, shape = _nl(name)
    x, d = tied(shape, 7), normal(shape, 8)
    y, jv = jax.jit(lambda a, b: jax.jvp(f, (a,), (b,)))(x, d)
    want_y, want = jax.jvp(lambda s: reference(name, s), (stacked(x),), (stacked(d),))
    if not name.startswith("exscan") or rank:
        np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(jv, want, rtol=1e-13, atol=1e-13)
    # reverse mode: the transpose of that JVP, checked by the dot test and against
    # the reference's own gradient of the summed objective
    w = cotangent(name, y.shape, 9)
    (xt,) = jax.jit(lambda a, c: jax.vjp(f, a)[1](c))(x, w)
    assert abs(gdot(jv, w) - gdot(d, xt)) <= 1e-12 * max(1.0, abs(gdot(jv, w)))
    ws = stacked(w)
    all_grads = jax.grad(lambda s: sum(jnp.vdot(reference(name, s, r), ws[r])
                                       for r in range(size)))(stacked(x))
    np.testing.assert_allclose(xt, all_grads[rank], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("op", ["allreduce", "reduce", "scan", "exscan", "reduce_scatter"])
def test_ties_split_equally_between_the_tied_ranks(op):
    # every rank holds the same values: each result is tied between all the ranks it
    # reduces, so its tangent is the mean of their tangents
    shape = (size, 4) if op == "reduce_scatter" else (4,)
    x = jnp.asarray(np.linspace(-1.0, 2.0, int(np.prod(shape))).reshape(shape))
    t = normal(shape, 10)
    ts = np.stack(WORLD.allgather(np.asarray(t)))
    want = {
        "allreduce": ts.mean(0),
        "reduce": ts.mean(0) if rank == last else ts[rank],
        "scan": ts[: rank + 1].mean(0),
        "exscan": ts[:rank].mean(0) if rank else np.zeros(shape),
        "reduce_scatter": ts.mean(0)[rank] if op == "reduce_scatter" else None,
    }[op]
    for red in (MPI.MAX, MPI.MIN):
        _, jv = jax.jvp(lambda v: OPS[op](v, red), (x,), (t,))
        np.testing.assert_allclose(jv, want, rtol=1e-13, atol=1e-15)


def test_max_ties_split_equally():
    x = jnp.array([1.0, float(rank), 5.0 if rank < 2 else 0.0])
    g = jax.grad(lambda v: jnp.sum(vjpmpi.allreduce(v, MPI.MAX)))(x)
    # the objective summed over ranks is size * sum(max); ties share the derivative
    n_tied = min(size, 2)
    expected = [1.0, size if rank == size - 1 else 0.0, size / n_tied if rank < 2 else 0.0]
    np.testing.assert_allclose(g, expected, rtol=1e-14)
    g = jax.grad(lambda v: jnp.sum(vjpmpi.allreduce(-v, MPI.MIN)))(x)
    np.testing.assert_allclose(g, -np.asarray(expected), rtol=1e-14)


def test_prod_gradient_with_zeros():
    rows = np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [4.0, 7.0, 0.5], [1.5, 2.0, 2.0]])
    vals = np.array([rows[r] if r < 4 else [1.25, 0.5 + r, 1.0 - 0.1 * r] for r in range(size)])
    x = jnp.asarray(vals[rank])
    g = jax.grad(lambda v: jnp.sum(vjpmpi.allreduce(v, MPI.PROD)))(x)
    others = np.prod(np.delete(vals, rank, axis=0), axis=0)
    np.testing.assert_allclose(g, size * others, rtol=1e-14)
    assert np.all(np.isfinite(g))


def test_prod_derivative_needs_no_division():
    # every rank holds a with a**size = inf but a**(size - 1) finite: the product
    # overflows while every "product of the others" is finite; a derivative computed
    # as product / x_r would be inf
    a = 1e300 ** (1 / max(size - 1, 1))
    x = jnp.full(3, a)
    g = jax.grad(lambda v: jnp.sum(vjpmpi.allreduce(v, MPI.PROD)))(x)
    assert size == 1 or a ** (size - 1) * a == float("inf")
    np.testing.assert_allclose(g, np.full(3, size * a ** (size - 1)), rtol=1e-13)


def test_integer_inputs_have_float0_tangents():
    x = jnp.arange(3)
    for op in (MPI.BAND, MPI.MAX, MPI.PROD):
        y, t = jax.jvp(lambda v: vjpmpi.allreduce(v, op), (x,), (np.zeros(3, jax.dtypes.float0),))
        assert t.dtype == jax.dtypes.float0
    y, t = jax.jvp(lambda v: vjpmpi.scan(v, MPI.MAX), (x,), (np.zeros(3, jax.dtypes.float0),))
    assert t.dtype == jax.dtypes.float0
    np.testing.assert_array_equal(y, np.arange(3))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64", "complex128"])
def test_other_dtypes(dtype):
    """float16/bfloat16/float32 MAX and PROD, complex PROD, against the float64 /
    complex128 reference within the dtype's rounding."""
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    eps = float(jnp.finfo(dt).eps)
    reds = ["PROD"] if dt.kind == "c" else ["MAX", "PROD"]
    for name in [f"{op}_{red}" for op in ("allreduce", "scan", "exscan") for red in reds]:
        f, shape = _nl(name)
        x = normal(shape, 11) * 0.5 + 1.0
        t = normal(shape, 12)
        if dt.kind == "c":
            x, t = x + 0.5j * normal(shape, 13), t - 1j * normal(shape, 14)
        x, t = x.astype(dt), t.astype(dt)
        _, jv = jax.jvp(f, (x,), (t,))
        assert jv.dtype == dt
        wide = jnp.complex128 if dt.kind == "c" else jnp.float64
        _, want = jax.jvp(lambda s: reference(name, s), (stacked(x.astype(wide)),),
                          (stacked(t.astype(wide)),))
        # each term of the tangent is a product of up to `size` roundings, and up to
        # `size` terms are summed: bounded by 4 * size * eps * (the same on |x|, |t|)
        _, scale = jax.jvp(lambda s: reference(name, s), (stacked(abs(x.astype(wide))),),
                           (stacked(abs(t.astype(wide))),))
        err = np.abs(np.asarray(jv.astype(wide)) - np.asarray(want))
        assert np.all(err <= 4 * size * eps * np.abs(np.asarray(scale)) + 1e-300), (name, err)


# ------------------------------------------------- O(n) in what XLA runs --
_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16|c\d+)\[([\d,]*)\]")
_ALLGATHER = re.compile(r'^.*custom_call_target="vjpmpi_allgather".*$', re.M)


def _largest_buffer(hlo):
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in _SHAPE.findall(hlo))


@pytest.mark.parametrize("name", NONLINEAR)
def test_derivative_memory_and_traffic_do_not_grow_with_ranks(name):
    """What XLA compiles for jvp and value_and_grad holds no buffer larger than the
    op's own input or output, and no allgather, except the allgather that reduce_scatter
    needs anyway (its adjoint), of the input's size."""
    f, shape = _nl(name)
    x = normal(shape, 15)
    y = jax.eval_shape(f, x)
    bound = max(x.size, y.size)
    programs = {
        "jvp": jax.jit(lambda a, b: jax.jvp(f, (a,), (b,))).lower(x, x),
        "value_and_grad": jax.jit(jax.value_and_grad(lambda a: jnp.sum(f(a) ** 2))).lower(x),
    }
    for what, lowered in programs.items():
        hlo = lowered.compile().as_text()
        assert "vjpmpi_" in hlo
        assert _largest_buffer(hlo) <= bound, (what, _largest_buffer(hlo), bound)
        gathers = _ALLGATHER.findall(hlo)
        if name.startswith("reduce_scatter"):
            assert all(_largest_buffer(g) <= bound for g in gathers), (what, gathers)
        else:
            assert not gathers, (what, gathers)


# ------------------------------------------------------------ transforms --
def test_vmap_of_grad_nonlinear():
    for name in ("allreduce_MAX", "scan_MIN", "exscan_PROD"):
        f, shape = _nl(name)
        xs = normal((4, *shape), 14)
        loss = lambda v: jnp.sum(f(v) ** 2)  # noqa: E731
        g = jax.vmap(jax.grad(loss))(xs)
        for i in range(4):
            np.testing.assert_allclose(g[i], jax.grad(loss)(xs[i]), rtol=1e-13, err_msg=name)


@pytest.mark.parametrize("op", list(OPS))
def test_second_order_prod(op):
    """Hessian-vector products of PROD losses (the derivative's own derivative, through
    the recurrence and the reversed exscan) against central differences of the gradient."""
    f, shape = _nl(f"{op}_PROD")
    x = normal(shape, 16) * 0.3 + 1.0
    v = normal(shape, 17)
    loss = lambda a: jnp.sum(f(a) ** 2)  # noqa: E731
    g = jax.grad(loss)
    hv = jax.jit(lambda a, b: jax.jvp(g, (a,), (b,))[1])(x, v)
    eps = 1e-5
    fd = (g(x + eps * v) - g(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(hv, fd, rtol=1e-6, atol=1e-8)


def test_rank_dependent_use_of_the_result():
    """Only even ranks use the results; every rank still runs every backward collective."""
    names = ["allreduce_MAX", "scan_PROD", "exscan_MIN", "reduce_PROD"]

    def uses(r):
        return r % 2 == 0

    def loss(v):
        total = jnp.sum(v) * 0.25
        for i, name in enumerate(names):
            y = _nl(name)[0](v * (1 + 0.1 * i))
            if uses(rank):
                total = total + jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) * jnp.arange(5))
        return total

    def global_loss(stack):
        out = jnp.sum(stack) * 0.25
        for i, name in enumerate(names):
            for r in filter(uses, range(size)):
                out = out + jnp.sum(reference(name, stack * (1 + 0.1 * i), r) * jnp.arange(5))
        return out

    x = tied(5, 18) * 0.5 + normal(5, 19) * 0.01
    g = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(g, jax.grad(global_loss)(stacked(x))[rank], rtol=1e-12, atol=1e-12)


def test_checkpoint_and_loop_of_nonlinear_reductions():
    def step(c, _):
        return vjpmpi.scan(jnp.tanh(c), MPI.MAX) + 0.5 * vjpmpi.allreduce(c, MPI.PROD) * 0.1, None

    def run(v, remat):
        body = jax.checkpoint(step) if remat else step
        return jnp.sum(jax.lax.scan(body, v, None, length=3)[0] ** 2)

    x = normal(4, 20) * 0.5 + 1.0
    g_plain = jax.jit(jax.grad(lambda v: run(v, False)))(x)
    g_remat = jax.jit(jax.grad(lambda v: run(v, True)))(x)
    np.testing.assert_allclose(g_remat, g_plain, rtol=1e-13)
    d = normal(4, 21)
    eps = 1e-6
    fd = (gdot(jnp.ones(()), run(x + eps * d, False)) - gdot(jnp.ones(()), run(x - eps * d, False)))
    assert abs(fd / (2 * eps) - gdot(g_plain, d)) <= 1e-6 * max(1.0, abs(fd / (2 * eps)))


# ------------------------------------------------ the recurrence kernel --
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64",
                                   "complex128"])
def test_recurrence_matches_numpy(dtype, reverse):
    """e_s = sum over the ranks q before s (rank order, or from the last rank down) of
    b_q prod_{q < r < s} a_r, element-wise; 0 on the first rank."""
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    gen = rng(22)  # small integers, |a| <= 1: every partial result exact in every dtype
    a = gen.integers(-1, 2, 6).astype(dt)
    b = gen.integers(-3, 4, 6).astype(dt)
    if dt.kind == "c":
        a = (a + 1j * gen.integers(-1, 2, 6) * (np.abs(a) == 0)).astype(dt)
        b = (b - 1j * gen.integers(-2, 3, 6)).astype(dt)
    name = "recurrence_reversed" if reverse else "recurrence"
    comm = vjpmpi._mpi.as_comm(None, "test")
    (e,) = jax.jit(lambda u, v: _ops.PRIMITIVES[name].bind(u, v, comm=comm))(a, b)
    As = np.stack(WORLD.allgather(a)).astype(np.complex128)
    Bs = np.stack(WORLD.allgather(b)).astype(np.complex128)
    order = list(range(size))[::-1] if reverse else list(range(size))
    here = order.index(rank)
    want = np.zeros(6, np.complex128)
    for i in range(here):  # small integers: exact in every dtype
        want = want * As[order[i]] + Bs[order[i]] if i else Bs[order[i]].copy()
    np.testing.assert_array_equal(np.asarray(e).astype(np.complex128),
                                  want if dt.kind == "c" else want.real)


# ----------------------------------------- the others-product kernel --
@pytest.mark.parametrize("dtype, n", [(d, 7) for d in ("float16", "bfloat16", "float32", "float64",
                                                       "complex64", "complex128")]
                         + [("float64", (4 << 20) // 8 + 5)])  # two 4 MiB blocks
def test_others_product_matches_numpy(dtype, n):
    """prod over the ranks r != this one of x_r, element-wise, zeros included (the
    derivative of allreduce/reduce/reduce_scatter PROD); exact on small integers."""
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    gen = rng(23)
    x = gen.integers(-2, 3, n).astype(dt)
    if dt.kind == "c":
        x = (x + 1j * gen.integers(-1, 2, n)).astype(dt)
    comm = vjpmpi._mpi.as_comm(None, "test")
    (got,) = jax.jit(lambda v: _ops.PRIMITIVES["others_product"].bind(v, comm=comm))(x)
    xs = np.stack(WORLD.allgather(x)).astype(np.complex128)
    want = np.prod(np.delete(xs, rank, axis=0), axis=0)
    np.testing.assert_array_equal(np.asarray(got).astype(np.complex128),
                                  want if dt.kind == "c" else want.real)
