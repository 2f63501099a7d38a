"""Checkpoints across jobs of other rank counts (tests/mpi/ckpt_reshard.py, the model of
tests/mpi/ckpt_model.py: data-parallel, tensor-parallel, expert-parallel layers and
`sharded_optimizer(adam)` state, float64).

- A 2-rank job trains two steps and saves step 2 (tensor and expert blocks over 2 ranks,
  ZeRO ranges over 2), with every leaf's global array gathered without the checkpoint
  code and the objective after one more step.
- A 2-rank job trains three steps and saves step 3, but rank 1 dies after writing its
  first array: the job fails, a temporary directory is left, no `step_3`.
- Jobs at 1, 3 and 4 ranks load the newest complete checkpoint (step 2, not the
  interrupted one): every leaf's global array equals the saved one bit for bit (the
  model's `to_dense` layers too), and one more step gives the objective of the same
  step at 2 ranks (1e-12).
"""

import os

import pytest
from _mpirun import Job

SCRIPT = "mpi/ckpt_reshard.py"
TIMEOUT = 300
CORES = len(os.sched_getaffinity(0))


def run(nprocs, mode, directory, compiles):
    env = {"VJPMPI_TEST_SHARED_COMPILES": str(compiles)}
    if nprocs > CORES:  # (waiting ranks sleep: tests/test_multirank.py OVERSUBSCRIBED_ENV)
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    return Job(nprocs, [SCRIPT, mode, str(directory)], TIMEOUT, env).result()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints' directory after the 2-rank save and the interrupted save."""
    directory = tmp_path_factory.mktemp("checkpoints")
    compiles = tmp_path_factory.mktemp("compiles")
    out = run(2, "save", directory, compiles)
    assert out.returncode == 0 and out.output.count("ckpt_reshard save ok") == 2, out.describe()
    out = run(2, "interrupt", directory, compiles)
    assert not out.timed_out and out.returncode != 0, out.describe()
    assert "ckpt_reshard interrupt ok" not in out.output, out.describe()
    assert "should have died" not in out.output, out.describe()
    return directory, compiles


def test_an_interrupted_save_leaves_the_last_complete_step(saved):
    directory, _ = saved
    names = sorted(p.name for p in directory.iterdir())
    assert "step_2" in names and "step_3" not in names, names
    leftover = [n for n in names if n.startswith("step_3.tmp-")]
    assert len(leftover) == 1, names
    partial = directory / leftover[0]
    assert not (partial / "manifest.json").exists()
    assert any(partial.iterdir())  # (rank 0 and rank 1 had written part of it)


@pytest.mark.parametrize("nprocs", [1, 3, 4])
def test_load_at_another_rank_count(saved, nprocs):
    directory, compiles = saved
    out = run(nprocs, "load", directory, compiles)
    assert out.returncode == 0 and out.output.count("ckpt_reshard load ok") == nprocs, \
        out.describe()
