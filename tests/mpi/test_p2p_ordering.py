"""Point-to-point ops and the ordering guarantee under every control-flow construct.

The "hot potato" rings below deadlock if any rank executes its sends and
receives out of program order (rank 0 sends first, every other rank receives
first), so passing them within mpiexec's timeout is the ordering check.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi

from helpers import WORLD, kernel_calls, to_device

rank, size = WORLD.rank, WORLD.size
needs2 = pytest.mark.skipif(size < 2, reason="needs at least 2 ranks")


def _overlaps():
    return kernel_calls()[1]


def hot_potato(x):
    """Pass x around the ring once, each rank adding its rank; returns what came back."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if rank == 0:
        vjpmpi.send(x, nxt)
        return vjpmpi.recv(x, prv)
    y = vjpmpi.recv(x, prv)
    vjpmpi.send(y + rank, nxt)
    return y


def ring_total(x0):
    return x0 + sum(range(size))


@needs2
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_hot_potato(mode):
    f = hot_potato if mode == "eager" else jax.jit(hot_potato)
    x = to_device(np.arange(3.0))
    y = f(x)
    if rank == 0:
        np.testing.assert_array_equal(y, ring_total(np.arange(3.0)))


@needs2
@pytest.mark.parametrize("loop", ["fori_loop", "scan", "while_loop"])
def test_hot_potato_in_loops(loop):
    def step(x):
        return hot_potato(x) if rank == 0 else (hot_potato(x), x)[1]

    n = 5

    @jax.jit
    def f(x):
        if loop == "fori_loop":
            return jax.lax.fori_loop(0, n, lambda i, v: step(v), x)
        if loop == "scan":
            return jax.lax.scan(lambda v, _: (step(v), None), x, None, length=n)[0]
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, step(c[1])), (0, x))[1]

    y = f(to_device(np.zeros(2)))
    if rank == 0:
        np.testing.assert_array_equal(y, np.full(2, n * sum(range(size)), float))


@needs2
def test_hot_potato_in_cond():
    @jax.jit
    def f(x, p):
        return jax.lax.cond(p > 0, hot_potato, lambda v: hot_potato(v) * 0, x)

    y = f(to_device(np.ones(2)), 1)
    if rank == 0:
        np.testing.assert_array_equal(y, ring_total(np.ones(2)))


@needs2
def test_reversed_pairs_need_program_order():
    # Two independent messages with different tags, received in the opposite order
    # to how they were sent would deadlock with synchronous semantics for large sizes.
    big = to_device(np.arange(200_000.0))

    @jax.jit
    def f(a, b):
        if rank == 0:
            vjpmpi.send(a, 1, tag=1)
            vjpmpi.send(b, 1, tag=2)
            return a, b
        if rank == 1:
            ra = vjpmpi.recv(a, 0, tag=1)
            rb = vjpmpi.recv(b, 0, tag=2)
            return ra, rb
        return a, b

    ra, rb = f(big, to_device(2 * np.arange(200_000.0)))
    if rank == 1:
        np.testing.assert_array_equal(ra, np.arange(200_000.0))
        np.testing.assert_array_equal(rb, 2 * np.arange(200_000.0))


def test_independent_collectives_keep_program_order():
    # Independent collectives on different data in one program, mixed with compute:
    # every rank must issue them in source order or the payloads would swap.
    before = _overlaps()

    @jax.jit
    def f(a, b, c):
        ra = vjpmpi.allreduce(a, MPI.SUM)
        rb = vjpmpi.bcast(b, size - 1)
        rc = vjpmpi.allgather(jnp.sin(c))
        rd = vjpmpi.allreduce(jnp.cos(c).sum(), MPI.MAX)
        return ra, rb, rc, rd

    a = to_device(np.full(1000, rank + 1.0))
    b = to_device(np.full(7, rank * 1.0))
    c = to_device(np.arange(5.0) + rank)
    for _ in range(20):
        ra, rb, rc, rd = f(a, b, c)
    np.testing.assert_array_equal(ra, np.full(1000, size * (size + 1) / 2))
    np.testing.assert_array_equal(rb, np.full(7, size - 1.0))
    np.testing.assert_allclose(rc, np.sin(np.arange(5.0)[None] + np.arange(size)[:, None]),
                               rtol=1e-6)
    assert _overlaps() == before


def test_separately_jitted_programs_in_call_order():
    before = _overlaps()
    f = jax.jit(lambda x: vjpmpi.allreduce(x, MPI.SUM))
    g = jax.jit(lambda x: vjpmpi.bcast(x * 2, 0))
    h = jax.jit(lambda x: vjpmpi.scan(x, MPI.SUM))
    big = to_device(np.ones(500_000) * (rank + 1))
    small = to_device(np.ones(3) * (rank + 1))
    outs = [(f(big), g(small), h(small)) for _ in range(10)]
    for a, b, c in (map(np.asarray, out) for out in outs):  # NumPy: no compile per slice
        assert float(a[0]) == size * (size + 1) / 2
        assert float(b[0]) == 2.0
        assert float(c[0]) == (rank + 1) * (rank + 2) / 2
    assert _overlaps() == before


def test_eager_calls_in_call_order():
    before = _overlaps()
    big = to_device(np.ones(500_000) * (rank + 1))
    small = to_device(np.ones(3) * (rank + 1))
    res = [(vjpmpi.allreduce(big, MPI.SUM), vjpmpi.allgather(small), vjpmpi.exscan(small, MPI.SUM))
           for _ in range(10)]
    for a, b, c in (map(np.asarray, r) for r in res):  # NumPy: no compile per slice
        assert float(a[-1]) == size * (size + 1) / 2
        np.testing.assert_array_equal(b[:, 0], np.arange(1, size + 1))
        assert float(c[0]) == rank * (rank + 1) / 2
    assert _overlaps() == before


@needs2
def test_recv_status_any_source_and_tag():
    # A communicator of its own: wildcard receives must not see other tests' messages.
    comm = WORLD.Dup()
    status = MPI.Status()
    if rank == 0:
        got = {}
        for _ in range(size - 1):
            y = vjpmpi.recv(to_device(np.zeros(2)), status=status, comm=comm)
            got[status.Get_source()] = (np.asarray(y), status.Get_tag())
        for src in range(1, size):
            np.testing.assert_array_equal(got[src][0], np.full(2, float(src)))
            assert got[src][1] == 10 + src
    else:
        vjpmpi.send(to_device(np.full(2, float(rank))), 0, tag=10 + rank, comm=comm)
    comm.Barrier()
    comm.Free()


@needs2
def test_sendrecv_status_and_tags():
    status = MPI.Status()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    y = jax.jit(lambda x: vjpmpi.sendrecv(x, x, prv, nxt, sendtag=rank, recvtag=prv,
                                          status=status))(to_device(np.full(3, rank)))
    np.testing.assert_array_equal(y, np.full(3, prv))
    assert status.Get_source() == prv and status.Get_tag() == prv


def test_proc_null_peers():
    # A non-periodic shift: the ends talk to MPI.PROC_NULL and keep the template.
    nxt = rank + 1 if rank + 1 < size else MPI.PROC_NULL
    prv = rank - 1 if rank > 0 else MPI.PROC_NULL
    tmpl = to_device(np.full(2, -1.0))
    y = jax.jit(lambda x, t: vjpmpi.sendrecv(x, t, prv, nxt))(to_device(np.full(2, float(rank))),
                                                              tmpl)
    np.testing.assert_array_equal(y, np.full(2, float(rank - 1) if rank > 0 else -1.0))


def test_sendrecv_different_shapes():
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    y = vjpmpi.sendrecv(to_device(np.full((2, 3), float(rank))), to_device(np.zeros((2, 3))), prv,
                        nxt)
    np.testing.assert_array_equal(y, np.full((2, 3), float(prv)))
    # a recvbuf of another shape but the same number of elements
    y = vjpmpi.sendrecv(to_device(np.full((6,), float(rank))), to_device(np.zeros((3, 2))), prv,
                        nxt)
    assert y.shape == (3, 2)


def test_vmap_send_recv_pair():
    if size < 2:
        pytest.skip("needs 2 ranks")
    xs = to_device(np.arange(12.0).reshape(4, 3))
    if rank == 0:
        jax.vmap(lambda v: vjpmpi.send(v, 1))(xs)
    elif rank == 1:
        y = jax.vmap(lambda v: vjpmpi.recv(v, 0))(to_device(np.zeros((4, 3))))
        np.testing.assert_array_equal(y, np.arange(12.0).reshape(4, 3))


def test_vmap_is_one_call():
    ones = to_device(np.ones((64, 4)))
    calls0 = kernel_calls()[0]
    jax.vmap(lambda v: vjpmpi.allreduce(v, MPI.SUM))(ones).block_until_ready()
    assert kernel_calls()[0] == calls0 + 1
    jaxpr = jax.make_jaxpr(jax.vmap(lambda v: vjpmpi.allgather(v)))(ones)
    assert str(jaxpr).count("vjpmpi_allgather") == 1


def test_barrier():
    for _ in range(3):
        vjpmpi.barrier()
    jax.jit(lambda x: (vjpmpi.barrier(), x + 1)[1])(1.0).block_until_ready()


@needs2
def test_mpi_runtime_error_is_an_exception():
    # rank 1 sends 10 elements, rank 0 expects 5: MPI_ERR_TRUNCATE, reported not aborted.
    if rank == 1:
        vjpmpi.send(to_device(np.ones(10)), 0, tag=77)
    elif rank == 0:
        with pytest.raises(Exception, match=r"vjpmpi\.recv.*(MPI_Recv|VJPMPI_CHECK)"):
            vjpmpi.recv(to_device(np.zeros(5)), 1, tag=77).block_until_ready()
    vjpmpi.barrier()


def test_no_recompilation_with_fresh_objects():
    import resource

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None
    )
    x = to_device(np.ones(4))
    vjpmpi.allreduce(x, MPI.SUM, comm=MPI.Comm(WORLD)).block_until_ready()  # warm up
    n0 = len(compiles)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(1000):
        y = vjpmpi.allreduce(x, MPI.Op(MPI.SUM), comm=MPI.Comm(WORLD))
    y.block_until_ready()
    assert len(compiles) == n0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss1 - rss0 < 20 * 1024  # KiB: no per-call growth (mpi4jax: +1.45 MiB per call)


def test_nested_jit_and_regions_never_overlap():
    # Collectives in nested jitted functions, loop bodies and branches sit in other
    # XLA computations, joined to the outer chain through their operands and results;
    # XLA:CPU must run them one at a time.
    before = _overlaps()
    inner = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))

    @jax.jit
    def f(x, y, z):
        a = vjpmpi.allreduce(x, MPI.SUM)
        b = inner(y)
        c = jax.lax.fori_loop(0, 3, lambda i, v: vjpmpi.allreduce(v, MPI.MAX), z)
        d = jax.lax.cond(x[0] > 0, lambda v: vjpmpi.bcast(v, 0), lambda v: v, y)
        e = vjpmpi.allgather(z[:4])
        return a, b, c, d, e

    x = to_device(np.full(300_000, rank + 1.0))
    y = to_device(np.full(300_000, rank * 2.0))
    z = to_device(np.arange(8.0) * (rank + 1))
    for _ in range(10):
        a, b, c, d, e = f(x, y, z)
    a, b, d = np.asarray(a), np.asarray(b), np.asarray(d)  # NumPy slices: no compiles
    np.testing.assert_array_equal(a[:3], np.full(3, size * (size + 1) / 2))
    np.testing.assert_array_equal(b[:3], np.full(3, size * (size - 1.0)))
    np.testing.assert_array_equal(c, np.arange(8.0) * size)
    np.testing.assert_array_equal(d[:3], np.zeros(3))
    np.testing.assert_array_equal(e, np.arange(4.0)[None] * (np.arange(size)[:, None] + 1))
    assert _overlaps() == before


# --------------------------------------------- no copies of the exchanged arrays --
def _copies(hlo: str, n: int) -> int:
    """The copies of an array of n float32 that compiled HLO text makes in each step of
    its loops (XLA's `copy` ops in the while bodies; none: in the whole program)."""
    bodies = set(re.findall(r"body=(%[\w.-]+)", hlo))
    parts = re.split(r"\n(?=%|ENTRY)", hlo)
    texts = [t for t in parts if t.split(" ", 1)[0] in bodies] if bodies else [hlo]
    return sum(len(re.findall(rf"= f32\[{n}\]\{{0\}} copy\(", t)) for t in texts)


def _pingpong(c):
    """Half a round trip between rank pairs (compiled only: the peers may be this rank)."""
    peer = rank ^ 1 if rank ^ 1 < size else rank
    if rank % 2 == 0:
        vjpmpi.send(c, peer)
        return vjpmpi.recv(c, peer)
    c = vjpmpi.recv(c, peer)
    vjpmpi.send(c, peer)
    return c


def test_exchanged_arrays_are_not_copied():
    """XLA copies no exchanged array where none must be: two arrays carried through a
    loop and exchanged in turn (`b = sendrecv(a, b)`: the result takes its template's
    buffer), as mpi4py's floor swaps its two buffers, and send + recv, compile to no
    copy (and so does the same swap of started calls, vjpmpi.start / wait, which MPI
    makes in XLA's buffers); `c = sendrecv(c, c)` (the array sent is its own template) to
    one in a loop (the result into the loop's carry, while the array sent is read) and to
    none outside one.
    Its result used to take the template's buffer there too, which XLA must keep for the
    send: a copy before the call, and another into the carry (issue 61: a 16 MiB exchange
    at 2.1x mpi4py's time)."""
    n = 1 << 14
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    x = jnp.ones(n, jnp.float32)

    def exchange(a, b):
        return vjpmpi.sendrecv(a, b, prv, nxt, sendtag=0, recvtag=0)

    def swap(i, ab, exchange=exchange):
        a, b = ab
        b = exchange(a, b)
        return exchange(b, a), b

    def started(a, b):  # (MPI reads and writes XLA's buffers: the wait's result is r's)
        return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, a, b, prv, nxt, sendtag=0, recvtag=0))

    programs = {  # name: (function, arguments, most copies)
        "swap": (lambda a, b: jax.lax.fori_loop(0, 8, swap, (a, b)), (x, x + 1), 0),
        "started": (lambda a, b: jax.lax.fori_loop(0, 8, lambda i, ab: swap(i, ab, started),
                                                   (a, b)), (x, x + 1), 0),
        "carry": (lambda c: jax.lax.fori_loop(0, 8, lambda i, c: exchange(c, c), c), (x,), 1),
        "once": (lambda c: exchange(c, c) * c, (x,), 0),
        "pingpong": (lambda c: jax.lax.fori_loop(0, 8, lambda i, c: _pingpong(c), c), (x,), 0),
    }
    for name, (f, args, most) in programs.items():
        hlo = jax.jit(f).lower(*args).compile().as_text()
        assert _copies(hlo, n) <= most, (name, _copies(hlo, n), hlo)
