"""The ranks of a test run compile each program once, not once per rank.

Under `mpiexec` every rank traces and compiles the same programs at about the same
moment; oversubscribed on two cores, four or eight ranks pay four or eight times the
compile. With VJPMPI_TEST_SHARED_COMPILES=DIR (tests/test_multirank.py sets one DIR per
pytest session), JAX's persistent compilation cache lives in DIR, and a program that is
not there yet is compiled by the first rank that asks for it while the others sleep
until it is written, then load it. Only a byte-identical key is shared: the same HLO
module (every attribute of every collective: communicator number, tags, roots, program
signature, call-site hash), the same compile options, XLA flags and JAX version. So a
rank loads exactly the executable it would have compiled, and programs that differ
between ranks (or jobs) are compiled by each. Tracing and lowering still run on every
rank (the texts of call sites and argument errors are registered there).

This leans on JAX internals (the cache object, `compile_or_get_cached`); where they are
not what it expects, `share_compiles` returns False and every rank compiles on its own.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

# A rank that waits longer than this for another rank's compile compiles on its own
# (the slowest program of the suite compiles in about 10 s at 8 ranks).
WAIT_S = 300.0
_POLL_S = 0.02


class SharedCache:
    """JAX's cache interface (get/put) over DIR, with one compiling rank per key."""

    def __init__(self, path: str):
        self._dir = Path(path)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._held = threading.local()  # the key this thread is compiling, if any

    def _entry(self, key: str) -> Path:
        return self._dir / f"{key}.exe"

    def get(self, key: str):
        entry, lock = self._entry(key), self._dir / f"{key}.compiling"
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                return entry.read_bytes()  # complete: put() writes by rename
            except FileNotFoundError:
                pass
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if time.monotonic() > deadline or not _owner_alive(lock):
                    return None  # compile here (the owner is gone or stuck)
                time.sleep(_POLL_S)
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            try:  # (the owner may have written it and let go between the two looks)
                value = entry.read_bytes()
            except FileNotFoundError:
                self._held.lock = lock  # released when this compile returns (release())
                return None
            lock.unlink(missing_ok=True)
            return value

    def put(self, key: str, value: bytes) -> None:
        entry = self._entry(key)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, entry)

    def release(self) -> None:
        lock = getattr(self._held, "lock", None)
        if lock is not None:
            self._held.lock = None
            lock.unlink(missing_ok=True)


def _owner_alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text() or "0")
    except (FileNotFoundError, ValueError):
        return True  # just created or just removed: look again
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def share_compiles(path: str) -> bool:
    """Install the shared cache at `path`; False (nothing changed) where JAX differs."""
    import jax

    try:
        from jax._src import compilation_cache, compiler
    except ImportError:
        return False
    original = getattr(compiler, "compile_or_get_cached", None)
    if original is None or not hasattr(compilation_cache, "_cache"):
        return False
    cache = SharedCache(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
    compilation_cache._cache = cache
    compilation_cache._cache_initialized = True

    @functools.wraps(original)
    def compile_then_release(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:  # written, not written (host callbacks) or failed: the waiters go on
            cache.release()

    compiler.compile_or_get_cached = compile_then_release
    return True
