"""Multi-rank suite: runs on every rank under mpiexec (see tests/test_multirank.py).

A failing test on any rank aborts the whole job (after printing the report),
so the other ranks never wait forever in a collective the failed rank skipped.

`--junitxml=DIR/results.rank{rank}.xml`: each rank writes its own JUnit file
(`{rank}` is replaced by the rank in COMM_WORLD); tests/test_multirank.py compares
them with tests/expected_counts.json.
"""

import os
import sys

import jax
import pytest
from mpi4py import MPI

import vjpmpi  # noqa: F401  (first: sets synchronous CPU dispatch before any array exists)

jax.config.update("jax_enable_x64", True)
if os.environ.get("VJPMPI_TEST_SHARED_COMPILES"):  # one compile per program, not per rank
    from _shared_compiles import share_compiles

    share_compiles(os.environ["VJPMPI_TEST_SHARED_COMPILES"])

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(tryfirst=True)  # before pytest's junitxml plugin opens the file
def pytest_configure(config):
    path = config.option.xmlpath
    if path and "{rank}" in path:
        config.option.xmlpath = path.replace("{rank}", str(WORLD.rank))
    if WORLD.rank:  # one slowest-tests table per job (rank 0's), not one per rank
        config.option.durations = None


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(
            f"\n==== rank {WORLD.rank}/{WORLD.size}: {report.nodeid} FAILED ({report.when}) ====\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        WORLD.Abort(1)


def _make_comm(kind):
    if kind == "default":
        return None
    if kind == "world":
        return WORLD
    if kind == "dup":
        return WORLD.Dup()
    if kind == "split":  # two halves, the upper one in reverse rank order
        half = WORLD.rank >= (WORLD.size + 1) // 2
        return WORLD.Split(int(half), -WORLD.rank if half else WORLD.rank)
    if kind == "cart":
        return WORLD.Create_cart([WORLD.size], periods=[True])
    if kind == "self":
        return MPI.COMM_SELF
    raise ValueError(kind)


COMM_KINDS = ["default", "world", "dup", "split", "cart", "self"]


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    c = _make_comm(request.param)
    yield c
    if request.param in ("dup", "split", "cart"):
        c.Free()
