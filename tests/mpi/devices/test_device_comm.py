"""Every device a rank (`vjpmpi.device_comm`): each op's values against NumPy on the global
data of all P x D ranks, its transpose by the rank-summed dot-product test, ranks that
each device computes (roots and peers from its rank), batching that differs between
processes, order through loops and branches, what XLA compiles, and the errors.

Runs at P processes of D CPU devices each (tests/test_multirank.py, test_devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import vjpmpi

from helpers import WORLD

D = len(jax.devices())
PROCS, PROC = WORLD.size, WORLD.rank
# what a run's failure raises (docs/concepts/agreement.md): ValueError at the call on one
# device; jax.errors.JaxRuntimeError where a program over several devices is used
RUN_ERROR = ValueError if D == 1 else jax.errors.JaxRuntimeError
N = PROCS * D  # the device communicator's size
MESH = Mesh(np.array(jax.devices()), ("d",))
MINE = slice(PROC * D, (PROC + 1) * D)  # this process's ranks


def comm():
    return vjpmpi.device_comm("d")


def run(body, *xs, out=P("d")):
    """`body` in a shard_map over this process's devices; `xs` stacked per device."""
    f = jax.shard_map(body, mesh=MESH, in_specs=tuple(P("d") for _ in xs), out_specs=out)
    return jax.jit(f)(*xs)


def per_rank(shape, salt=0, dtype=np.float64):
    """Data of every rank of the device communicator, [N, *shape] (the same everywhere)."""
    g = np.random.default_rng(1234 + salt)
    return g.standard_normal((N, *shape)).astype(dtype)


def local(a):
    """This process's devices' rows of a global [N, ...] array, as shard_map inputs."""
    return jnp.asarray(a[MINE].reshape(D * a.shape[1], *a.shape[2:]) if a.ndim > 1 else a[MINE])


def mine(y, rows=1):
    """A shard_map result (each device's `rows` rows) as [D, rows, ...]."""
    y = np.asarray(y)
    return y.reshape(D, rows, *y.shape[1:]) if rows != 1 else y.reshape(D, *y.shape[1:])


# (name, op on (x, comm), its input per rank, its expected result per rank [N, ...])
X = per_rank((2, 3))
ROOT = N - 1


def _exscan(a):
    return np.concatenate([np.zeros((1, *a.shape[1:])), np.cumsum(a, 0)[:-1]])


BLOCKS = per_rank((N, 2), salt=1)  # alltoall / reduce_scatter inputs: [N ranks, N blocks, 2]
OPS = {
    "allreduce": (lambda x, c: vjpmpi.allreduce(x, MPI.SUM, comm=c), X, np.stack([X.sum(0)] * N)),
    "allreduce_max": (lambda x, c: vjpmpi.allreduce(x, MPI.MAX, comm=c), X, np.stack([X.max(0)] * N)),
    "bcast": (lambda x, c: vjpmpi.bcast(x, ROOT, comm=c), X, np.stack([X[ROOT]] * N)),
    "reduce": (lambda x, c: vjpmpi.reduce(x, MPI.SUM, 0, comm=c), X,
               np.stack([X.sum(0)] + list(X[1:]))),
    "allgather": (lambda x, c: vjpmpi.allgather(x, comm=c), X, np.stack([X] * N)),
    "gather": (lambda x, c: vjpmpi.gather(x, ROOT, comm=c), X,
               np.stack([np.zeros_like(X)] * (N - 1) + [X])),
    "scatter": (lambda x, c: vjpmpi.scatter(x, 0, comm=c), BLOCKS, np.stack(
        [BLOCKS[0][r] for r in range(N)])),
    "alltoall": (lambda x, c: vjpmpi.alltoall(x, comm=c), BLOCKS, BLOCKS.transpose(1, 0, 2)),
    "reduce_scatter": (lambda x, c: vjpmpi.reduce_scatter(x, MPI.SUM, comm=c), BLOCKS,
                       BLOCKS.sum(0)),
    "scan": (lambda x, c: vjpmpi.scan(x, MPI.SUM, comm=c), X, np.cumsum(X, 0)),
    "scan_prod": (lambda x, c: vjpmpi.scan(x, MPI.PROD, comm=c), X, np.cumprod(X, 0)),
    "exscan": (lambda x, c: vjpmpi.exscan(x, MPI.SUM, comm=c), X, _exscan(X)),
    "exscan_min": (lambda x, c: vjpmpi.exscan(x, MPI.MIN, comm=c), X, np.concatenate(
        [np.full((1, 2, 3), np.inf), np.minimum.accumulate(X, 0)[:-1]])),
    "sendrecv_ring": (lambda x, c: vjpmpi.sendrecv(x, x, (c.rank - 1) % c.size,
                                                   (c.rank + 1) % c.size, comm=c),
                      X, np.roll(X, 1, 0)),
    "sendrecv_back2": (lambda x, c: vjpmpi.sendrecv(x, x * 0, (c.rank + 2) % c.size,
                                                    (c.rank - 2) % c.size, sendtag=3,
                                                    recvtag=3, comm=c),
                       X, np.roll(X, -2, 0)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_values_against_numpy(name):
    op, x, want = OPS[name]
    got = run(lambda v: op(v.reshape(x.shape[1:]), comm())[None], local(x))
    np.testing.assert_allclose(np.asarray(got), want[MINE], rtol=1e-12, atol=1e-12, err_msg=name)


def test_send_recv_pairs_across_and_within_processes():
    """Even ranks send to the next odd one, which receives (both kinds of pair when D > 1:
    within a process and, at D = 1, across processes)."""
    def body(v):
        c = comm()
        even = c.rank % 2 == 0
        peer = jnp.where(even, c.rank + 1, c.rank - 1)
        ok = (c.rank + 1 < c.size) | ~even
        peer = jnp.where(ok, peer, MPI.PROC_NULL)
        # every device runs both calls; one of them is to MPI.PROC_NULL
        vjpmpi.send(v, jnp.where(even, peer, MPI.PROC_NULL), comm=c)
        return vjpmpi.recv(v * 0 - 1, jnp.where(even, MPI.PROC_NULL, peer), comm=c)

    got = mine(run(lambda v: body(v.reshape(2, 3))[None], local(X)))
    want = np.stack([X[r - 1] if r % 2 else -np.ones((2, 3)) for r in range(N)])
    np.testing.assert_allclose(got, want[MINE])


def test_roots_and_peers_each_device_computes():
    """A root every device computes (N - 1 - the process's first rank, the same on all:
    checked when it runs), and a shift whose peers depend on the rank."""
    def body(v):
        c = comm()
        root = (c.size - 1) + 0 * c.rank
        b = vjpmpi.bcast(v, root, comm=c)
        r = vjpmpi.reduce(v, MPI.SUM, root, comm=c)
        shift = vjpmpi.sendrecv(v, v, jnp.where(c.rank > 0, c.rank - 1, MPI.PROC_NULL),
                                jnp.where(c.rank + 1 < c.size, c.rank + 1, MPI.PROC_NULL),
                                comm=c)
        return jnp.stack([b, r, shift])[None]

    got = mine(run(lambda v: body(v.reshape(2, 3)), local(X)))
    want_r = np.stack(list(X[:-1]) + [X.sum(0)])
    want_s = np.concatenate([X[:1], X[:-1]])  # (rank 0 keeps its template: PROC_NULL)
    np.testing.assert_allclose(got[:, 0], np.stack([X[N - 1]] * N)[MINE])
    np.testing.assert_allclose(got[:, 1], want_r[MINE])
    np.testing.assert_allclose(got[:, 2], want_s[MINE])


def gdot_devices(a, b):
    """Rank-summed inner product over every device of every process."""
    return WORLD.allreduce(float(np.vdot(np.asarray(a), np.asarray(b))))


LINEAR = ["allreduce", "bcast", "reduce", "allgather", "gather", "scatter", "alltoall",
          "reduce_scatter", "scan", "exscan", "sendrecv_ring", "sendrecv_back2"]


@pytest.mark.parametrize("name", LINEAR)
def test_dot_product_of_each_transpose(name):
    """<F(x), w> = <x, F^T(w)>, inner products summed over all P x D ranks."""
    op, x, want = OPS[name]
    shape = x.shape[1:]
    f = jax.shard_map(lambda v: op(v.reshape(shape), comm())[None], mesh=MESH,
                      in_specs=P("d"), out_specs=P("d"))
    xs = local(per_rank(shape, salt=5))
    ws = jnp.asarray(np.random.default_rng(9 + PROC).standard_normal((D, *want.shape[1:])))
    y = jax.jit(f)(xs)
    (ct,) = jax.jit(lambda w: jax.linear_transpose(f, xs)(w))(ws)
    lhs, rhs = gdot_devices(y, ws), gdot_devices(xs, ct)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (name, lhs, rhs)


@pytest.mark.parametrize("name", LINEAR)
def test_jvp_and_vmap_of_each_op_keep_the_typing(name):
    """Forward mode and batching inside shard_map under JAX's default check_vma (each rule
    carries the varying-manual-axes type, or JAX raises): the JVP of a linear op is the op
    of the tangent; a vmap over two batches in the body (processes batching data that
    differs) is each batch's call."""
    op, x, want = OPS[name]
    shape = x.shape[1:]
    f = jax.shard_map(lambda v: op(v.reshape(shape), comm())[None], mesh=MESH,
                      in_specs=P("d"), out_specs=P("d"))
    xs = local(per_rank(shape, salt=11))
    ts = jnp.asarray(np.random.default_rng(21 + PROC).standard_normal(xs.shape))
    y, yt = jax.jit(lambda a, t: jax.jvp(f, (a,), (t,)))(xs, ts)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(f)(xs)), rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(np.asarray(yt), np.asarray(jax.jit(f)(ts)), rtol=1e-12,
                               atol=1e-12, err_msg=name)

    def batched(v):
        u = v.reshape(shape)
        return jax.vmap(lambda w: op(w, comm()))(jnp.stack([u, 2 * u + 1 + PROC]))[None]

    got = jax.jit(jax.shard_map(batched, mesh=MESH, in_specs=P("d"), out_specs=P("d")))(xs)
    per = [jax.jit(f)(xs), jax.jit(f)(2 * xs + 1 + PROC)]
    np.testing.assert_allclose(np.asarray(got), np.stack([np.asarray(p) for p in per], axis=1),
                               rtol=1e-12, atol=1e-12, err_msg=name)


def test_gradient_of_a_loss_against_finite_differences():
    """A nonlinear loss of allreduce(MAX), scan(PROD) and a ring: grad against central
    differences of the same (global) function, one direction per process."""
    def loss(v):
        def body(v):
            c = comm()
            v = v.reshape(2, 3)
            m = vjpmpi.allreduce(v * (1 + 0.1 * c.rank), MPI.MAX, comm=c)
            p = vjpmpi.scan(1 + 0.1 * v, MPI.PROD, comm=c)
            s = vjpmpi.sendrecv(jnp.sin(v), v, (c.rank - 1) % c.size, (c.rank + 1) % c.size,
                                comm=c)
            return (jnp.sum(m * p) + jnp.sum(s * v))[None]
        return jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d"))(v).sum()

    x = local(X)
    g = jax.jit(jax.grad(loss))(x)
    direction = jnp.asarray(np.random.default_rng(3 + PROC).standard_normal(x.shape))
    eps = 1e-6
    up, down = jax.jit(loss)(x + eps * direction), jax.jit(loss)(x - eps * direction)
    fd = WORLD.allreduce(float(up - down)) / (2 * eps)
    assert abs(gdot_devices(g, direction) - fd) < 1e-5 * max(1.0, abs(fd))


def test_vmap_differs_between_processes():
    """Each process batches along another axis (process 0 along axis 0, the others along
    axis 1): the ranks' blocks still pair."""
    axis = 0 if PROC == 0 else 1

    def body(v):
        v = v.reshape(2, 3)
        stacked = jnp.stack([v, 2 * v], axis=axis)
        return jax.vmap(lambda u: vjpmpi.allreduce(u, MPI.SUM, comm=comm()), in_axes=axis)(
            stacked)[None]

    got = mine(run(body, local(X)))
    np.testing.assert_allclose(got, np.stack([np.stack([X.sum(0), 2 * X.sum(0)])] * D))


def test_order_through_loops_and_branches_and_the_compiled_program():
    """A fori_loop of collectives and a cond whose predicate differs between processes
    (the same on a process's devices, the same collectives in both branches): the
    values, and the device calls on one token chain in what XLA compiled."""
    def body(v):
        c = comm()
        v = v.reshape(2, 3)

        def step(i, u):
            u = vjpmpi.allreduce(u, MPI.SUM, comm=c) / c.size
            return vjpmpi.sendrecv(u, u, (c.rank - 1) % c.size, (c.rank + 1) % c.size, comm=c)

        u = jax.lax.fori_loop(0, 3, step, v)
        u = jax.lax.cond(PROC % 2 == 0, lambda w: vjpmpi.bcast(w, 0, comm=c),
                         lambda w: vjpmpi.bcast(w * 2, 0, comm=c), u)
        return u[None]

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d")))
    got = mine(f(local(X)))
    want = X.mean(0)
    np.testing.assert_allclose(got, np.stack([want] * D), rtol=1e-12)
    hlo = f.lower(local(X)).compile().as_text()
    assert hlo.count('custom_call_target="vjpmpi_allreduce_dev"') == 1
    assert 'custom_call_target="vjpmpi_sendrecv_dev"' in hlo
    assert 'custom_call_target="vjpmpi_allreduce"' not in hlo  # (no one-device call)


def test_size_and_rank():
    def body(v):
        c = comm()
        return jnp.stack([c.rank, c.Get_size() + 0 * c.rank])[None]

    got = mine(run(body, jnp.zeros(D)))
    np.testing.assert_array_equal(got[:, 0], np.arange(N)[MINE])
    assert (got[:, 1] == N).all() and comm_size_outside() == N


def comm_size_outside():
    out = []
    jax.jit(jax.shard_map(lambda v: out.append(comm().size) or v, mesh=MESH, in_specs=P("d"),
                          out_specs=P("d")))(jnp.zeros(D))
    return out[0]


# ------------------------------------------------------------------ errors --
def test_device_comm_outside_shard_map_is_refused():
    with pytest.raises(ValueError, match=r"vjpmpi.device_comm: no mesh axis 'd' of a jax.shard_map"):
        vjpmpi.device_comm("d")
    with pytest.raises(ValueError, match=r"no mesh axis 'e'"):
        run(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=vjpmpi.device_comm("e")), jnp.zeros(D))
    with pytest.raises(TypeError, match=r"argument 'axis_name' must be a mesh axis name"):
        vjpmpi.device_comm(0)
    leaked = []
    run(lambda v: leaked.append(comm()) or v, jnp.zeros(D))
    with pytest.raises(ValueError, match=r"vjpmpi.allreduce: a device communicator .* used "
                                         r"outside the jax.shard_map"):
        jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=leaked[0]))(jnp.zeros(3))


def test_a_branch_whose_devices_differ_is_refused():
    """A cond whose predicate varies over the devices, with a collective in one branch
    only: refused when the program is lowered, on every rank (no device waits)."""
    def body(v):
        c = comm()
        return jax.lax.cond(c.rank % 2 == 0, lambda w: vjpmpi.allreduce(w, MPI.SUM, comm=c),
                            lambda w: w, v)

    with pytest.raises(ValueError, match=r"a lax.cond whose predicate varies over mesh axis "
                                         r"'d' has different collectives in its branches"):
        run(body, jnp.zeros(D))


def test_a_root_outside_the_communicator_fails_on_every_rank():
    """A root each device computes, out of range on one device only: the call fails on
    every rank when it runs (the processes agree before any data moves)."""
    def body(v):
        c = comm()
        return vjpmpi.bcast(v, jnp.where(c.rank == 0, c.size + 5, 0), comm=c)

    with pytest.raises(RUN_ERROR, match=r"outside the device communicator"):
        np.asarray(run(body, jnp.zeros(D)))
    # the ranks are still in step: a collective after it pairs
    assert float(vjpmpi.allreduce(jnp.ones(()), MPI.SUM)) == PROCS


def test_gather_and_scatter_shapes_on_devices():
    """On a device communicator every device's gather result is stacked (zeros off the
    root) and scatter takes the stacked shape everywhere."""
    def body(v):
        c = comm()
        g = vjpmpi.gather(v, 0, comm=c)
        with pytest.raises(ValueError, match=r"leading axis of length comm size"):
            vjpmpi.scatter(v, 0, comm=c)
        return g[None]

    got = run(body, jnp.arange(D * 1.0))
    assert got.shape == (D, N, 1)


# ------------------------------------------------- variable-size exchanges --
def _ragged(v):
    """Rank r sends (r + j) % 3 rows of value 100 r + j to each rank j, into block r of j's
    output (JAX's ragged_all_to_all: offsets named by the sender)."""
    c = comm()
    r = c.rank
    j = jnp.arange(N)
    sizes = ((j + r) % 3).astype(jnp.int32)
    operand = (100.0 * r + jnp.repeat(j, 3)).reshape(3 * N, 1) + v[0]
    out = jnp.full((3 * N, 1), -1.0)
    return vjpmpi.ragged_alltoall(operand, out, (3 * j).astype(jnp.int32), sizes,
                                  jnp.full(N, 3 * r, jnp.int32), ((j + r) % 3).astype(jnp.int32),
                                  comm=c)


def test_variable_size_exchanges_between_devices():
    got = mine(run(lambda v: _ragged(v)[None], jnp.zeros(D)))[..., 0]
    want = -np.ones((N, 3 * N))
    for r in range(N):
        for s in range(N):
            want[r, 3 * s:3 * s + (r + s) % 3] = 100 * s + r
    np.testing.assert_allclose(got, want[MINE])

    def vs(v):
        c = comm()
        r = c.rank
        x = (10.0 * r + jnp.arange(1.0 * N))[:, None]
        k = (r % 2 + 1).astype(jnp.int32)
        ag, _ = vjpmpi.allgatherv(x, k, capacity=2 * N, comm=c)
        g, counts = vjpmpi.gatherv(x, k, root=N - 1, capacity=2 * N, comm=c)
        sv, got = vjpmpi.scatterv(jnp.arange(2.0 * N)[:, None], jnp.full(N, 2, jnp.int32),
                                  root=0, capacity=2, comm=c)
        av, _ = vjpmpi.alltoallv(x, jnp.ones(N, jnp.int32), capacity=N, comm=c)
        return jnp.concatenate([ag[:, 0], g[:, 0], counts.astype(x.dtype), sv[:, 0],
                                got[None].astype(x.dtype), av[:, 0]])[None]

    got = mine(run(vs, jnp.zeros(D)))
    rows = np.concatenate([10.0 * r + np.arange(r % 2 + 1) for r in range(N)])
    packed = np.concatenate([rows, np.zeros(2 * N - len(rows))])
    for a in range(D):
        r = PROC * D + a
        row = got[a]
        np.testing.assert_allclose(row[:2 * N], packed)
        np.testing.assert_allclose(row[2 * N:4 * N], packed if r == N - 1 else 0 * packed)
        np.testing.assert_allclose(row[4 * N:5 * N], [(s % 2 + 1) * (r == N - 1) for s in range(N)])
        np.testing.assert_allclose(row[5 * N:5 * N + 3], [2 * r, 2 * r + 1, 2])
        np.testing.assert_allclose(row[5 * N + 3:], [10.0 * s + r for s in range(N)])


def test_dot_product_of_the_ragged_transpose():
    f = jax.shard_map(lambda v: _ragged(v)[None], mesh=MESH, in_specs=P("d"), out_specs=P("d"))
    xs = jnp.asarray(np.random.default_rng(PROC).standard_normal(D))
    ws = jnp.asarray(np.random.default_rng(50 + PROC).standard_normal((D, 3 * N, 1)))
    y0 = jax.jit(f)(jnp.zeros(D))
    lin = lambda v: jax.jit(f)(v) - y0  # noqa: E731 (linear in v: each slice row + v)
    (ct,) = jax.jit(lambda w: jax.linear_transpose(f, xs)(w))(ws)
    lhs, rhs = gdot_devices(lin(xs), ws), gdot_devices(xs, ct)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (lhs, rhs)


# ------------------------------------------------------------- started calls --
def test_started_calls_between_devices():
    """start/wait of a sendrecv ring and of a send/recv pair split in halves; the
    transpose of the whole by the dot-product test (the templates from `v`, as the
    receives of a linear map: a constant template's receive would run in the forward
    pass that linear_transpose keeps, its send in the transposed one)."""
    def body(v):
        c = comm()
        r = c.rank
        p = vjpmpi.start(vjpmpi.sendrecv, v, v * 0, (r - 1) % c.size, (r + 1) % c.size, comm=c)
        s = vjpmpi.start(vjpmpi.send, v * 10, (r + 1) % c.size, tag=5, comm=c)
        q = vjpmpi.start(vjpmpi.recv, v * 0, (r - 1) % c.size, tag=5, comm=c)
        y = vjpmpi.wait(p) + vjpmpi.wait(q)
        vjpmpi.wait(s)
        return y

    f = jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d"))
    xs = local(X).reshape(-1)
    got = np.asarray(jax.jit(f)(xs)).reshape(D, -1)
    np.testing.assert_allclose(got, 11 * np.roll(X, 1, 0).reshape(N, -1)[MINE])
    ws = jnp.asarray(np.random.default_rng(8 + PROC).standard_normal(xs.shape))
    (ct,) = jax.jit(lambda w: jax.linear_transpose(f, xs)(w))(ws)
    lhs, rhs = gdot_devices(jax.jit(f)(xs), ws), gdot_devices(xs, ct)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (lhs, rhs)
