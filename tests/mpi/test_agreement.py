"""No silent wrong answers (issue 27): what ranks disagree on ends in an error.

- The ranks of a communicator compare each collective of a program new to them (op,
  dtype, per-rank shape, root, reduction) before any data moves: a disagreement raises on
  every rank, naming what differs and each rank's collective, and the ranks stay in step.
  Programs that differ between ranks but agree on their collectives (other local shapes,
  other compute, a new program on one rank only) run.
- Lifetimes: a program names its communicator by a number MPI cannot hand out again, and
  a receive status by a slot that lives as long as its `MPI.Status`.
- Threads: a communicator's collectives belong to the first thread that uses it.

It runs at 2-4 ranks (tests/test_multirank.py ONLY_AT: one rank cannot disagree with
itself). Each test works on a fresh duplicate of COMM_WORLD, so every program in it is new on
every rank (the check compares programs that a rank has not yet seen verified). The
job that ends the process when a rank that cannot be told is already inside the
collective (it ran the program before) is in tests/test_reliability.py.
"""

import functools
import os
import re
import signal
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import _kernels

from helpers import WORLD, to_device

rank, size = WORLD.rank, WORLD.size
last = size - 1
CHECK = _kernels.CHECK  # (the 3-rank job runs with VJPMPI_CHECK=1)


@pytest.fixture
def comm():
    c = WORLD.Dup()
    yield c
    c.Free()


def raises_everywhere(call, *patterns):
    """`call()` raises on this rank (and so, the test running on every rank, on each),
    with a message matching every pattern; returns the message."""
    with pytest.raises(ValueError) as info:  # (on every path: issue 60, item 8)
        jax.block_until_ready(call())
    text = str(info.value)
    for p in patterns:
        assert re.search(p, text), f"{p!r} not in:\n{text}"
    return text


def in_step(comm):
    """After an error the ranks go on together: the next collective pairs correctly."""
    y = vjpmpi.allreduce(to_device(np.full(2, rank + 1.0)), MPI.SUM, comm=comm)
    np.testing.assert_array_equal(np.asarray(y), np.full(2, size * (size + 1) / 2))


MISMATCH = r"(the ranks disagree|collective mismatch \(VJPMPI_CHECK\))"


def row(r, text):
    """Rank `r`'s row in a mismatch message shows `text` (with VJPMPI_CHECK the row is
    the call site's description, the per-rank block in brackets where it differs)."""
    return rf"\n  rank {r}: [^\n]*" + re.escape(text)


def _ones(shape, dtype=jnp.float32):
    return to_device(np.ones(shape, dtype))


# (name, what differs, this rank's call, the row each rank's collective gives)
CASES = [
    ("shape", "shape differs",
     lambda c: vjpmpi.allreduce(_ones((2, 3) if rank == 0 else (3, 2)), MPI.SUM, comm=c),
     lambda r: f"allreduce(SUM) on float32[{'2, 3' if r == 0 else '3, 2'}]"),
    ("count", "shape differs",
     lambda c: vjpmpi.allgather(_ones(4 + (rank == last)), comm=c),
     lambda r: f"allgather() on float32[{4 + (r == last)}]"),
    ("dtype", "dtype differs",
     lambda c: vjpmpi.allreduce(_ones(4, np.int32 if rank == 0 else np.float32), MPI.SUM, comm=c),
     lambda r: f"allreduce(SUM) on {'int32' if r == 0 else 'float32'}[4]"),
    ("op", "'op' differs",
     lambda c: vjpmpi.allreduce(_ones(3), MPI.MAX if rank == last else MPI.SUM, comm=c),
     lambda r: f"allreduce({'MAX' if r == last else 'SUM'}) on float32[3]"),
    ("own root", "'root' differs",  # every rank names itself root
     lambda c: vjpmpi.bcast(_ones(5) * rank, rank, comm=c),
     lambda r: f"bcast(root={r}) on float32[5]"),
    ("last root", "'root' differs",  # only the last rank names another root
     lambda c: vjpmpi.reduce(_ones(6), MPI.SUM, 1 if rank == last else 0, comm=c),
     lambda r: f"reduce(SUM, root={1 if r == last else 0}) on float32[6]"),
    ("collective", "the collective differs",
     lambda c: (vjpmpi.bcast(_ones(7), 0, comm=c) if rank == 0
                else vjpmpi.allreduce(_ones(7), MPI.SUM, comm=c)),
     lambda r: "bcast(root=0) on float32[7]" if r == 0 else "allreduce(SUM) on float32[7]"),
    # vmap: rank 0 batches (3 members), the others run the same function on a constant
    ("batching", "shape differs",
     lambda c: (jax.vmap(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=c))(_ones((3, 4)))
                if rank == 0 else vjpmpi.allreduce(_ones(4), MPI.SUM, comm=c)),
     lambda r: f"allreduce(SUM) on float32[{'3, 4' if r == 0 else '4'}]"),
]


@pytest.mark.parametrize("name, what, call, describe", CASES, ids=[c[0] for c in CASES])
def test_disagreement_raises_on_every_rank(comm, name, what, call, describe):
    before = _kernels.cpu.verified_count()
    text = raises_everywhere(lambda: call(comm), MISMATCH, re.escape(what),
                             rf"on a communicator of {size} ranks")
    for r in range(size):  # every rank's message shows every rank's collective
        assert re.search(row(r, describe(r)), text), f"rank {r}'s row missing:\n{text}"
    assert _kernels.cpu.verified_count() == before + 1
    in_step(comm)


def test_disagreement_under_jit_and_grad(comm):
    """Rank 0 differentiates (bcast, then its transpose reduce) while the other ranks run
    the forward twice: the second collective disagrees (reduce against bcast)."""

    def loss(v):
        return jnp.sum(vjpmpi.bcast(v, 0, comm=comm) ** 2)

    x = to_device(np.arange(4.0, dtype=np.float32))
    if rank == 0:
        raises_everywhere(lambda: jax.jit(jax.grad(loss))(x), MISMATCH,
                          "the collective differs",
                          row(0, "reduce(SUM, root=0) on float32[4]"),
                          row(1, "bcast(root=0) on float32[4]"))
    else:
        jax.block_until_ready(jax.jit(loss)(x))  # pairs with rank 0's forward bcast
        raises_everywhere(lambda: jax.jit(loss)(x), MISMATCH, "the collective differs")
    in_step(comm)


def test_rank_dependent_trip_count(comm):
    """fori_loop(0, 2 + (rank == 0)): rank 0 runs a third allreduce where the others
    have finished and run their next collective; that one disagrees and both raise."""
    f = jax.jit(lambda v: jax.lax.fori_loop(
        0, 2 + (rank == 0), lambda i, c: vjpmpi.allreduce(c, MPI.SUM, comm=comm) / size, v))
    x = to_device(np.ones(7, np.float32))
    if rank == 0:
        raises_everywhere(lambda: f(x), MISMATCH, "shape differ",
                          row(0, "allreduce(SUM) on float32[7]"),
                          row(1, "allreduce(SUM) on float64[2]"))
    else:
        np.testing.assert_array_equal(np.asarray(f(x)), np.ones(7))
        raises_everywhere(lambda: in_step(comm), MISMATCH, "shape differ")
    in_step(comm)


def test_programs_that_differ_but_agree_on_their_collectives_run(comm):
    """What each rank computes around the collectives may differ: local batch sizes, a
    program new to one rank only (its next batch has a new shape, the others' not),
    programs of other structure with the same collectives."""
    def local_grad(w, batch):
        return jax.grad(lambda w: jnp.mean((batch @ w) ** 2))(w)

    grad = jax.jit(lambda w, b: vjpmpi.allreduce(local_grad(w, b), MPI.SUM, comm=comm))
    # the same collective inside a one-trip loop: another program signature
    looped = jax.jit(lambda w, b: jax.lax.fori_loop(
        0, 1, lambda i, g: vjpmpi.allreduce(g, MPI.SUM, comm=comm), local_grad(w, b)))
    w0 = np.linspace(0.0, 1.0, 4)

    def batch_of(r, i):  # each rank's own batch size
        return np.arange((8 + r) * 4.0).reshape(8 + r, 4) / 100 + r + i

    for i in range(3):
        # the third time, the program is new to every rank but rank 0, which runs its
        # verified one without comparing: the others compare with what it runs
        step = looped if i == 2 and rank != 0 else grad
        before = _kernels.cpu.verified_count()
        got = step(to_device(w0), to_device(batch_of(rank, i)))
        want = sum(2 * b.T @ (b @ w0) / len(b) for b in (batch_of(r, i) for r in range(size)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
        if i == 2 and not CHECK:
            assert _kernels.cpu.verified_count() - before == (rank != 0)
    # one program on rank 0, two on the others (bcast, then allreduce)
    x = to_device(np.full(3, rank + 1.0))
    if rank == 0:
        split = lambda: jax.jit(lambda v: vjpmpi.allreduce(  # noqa: E731
            vjpmpi.bcast(v, 0, comm=comm), MPI.SUM, comm=comm))(x)
    else:
        split = lambda: vjpmpi.allreduce(vjpmpi.bcast(x, 0, comm=comm), MPI.SUM, comm=comm)  # noqa: E731
    if CHECK and size > 1:  # VJPMPI_CHECK also compares the position within each program
        if rank == 0:
            raises_everywhere(split, "from different points of their programs")
        else:
            jax.block_until_ready(vjpmpi.bcast(x, 0, comm=comm))
            raises_everywhere(lambda: vjpmpi.allreduce(x, MPI.SUM, comm=comm),
                              "from different points of their programs")
    else:
        np.testing.assert_array_equal(np.asarray(split()), np.full(3, size))
    in_step(comm)


def test_each_new_program_is_compared_once(comm):
    """The comparison runs at the first collective of a program's first run on each rank
    (then once every rank starts it at the same collective, it is verified) and costs
    nothing after that; VJPMPI_CHECK compares every collective of every run."""
    f = jax.jit(lambda v: vjpmpi.allreduce(vjpmpi.allreduce(v, MPI.SUM, comm=comm), MPI.MAX,
                                           comm=comm))
    x = to_device(np.arange(5.0))
    before = _kernels.cpu.verified_count()
    for _ in range(4):
        np.testing.assert_array_equal(np.asarray(f(x)), size * np.arange(5.0))
    compared = _kernels.cpu.verified_count() - before
    assert compared == (0 if size == 1 else 8 if CHECK else 1)


def test_a_root_still_comparing_while_its_peers_run_ahead(comm):
    """A loop of 100 reduces to the last rank, the first compared (a new program): the
    other ranks' sends are eager, so they run ahead of the root. No rank leaves the
    comparison before every rank has read what it needs: before, a root still reading
    when more than 64 unmatched messages had reached it waited for ever under MPICH over
    libfabric's TCP provider (CI's network part: the connection stops there,
    FI_TCP_MAX_SAVED, and the read's reply waits behind them)."""
    for shift in range(3):
        x = np.arange(3.0 + shift) + rank  # (a new shape: a new program)

        def f(v, shift=shift):
            def body(j, acc):
                return acc + vjpmpi.reduce(v * (j + 1) + shift, MPI.SUM, last, comm=comm)
            return jax.lax.fori_loop(0, 100, body, jnp.zeros_like(v))

        v = to_device(x)
        run = jax.jit(f).lower(v).compile()
        comm.Barrier()  # (the ranks start together: the others' sends come early)
        before = _kernels.cpu.verified_count()
        got = np.asarray(run(v))
        j = np.arange(1.0, 101.0)[:, None]
        total = sum(np.arange(3.0 + shift) + r for r in range(size))
        # the root gets the sum over ranks; a non-root's reduce returns its input
        want = (j * total + size * shift if rank == last else j * x + shift).sum(0)
        np.testing.assert_array_equal(got, want)
        assert _kernels.cpu.verified_count() - before == (0 if size == 1 else 100 if CHECK else 1)


# ------------------------------------------ checks only some ranks can make --
def test_scatter_root_refusal_reaches_the_ranks_that_wait(comm):
    """Only the root can check its input's rank axis: a bad one raises ValueError there at
    trace time (as mpi4jax's scatter does), and the ranks waiting in the scatter for it
    stop with the same message (they used to wait in MPI_Scatter for ever); all go on in
    step. The communicator is fresh: the others wait for its window's opening."""
    root = last
    x = to_device(np.ones((size + 1, 2) if rank == root else (2,), np.float32))

    def refused(n):  # (the root's message for its input of shape (size + 1, n))
        return (rf"vjpmpi\.scatter: argument 'x' on the root \(rank {root}\) must have a "
                rf"leading axis of length comm size {size}, got shape \({size + 1}, {n}\)")
    message = refused(2)
    if rank == root:
        with pytest.raises(ValueError, match=message):
            vjpmpi.scatter(x, root, comm=comm)
    else:
        raises_everywhere(lambda: vjpmpi.scatter(x, root, comm=comm), message,
                          rf"rank {root} refused it when it traced the call")
    in_step(comm)  # (the root's next call there waits for the others to stop in the scatter)
    # the same on a communicator whose window is open, in a jitted program new to every
    # rank (the others compare; inside MPI already, in a program they verified before, they
    # would end the job: tests/test_reliability.py)
    f = jax.jit(lambda v: vjpmpi.scatter(v * 2, root, comm=comm))
    x3 = to_device(np.ones((size + 1, 3) if rank == root else (3,), np.float32))
    if rank == root:
        with pytest.raises(ValueError, match=refused(3)):
            f(x3)
    else:
        raises_everywhere(lambda: f(x3), refused(3), rf"rank {root} refused it when it traced",
                          rf"rank {root}: refused it \(its argument error, above\)")
    in_step(comm)
    # the mpi4py habit: the whole (size, n) array passed on every rank, template included
    full = to_device(np.ones((size, 3), np.float32))
    raises_everywhere(lambda: jax.jit(lambda v: vjpmpi.scatter(v, 0, comm=comm))(full),
                      MISMATCH, "shape differs", row(0, "scatter(root=0) on float32[3]"),
                      row(1, f"scatter(root=0) on float32[{size}, 3]"))
    in_step(comm)


def test_refusal_skipped_by_the_others_leaves_them_in_step(comm):
    """mpi4jax's own test of a wrong-size scatter runs on the root only: the root raises,
    the others never call the scatter, and everyone's next collectives (a scatter from the
    same root among them) pair as they should."""
    root = last
    if rank == root:
        with pytest.raises(ValueError, match="vjpmpi.scatter: argument 'x' on the root"):
            vjpmpi.scatter(to_device(np.ones(size + 1, np.float32)), root, comm=comm)
    good = to_device(np.arange(size * 2.0, dtype=np.float32).reshape(size, 2)
                     if rank == root else np.zeros(2, np.float32))
    y = vjpmpi.scatter(good, root, comm=comm)
    np.testing.assert_array_equal(np.asarray(y), [2.0 * rank, 2.0 * rank + 1])
    in_step(comm)


@pytest.mark.parametrize("stalled", [False, True], ids=["together", "rank0_stalled"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_refusal_then_another_collective_at_once_ends_in_step(comm, jitted, stalled):
    """Every rank calls a gatherv whose root passes capacity=-1, then at once an
    allreduce, each in try/except (issue 60, item 6): the root refuses at trace time and
    goes on; the others stop in the gatherv with the root's message, not with a mismatch
    against the root's allreduce, and every allreduce pairs with every other (the others'
    used to wait in theirs for ever, the root's having been taken for the gatherv's).
    `stalled`: the root, a second after the others went into the gatherv, stops rank 0's
    process there (SIGSTOP) for half a second before it refuses. At 3 ranks and more,
    another rank then stops in the gatherv and runs its allreduce while rank 0 still waits
    in the gatherv: it must wait for rank 0 to leave it, not take rank 0's gatherv for a
    mismatch (it used to raise alone and wait in the agreement's barrier while the others
    ran their allreduce: a hang that CI met by chance, issue 61)."""
    root = last
    pid0 = WORLD.bcast(os.getpid(), root=0)
    if stalled and len(set(WORLD.allgather(MPI.Get_processor_name()))) > 1:
        pytest.skip("the ranks are on several machines: rank 0 cannot be stopped from the root")
    x = to_device(np.arange(4.0) + rank)
    gatherv = functools.partial(vjpmpi.gatherv, root=root, comm=comm,
                                capacity=-1 if rank == root else 2 * size)
    allreduce = functools.partial(vjpmpi.allreduce, op=MPI.SUM, comm=comm)
    if jitted:
        gatherv, allreduce = jax.jit(gatherv), jax.jit(allreduce)
    message = r"vjpmpi\.gatherv: argument 'capacity'=-1 must be in 0\.\.2\*\*31 - 1"
    errors, sums, resumes = [], [], []
    for _ in range(2):  # (twice: again on a communicator whose programs ran before)
        if stalled and rank == root:
            time.sleep(1.0)  # (the others are in the gatherv by now)
            os.kill(pid0, signal.SIGSTOP)  # (the job's own rank 0, by its id)
            resumes.append(subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {pid0}"]))
        try:
            jax.block_until_ready(gatherv(x, 2))
        except ValueError as err:
            errors.append(str(err))
        try:
            sums.append(np.asarray(allreduce(x)))
        except ValueError as err:
            sums.append(str(err))
    assert all(r.wait() == 0 for r in resumes)
    assert len(errors) == 2, errors
    for text in errors:
        assert re.search(message, text), text
        if rank != root:
            assert f"rank {root} refused it when it traced the call" in text, text
    want = sum(np.arange(4.0) + r for r in range(size))
    for got in sums:
        assert not isinstance(got, str), got
        np.testing.assert_array_equal(got, want)
    in_step(comm)


def test_a_failed_run_is_a_value_error_on_both_of_jaxs_paths(comm):
    """A call that fails when it runs (a count past the rows, on one rank: an error on
    every rank) raises ValueError on every rank, whether its program was compiled by this
    call (JAX's Python path, which raises JaxRuntimeError: vjpmpi's text turns it into a
    ValueError that is also one) or ran before (JAX's C++ fast path raises ValueError)
    (issue 60, item 8). The paths differ between ranks in one call: rank 0 calls a fresh
    jit, the others the one that ran before."""
    x = to_device(np.arange(6.0).reshape(3, 2) + rank)

    def program():
        return jax.jit(lambda v, k: vjpmpi.allgatherv(v, k, capacity=3 * size, comm=comm))

    warm = program()
    y, counts = warm(x, 1)  # (compiled: the next calls take the fast path)
    np.testing.assert_array_equal(np.asarray(counts), np.ones(size))
    bad = 4 if rank == last else 1  # (more than the 3 rows of x, on the last rank only)
    for fresh in (True, False):
        f = program() if fresh and rank == 0 else warm
        message = rf"vjpmpi\.allgatherv: rank {last}'s count=4 is more than the 3 rows"
        with pytest.raises(ValueError, match=message) as info:
            f(x, bad)
        if f is not warm:  # (JAX's own type on its Python path, kept)
            assert isinstance(info.value, jax.errors.JaxRuntimeError), type(info.value)
    y, counts = warm(x, 1)
    np.testing.assert_array_equal(np.asarray(counts), np.ones(size))
    in_step(comm)


# -------------------------------------------------------------- lifetimes --
def test_status_of_a_dead_object_is_not_written():
    """A program that creates its MPI.Status while tracing keeps no address: the object
    is gone when it runs (it used to crash); a live one is filled on every call."""
    peer = rank ^ 1
    if peer >= size:
        return

    def exchange(v):
        status = MPI.Status()  # dies when tracing ends
        return vjpmpi.sendrecv(v, v, source=peer, dest=peer, sendtag=10 + rank, status=status)

    slots = _kernels.cpu._status_slots()
    f = jax.jit(exchange)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(to_device(np.full(2, rank + 0.5)))),
                                      np.full(2, peer + 0.5))
        assert _kernels.cpu._status_slots() == slots  # (released when tracing ended)
    kept = MPI.Status()
    g = jax.jit(lambda v: vjpmpi.sendrecv(v, v, source=peer, dest=peer, sendtag=20 + rank,
                                          status=kept))
    g(to_device(np.ones(2))).block_until_ready()
    assert (kept.Get_source(), kept.Get_tag()) == (peer, 20 + peer)
    assert _kernels.cpu._status_slots() == slots + 1
    del kept
    assert _kernels.cpu._status_slots() == slots  # its slot is gone: nothing is written
    g(to_device(np.ones(2))).block_until_ready()


def test_program_of_a_freed_communicator_fails_on_every_rank():
    """MPICH hands a freed communicator's handle to the next one: a program traced with
    the freed one must not run on the new one."""
    old = WORLD.Dup()
    handle = old.handle
    f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=old))
    x = to_device(np.ones(3))
    np.testing.assert_array_equal(np.asarray(f(x)), np.full(3, size))
    old.Free()
    new = WORLD.Split(rank % 2, rank)  # a different group, maybe the same handle
    try:
        raises_everywhere(lambda: f(x), r"vjpmpi\.allreduce: the communicator this program was "
                                        r"traced with .* has been freed")
        g = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=new))
        np.testing.assert_array_equal(np.asarray(g(x)), np.full(3, new.Get_size()))
        print(f"freed handle {handle:#x}, new communicator's {new.handle:#x}")
    finally:
        new.Free()


# ---------------------------------------------------------------- threads --
def in_thread(fn):
    """fn() on a new thread; what it returned or raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_communicator_belongs_to_its_first_thread(comm):
    """Another thread's collective on it raises (traced, eager, or a compiled program it
    runs on that thread); each thread with a communicator of its own runs."""
    x = to_device(np.full(3, rank + 1.0))
    f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=comm))
    np.testing.assert_array_equal(np.asarray(f(x)), np.full(3, size * (size + 1) / 2))
    owns = r"thread \d+ runs a collective on a communicator that thread \d+ owns"
    eager = in_thread(lambda: vjpmpi.allreduce(x, MPI.SUM, comm=comm))
    assert re.search(owns, str(eager.get("error"))), eager
    traced = in_thread(lambda: jax.jit(lambda v: vjpmpi.bcast(v, 0, comm=comm))(x))
    assert re.search(owns, str(traced.get("error"))), traced
    compiled = in_thread(lambda: jax.block_until_ready(f(x)))  # traced by this thread
    assert re.search(owns, str(compiled.get("error"))), compiled
    # a communicator per thread: both threads' results are right on every rank
    mine = WORLD.Dup()
    try:
        other = in_thread(lambda: np.asarray(vjpmpi.allreduce(x * 1000, MPI.SUM, comm=mine)))
        np.testing.assert_array_equal(other["value"], np.full(3, 1000 * size * (size + 1) / 2))
    finally:
        mine.Free()
    in_step(comm)
