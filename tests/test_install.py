"""Import-time checks, each in a fresh single-rank interpreter.

The platform parts of .ci/run run the checks whose outcome can depend on their
platform: `mpi_library` (the MPI library the kernels are built against: the Open MPI
part) and `jax_version` (the JAX installed: the oldest- and newest-JAX parts); the main
part runs all."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mpirun import RANK_ENV, ROOT, TESTS


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS, env={**os.environ, **RANK_ENV},
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.mpi_library
def test_kernels_use_mpi4py_library():
    r = python(
        "from mpi4py import MPI\n"
        "import vjpmpi\n"
        "from vjpmpi import _kernels\n"
        "assert _kernels.cpu.library_version() == MPI.Get_library_version()\n"
        "print(_kernels.cpu.abi, MPI.get_vendor()[0])\n"
    )
    assert r.returncode == 0, r.stderr
    abi, vendor = r.stdout.strip().split(maxsplit=1)
    assert (abi, vendor) in {("mpich", "MPICH"), ("mpich", "Intel MPI"), ("openmpi", "Open MPI")}


@pytest.mark.mpi_library
def test_mismatched_mpi_library_is_a_clear_import_error():
    r = python(
        "from mpi4py import MPI\n"
        "MPI.Get_library_version = lambda: 'Open MPI v5.0.3, package: Open MPI'\n"
        "import vjpmpi\n"
    )
    assert r.returncode != 0
    assert "ImportError: vjpmpi's kernels and mpi4py use different MPI libraries" in r.stderr
    assert "VJPMPI_MPICC" in r.stderr


@pytest.mark.jax_version
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


@pytest.mark.jax_version
def test_import_sets_synchronous_dispatch():
    r = python(
        "import jax, vjpmpi\n"
        "assert jax.config.read('jax_cpu_enable_async_dispatch') is False\n"
        "import jax.numpy as jnp; jnp.ones(1)\n"
    )
    assert r.returncode == 0, r.stderr


CUDA_HEADERS = Path("/usr/local/cuda/include/cuda_runtime_api.h")


@pytest.mark.jax_version
@pytest.mark.mpi_library
@pytest.mark.skipif(not CUDA_HEADERS.exists(), reason="no CUDA toolkit on this machine")
def test_cuda_backend_is_built_and_registered():
    """With a CUDA toolkit at build time the CUDA handlers are compiled and registered
    (all of the CPU's but vjpmpi.start / wait's and the ragged exchange's); without a GPU they stage through host
    memory and say why CUDA-aware is off."""
    r = python(
        "from mpi4py import MPI\n"
        "import vjpmpi\n"
        "from vjpmpi import _kernels\n"
        "assert _kernels.cuda is not None, 'CUDA backend not built'\n"
        "started = {'send_start', 'recv_start', 'sendrecv_start', 'wait', 'wait_send',\n"
        "           'wait_sendrecv', 'ragged_alltoall'}\n"
        "started |= {k + '_dev' for k in started} - {'wait_sendrecv_dev'}  # (and their\n"
        "# device calls; a device call's wait takes no arrays: one wait for every op)\n"
        "cpu = set(_kernels.cpu.registrations())\n"
        "assert started <= cpu, cpu  # (vjpmpi.start / wait, the ragged exchange: CPU only)\n"
        "assert sorted(_kernels.cuda.registrations()) == sorted(cpu - started)\n"
        "assert _kernels.cuda.library_version() == MPI.Get_library_version()\n"
        "print(vjpmpi.cuda_mode(), _kernels.cuda.cuda_aware_query())\n"
        "print(_kernels.cuda.configure_cuda('1') or 'no error')\n"
    )
    assert r.returncode == 0, r.stderr
    mode, aware = r.stdout.splitlines()[0].split()
    assert mode == ("cuda-aware" if aware == "1" else "host-staged")
    if aware != "1":  # forcing CUDA-aware on an MPI without it: a clear error, not a crash
        assert "VJPMPI_CUDA_AWARE=1, but this MPI" in r.stdout


@pytest.mark.mpi_library
@pytest.mark.skipif(not CUDA_HEADERS.exists(), reason="no CUDA toolkit on this machine")
def test_cuda_module_shares_the_cpu_runtime():
    """One runtime for both backends (fresh interpreter, VJPMPI_TRACE=1): a call entered
    through the CUDA module's code path is in vjpmpi.take_trace() and the call count,
    and a site registered once reads the same in both modules."""
    r = python(
        "import vjpmpi\n"
        "from vjpmpi import _kernels\n"
        "assert _kernels.cuda is not None, 'CUDA backend not built'\n"
        "cpu, cuda = _kernels.cpu, _kernels.cuda\n"
        "assert cuda.runtime_address() == cpu.runtime_address()\n"
        "site = _kernels.register_site('probe at <string>:1')\n"
        "assert cuda._site_for_test(site) == cpu._site_for_test(site) == 'probe at <string>:1'\n"
        "vjpmpi.take_trace()\n"
        "calls = _kernels.call_counts()[0]\n"
        "cuda._guard_for_test('cuda_probe', site)\n"
        "assert _kernels.call_counts()[0] == calls + 1, _kernels.call_counts()\n"
        "print(vjpmpi.take_trace())\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['cuda_probe']"


def test_bad_cuda_aware_setting_is_an_import_error():
    r = subprocess.run(
        [sys.executable, "-c", "import vjpmpi"], cwd=TESTS, capture_output=True, text=True,
        env={**os.environ, **RANK_ENV, "VJPMPI_CUDA_AWARE": "maybe"}, timeout=300)
    assert r.returncode != 0 and ("VJPMPI_CUDA_AWARE='maybe' is not a valid setting: "
                                  "VJPMPI_CUDA_AWARE takes auto, 1/on/true/yes (on) or "
                                  "0/off/false/no (off)") in r.stderr, r.stderr


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


def test_version_is_the_distributions():
    """`vjpmpi.__version__` is the installed distribution's (pyproject.toml's version), not a
    second copy written by hand that can drift from it."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    r = python("import importlib.metadata as m, vjpmpi\n"
               "print(vjpmpi.__version__, m.version('vjpmpi'))\n")
    assert r.returncode == 0, r.stderr
    mine, installed = r.stdout.split()
    assert mine == installed == meta["project"]["version"]


@pytest.mark.jax_version
def test_jax_range_is_declared_once():
    """pyproject.toml's JAX range, its build-time jaxlib (the FFI headers) and the range
    vjpmpi warns outside of are the same; the installed JAX is inside it (CI runs both
    ends, see .ci/run)."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    r = python("from vjpmpi import _versions, _kernels\n"
               "import jax\n"
               "print(*_versions.JAX_TESTED, jax.__version__, _kernels.cpu.jaxlib_headers)\n")
    assert r.returncode == 0, r.stderr
    low, high, installed, headers = r.stdout.split()
    deps = meta["project"]["dependencies"]
    assert f"jax>={low},<={high}" in deps and f"jaxlib>={low},<={high}" in deps, deps
    assert f"jaxlib=={low}" in meta["build-system"]["requires"]
    assert headers == low  # a pip build uses the oldest supported jaxlib's headers
    v = lambda s: tuple(int(p) for p in s.split(".")[:3])  # noqa: E731
    assert v(low) <= v(installed) <= v(high)


@pytest.mark.jax_version
@pytest.mark.parametrize("version", ["0.6.2", "0.12.1", "1.0.0.dev20270101"])
def test_jax_outside_the_range_warns(version):
    r = python(
        "import warnings, jax\n"
        f"jax.__version__ = {version!r}\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import vjpmpi\n"
        "hits = [x for x in w if issubclass(x.category, vjpmpi.JaxVersionWarning)]\n"
        "print(len(hits), hits[0].message if hits else '')\n"
    )
    assert r.returncode == 0, r.stderr
    low, high = _tested_range()
    assert r.stdout.startswith("1 "), r.stdout
    assert f"tested with JAX {low} to {high}, but JAX {version} is installed" in r.stdout


@pytest.mark.jax_version
def test_jax_inside_the_range_does_not_warn():
    # no version warning, and no warning of any kind raised from vjpmpi's own files
    # (a deprecated JAX name that vjpmpi reads warns at vjpmpi's line)
    r = python(
        "import os, warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import vjpmpi\n"
        "    import vjpmpi.nn, vjpmpi.fft, vjpmpi.compat.mpi4jax\n"
        "here = os.path.dirname(vjpmpi.__file__)\n"
        "print([f'{x.category.__name__}: {x.message}' for x in w\n"
        "       if issubclass(x.category, vjpmpi.JaxVersionWarning) or x.filename.startswith(here)])\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.jax_version
def test_kernels_built_against_newer_jaxlib_is_a_clear_import_error():
    """XLA refuses FFI handlers compiled against a newer jaxlib than itself, and says so
    only when the CPU client starts; vjpmpi says it at import, with the fix."""
    r = python(
        "import jax, jaxlib.version  # (jax checks jaxlib at its own import)\n"
        "jaxlib.version.__version__ = '0.6.0'\n"
        "import vjpmpi\n"
    )
    assert r.returncode != 0
    assert "ImportError: vjpmpi's kernels were compiled against the XLA FFI headers of " \
           "jaxlib" in r.stderr
    assert "but jaxlib 0.6.0 is installed" in r.stderr and "--no-build-isolation" in r.stderr


@functools.cache
def _tested_range():
    r = python("from vjpmpi import _versions; print(*_versions.JAX_TESTED)")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.mpi_library
@pytest.mark.skipif(not os.environ.get("VJPMPI_OTHER_LIBMPI"),
                    reason="VJPMPI_OTHER_LIBMPI (another MPI family's libmpi) not set; "
                           ".ci/run sets it in its Open MPI environment")
def test_other_mpi_family_at_run_time_is_a_clear_import_error():
    """mpi4py made to load the other family's libmpi (MPICH's under Open MPI kernels):
    the kernels cannot run on it, and importing vjpmpi says so instead of crashing."""
    r = subprocess.run(
        [sys.executable, "-c", "import vjpmpi"], cwd=TESTS, capture_output=True, text=True,
        timeout=300,
        env={**os.environ, **RANK_ENV, "MPI4PY_LIBMPI": os.environ["VJPMPI_OTHER_LIBMPI"]})
    assert r.returncode != 0
    assert "ImportError: vjpmpi's kernels and mpi4py use different MPI libraries" in r.stderr, \
        r.stderr[-3000:]
