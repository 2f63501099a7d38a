"""Smoke test of the cluster tutorial's script (examples/train_cluster.py), float64.

- It learns, and the ranks' run (each rank its slice of the global batch, the ZeRO
  optimizer) equals one process's run on the whole batches (1e-10).
- A run of K steps that saves a checkpoint, then a run resumed from it to 2K steps,
  equals an uninterrupted run of 2K steps, bit for bit (the model and the losses).
- The command lines of examples/cluster/train.sbatch (whose bash syntax holds) and of
  docs/guides/training.md run this script with options it takes.
"""

import atexit
import functools
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import train_cluster  # noqa: E402

WORLD = MPI.COMM_WORLD
K = 6  # steps between checkpoints; the runs take 2K
RUN = {"batch": 32, "lr": 1e-2, "log_every": 0, "dtype": jnp.float64}


def leaves(result):
    return jax.tree_util.tree_leaves(train_cluster.params(result["model"]))


@functools.cache
def shared_dir():
    """A fresh directory, the same on every rank (removed at exit by rank 0)."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="vjpmpi_cluster_") if WORLD.rank == 0 else None)
    if WORLD.rank == 0:
        atexit.register(shutil.rmtree, path, True)
    return Path(path)


@functools.cache
def uninterrupted():
    return train_cluster.main(steps=2 * K, checkpoint=shared_dir() / "a", every=K, **RUN)


def test_ranks_equal_one_process_on_the_whole_batch():
    run = uninterrupted()
    assert run["steps"] == (0, 2 * K) and len(run["losses"]) == 2 * K
    assert np.mean(run["losses"][-3:]) < run["losses"][0] - 0.3, run["losses"]  # it learns
    one = train_cluster.main(steps=2 * K, comm=MPI.COMM_SELF, **RUN)  # (on each rank)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=0, atol=1e-10)
    for a, b in zip(leaves(run), leaves(one), strict=True):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-10)


def test_resumed_run_equals_an_uninterrupted_one():
    where = shared_dir() / "b"
    first = train_cluster.main(steps=K, checkpoint=where, every=K, **RUN)
    assert first["steps"] == (0, K)
    assert sorted(p.name for p in where.iterdir()) == [f"step_{K}"]
    rest = train_cluster.main(steps=2 * K, checkpoint=where, every=K, resume=True, **RUN)
    assert rest["steps"] == (K, 2 * K)  # (it did resume: a fresh start would also match)
    run = uninterrupted()
    assert first["losses"] + rest["losses"] == run["losses"]
    for a, b in zip(leaves(rest), leaves(run), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def launched_options(text, launcher):
    """The options after `examples/train_cluster.py` of each `launcher` command line
    (continued over backslash-newlines) in `text`."""
    lines = text.replace("\\\n", " ").splitlines()
    out = []
    for line in lines:
        if not line.startswith(launcher + " "):
            continue
        words = shlex.split(line, comments=True)
        if "examples/train_cluster.py" in words:
            script = words.index("examples/train_cluster.py")
            assert words[script - 3:script] == ["python", "-m", "mpi4py"], line
            out.append(words[script + 1:])
    return out


def test_the_command_lines_take_the_scripts_options():
    sbatch = ROOT / "examples" / "cluster" / "train.sbatch"
    check = subprocess.run(["bash", "-n", str(sbatch)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr
    (options,) = launched_options(sbatch.read_text(), "srun")
    got = train_cluster.parse_args(options)
    assert got["resume"] and got["checkpoint"] == "$SLURM_SUBMIT_DIR/checkpoints", got
    assert re.search(r"^srun --mpi=pmi2 ", sbatch.read_text(), re.MULTILINE)
    page = (ROOT / "docs" / "guides" / "training.md").read_text()
    lines = launched_options(page, "mpiexec")
    assert len(lines) == 3, lines
    for options in lines:
        train_cluster.parse_args(options)  # (argparse exits on an unknown option)
