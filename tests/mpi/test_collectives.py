"""Every collective against a NumPy reference built from mpi4py-gathered inputs.

Covers op x dtype, op x mode (eager / jit / vmap) x shape x every root, and
op x communicator kind, at whatever rank count mpiexec started.

Compile once, assert many: the jit cases run as one program per op (every dtype and
reduction; every shape and root) or per communicator kind (every op and root), built
by the first test that needs it (`jit_results`); each test asserts its own calls.
Eager and vmap calls stay eager, one call each.
"""

import dataclasses
from typing import Callable

import jax
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from helpers import (BF16, DTYPES, WORLD, assert_equal, data, identity, np_reduce, reductions,
                     to_device)


@dataclasses.dataclass(frozen=True)
class Case:
    """How to feed one collective and what NumPy says it must return."""

    call: Callable  # (x, comm, kw) -> result
    ref: Callable  # (xs over ranks, rank, size, kw) -> expected
    rank_axis_in: Callable = lambda rank, kw: False  # input gets a leading comm-size axis
    red: bool = False  # takes a reduction op
    root: bool = False  # takes a root


def _root_in(rank, kw):
    return rank == kw["root"]


CASES = {
    "allreduce": Case(lambda x, c, kw: vjpmpi.allreduce(x, kw["op"], comm=c),
                      lambda xs, r, n, kw: np_reduce(kw["red"], xs, xs[0].dtype), red=True),
    "reduce": Case(lambda x, c, kw: vjpmpi.reduce(x, kw["op"], kw["root"], comm=c),
                   lambda xs, r, n, kw: np_reduce(kw["red"], xs, xs[0].dtype)
                   if r == kw["root"] else xs[r], red=True, root=True),
    "bcast": Case(lambda x, c, kw: vjpmpi.bcast(x, kw["root"], comm=c),
                  lambda xs, r, n, kw: xs[kw["root"]], root=True),
    "allgather": Case(lambda x, c, kw: vjpmpi.allgather(x, comm=c),
                      lambda xs, r, n, kw: np.stack(xs)),
    "gather": Case(lambda x, c, kw: vjpmpi.gather(x, kw["root"], comm=c),
                   lambda xs, r, n, kw: np.stack(xs) if r == kw["root"] else xs[r], root=True),
    "scatter": Case(lambda x, c, kw: vjpmpi.scatter(x, kw["root"], comm=c),
                    lambda xs, r, n, kw: xs[kw["root"]][r], rank_axis_in=_root_in, root=True),
    "alltoall": Case(lambda x, c, kw: vjpmpi.alltoall(x, comm=c),
                     lambda xs, r, n, kw: np.stack([xs[i][r] for i in range(n)]),
                     rank_axis_in=lambda rank, kw: True),
    "reduce_scatter": Case(lambda x, c, kw: vjpmpi.reduce_scatter(x, kw["op"], comm=c),
                           lambda xs, r, n, kw: np_reduce(kw["red"], xs, xs[0].dtype)[r],
                           rank_axis_in=lambda rank, kw: True, red=True),
    "scan": Case(lambda x, c, kw: vjpmpi.scan(x, kw["op"], comm=c),
                 lambda xs, r, n, kw: np_reduce(kw["red"], xs[: r + 1], xs[0].dtype), red=True),
    "exscan": Case(lambda x, c, kw: vjpmpi.exscan(x, kw["op"], comm=c),
                   lambda xs, r, n, kw: identity(kw["red"], xs[0].shape, xs[0].dtype) if r == 0
                   else np_reduce(kw["red"], xs[:r], xs[0].dtype), red=True),
    "sendrecv": Case(lambda x, c, kw: vjpmpi.sendrecv(
                         x, x, (kw["rank"] - 1) % kw["size"], (kw["rank"] + 1) % kw["size"], comm=c),
                     lambda xs, r, n, kw: xs[(r - 1) % n]),
}


def _comm_info(comm):
    c = WORLD if comm is None else comm
    return c, c.Get_rank(), c.Get_size()


def _roots(name, size):
    return range(size) if CASES[name].root else [0]


def _prepare(name, comm, shape, dtype, red, root, salts):
    """The keyword arguments of one call and this rank's inputs (one per salt)."""
    case = CASES[name]
    _, rank, size = _comm_info(comm)
    kw = {"red": red, "op": getattr(MPI, red), "root": root, "rank": rank, "size": size}
    local_shape = (size, *shape) if case.rank_axis_in(rank, kw) else shape
    return kw, [data(local_shape, dtype, rank, salt=s) for s in salts]


def _gather(comm, xs_local):
    """Every rank's inputs, per input: [[rank 0's, rank 1's, ...] for each of xs_local]
    (one mpi4py allgather for all of them)."""
    c, _, size = _comm_info(comm)
    every = c.allgather(xs_local)
    assert len(every) == size and all(len(e) == len(xs_local) for e in every)
    return [[every[r][i] for r in range(size)] for i in range(len(xs_local))]


def _verify(name, comm, kw, gathered, got):
    """Compare each result with the NumPy reference of every rank's inputs."""
    _, rank, size = _comm_info(comm)
    assert len(got) == len(gathered)
    for xs, g in zip(gathered, got, strict=True):
        assert_equal(g, CASES[name].ref(xs, rank, size, kw))


def check(name, mode, comm, shape, dtype, red="SUM", root=0, batch=3):
    """Run collective `name` eagerly ("eager") or under an eager vmap ("vmap") and
    compare with the NumPy reference. (The jit mode runs many calls in one program:
    `jit_results`.)"""
    case = CASES[name]
    kw, xs_local = _prepare(name, comm, shape, dtype, red, root,
                            range(batch) if mode == "vmap" else [0])
    fn = lambda x: case.call(x, comm, kw)  # noqa: E731
    if mode == "eager":
        got = [fn(to_device(xs_local[0]))]
    else:
        assert mode == "vmap", mode
        stacked = np.asarray(jax.vmap(fn)(to_device(np.stack(xs_local))))
        assert stacked.shape[0] == batch
        got = list(stacked)  # NumPy slices: no compile per slice
    _verify(name, comm, kw, _gather(comm, xs_local), got)


def key(name, shape, dtype, red="SUM", root=0):
    return name, tuple(shape), np.dtype(dtype), red, root


# Compile once, assert many: each entry is ONE jitted program that runs many calls
# (every dtype and reduction of one op, every shape and root of one op, every op and
# root on one communicator kind). The first test that needs an entry runs it; every
# test then asserts its own calls. Every rank runs the tests in the same order, so
# all ranks run each program together.
_JIT: dict = {}


def jit_results(cache_key, calls, comm):
    """{key(*call): (kw, every rank's inputs, [result])} for `calls`, a list of
    (name, shape, dtype, red, root), all run in ONE jitted program on `comm`, in order."""
    if cache_key not in _JIT:
        prepared = [_prepare(n, comm, shape, dtype, red, root, [0])
                    for n, shape, dtype, red, root in calls]
        xs_local = [xs[0] for _, xs in prepared]

        def program(xs):
            return [CASES[call[0]].call(x, comm, kw)
                    for call, (kw, _), x in zip(calls, prepared, xs, strict=True)]

        outs = jax.jit(program)([to_device(x) for x in xs_local])
        assert len(outs) == len(calls)
        gathered = _gather(comm, xs_local)
        _JIT[cache_key] = {key(*call): (kw, [xs], [out]) for call, (kw, _), xs, out
                           in zip(calls, prepared, gathered, outs, strict=True)}
    return _JIT[cache_key]


def check_jit(results, name, comm, shape, dtype, red="SUM", root=0):
    kw, gathered, got = results[key(name, shape, dtype, red, root)]
    _verify(name, comm, kw, gathered, got)


SHAPES = {"scalar": (), "1d": (5,), "nd": (2, 3, 2), "empty": (0,), "empty_nd": (3, 0)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
@pytest.mark.parametrize("name", list(CASES))
def test_modes_shapes_roots(name, mode, shape):
    roots = _roots(name, WORLD.size)
    if mode == "jit":  # one program per op: every shape and root
        results = jit_results(("modes", name), [(name, s, np.float32, "SUM", root)
                                                for s in SHAPES.values() for root in roots], None)
    for root in roots:
        if mode == "jit":
            check_jit(results, name, None, SHAPES[shape], np.float32, root=root)
        else:
            check(name, mode, None, SHAPES[shape], np.float32, root=root)


def _dtype_reds(name, dtype):
    return reductions(dtype) if CASES[name].red else ["SUM"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_dtypes(name, dtype):
    root = WORLD.size - 1
    # one program per op: every dtype and reduction
    results = jit_results(("dtypes", name), [(name, (2, 3), d, red, root) for d in DTYPES
                                             for red in _dtype_reds(name, d)], None)
    for red in _dtype_reds(name, dtype):
        check_jit(results, name, None, (2, 3), dtype, red=red, root=root)


@pytest.mark.parametrize("name", list(CASES))
def test_communicators(name, comm, request):
    # One program per communicator kind (every op and root), run in the first test of
    # that kind on its communicator; the kind's other tests assert their op's calls.
    kind = request.node.callspec.params["comm"]
    _, _, size = _comm_info(comm)
    results = jit_results(("comm", kind), [(n, (3,), np.float64, "SUM", root)
                                           for n in CASES for root in _roots(n, size)], comm)
    for root in _roots(name, size):
        check_jit(results, name, comm, (3,), np.float64, root=root)


@pytest.mark.parametrize("name", ["allreduce", "reduce", "scan", "exscan", "reduce_scatter"])
@pytest.mark.parametrize("red", ["MAX", "MIN", "PROD"])
def test_nonsum_reductions_vmap(name, red):
    check(name, "vmap", None, (4,), np.float64, red=red)


# unit roundoff (half an ulp of 1) and significand bits of each half format
HALF = {np.dtype(np.float16): (2.0**-11, 11), BF16: (2.0**-8, 8)}


def half_inputs(dtype, rank):
    """This rank's values: 7 that are not exact in the format, mixed signs, and 2 that
    make ties at 2 ranks (2**p + 1 and 2**p + 3, p significand bits, spacing 2 there)."""
    _, p = HALF[dtype]
    signs = np.where((np.arange(7) + rank) % 3 == 0, -1.0, 1.0)
    rounded = np.linspace(0.1, 2.3, 7) * (rank + 1) * signs
    ties = [2.0**p, 2.0**p + 2] if rank == 0 else [1.0, 1.0]
    return np.concatenate([rounded, ties]).astype(dtype)


@pytest.mark.parametrize("dtype", list(HALF), ids=str)
def test_half_precision_rounding(dtype):
    """float16 / bfloat16 SUM, PROD, MAX and MIN on values that are not small integers.

    Each combining step of the kernel's MPI op works in float32 and rounds the result
    to the half format (round to nearest even); MPI may combine the ranks' values in
    any order or tree. Reference: the exact result of the (already rounded) half inputs
    in float64, exact here. Float32 holds the sum of two of these values exactly (per
    element they are within a factor 2**12 of each other) and the product of any two
    half values, so each of the n - 1 steps at n ranks adds a relative error of at most
    u (the format's unit roundoff), whatever the order:
      SUM      |got - exact| <= g * sum_i |x_i|,   g = (n-1) u / (1 - (n-1) u)
      PROD     |got - exact| <= ((1 + u)**(n-1) - 1) * |exact|
      MAX/MIN  got == exact (the result is one of the inputs)
    At 2 ranks there is one rounding: SUM and PROD are the exact result rounded to
    nearest even, ties included (2**p + 1 rounds down to 2**p, 2**p + 3 up to 2**p + 4).
    """
    u, _ = HALF[dtype]
    size = WORLD.size
    x = half_inputs(dtype, WORLD.rank)
    xs = np.stack([half_inputs(dtype, r) for r in range(size)]).astype(np.float64)
    bounds = {
        "SUM": (xs.sum(0), (size - 1) * u / (1 - (size - 1) * u) * np.abs(xs).sum(0)),
        "PROD": (xs.prod(0), ((1 + u) ** (size - 1) - 1) * np.abs(xs.prod(0))),
        "MAX": (xs.max(0), np.zeros(len(x))),
        "MIN": (xs.min(0), np.zeros(len(x))),
    }
    for red, (exact, bound) in bounds.items():
        got = vjpmpi.allreduce(to_device(x), getattr(MPI, red), comm=WORLD)
        assert got.dtype == dtype
        err = np.abs(np.asarray(got, np.float64) - exact)
        assert (err <= bound).all(), (red, size, np.asarray(got), exact, err, bound)
        if size <= 2:  # at most one rounding: exactly the rounded result
            assert (exact.astype(np.float32) == exact).all()  # so float32 -> half rounds once
            assert_equal(got, exact.astype(np.float32).astype(dtype))
    if size == 2:  # the ties went to the even neighbour, one down and one up
        _, p = HALF[dtype]
        got = vjpmpi.allreduce(to_device(x), MPI.SUM, comm=WORLD)
        np.testing.assert_array_equal(np.asarray(got, np.float64)[7:], [2.0**p, 2.0**p + 4])


def test_inputs_not_mutated():
    # Shape "1d" and root 0: the eager calls reuse test_modes_shapes_roots' compiled
    # programs; the jit part is one program of every op.
    rank = WORLD.rank
    kw = {"red": "SUM", "op": MPI.SUM, "root": 0, "rank": rank, "size": WORLD.size}
    xs_np = {name: data((WORLD.size, *SHAPES["1d"]) if case.rank_axis_in(rank, kw)
                        else SHAPES["1d"], np.float32, rank)
             for name, case in CASES.items()}
    xs = {name: to_device(x_np) for name, x_np in xs_np.items()}
    for name, case in CASES.items():
        jax.block_until_ready(case.call(xs[name], None, kw))
        assert_equal(xs[name], xs_np[name])
    every_op = jax.jit(lambda d: {name: CASES[name].call(v, None, kw) for name, v in d.items()})
    jax.block_until_ready(every_op(xs))
    for name in CASES:
        assert_equal(xs[name], xs_np[name])


def test_python_scalars_and_weak_types():
    size = WORLD.size
    assert float(vjpmpi.allreduce(1.5, MPI.SUM)) == 1.5 * size
    assert int(vjpmpi.allreduce(2, MPI.MAX)) == 2
    assert vjpmpi.allgather(3.0).shape == (size,)


# A NaN on any rank gives NaN in MAX/MIN on every rank, as jnp.max/jnp.min do (MPI's
# built-in MAX/MIN keep or drop it depending on the order they combine the operands).
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
@pytest.mark.parametrize("op", ["MAX", "MIN"])
def test_nan_propagates_in_max_and_min(dtype, op):
    size, rank = WORLD.size, WORLD.rank

    def local(r):
        x = np.array([1.0, 2.0, 0.5, 3.0, -1.0], np.float64) * (r + 1)
        x[2] = np.nan if r == size - 1 else x[2]  # a NaN on the last rank
        x[3] = np.nan if r == 0 else x[3]  # and on the first
        return x.astype(dtype)

    combine = np.maximum if op == "MAX" else np.minimum  # (both propagate NaN)
    stack = np.stack([local(r).astype(np.float64) for r in range(size)])
    red = getattr(MPI, op)
    x = jax.numpy.asarray(local(rank))
    got = jax.jit(lambda x: (vjpmpi.allreduce(x, red), vjpmpi.scan(x, red),
                             vjpmpi.reduce(x, red, size - 1)))(x)
    assert_equal(got[0], combine.reduce(stack).astype(dtype))
    assert_equal(got[1], combine.accumulate(stack)[rank].astype(dtype))
    if rank == size - 1:
        assert_equal(got[2], combine.reduce(stack).astype(dtype))
    blocks = np.stack([local(rank)] * size)  # reduce_scatter: rank r gets block r reduced
    assert_equal(vjpmpi.reduce_scatter(jax.numpy.asarray(blocks), red),
                 combine.reduce(stack).astype(dtype))


# Blocks of 4 MiB and more: the in-place exchange (a power-of-two communicator) copies
# each outgoing block with non-temporal stores (StreamCopy, csrc/hugepages.cc), 64 bytes per
# step, then a tail. Block lengths here are no multiple of 16 bytes, so the loads start
# unaligned from the second block on and every copy has a tail; one program.
LARGE_BLOCKS = {"uint8": (np.uint8, (4 << 20) + 3), "float32": (np.float32, (1 << 20) + 5)}


def test_alltoall_large_blocks_exact():
    size, rank = WORLD.size, WORLD.rank
    gen = np.random.default_rng(100 + rank)
    xs = {k: gen.integers(0, 250, (size, n)).astype(dt) for k, (dt, n) in LARGE_BLOCKS.items()}
    got = jax.jit(lambda d: {k: vjpmpi.alltoall(v) for k, v in d.items()})(xs)
    for k, x in xs.items():
        want = np.empty_like(x)
        WORLD.Alltoall(x, want)
        assert_equal(got[k], want)
