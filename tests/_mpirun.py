"""Run a Python program under `mpiexec` with a hard timeout (never hangs the caller)."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Subprocesses start in tests/, never in the repository root, so that `import vjpmpi`
# finds the installed package (with its compiled kernels), not the source folder.
TESTS = ROOT / "tests"

# XLA's CPU code generation at LLVM -O0: what the suite spends its time on is compiling,
# and this compiles its programs 1.5-5 times faster. It leaves XLA's HLO passes alone, so
# the optimized HLO that tests inspect (order, counts, buffers) is what users' programs
# compile to (test_multirank.py: test_rank_env_compiles_the_same_hlo).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# Rank processes share 2 cores: keep each one single-threaded.
RANK_ENV = {
    # Open MPI refuses to start as root without these (CI containers run as root);
    # MPICH ignores them
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false {FAST_COMPILE}",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "VJPMPI_TRACE": "1",  # the trace test compares every rank's sequence of collectives
}


def device_env(ndev: int) -> dict[str, str]:
    """The job environment of `ndev` CPU devices per process: RANK_ENV's XLA_FLAGS with
    --xla_force_host_platform_device_count (read when JAX starts its CPU backend)."""
    return {"XLA_FLAGS": f"{RANK_ENV['XLA_FLAGS']} --xla_force_host_platform_device_count={ndev}"}


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the `mpich` extra or a system MPI")
    return found


@functools.cache
def mpi_family() -> str:
    """'openmpi' or 'mpich', from what `mpiexec --version` says (no MPI started here)."""
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60)
    return "openmpi" if "Open MPI" in out.stdout + out.stderr else "mpich"


def launch(nprocs: int, hosts: str | None = None) -> list[str]:
    """The mpiexec command line for `nprocs` ranks on this machine (oversubscribed);
    `hosts` (MPICH only), e.g. "localhost:2,127.0.0.1:2": ranks in that order on names
    that MPI takes for different nodes (both this machine), so that MPI_COMM_TYPE_SHARED
    splits them by name and messages between them go through the network module."""
    if hosts is not None:
        if mpi_family() != "mpich":
            raise RuntimeError("_mpirun.launch: `hosts` needs MPICH's launcher")
        return [mpiexec(), "-hosts", hosts, "-n", str(nprocs)]
    extra = ["--oversubscribe"] if mpi_family() == "openmpi" else []
    return [mpiexec(), *extra, "-n", str(nprocs)]


def network_env() -> dict[str, str]:
    """Environment that turns shared memory off, so every message (also between ranks
    on one machine) goes through the MPI library's network module, over loopback TCP:
    the closest one machine gets to several nodes."""
    if mpi_family() == "openmpi":
        return {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_pml": "ob1"}
    # MPICH: no local (shared-memory) path, and the OFI network module over its TCP
    # provider. (The wheel's default UCX module loses MPI_ANY_SOURCE messages when
    # MPIR_CVAR_NOLOCAL=1 at 4 ranks; plain mpi4py shows it, so it is not vjpmpi's.)
    return {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


@dataclasses.dataclass
class Run:
    nprocs: int
    returncode: int | None
    output: str
    timed_out: bool

    def describe(self) -> str:
        state = "TIMED OUT (killed)" if self.timed_out else f"exit code {self.returncode}"
        return f"mpiexec -n {self.nprocs}: {state}\n{self.output[-20000:]}"


class Job:
    """`python argv...` started on `nprocs` ranks; `result()` waits for it (the whole job
    is killed `timeout` s after its start), `kill()` ends it now; `started` and `ended` are
    its start and end on `time.monotonic()`'s clock (`ended` is set once it has ended)."""

    def __init__(self, nprocs: int, argv: list[str], timeout: float, env: dict | None = None,
                 hosts: str | None = None):
        self.nprocs, self.timeout = nprocs, timeout
        self.started, self.ended = time.monotonic(), None
        full_env = {**os.environ, **RANK_ENV, **(env or {})}
        self.proc = subprocess.Popen(
            [*launch(nprocs, hosts), sys.executable, *argv], cwd=TESTS, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            text=True,
        )
        self._run: Run | None = None
        # (a thread reads the output, so a job left to run never blocks on a full pipe)
        self._reader = threading.Thread(target=self._wait, daemon=True)
        self._reader.start()

    def _wait(self):
        try:
            out, _ = self.proc.communicate(timeout=self.timeout)
            self._run = Run(self.nprocs, self.proc.returncode, out, False)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate()
            self._run = Run(self.nprocs, None, out, True)
        self.ended = time.monotonic()

    def result(self) -> Run:
        self._reader.join()
        return self._run

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the job we started, by its group
        except ProcessLookupError:  # (it has ended)
            pass


def mpirun(nprocs: int, argv: list[str], timeout: float, env: dict | None = None) -> Run:
    """Run `python argv...` on `nprocs` ranks; kill the whole job after `timeout` s."""
    return Job(nprocs, argv, timeout, env).result()
