"""Differentiation: exact adjoints, reverse order, symmetry,
completeness under jit / vmap / scan / checkpoint / cg, and ordered_collective."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi

from helpers import WORLD, gdot, normal, send_recv_pair

rank, size = WORLD.rank, WORLD.size
nxt, prv = (rank + 1) % size, (rank - 1) % size
needs2 = pytest.mark.skipif(size < 2, reason="needs at least 2 ranks")


def shift_peers():
    """A non-periodic shift: the ends talk to MPI.PROC_NULL."""
    return (rank - 1 if rank > 0 else MPI.PROC_NULL,
            rank + 1 if rank + 1 < size else MPI.PROC_NULL)


def _linear_ops():
    s = (4, 3)
    ops = {
        "allreduce": (lambda v: vjpmpi.allreduce(v, MPI.SUM), s),
        "allgather": (vjpmpi.allgather, s),
        "alltoall": (vjpmpi.alltoall, (size, 3)),
        "reduce_scatter": (lambda v: vjpmpi.reduce_scatter(v, MPI.SUM), (size, 3)),
        "scan": (lambda v: vjpmpi.scan(v, MPI.SUM), s),
        "exscan": (lambda v: vjpmpi.exscan(v, MPI.SUM), s),
        "sendrecv_ring": (lambda v: vjpmpi.sendrecv(v, v, prv, nxt, sendtag=1, recvtag=1), s),
        "sendrecv_shift": (lambda v: vjpmpi.sendrecv(v, v * 2, *shift_peers(), recvtag=0), s),
        "send_recv": (send_recv_pair, s),
    }
    for root in range(size):
        ops[f"reduce_root{root}"] = (lambda v, r=root: vjpmpi.reduce(v, MPI.SUM, r), s)
        ops[f"bcast_root{root}"] = (lambda v, r=root: vjpmpi.bcast(v, r), s)
        ops[f"gather_root{root}"] = (lambda v, r=root: vjpmpi.gather(v, r), s)
        ops[f"scatter_root{root}"] = (lambda v, r=root: vjpmpi.scatter(v, r),
                                      (size, 3) if rank == root else (3,))
    return ops


LINEAR = _linear_ops()
# ------------------------------------------------------------- exactness --
def _is_other_root(name):
    """The instances of a rooted op at roots past 0 (root 0 stands for the op eagerly)."""
    return "_root" in name and not name.endswith("_root0")


@pytest.mark.parametrize("name", list(LINEAR))
def test_dot_product_linear_transpose(name):
    f, shape = LINEAR[name]
    x, v = normal(shape, 1), normal(shape, 3)
    w = normal(jax.eval_shape(f, x).shape, 2)

    def all_of(a, c, t):  # the value, and the adjoint three ways: one program
        (at,) = jax.linear_transpose(f, a)(c)
        return f(a), at, jax.vjp(f, a)[1](c)[0], jax.jvp(f, (a,), (t,))[1]

    y, xt, vt, jv = jax.jit(all_of)(x, w, v)
    lhs, rhs = gdot(y, w), gdot(x, xt)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)
    # vjp gives the same cotangent, and jvp agrees: <J v, w> = <v, J^T w>
    np.testing.assert_allclose(vt, xt, rtol=1e-13, atol=1e-13)
    assert abs(gdot(jv, w) - gdot(v, xt)) <= 1e-12 * max(1.0, abs(gdot(jv, w)))
    if not _is_other_root(name):  # and outside jit: each op's eager vjp
        _, vjp = jax.vjp(f, x)
        np.testing.assert_allclose(vjp(w)[0], xt, rtol=1e-13, atol=1e-13)


# ------------------------------------------------------- seed reproducers --
def test_seed_linear_transpose_allreduce_under_jit():
    arr = jnp.ones((3, 2))

    def f(x):
        (res,) = jax.linear_transpose(lambda v: vjpmpi.allreduce(v, MPI.SUM), arr)(x)
        return res

    np.testing.assert_array_equal(jax.jit(f)(arr), np.full((3, 2), size))


def test_seed_chained_and_multiple_outputs():
    arr = jnp.arange(6.0).reshape(3, 2) + rank

    def two(v):
        return vjpmpi.allreduce(vjpmpi.allreduce(v, MPI.SUM), MPI.SUM)

    (r,) = jax.jit(jax.linear_transpose(two, arr))(arr)
    np.testing.assert_allclose(r, size * size * sum(np.arange(6.0).reshape(3, 2) + k
                                                    for k in range(size)) / size)

    def several(v):
        a = vjpmpi.allreduce(v, MPI.SUM)
        return a, vjpmpi.allgather(v), 2 * a  # the same collective result used twice

    cts = (jnp.ones((3, 2)), jnp.ones((size, 3, 2)), jnp.ones((3, 2)))
    (r,) = jax.jit(jax.linear_transpose(several, arr))(cts)
    np.testing.assert_allclose(r, np.full((3, 2), 3.0 * size + size))
    g = jax.jit(jax.grad(lambda v: jnp.sum(several(v)[0] * several(v)[2])))(arr)
    total = sum(np.arange(6.0).reshape(3, 2) + k for k in range(size))
    np.testing.assert_allclose(g, 4 * size * total)


# ------------------------------------------------------------ reverse order --
def _fwd_many(x):
    a = vjpmpi.allreduce(x, MPI.SUM)
    b = vjpmpi.allgather(2 * x)
    c = vjpmpi.bcast(3 * x, 0)
    d = vjpmpi.scan(x, MPI.SUM)
    return jnp.sum(a ** 2) + jnp.sum(jnp.sin(b)) + jnp.sum(c * d)


FORWARD = ["allreduce", "allgather", "bcast", "scan"]
# scan's adjoint is one exscan over the ranks in reverse order (the suffix sums)
BACKWARD = ["exscan", "reduce", "reduce_scatter", "allreduce"]


def test_backward_runs_transposes_in_reverse_order_in_hlo():
    from test_api import assert_chain

    text = jax.jit(jax.grad(_fwd_many)).lower(jnp.ones(3)).as_text()
    assert_chain(text, FORWARD + BACKWARD)


@pytest.mark.skipif(os.environ.get("VJPMPI_TRACE") != "1", reason="needs VJPMPI_TRACE=1")
def test_runtime_trace_identical_on_every_rank():
    vjpmpi.take_trace()
    g = jax.jit(jax.grad(_fwd_many))(normal(3, 7))
    g.block_until_ready()
    seq = vjpmpi.take_trace()
    assert seq == FORWARD + BACKWARD
    assert all(s == seq for s in WORLD.allgather(seq))


# --------------------------------------------------------------- symmetry --
@needs2
def test_cotangent_only_on_rank0():
    x = normal(4, 8)

    def loss(v):
        y = vjpmpi.allreduce(v, MPI.SUM)
        return jnp.sum(y ** 2) if rank == 0 else jnp.sum(v ** 2)

    g = jax.jit(jax.grad(loss))(x)
    y = sum(np.asarray(normal_other) for normal_other in WORLD.allgather(np.asarray(x)))
    np.testing.assert_allclose(g, 2 * y + (2 * np.asarray(x) if rank != 0 else 0), rtol=1e-13)


@needs2
def test_allgather_unused_on_odd_ranks():
    x = normal(3, 9)

    def loss(v):
        g = vjpmpi.allgather(v)
        return jnp.sum(g[0] * g[-1]) if rank % 2 == 0 else jnp.sum(v)

    g = jax.grad(loss)(x)
    xs = WORLD.allgather(np.asarray(x))
    n_even = (size + 1) // 2
    expected = np.ones(3) if rank % 2 else np.zeros(3)
    if rank == 0:
        expected = expected + n_even * xs[-1]
    if rank == size - 1:
        expected = expected + n_even * xs[0]
    np.testing.assert_allclose(g, expected, rtol=1e-13)


@needs2
def test_send_recv_only_receiver_loss():
    x = normal(3, 10)

    def loss(v):
        if rank == 0:
            vjpmpi.send(v, 1)
            return jnp.zeros(())
        if rank == 1:
            return jnp.sum(vjpmpi.recv(v, 0) ** 2)  # v is the template
        return jnp.sum(v)

    g = jax.jit(jax.grad(loss))(x)
    x0 = WORLD.bcast(np.asarray(x), root=0)
    expected = {0: 2 * x0, 1: np.zeros(3)}.get(rank, np.ones(3))
    np.testing.assert_allclose(g, expected, rtol=1e-13)


@needs2
def test_rank_dependent_cond_around_local_work():
    x = normal(3, 11)

    def loss(v):
        local = jax.lax.cond(rank % 2 == 0, jnp.sin, jnp.cos, v)
        return jnp.sum(vjpmpi.allreduce(local, MPI.SUM) ** 2)

    g = jax.jit(jax.grad(loss))(x)
    locals_ = [np.sin(a) if r % 2 == 0 else np.cos(a)
               for r, a in enumerate(WORLD.allgather(np.asarray(x)))]
    s = sum(locals_)
    deriv = np.cos(np.asarray(x)) if rank % 2 == 0 else -np.sin(np.asarray(x))
    np.testing.assert_allclose(g, size * 2 * s * deriv, rtol=1e-12)


def _inputs_on_even_ranks_only(v):
    """Even ranks feed v into the collectives, odd ranks a constant: on odd ranks no
    collective input depends on what is differentiated, yet every rank must run every
    tangent collective and its transpose."""
    u = v + 3.0 if rank % 2 == 0 else jnp.linspace(1.0, 2.0, v.shape[0])
    s = vjpmpi.allreduce(u, MPI.SUM)
    m = vjpmpi.allreduce(u, MPI.MAX)
    y = vjpmpi.sendrecv(u, u, prv, nxt, sendtag=6, recvtag=6)
    return jnp.sum(s * v) + jnp.sum(m * v) + jnp.sum(y * v)


_INPUT_TRANSFORMS = {
    "grad": lambda f: jax.grad(f),
    "jit_grad": lambda f: jax.jit(jax.grad(f)),
    "grad_of_inner_jit": lambda f: jax.grad(jax.jit(f)),
    "grad_of_checkpoint": lambda f: jax.jit(jax.grad(jax.checkpoint(f))),
    "grad_of_scan": lambda f: jax.jit(jax.grad(
        lambda v: jax.lax.scan(lambda c, _: (c + f(v), None), 0.0, None, length=2)[0] / 2)),
    "grad_of_cond": lambda f: jax.jit(jax.grad(
        lambda v: jax.lax.cond(rank % 2 == 0, f, lambda w: f(w) * 1.0, v))),
    "vjp": lambda f: (lambda v: jax.vjp(f, v)[1](1.0)[0]),
}


@pytest.mark.parametrize("transform", list(_INPUT_TRANSFORMS))
def test_collective_inputs_independent_of_x_on_some_ranks(transform):
    x = normal(4, 21)
    xs = np.stack(WORLD.allgather(np.asarray(x)))
    us = np.array([xs[r] + 3.0 if r % 2 == 0 else np.linspace(1.0, 2.0, 4) for r in range(size)])
    s, m, total = us.sum(0), us.max(0), xs.sum(0)
    even = rank % 2 == 0
    # d/dx_r of sum over ranks q of (s + m + u_{q-1}) . x_q
    want = s + m + us[prv] + (even * (total + (us[rank] == m) * total + xs[nxt]))
    g = _INPUT_TRANSFORMS[transform](_inputs_on_even_ranks_only)(x)
    np.testing.assert_allclose(g, want, rtol=1e-13)


def test_bcast_input_built_from_constants_on_some_ranks():
    x = normal(4, 24)
    xs = np.stack(WORLD.allgather(np.asarray(x)))

    def loss(v):  # only rank 0's input matters; rank 1's is a constant
        y = vjpmpi.bcast(jnp.zeros(4) if rank == 1 else v, 0)
        return jnp.sum(y * v)

    g = jax.jit(jax.grad(loss))(x)
    # sum over ranks of x_0 . x_r: d/dx_0 = x_0 + sum_r x_r, d/dx_r = x_0 elsewhere
    np.testing.assert_allclose(g, xs[0] + xs.sum(0) if rank == 0 else xs[0], rtol=1e-13)


def test_jvp_with_collective_inputs_independent_of_x_on_some_ranks():
    x, d = normal(4, 22), normal(4, 23)
    value, jv = jax.jit(lambda a, b: jax.jvp(_inputs_on_even_ranks_only, (a,), (b,)))(x, d)
    g = jax.grad(_inputs_on_even_ranks_only)(x)
    assert abs(gdot(jnp.ones(()), jv) - gdot(g, d)) <= 1e-12 * max(1.0, abs(gdot(g, d)))
    np.testing.assert_allclose(value, _inputs_on_even_ranks_only(x), rtol=1e-14)


# ----------------------------------------------------------- completeness --
@pytest.mark.parametrize("name", ["allreduce", "allgather", "alltoall", "reduce_scatter",
                                  "scan", "exscan", "sendrecv_ring", "bcast_root0",
                                  "scatter_root0", "gather_root0", "reduce_root0"])
def test_vmap_of_jvp_vjp_and_transpose(name):
    f, shape = LINEAR[name]
    xs, ts = normal((3, *shape), 12), normal((3, *shape), 14)  # (tangents independent of x)
    ws = jax.eval_shape(jax.vmap(f), xs)
    cts = normal(ws.shape, 13)
    got = jax.jit(jax.vmap(lambda x, c: jax.vjp(f, x)[1](c)[0]))(xs, cts)
    tr = jax.vmap(lambda x, c: jax.linear_transpose(f, x)(c)[0])(xs, cts)
    jv = jax.vmap(lambda x, t: jax.jvp(f, (x,), (t,))[1])(xs, ts)
    # each batch member on its own (the unbatched adjoints pass the dot tests above)
    one = jax.jit(lambda x, c, t: (jax.vjp(f, x)[1](c)[0], f(t)))
    for i in range(3):
        vjp_i, f_t = one(xs[i], cts[i], ts[i])
        np.testing.assert_allclose(got[i], vjp_i, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(tr[i], vjp_i, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(jv[i], f_t, rtol=1e-13, atol=1e-14)  # linear: J t = f(t)


def test_second_order():
    x, v = normal(3, 15), normal(3, 16)

    def loss(u):
        return jnp.sum(vjpmpi.allreduce(u, MPI.SUM) ** 3)

    hv = jax.jit(lambda a, b: jax.jvp(jax.grad(loss), (a,), (b,))[1])(x, v)
    y = sum(WORLD.allgather(np.asarray(x)))
    vs = sum(WORLD.allgather(np.asarray(v)))
    np.testing.assert_allclose(hv, 6 * size * y * vs, rtol=1e-12)
    # jax.hessian's basis directions move the same coordinate on every rank at once:
    # d/de of rank r's gradient size * prod_{s != r} x_s is size * sum_{s != r} prod_{t != r, s} x_t
    prod_loss = lambda u: jnp.sum(vjpmpi.allreduce(u, MPI.PROD))  # noqa: E731
    xs = np.stack(WORLD.allgather(np.asarray(x)))
    diag = size * sum((np.prod(np.delete(xs, [rank, s], axis=0), axis=0)
                       for s in range(size) if s != rank), np.zeros(3))
    g = jax.grad(prod_loss)
    eps = 1e-6

    def second(a, b):  # the Hessian, its product with b, and central differences of g
        return jax.hessian(prod_loss)(a), jax.jvp(g, (a,), (b,))[1], g(a + eps * b), g(a - eps * b)

    hess, hv, g_plus, g_minus = jax.jit(second)(x, v)
    np.testing.assert_allclose(hess, np.diag(diag), rtol=1e-12, atol=1e-14)
    # every rank perturbed: the global Hessian-vector product
    np.testing.assert_allclose(hv, (g_plus - g_minus) / (2 * eps), rtol=1e-6, atol=1e-9)


def _halo(u, comm=None):
    left = vjpmpi.sendrecv(u[-1:], u[:1], prv, nxt, sendtag=3, recvtag=3, comm=comm)
    right = vjpmpi.sendrecv(u[:1], u[-1:], nxt, prv, sendtag=4, recvtag=4, comm=comm)
    return jnp.concatenate([left, u, right])


halo = vjpmpi.ordered_collective(_halo)


def _diffuse(u, steps, remat):
    def step(v, _):
        e = halo(v)
        return v + 0.2 * (e[:-2] - 2 * v + e[2:]), None

    step = jax.checkpoint(step) if remat else step
    return jax.lax.scan(step, u, None, length=steps)[0]


def _diffuse_global(u, steps):
    def step(v, _):
        return v + 0.2 * (jnp.roll(v, 1) - 2 * v + jnp.roll(v, -1)), None

    return jax.lax.scan(step, u, None, length=steps)[0]


@pytest.mark.parametrize("remat", [False, True])
def test_halo_exchange_scan_100_steps_matches_single_process(remat):
    n = 5
    u0 = normal(n, 17)
    target = normal(n, 18)

    def loss(u):
        return jnp.sum((_diffuse(u, 100, remat) - target) ** 2)

    g = jax.jit(jax.grad(loss))(u0)
    u_glob = jnp.concatenate(WORLD.allgather(np.asarray(u0)))
    t_glob = jnp.concatenate(WORLD.allgather(np.asarray(target)))

    @jax.jit
    def reference(u):  # single process: the global field's gradient and final state
        return (jax.grad(lambda v: jnp.sum((_diffuse_global(v, 100) - t_glob) ** 2))(u),
                _diffuse_global(u, 100))

    g_ref, fwd_ref = reference(u_glob)
    np.testing.assert_allclose(g, g_ref[rank * n:(rank + 1) * n], rtol=1e-10, atol=1e-12)
    fwd = jax.jit(lambda u: _diffuse(u, 100, remat))(u0)
    np.testing.assert_allclose(fwd, fwd_ref[rank * n:(rank + 1) * n], rtol=1e-12)


@pytest.mark.parametrize("shape", [(65536,), (256, 3)])  # (f64: 512 KiB; 6 KiB)
def test_transposed_sendrecvs_hold_no_zero_templates(shape):
    """The backward of k chained ring sendrecvs receives each cotangent into the
    cotangent's own buffer, not a zero-filled template per call: the compiled gradient's
    temporaries do not grow with k (XLA:CPU computed every zero template at the start of
    the backward, all live at once). A PROC_NULL shift (a line of ranks) keeps its zeros:
    the end of the line receives nothing. The gradients are exact: the loss weights
    each rank's elements by its own rank, so each input's cotangent names the rank it
    reached after k steps."""
    up = rank - 1 if rank > 0 else MPI.PROC_NULL
    down = rank + 1 if rank + 1 < size else MPI.PROC_NULL
    w = (1.0 + rank) * (1.0 + jnp.arange(np.prod(shape), dtype=jnp.float64).reshape(shape))

    def chain(k, source, dest):
        def loss(v):
            for _ in range(k):  # (the line's first rank receives nothing: zeros)
                t = v if source != MPI.PROC_NULL else jnp.zeros_like(v)
                v = vjpmpi.sendrecv(v, t, source, dest, sendtag=5, recvtag=5) * 0.5
            return jnp.sum(w * v)
        return jax.jit(jax.grad(loss))

    x = normal(shape, 23)
    temps = {}
    for k in (2, 8):
        ring = chain(k, prv, nxt)
        compiled = ring.lower(x).compile()
        temps[k] = compiled.memory_analysis().temp_size_in_bytes
        g = np.asarray(ring(x))
        # x on this rank travels k steps to rank + k, whose weight it gets
        there = (rank + k) % size
        want = 0.5 ** k * (1.0 + there) * (1.0 + np.arange(np.prod(shape))).reshape(shape)
        np.testing.assert_allclose(g, want, rtol=1e-14)
        # a line: what leaves the last rank is dropped, and what reaches it is kept
        line = np.asarray(chain(k, up, down)(x))
        want = (0.5 ** k * (1.0 + rank + k) * (1.0 + np.arange(np.prod(shape))).reshape(shape)
                if rank + k < size else np.zeros(shape))
        np.testing.assert_allclose(line, want, rtol=1e-14)
    nbytes = int(np.prod(shape)) * 8
    assert temps[8] <= temps[2] + 2 * nbytes, (shape, temps)  # (zeros: 6 more templates)


def test_fori_loop_and_checkpoint_of_collectives():
    x = normal(3, 19)

    @jax.checkpoint
    def block(v):
        return jnp.tanh(vjpmpi.allreduce(v, MPI.SUM) / size)

    def loss(v):
        return jnp.sum(jax.lax.fori_loop(0, 10, lambda i, a: block(a), v) ** 2)

    g = jax.jit(jax.grad(loss))(x)
    xs = jnp.stack([jnp.asarray(a) for a in WORLD.allgather(np.asarray(x))])

    def ref(stack):  # every rank holds the same iterate after the first step
        a = stack
        for _ in range(10):
            a = jnp.tanh(jnp.broadcast_to(a.sum(0) / size, a.shape))
        return jnp.sum(a ** 2)  # sum over ranks of each rank's loss

    np.testing.assert_allclose(g, jax.jit(jax.grad(ref))(xs)[rank], rtol=1e-12)


def test_cg_with_distributed_operator():
    n = 4
    a_local = normal((n, n), 20) / np.sqrt(n)
    a_glob = sum(np.asarray(m) @ np.asarray(m).T for m in WORLD.allgather(np.asarray(a_local)))
    a_glob = a_glob + n * np.eye(n)
    b = jnp.asarray(WORLD.bcast(np.random.default_rng(5).standard_normal(n), root=0))

    def matvec(x):  # A = sum over ranks of M_r M_r^T (+ n I), x replicated
        xr = vjpmpi.use_replicated(x)
        return vjpmpi.sum_replicated(a_local @ (a_local.T @ xr)) + n * x

    def loss(rhs):  # (the solution comes out as well: one program for both checks)
        x, _ = jax.scipy.sparse.linalg.cg(matvec, rhs, tol=1e-14)
        return jnp.sum(x ** 2), x

    g, x = jax.jit(jax.grad(loss, has_aux=True))(b)
    np.testing.assert_allclose(x, np.linalg.solve(a_glob, b), rtol=1e-9)
    x_ref = np.linalg.solve(a_glob, np.asarray(b))
    np.testing.assert_allclose(g, 2 * np.linalg.solve(a_glob.T, x_ref), rtol=1e-8)


# ---------------------------------------------------------- replicated pair --
def test_replicated_pair_data_parallel_mean_loss():
    w = jnp.asarray(WORLD.bcast(np.array([0.5, -1.0, 2.0]), root=0))  # replicated weights
    xb = normal((6, 3), 21)  # this rank's batch
    yb = normal(6, 22)

    def mean_loss(weights, sum_op, use_op=vjpmpi.use_replicated):
        local = jnp.sum((xb @ use_op(weights) - yb) ** 2)
        return sum_op(local) / (6 * size)

    @jax.jit
    def three(v):  # the pair, plain allreduce, and sum_replicated without use_replicated
        return (jax.grad(mean_loss)(v, vjpmpi.sum_replicated),
                jax.grad(mean_loss)(v, lambda u: vjpmpi.allreduce(u, MPI.SUM)),
                jax.grad(mean_loss)(v, vjpmpi.sum_replicated, lambda u: u))

    g, g_wrong, g_own = three(w)
    xs = np.concatenate(WORLD.allgather(np.asarray(xb)))
    ys = np.concatenate(WORLD.allgather(np.asarray(yb)))
    g_ref = 2 * xs.T @ (xs @ np.asarray(w) - ys) / len(ys)
    np.testing.assert_allclose(g, g_ref, rtol=1e-12)  # same, correct gradient on every rank
    # the mistake the pair prevents: allreduce's true adjoint counts the replicated
    # loss once per rank, giving size times the gradient
    np.testing.assert_allclose(g_wrong, size * g_ref, rtol=1e-12)
    # and without use_replicated each rank gets only its own batch's contribution
    # (which sums over ranks to the full gradient)
    g_own_ref = 2 * np.asarray(xb).T @ (np.asarray(xb) @ np.asarray(w) - np.asarray(yb)) / len(ys)
    np.testing.assert_allclose(g_own, g_own_ref, rtol=1e-12)
    np.testing.assert_allclose(sum(WORLD.allgather(np.asarray(g_own))), g_ref, rtol=1e-12)


def test_use_replicated_sums_cotangents_and_transposes():
    w = jnp.ones(3)
    g = jax.grad(lambda v: jnp.sum(vjpmpi.use_replicated(v) * (rank + 1)))(w)
    np.testing.assert_allclose(g, np.full(3, size * (size + 1) / 2))
    (t,) = jax.linear_transpose(vjpmpi.sum_replicated, w)(jnp.full(3, 2.0))
    np.testing.assert_array_equal(t, np.full(3, 2.0))  # no communication backward
    (t,) = jax.linear_transpose(vjpmpi.use_replicated, w)(jnp.full(3, float(rank)))
    np.testing.assert_array_equal(t, np.full(3, size * (size - 1) / 2))


# ----------------------------------------------------- ordered_collective --
def test_ordered_collective_halo_gradient_check():
    u = normal(6, 23)
    w = normal(8, 24)
    d = normal(6, 25)
    lowered = jax.jit(halo).lower(u)
    f = lowered.compile()
    _, vjp = jax.vjp(halo, u)
    (ut,) = vjp(w)
    eps = 1e-6
    fd = (gdot(f(u + eps * d), w) - gdot(f(u - eps * d), w)) / (2 * eps)
    assert abs(fd - gdot(d, ut)) <= 1e-8 * max(1.0, abs(fd))
    text = lowered.as_text(debug_info=True)
    assert "vjpmpi._halo" in text  # the unit is named in the program


@pytest.mark.skipif(size != 2, reason="a two-stage pipeline runs on exactly 2 ranks")
def test_ordered_collective_two_stage_pipeline_matches_single_process():
    w0 = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)))
    w1 = jnp.asarray(np.random.default_rng(2).standard_normal((2, 4)))
    x = jnp.asarray(np.random.default_rng(3).standard_normal(3))

    @vjpmpi.ordered_collective
    def pipeline(params):
        if rank == 0:
            h = jnp.tanh(params @ x)
            vjpmpi.send(h, 1, tag=9)
            return jnp.zeros(())
        h = vjpmpi.recv(params[:, 0], 0, tag=9)  # template: shape (4,), values unused
        return jnp.sum((w1 @ h) ** 2) + 0.0 * jnp.sum(params)

    params = w0 if rank == 0 else jnp.zeros((4, 3))
    g = jax.jit(jax.grad(pipeline))(params)
    g_ref = jax.jit(jax.grad(lambda a: jnp.sum((w1 @ jnp.tanh(a @ x)) ** 2)))(w0)
    if rank == 0:
        np.testing.assert_allclose(g, g_ref, rtol=1e-12)


def test_ordered_collective_nests_and_vmaps():
    @vjpmpi.ordered_collective(name="outer")
    def outer(u):
        return halo(halo(u)[1:-1] * 2.0)

    us = normal((3, 5), 26)
    got = jax.vmap(outer)(us)
    # NumPy: halo(u)[1:-1] is u, so outer(u) = halo(2 u): the previous rank's last and
    # the next rank's first entry around this rank's own, all doubled
    every = np.stack(WORLD.allgather(np.asarray(us)))  # (rank, batch, 5)
    want = 2 * np.concatenate([every[prv][:, -1:], every[rank], every[nxt][:, :1]], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    np.testing.assert_allclose(outer(us[0]), want[0], rtol=1e-14)  # unbatched, eager
    lo = lambda v: jnp.sum(outer(v) ** 2)  # noqa: E731
    d = normal(5, 27)
    eps = 1e-6
    value_and_grad = jax.jit(jax.value_and_grad(lo))
    _, g = value_and_grad(us[0])
    fd = (WORLD.allreduce(float(value_and_grad(us[0] + eps * d)[0]))
          - WORLD.allreduce(float(value_and_grad(us[0] - eps * d)[0]))) / (2 * eps)
    assert abs(fd - gdot(d, g)) <= 1e-6 * max(1.0, abs(fd))


# send_recv included: its backward receive on the sending rank has a constant template,
# which a second linearization still runs (vjpmpi gives it a zero tangent there).
@pytest.mark.parametrize("name", list(LINEAR))
def test_second_order_through_every_linear_op(name):
    f, shape = LINEAR[name]
    x, v = normal(shape, 28), normal(shape, 29)

    def loss(u):
        return jnp.sum(jnp.sin(f(u)))

    g = jax.grad(loss)
    eps = 1e-5

    def second(a, b):  # the Hessian-vector product and central differences of g
        return jax.jvp(g, (a,), (b,))[1], g(a + eps * b), g(a - eps * b)

    hv, g_plus, g_minus = jax.jit(second)(x, v)
    np.testing.assert_allclose(hv, (g_plus - g_minus) / (2 * eps), rtol=1e-6, atol=1e-8)
