"""Asynchronous collectives (a call that moves at least the threshold's bytes runs its
MPI call on the communicator's thread while XLA runs what does not wait for it) and
the bucketed gradient sync of `vjpmpi.nn` that uses them.

- Every op, forward, reverse (vjp) and under vmap (batched on axis 0 on even ranks, on
  the last axis on odd ones), on rank-dependent float64 data: the program run with
  every call asynchronous gives the same bits as the same program run with none.
- The threshold decides which calls run on the communicator's thread (counted); ranks
  with different thresholds still pair, and a call below it that runs on the
  communicator's thread on some ranks and on XLA's on others makes the same MPI call
  (a hang when it was nonblocking on one thread only); a reduce_scatter where MPICH's
  nonblocking algorithm sums in another order gives the same bits both ways.
- The default ("auto") follows the node layout: calls of 1 MiB or more are asynchronous
  on communicators across nodes only (at 4 ranks on two nodes: tests/test_multirank.py).
- What XLA compiles: an independent computation is scheduled between a call and the
  first use of its result.
- At run time: computation that does not depend on a message runs while it is in
  flight (a probe sees the call running on the communicator's thread).
- `sync_gradients` and bucketed `allreduce_gradients` equal `allreduce_gradients` bit
  for bit, one allreduce per bucket, the bucket of the last leaves first.

(The 3-rank job of tests/test_multirank.py runs the whole suite, the program-order
suite included, with every call that moves data asynchronous: VJPMPI_ASYNC_BYTES=0.)
"""

import os
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn
from helpers import WORLD, compiled, rng, send_recv_pair
from hlo_order import _ancestors, assert_ordered, parse
from vjpmpi import _kernels

rank, size = WORLD.rank, WORLD.size
nxt, prv = (rank + 1) % size, (rank - 1) % size
last = size - 1  # a root that is not rank 0 where there are two ranks or more
needs2 = pytest.mark.skipif(size < 2, reason="needs at least 2 ranks")


S = (6, 5)
# name: (function of this rank's input, this rank's input shape)
OPS = {
    "allreduce_sum": (lambda v: vjpmpi.allreduce(v, MPI.SUM), S),
    "allreduce_max": (lambda v: vjpmpi.allreduce(v, MPI.MAX), S),
    "allreduce_prod": (lambda v: vjpmpi.allreduce(v, MPI.PROD), S),
    "reduce": (lambda v: vjpmpi.reduce(v, MPI.SUM, last), S),
    "bcast": (lambda v: vjpmpi.bcast(v, last), S),
    "allgather": (vjpmpi.allgather, S),
    "gather": (lambda v: vjpmpi.gather(v, last), S),
    "scatter": (lambda v: vjpmpi.scatter(v, last), (size, 5) if rank == last else (5,)),
    "alltoall": (vjpmpi.alltoall, (size, 5)),
    "reduce_scatter": (lambda v: vjpmpi.reduce_scatter(v, MPI.SUM), (size, 5)),
    "scan": (lambda v: vjpmpi.scan(v, MPI.SUM), S),
    "exscan": (lambda v: vjpmpi.exscan(v, MPI.SUM), S),
    "sendrecv": (lambda v: vjpmpi.sendrecv(v, v * 2, prv, nxt, sendtag=1, recvtag=1), S),
    "send_recv": (send_recv_pair, S),
}
BATCH = 3
BATCH_AXIS = 0 if rank % 2 == 0 else -1  # rank-dependent batching


def _inputs():
    out = {}
    for i, (name, (fn, shape)) in enumerate(OPS.items()):
        x = rng(i).standard_normal(shape)
        y_shape = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, np.float64)).shape
        ct = rng(100 + i).standard_normal(y_shape)
        xb = np.stack([rng(200 + 7 * i + b).standard_normal(shape) for b in range(BATCH)],
                      axis=BATCH_AXIS)
        out[name] = (x, ct, xb)
    return out


def _every_op(inputs):
    out = {}
    for name, (x, ct, xb) in inputs.items():
        fn = OPS[name][0]
        y, pull = jax.vjp(fn, x)
        (g,) = pull(ct)
        yb = jax.vmap(fn, in_axes=BATCH_AXIS, out_axes=0)(xb)
        out[name] = (y, g, yb)
    return out


def _program(threshold):
    """The program of every op run with `threshold` (None: every call synchronous): its
    results on this rank's inputs, its HLO text and the calls that ran asynchronously."""
    inputs = _inputs()
    exe = compiled((__name__, "every_op"), _every_op, inputs)
    before = _kernels.cpu._async_calls()
    with vjpmpi.async_threshold(threshold):
        out = jax.tree_util.tree_map(np.asarray, exe(inputs))
    return out, exe.as_text(), _kernels.cpu._async_calls() - before


_RESULTS = {}


def _results(threshold):
    if threshold not in _RESULTS:
        _RESULTS[threshold] = _program(threshold)
    return _RESULTS[threshold]


def _calls(text):
    comps, _ = parse(text)
    return [i for instrs in comps.values() for i in instrs if i.target is not None]


def test_threshold_decides_where_calls_run():
    """Threshold 0: every call of the program (each runs once) on the communicator's
    thread; None: none."""
    calls = _calls(_results(0)[1])
    assert len(calls) > 2 * len(OPS) - 2
    assert_ordered(_results(0)[1])
    assert _results(0)[2] == len(calls)
    assert _results(None)[2] == 0


@pytest.mark.parametrize("name", list(OPS))
def test_same_bits_as_synchronous(name):
    got, want = _results(0)[0][name], _results(None)[0][name]
    for what, a, b in zip(("result", "vjp", "vmap"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), (
            f"{name} {what}: asynchronous differs from synchronous by up to "
            f"{np.max(np.abs(a - b))}")
    # and it is the op's result: the sum over ranks of allreduce_sum, for one
    if name == "allreduce_sum":
        np.testing.assert_allclose(got[0], WORLD.allreduce(_inputs()[name][0]), rtol=1e-12)


def test_threshold_counts_the_larger_side():
    """A call is asynchronous when its larger side, in or out, reaches the threshold."""
    x = jnp.zeros((4,), jnp.float32)  # 16 bytes in, 16 * size out

    exe = compiled((__name__, "allgather16"), vjpmpi.allgather, x)

    def went_async(threshold):
        before = _kernels.cpu._async_calls()
        with vjpmpi.async_threshold(threshold):
            np.testing.assert_array_equal(np.asarray(exe(x)), np.zeros((size, 4)))
        return _kernels.cpu._async_calls() - before

    assert went_async(16 * size) == 1
    assert went_async(16 * size + 1) == 0
    assert went_async(None) == 0


def test_threshold_arguments(monkeypatch):
    for bad in (-1, 1.5, "64", "AUTO", np.arange(2)):
        with pytest.raises(ValueError, match=r"vjpmpi.async_threshold: `nbytes`"):
            with vjpmpi.async_threshold(bad):
                pass
    before = _kernels.ASYNC_BYTES
    with vjpmpi.async_threshold(7):
        assert _kernels.ASYNC_BYTES == 7 and _kernels.cpu.async_bytes() == 7
        with vjpmpi.async_threshold(None):
            assert _kernels.cpu.async_bytes() == -1
        assert _kernels.cpu.async_bytes() == 7
    assert _kernels.ASYNC_BYTES == before
    with vjpmpi.async_threshold("auto"):
        assert _kernels.cpu.async_bytes() == _kernels.cpu.async_auto
    for raw, value in (("", "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("0", 0),
                       (" 4096 ", 4096), ("off", None), ("OFF", None), ("never", None)):
        monkeypatch.setenv("VJPMPI_ASYNC_BYTES", raw)
        assert _kernels._env_async_bytes() == value, raw
    for raw in ("-1", "64k", "yes"):
        monkeypatch.setenv("VJPMPI_ASYNC_BYTES", raw)
        with pytest.raises(ValueError, match="VJPMPI_ASYNC_BYTES"):
            _kernels._env_async_bytes()


def _node_comms():
    """Communicators of every layout over the nodes (MPI_COMM_TYPE_SHARED's groups):
    name -> (mpi4py communicator (None: vjpmpi's default), whether its processes are on
    more than one node, as this test works it out: the nodes' first ranks gathered)."""
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    first = node.allreduce(rank, op=MPI.MIN)  # (the node's number)
    comms = {"default": None, "world": WORLD, "dup": WORLD.Dup(), "node": node,
             "across": WORLD.Split(node.rank, rank),  # one process of each node, by turn
             "halves": WORLD.Split(int(rank >= (size + 1) // 2), rank),
             "self": MPI.COMM_SELF}
    return {name: (c, len(set((c or WORLD).allgather(first))) > 1)
            for name, c in comms.items()}, len(set(WORLD.allgather(first)))


def test_auto_threshold_follows_the_node_layout():
    """"auto" (the default): a call of 1 MiB or more (a collective or a point-to-point
    call) runs on the communicator's thread where the communicator's processes are on
    more than one node, none within a node; an explicit threshold holds for every
    communicator. One node in the harness's jobs;
    tests/test_multirank.py runs this at 4 ranks on two (VJPMPI_TEST_NODES=2)."""
    comms, nodes = _node_comms()
    if os.environ.get("VJPMPI_TEST_NODES"):
        assert nodes == int(os.environ["VJPMPI_TEST_NODES"]), nodes
    auto = _kernels.AUTO_ASYNC_BYTES
    assert auto == 1 << 20
    went = {}
    for name, (c, spans) in comms.items():
        for n in (auto // 4, auto // 4 - 1):  # float32: 1 MiB, and 4 bytes less
            x = rng(n).integers(-1000, 1000, n).astype(np.float32)  # (sums exact)
            f = jax.jit(lambda v, c=c: vjpmpi.allreduce(v, MPI.SUM, comm=c))
            for threshold in ("auto", None, 0):
                before = _kernels.cpu._async_calls()
                with vjpmpi.async_threshold(threshold):
                    y = np.asarray(f(x))
                went[name, n, threshold] = _kernels.cpu._async_calls() - before
                np.testing.assert_array_equal(y, (c or WORLD).allreduce(x, op=MPI.SUM))
            assert went[name, n, "auto"] == int(spans and 4 * n >= auto), (name, n, spans, went)
            assert went[name, n, None] == 0 and went[name, n, 0] == 1, (name, n, went)
        # a point-to-point call follows the same rule (a ring's sendrecv of 1 MiB: an
        # unsplit halo exchange across nodes travels while the interior is computed)
        cw = c or WORLD
        n = auto // 4
        x = np.arange(n, dtype=np.float32) + 1000 * rank  # (this rank's own)
        prev, nxt = (cw.rank - 1) % cw.size, (cw.rank + 1) % cw.size
        from_prev = np.arange(n, dtype=np.float32) + 1000 * cw.allgather(rank)[prev]
        g = jax.jit(lambda v, c=c: vjpmpi.sendrecv(v, v, prev, nxt, comm=c))
        for threshold in ("auto", None, 0):
            before = _kernels.cpu._async_calls()
            with vjpmpi.async_threshold(threshold):
                y = np.asarray(g(x))
            went[name, "p2p", threshold] = _kernels.cpu._async_calls() - before
            np.testing.assert_array_equal(y, from_prev)
        assert went[name, "p2p", "auto"] == int(spans), (name, spans, went)
        assert went[name, "p2p", None] == 0 and went[name, "p2p", 0] == 1, (name, went)
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    if nodes == 1:
        assert not any(spans for _, spans in comms.values())
    else:  # (both kinds seen)
        assert comms["world"][1] and comms["across"][1] and not comms["node"][1]


def test_started_calls_polled_from_their_start_follow_the_node_layout():
    """A started call of more than 64 KiB that XLA's thread posts is polled by the
    communicator's thread from its start where calls may run there ("auto": across nodes;
    an explicit threshold: every communicator), and within a node by default its wait
    alone tests it (polled from the start, a 1 MiB exchange waited for at once took
    1.2-1.3x mpi4py's Sendrecv there). A message of 64 KiB or less never is. The values
    received are the ring's, every way. tests/test_multirank.py runs this on two nodes."""
    comms, nodes = _node_comms()
    polled = {}
    for name, (c, spans) in comms.items():
        w = c or WORLD
        prv, nxt = (w.rank - 1) % w.size, (w.rank + 1) % w.size
        for n in (1 << 16, (1 << 14) + 1):  # float32: 256 KiB, and 64 KiB + 4 bytes
            x = rng(n + w.rank).integers(-1000, 1000, n).astype(np.float32) + w.rank

            @jax.jit
            def f(v, c=c, prv=prv, nxt=nxt):
                h = vjpmpi.start(vjpmpi.sendrecv, v, v, source=prv, dest=nxt, comm=c)
                return vjpmpi.wait(h)

            want = np.empty_like(x)
            w.Sendrecv(x, nxt, 0, want, prv, 0)
            for threshold in ("auto", None, 0):
                before = _kernels.cpu._started_polled_from_start()
                with vjpmpi.async_threshold(threshold):
                    y = np.asarray(f(x))
                polled[name, n, threshold] = _kernels.cpu._started_polled_from_start() - before
                np.testing.assert_array_equal(y, want)
            large = 4 * n > 1 << 16
            assert polled[name, n, "auto"] == int(spans and large), (name, n, spans, polled)
            assert polled[name, n, None] == 0, (name, n, polled)
            assert polled[name, n, 0] == int(large), (name, n, polled)
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    assert nodes > 1 or not any(v for (_, _, t), v in polled.items() if t == "auto")


# ------------------------------------------------ "auto", call site by call site --
FLOOR_NS = 200_000  # (async.h: SiteRecord::kOverlapFloorNs)
kSitePlaces = 16    # (async.h: a site's first 15 calls in a run have a record each)


@pytest.mark.parametrize("measured, stays", [
    # nothing beside the call (10 us of 400 us): asynchronous 3 times, then 64 runs stay
    # on XLA's thread and one probes again, alone
    ([(10_000, 400_000)], [False] * 3 + ([True] * 64 + [False]) * 2),
    ([(FLOOR_NS - 1, 10_000_000)], [False] * 3 + [True] * 64 + [False]),  # (under the floor)
    ([(FLOOR_NS, 10_000_000)], [False] * 140),  # the floor computed beside: it pays
    ([(30_000, 120_000)], [False] * 140),       # a quarter of the call's time
    ([(29_000, 120_000)], [False] * 3 + [True] * 64 + [False]),
    ([(-1, 400_000)], [False] * 140),           # the thread's clock not read: asynchronous
    ([(10_000, 400_000)] * 2 + [(FLOOR_NS, 400_000)], [False] * 140),  # never 3 in a row
    # a started call (0: only the floor counts, not the quarter of its time)
    ([(FLOOR_NS - 1, 0)], [False] * 3 + [True] * 64 + [False]),
    ([(FLOOR_NS, 0)], [False] * 140),
])
def test_auto_keeps_a_call_site_on_xlas_thread_while_nothing_runs_beside_it(measured, stays):
    """"auto"'s record of a call site (async.h, SiteRecord): each asynchronous run reports
    what XLA's thread computed beside the call; where that stayed under both the floor
    (200 us) and a quarter of the call's time three runs in a row, the next 64 runs stay
    on XLA's thread, then one runs asynchronously again."""
    got = _kernels.cpu._site_record_probe(len(stays), measured)
    assert got == stays[:len(got)] and len(got) == len(stays), [
        i for i, (g, w) in enumerate(zip(got, stays, strict=True)) if g != w]


def test_the_clock_read_is_the_posting_threads_own():
    """What XLA's thread computed beside a call is read on that thread's own CPU clock by
    the thread that runs the call (not the reader's clock, nor the process's, which
    counts the reader's spinning in MPI). A thread spins until its own clock reads 30 ms;
    this one, which waited meanwhile, then reads at least that, and not much more."""
    for _ in range(3):
        got = _kernels.cpu._thread_cpu_probe(30_000)
        assert 30_000 <= got < 1_030_000, got


def _ring_loop(c, steps):
    w = c or WORLD
    prv, nxt = (w.rank - 1) % w.size, (w.rank + 1) % w.size
    n = _kernels.AUTO_ASYNC_BYTES // 4  # float32: 1 MiB

    @jax.jit
    def f(v):
        return jax.lax.fori_loop(
            0, steps, lambda i, x: vjpmpi.sendrecv(x, x, source=prv, dest=nxt, comm=c), v)

    x = np.arange(n, dtype=np.float32) + 1000 * w.rank
    want = np.arange(n, dtype=np.float32) + 1000 * ((w.rank - steps) % w.size)
    return f, x, want


def test_auto_runs_a_loop_of_exchanges_alone_on_xlas_thread():
    """A 1 MiB exchange in a loop with nothing beside it (a loop that only exchanges):
    "auto" runs it asynchronously where its communicator spans nodes, sees that XLA's
    thread had nothing to compute meanwhile, and keeps the site's next runs on XLA's
    thread (the hand-offs cost 7-12 % of such a loop over TCP), probing every 65th run.
    A site's first 15 calls in a run have a record each, its later ones one between
    them: in the first of four runs of 80 calls, at least 15 + 3 go to the communicator's
    thread; in the fourth, at most 12 (the probes, and runs beside which other work of
    the process's threads fell). An explicit threshold (0) still
    sends every call there. Within a node "auto" sends none. Every value arrives.
    tests/test_multirank.py runs this on two nodes."""
    comms, nodes = _node_comms()
    seen = {}
    for name in ("default", "node", "across"):
        c, spans = comms[name]
        f, x, want = _ring_loop(c, 80)
        with vjpmpi.async_threshold(None):
            f(x).block_until_ready()  # (compiled and run once: its first run's work)
        for threshold in ("auto",) * 4 + (0,):
            before = (_kernels.cpu._async_calls(), _kernels.cpu._auto_kept_calls())
            with vjpmpi.async_threshold(threshold):
                y = np.asarray(f(x))
            np.testing.assert_array_equal(y, want)
            seen.setdefault(name, []).append(
                (_kernels.cpu._async_calls() - before[0], _kernels.cpu._auto_kept_calls() - before[1]))
        seen[name].append(spans)
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    seen = WORLD.allgather(seen)  # (every rank judges every rank's: they fail together)
    for r, s in enumerate(seen):
        for name, (*auto, explicit, spans) in s.items():
            assert explicit == (80, 0), (r, name, s)
            if not spans:
                assert auto == [(0, 0)] * 4, (r, name, s)
                continue
            assert all(sum(a) == 80 for a in auto), (r, name, s)
            assert auto[0][0] >= kSitePlaces - 1 + 3, (r, name, s)  # (every record tried)
            assert auto[3][0] <= 12, (r, name, s)
    assert nodes == 1 or any(s["default"][3] for s in seen)


_LATE = {"on": False}


def _late_delay(x):  # (rank 1 enters the call 30 ms late, while _LATE is on)
    if rank == 1 and _LATE["on"]:
        time.sleep(0.03)
    return x


def _burn_while_in_flight(y):  # (XLA's thread computes: 5 ms of CPU while a call is in flight)
    until = time.monotonic() + 0.2
    while _LATE["on"] and not _kernels.cpu._in_flight() and time.monotonic() < until:
        pass
    start = time.thread_time()
    while _LATE["on"] and time.thread_time() - start < 0.005:
        pass
    return y


def _six_late_runs(exe, args, sums, want):
    """Six runs of `exe(*args)` under "auto" with _LATE on, each of `sums(out)` checked
    against `want`: the (asynchronous, kept synchronous) calls they made."""
    _LATE["on"] = True
    before = (_kernels.cpu._async_calls(), _kernels.cpu._auto_kept_calls())
    try:
        with vjpmpi.async_threshold("auto"):  # (the 3-rank job's default is 0)
            for _ in range(6):
                for s in sums(exe(*args)):
                    np.testing.assert_array_equal(np.asarray(s), want)
    finally:
        _LATE["on"] = False
    return (_kernels.cpu._async_calls() - before[0], _kernels.cpu._auto_kept_calls() - before[1])


def test_auto_keeps_a_call_asynchronous_while_xla_computes_beside_it():
    """A 1 MiB allreduce whose program computes beside it (a callback that spins 5 ms of
    CPU on XLA's thread while the call is in flight; rank 1 enters the call 30 ms late, so
    that it is in flight on every other rank): "auto" keeps it on the communicator's
    thread in every run there, where its communicator spans nodes. tests/test_multirank.py
    runs this on two nodes."""
    comms, _ = _node_comms()
    n = _kernels.AUTO_ASYNC_BYTES // 4
    delay, burn = _late_delay, _burn_while_in_flight

    def f(x, y):
        d = jax.pure_callback(delay, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        r = vjpmpi.allreduce(d, MPI.SUM)
        outs = _dots(y, 10)  # (enough thunks: XLA:CPU runs programs of 8 or fewer in order)
        p = jax.pure_callback(burn, jax.ShapeDtypeStruct(y.shape, y.dtype), outs[0])
        return r, p, outs[-1]

    x = rng(5).integers(-1000, 1000, n).astype(np.float32)  # (this rank's own; sums exact)
    want = WORLD.allreduce(x, op=MPI.SUM)
    args = (jnp.asarray(x), jnp.ones((32, 32), jnp.float32))
    exe = compiled((__name__, "auto_beside"), f, *args)
    with vjpmpi.async_threshold(None):
        jax.block_until_ready(exe(*args))
    spans = comms["default"][1]
    went = _six_late_runs(exe, args, lambda out: [out[0]], want)
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    went = WORLD.allgather(went)  # (every rank fails together)
    for r, w in enumerate(went):
        if not spans:
            assert w == (0, 0), went
        elif r != 1:  # (rank 1's call, entered last, may end before its callback spins)
            assert w == (6, 0), went


def test_auto_decides_for_each_of_a_sites_calls_in_a_run():
    """Two 1 MiB allreduces of one call site in a program (a gradient sync's buckets are
    one site): XLA computes beside the first (a callback spinning 5 ms of CPU while it is
    in flight; rank 1 enters it 30 ms late), nothing beside the second. In 6 runs the
    first stays asynchronous every time, the second after 3 runs stays on XLA's thread
    (one record for both: the second's idle runs never come 3 in a row, and in a
    gradient sync the last buckets' idle runs kept the first ones synchronous, a
    data-parallel step at 2.00x its compute against 1.62x). tests/test_multirank.py runs
    this on two nodes."""
    comms, _ = _node_comms()
    n = _kernels.AUTO_ASYNC_BYTES // 4
    delay, burn = _late_delay, _burn_while_in_flight

    def f(x, y):
        v = jax.pure_callback(delay, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        outs = _dots(y, 10)  # (enough thunks: XLA:CPU runs programs of 8 or fewer in order)
        sums = []
        for i in range(2):
            sums.append(vjpmpi.allreduce(v, MPI.SUM))  # (one site, two calls)
            if i == 0:  # (the second call after the callback: nothing beside it)
                p = jax.pure_callback(burn, jax.ShapeDtypeStruct(y.shape, y.dtype), outs[0])
                v = v + p[0, 0] * 0
        return sums, outs[-1]

    x = rng(7).integers(-1000, 1000, n).astype(np.float32)  # (this rank's own; sums exact)
    want = WORLD.allreduce(x, op=MPI.SUM)
    args = (jnp.asarray(x), jnp.ones((32, 32), jnp.float32))
    exe = compiled((__name__, "auto_places"), f, *args)
    with vjpmpi.async_threshold(None):
        jax.block_until_ready(exe(*args))
    spans = comms["default"][1]
    went = _six_late_runs(exe, args, lambda out: out[0], want)
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    went = WORLD.allgather(went)  # (every rank fails together)
    for r, w in enumerate(went):
        if not spans:
            assert w == (0, 0), went
        elif r != 1:  # (rank 1's first call, entered last, may end before the callback)
            assert w == (6 + 3, 3), went


def test_auto_polls_a_started_call_from_its_start_while_the_program_computes_between():
    """A started 1 MiB exchange (vjpmpi.start) across nodes under "auto": waited for at
    once in a loop of 80, the site's calls stop being polled from their start after
    three runs of the program (the wait tests each to its end, as within a node), but
    for probes (and a few more where other work fell beside one: at most 12 of the
    fourth run's 80); with matrix products
    computed between each start and its wait (between fences: a millisecond or more),
    every one of 6 is polled from its start. (A program with a host callback copies its
    started calls' arrays and posts them on the communicator's thread: not polled from
    its start by XLA's, so none here.) Every value arrives. tests/test_multirank.py runs this on
    two nodes."""
    comms, _ = _node_comms()
    spans = comms["default"][1]
    n = _kernels.AUTO_ASYNC_BYTES // 4
    x = np.arange(n, dtype=np.float32) + 1000 * rank

    @jax.jit
    def at_once(v):
        def body(i, c):
            return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, c, c, source=prv, dest=nxt))
        return jax.lax.fori_loop(0, 80, body, v)

    @jax.jit
    def between(v, y):  # (a millisecond or more of matrix products between the two)
        h = vjpmpi.start(vjpmpi.sendrecv, v, v, source=prv, dest=nxt)
        y = vjpmpi.fence(y)
        y = vjpmpi.fence(_dots(y, 4)[-1])
        return vjpmpi.wait(h), y

    y = jnp.asarray(rng(6).standard_normal((128, 128)), jnp.float32) / 16
    with vjpmpi.async_threshold(None):  # (compiled and run once)
        at_once(x).block_until_ready()
        jax.block_until_ready(between(x, y))
    went = []
    for f, args, runs, want in (
            (at_once, (x,), 3, np.arange(n, dtype=np.float32) + 1000 * ((rank - 80) % size)),
            (at_once, (x,), 1, np.arange(n, dtype=np.float32) + 1000 * ((rank - 80) % size)),
            (between, (x, y), 6, np.arange(n, dtype=np.float32) + 1000 * prv)):
        before = (_kernels.cpu._started_polled_from_start(), _kernels.cpu._auto_kept_calls())
        with vjpmpi.async_threshold("auto"):  # (the 3-rank job's default is 0)
            for _ in range(runs):
                out = f(*args)
                np.testing.assert_array_equal(np.asarray(out[0] if f is between else out), want)
        went.append((_kernels.cpu._started_polled_from_start() - before[0],
                     _kernels.cpu._auto_kept_calls() - before[1]))
    for name in ("dup", "node", "across", "halves"):
        comms[name][0].Free()
    went = WORLD.allgather(went)  # (every rank fails together)
    for r, (first, loop, computed) in enumerate(went):
        if not spans:
            assert first == loop == computed == (0, 0), (r, went)
            continue
        assert first[0] >= kSitePlaces - 1 + 3 and sum(first) == 3 * 80, (r, went)
        assert loop[0] <= 12 and sum(loop) == 80, (r, went)
        assert computed == (6, 0), (r, went)


@needs2
def test_a_wait_within_a_node_tests_its_call_to_the_end():
    """A started call its communicator's thread does not poll from its start (within a
    node, the default threshold) is tested by its wait until it is done, however late
    the peer: handed to that thread, it moved only once the thread woke (0.1-0.6 ms on a
    busy node). Polled from its start (threshold 0), a wait that outlasts its spin hands
    it over. Rank 0 receives from rank 1, which sends 50 ms late."""
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    first = WORLD.allgather(node.allreduce(rank, op=MPI.MIN))  # (each rank's node)
    node.Free()
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    went = {}
    if rank < 2:
        n, peer = 1 << 16, 1 - rank  # (256 KiB: polled from its start where it may be)

        @jax.jit
        def f(v):
            return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, v, v, source=peer, dest=peer,
                                            comm=pair))

        x = np.full(n, rank + 1.0, np.float32)
        f(x).block_until_ready()
        for threshold in ("auto", 0):
            pair.Barrier()
            before = _kernels.cpu._started_handed_over()
            if rank == 1:
                time.sleep(0.05)
            with vjpmpi.async_threshold(threshold):
                y = np.asarray(f(x))
            went[threshold] = _kernels.cpu._started_handed_over() - before
            np.testing.assert_array_equal(y, np.full(n, peer + 1.0, np.float32))
        pair.Free()
    went = WORLD.bcast(went, root=0)  # (every rank judges rank 0's waits)
    assert went == {"auto": int(first[0] != first[1]), 0: 1}, went


@needs2
def test_the_thread_sleeps_while_a_wait_tests_its_call():
    """A started call polled from its start (threshold 0) whose wait has come is the
    wait's to test: the communicator's thread finds it parked and sleeps until the wait
    hands it over, rather than spin and nap beside it (those wake-ups took a core from the
    ranks: a started 1 MiB exchange over loopback TCP waited for at once, 1.04-1.06x
    mpi4py's Sendrecv). Rank 1 sends 20 ms late: rank 0's wait spins its 0.5 ms, then
    hands the call over, and the thread, woken, ends it (not woken, nothing would: the
    job hangs). Rank 0's thread found the call parked a few times at most (spinning and
    napping beside the wait: about 200 each time), and every value arrives."""
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    seen = {}
    if rank < 2:
        n, peer = 1 << 16, 1 - rank  # (256 KiB: polled from its start)

        @jax.jit
        def f(v):
            return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, v, v, source=peer, dest=peer,
                                            comm=pair))

        x = np.arange(n, dtype=np.float32) + 1000 * rank
        with vjpmpi.async_threshold(0):
            f(x).block_until_ready()
            for _ in range(3):
                pair.Barrier()
                before = (_kernels.cpu._started_polls_parked(),
                          _kernels.cpu._started_handed_over())
                if rank == 1:
                    time.sleep(0.02)
                y = np.asarray(f(x))
                np.testing.assert_array_equal(y, np.arange(n, dtype=np.float32) + 1000 * peer)
                seen.setdefault("parked", []).append(
                    _kernels.cpu._started_polls_parked() - before[0])
                seen.setdefault("handed", []).append(
                    _kernels.cpu._started_handed_over() - before[1])
        pair.Free()
    seen = WORLD.bcast(seen, root=0)  # (every rank judges rank 0's waits)
    assert seen["handed"] == [1, 1, 1], seen
    assert max(seen["parked"]) <= 3, seen  # (0 where the thread first ran after the wait)


# ------------------------------------------------------ compute meets message --
def _dots(y, n):
    outs = []
    for _ in range(n):
        y = jnp.sin(y @ y)
        outs.append(y)
    return outs


def test_compiled_schedule_puts_compute_inside_the_call():
    """XLA's schedule: between the allreduce and the first instruction that uses its
    result come instructions that do not depend on it (run asynchronously, the
    executor runs them while the call's future is pending)."""

    def f(x, y):
        r = vjpmpi.allreduce(x, MPI.SUM)
        outs = _dots(y, 6)
        return r * outs[-1][0, 0]

    args = (jnp.ones(1 << 15, jnp.float32), jnp.ones((32, 32), jnp.float32))
    text = jax.jit(f).lower(*args).compile().as_text()
    comps, entry = parse(text)
    instrs = comps[entry]
    anc = _ancestors(instrs)
    (call,) = [i for i in instrs if i.target == "vjpmpi_allreduce"]
    pos = [i.name for i in instrs].index(call.name)
    users = [k for k, i in enumerate(instrs) if call.name in anc(i.name)
             and i.opcode not in ("get-tuple-element", "bitcast")]
    independent = [i for i in instrs[pos + 1:min(users)]
                   if call.name not in anc(i.name) and i.opcode in ("fusion", "dot")]
    assert len(independent) >= 6, [i.name for i in instrs]


@needs2
@pytest.mark.skipif(_kernels.CHECK, reason="VJPMPI_CHECK compares each collective with the "
                    "other ranks' on the calling thread before it starts: the wait for a late "
                    "rank overlaps nothing")
def test_compute_runs_while_a_message_is_in_flight():
    """Rank 1 enters the allreduce a second late; on every other rank a probe that does
    not depend on the allreduce must see it running (on the communicator's thread)
    while it waits. Synchronously the probe runs only after the call returns. (The
    second run: the first run of a program compares its collectives with the other
    ranks' on the calling thread.)"""
    limit = 20.0
    late = {"on": False, "t0": 0.0}

    def delay(x):
        if rank == 1 and late["on"]:
            time.sleep(1.0)
        return x

    def probe(y):  # (not on rank 1, which is not judged: its call may come and go
        seen = 0  # between two looks, and the loop would wait out the limit)
        while rank != 1 and late["on"] and not seen and time.monotonic() - late["t0"] < limit:
            seen = _kernels.cpu._in_flight()
            time.sleep(0.001)
        return np.full(y.shape, seen, y.dtype)

    def f(x, y):
        d = jax.pure_callback(delay, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        r = vjpmpi.allreduce(d, MPI.SUM)
        # enough thunks (XLA:CPU runs programs of 8 or fewer in sequence)
        outs = _dots(y, 10)
        p = jax.pure_callback(probe, jax.ShapeDtypeStruct(y.shape, y.dtype), outs[0])
        return r, p, outs[-1]

    args = (jnp.ones(1 << 14, jnp.float32), jnp.ones((32, 32), jnp.float32))
    exe = compiled((__name__, "probe"), f, *args)
    with vjpmpi.async_threshold(0):
        jax.block_until_ready(exe(*args))
        late.update(on=True, t0=time.monotonic())
        r, p, _ = exe(*args)
    np.testing.assert_array_equal(np.asarray(r), np.full(1 << 14, size, np.float32))
    seen = WORLD.allgather(float(np.asarray(p)[0, 0]))  # every rank fails together
    assert all(s > 0 for k, s in enumerate(seen) if k != 1), seen


def test_continuations_run_off_the_communicators_thread():
    """What waits on an asynchronous call runs on another thread than the communicator's,
    which stays free for the program's next call: when the communicator's thread
    completed the call's future itself, XLA ran the computation waiting on it there
    (a halo loop's second exchange started 20-60 ms after XLA posted it, behind a block
    of the interior update). The third run: even ranks asynchronous, odd ranks not."""
    where = []

    def probe(a):
        where.append(bool(_kernels.cpu._on_comm_thread()))
        return a

    def f(x):
        for _ in range(3):
            a = vjpmpi.allreduce(x, MPI.SUM)
            x = jax.pure_callback(probe, jax.ShapeDtypeStruct(a.shape, a.dtype), a) / size
        return x, _dots(x.reshape(64, 64)[:32, :32], 10)[-1]

    x = jnp.asarray(rng(11).standard_normal(1 << 12))
    exe = compiled((__name__, "continuation"), f, x)
    for threshold in (0, None, 0 if rank % 2 == 0 else None):
        where.clear()
        with vjpmpi.async_threshold(threshold):
            y, _ = exe(x)
        np.testing.assert_allclose(np.asarray(y), WORLD.allreduce(np.asarray(x)) / size,
                                   rtol=1e-13)
        # (every rank fails together)
        assert WORLD.allgather(where) == [[False] * 3] * size, threshold


def test_an_asynchronous_call_completes_on_the_thread_that_ran_it():
    """The thread that ran an asynchronous call completes its future itself, after
    handing the communicator's loop over (XLA's continuation runs there, off the
    communicator's thread): a completion thread woken for it cost a wake-up per call
    (a 1 MiB send + recv over loopback TCP: 1.08-1.11x mpi4jax's with it, 0.99-1.02x
    without). Eight chained ring shifts, each rank's own values, threshold 0: eight
    hand-overs on every rank, and every value arrives."""
    n, steps = 1 << 12, 8
    prev, nxt = (rank - 1) % size, (rank + 1) % size

    @jax.jit
    def f(v):
        return jax.lax.fori_loop(
            0, steps, lambda i, c: vjpmpi.sendrecv(c, c, source=prev, dest=nxt), v)

    x = np.arange(n, dtype=np.float32) + 1000 * rank
    with vjpmpi.async_threshold(0):
        f(x).block_until_ready()
        before = (_kernels.cpu._loop_handoffs(), _kernels.cpu._async_calls())
        y = np.asarray(f(x))
        counts = (_kernels.cpu._loop_handoffs() - before[0],
                  _kernels.cpu._async_calls() - before[1])
    np.testing.assert_array_equal(
        y, np.arange(n, dtype=np.float32) + 1000 * ((rank - steps) % size))
    assert WORLD.allgather(counts) == [(steps, steps)] * size  # (every rank fails together)


def test_a_loop_handed_over_never_waits_for_the_thread_that_left():
    """A job posted to a loop whose thread handed it over and is away (XLA's continuation
    computing there) gets another thread at once: it never waits for that computation
    (a halo loop's second exchange once started 20-60 ms late behind a block of the
    interior update). The probe's first job hands the loop over, posts a second and stays
    away 300 ms; the second runs within 100 ms of its post."""
    waited = [_kernels.cpu._handoff_probe(300_000) for _ in range(2)]
    waited += [_kernels.cpu._handoff_probe(0) for _ in range(20)]  # (back at once: no hang)
    seen = WORLD.allgather(max(waited[:2]))
    assert all(w < 100_000 for w in seen), seen


def test_blocking_and_nonblocking_never_meet():
    """A call below the threshold runs on the thread that completes its last input: here
    on even ranks XLA's (its input comes from a callback that returns only after the
    large call has completed), on odd ranks the communicator's (its input is ready, the
    large call before it completes last). Both must use the same kind of MPI call: MPI
    never matches a blocking allreduce with a nonblocking one (a 4-rank FFT waited for
    ever that way)."""
    big = jnp.asarray(rng(7).standard_normal(1 << 18))  # 2 MiB: asynchronous
    y = jnp.asarray(rng(8).standard_normal((32, 32)) / 32)
    posted = {"base": 0}

    def after_the_large_call(v):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:  # (posted, then no call running)
            if _kernels.cpu._async_calls() > posted["base"] and not _kernels.cpu._in_flight():
                break
            time.sleep(0.0002)
        time.sleep(0.05)
        return v

    def f(big, y):
        r = vjpmpi.allreduce(big, MPI.SUM)
        outs = _dots(y, 10)  # (more than 8 thunks: XLA:CPU runs the program as dataflow)
        if rank % 2 == 0:
            small = jax.pure_callback(after_the_large_call,
                                      jax.ShapeDtypeStruct((), y.dtype), y[0, 0])
        else:
            small = y[0, 0]
        return r, vjpmpi.allreduce(small, MPI.SUM), outs[-1]

    exe = compiled((__name__, "kinds_meet"), f, big, y)
    want = WORLD.allreduce(float(y[0, 0]))
    with vjpmpi.async_threshold(1 << 16):
        for _ in range(3):
            posted["base"] = _kernels.cpu._async_calls()
            r, s, _ = exe(big, y)
            np.testing.assert_allclose(float(s), want, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(r), WORLD.allreduce(np.asarray(big)), rtol=1e-12)


@needs2
def test_ranks_with_different_thresholds_agree():
    """The threshold only moves a call between threads: ranks with different settings
    (here rank 0 runs every call asynchronously, the others none) run the same MPI
    calls, also in a program every rank has run before (whose later runs the ranks'
    agreement does not compare)."""
    x = jnp.full((3,), rank + 1.0)
    exe = compiled((__name__, "modes"), lambda v: vjpmpi.allreduce(v, MPI.SUM) * 2, x)
    want = np.full(3, size * (size + 1.0))
    np.testing.assert_array_equal(np.asarray(exe(x)), want)
    before = _kernels.cpu._async_calls()
    with vjpmpi.async_threshold(0 if rank == 0 else None):
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(exe(x)), want)
    assert _kernels.cpu._async_calls() - before == (3 if rank == 0 else 0)


def test_same_bits_where_mpi_algorithms_differ():
    """reduce_scatter of 64 Ki float64 (the size where MPICH's nonblocking
    MPI_Ireduce_scatter_block sums in another order than the blocking call at 4 ranks):
    asynchronous and synchronous give the same bits, since both make the blocking call."""
    x = jnp.asarray(rng(9).standard_normal((size, (1 << 16) // size)))
    exe = compiled((__name__, "reduce_scatter_64k"),
                   lambda v: vjpmpi.reduce_scatter(v, MPI.SUM), x)
    runs = {}
    for threshold in (None, 0):
        before = _kernels.cpu._async_calls()
        with vjpmpi.async_threshold(threshold):
            runs[threshold] = np.asarray(exe(x))
        assert _kernels.cpu._async_calls() - before == (threshold == 0)
    assert runs[0].tobytes() == runs[None].tobytes()
    np.testing.assert_allclose(runs[0], WORLD.allreduce(np.asarray(x))[rank], rtol=1e-12,
                               atol=1e-13)


# ------------------------------------------------------------- gradient sync --
class Net(eqx.Module):
    layers: tuple
    scale: jax.Array  # float64: a second dtype group
    step: int = eqx.field(static=True, default=1)

    def __call__(self, x):
        for w, b in self.layers:
            x = jnp.tanh(x @ w + b)
        return jnp.sum(x.astype(jnp.float64) * self.scale)


def _net():
    g = rng(31)
    sizes = [(9, 16), (16, 16), (16, 7), (7, 3)]
    layers = tuple((jnp.asarray(g.standard_normal(s).astype(np.float32) / 3),
                    jnp.asarray(g.standard_normal(s[1]).astype(np.float32)))
                   for s in sizes)
    return Net(layers, jnp.asarray(np.linspace(0.5, 1.5, 3)))


def _leaf_bytes(net):
    leaves, _ = jax.tree_util.tree_flatten(net)
    return [leaf.size * leaf.dtype.itemsize for leaf in leaves]


def _loss(net, x):
    return jnp.mean(jax.vmap(net)(x))


BUCKETS = [1, 700, 1 << 20, None]  # a bucket per leaf, some leaves each, one per dtype


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_sync_gradients_equals_allreduce_gradients(bucket_bytes, mean):
    net = _net()
    x = jnp.asarray(rng(5).standard_normal((11, 9)).astype(np.float32))  # this rank's data

    def reference(net, x):
        return vjpmpi.nn.allreduce_gradients(jax.grad(_loss)(net, x), mean=mean)

    def bucketed(net, x):
        return vjpmpi.nn.allreduce_gradients(jax.grad(_loss)(net, x), mean=mean,
                                             bucket_bytes=bucket_bytes)

    def synced(net, x):
        return jax.grad(lambda n: _loss(vjpmpi.nn.sync_gradients(
            n, mean=mean, bucket_bytes=bucket_bytes), x))(net)

    want = jax.jit(reference)(net, x)
    local = jax.tree_util.tree_leaves(jax.jit(jax.grad(_loss))(net, x))
    every = WORLD.allgather([np.asarray(leaf) for leaf in local])
    for k, leaf in enumerate(jax.tree_util.tree_leaves(want)):  # against NumPy
        total = sum(e[k].astype(np.float64) for e in every)
        np.testing.assert_allclose(leaf, total / size if mean else total, rtol=2e-6,
                                   atol=1e-6)
    for fn in (bucketed, synced):
        got = jax.jit(fn)(net, x)
        got_leaves, got_def = jax.tree_util.tree_flatten(got)
        want_leaves, want_def = jax.tree_util.tree_flatten(want)
        assert got_def == want_def and len(want_leaves) == 9
        for k, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (fn.__name__, k)


def _expected_buckets(bucket_bytes):
    """Bucket sizes in bytes, in the order they must be reduced: the float64 leaf (the
    last one), then the float32 leaves from the last back, cut at `bucket_bytes`."""
    sizes = _leaf_bytes(_net())
    out = [sizes[-1]]
    run = 0
    for n in reversed(sizes[:-1]):
        if run and bucket_bytes is not None and run + n > bucket_bytes:
            out.append(run)
            run = 0
        run += n
    return out + [run]


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_sync_gradients_calls_in_backward_order(bucket_bytes):
    """One allreduce per bucket, in program order the bucket of the last leaves first,
    each depending only on its own gradients (so it can start while the backward pass
    computes the earlier layers' gradients)."""
    net = _net()
    x = jnp.ones((11, 9), jnp.float32)

    def step(net, x):
        return jax.grad(lambda n: _loss(vjpmpi.nn.sync_gradients(
            n, bucket_bytes=bucket_bytes), x))(net)

    text = jax.jit(step).lower(net, x).compile().as_text()
    assert_ordered(text)
    calls = [c for c in _calls(text) if c.target == "vjpmpi_allreduce"]
    got = [int(n) * (8 if t == "f64" else 4) for t, n in
           (_call_input(text, c.name) for c in _in_chain_order(text, calls))]
    assert got == _expected_buckets(bucket_bytes)


def _call_input(text, name):
    """The element type and count of a call's (one-dimensional) input."""
    line = next(ln for ln in text.splitlines()
                if re.match(rf"\s*(ROOT\s+)?%{re.escape(name)} ", ln))
    args = line[line.index("custom-call(") + len("custom-call("):]
    m = re.search(r"(f32|f64)\[(\d+)\]", args)
    return m.group(1), m.group(2)


def _in_chain_order(text, calls):
    comps, entry = parse(text)
    anc = _ancestors(comps[entry])
    return sorted(calls, key=lambda c: len([d for d in calls if d.name in anc(c.name)]))


@pytest.mark.parametrize("where", ["allreduce_gradients", "sync_gradients",
                                   "sharded_optimizer"])
def test_bucket_bytes_that_differ_between_ranks_fail_saying_so(where):
    """Rank 0 cuts its buckets at another `bucket_bytes` than the others: every rank
    raises, saying that bucket_bytes differ and what each rank passed (it used to be the
    first buckets' allreduce shapes); at one rank nothing can differ and it runs."""
    net = _net()
    x = jnp.ones((11, 9), jnp.float32)
    cap = 400 if rank == 0 else 1200
    run = {
        "allreduce_gradients": lambda: jax.jit(lambda n: vjpmpi.nn.allreduce_gradients(
            jax.grad(_loss)(n, x), bucket_bytes=cap))(net),
        "sync_gradients": lambda: jax.jit(jax.grad(lambda n: _loss(
            vjpmpi.nn.sync_gradients(n, bucket_bytes=cap), x)))(net),
        "sharded_optimizer": lambda: _sharded_train(
            vjpmpi.nn.sharded_optimizer(optax.sgd(0.1), bucket_bytes=cap), net, x, steps=1),
    }[where]
    if size == 1:
        jax.block_until_ready(run())
        return
    with pytest.raises(Exception) as info:
        jax.block_until_ready(run())
    text = str(info.value)
    assert re.search(r"vjpmpi: (the ranks disagree|collective mismatch \(VJPMPI_CHECK\)) on "
                     rf"a communicator of {size} ranks \(their collective #\d+ there\): the "
                     r"arguments differ", text), text
    for r in range(size):
        assert re.search(rf"\n  rank {r}: vjpmpi\.nn\.{where} with bucket_bytes="
                         rf"{400 if r == 0 else 1200} \(every rank must pass the same "
                         r"bucket_bytes\)", text), text
    vjpmpi.barrier()  # (the ranks go on in step)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bucket_bytes_must_be_positive(bad):
    net = _net()
    with pytest.raises(ValueError, match=r"nn.sync_gradients: `bucket_bytes`"):
        vjpmpi.nn.sync_gradients(net, bucket_bytes=bad)
    with pytest.raises(ValueError, match=r"nn.allreduce_gradients: `bucket_bytes`"):
        vjpmpi.nn.allreduce_gradients(net, bucket_bytes=bad)


def test_bucketing_keeps_the_bits_of_large_buffers():
    """MPI may pick its allreduce algorithm by message size: one bucket per leaf and one
    per dtype still give the same bits where a buffer crosses MPICH's switch points."""
    g = rng(41)
    tree = {"a": jnp.asarray(g.standard_normal(7).astype(np.float32)),
            "b": jnp.asarray(g.standard_normal((300, 1000)).astype(np.float32)),
            "c": jnp.asarray(g.standard_normal(2000).astype(np.float32))}
    whole = jax.jit(vjpmpi.nn.allreduce_gradients)(tree)
    each = jax.jit(lambda t: vjpmpi.nn.allreduce_gradients(t, bucket_bytes=1))(tree)
    for k in tree:
        assert np.asarray(whole[k]).tobytes() == np.asarray(each[k]).tobytes(), k


def _sharded_train(opt, net, x, steps=4):
    state = opt.init(net)

    @jax.jit
    def step(n, s):
        u, s = opt.update(jax.grad(_loss)(n, x), s, n)
        return optax.apply_updates(n, u), s

    out = []
    for _ in range(steps):
        net, state = step(net, state)
        out.append(jax.tree_util.tree_leaves(net))
    return out


def test_bucketed_sharded_optimizer_equals_unbucketed():
    """ZeRO in buckets (the parameters of each bucket sharded over the ranks: a bucket per
    leaf, and some leaves each) against one shard per dtype, step after step, on
    rank-dependent data: the gradients each rank reduces and gathers back (an optimizer
    that passes them through) are the same bits; adam's steps agree to the last bits of the optimizer's arithmetic, which XLA rewrites
    depending on how a leaf's part sits in the compiled step (a constant folded into a
    multiply, a division by a shared float32 scalar turned into a multiply by its
    reciprocal, a multiply and an add fused into an FMA: a few float32 ulp per step; a
    float64 leaf's adam step 5e-11 apart at 3 ranks, optax's scalars being float32). A
    part laid out wrongly would move by a step's size (1e-2 here). (One shard per dtype equals plain data parallelism:
    tests/mpi/test_nn_optim.py.)"""
    net = _net()
    x = jnp.asarray(rng(6).standard_normal((11, 9)).astype(np.float32))  # this rank's data
    inners = {"identity": optax.identity, "adam": lambda: optax.adam(1e-2)}
    for name, inner in inners.items():
        whole = _sharded_train(vjpmpi.nn.sharded_optimizer(inner()), net, x)
        for bucket_bytes in BUCKETS[:2]:
            got = _sharded_train(vjpmpi.nn.sharded_optimizer(inner(), bucket_bytes=bucket_bytes),
                                 net, x)
            assert len(got) == len(whole) == 4
            for k, (a, b) in enumerate(zip(got, whole, strict=True)):
                assert len(a) == len(b) == 9
                for j, (u, v) in enumerate(zip(a, b, strict=True)):
                    u, v = np.asarray(u), np.asarray(v)
                    if name == "identity":  # (the bits vjpmpi moves)
                        assert u.tobytes() == v.tobytes(), (name, bucket_bytes, k, j)
                    else:  # (optax's scalars, such as adam's bias corrections, are float32
                        # whatever the leaf's dtype: a float64 leaf's step has their error)
                        tol = 1e-8 if u.dtype == np.float64 else 2e-6
                        np.testing.assert_allclose(u, v, rtol=tol, atol=tol,
                                                   err_msg=f"{name}, {bucket_bytes}, step {k}")


def _rs_elements(text, name):
    line = next(ln for ln in text.splitlines()
                if re.match(rf"\s*(ROOT\s+)?%{re.escape(name)} ", ln))
    args = line[line.index("custom-call(") + len("custom-call("):]
    m = re.search(r"(f32|f64)\[([\d,]+)\]", args)
    return m.group(1), int(np.prod([int(d) for d in m.group(2).split(",")]))


@pytest.mark.parametrize("bucket_bytes", BUCKETS[:2])
def test_sharded_optimizer_reduces_buckets_in_backward_order(bucket_bytes):
    """One reduce_scatter per bucket (padded to a multiple of the size), in program
    order the bucket of the last leaves first; XLA schedules backward-pass work that
    the first bucket does not wait for between its call and the last bucket's."""
    net = _net()
    x = jnp.ones((11, 9), jnp.float32)
    opt = vjpmpi.nn.sharded_optimizer(optax.sgd(0.1), bucket_bytes=bucket_bytes)
    state = opt.init(net)

    def step(n, s):
        return opt.update(jax.grad(_loss)(n, x), s, n)

    text = jax.jit(step).lower(net, state).compile().as_text()
    assert_ordered(text)
    calls = _in_chain_order(text, [c for c in _calls(text)
                                   if c.target == "vjpmpi_reduce_scatter"])
    got = [(t, n) for t, n in (_rs_elements(text, c.name) for c in calls)]
    want = [("f64" if k == 0 else "f32", -(-(b // (8 if k == 0 else 4)) // size) * size)
            for k, b in enumerate(_expected_buckets(bucket_bytes))]
    assert got == want
    comps, entry = parse(text)
    instrs = comps[entry]
    anc = _ancestors(instrs)
    names = [i.name for i in instrs]
    first, final = names.index(calls[0].name), names.index(calls[-1].name)
    between = [i for i in instrs[first + 1:final] if i.opcode in ("fusion", "dot")
               and calls[0].name not in anc(i.name) and i.name in anc(calls[-1].name)]
    assert between, names


def test_sharded_optimizer_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match=r"nn.sharded_optimizer: `bucket_bytes`"):
        vjpmpi.nn.sharded_optimizer(optax.sgd(0.1), bucket_bytes=0)
