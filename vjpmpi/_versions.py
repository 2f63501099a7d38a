"""The JAX range vjpmpi is tested with, and the checks made at import."""

from __future__ import annotations

import re
import warnings

import jax
import jaxlib.version

# Both ends run the multi-rank suite in CI (.ci/run: oldest-jax on Python 3.11, newest-jax
# on Python 3.13, which JAX 0.11 and newer need); pyproject.toml declares the same.
# (0.7.0 is left out: a process that ran an equinox Embedding under filter_jit dies
# at exit with glibc's "corrupted size vs. prev_size", without vjpmpi too.)
JAX_TESTED = ("0.7.1", "0.12.0.1")


class JaxVersionWarning(UserWarning):
    """Emitted at `import vjpmpi` when the installed JAX is outside the tested range.

    A warning, not an exception: the import goes on.
    vjpmpi relies on JAX internals that change between releases; outside the range it is
    tested with (the `jax` requirement of its pyproject.toml) it may fail or misbehave in
    ways its tests would have caught. Install a JAX in that range, or filter the warning
    (`warnings.filterwarnings("ignore", category=vjpmpi.JaxVersionWarning)`) to run anyway.
    """


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.10.2' -> (0, 10, 2); pre-release and local suffixes are ignored."""
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in m.group().split("."))


def check_jax(version: str = jax.__version__) -> bool:
    """Warn (and return False) when `version` of JAX is outside `JAX_TESTED`.

    vjpmpi relies on JAX internals (`_jax_compat.py` lists them), which change
    between releases: outside the range it may fail or misbehave in ways the tests
    would have caught."""
    low, high = JAX_TESTED
    if version_tuple(low) <= version_tuple(version) <= version_tuple(high):
        return True
    warnings.warn(
        f"vjpmpi is tested with JAX {low} to {high}, but JAX {version} is installed; it "
        "relies on JAX internals that may have changed. Install a JAX in that range "
        f"(pip install \"jax>={low},<={high}\") or report what fails.",
        JaxVersionWarning, stacklevel=3)
    return False


def check_ffi_headers(built: str, runtime: str = jaxlib.version.__version__) -> None:
    """ImportError when the kernels were compiled against a newer jaxlib's XLA FFI
    headers than the jaxlib installed: XLA refuses to register such handlers, and
    says so only when JAX creates its CPU client, in terms of API versions."""
    if version_tuple(built) > version_tuple(runtime):
        raise ImportError(
            f"vjpmpi's kernels were compiled against the XLA FFI headers of jaxlib {built}, "
            f"but jaxlib {runtime} is installed; XLA accepts handlers built against its own "
            "or an older jaxlib only. Upgrade jaxlib, or rebuild vjpmpi against the installed "
            "one: pip install --no-build-isolation --force-reinstall --no-deps vjpmpi "
            "(needs scikit-build-core, nanobind and an MPI in the environment)."
        )
