"""Run the multi-rank suite (tests/mpi) at 1, 2, 3 and 4 ranks, each in its own mpiexec.

The platform runs of `.ci/run` select with the environment:
  VJPMPI_TEST_RANKS   rank counts, e.g. "2" (default "1,2,3,4")
  VJPMPI_TEST_FILES   the part of tests/mpi to run, e.g. "mpi/test_collectives.py"
                      (default: all of it)
  VJPMPI_TEST_NETWORK "1": every message through MPI's network module over loopback
                      (shared memory off; `_mpirun.NETWORK_ENV`)
"""

import os
import re

import pytest

from _mpirun import mpirun, network_env

TIMEOUT = 900  # seconds per rank count; a deadlock fails the run instead of hanging CI
RANKS = [int(n) for n in os.environ.get("VJPMPI_TEST_RANKS", "1,2,3,4").split(",")]
FILES = os.environ.get("VJPMPI_TEST_FILES", "mpi").split()
NETWORK = os.environ.get("VJPMPI_TEST_NETWORK", "") not in ("", "0")


@pytest.mark.parametrize("nprocs", RANKS)
def test_suite(nprocs):
    run = mpirun(
        nprocs,
        ["-m", "pytest", *FILES, "-q", "-p", "no:cacheprovider", "-x"],
        timeout=TIMEOUT * (2 if NETWORK else 1),
        env=network_env() if NETWORK else None,
    )
    assert not run.timed_out and run.returncode == 0, (
        f"multi-rank suite failed at {nprocs} ranks\n" + run.describe()
    )
    counts = re.findall(r"(\d+) passed", run.output)
    assert len(counts) == nprocs, run.describe()
    print(f"{nprocs} ranks: {counts[0]} passed on each rank")


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
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    run = mpirun(2, [str(script)], timeout=60)
    # Either MPI reports the mismatch or the job is killed at the timeout: never a hang.
    assert run.timed_out or run.returncode != 0, run.describe()
