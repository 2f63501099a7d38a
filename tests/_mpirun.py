"""Run a Python program under `mpiexec` with a hard timeout (never hangs the caller)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Subprocesses start in tests/, never in the repository root, so that `import vjpmpi`
# finds the installed package (with its compiled kernels), not the source folder.
TESTS = ROOT / "tests"

# Rank processes share 2 cores: keep each one single-threaded.
RANK_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "VJPMPI_TRACE": "1",  # the trace test compares every rank's sequence of collectives
}


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the `mpich` extra or a system MPI")
    return found


@dataclasses.dataclass
class Run:
    nprocs: int
    returncode: int | None
    output: str
    timed_out: bool

    def describe(self) -> str:
        state = "TIMED OUT (killed)" if self.timed_out else f"exit code {self.returncode}"
        return f"mpiexec -n {self.nprocs}: {state}\n{self.output[-20000:]}"


def mpirun(nprocs: int, argv: list[str], timeout: float, env: dict | None = None) -> Run:
    """Run `python argv...` on `nprocs` ranks; kill the whole job after `timeout` s."""
    full_env = {**os.environ, **RANK_ENV, **(env or {})}
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, *argv]
    proc = subprocess.Popen(
        cmd, cwd=TESTS, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Run(nprocs, proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job we started, by its process group
        out, _ = proc.communicate()
        return Run(nprocs, None, out, True)
