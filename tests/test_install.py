"""Import-time checks, each in a fresh single-rank interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mpirun import RANK_ENV, TESTS


def python(code: str) -> subprocess.CompletedProcess:
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


CUDA_HEADERS = Path("/usr/local/cuda/include/cuda_runtime_api.h")


@pytest.mark.skipif(not CUDA_HEADERS.exists(), reason="no CUDA toolkit on this machine")
def test_cuda_backend_is_built_and_registered():
    """With a CUDA toolkit at build time the CUDA handlers are compiled and registered;
    without a GPU they stage through host memory and say why CUDA-aware is off."""
    r = python(
        "from mpi4py import MPI\n"
        "import vjpmpi\n"
        "from vjpmpi import _kernels\n"
        "assert _kernels.cuda is not None, 'CUDA backend not built'\n"
        "assert sorted(_kernels.cuda.registrations()) == sorted(_kernels.cpu.registrations())\n"
        "assert _kernels.cuda.library_version() == MPI.Get_library_version()\n"
        "print(vjpmpi.cuda_mode(), _kernels.cuda.cuda_aware_query())\n"
        "print(_kernels.cuda.configure_cuda('1') or 'no error')\n"
    )
    assert r.returncode == 0, r.stderr
    mode, aware = r.stdout.splitlines()[0].split()
    assert mode == ("cuda-aware" if aware == "1" else "host-staged")
    if aware != "1":  # forcing CUDA-aware on an MPI without it: a clear error, not a crash
        assert "VJPMPI_CUDA_AWARE=1, but this MPI" in r.stdout


def test_bad_cuda_aware_setting_is_an_import_error():
    r = subprocess.run(
        [sys.executable, "-c", "import vjpmpi"], cwd=TESTS, capture_output=True, text=True,
        env={**os.environ, **RANK_ENV, "VJPMPI_CUDA_AWARE": "yes"}, timeout=300)
    assert r.returncode != 0 and "VJPMPI_CUDA_AWARE must be auto, 0 or 1" in r.stderr


def test_source_tree_without_build_says_so(tmp_path):
    """Importing the repository's vjpmpi/ folder (no compiled kernels in it) names the cause."""
    import json
    import shutil
    from importlib.metadata import distribution

    url = distribution("vjpmpi").read_text("direct_url.json") or "{}"
    if json.loads(url).get("dir_info", {}).get("editable"):
        pytest.skip("an editable install's import hook finds the package before the folder")

    from _mpirun import ROOT

    shutil.copytree(ROOT / "vjpmpi", tmp_path / "vjpmpi",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    r = subprocess.run([sys.executable, "-c", "import vjpmpi"], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, **RANK_ENV}, timeout=300)
    assert r.returncode != 0
    assert "compiled kernels are not in" in r.stderr and "pip install ." in r.stderr
