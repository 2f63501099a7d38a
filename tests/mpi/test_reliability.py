"""Endurance, communicator churn and interop with the user's own mpi4py traffic."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import _kernels, _mpi
from vjpmpi._lowering import CALL_ATTRS

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size


def rss_kib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4  # resident pages of 4 KiB


def drain_trace():
    """The opt-in trace (VJPMPI_TRACE=1, on in this suite) keeps one entry per call."""
    if _kernels.trace_enabled():
        vjpmpi.take_trace()


def test_100k_collectives_hold_memory_flat():
    x = jnp.ones(4, jnp.float32)
    f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM) / SIZE)
    for i in range(20_000):  # warm-up: caches, allocator pools, earlier tests' garbage
        x = f(x)
        if i % 1000 == 0:
            x.block_until_ready()
    x.block_until_ready()
    drain_trace()
    gc.collect()
    before = rss_kib()
    for i in range(100_000):
        x = f(x)
        if i % 1000 == 0:
            x.block_until_ready()
            drain_trace()
    x.block_until_ready()
    drain_trace()
    gc.collect()
    growth = rss_kib() - before
    np.testing.assert_allclose(np.asarray(x), 1.0)
    assert growth < 1024, f"resident memory grew by {growth} KiB over 100,000 collectives"
    loop = jax.jit(lambda v: jax.lax.fori_loop(0, 100_000, lambda i, c: f(c), v))
    np.testing.assert_allclose(np.asarray(loop(x)), 1.0)


def test_communicator_churn_does_not_leak():
    """Dup, run collectives on it, Free: 400 times. Each cycle takes three of MPI's context
    ids (MPICH has about 2k): the communicator's, its agreement window's duplicate's and
    the window's own; freeing the communicator must close its window.

    Each communicator has a number of its own (never reused, unlike MPI's handle), so
    its programs are its own: a fresh trace and compile per cycle. Freeing it closes its
    window and drops its eager programs; what must not grow is memory or open windows.
    """
    x = jnp.arange(3.0)
    open_before = _kernels.cpu.open_channels()
    before = rss_kib()
    numbers = set()
    for i in range(400):
        comm = WORLD.Dup()
        if i % 25 == 0:  # a user's jitted function closing over the communicator
            y = jax.jit(lambda v, c=comm: vjpmpi.allreduce(v, MPI.SUM, comm=c))(x)
        else:
            y = vjpmpi.allreduce(x, MPI.SUM, comm=comm)
        np.testing.assert_allclose(np.asarray(y), SIZE * np.arange(3.0))
        numbers.add(_mpi.as_comm(comm, "test").id)
        comm.Free()
        assert not _kernels.cpu.comm_alive(max(numbers))
    assert len(numbers) == 400  # (MPICH hands the freed handle out again; numbers are new)
    assert _kernels.cpu.open_channels() == open_before
    growth = rss_kib() - before
    assert growth < 64 * 1024, f"resident memory grew by {growth} KiB over 400 communicators"


def test_vjpmpi_traffic_never_matches_user_messages():
    """User's pending mpi4py messages on COMM_WORLD, same tags, interleaved with vjpmpi's."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    mine = np.full(5, 100.0 + RANK)
    got = np.empty(5)
    req = [WORLD.Isend(mine, nxt, tag=0), WORLD.Irecv(got, prv, tag=0)]
    x = jnp.full(5, float(RANK))
    y = vjpmpi.sendrecv(x, x, prv, nxt, sendtag=0, recvtag=0)           # default comm
    z = vjpmpi.allreduce(x, MPI.SUM, comm=WORLD)                         # user's comm
    pair = RANK ^ 1  # send/recv in pairs (0->1, 2->3, ...); an odd last rank sits out
    w = None
    if pair < SIZE:
        if RANK % 2:
            w = vjpmpi.recv(x, pair, tag=0)
        else:
            vjpmpi.send(x, pair, tag=0)
    MPI.Request.Waitall(req)
    np.testing.assert_array_equal(got, 100.0 + prv)                      # user's data intact
    np.testing.assert_array_equal(np.asarray(y), float(prv))
    np.testing.assert_array_equal(np.asarray(z), float(sum(range(SIZE))))
    if w is not None:
        np.testing.assert_array_equal(np.asarray(w), float(pair))
    WORLD.Barrier()


def test_checks_are_off_unless_asked_for():
    """Default run: no check traffic and no timeout configured; the watchdog warns after
    60 s, naming the call site, whose id is in the program (its text registered)."""
    assert not _kernels.CHECK and not _kernels.TIMEOUT
    assert _kernels.WARN_AFTER == 60.0 == _kernels.WARN_AFTER_DEFAULT
    text = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM)).lower(jnp.ones(3)).as_text()
    assert text.count("stablehlo.custom_call") == 1
    call = re.search(r"call = dense<\[([-\d, ]+)\]>", text).group(1).split(",")
    site = int(call[CALL_ATTRS.index("site")])
    assert re.fullmatch(r"allreduce\(SUM\) on float\d\d\[3\] at \S+test_reliability.py:\d+ "
                        r"\(\S+<lambda>\)", _kernels.cpu._site_for_test(site))


def test_freed_communicator_is_a_clear_error():
    comm = WORLD.Dup()
    comm.Free()
    with pytest.raises((TypeError, ValueError), match="vjpmpi.allreduce.*comm"):
        vjpmpi.allreduce(jnp.ones(2), MPI.SUM, comm=comm)
