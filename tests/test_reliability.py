"""Failure modes that end a job: mismatch check, timeout watchdog, failing rank,
use after MPI_Finalize, messages over 2**31 elements.

Each case runs its own program under mpiexec (with a hard timeout) and checks
what the user sees and how fast the job ends. The cases where the number of ranks
matters (the mismatch check, the timeout watchdog, a failing rank, MPI_Finalize) run
at 2 and 3 ranks: at 3, one rank against two others, and ranks that are neither the
first nor the one that goes wrong. (The check's absence of false alarms over the whole
suite is the 3-rank job of tests/test_multirank.py, which runs every test with
VJPMPI_CHECK=1 and VJPMPI_TIMEOUT=300; 8 oversubscribed ranks are its 8-rank job.)
"""

import re
import textwrap
import time

import pytest

from _mpirun import RANK_ENV, Job, mpirun, network_env

HEADER = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
import vjpmpi
rank = MPI.COMM_WORLD.rank


def say(*parts):  # one write per line: ranks' lines never interleave
    sys.stdout.write(" ".join(str(p) for p in parts) + "\\n")
    sys.stdout.flush()
"""


def run_script(tmp_path, body, nprocs=2, timeout=120, env=None, argv=()):
    script = tmp_path / "prog.py"
    script.write_text(HEADER + textwrap.dedent(body))
    t0 = time.monotonic()
    run = mpirun(nprocs, [*argv, str(script)], timeout=timeout, env=env)
    return run, time.monotonic() - t0


CHECK = {"VJPMPI_CHECK": "1"}
NPROCS = pytest.mark.parametrize("nprocs", [2, 3])


def report(run, needle):
    """The lines of every rank's report that contain `needle`."""
    return [ln for ln in run.output.splitlines() if needle in ln]


@NPROCS
def test_check_names_each_ranks_collective(tmp_path, nprocs):
    run, took = run_script(tmp_path, """
        def f(x):
            if rank == 0:
                return vjpmpi.bcast(x, 0)
            return vjpmpi.allreduce(x, MPI.SUM)
        try:
            jax.jit(f)(jnp.ones((10, 100), jnp.float32)).block_until_ready()
        except Exception as e:
            say(f"rank {rank} caught:", e)
    """, nprocs=nprocs, env=CHECK, timeout=60)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert len(report(run, "caught: ")) == nprocs, run.describe()  # every rank raises
    assert f"collective mismatch (VJPMPI_CHECK) on a communicator of {nprocs} ranks" in run.output
    # every rank's report names every rank's collective
    assert len(report(run, "rank 0: bcast(root=0) on float32[10, 100] at")) == nprocs, \
        run.describe()
    assert re.search(r"rank 0: bcast\(root=0\) on float32\[10, 100\] at \S+prog.py:\d+ \(f\)",
                     run.output), run.describe()
    for r in range(1, nprocs):
        assert re.search(rf"rank {r}: allreduce\(SUM\) on float32\[10, 100\] at \S+prog.py:\d+ "
                         r"\(f\)", run.output), run.describe()
        assert len(report(run, f"rank {r}: allreduce(SUM) on float32[10, 100] at")) == nprocs
    print(f"mismatch reported on all {nprocs} ranks, job done in {took:.1f} s")


@NPROCS
def test_check_catches_shape_and_root_differences(tmp_path, nprocs):
    run, _ = run_script(tmp_path, """
        cases = {
            "shape": lambda: vjpmpi.allreduce(jnp.ones(10 + rank), MPI.SUM),
            "root": lambda: vjpmpi.bcast(jnp.ones(4), rank),
            "op": lambda: vjpmpi.allreduce(jnp.ones(4), MPI.SUM if rank else MPI.MAX),
            "dtype": lambda: vjpmpi.allgather(jnp.ones(4, jnp.float32 if rank else jnp.int32)),
        }
        for name, call in cases.items():
            try:
                call().block_until_ready()
                say(f"rank {rank} {name}: no error")
            except Exception as e:
                say(f"rank {rank} {name}: mismatch={'collective mismatch' in str(e)}")
        say(f"rank {rank} after:", vjpmpi.allreduce(jnp.ones(2), MPI.SUM))
    """, nprocs=nprocs, env=CHECK, timeout=60)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    for case in ("shape", "root", "op", "dtype"):
        assert len(report(run, f"{case}: mismatch=True")) == nprocs, run.describe()
    # after the reported mismatches the ranks are still in step
    assert len(report(run, f"after: [{nprocs}. {nprocs}.]")) == nprocs, run.describe()


@NPROCS
def test_check_catches_forward_against_backward(tmp_path, nprocs):
    run, _ = run_script(tmp_path, """
        def loss(x):
            return jnp.sum(vjpmpi.bcast(x, 0) ** 2)
        x = jnp.arange(4.0)
        try:
            if rank == 0:
                jax.jit(jax.grad(loss))(x).block_until_ready()   # bcast, then reduce
            else:
                jax.jit(loss)(x).block_until_ready()             # bcast
                jax.jit(loss)(x).block_until_ready()             # bcast: meets the reduce
        except Exception as e:
            say(f"rank {rank} caught:", e)
    """, nprocs=nprocs, env=CHECK, timeout=60)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert len(report(run, "caught: ")) == nprocs, run.describe()
    assert re.search(r"rank 0: reduce\(SUM, root=0\) on float32\[4\] \[backward\] at", run.output)
    for r in range(1, nprocs):
        assert re.search(rf"rank {r}: bcast\(root=0\) on float32\[4\] at", run.output), \
            run.describe()


def test_program_on_several_devices_of_one_process_runs(tmp_path):
    """Two CPU devices in one process, a mesh of jax.make_mesh's default axis type (arrays
    typed by their split): a shard_map and a jit of the split array each run every
    device's own call (one process: the sum is the array), as does one device."""
    run, _ = run_script(tmp_path, """
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((2,), ("i",))
        x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("i")))
        f = jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM), mesh=mesh, in_specs=P("i"),
                          out_specs=P("i"))
        for fn in (f, lambda v: vjpmpi.allreduce(v, MPI.SUM) * 2):
            say("ran:", np.asarray(jax.jit(fn)(x)))
        one = jax.make_mesh((1,), ("i",), devices=jax.devices()[:1])
        g = jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM), mesh=one, in_specs=P(),
                          out_specs=P())
        say("one device:", np.asarray(jax.jit(g)(jnp.arange(4.0, device=jax.devices()[0]))))
    """, nprocs=1, timeout=120,
        env={"XLA_FLAGS": RANK_ENV["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"})
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert "ran: [0. 1. 2. 3.]" in run.output, run.describe()
    assert "ran: [0. 2. 4. 6.]" in run.output, run.describe()
    assert "one device: [0. 1. 2. 3.]" in run.output, run.describe()


# A rank runs a program again (verified when all ranks ran it): it moves data without
# comparing. Another rank runs a program new to it whose collective disagrees: it
# compares, finds the first rank already inside the collective (it cannot be told) and
# ends the job with the message, instead of a wrong answer on both.
HIT_AND_MISS = """
    x = jnp.ones((2, 3), jnp.float32)
    f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
    f(x).block_until_ready()
    say(f"rank {rank} first call ok")
    if rank == 0:
        f(x).block_until_ready()
    else:
        jax.jit(lambda v: vjpmpi.allreduce(v.T, MPI.SUM))(x).block_until_ready()
    say(f"rank {rank} NO ERROR")
"""


@NPROCS
def test_disagreement_with_a_rank_already_inside_ends_the_job(tmp_path, nprocs):
    run, took = run_script(tmp_path, HIT_AND_MISS, nprocs=nprocs, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert len(report(run, "first call ok")) == nprocs and "NO ERROR" not in run.output
    assert re.search(r"vjpmpi\.allreduce: the ranks disagree on a communicator of "
                     rf"{nprocs} ranks \(their collective #2 there\): shape differs", run.output)
    assert re.search(r"\n  rank 0: allreduce\(SUM\) on float32\[2, 3\]( at \S+ \S+)? \(already "
                     r"running it: it ran this program before\)", run.output), run.describe()
    assert re.search(r"\n  rank 1: allreduce\(SUM\) on float32\[3, 2\]( at \S+ \S+)?\n",
                     run.output), run.describe()
    assert "Aborting the job: some ranks cannot be told" in run.output
    assert took < 60, f"job took {took:.1f} s to end"


# One rank runs a collective more than the others, which end: it learns that they
# called MPI_Finalize (their windows say so) instead of waiting for them forever.
# - "new": a program new to it, whose collective it compares before moving data;
# - "verified": a program every rank ran before: it moves data at once, inside
#   MPI_Allreduce, and its watchdog reads the others' windows after a second.
# (script, what the job says: a pattern per line)
EXTRA_AT_THE_END = {
    "new": ("""
        x = jnp.ones(3, jnp.float32)
        jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))(x).block_until_ready()
        if rank == 0:
            jax.jit(lambda v: vjpmpi.bcast(v, 0))(x).block_until_ready()   # the others don't
            say("NO ERROR")
    """, [r"vjpmpi\.bcast: not every rank runs this collective on a communicator of {n} ranks "
          r"\(their collective #2 there\)", r"\n  rank 0: bcast\(root=0\) on float32\[3\]",
          r"\n  rank 1: has called MPI_Finalize without running it"]),
    "verified": ("""
        x = jnp.ones(3, jnp.float32)
        f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
        f(x).block_until_ready()
        if rank == 0:
            f(x).block_until_ready()   # the others don't
            say("NO ERROR")
    """, [r"vjpmpi: rank 0 of {n} has waited [1-4]\.\d s in allreduce\(SUM\) on float32\[3\] at "
          r"\S+prog.py:\d+ \S+, on a communicator of {n} ranks \(rank 0 there\) \(its "
          r"collective #2 there\); rank [1-9] has called MPI_Finalize without running it\.\n"
          r"Aborting the job \(the ranks inside the call cannot be told\)"]),
}


@NPROCS
@pytest.mark.parametrize("case", EXTRA_AT_THE_END)
def test_collective_after_the_others_finished_ends_the_job(tmp_path, nprocs, case):
    body, patterns = EXTRA_AT_THE_END[case]
    run, took = run_script(tmp_path, body, nprocs=nprocs, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "NO ERROR" not in run.output
    for pattern in patterns:
        assert re.search(pattern.replace("{n}", str(nprocs)), run.output), (pattern,
                                                                            run.describe())
    if case == "new":  # (each rank's row)
        for r in range(2, nprocs):
            assert f"\n  rank {r}: has called MPI_Finalize without running it" in run.output
    assert took < 60, f"job took {took:.1f} s to end"


# With VJPMPI_CHECK every collective is compared; a rank waiting for others that never
# come (here: they sleep after their last collective) gives up at VJPMPI_TIMEOUT (60 s
# without it), saying where each rank is, and ends the job.
EXTRA_WHILE_OTHERS_SLEEP = """
    x = jnp.ones(3, jnp.float32)
    jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))(x).block_until_ready()
    if rank == 0:
        jax.jit(lambda v: vjpmpi.bcast(v, 0))(x).block_until_ready()
        say("NO ERROR")
    else:
        time.sleep(300)
"""


@NPROCS
def test_check_waits_for_absent_ranks_within_its_limit(tmp_path, nprocs):
    run, took = run_script(tmp_path, EXTRA_WHILE_OTHERS_SLEEP, nprocs=nprocs, timeout=120,
                           env={**CHECK, "VJPMPI_TIMEOUT": "3"})
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert re.search(rf"vjpmpi: timeout \(VJPMPI_TIMEOUT=3 s\): rank 0 of {nprocs} has waited "
                     r"3\.\d s in bcast\(root=0\) on float32\[3\] at \S+prog.py:\d+ \S+, on a "
                     rf"communicator of {nprocs} ranks \(rank 0 there\); the other ranks did not "
                     r"join it \(it is their collective #2 there\)", run.output), run.describe()
    for r in range(1, nprocs):
        assert f"\n  rank {r}: has not reached it" in run.output
        assert (f"\n  (rank {r}'s last collective there: #1, allreduce(SUM) on float32[3])"
                in run.output), run.describe()
    assert took < 60, f"job took {took:.1f} s to end"


# A rank's first collective on a communicator, the other ranks never running it (they
# return and finalize): that collective opens the communicator's agreement window, a
# collective of its own; the rank that waits reads the others' headers in the default
# communicator's window (opened at import) and ends the job, saying they have called
# MPI_Finalize, with default settings and under VJPMPI_CHECK.
FIRST_ALONE = """
    comm = None if "{comm}" == "default" else MPI.COMM_WORLD.Split(0, rank)
    f = lambda x, r: jax.lax.cond(r == 0, lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=comm),
                                  lambda v: v, x)
    y = jax.jit(f)(jnp.ones(4) * (rank + 1), rank)
    say(f"rank {{rank}} returned", np.asarray(y)[0])
"""


@pytest.mark.parametrize("nprocs,env", [(2, "default"), (3, "default"), (3, "check")])
@pytest.mark.parametrize("comm", ["default", "split"])
def test_first_collective_without_partners_ends_the_job(tmp_path, nprocs, comm, env):
    run, took = run_script(tmp_path, FIRST_ALONE.format(comm=comm), nprocs=nprocs,
                           env=CHECK if env == "check" else None, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "rank 0 returned" not in run.output, run.describe()
    for r in range(1, nprocs):
        assert f"rank {r} returned" in run.output, run.describe()
    if comm == "default":  # (its window is open: the agreement reads the others' entries)
        assert re.search(r"vjpmpi\.allreduce: not every rank runs this collective on a "
                         rf"communicator of {nprocs} ranks \(their collective #1 there\)",
                         run.output), run.describe()
        for r in range(1, nprocs):
            assert f"\n  rank {r}: has called MPI_Finalize without running it" in run.output
    else:
        assert re.search(rf"vjpmpi: rank 0 of {nprocs} has waited \d+\.\d s in allreduce\(SUM\) "
                         r"on float32\[4\] at \S+prog.py:\d+ \S+, on a communicator of "
                         rf"{nprocs} ranks \(rank 0 there\), its first collective there "
                         r"\(which opens the communicator's agreement window.*\); rank [1-9] has "
                         r"called MPI_Finalize without running it", run.output), run.describe()
    assert took < 30, f"job took {took:.1f} s to end"


# A rank that has waited past VJPMPI_WARN_AFTER (60 s by default) in a call says so, once
# per call, naming it and, for a collective, the ranks that have not reached it (read from
# their windows); nothing ends the job unless VJPMPI_TIMEOUT is set. Here a verified
# program, so the waiting ranks are inside MPI (the watchdog's thread warns), or a receive
# whose tag no message has.
STRAGGLER = {
    "collective": ("""
        f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
        x = jnp.ones(1000, jnp.float32)
        f(x).block_until_ready()   # (collective #1: the program is verified on every rank)
        if rank == 1:
            time.sleep(4)          # past VJPMPI_WARN_AFTER=2, then joins
        say(f"rank {rank} result", float(f(x)[0]))
    """, {"VJPMPI_WARN_AFTER": "2"}),
    "tag": ("""
        x = jnp.ones(8, jnp.float32)
        if rank == 0:    # sends tag 1 (received), waits for a tag 2 that never comes
            jax.jit(lambda v: vjpmpi.sendrecv(v, v, 1, 1, sendtag=1, recvtag=2))(x)
            say("NO ERROR")
        elif rank == 1:
            jax.jit(lambda v: vjpmpi.sendrecv(v, v, 0, 0, sendtag=3, recvtag=1))(x)
        say(f"rank {rank} idle")
        time.sleep(60)
    """, {"VJPMPI_WARN_AFTER": "2", "VJPMPI_TIMEOUT": "6"}),
}


@pytest.mark.parametrize("case,nprocs", [("collective", 2), ("collective", 3), ("tag", 2)])
def test_watchdog_warns_about_a_stuck_call(tmp_path, case, nprocs):
    body, env = STRAGGLER[case]
    run, took = run_script(tmp_path, body, nprocs=nprocs, env=env, timeout=120)
    warnings = report(run, "vjpmpi: warning (VJPMPI_WARN_AFTER=2 s)")
    assert "NO ERROR" not in run.output, run.describe()
    if case == "collective":  # every rank but 1 waits in it: each warns once, then all end
        assert run.returncode == 0 and not run.timed_out, run.describe()
        assert len(report(run, f"result {float(nprocs)}")) == nprocs, run.describe()
        assert len(warnings) == nprocs - 1, run.describe()
        for r in (r for r in range(nprocs) if r != 1):
            assert any(re.search(
                rf"rank {r} of {nprocs} has waited [23]\.\d s in allreduce\(SUM\) on "
                rf"float32\[1000\] at \S+prog.py:\d+ \S+, on a communicator of {nprocs} ranks "
                rf"\(rank {r} there\)\. It is their collective #2 there; not there yet: rank 1 "
                r"\(its last collective there: #1, allreduce\(SUM\) on float32\[1000\]\)\. "
                r"Still waiting", w) for w in warnings), run.describe()
    else:  # one warning on rank 0, then VJPMPI_TIMEOUT ends the job
        assert run.returncode != 0 and not run.timed_out, run.describe()
        assert len(warnings) == 1 and re.search(
            rf"rank 0 of {nprocs} has waited 2\.\d s in sendrecv\(dest=1, source=1, "
            r"sendtag=1, recvtag=2\) on float32\[8\], float32\[8\] at \S+prog.py:\d+ \S+, on a "
            rf"communicator of {nprocs} ranks \(rank 0 there\)\. It waits for rank 1\.",
            warnings[0]), run.describe()
        assert re.search(rf"vjpmpi: timeout \(VJPMPI_TIMEOUT=6 s\): rank 0 of {nprocs} has "
                         r"waited 6\.\d s in sendrecv\(", run.output), run.describe()
    assert took < 60, f"job took {took:.1f} s to end"


# A root that refused its scatter at trace time (ValueError there) while the others run a
# program they had verified before: they are inside MPI_Scatter and cannot be told. Their
# watchdogs read the root's note (unchanged for a second) and end the job with its message,
# or, where the root goes on at once with another collective there, the root's agreement
# sees them in the call it refused and ends the job with it (issue 60, item 6).
REFUSED_INSIDE = """
    n = MPI.COMM_WORLD.size
    f = jax.jit(lambda v: vjpmpi.scatter(v, 0))
    f(jnp.ones((n, 3)) if rank == 0 else jnp.ones(3)).block_until_ready()   # verified
    try:
        f(jnp.ones((n + 1, 3)) if rank == 0 else jnp.ones(3)).block_until_ready()
        say("NO ERROR")
    except ValueError as e:
        say(f"rank {rank} raised ValueError:", str(e).splitlines()[0])
        if GO_ON:
            vjpmpi.allreduce(jnp.ones(2), MPI.SUM).block_until_ready()
            say("WENT ON")
        time.sleep(60)
"""


@NPROCS
@pytest.mark.parametrize("go_on", [False, True], ids=["stays", "goes_on"])
def test_refusal_reaches_ranks_inside_the_collective(tmp_path, nprocs, go_on):
    run, took = run_script(tmp_path, f"GO_ON = {go_on}\n" + textwrap.dedent(REFUSED_INSIDE),
                           nprocs=nprocs, timeout=120)
    assert "WENT ON" not in run.output, run.describe()
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "NO ERROR" not in run.output
    message = (rf"vjpmpi\.scatter: argument 'x' on the root \(rank 0\) must have a leading "
               rf"axis of length comm size {nprocs}, got shape \({nprocs + 1}, 3\)")
    assert re.search("rank 0 raised ValueError: " + message, run.output), run.describe()
    assert re.search(message + r"\n\(rank 0 refused it when it traced the call, raising this "
                     r"there, and will not run it; the ranks waiting in it stop here: their "
                     rf"collective #2 on a communicator of {nprocs} ranks\)\nAborting the job "
                     r"\(the ranks inside the call cannot be told\)", run.output), run.describe()
    assert took < 60, f"job took {took:.1f} s to end"


def test_check_compares_point_to_point_dtypes(tmp_path):
    """Same number of bytes, another dtype: MPI cannot tell; VJPMPI_CHECK sends a header
    first and the receiver raises, naming both sides. The ranks go on in step."""
    run, _ = run_script(tmp_path, """
        if rank == 0:
            vjpmpi.send(jnp.arange(4, dtype=jnp.float32), 1, tag=3)
        else:
            try:
                vjpmpi.recv(jnp.zeros(4, jnp.int32), 0, tag=3).block_until_ready()
                say("NO ERROR")
            except Exception as e:
                say("caught:", str(e).splitlines()[0])
        say(f"rank {rank} after:", vjpmpi.allreduce(jnp.ones(2), MPI.SUM))
    """, env=CHECK, timeout=60)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert re.search(r"caught: .*vjpmpi\.recv: \(VJPMPI_CHECK\) rank 0 sent float32\[4\] "
                     r"\(send\(dest=1, tag=3\) on float32\[4\] at \S+prog.py:\d+ \S+\) with tag 3, but "
                     r"rank 1's receive template is int32\[4\]", run.output), run.describe()
    assert len(report(run, "after: [2. 2.]")) == 2, run.describe()


# Checks only one rank can make end the job with their message when the exchange runs,
# instead of raising on that rank while its peers wait for its messages for ever.
ONE_SIDED = {
    # rank 1's block (1 cell) is narrower than the halo (2 cells): only it can tell
    "halo": ("""
        import vjpmpi.nn as vnn
        cart = MPI.COMM_WORLD.Create_cart([2], periods=[True])
        u = jnp.arange(4.0 if rank == 0 else 1.0)
        say(f"rank {rank} traced:", jax.jit(vnn.HaloExchange(cart, width=2)).lower(u) is not None)
        y = vnn.HaloExchange(cart, width=2)(u).block_until_ready()
        say("NO ERROR", y)
    """, r"vjpmpi\.nn\.HaloExchange: on rank 1, the block shape \(1,\) is smaller than the "
         r"halo width 2 \(the neighbours that wait for its halos cannot check it\)"),
    # rank 1 receives from ANY_SOURCE: its derivative names no rank to send back to
    "any_source": ("""
        def f(x):
            if rank == 0:
                vjpmpi.send(x, 1)
                return jnp.sum(x) * 0
            return jnp.sum(vjpmpi.recv(x, MPI.ANY_SOURCE) ** 2)
        say(f"rank {rank} traced:", jax.jit(jax.grad(f)).lower(jnp.ones(3)) is not None)
        g = jax.grad(f)(jnp.ones(3)).block_until_ready()
        say("NO ERROR", g)
    """, r"vjpmpi\.recv: differentiating a receive needs an explicit 'source': with "
         r"MPI\.ANY_SOURCE the tangent and cotangent messages could pair with another "
         r"sender's"),
}


@pytest.mark.parametrize("case", ONE_SIDED)
def test_check_only_one_rank_can_make_ends_the_job(tmp_path, case):
    body, message = ONE_SIDED[case]
    run, took = run_script(tmp_path, body, nprocs=2, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert len(report(run, "traced: True")) == 2, run.describe()  # (tracing raises nowhere)
    assert "NO ERROR" not in run.output
    assert re.search(message, run.output), run.describe()
    assert "Aborting the job (the ranks it exchanges messages with cannot be told)" in run.output
    assert took < 60, f"job took {took:.1f} s to end"


HANG = """
    x = jnp.ones(1000, jnp.float32)
    if rank == 0:
        jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))(x).block_until_ready()
    else:
        time.sleep(300)   # never joins the allreduce
"""


@NPROCS
def test_timeout_names_the_stuck_call_and_aborts(tmp_path, nprocs):
    run, took = run_script(tmp_path, HANG, nprocs=nprocs, env={"VJPMPI_TIMEOUT": "3"},
                           timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert re.search(rf"vjpmpi: timeout \(VJPMPI_TIMEOUT=3 s\): rank 0 of {nprocs} has waited "
                     r"3\.\d s in allreduce\(SUM\) on float32\[1000\] at \S+prog.py:\d+ \S+, "
                     rf"on a communicator of {nprocs} ranks \(rank 0 there\)", run.output), \
        run.describe()
    assert took < 60, f"job took {took:.1f} s to end"
    print(f"timeout 3 s at {nprocs} ranks: job ended after {took:.1f} s")


# A limit too large for int64 nanoseconds past now (inf; 1e10 s, about 317 years) is no
# limit: its deadline once overflowed into the past, and where the ranks' agreement
# waits for MPI to complete a read (no shared memory: MPIR_CVAR_NOLOCAL=1) the job ended
# at its first collective, "has waited 0.0 s". The same with the warning's limit.
@pytest.mark.parametrize("nprocs,limit", [(2, "inf"), (3, "1e10")])
def test_timeout_past_int64_nanoseconds_is_no_limit(tmp_path, nprocs, limit):
    run, took = run_script(tmp_path, """
        x = jnp.arange(1000, dtype=jnp.float32)
        f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
        g = jax.jit(lambda v: vjpmpi.bcast(v + 1, 0))
        for _ in range(3):
            assert (np.asarray(f(x)) == MPI.COMM_WORLD.size * np.asarray(x)).all()
            assert (np.asarray(g(x)) == np.asarray(x) + 1).all()
        say(f"rank {rank} OK")
    """, nprocs=nprocs, timeout=120,
        env={**network_env(), "VJPMPI_TIMEOUT": limit, "VJPMPI_WARN_AFTER": limit})
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert len(report(run, " OK")) == nprocs and "timeout" not in run.output, run.describe()
    print(f"VJPMPI_TIMEOUT={limit} at {nprocs} ranks over the network module: {took:.1f} s")


# Calls the watchdog must see among others, each stuck in a receive that never ends:
# - "started": a started receive (vjpmpi.start), watched from its start while the
#   program computes and then waits;
# - "two_comms": two threads of rank 0, each on its own communicator, the stuck receive
#   beside a stream of short calls (the latest call, ending, once hid the stuck one
#   until the job's own timeout).
# (script, the stuck call's site as the timeout names it)
WATCHED = {
    "started": ("""
        x = jnp.ones(1000, jnp.float32)
        if rank == 0:
            def f(v):
                p = vjpmpi.start(vjpmpi.recv, v, 1, tag=7)
                return vjpmpi.wait(p) + jnp.sin(v)
            jax.jit(f)(x).block_until_ready()
            say("NO ERROR")
        else:
            time.sleep(300)   # never sends
    """, r"recv\(source=1, tag=7\) on float32\[1000\]"),
    "two_comms": ("""
        import threading
        a, b = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
        x = jnp.ones(100, jnp.float32)
        exchange = jax.jit(lambda v: vjpmpi.sendrecv(v, v, 1 - rank, 1 - rank, comm=b))
        exchange(x).block_until_ready()
        if rank == 0:
            stuck = jax.jit(lambda v: vjpmpi.recv(v, 1, comm=a))   # (from any tag)
            threading.Thread(target=lambda: stuck(x).block_until_ready(), daemon=True).start()
        for _ in range(400):   # about 8 s, past the limit
            exchange(x).block_until_ready()
            time.sleep(0.02)
        say("NO ERROR")
        time.sleep(300)
    """, r"recv\(source=1, tag=ANY_TAG\) on float32\[100\]"),
}


@pytest.mark.parametrize("case", WATCHED)
def test_timeout_watches_every_call_in_flight(tmp_path, case):
    body, site = WATCHED[case]
    run, took = run_script(tmp_path, body, env={"VJPMPI_TIMEOUT": "3"}, timeout=90)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "NO ERROR" not in run.output
    assert re.search(r"vjpmpi: timeout \(VJPMPI_TIMEOUT=3 s\): rank 0 of 2 has waited 3\.\d s "
                     rf"in {site} at \S+prog.py:\d+ \S+, on a communicator of 2 ranks "
                     r"\(rank 0 there\)", run.output), run.describe()
    assert took < 60, f"job took {took:.1f} s to end"


FAIL = """
    x = jnp.ones(100)
    if rank == 1:
        raise ValueError("boom on rank 1")
    jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))(x).block_until_ready()
"""


@NPROCS
def test_failing_rank_ends_job_with_mpi4py_launcher(tmp_path, nprocs):
    run, took = run_script(tmp_path, FAIL, nprocs=nprocs, argv=["-m", "mpi4py"], timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "ValueError: boom on rank 1" in run.output and "Traceback" in run.output
    assert took < 60, f"job took {took:.1f} s to end"
    print(f"python -m mpi4py at {nprocs} ranks: job ended {took:.1f} s after start")


@NPROCS
def test_failing_rank_ends_job_without_the_launcher(tmp_path, nprocs):
    """Plain `python`, default settings: the failing rank exits, calling MPI_Finalize at
    exit; the others, waiting for it at their first collective, see that in its window
    and end the job within seconds, saying so (they used to wait for VJPMPI_TIMEOUT)."""
    run, took = run_script(tmp_path, FAIL, nprocs=nprocs, timeout=120)
    if run.returncode == 4 and "has called MPI_Finalize" not in run.output:
        # (MPICH's launcher may tear the job down before forwarding what the aborting
        # rank wrote just before MPI_Abort, when a rank has already exited: one rerun)
        print(f"abort message lost by the launcher (exit code 4), rerun:\n{run.output}")
        run, took = run_script(tmp_path, FAIL, nprocs=nprocs, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert "ValueError: boom on rank 1" in run.output
    assert re.search(r"vjpmpi\.allreduce: not every rank runs this collective on a "
                     rf"communicator of {nprocs} ranks \(their collective #1 there\)",
                     run.output), run.describe()
    assert "\n  rank 1: has called MPI_Finalize without running it" in run.output
    assert took < 30, f"job took {took:.1f} s to end"
    print(f"plain python at {nprocs} ranks: job ended {took:.1f} s after start")


@NPROCS
def test_use_after_finalize_is_an_error(tmp_path, nprocs):
    run, _ = run_script(tmp_path, """
        f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
        x = jnp.ones(3)
        f(x).block_until_ready()
        MPI.Finalize()
        for name, call in [("compiled", lambda: f(x)),
                           ("eager", lambda: vjpmpi.bcast(x, 0)),
                           ("new trace", lambda: jax.jit(lambda v: vjpmpi.scan(v, "SUM"))(x))]:
            try:
                call().block_until_ready()
                say(name, "no error")
            except Exception as e:
                say(name, "error:", type(e).__name__, str(e).splitlines()[0])
    """, nprocs=nprocs, timeout=60)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    for name in ("compiled", "eager", "new trace"):
        lines = report(run, f"{name} error:")
        assert len(lines) == nprocs and all("finalized" in ln for ln in lines), run.describe()


def test_message_over_2_gib(tmp_path):
    """A uint8 array of 2**31 + 64 elements: bcast and allreduce use MPI-4 large counts."""
    run, took = run_script(tmp_path, """
        jax.config.update("jax_enable_x64", True)  # indices past 2**31
        n = 2**31 + 64
        idx = np.array([0, 1, 255, 2**31 - 1, 2**31, 2**31 + 1, n - 1])
        make = jax.jit(lambda: jax.lax.iota(jnp.uint8, n) * (rank == 0))   # i % 256 on root
        y = jax.jit(lambda v: vjpmpi.bcast(v, 0), donate_argnums=0)(make())
        assert (np.asarray(y[idx]) == idx % 256).all(), np.asarray(y[idx])
        z = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM), donate_argnums=0)(y)
        assert (np.asarray(z[idx]) == (idx * MPI.COMM_WORLD.size) % 256).all()
        say(f"rank {rank} ok")
    """, timeout=600)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert len(report(run, " ok")) == 2, run.describe()
    print(f"2 GiB + 64 B bcast and allreduce on 2 ranks: {took:.0f} s")


# Two jobs that wait a minute, with the default limits (no VJPMPI_TIMEOUT): they start with
# this module and run beside its other tests (the waiting rank sleeps between its reads of
# the other's window, the other sleeps), and the tests below collect them.
# - "warning": a rank waits 60 s in a collective the other has not reached (here, in the
#   ranks' agreement on a program new to both) and warns once, naming the call and where
#   the other rank is; the other then joins and both finish.
# - "check_limit": under VJPMPI_CHECK=1, a rank's first collective on a communicator from
#   Comm.Split, which the other rank (alive, asleep) never runs: the job ends at the
#   check's 60 s limit, saying so.
MINUTE = {
    "warning": (None, """
        x = jnp.ones(1000, jnp.float32)
        vjpmpi.allreduce(x, MPI.SUM).block_until_ready()   # (collective #1, on both ranks)
        if rank == 1:
            time.sleep(66)   # past the default warning, then joins
        # (a program new to both: rank 0 waits in the ranks' agreement on it, asleep
        # between its reads; in MPI_Allreduce, MPICH would keep a core busy)
        y = jax.jit(lambda v: vjpmpi.allreduce(v[:500] * 2, MPI.MAX))(x)
        say(f"rank {rank} result", float(y[0]), y.shape)
    """),
    "check_limit": (CHECK, """
        sub = MPI.COMM_WORLD.Split(0, rank)
        if rank == 0:
            jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=sub))(jnp.ones(4))
            say("NO ERROR")
        else:
            time.sleep(120)
    """),
}
_MINUTE_JOBS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def minute_jobs(request, tmp_path_factory):
    """Start the selected jobs of MINUTE when the module starts; end what is left at its end."""
    for name, (env, body) in MINUTE.items():
        if any(item.nodeid.endswith(f"test_waits_of_a_minute[{name}]")
               for item in request.session.items):
            script = tmp_path_factory.mktemp(name) / "prog.py"
            script.write_text(HEADER + textwrap.dedent(body))
            _MINUTE_JOBS[name] = Job(2, [str(script)], timeout=180, env=env)
    yield
    for job in _MINUTE_JOBS.values():
        job.kill()


@pytest.mark.parametrize("name", MINUTE)
def test_waits_of_a_minute(name):
    job = _MINUTE_JOBS[name]
    run = job.result()
    took = job.ended - job.started   # (the job's own time, not when this test collects it)
    warnings = report(run, "vjpmpi: warning")
    if name == "warning":
        assert run.returncode == 0 and not run.timed_out, run.describe()
        assert len(report(run, "result 2.0 (500,)")) == 2, run.describe()
        assert len(warnings) == 1, run.describe()
        assert re.search(
            r"vjpmpi: warning \(VJPMPI_WARN_AFTER=60 s\): rank 0 of 2 has waited 6\d\.\d s in "
            r"allreduce\(MAX\) on float32\[500\] at \S+prog.py:\d+ \S+, on a communicator of 2 "
            r"ranks \(rank 0 there\), for the ranks' agreement on it \(their collective #2 "
            r"there: .*\); each rank:\n  rank 0: allreduce\(MAX\) on float32\[500\] at \S+prog.py"
            r":\d+ \S+\n  rank 1: has not reached it\n  \(rank 1's last collective there: #1, "
            r"allreduce\(SUM\) on float32\[1000\]\)\n Still waiting", run.output), run.describe()
        assert 60 < took < 150, took
    else:
        assert not run.timed_out and run.returncode != 0, run.describe()
        assert "NO ERROR" not in run.output and not warnings, run.describe()
        assert re.search(r"vjpmpi: timeout \(VJPMPI_CHECK's limit=60 s\): rank 0 of 2 has "
                         r"waited 60\.\d s in allreduce\(SUM\) on float32\[4\] at \S+prog.py:\d+ "
                         r"\S+, on a communicator of 2 ranks \(rank 0 there\), its first collective "
                         r"there .*; the other ranks did not join it\.", run.output), run.describe()
        assert 60 < took < 120, took
