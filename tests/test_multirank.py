"""Run the multi-rank suite (tests/mpi) at 1, 2, 3, 4 and 8 ranks, each rank count in one
mpiexec job (at 2 and 3 ranks, two at once: AT_ONCE), and check what ran against
tests/expected_counts.json.

The jobs:
  1, 2, 4   every file (but those of ONLY_AT that leave the count out);
  3         the odd count (one rank against two), with the mismatch check and the
            watchdog on in every test, and every call that moves data asynchronous
            (JOB_ENV: VJPMPI_CHECK=1, VJPMPI_TIMEOUT=300, VJPMPI_ASYNC_BYTES=0): the
            check must pass whatever the suite does, a wrong pairing in the ordering
            suites is an error naming every rank's collective, and every op's results,
            derivatives and order hold on the communicators' threads;
  8         (oversubscribed) the files of WIDE, whose algorithms depend on the rank
            count, without their tests marked `narrow` (work that does not change past
            4 ranks: dtype coverage, vmap, checkpoint, second derivatives), and the
            pipeline x tensor x data grid (2 x 2 x 2).

Within a session the ranks of every job share compiled programs (one compile per
distinct program: tests/mpi/_shared_compiles.py), and a job with more ranks than cores
runs with OVERSUBSCRIBED_ENV (waiting ranks sleep), but for LATENCY_BOUND files, which
run spinning in a job of their own at that count.

The platform runs of `.ci/run` and contributors select with the environment:
  VJPMPI_TEST_RANKS   rank counts, e.g. "2" (default "1,2,3,4,8")
  VJPMPI_TEST_FILES   the part of tests/mpi to run: test files or folders, e.g.
                      "mpi/test_collectives.py" (default: all of it)
  VJPMPI_TEST_NETWORK "1": every message through MPI's network module over loopback
                      (shared memory off; `_mpirun.network_env()`)
  VJPMPI_TEST_SHARED_COMPILES  the folder the ranks share compiled programs in (default:
                      one per session), or "0": every rank compiles on its own
  VJPMPI_TEST_YIELD   "1": every job as if oversubscribed (waiting ranks sleep), for a
                      session that shares the machine with another (.ci/run's platform
                      parts run in pairs)
`pytest tests -m quick` is the development tier: the multi-rank suite at 2 ranks without
the examples' smoke tests (QUICK_LEAVES_OUT), held against the table like any job.

Every rank writes a JUnit file; per test file and rank count the ranks must agree on
every test's outcome, and the numbers of passed and skipped tests, the tests run per
test function and the skipped tests with their reasons must equal the table's entry
(only the files of the run are checked, so the platform subsets are checked too). A
test that newly skips, a test that no longer runs, a skip that now passes, or a (file,
rank count) pair missing from the table fails, naming the file, the rank count, the
expected and the measured numbers and the tests concerned. Each job's wall time and
slowest tests (from the JUnit files) are printed at the end of the session.

Skips that depend on the machine rather than on the code (no GPU for JAX, the CUDA
module not built) are listed with their reasons under "environment_skips" in the
table: a test recorded as passing may skip with one of those reasons, and one recorded
as skipped with one of them may pass; every other difference fails.

After adding, removing or re-parametrizing tests on purpose, regenerate the table:
  VJPMPI_UPDATE_COUNTS=1 .venv/bin/pytest tests/test_multirank.py
writes the measured entries for the files and rank counts of the run into the table
(other entries are kept; entries of files that no longer exist are dropped) instead of
comparing; VJPMPI_TEST_FILES / VJPMPI_TEST_RANKS narrow it to what changed. Review the
diff of tests/expected_counts.json before committing it.
"""

import atexit
import collections
import dataclasses
import fnmatch
import functools
import json
import os
import re
import shutil
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from _mpirun import (FAST_COMPILE, RANK_ENV, TESTS, Job, device_env, mpi_family, mpirun,
                     network_env)

TIMEOUT = 1200  # seconds per rank count; a deadlock fails the run instead of hanging CI
RANKS = [int(n) for n in os.environ.get("VJPMPI_TEST_RANKS", "1,2,3,4,8").split(",")]
FILES = os.environ.get("VJPMPI_TEST_FILES", "mpi").split()
NETWORK = os.environ.get("VJPMPI_TEST_NETWORK", "") not in ("", "0")
UPDATE = os.environ.get("VJPMPI_UPDATE_COUNTS", "") not in ("", "0")
TABLE = TESTS / "expected_counts.json"
# `pytest tests -m quick`: the 2-rank job, without the files that QUICK_LEAVES_OUT
# matches (the examples' smoke tests, which train models)
QUICK_RANKS = (2,)
QUICK_LEAVES_OUT = ("mpi/test_example_*.py",)
# The environment of a rank count's job (see the module docstring).
JOB_ENV = {3: {"VJPMPI_CHECK": "1", "VJPMPI_TIMEOUT": "300", "VJPMPI_ASYNC_BYTES": "0"}}
# Rank counts past 4 (oversubscribed) and the files that run there, each without its
# tests marked `narrow`: the nonlinear derivatives' scans over the ranks and the
# adjoints of every linear op and root, at a count of ranks past 4.
WIDE = {8: ("mpi/test_nonlinear.py", "mpi/test_autodiff.py", "mpi/test_pipeline_grid.py")}
# Files that run at some of 1-4 ranks only (default: all four). The examples and the
# mpi4jax namespace are built on collectives the core files test at every count; a
# one-rank run of the layers repeats the dense layer, and the CUDA lowering tests only
# lower (no collective runs). At 3 ranks (the odd, non-power-of-two count, with the
# check on) run the files whose algorithms depend on the rank count (collectives,
# point-to-point, autodiff, nonlinear derivatives, FFTs, 3 pipeline stages) and the
# ordering suite; the tensor-parallel layers' splits run at 2 and 4 (their block
# arithmetic is one formula for any count; CI's time, 2026-12-03). Not at 4 since
# 2026-12-06 (CI's time): the fuzzed programs, the MoE layer (mpi/test_nn_layout.py
# runs one over 4 ranks), the dense layers (test_nn_layout: a 2 x 2 data x tensor grid),
# the pipelines (3 stages at 3 ranks; the 2 x 2 x 2 grid at 8) and the LM example but for
# its pipeline (tests/test_example_lm_resume.py resumes the LM at 4 ranks, a 2 x 2 grid);
# the checkpoints not at 1 (tests/test_checkpoint_reshard.py loads at 1).
ONLY_AT = {
    "mpi/test_agreement.py": (2, 3, 4),  # (one rank cannot disagree with itself)
    "mpi/test_nn.py": (2,),
    "mpi/test_nn_halo.py": (2, 4),  # (4: a ring whose two neighbours differ, and 2x2)
    "mpi/test_nn_optim.py": (2, 3),  # (3: a shard that sees another leaf size)
    "mpi/test_nn_moe.py": (2,),  # (1: the dense layer itself)
    "mpi/test_nn_moe_ragged.py": (2, 3),  # (uneven and zero token counts: 3, the odd count)
    # (blocks, ZeRO ranges and writers change with the count: 1, 2 and the odd 3; loads
    # at 1, 3 and 4 of what 2 saved: tests/test_checkpoint_reshard.py; CI's time)
    "mpi/test_checkpoint.py": (2, 3),
    # (4: a data x tensor grid, tensor blocks summed over a part of the ranks; 2: the
    # tensor group is every rank)
    "mpi/test_nn_layout.py": (2, 4),
    "mpi/test_example_digits.py": (2,),
    "mpi/test_example_transpose.py": (2,),
    "mpi/test_example_pde.py": (2,),
    "mpi/test_example_lm.py": (2, 4),  # (4: the pipelined LM alone)
    "mpi/test_example_spectral.py": (2,),
    "mpi/test_example_cluster.py": (2,),
    "mpi/test_example_moe.py": (2,),
    "mpi/test_compat.py": (1, 2, 4),
    # (each stage compiles programs of its own: at 3 ranks a subset, AT_WIDE)
    "mpi/test_pipeline.py": (2, 3),
    "mpi/test_pipeline_grid.py": (),  # (8 ranks: the 3-D grid, WIDE)
    "mpi/test_cuda_lowering.py": (2,),
    # rank-count-independent logic (fuzzed programs, failure modes, runtime, API): not
    # at the odd count; the fuzzed programs' rank-dependent parts need two ranks or more,
    # and the failure modes (leaks, communicator churn, tags) do not change past two
    "mpi/test_fuzz.py": (2,),
    "mpi/test_reliability.py": (1, 2),
    "mpi/test_runtime.py": (1, 2, 4),
    "mpi/test_api.py": (1, 2, 4),
}
# Many devices per process (tests/mpi/devices): each file runs in jobs of P processes with D
# CPU devices each (XLA_FLAGS=--xla_force_host_platform_device_count=D), its table entries
# keyed "PxD". At 3 processes with the check on, as JOB_ENV says. The default layouts:
# one device per process, two, and the odd count of processes with two each (3 x 1, 3 x 4
# and 2 x 4 ran too until 2026-12-06: CI's time; VJPMPI_TEST_DEVICE_LAYOUTS=2x4 runs it; the
# docs' examples run at 2 x 4).
DEVICE_FILES = os.environ.get("VJPMPI_TEST_DEVICE_FILES", "mpi/devices").split()
DEVICE_LAYOUTS = [tuple(int(v) for v in k.split("x")) for k in os.environ.get(
    "VJPMPI_TEST_DEVICE_LAYOUTS", "2x1,2x2,3x2").split(",") if k]
# The layouts each device file runs at (default: all of them). The layers' block
# arithmetic is one formula for any count (as mpi/test_nn.py's): one device per process
# (the device communicator as the process one), two, and the odd count with the check on;
# the example (which trains) at 2 x 2, beside tests/test_example_devices.py's 2 x 2 run
# against 4 processes.
# At one device per process (the device communicator as the process's) the files whose
# calls differ there: the layers, the communicator and its errors (not the sharded arrays,
# which one device does not split, nor jax.lax's functions of one device).
DEVICE_ONLY_AT: dict[str, tuple[tuple[int, int], ...]] = {
    "mpi/devices/test_sharded.py": ((2, 2), (2, 4), (3, 2)),
    "mpi/devices/test_lax.py": ((2, 2), (2, 4), (3, 2)),
    "mpi/devices/test_nn_devices.py": ((2, 1), (2, 2), (3, 2)),
    "mpi/devices/test_example_digits_devices.py": ((2, 2),),
}


# Jobs with more ranks than the machine has cores (3, 4 and 8 on CI's two): MPICH's
# waits sleep (nanosleep) instead of spinning, so a rank that waits in a collective
# leaves its core to a rank that still computes or compiles. Files that run hundreds of
# thousands of collectives back to back (where each sleep costs a fraction of a
# millisecond) keep spinning, in a job of their own at those counts.
OVERSUBSCRIBED_ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
LATENCY_BOUND = ("mpi/test_reliability.py",)
CORES = len(os.sched_getaffinity(0))
YIELD = os.environ.get("VJPMPI_TEST_YIELD", "") not in ("", "0")


def oversubscribed(nprocs: int) -> bool:
    """Whether a job of `nprocs` ranks runs with OVERSUBSCRIBED_ENV."""
    return nprocs > CORES or YIELD
JOB_TIMES: list[dict] = []  # (printed by tests/conftest.py at the end of the session)


def counts_of(file: str) -> tuple[int, ...]:
    """The rank counts `file` runs at."""
    return (*ONLY_AT.get(file, (1, 2, 3, 4)), *(n for n, fs in WIDE.items() if file in fs))


def quick_tier(markexpr: str) -> bool:
    """Whether pytest's -m expression selects the quick tier (and not its complement)."""
    return "quick" in re.findall(r"\w+", markexpr or "") and not re.search(r"not\s+quick", markexpr)


def run_files(entries) -> list[str]:
    """The test files of `entries` (files or folders), as keys of the table
    ("mpi/test_api.py")."""
    files = []
    for entry in entries:
        assert "::" not in entry and not entry.startswith("-"), (
            f"VJPMPI_TEST_FILES takes test files or folders (counts are per file): {entry!r}")
        path = (TESTS / entry).resolve()
        found = sorted(path.glob("test_*.py")) if path.is_dir() else [path]
        assert found and all(p.is_file() for p in found), f"no test files at {entry!r}"
        files += [p.relative_to(TESTS).as_posix() for p in found]
    return sorted(set(files))


def read_junit(path, files) -> dict[str, dict[str, tuple[str, str]]]:
    """{file: {test id: (outcome, skip reason or message)}} from one rank's JUnit file."""
    modules = {f.rsplit("/", 1)[-1].removesuffix(".py"): f for f in files}
    results = {f: {} for f in files}
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        where = [i for i, p in enumerate(parts) if p in modules]
        file = modules[parts[where[0]]] if where else "(not a test file of the run)"
        classes = parts[where[0] + 1:] if where else parts
        test_id = "::".join([*classes, case.get("name")])
        outcome, reason = "passed", ""
        for child in case:
            if child.tag == "skipped":
                outcome, reason = "skipped", child.get("message", "")
            elif child.tag in ("failure", "error"):
                outcome, reason = "failed", child.get("message", "")
        results.setdefault(file, {})[test_id] = (outcome, reason)
    return results


def junit_times(path) -> list[tuple[float, str]]:
    """[(seconds, test id)] of one rank's JUnit file, slowest first."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        rows.append((float(case.get("time", 0)), f"{'.'.join(module[2:])}::{case.get('name')}"))
    return sorted(rows, reverse=True)


def summarize(tests: dict[str, tuple[str, str]]) -> dict:
    """One table entry: counts, skipped tests with reasons, tests run per function."""
    outcomes = collections.Counter(outcome for outcome, _ in tests.values())
    entry = {
        "passed": outcomes.pop("passed", 0),
        "skipped": outcomes.pop("skipped", 0),
        "skips": {t: r for t, (o, r) in sorted(tests.items()) if o == "skipped"},
        "tests": dict(sorted(collections.Counter(t.split("[")[0] for t in tests).items())),
    }
    if outcomes:  # failed (the run's exit code catches these first)
        entry["other"] = dict(outcomes)
    return entry


def regenerate_hint(file, nprocs) -> str:
    if "x" in str(nprocs):  # (a many-devices job)
        select = (f"VJPMPI_TEST_DEVICE_FILES={file} VJPMPI_TEST_DEVICE_LAYOUTS={nprocs} "
                  ".venv/bin/pytest tests/test_multirank.py -k test_devices")
    else:
        select = (f"VJPMPI_TEST_FILES={file} VJPMPI_TEST_RANKS={nprocs} "
                  ".venv/bin/pytest tests/test_multirank.py")
    return (f"regenerate the entry with\n"
            f"    VJPMPI_UPDATE_COUNTS=1 {select}\n"
            f"  (or the whole table: VJPMPI_UPDATE_COUNTS=1 .venv/bin/pytest "
            f"tests/test_multirank.py) and review the diff of tests/{TABLE.name}")


def compare(file, nprocs, want, tests, env_reasons) -> list[str]:
    """What differs between the table's entry `want` and the measured `tests`."""
    got = summarize(tests)
    where = f"{file} at {nprocs} ranks"
    measured = f"got {got['passed']} passed, {got['skipped']} skipped"
    if want is None:
        return [f"{where}: no entry in tests/{TABLE.name} ({measured});\n  "
                + regenerate_hint(file, nprocs)]
    problems, notes = [], []
    if got.get("other"):
        problems.append(f"other outcomes: {got['other']}")
    swapped = 0  # passes that became environment skips, less the reverse
    for t, r in got["skips"].items():
        old = want["skips"].get(t)
        if old is None:
            if r in env_reasons and t.split("[")[0] in want["tests"]:
                notes.append(f"skipped here: {t} ({r})")
                swapped += 1
            else:
                problems.append(f"new skip: {t} ({r})")
        elif old is not None and r != old and not (old in env_reasons and r in env_reasons):
            problems.append(f"skip reason changed: {t} ({old} -> {r})")
    for t, r in want["skips"].items():
        if tests.get(t, ("",))[0] == "passed":
            if r in env_reasons:
                notes.append(f"passed here: {t} (skipped in the table: {r})")
                swapped -= 1
            else:
                problems.append(f"no longer skipped: {t} (was: {r})")
    for fn in sorted(set(want["tests"]) | set(got["tests"])):
        w, g = want["tests"].get(fn, 0), got["tests"].get(fn, 0)
        if g < w:
            problems.append(f"missing: {fn} ran {g} of its {w} tests")
        elif g > w:
            problems.append(f"not in the table: {fn} ran {g} tests, the table has {w}")
    # the counts, where environment skips may stand in for passes and the other way round
    allowed = (want["passed"] - swapped, want["skipped"] + swapped)
    if (got["passed"], got["skipped"]) != allowed:
        problems.append(f"counts differ (allowing for environment skips: expected "
                        f"{allowed[0]} passed, {allowed[1]} skipped)")
    if not problems:
        return []
    lines = [f"{where}: expected {want['passed']} passed, {want['skipped']} skipped; {measured}"]
    lines += [f"  {p}" for p in problems]
    lines += [f"  (allowed, environment-dependent: {n})" for n in notes]
    lines.append("  if the change is intended, " + regenerate_hint(file, nprocs))
    return lines


def load_table() -> dict:
    if not TABLE.exists():
        return {"environment_skips": {}, "counts": {}}
    return json.loads(TABLE.read_text())


@functools.cache
def session_folder() -> Path:
    """This session's scratch folder (shared compiles, jobs started early); removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="vjpmpi-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def shared_compiles() -> dict[str, str]:
    """The folder in which the ranks of every job of the session share compiled programs
    (tests/mpi/_shared_compiles.py); VJPMPI_TEST_SHARED_COMPILES=0 turns it off."""
    given = os.environ.get("VJPMPI_TEST_SHARED_COMPILES", "")
    if given == "0":
        return {}
    return {"VJPMPI_TEST_SHARED_COMPILES": given or str(session_folder() / "compiles")}


# Rank counts whose job runs as this many jobs at once, each with OVERSUBSCRIBED_ENV (the
# LATENCY_BOUND files spinning, on their own first): a job's ranks share compiled
# programs, so while one compiles the others wait, and a 2-rank job alone leaves about
# one of CI's two cores idle (since 2026-12-06, CI's time: 2 ranks 314 -> 250 s, 3 ranks
# 187 -> 162 s; 4 ranks gained 8 s, not worth its 8 processes).
AT_ONCE = {2: 2, 3: 2}
# The files' seconds in the 2-rank job (2026-12-06, CI's machine class), by which they are
# dealt to those jobs, the longest first to the least loaded (any other file: 3 s). Stale
# figures cost only balance.
SECONDS_AT_2 = {
    "mpi/test_nn.py": 25, "mpi/test_nn_moe_ragged.py": 22, "mpi/test_pipeline.py": 17,
    "mpi/test_example_lm.py": 17, "mpi/test_async.py": 16, "mpi/test_nn_moe.py": 16,
    "mpi/test_fuzz.py": 12, "mpi/test_nn_halo.py": 11, "mpi/test_nn_optim.py": 11,
    "mpi/test_nn_layout.py": 10, "mpi/test_autodiff.py": 10, "mpi/test_fft.py": 9,
    "mpi/test_example_moe.py": 8, "mpi/test_split.py": 8, "mpi/test_checkpoint.py": 8,
    "mpi/test_program_order.py": 8, "mpi/test_ragged.py": 7, "mpi/test_collectives.py": 7,
    "mpi/test_nonlinear.py": 6, "mpi/test_example_cluster.py": 5,
}


def deal(files: list[str], parts: int) -> list[list[str]]:
    """`files` in `parts` shares of about equal seconds (SECONDS_AT_2), each sorted."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for f in sorted(files, key=lambda f: (-SECONDS_AT_2.get(f, 3), f)):
        i = load.index(min(load))
        shares[i].append(f)
        load[i] += SECONDS_AT_2.get(f, 3)
    return [sorted(share) for share in shares]


def job_plan(nprocs, config) -> list[list[tuple[list[str], list[str], dict[str, str]]]]:
    """The jobs (files, extra pytest arguments, environment) of test_suite[nprocs], in
    stages run one after the other, the jobs of a stage at once: for an oversubscribed
    count the LATENCY_BOUND files spinning, then the rest with OVERSUBSCRIBED_ENV (in
    AT_ONCE's number of jobs at once); else one job."""
    files = [f for f in run_files(FILES) if nprocs in counts_of(f)]
    if quick_tier(config.getoption("markexpr")):
        files = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in QUICK_LEAVES_OUT)]
    extra = ["-m", "not narrow"] if nprocs in WIDE else []
    parts = 1 if NETWORK or YIELD else AT_ONCE.get(nprocs, 1)  # (YIELD: shared already)
    if not oversubscribed(nprocs) and parts == 1:
        return [[(files, extra, shared_compiles())]] if files else []
    spinning = [f for f in files if f in LATENCY_BOUND]
    rest = [f for f in files if f not in LATENCY_BOUND]
    stages = [[(spinning, extra, shared_compiles())]] if spinning else []
    shares = deal(rest, parts)
    stages.append([(fs, extra, {**shared_compiles(), **OVERSUBSCRIBED_ENV})
                   for fs in shares if fs])
    return [stage for stage in stages if stage]


# Jobs of one rank started when collection ends (tests/conftest.py): no rank of theirs
# waits for another, so they take the core that the single-process tests before them
# (benchmarks, docs, install checks) leave free, and test_suite[1] collects the result.
EARLY_RANKS = (1,)
EARLY: dict[int, "StartedJob"] = {}


def start_early(session):
    for item in session.items:
        nprocs = getattr(item, "callspec", None) and item.callspec.params.get("nprocs")
        if (item.module.__name__ == __name__ and item.originalname == "test_suite"
                and nprocs in EARLY_RANKS and nprocs not in EARLY):
            plan = job_plan(nprocs, session.config)
            if len(plan) == 1 and len(plan[0]) == 1:
                files, extra, env = plan[0][0]
                folder = session_folder() / f"early-{nprocs}"
                EARLY[nprocs] = start_job(nprocs, files, folder, extra, env)


def stop_early():
    """End the early jobs that no test collected (the session stopped first)."""
    while EARLY:
        EARLY.popitem()[1].job.kill()


@pytest.mark.parametrize("nprocs", [pytest.param(n, marks=pytest.mark.quick)
                                    if n in QUICK_RANKS else n for n in RANKS])
def test_suite(nprocs, tmp_path, request):
    plan = job_plan(nprocs, request.config)
    if not plan:
        pytest.skip(f"no file of VJPMPI_TEST_FILES runs at {nprocs} ranks (ONLY_AT, WIDE)")
    jobs = 0
    for stage in plan:
        running = []
        for files, extra, env in stage:  # (started together, then each compared)
            started = EARLY.pop(nprocs, None) if jobs == 0 else None
            running.append(started or start_job(nprocs, files, tmp_path / f"job{jobs}", extra,
                                                 env))
            jobs += 1
        try:
            for started in running:
                compare_job(started)
        finally:  # (a job that failed: the others of its stage end with it)
            for started in running:
                if started.job.proc.poll() is None:
                    started.job.kill()


@dataclasses.dataclass
class StartedJob:
    nprocs: int
    entries: list[str]
    tmp_path: Path
    shown: dict[str, str]  # (its environment but for the shared-compiles folder)
    job: Job
    started: float
    key: str = ""  # its table entries' key: the rank count, or "PxD" (devices per process)


@pytest.mark.parametrize("layout", [pytest.param(f"{p}x{d}", marks=pytest.mark.quick)
                                    if (p, d) == (2, 2) else f"{p}x{d}" for p, d in DEVICE_LAYOUTS])
def test_devices(layout, tmp_path):
    """The many-devices files (tests/mpi/devices) at P processes of D devices."""
    nprocs, ndev = (int(v) for v in layout.split("x"))
    files = [f for f in run_files(DEVICE_FILES)
             if (nprocs, ndev) in DEVICE_ONLY_AT.get(f, DEVICE_LAYOUTS)]
    if not files:
        pytest.skip(f"no file of VJPMPI_TEST_DEVICE_FILES runs at {layout}")
    env = {**shared_compiles(), **device_env(ndev),
           **(OVERSUBSCRIBED_ENV if oversubscribed(nprocs) else {})}
    started = start_job(nprocs, files, tmp_path / "job", [], env)
    started.key = layout
    compare_job(started)


def start_job(nprocs, entries, tmp_path, extra=(), env=None) -> StartedJob:
    """Start the multi-rank suite's `entries` of tests/ at `nprocs` ranks."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shown = {**JOB_ENV.get(nprocs, {}), **(network_env() if NETWORK else {})}
    shown |= {k: v for k, v in (env or {}).items() if k != "VJPMPI_TEST_SHARED_COMPILES"}
    job = Job(
        nprocs,
        ["-m", "pytest", *entries, *extra, "-q", "-p", "no:cacheprovider", "-x",
         "--durations=15", f"--junitxml={tmp_path}/results.rank{{rank}}.xml"],
        timeout=TIMEOUT * (2 if NETWORK else 1),
        env={**shown, **(env or {})},
    )
    return StartedJob(nprocs, list(entries), tmp_path, shown, job, time.monotonic())


def compare_job(started: StartedJob):
    """Wait for a job of the multi-rank suite; compare what ran with the table."""
    nprocs, tmp_path, shown = started.nprocs, started.tmp_path, started.shown
    key = started.key or str(nprocs)
    files = run_files(started.entries)
    run = started.job.result()
    wall = time.monotonic() - started.started
    assert not run.timed_out and run.returncode == 0, (
        f"multi-rank suite failed at {nprocs} ranks\n" + run.describe()
    )
    counts = re.findall(r"(\d+) passed", run.output)
    assert len(counts) == nprocs, run.describe()
    JOB_TIMES.append({"job": f"{nprocs} ranks" + "".join(f" {k}={v}" for k, v in shown.items()),
                      "wall": wall, "tests": junit_times(tmp_path / "results.rank0.xml")})

    # every rank's results, and all ranks agree on every test's outcome
    per_rank = []
    for r in range(nprocs):
        path = tmp_path / f"results.rank{r}.xml"
        assert path.exists(), f"rank {r} of {nprocs} wrote no JUnit file\n" + run.describe()
        per_rank.append(read_junit(path, files))
    first = per_rank[0]
    for r, results in enumerate(per_rank[1:], 1):
        differ = sorted(
            f"{f}::{t}: rank 0 {first.get(f, {}).get(t)}, rank {r} {results.get(f, {}).get(t)}"
            for f in set(results) | set(first)
            for t in set(results.get(f, {})) | set(first.get(f, {}))
            if results.get(f, {}).get(t) != first.get(f, {}).get(t))
        assert not differ, f"ranks disagree at {nprocs} ranks:\n" + "\n".join(differ)
    stray = set(per_rank[0]) - set(files)
    assert not stray, f"results outside the run's files: {per_rank[0][min(stray)]}"

    measured = {f: summarize(per_rank[0][f]) for f in files}
    for f, entry in measured.items():
        print(f"{key} ranks: {f}: {entry['passed']} passed, {entry['skipped']} skipped "
              "on each rank")

    table = load_table()
    if UPDATE:
        for f, entry in measured.items():
            table["counts"].setdefault(f, {})[key] = entry
        table["counts"] = {f: dict(sorted(v.items(), key=lambda kv: [int(n) for n in kv[0].split("x")]))
                           for f, v in sorted(table["counts"].items()) if (TESTS / f).exists()}
        TABLE.write_text(json.dumps(table, indent=1) + "\n")
        print(f"VJPMPI_UPDATE_COUNTS: wrote {len(measured)} entries at {key} ranks to {TABLE}")
        return
    env_reasons = set(table["environment_skips"])
    problems = []
    for f in files:
        problems += compare(f, key, table["counts"].get(f, {}).get(key),
                            per_rank[0][f], env_reasons)
    if problems:
        pytest.fail(f"tests run at {key} ranks differ from {TABLE}:\n" + "\n".join(problems),
                    pytrace=False)


MISMATCH = """
import jax.numpy as jnp
from mpi4py import MPI
import vjpmpi
x = jnp.ones(1000)
if MPI.COMM_WORLD.rank == 0:
    y = vjpmpi.bcast(x, 0)
else:
    y = vjpmpi.allreduce(x, MPI.SUM)
y.block_until_ready()
vjpmpi.barrier()
"""


def test_mismatched_program_fails_within_timeout(tmp_path):
    """Rank 0 broadcasts while rank 1 allreduces: each rank compares its collective with
    the other's before moving data (one-sided reads of the other's window, over the
    network too) and raises, naming both; the job ends with their tracebacks, well before
    the watchdog's limit or the launcher's timeout (a hang killed by the harness fails)."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    started = time.monotonic()
    env = {"VJPMPI_TIMEOUT": "5", **(network_env() if NETWORK else {})}  # (CI's network part)
    run = mpirun(2, [str(script)], timeout=120, env=env)
    took = time.monotonic() - started
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert len(re.findall(  # (one message from each rank)
        r"vjpmpi\.(bcast|allreduce): the ranks disagree on a communicator of 2 ranks "
        r"\(their collective #1 there\): the collective differs", run.output)) == 2, \
        run.describe()
    assert re.search(r"\n  rank 0: bcast\(root=0\) on float32\[1000\] at \S+mismatch.py:7", run.output)
    assert re.search(r"\n  rank 1: allreduce\(SUM\) on float32\[1000\] at \S+mismatch.py:9", run.output)
    assert "vjpmpi: timeout" not in run.output, run.describe()
    assert took < 60, f"job took {took:.1f} s to end"


@pytest.mark.skipif(mpi_family() != "mpich", reason="two host names for one machine: MPICH's launcher")
def test_async_default_on_two_nodes(tmp_path):
    """4 ranks on two host names for this machine (two nodes to MPI: MPI_COMM_TYPE_SHARED
    splits them, messages between them take the network module): the default threshold
    puts calls of 1 MiB or more on the communicator's thread on communicators across
    the two nodes, and none on those within one, and that thread polls large started
    calls from their start across nodes only, and "auto" keeps a call site on XLA's thread
    where nothing runs beside it, call site by call site (tests/mpi/test_async.py)."""
    env = {**OVERSUBSCRIBED_ENV, "VJPMPI_TEST_NODES": "2", "MPIR_CVAR_CH4_NETMOD": "ofi",
           "FI_PROVIDER": "tcp"}
    tests = ("test_auto_threshold_follows_the_node_layout",
             "test_started_calls_polled_from_their_start_follow_the_node_layout",
             "test_auto_runs_a_loop_of_exchanges_alone_on_xlas_thread",
             "test_auto_keeps_a_call_asynchronous_while_xla_computes_beside_it",
             "test_auto_polls_a_started_call_from_its_start_while_the_program_computes_between",
             "test_auto_decides_for_each_of_a_sites_calls_in_a_run")
    run = Job(4, ["-m", "pytest", "mpi/test_async.py", "-q", "-p", "no:cacheprovider",
                  "-k", " or ".join(tests), f"--junitxml={tmp_path}/results.rank{{rank}}.xml"],
              timeout=300, env=env, hosts="localhost:2,127.0.0.1:2").result()
    assert not run.timed_out and run.returncode == 0, run.describe()
    for r in range(4):  # (each rank ran the tests, and they passed there)
        results = read_junit(tmp_path / f"results.rank{r}.xml", ["mpi/test_async.py"])
        assert results == {"mpi/test_async.py": {t: ("passed", "") for t in tests}}, (r, results)


def without_handles(hlo: str) -> str:
    """`hlo` with its MPI handles and host addresses blanked: they differ between
    processes on Open MPI (a communicator handle is a pointer there)."""
    def blank(m):  # (the kernels' `call` array: comm first, status eighth)
        v = m.group(1).split(", ")
        v[0] = v[7] = "_"
        return f"call = dense<[{', '.join(v)}]>"

    hlo = re.sub(r"\b(comm|status) = -?\d+ : i64", r"\1 = _", hlo)
    return re.sub(r"call = dense<\[([-\d, ]+)\]>", blank, hlo)


HLO_PROGRAMS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
import vjpmpi
jax.config.update("jax_enable_x64", True)

def f(x):  # collectives in a loop, a branch and a gradient, and some dense work
    def body(i, c):
        c = vjpmpi.allreduce(jnp.sin(c) * i, MPI.SUM) + vjpmpi.scan(c, MPI.MAX)
        return jax.lax.cond(i % 2 == 0, lambda v: vjpmpi.bcast(v, 0), jnp.tanh, c)
    y = jax.lax.fori_loop(0, 3, body, x)
    return jnp.sum(vjpmpi.allgather(y) ** 2) + jnp.sum(jax.nn.softmax(x @ x.T))

x = np.linspace(0.0, 1.0, 16).reshape(4, 4)
texts = [jax.jit(jax.value_and_grad(f)).lower(x).compile().as_text(),
         jax.jit(jax.vmap(jax.grad(f))).lower(np.stack([x, 2 * x])).compile().as_text()]
open(sys.argv[1], "w").write("\\n=====\\n".join(texts))
"""


def test_rank_env_compiles_the_same_hlo(tmp_path):
    """The suite's ranks compile with FAST_COMPILE (LLVM -O0): XLA's optimized HLO, what
    the tests inspect, is the same as with XLA's defaults."""
    script = tmp_path / "programs.py"
    script.write_text(HLO_PROGRAMS)
    texts = []
    for flags in (RANK_ENV["XLA_FLAGS"], RANK_ENV["XLA_FLAGS"].replace(FAST_COMPILE, "")):
        out = tmp_path / f"hlo{len(texts)}.txt"
        run = mpirun(1, [str(script), str(out)], timeout=120, env={"XLA_FLAGS": flags})
        assert run.returncode == 0 and not run.timed_out, run.describe()
        texts.append(out.read_text())
    assert FAST_COMPILE in RANK_ENV["XLA_FLAGS"]
    assert "vjpmpi_allreduce" in texts[0] and "while" in texts[0], texts[0][:2000]
    same = [without_handles(t) for t in texts]
    assert same[0] == same[1]



SHARED_PROGRAMS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from _shared_compiles import share_compiles
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
import vjpmpi
assert share_compiles(sys.argv[1])
loads = []  # programs loaded from the cache (another rank compiled them)
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: loads.append(name) if name.endswith("cache_retrieval_time_sec")
    else None)
rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
x = np.arange(6.0).reshape(2, 3) + rank
# one program on every rank: programs name COMM_WORLD by vjpmpi's number for it, the
# same on every rank
same = jax.jit(lambda v: vjpmpi.allreduce(jnp.sin(v), MPI.SUM, comm=MPI.COMM_WORLD))
# the lowered programs of the ranks: equal ones have one cache key
texts = MPI.COMM_WORLD.allgather(same.lower(x).as_text())
y = same(x)
n_same = len(loads)
own = jax.jit(lambda v: vjpmpi.allreduce(v * (rank + 1.0), MPI.SUM, comm=MPI.COMM_WORLD))
z = own(x)
ref_y = sum(np.sin(np.arange(6.0).reshape(2, 3) + r) for r in range(size))
ref_z = sum((np.arange(6.0).reshape(2, 3) + r) * (r + 1.0) for r in range(size))
open(f"{sys.argv[1]}.rank{rank}.json", "w").write(json.dumps({
    "rank": rank, "same": n_same, "own": len(loads) - n_same, "distinct": len(set(texts)),
    "y": bool(np.allclose(y, ref_y)), "z": bool(np.allclose(z, ref_z)),
    "hlo": same.lower(x).compile().as_text()}))
"""


def test_ranks_share_compiled_programs(tmp_path):
    """With VJPMPI_TEST_SHARED_COMPILES (every job of this file), a program that is the
    same on every rank is compiled by one rank and loaded by the others, with the same
    results and the same optimized HLO; a program that differs is compiled by each."""
    script = tmp_path / "shared.py"
    script.write_text(SHARED_PROGRAMS)
    run = mpirun(3, [str(script), str(tmp_path / "cache"), str(TESTS / "mpi")], timeout=180)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    results = [json.loads((tmp_path / f"cache.rank{r}.json").read_text()) for r in range(3)]
    assert all(r["y"] and r["z"] for r in results), run.describe()
    # One compile per distinct program. A program names COMM_WORLD by vjpmpi's number
    # for it (2, in every process, on MPICH and Open MPI alike), so the three ranks
    # lower one program.
    distinct = results[0]["distinct"]
    assert distinct == 1, distinct
    loads = sorted(r["same"] for r in results)
    assert sum(loads) == 3 - distinct and max(loads) <= 1, [(r["rank"], r["same"]) for r in results]
    assert [r["own"] for r in results] == [0, 0, 0]
    hlo = {without_handles(r["hlo"]) for r in results}
    assert len(hlo) == 1 and "vjpmpi_allreduce" in results[0]["hlo"]
