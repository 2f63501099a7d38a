"""Import-time checks, each in a fresh single-rank interpreter."""

import subprocess
import sys

from _mpirun import RANK_ENV, TESTS


def python(code: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS, env={**os.environ, **RANK_ENV},
        capture_output=True, text=True, timeout=300,
    )


def test_kernels_use_mpi4py_library():
    r = python(
        "from mpi4py import MPI\n"
        "import vjpmpi\n"
        "from vjpmpi import _kernels\n"
        "assert _kernels.cpu.library_version() == MPI.Get_library_version()\n"
        "print(_kernels.cpu.abi, MPI.get_vendor()[0])\n"
    )
    assert r.returncode == 0, r.stderr
    abi, vendor = r.stdout.split()
    assert (abi, vendor) in {("mpich", "MPICH"), ("mpich", "Intel MPI"), ("openmpi", "Open MPI")}


def test_mismatched_mpi_library_is_a_clear_import_error():
    r = python(
        "from mpi4py import MPI\n"
        "MPI.Get_library_version = lambda: 'Open MPI v5.0.3, package: Open MPI'\n"
        "import vjpmpi\n"
    )
    assert r.returncode != 0
    assert "ImportError: vjpmpi's kernels and mpi4py use different MPI libraries" in r.stderr
    assert "VJPMPI_MPICC" in r.stderr


def test_late_import_warns_about_ordering():
    r = python(
        "import warnings, jax.numpy as jnp\n"
        "jnp.ones(1).block_until_ready()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import vjpmpi\n"
        "assert any(issubclass(x.category, vjpmpi.OrderingWarning) for x in w), w\n"
    )
    assert r.returncode == 0, r.stderr


def test_import_sets_synchronous_dispatch():
    r = python(
        "import jax, vjpmpi\n"
        "assert jax.config.read('jax_cpu_enable_async_dispatch') is False\n"
        "import jax.numpy as jnp; jnp.ones(1)\n"
    )
    assert r.returncode == 0, r.stderr
