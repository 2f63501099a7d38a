"""Derivatives of the nonlinear reductions (MAX, MIN, PROD of allreduce, reduce, scan,
exscan and reduce_scatter): exact against a single-process reference, adjoint-consistent,
with ties and zeros, and O(n) per rank in what XLA compiles. Also run at 8 ranks
(tests/test_multirank.py).

Cost: each op's derivatives (jvp, vjp, value_and_grad) are one program, compiled once
(`derivatives`) and shared by the tests that run or inspect it; the single-process
reference and its derivatives are NumPy (`reference`; in jnp, eager, every op on a new
shape was a compile of its own); test data is NumPy (a `jnp.asarray` of it stages, a
compile per shape)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import _primitive

from helpers import BF16, WORLD, compiled, gdot, normal, rng

rank, size = WORLD.rank, WORLD.size
last = size - 1
# work that does not change past 4 ranks (dtype coverage, vmap, checkpoint, second
# derivatives): left out of the 8-rank job (tests/test_multirank.py)
NARROW = pytest.mark.narrow

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


def _contributors(name, r):
    """The ranks whose inputs rank `r`'s result of `name` reduces (none for exscan's
    rank 0, which holds the identity, a constant)."""
    op = name.rsplit("_", 1)[0]
    return {"allreduce": range(size), "reduce": range(size) if r == last else [r],
            "scan": range(r + 1), "exscan": range(r), "reduce_scatter": range(size)}[op]


def _part(name, stack, r):
    """Each rank's part of rank `r`'s result: its block `r` for reduce_scatter."""
    return stack[:, r] if name.startswith("reduce_scatter") else stack


def reference(name, stack, r=rank):
    """Rank `r`'s result of `name` from every rank's input (stack[q]), and its derivative,
    in NumPy: (y, dy) with dy[q] = dy / d_part(stack)[q], element-wise. MAX/MIN: the
    ranks attaining the result share the derivative equally (ties split equally); PROD:
    the product of the other ranks' values (exact with zeros, no division). None for
    exscan's rank 0 (the identity, a constant)."""
    ranks = list(_contributors(name, r))
    if not ranks:
        return None
    part = _part(name, np.asarray(stack), r)
    xs = part[ranks]
    if name.endswith("PROD"):
        y = np.prod(xs, axis=0)
        d = np.stack([np.prod(np.delete(xs, i, axis=0), axis=0) for i in range(len(ranks))])
    else:
        y = xs.max(0) if name.endswith("MAX") else xs.min(0)
        hit = xs == y
        d = hit / hit.sum(0)
    dy = np.zeros(part.shape, d.dtype)
    dy[ranks] = d
    return y, dy


def reference_jvp(name, stack, tangents, r=rank):
    """(y, its tangent) of rank `r`'s result, from every rank's input and tangent."""
    y, dy = reference(name, stack, r)
    return y, np.sum(dy * _part(name, np.asarray(tangents), r), axis=0)


def reference_grad(name, stack, cotangents):
    """The gradient with respect to every rank's input (the stack) of sum_r <y_r, w_r>,
    the objective summed over ranks, w_r rank r's cotangent (real)."""
    stack = np.asarray(stack)
    grad = np.zeros(stack.shape, np.result_type(stack, cotangents[0]))
    for r in range(size):
        if reference(name, stack, r) is not None:
            _part(name, grad, r)[...] += cotangents[r] * reference(name, stack, r)[1]
    return grad


def stacked(a):
    """Every rank's `a`, stacked in rank order (NumPy, on every rank)."""
    return np.stack(WORLD.allgather(np.asarray(a)))


def npnormal(shape, salt=0):
    """helpers.normal's values, as a NumPy array."""
    return rng(salt).standard_normal(shape)


def tied(shape, salt):
    """Small integers: many ties between ranks and many zeros."""
    return rng(salt).integers(-2, 3, shape).astype(np.float64)


def cotangent(name, shape, salt):
    w = npnormal(shape, salt)
    if name.startswith("exscan") and rank == 0:
        w = np.zeros_like(w)  # rank 0 holds the identity (+-inf for MAX/MIN): constant
    return w


def derivatives(name):
    """The program of `name`'s derivatives that the exactness and vmap tests run and
    the memory test inspects, compiled once: (a, b, c) -> (f(a), its jvp along b, its
    vjp of the cotangent c, value_and_grad of sum(f(a) ** 2))."""
    f, shape = _nl(name)
    x = np.zeros(shape)
    w = np.zeros(jax.eval_shape(f, x).shape)

    def program(a, b, c):
        y, jv = jax.jvp(f, (a,), (b,))
        xt = jax.vjp(f, a)[1](c)[0]
        return y, jv, xt, jax.value_and_grad(lambda v: jnp.sum(f(v) ** 2))(a)
    return compiled(("nonlinear", "derivatives", name), program, x, x, w)


# ------------------------------------------------------------- exactness --
@pytest.mark.parametrize("name", NONLINEAR)
def test_nonlinear_jvp_vjp_agree_and_match_finite_differences(name):
    f, shape = _nl(name)
    x = npnormal(shape, 4)
    if name.endswith("PROD") and rank == 0:
        x[0] = 0.0  # a zero factor: no division allowed
    w = cotangent(name, jax.eval_shape(f, x).shape, 5)
    d = npnormal(shape, 6)
    run = derivatives(name)
    y, jv, xt, _ = run(x, d, w)
    assert abs(gdot(jv, w) - gdot(d, xt)) <= 1e-12 * max(1.0, abs(gdot(jv, w)))
    # the primal: numpy's reduction of every rank's input
    xs = stacked(x)
    if not name.startswith("exscan") or rank:
        np.testing.assert_allclose(y, reference(name, xs)[0], rtol=1e-14, atol=0)
    eps = 1e-6
    fin = lambda y: np.where(np.isfinite(y), y, 0.0)  # noqa: E731
    f_at = lambda a: fin(np.asarray(run(a, d, w)[0]))  # noqa: E731  (f: the program's primal)
    fd = (gdot(f_at(x + eps * d), w) - gdot(f_at(x - eps * d), w)) / (2 * eps)
    assert abs(fd - gdot(d, xt)) <= 1e-6 * max(1.0, abs(fd)), (fd, gdot(d, xt))


def ties_data(name):
    """(x, d, w) of the ties test: small integers, a tangent and a cotangent."""
    f, shape = _nl(name)
    x, d = tied(shape, 7), npnormal(shape, 8)
    return x, d, cotangent(name, jax.eval_shape(f, x).shape, 9)


@pytest.mark.parametrize("name", NONLINEAR)
def test_ties_and_zeros_match_the_single_process_derivative(name):
    x, d, w = ties_data(name)
    y, jv, xt, _ = derivatives(name)(x, d, w)
    xs, ds, ws = stacked(x), stacked(d), stacked(w)
    all_grads = reference_grad(name, xs, ws)
    if not name.startswith("exscan") or rank:
        want_y, want = reference_jvp(name, xs, ds)
    else:  # rank 0's exscan: the identity, a constant
        want_y, want = None, np.zeros(np.shape(jv))
    if not name.startswith("exscan") or rank:
        np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(jv, want, rtol=1e-13, atol=1e-13)
    # reverse mode: the transpose of that JVP, checked by the dot test and against
    # the reference's own gradient of the summed objective
    assert abs(gdot(jv, w) - gdot(d, xt)) <= 1e-12 * max(1.0, abs(gdot(jv, w)))
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
        y, jv = jax.jvp(lambda v: OPS[op](v, red), (x,), (t,))
        np.testing.assert_allclose(jv, want, rtol=1e-13, atol=1e-15)
        # the primal: the max and min of equal values are that value (exscan's rank 0:
        # the identity)
        if op != "exscan" or rank:
            np.testing.assert_array_equal(y, np.asarray(x)[rank] if op == "reduce_scatter" else x)


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
    # every rank holds 0, 1, 2: their BAND and MAX are those, their PROD 0, 1, 2**size
    wants = [np.arange(3), np.arange(3), np.array([0, 1, 2**size])]
    for op, want in zip((MPI.BAND, MPI.MAX, MPI.PROD), wants, strict=True):
        y, t = jax.jvp(lambda v: vjpmpi.allreduce(v, op), (x,), (np.zeros(3, jax.dtypes.float0),))
        assert t.dtype == jax.dtypes.float0
        np.testing.assert_array_equal(y, want)
    y, t = jax.jvp(lambda v: vjpmpi.scan(v, MPI.MAX), (x,), (np.zeros(3, jax.dtypes.float0),))
    assert t.dtype == jax.dtypes.float0
    np.testing.assert_array_equal(y, np.arange(3))


@NARROW
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64", "complex128"])
def test_other_dtypes(dtype):
    """float16/bfloat16/float32 MAX and PROD, complex PROD, against the float64 /
    complex128 reference within the dtype's rounding. Every op's jvp of this dtype in
    one compiled program."""
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    eps = float(jnp.finfo(dt).eps)
    reds = ["PROD"] if dt.kind == "c" else ["MAX", "PROD"]
    names = [f"{op}_{red}" for op in ("allreduce", "scan", "exscan") for red in reds]
    shape = (5,)
    assert all(_nl(name)[1] == shape for name in names)
    x = npnormal(shape, 11) * 0.5 + 1.0
    t = npnormal(shape, 12)
    if dt.kind == "c":
        x, t = x + 0.5j * npnormal(shape, 13), t - 1j * npnormal(shape, 14)
    x, t = x.astype(dt), t.astype(dt)
    jvps = jax.jit(lambda a, b: {name: jax.jvp(_nl(name)[0], (a,), (b,))[1]
                                 for name in names})(x, t)
    wide = np.complex128 if dt.kind == "c" else np.float64
    xs, ts = stacked(x.astype(wide)), stacked(t.astype(wide))
    for name in names:
        jv = jvps[name]
        assert jv.dtype == dt
        if name.startswith("exscan") and rank == 0:  # the identity: a zero tangent
            want = scale = np.zeros(shape)
        else:
            want = reference_jvp(name, xs, ts)[1]
            # each term of the tangent is a product of up to `size` roundings, and up to
            # `size` terms are summed: bounded by 4 * size * eps * (the same on |x|, |t|)
            scale = reference_jvp(name, abs(xs), abs(ts))[1]
        err = np.abs(np.asarray(jv).astype(wide) - np.asarray(want))
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
    needs anyway (its adjoint), of the input's size. (One program holds the jvp, the vjp
    and value_and_grad, the one the exactness tests run: a buffer or an allgather in any
    of them is in it.)"""
    f, shape = _nl(name)
    x = npnormal(shape, 15)
    y = jax.eval_shape(f, x)
    bound = max(x.size, y.size)
    programs = {"jvp, vjp and value_and_grad": derivatives(name)}
    for what, program in programs.items():
        hlo = program.as_text()
        assert "vjpmpi_" in hlo
        assert _largest_buffer(hlo) <= bound, (what, _largest_buffer(hlo), bound)
        gathers = _ALLGATHER.findall(hlo)
        if name.startswith("reduce_scatter"):
            assert all(_largest_buffer(g) <= bound for g in gathers), (what, gathers)
        else:
            assert not gathers, (what, gathers)


# ------------------------------------------------------------ transforms --
@NARROW
def test_vmap_of_grad_nonlinear():
    """vmap of grad equals grad of each member, and both the single-process gradient of
    the loss summed over ranks (NumPy)."""
    for name in ("allreduce_MAX", "scan_MIN", "exscan_PROD"):
        f, shape = _nl(name)
        xs = normal((4, *shape), 14)
        loss = lambda v: jnp.sum(f(v) ** 2)  # noqa: E731
        g = np.asarray(jax.vmap(jax.grad(loss))(xs))  # eager: the mode under test
        run = derivatives(name)  # its value_and_grad is that of `loss`: no new compile
        d, w = np.zeros(shape), np.zeros(jax.eval_shape(f, xs[0]).shape)
        for i in range(4):
            np.testing.assert_allclose(g[i], run(np.asarray(xs)[i], d, w)[3][1], rtol=1e-13,
                                       err_msg=name)

        # sum_r sum(y_r ** 2): the cotangent of y_r is 2 y_r (exscan's rank 0: constant)
        stacks = np.swapaxes(stacked(xs), 0, 1)  # (batch, rank, ...)
        want = []
        for s in stacks:
            ys = [reference(name, s, r) for r in range(size)]
            cts = [2 * y[0] if y is not None else 0.0 for y in ys]
            want.append(reference_grad(name, s, cts)[rank])
        np.testing.assert_allclose(g, np.stack(want), rtol=1e-12, atol=1e-12, err_msg=name)


@NARROW
@pytest.mark.parametrize("op", list(OPS))
def test_second_order_prod(op):
    """Hessian-vector products of PROD losses (the derivative's own derivative, through
    the recurrence and the reversed exscan) against central differences of the gradient."""
    f, shape = _nl(f"{op}_PROD")
    x = npnormal(shape, 16) * 0.3 + 1.0
    v = npnormal(shape, 17)
    loss = lambda a: jnp.sum(f(a) ** 2)  # noqa: E731
    g = jax.grad(loss)
    g_and_hv = jax.jit(lambda a, b: jax.jvp(g, (a,), (b,)))  # (g(a), the hvp): one compile
    hv = g_and_hv(x, v)[1]
    eps = 1e-5
    g_at = lambda a: np.asarray(g_and_hv(a, v)[0])  # noqa: E731  (the gradient at a)
    fd = (g_at(x + eps * v) - g_at(x - eps * v)) / (2 * eps)
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

    # the global objective: 0.25 sum(stack) + sum over i and the ranks r that use it of
    # <y_r(c_i stack), arange(5)>, c_i = 1 + 0.1 i; its gradient, in NumPy
    x = tied(5, 18) * 0.5 + npnormal(5, 19) * 0.01
    g = jax.jit(jax.grad(loss))(x)
    stack = stacked(x)
    want = np.full(stack.shape, 0.25)
    cts = [np.arange(5.0) if uses(r) else np.zeros(5) for r in range(size)]
    for i, name in enumerate(names):
        c = 1 + 0.1 * i
        want += c * reference_grad(name, c * stack, cts)
    np.testing.assert_allclose(g, want[rank], rtol=1e-12, atol=1e-12)


@NARROW
def test_checkpoint_and_loop_of_nonlinear_reductions():
    def step(c, _):
        return vjpmpi.scan(jnp.tanh(c), MPI.MAX) + 0.5 * vjpmpi.allreduce(c, MPI.PROD) * 0.1, None

    def run(v, remat):
        body = jax.checkpoint(step) if remat else step
        return jnp.sum(jax.lax.scan(body, v, None, length=3)[0] ** 2)

    x = npnormal(4, 20) * 0.5 + 1.0
    plain = jax.jit(jax.value_and_grad(lambda v: run(v, False)))  # run and its gradient
    g_plain = plain(x)[1]
    g_remat = jax.jit(jax.grad(lambda v: run(v, True)))(x)
    np.testing.assert_allclose(g_remat, g_plain, rtol=1e-13)
    d = npnormal(4, 21)
    eps = 1e-6
    run_plain = lambda v: plain(v)[0]  # noqa: E731  (run(v, False), the same program)
    one = np.ones(())
    fd = (gdot(one, run_plain(x + eps * d)) - gdot(one, run_plain(x - eps * d)))
    assert abs(fd / (2 * eps) - gdot(g_plain, d)) <= 1e-6 * max(1.0, abs(fd / (2 * eps)))


# ------------------------------------------------ the recurrence kernel --
RECURRENCE_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def _dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def recurrence_inputs(dtype):
    dt = _dtype(dtype)
    gen = rng(22)  # small integers, |a| <= 1: every partial result exact in every dtype
    a = gen.integers(-1, 2, 6).astype(dt)
    b = gen.integers(-3, 4, 6).astype(dt)
    if dt.kind == "c":
        a = (a + 1j * gen.integers(-1, 2, 6) * (np.abs(a) == 0)).astype(dt)
        b = (b - 1j * gen.integers(-2, 3, 6)).astype(dt)
    return a, b


@functools.cache
def recurrences():
    """{(dtype, reverse): e}: both kernels on every dtype, in one compiled program (run
    by the first of the tests below, on every rank)."""
    comm = vjpmpi._mpi.as_comm(None, "test")
    keys = [(d, r) for d in RECURRENCE_DTYPES for r in (False, True)]
    inputs = {d: recurrence_inputs(d) for d in RECURRENCE_DTYPES}

    def program(inputs):
        name = {False: "recurrence", True: "recurrence_reversed"}
        return {f"{d}/{r}": _primitive.PRIMITIVES[name[r]].bind(*inputs[d], comm=comm)[0]
                for d, r in keys}
    out = jax.jit(program)(inputs)
    return {(d, r): np.asarray(out[f"{d}/{r}"]) for d, r in keys}


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", RECURRENCE_DTYPES)
def test_recurrence_matches_numpy(dtype, reverse):
    """e_s = sum over the ranks q before s (rank order, or from the last rank down) of
    b_q prod_{q < r < s} a_r, element-wise; 0 on the first rank."""
    dt = _dtype(dtype)
    a, b = recurrence_inputs(dtype)
    e = recurrences()[dtype, reverse]
    assert e.dtype == dt
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
OTHERS_PRODUCT_CASES = ([(d, 7) for d in ("float16", "bfloat16", "float32", "float64",
                                          "complex64", "complex128")]
                        + [("float64", (4 << 20) // 8 + 5)])  # two 4 MiB blocks


def others_product_input(dtype, n):
    dt = _dtype(dtype)
    gen = rng(23)
    x = gen.integers(-2, 3, n).astype(dt)
    if dt.kind == "c":
        x = (x + 1j * gen.integers(-1, 2, n)).astype(dt)
    return x


@functools.cache
def others_products():
    """{(dtype, n): result} of every case below, in one compiled program."""
    comm = vjpmpi._mpi.as_comm(None, "test")
    inputs = {f"{d}/{n}": others_product_input(d, n) for d, n in OTHERS_PRODUCT_CASES}
    out = jax.jit(lambda xs: {k: _primitive.PRIMITIVES["others_product"].bind(v, comm=comm)[0]
                              for k, v in xs.items()})(inputs)
    return {(d, n): np.asarray(out[f"{d}/{n}"]) for d, n in OTHERS_PRODUCT_CASES}


@pytest.mark.parametrize("dtype, n", OTHERS_PRODUCT_CASES)
def test_others_product_matches_numpy(dtype, n):
    """prod over the ranks r != this one of x_r, element-wise, zeros included (the
    derivative of allreduce/reduce/reduce_scatter PROD); exact on small integers."""
    dt = _dtype(dtype)
    x = others_product_input(dtype, n)
    got = others_products()[dtype, n]
    assert got.dtype == dt
    xs = np.stack(WORLD.allgather(x)).astype(np.complex128)
    want = np.prod(np.delete(xs, rank, axis=0), axis=0)
    np.testing.assert_array_equal(np.asarray(got).astype(np.complex128),
                                  want if dt.kind == "c" else want.real)
