"""Program order across loops, branches, nested jit, remat and custom derivatives.

Every pattern below runs the same collectives in the same program order on every
rank, but the data dependencies between them differ by rank (rank 0 feeds one
collective's result into the next one's input, the others do not), and, where
noted, so does the structure (a nested jit on even ranks only). XLA schedules by
data dependencies, so without one token chain through the whole program the
ranks issue the collectives in different orders: the neighbouring collectives
use different ops (MAX against SUM, bcast against allreduce) and sizes, so a
wrong pairing gives wrong numbers, an MPI error or a hang, never a pass.

Each pattern is checked forward against NumPy on the gathered inputs, its
gradient (or JVP) against rank-aware central differences of the loss summed over
ranks, and its compiled HLO (`jit(f).lower(...).compile().as_text()`) for one chain
of data dependencies through all collectives (`hlo_order`).
"""

import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi

from helpers import WORLD
from hlo_order import assert_ordered, collective_sequence, order_violations

rank, size = WORLD.rank, WORLD.size
SUM, MAX = MPI.SUM, MPI.MAX
NX, NZ = 5, 8  # x and z have different sizes, so neighbouring collectives do too
tracing = pytest.mark.skipif(os.environ.get("VJPMPI_TRACE") != "1", reason="needs VJPMPI_TRACE=1")


def rng(salt):
    return np.random.default_rng(4242 + 131 * rank + 7919 * salt)


def gathered(a):
    return [np.asarray(v) for v in WORLD.allgather(np.asarray(a))]


def gdot(a, b):
    """Global inner product of two pytrees: local vdots summed over ranks."""
    local = sum(float(np.vdot(np.asarray(u), np.asarray(v)))
                for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return WORLD.allreduce(local)


# ------------------------------------------------- building blocks (jax, np) --
def work(x):
    """Local work with no communication (gives the collective's input its own latency)."""
    return jax.lax.fori_loop(0, 2, lambda i, v: jnp.sin(v) + 0.5 * v, x)


def np_work(x):
    for _ in range(2):
        x = np.sin(x) + 0.5 * x
    return x


def on_rank0(a, b):
    """Rank 0 makes `a` depend on `b`; the other ranks leave `a` alone."""
    return a + 0.5 * jnp.mean(b) if rank == 0 else a


def np_on_rank0(a, b, r):
    return a + 0.5 * np.mean(b) if r == 0 else a


def max_step(i, v):
    return vjpmpi.allreduce(v, MAX) + 0.5 * v


def np_max_loop(zs, n=3):
    for _ in range(n):
        m = np.max(zs, axis=0)
        zs = [m + 0.5 * z for z in zs]
    return zs


def max_loop(v):
    return jax.lax.fori_loop(0, 3, max_step, v)


def jit_on_even_ranks(f):
    """Rank-dependent structure: a nested jit on even ranks, inline code on odd ones."""
    return jax.jit(f) if rank % 2 == 0 else f


@jax.custom_vjp
def csum(v):
    return vjpmpi.allreduce(v, SUM)


csum.defvjp(lambda v: (vjpmpi.allreduce(v, SUM), None),
            lambda _, g: (vjpmpi.allreduce(g, SUM),))


@jax.custom_jvp
def cmax(v):
    return vjpmpi.allreduce(v, MAX)


@cmax.defjvp
def _cmax_jvp(primals, tangents):
    (v,), (t,) = primals, tangents
    y = vjpmpi.allreduce(v, MAX)
    return y, vjpmpi.allreduce(jnp.where(v == y, t, 0.0), SUM)


# ---------------------------------------------------------------- patterns --
# name -> (f(x, z) -> tuple of arrays, reference(X, Z) -> expected tuple on this rank,
#          pattern needs at least 2 ranks)
def _loop_then_top(x, z):
    c = max_loop(z)
    return vjpmpi.allreduce(on_rank0(x, c), SUM), c


def _ref_loop_then_top(X, Z):
    C = np_max_loop(Z)
    a = sum(np_on_rank0(X[r], C[r], r) for r in range(size))
    return a, C[rank]


def _top_then_loop(x, z):
    a = vjpmpi.allreduce(work(x), SUM)
    return a, max_loop(on_rank0(z, a))


def _ref_top_then_loop(X, Z):
    a = sum(np_work(v) for v in X)
    return a, np_max_loop([np_on_rank0(Z[r], a, r) for r in range(size)])[rank]


def _branches(v, pick):
    return jax.lax.cond(pick, lambda u: vjpmpi.allreduce(u, MAX),
                        lambda u: vjpmpi.bcast(u, size - 1), v)


def _np_branches(vs, pick):
    return np.max(vs, axis=0) if pick else vs[size - 1]


def _cond_then_top(pick):
    def f(x, z):
        c = _branches(z, jnp.asarray(pick))
        return vjpmpi.allreduce(on_rank0(x, c), SUM), c

    def ref(X, Z):
        c = _np_branches(Z, pick)
        return sum(np_on_rank0(X[r], c, r) for r in range(size)), c

    return f, ref


def _top_then_cond(pick):
    def f(x, z):
        a = vjpmpi.allreduce(work(x), SUM)
        return a, _branches(on_rank0(z, a), jnp.asarray(pick))

    def ref(X, Z):
        a = sum(np_work(v) for v in X)
        return a, _np_branches([np_on_rank0(Z[r], a, r) for r in range(size)], pick)

    return f, ref


def _switch(index):
    branches = [lambda u: vjpmpi.allreduce(u, MAX), lambda u: vjpmpi.bcast(u, size - 1),
                lambda u: 2.0 * u]

    def f(x, z):
        c = jax.lax.switch(jnp.asarray(index), branches, z)
        return vjpmpi.allgather(on_rank0(x, c)), c

    def ref(X, Z):
        c = [np.max(Z, axis=0), Z[size - 1], 2.0 * Z[rank]][index]
        c0 = [np.max(Z, axis=0), Z[size - 1], 2.0 * Z[0]][index]
        return np.stack([np_on_rank0(X[r], c0, r) for r in range(size)]), c

    return f, ref


def _forwarding_cond(x, z):
    # The branch only forwards its input (JAX drops the cond's output), and its
    # collective's result is unused: nothing but the token orders it.
    jax.lax.cond(z[0] > -1e9, lambda u: (vjpmpi.allreduce(2.0 * u, MAX), u)[1], lambda u: u, z)
    x8 = jnp.concatenate([x, x[:NZ - NX]])  # the same size as the branch's allreduce
    return (vjpmpi.allreduce(on_rank0(x8, z), SUM),)


def _ref_forwarding_cond(X, Z):
    x8 = [np.concatenate([v, v[:NZ - NX]]) for v in X]
    return (sum(np_on_rank0(x8[r], Z[r], r) for r in range(size)),)


def _partner():
    """Even ranks send to rank + 1, odd ranks receive from rank - 1; a last even rank rests."""
    if rank % 2 == 0:
        return "send" if rank + 1 < size else None
    return "recv"


def _send_only_cond(pick):
    # The sender's branch has no output at all.
    def f(x, z):
        p = jnp.asarray(pick)
        role = _partner()
        if role == "send":
            jax.lax.cond(p, lambda u: vjpmpi.send(3.0 * u, rank + 1, tag=7), lambda u: None, z)
            r = z
        elif role == "recv":
            r = jax.lax.cond(p, lambda u: vjpmpi.recv(u, rank - 1, tag=7), lambda u: u, z)
        else:
            r = z
        return vjpmpi.allreduce(on_rank0(x, r), SUM), r

    def ref(X, Z):
        got = [3.0 * Z[r - 1] if pick and r % 2 == 1 else Z[r] for r in range(size)]
        return sum(np_on_rank0(X[r], got[r], r) for r in range(size)), got[rank]

    return f, ref


def _nested_jit(x, z):
    c = jit_on_even_ranks(max_loop)(z)
    a = vjpmpi.allreduce(on_rank0(x, c), SUM)
    b = jit_on_even_ranks(lambda v: vjpmpi.bcast(v, 0))(on_rank0(2.0 * z, a))
    return a, b, c


def _ref_nested_jit(X, Z):
    C = np_max_loop(Z)
    a = sum(np_on_rank0(X[r], C[r], r) for r in range(size))
    return a, 2.0 * Z[0] + 0.5 * np.mean(a), C[rank]


def _scan(reverse):
    def body(c, xt):
        return vjpmpi.allreduce(c, SUM) * 0.5 + jnp.sin(c), vjpmpi.allgather(xt)

    def f(x, z):
        xs = x[None] * jnp.arange(1.0, 4.0)[:, None]
        c, ys = jax.lax.scan(body, z, xs, reverse=reverse)
        return c, ys, vjpmpi.bcast(on_rank0(x, c), size - 1)

    def ref(X, Z):
        C = list(Z)
        for _ in range(3):
            s = sum(C)
            C = [0.5 * s + np.sin(c) for c in C]
        ys = np.stack([np.stack([X[r] * (t + 1.0) for r in range(size)]) for t in range(3)])
        return C[rank], ys, np_on_rank0(X[size - 1], C[0], size - 1)

    return f, ref


def _checkpoint(x, z):
    c = jax.checkpoint(lambda v: vjpmpi.allreduce(jnp.sin(v), MAX) + v)(z)
    return vjpmpi.allreduce(on_rank0(x, c), SUM), c


def _ref_checkpoint(X, Z):
    m = np.max([np.sin(v) for v in Z], axis=0)
    return sum(np_on_rank0(X[r], m + Z[r], r) for r in range(size)), m + Z[rank]


def _custom_derivatives(x, z):
    c = csum(jnp.sin(z))
    a = vjpmpi.allreduce(on_rank0(x, c), MAX)
    return a, cmax(on_rank0(z, a)) + 0.5 * z, c


def _ref_custom_derivatives(X, Z):
    c = sum(np.sin(v) for v in Z)
    a = np.max([np_on_rank0(X[r], c, r) for r in range(size)], axis=0)
    m = np.max([np_on_rank0(Z[r], a, r) for r in range(size)], axis=0)
    return a, m + 0.5 * Z[rank], c


def _vmap_cond(x, z):
    # a batched predicate: JAX turns the cond into both branches and a select
    picks = jnp.arange(3) % 2 == 0
    c = jax.vmap(_branches)(jnp.stack([z, 2 * z, 3 * z]), picks)
    return vjpmpi.allreduce(on_rank0(x, c), SUM), c


def _ref_vmap_cond(X, Z):
    cs = [_np_branches([k * v for v in Z], k % 2 == 1) for k in (1, 2, 3)]
    c0 = np.stack(cs)
    return sum(np_on_rank0(X[r], c0, r) for r in range(size)), c0


def _vmap_loop(x, z):
    return jax.vmap(_loop_then_top)(jnp.stack([x, -x]), jnp.stack([z, 2 * z]))


def _ref_vmap_loop(X, Z):
    a1, c1 = _ref_loop_then_top(X, Z)
    a2, c2 = _ref_loop_then_top([-v for v in X], [2 * v for v in Z])
    return np.stack([a1, a2]), np.stack([c1, c2])


def _while_cond(x, z):
    # the loop's stopping test is a collective
    def cond(s):
        return vjpmpi.allreduce(jnp.max(jnp.abs(s[1])), MAX) > 1.0

    def body(s):
        k, v = s
        return k + 1, 0.5 * vjpmpi.allreduce(v, SUM) / size + 0.25 * v

    k, v = jax.lax.while_loop(cond, body, (0, 4.0 * z))
    return vjpmpi.allreduce(on_rank0(x, v), SUM), v, k


def _ref_while_cond(X, Z):
    V, k = [4.0 * v for v in Z], 0
    while max(np.max(np.abs(v)) for v in V) > 1.0:
        m = sum(V) / size
        V, k = [0.5 * m + 0.25 * v for v in V], k + 1
    return sum(np_on_rank0(X[r], V[r], r) for r in range(size)), V[rank], k


def _vmap_while_cond(x, z):
    # batched stopping test: the loop runs until every batch member is done
    a, v, k = jax.vmap(_while_cond)(jnp.stack([x, 2 * x]), jnp.stack([z, 3 * z]))
    return a, v, k


def _ref_vmap_while_cond(X, Z):
    outs = [_ref_while_cond([m * v for v in X], [n * v for v in Z]) for m, n in ((1, 1), (2, 3))]
    return tuple(np.stack(o) for o in zip(*outs, strict=True))


PATTERNS = {
    "loop_then_top": (_loop_then_top, _ref_loop_then_top),
    "top_then_loop": (_top_then_loop, _ref_top_then_loop),
    "cond_then_top_true": _cond_then_top(True),
    "cond_then_top_false": _cond_then_top(False),
    "top_then_cond_true": _top_then_cond(True),
    "top_then_cond_false": _top_then_cond(False),
    **{f"switch_{i}": _switch(i) for i in range(3)},
    "forwarding_cond": (_forwarding_cond, _ref_forwarding_cond),
    "send_only_cond_true": _send_only_cond(True),
    "send_only_cond_false": _send_only_cond(False),
    "nested_jit": (_nested_jit, _ref_nested_jit),
    "scan": _scan(False),
    "scan_reverse": _scan(True),
    "checkpoint": (_checkpoint, _ref_checkpoint),
    "custom_jvp_vjp": (_custom_derivatives, _ref_custom_derivatives),
    "vmap_cond_batched_predicate": (_vmap_cond, _ref_vmap_cond),
    "vmap_loop": (_vmap_loop, _ref_vmap_loop),
    "while_cond_collective": (_while_cond, _ref_while_cond),
    "vmap_while_cond_collective": (_vmap_while_cond, _ref_vmap_while_cond),
}
# reverse mode does not go through while_loop: JVP there
FORWARD_MODE_ONLY = {"while_cond_collective", "vmap_while_cond_collective"}


def inputs():
    return jnp.asarray(rng(1).standard_normal(NX)), jnp.asarray(rng(2).standard_normal(NZ))


def floats(tree):
    return [v for v in jax.tree.leaves(tree) if jnp.issubdtype(v.dtype, jnp.inexact)]


def weights(tree):
    """Random cotangent weights, seeded by rank; rank 1 gives the last output none."""
    leaves = floats(tree)
    ws = [jnp.asarray(rng(10 + i).standard_normal(jnp.shape(v))) for i, v in enumerate(leaves)]
    if rank == 1:
        ws[-1] = jnp.zeros_like(ws[-1])
    return ws


def local_loss(f, ws):
    return lambda x, z: sum(jnp.vdot(w, v) for w, v in zip(ws, floats(f(x, z)), strict=True))


@functools.cache
def programs(name):
    """Pattern `name` compiled once for all the tests that run or inspect it: `f` (the
    pattern) and `d`, this rank's loss (a weighted sum of its outputs: random weights
    seeded by rank, none for rank 1's last output) with its derivative: `d(x, z)` ->
    (loss, (gx, gz)) in reverse mode, or `d(x, z, dx, dz)` -> (loss, directional
    derivative) for the patterns that reverse mode does not go through."""
    f, _ = PATTERNS[name]
    x, z = inputs()
    loss = local_loss(f, weights(jax.eval_shape(f, x, z)))
    if name in FORWARD_MODE_ONLY:
        d = jax.jit(lambda a, b, da, db: jax.jvp(loss, (a, b), (da, db))).lower(x, z, x, z)
    else:
        d = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, z)
    return {"f": jax.jit(f).lower(x, z).compile(), "d": d.compile()}


# ------------------------------------------------------------------ tests --
def test_issue_reproducer():
    def f(x, z):
        c = jax.lax.fori_loop(0, 3, lambda i, v: vjpmpi.allreduce(v, MPI.MAX), z)
        if rank == 0:
            x = x + 0 * c[0]
        a = vjpmpi.allreduce(x, MPI.SUM)
        return a, c

    a, c = jax.jit(f)(jnp.full(8, rank + 1.0), jnp.arange(8.0) * (rank + 1))
    np.testing.assert_array_equal(a, np.full(8, size * (size + 1) / 2))
    np.testing.assert_array_equal(c, np.arange(8.0) * size)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_forward(name):
    _, ref = PATTERNS[name]
    x, z = inputs()
    got = programs(name)["f"](x, z)
    expected = ref(gathered(x), gathered(z))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["loop_then_top", "cond_then_top_true", "nested_jit", "scan"])
def test_forward_eager(name):
    # outside jit every loop and branch is a program of its own, dispatched in order
    f, ref = PATTERNS[name]
    x, z = inputs()
    for g, e in zip(f(x, z), ref(gathered(x), gathered(z)), strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_derivative_matches_finite_differences(name):
    x, z = inputs()
    prog = programs(name)
    dx, dz = jnp.asarray(rng(3).standard_normal(NX)), jnp.asarray(rng(4).standard_normal(NZ))
    if name in FORWARD_MODE_ONLY:
        _, directional = prog["d"](x, z, dx, dz)
        exact = WORLD.allreduce(float(directional))
        loss = lambda a, b: prog["d"](a, b, dx, dz)[0]  # noqa: E731
    else:
        _, (gx, gz) = prog["d"](x, z)
        exact = gdot((gx, gz), (dx, dz))
        loss = lambda a, b: prog["d"](a, b)[0]  # noqa: E731
    eps = 1e-6
    total = lambda a, b: WORLD.allreduce(float(loss(a, b)))  # noqa: E731
    fd = (total(x + eps * dx, z + eps * dz) - total(x - eps * dx, z - eps * dz)) / (2 * eps)
    assert abs(fd - exact) <= 1e-6 * max(1.0, abs(fd)), (fd, exact)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_compiled_hlo_is_one_chain(name):
    prog = programs(name)
    assert_ordered(prog["f"].as_text())
    assert_ordered(prog["d"].as_text())


def test_compiled_chain_runs_in_program_order():
    # top-level, loop, branch and nested-jit collectives appear in the compiled chain
    # in source order, whatever the data dependencies
    inner = jax.jit(lambda v: vjpmpi.scan(v, SUM))

    def f(x, z):
        a = vjpmpi.allgather(work(x))
        c = jax.lax.fori_loop(0, 2, lambda i, v: vjpmpi.allreduce(v, MAX), z)
        d = jax.lax.cond(z[0] > 0, lambda v: vjpmpi.bcast(v, 0), lambda v: vjpmpi.exscan(v, SUM), z)
        e = inner(x)
        return a, c, d, vjpmpi.reduce(e, SUM, 0)

    text = jax.jit(f).lower(*inputs()).compile().as_text()
    assert_ordered(text)
    seq = collective_sequence(text)
    assert seq.index("allgather") < seq.index("allreduce") < seq.index("bcast")
    assert seq.index("exscan") < seq.index("scan") < seq.index("reduce")


def test_hlo_checker_catches_a_broken_chain():
    # the checker itself: a program whose second collective takes a fresh token
    broken = """
HloModule m
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %t0 = token[] after-all()
  %a = (f32[4]{0}, token[]) custom-call(%x, %t0), custom_call_target="vjpmpi_allreduce"
  %t1 = token[] after-all()
  %b = (f32[4]{0}, token[]) custom-call(%x, %t1), custom_call_target="vjpmpi_bcast"
  %y = f32[4]{0} get-tuple-element(%b), index=0
  ROOT %r = f32[4]{0} add(%y, %y)
}
"""
    problems = order_violations(broken)
    assert any("fresh token" in p for p in problems)
    assert any("does not depend on" in p for p in problems)


@tracing
@pytest.mark.parametrize("name", [n for n in PATTERNS if not n.startswith("send_only")])
def test_runtime_sequence_identical_on_every_rank(name):
    x, z = inputs()
    d = programs(name)["d"]
    vjpmpi.take_trace()
    jax.block_until_ready(d(x, z, x, z) if name in FORWARD_MODE_ONLY else d(x, z))
    seq = vjpmpi.take_trace()
    assert seq and all(s == seq for s in WORLD.allgather(seq))


@tracing
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_backward_runs_transposes_in_reverse(reverse):
    f, _ = _scan(reverse)
    x, z = inputs()
    loss = local_loss(f, weights(jax.eval_shape(f, x, z)))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(g(x, z))
    vjpmpi.take_trace()
    jax.block_until_ready(g(x, z))
    forward = ["allreduce", "allgather"] * 3 + ["bcast"]
    backward = ["reduce"] + ["reduce_scatter", "allreduce"] * 3
    assert vjpmpi.take_trace() == forward + backward


def test_cg_while_loop_matches_single_process():
    # CG on a 1-D Poisson problem split in row blocks: halo exchange for the matvec,
    # allreduce dot products, and the stopping test an allreduce in the loop's condition;
    # then more collectives, the first fed by the solution on rank 0 only.
    n_local, maxiter, tol = 24 // size if 24 % size == 0 else 6, 40, 1e-10
    n = n_local * size
    lo = rank - 1 if rank > 0 else MPI.PROC_NULL
    hi = rank + 1 if rank + 1 < size else MPI.PROC_NULL
    b_glob = np.sin(np.arange(n) * 0.7) + 0.1 * np.arange(n) / n
    b = jnp.asarray(b_glob[rank * n_local:(rank + 1) * n_local])

    def matvec(u):  # (2 + 0.1) u_i - u_{i-1} - u_{i+1}, zero outside the domain
        left = vjpmpi.sendrecv(u[-1:], jnp.zeros(1), lo, hi, sendtag=1, recvtag=1)
        right = vjpmpi.sendrecv(u[:1], jnp.zeros(1), hi, lo, sendtag=2, recvtag=2)
        ext = jnp.concatenate([left, u, right])
        return 2.1 * u - ext[:-2] - ext[2:]

    def dot(a, c):
        return vjpmpi.allreduce(jnp.vdot(a, c), SUM)

    def solve(b):
        def cond(s):
            k, _, r, _, _ = s
            return (dot(r, r) > tol ** 2) & (k < maxiter)

        def body(s):
            k, x, r, p, hist = s
            ap = matvec(p)
            rr = dot(r, r)
            alpha = rr / dot(p, ap)
            x, r_new = x + alpha * p, r - alpha * ap
            p = r_new + dot(r_new, r_new) / rr * p
            return k + 1, x, r_new, p, hist.at[k].set(x)

        zero = jnp.zeros_like(b)
        k, x, r, _, hist = jax.lax.while_loop(
            cond, body, (0, zero, b, b, jnp.zeros((maxiter, n_local))))
        res = vjpmpi.allreduce(jnp.max(jnp.abs(r)), MAX)
        return k, hist, vjpmpi.allgather(on_rank0(x, res)), res

    k, hist, x_all, res = jax.jit(solve)(b)

    a = 2.1 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    x_ref, r_ref, p_ref, hist_ref = np.zeros(n), b_glob.copy(), b_glob.copy(), []
    while r_ref @ r_ref > tol ** 2 and len(hist_ref) < maxiter:
        ap = a @ p_ref
        rr = r_ref @ r_ref
        alpha = rr / (p_ref @ ap)
        x_ref, r_new = x_ref + alpha * p_ref, r_ref - alpha * ap
        p_ref, r_ref = r_new + (r_new @ r_new) / rr * p_ref, r_new
        hist_ref.append(x_ref.copy())
    assert 5 < int(k) == len(hist_ref) < maxiter
    mine = slice(rank * n_local, (rank + 1) * n_local)
    np.testing.assert_allclose(hist[:int(k)], np.array(hist_ref)[:, mine], rtol=1e-9, atol=1e-12)
    assert float(res) == pytest.approx(np.max(np.abs(r_ref)), rel=1e-6, abs=1e-12)
    x_glob = x_ref.reshape(size, n_local).copy()
    x_glob[0] += 0.5 * float(res)
    np.testing.assert_allclose(x_all, x_glob, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a @ x_ref, b_glob, atol=1e-8)


def test_construct_without_tokens_is_an_error():
    # A higher-order primitive whose lowering does not pass JAX's tokens on (as a
    # third-party construct might) leaves its collective outside the chain: a clear
    # error when compiling, never an unordered program.
    from jax._src import core
    from jax._src.interpreters import mlir

    opaque_p = core.Primitive("opaque_call")
    opaque_p.multiple_results = True
    opaque_p.def_abstract_eval(lambda *a, jaxpr: jaxpr.out_avals)

    def lowering(ctx, *args, jaxpr):
        # the keywords this JAX's jaxpr_subcomp takes (they changed between releases)
        known = inspect.signature(inspect.unwrap(mlir.jaxpr_subcomp)).parameters
        extra = {k: v for k, v in (("const_lowering", getattr(ctx, "const_lowering", None)),
                                   ("outer_traceback", None)) if k in known}
        outs, _ = mlir.jaxpr_subcomp(ctx.module_context, jaxpr.jaxpr, ctx.name_stack,
                                     mlir.TokenSet(), [], *args,
                                     dim_var_values=ctx.dim_var_values, **extra)
        return outs

    mlir.register_lowering(opaque_p, lowering)
    body = jax.make_jaxpr(lambda v: vjpmpi.allreduce(v, SUM))(jnp.ones(2))
    f = jax.jit(lambda v: opaque_p.bind(v, jaxpr=body))
    with pytest.raises(NotImplementedError, match=r"vjpmpi\.allreduce: collective lowered "
                                                    r"outside vjpmpi's ordering chain"):
        f.lower(jnp.ones(2))


def test_collective_inside_host_callback_is_an_error():
    def host(v):
        return np.asarray(vjpmpi.allreduce(jnp.asarray(v), SUM))

    f = jax.jit(lambda v: jax.pure_callback(host, jax.ShapeDtypeStruct(v.shape, v.dtype), v))
    with pytest.raises(Exception, match=r"vjpmpi\.allreduce: called from inside a host callback"):
        jax.block_until_ready(f(jnp.ones(3)))
    vjpmpi.barrier()  # the failed call ran no MPI: every rank is still in step


def test_exported_function_alone_runs_and_next_to_others_is_an_error():
    from jax import export

    x, z = inputs()
    unchecked = [export.DisabledSafetyCheck.custom_call(t) for t in vjpmpi.custom_call_targets()]
    assert "vjpmpi_allreduce" in vjpmpi.custom_call_targets()
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        export.export(jax.jit(_loop_then_top))(x, z)  # (JAX's check, without the list)
    exp = export.export(jax.jit(_loop_then_top), disabled_checks=unchecked)(x, z)
    # serialized and read back (what another process of the same job would load)
    exp = export.deserialize(exp.serialize())
    got = jax.jit(exp.call)(x, z)  # on its own: ordered by its own chain
    for g, e in zip(got, _ref_loop_then_top(gathered(x), gathered(z)), strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-12, atol=1e-12)
    # a communicator numbered in order of first use could be another one where it loads
    dup = WORLD.Dup()
    try:
        with pytest.raises(NotImplementedError, match=r"vjpmpi\.allreduce: a program exported "
                           r"with jax\.export names its communicator .*#\d+"):
            export.export(jax.jit(lambda v: vjpmpi.allreduce(v, SUM, comm=dup)),
                          disabled_checks=unchecked)(x)
    finally:
        dup.Free()
    if os.environ.get("VJPMPI_TRACE") == "1":  # unused results: the call still runs
        vjpmpi.take_trace()
        jax.block_until_ready(jax.jit(lambda a, b: (exp.call(a, b), a)[1])(x, z))
        assert vjpmpi.take_trace() == ["allreduce"] * 4
    both = jax.jit(lambda a, b: (exp.call(a, b), vjpmpi.allreduce(b, MAX)))
    with pytest.raises(NotImplementedError, match="jax.export-ed function that runs vjpmpi"):
        both.lower(x, z)
