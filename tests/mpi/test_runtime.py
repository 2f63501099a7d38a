"""One runtime for every backend, and one source (the C++ tables) for the codes.

- Both modules' handlers use one runtime, in the core library both link: call sites, counters,
  trace and settings are the same whichever backend runs a call (no GPU needed:
  a test hook enters the same guard a CUDA handler enters).
- Python's reduction codes and supported dtypes are read from the compiled
  kernels; each code runs the MPI op of its name, each dtype moves intact.
"""

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from vjpmpi import _kernels, _mpi

from helpers import DTYPES, WORLD, assert_equal, data, identity, np_reduce

rank, size = WORLD.rank, WORLD.size

needs_cuda_module = pytest.mark.skipif(
    _kernels.cuda is None,
    reason="vjpmpi was built without its CUDA backend")


# ------------------------------------------------------------ one runtime --
@needs_cuda_module
def test_cuda_module_shares_the_cpu_runtime():
    cpu, cuda = _kernels.cpu, _kernels.cuda
    assert cuda.runtime_address() == cpu.runtime_address() != 0
    # a site registered once: the same id and text in both modules' handlers
    text = f"probe(rank={rank}) at test_runtime.py"
    site = _kernels.register_site(text)
    assert site > 0
    assert cuda._site_for_test(site) == cpu._site_for_test(site) == text
    # a call entered through the CUDA module's code path is counted, and traced,
    # by the one runtime vjpmpi reads
    tracing = _kernels.trace_enabled()
    if tracing:
        vjpmpi.take_trace()
    calls, overlaps = _kernels.call_counts()
    cuda._guard_for_test("cuda_probe", site)
    cpu._guard_for_test("cpu_probe", site)
    assert _kernels.call_counts() == (calls + 2, overlaps)
    if tracing:  # (also checked with tracing on in tests/test_install.py)
        assert vjpmpi.take_trace() == ["cuda_probe", "cpu_probe"]


@needs_cuda_module
def test_both_modules_link_one_core_library():
    """No capsule between the modules: the runtime is `vjpmpi::runtime` in
    libvjpmpi_core.so, which both link (found next to them); the address each module's
    handlers use is that symbol's, and a call entered through the CUDA module is counted
    by the CPU module's call_counts()."""
    cpu, cuda = _kernels.cpu, _kernels.cuda
    assert not hasattr(cpu, "runtime_capsule") and not hasattr(cuda, "attach_runtime")
    core = Path(cpu.__file__).with_name("libvjpmpi_core.so")
    assert core.exists() and Path(cuda.__file__).parent == core.parent
    maps = Path("/proc/self/maps").read_text().splitlines()
    loaded = {line.split()[-1] for line in maps if line.endswith("/libvjpmpi_core.so")}
    assert loaded == {str(core.resolve())}, loaded  # one copy, the one next to the modules
    symbol = ctypes.c_char.in_dll(ctypes.CDLL(str(core)), "_ZN6vjpmpi7runtimeE")
    assert cpu.runtime_address() == cuda.runtime_address() == ctypes.addressof(symbol)
    tracing = _kernels.trace_enabled()
    calls, overlaps = cpu.call_counts()
    cuda._guard_for_test("cuda_probe", 0)
    assert cpu.call_counts() == (calls + 1, overlaps)
    if tracing:
        assert vjpmpi.take_trace()[-1:] == ["cuda_probe"]


# ---------------------------------------------------------- one code table --
def test_python_codes_come_from_the_kernels():
    names = tuple(_kernels.cpu.reductions())
    assert _mpi.RED_NAMES == names
    assert len(set(names)) == len(names)
    for code, name in enumerate(names):
        assert getattr(_mpi, name) == code
        assert isinstance(getattr(MPI, name), MPI.Op), name
        assert _mpi.as_red(getattr(MPI, name), "test") == code
        assert _mpi.as_red(name.lower(), "test") == code
    kernel_dtypes = {_mpi._numpy_dtype(n) for n in _kernels.cpu.dtypes()}
    assert _mpi._DTYPES == kernel_dtypes
    assert set(DTYPES) == kernel_dtypes  # the suite covers every supported dtype
    for d in kernel_dtypes:
        assert _mpi.check_dtype(d, "test") == d


@needs_cuda_module
def test_cuda_module_exports_the_same_tables():
    assert _kernels.cuda.reductions() == _kernels.cpu.reductions()
    assert _kernels.cuda.dtypes() == _kernels.cpu.dtypes()


def _defined(name, dtype):
    try:
        return _mpi.check_red_dtype(_mpi.as_red(name, "test"), dtype, "test") == \
            _mpi.as_red(name, "test")
    except TypeError:
        return False


# every reduction of the table on int32, and those defined for floats on float64
_RED_CASES = [(name, np.dtype(t)) for t in ("int32", "float64") for name in _kernels.REDUCTIONS
              if _defined(name, np.dtype(t))]


@pytest.mark.parametrize("name, dtype", _RED_CASES, ids=[f"{n}-{d}" for n, d in _RED_CASES])
def test_each_code_runs_the_mpi_op_of_its_name(name, dtype):
    """A code that Python and C++ read differently runs another op: the result then
    differs from mpi4py's op of that name and from NumPy (exscan's identity on rank 0
    tells the ops apart at one rank too)."""
    x = data((7,), dtype, rank, salt=3)
    xs = WORLD.allgather(x)
    expected = np_reduce(name, xs, dtype)
    by_mpi4py = np.empty_like(x)
    WORLD.Allreduce(x, by_mpi4py, op=getattr(MPI, name))
    assert_equal(by_mpi4py, expected)
    assert_equal(vjpmpi.allreduce(jnp.asarray(x), getattr(MPI, name)), expected)
    assert_equal(vjpmpi.allreduce(jnp.asarray(x), name), expected)
    prefix = identity(name, x.shape, dtype) if rank == 0 else np_reduce(name, xs[:rank], dtype)
    assert_equal(vjpmpi.exscan(jnp.asarray(x), getattr(MPI, name)), prefix)


@pytest.mark.parametrize("name", _kernels.DTYPES)
def test_every_dtype_round_trips_allgather(name):
    dtype = _mpi._numpy_dtype(name)
    assert str(dtype) == name
    x = data((5,), dtype, rank, salt=11)
    assert_equal(vjpmpi.allgather(jnp.asarray(x)), np.stack(WORLD.allgather(x)))


def test_trace_flag_is_the_environments():
    assert _kernels.trace_enabled() == _kernels._env_switch("VJPMPI_TRACE", False)


# ------------------------------------------------------ the call's attributes --
def test_a_program_with_other_call_attributes_is_refused(monkeypatch):
    """The kernels read a call's attributes by position from one array; a program whose
    array has another length (lowered by another vjpmpi release) is refused with a
    message on every rank, before any MPI call, instead of reading its values wrongly."""
    from vjpmpi import _lowering

    x = jnp.arange(3.0) + rank
    good = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
    assert_equal(good(x), sum(np.arange(3.0) + r for r in range(size)))
    monkeypatch.setattr(_lowering, "CALL_ATTRS", (*_lowering.CALL_ATTRS, "another"))
    other = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM) * 2)
    with pytest.raises(Exception, match=r"vjpmpi\.allreduce: this program's call attributes are "
                                        r"not the ones these kernels take .*trace it again"):
        other(x).block_until_ready()
    monkeypatch.undo()
    assert_equal(good(x + 1), sum(np.arange(3.0) + 1 + r for r in range(size)))
