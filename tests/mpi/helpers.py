"""References and data for the multi-rank suite."""

import functools
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
BF16 = np.dtype(ml_dtypes.bfloat16)

DTYPES = [
    np.dtype(t)
    for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64", "complex64", "complex128")
] + [BF16]

FLOAT_REDS = ["SUM", "PROD", "MAX", "MIN"]
INT_REDS = ["SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"]
BOOL_REDS = ["LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "MAX", "MIN"]
COMPLEX_REDS = ["SUM", "PROD"]


def reductions(dtype):
    if dtype == np.bool_:
        return BOOL_REDS
    if dtype.kind in "iu":
        return INT_REDS
    if dtype.kind == "c":
        return COMPLEX_REDS
    return FLOAT_REDS


def _logical(f):
    return lambda a, b: f(a != 0, b != 0).astype(a.dtype)


NP_REDS = {
    "SUM": np.add, "PROD": np.multiply, "MAX": np.maximum, "MIN": np.minimum,
    "LAND": _logical(np.logical_and), "LOR": _logical(np.logical_or),
    "LXOR": _logical(np.logical_xor), "BAND": np.bitwise_and, "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}
BOOL_NP = {"BAND": "LAND", "BOR": "LOR", "BXOR": "LXOR", "MAX": "LOR", "MIN": "LAND"}


def np_reduce(red, arrays, dtype):
    if dtype == np.bool_:
        red = BOOL_NP.get(red, red)
    out = functools.reduce(NP_REDS[red], [np.asarray(a, dtype) for a in arrays])
    return np.asarray(out, dtype)


def identity(red, shape, dtype):
    """The identity of a reduction (what exscan gives rank 0)."""
    if dtype == np.bool_:
        red = BOOL_NP.get(red, red)
        return np.full(shape, red == "LAND", dtype)
    if red in ("PROD", "LAND"):
        return np.ones(shape, dtype)
    if red == "BAND":
        return np.full(shape, -1).astype(dtype) if dtype.kind == "i" else np.full(shape, np.iinfo(dtype).max, dtype)
    if red == "MAX":
        return np.full(shape, -np.inf if dtype.kind == "f" or dtype == BF16 else np.iinfo(dtype).min, dtype)
    if red == "MIN":
        return np.full(shape, np.inf if dtype.kind == "f" or dtype == BF16 else np.iinfo(dtype).max, dtype)
    return np.zeros(shape, dtype)


def data(shape, dtype, rank, salt=0):
    """Small integer-valued data, different on each rank (exact in every dtype)."""
    rng = np.random.default_rng(7919 * rank + 104729 * salt + 17)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    lo = 0 if dtype.kind == "u" else -3
    if dtype.kind == "c":
        return (rng.integers(lo, 4, shape) + 1j * rng.integers(lo, 4, shape)).astype(dtype)
    return rng.integers(lo, 4, shape).astype(dtype)


def assert_equal(got, expected):
    got = np.asarray(got)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if expected.dtype == BF16 or expected.dtype.kind == "f":
        np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    else:
        np.testing.assert_array_equal(got, expected)


def as_jax(x):
    return jnp.asarray(x)


def kernel_calls() -> tuple[int, int]:
    """(kernel calls, calls that overlapped another): one runtime counts every backend's
    calls, whichever device they ran on."""
    from vjpmpi import _kernels

    return _kernels.call_counts()


# ------------------------------------------------ data and inner products --
def rng(salt=0):
    """A generator of this rank's own (different on every rank, reproducible)."""
    return np.random.default_rng(1000 + 97 * WORLD.rank + 7919 * salt)


def normal(shape, salt=0):
    return jnp.asarray(rng(salt).standard_normal(shape))


def gdot(a, b):
    """Global inner product: local vdots summed over ranks."""
    return WORLD.allreduce(float(np.real(np.vdot(np.asarray(a), np.asarray(b)))))


# ------------------------------------------------------------ pytrees --
def assert_trees_close(got, want, rtol=1e-12, atol=None, what="leaf"):
    """Every leaf of `got` equals the same leaf of `want` within tolerance.

    The trees must have the same structure and at least one array leaf: a tree that
    lost leaves, gained some or is empty fails (a bare `zip` of two leaf lists would
    pass on the common prefix, or on nothing at all)."""
    import jax

    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def, f"tree structures differ:\n  got  {got_def}\n  want {want_def}"
    assert want_leaves, "no leaves to compare"
    atol = rtol if atol is None else atol
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {i} of {len(want_leaves)}")


# ------------------------------------------------------- device arrays --
def to_device(x):
    """A JAX array of NumPy data without a compile: `jnp.asarray` of a NumPy array
    (JAX 0.10) and `jnp.full`/`jnp.arange`/`jnp.ones` compile a small program per shape
    and dtype; `jax.device_put` copies the buffer and compiles nothing."""
    import jax

    return jax.device_put(np.asarray(x))


# for shapes only: nothing is drawn with it
_SHAPES_KEY = jnp.asarray(np.zeros(2, np.uint32))


def fresh(ctor, *args, seed, **kwargs):
    """`ctor(*args, **kwargs)`, an equinox layer, with its parameters drawn by NumPy
    (uniform in +-1/sqrt(fan-in), as equinox draws them) instead of jax.random: the same
    layer and structure, and nothing compiled."""
    if "key" in inspect.signature(ctor).parameters:
        kwargs["key"] = _SHAPES_KEY
    shapes = eqx.filter_eval_shape(ctor, *args, **kwargs)
    gen = np.random.default_rng(seed)

    def draw(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        fan = int(np.prod(leaf.shape[1:])) if len(leaf.shape) > 1 else leaf.shape[0]
        lim = 1 / np.sqrt(max(fan, 1))
        return jnp.asarray(gen.uniform(-lim, lim, leaf.shape).astype(leaf.dtype))

    return jax.tree_util.tree_map(draw, shapes)


PROGRAMS = {}  # compiled(): {(test module, key): executable}


def compiled(key, fn, *args):
    """`jax.jit(fn)` compiled for `args`, once per key (name it with the test module)
    in this process: the tests that run or inspect the same program share one
    executable, each with its own data. `forget(module)` drops a module's programs
    (before the communicators they hold are freed)."""
    if key not in PROGRAMS:
        PROGRAMS[key] = jax.jit(fn).lower(*args).compile()
    return PROGRAMS[key]


def forget(module):
    for key in [k for k in PROGRAMS if k[0] == module]:
        del PROGRAMS[key]


def send_recv_pair(x):
    """Even ranks send `x` to the next rank, odd ranks receive from the previous one
    (`x` the template); a rank without a partner computes locally."""
    import vjpmpi

    rank, size = WORLD.rank, WORLD.size
    if rank % 2 == 0 and rank + 1 < size:
        vjpmpi.send(x, rank + 1, tag=5)
        return x * 2.0
    if rank % 2 == 1:
        return vjpmpi.recv(x, rank - 1, tag=5)
    return x * 3.0


class PerSample(eqx.Module):
    """`inner` applied to each row of a batch (a pipeline stage made of per-sample layers)."""

    inner: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.inner)(x)
