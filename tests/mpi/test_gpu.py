"""The CUDA backend, on each rank's GPU (skipped where JAX has no GPU).

Run with `JAX_PLATFORMS=cuda,cpu` (see tests/gpu/run_on_gpu.sh); under the CPU-only
suite every test here is skipped with the reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size

try:
    HAVE_GPU = bool(jax.devices("gpu"))
except RuntimeError:
    HAVE_GPU = False

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="JAX has no GPU backend here")


@pytest.fixture(scope="module")
def gpu():
    assert vjpmpi.cuda_mode() in ("host-staged", "cuda-aware"), "CUDA backend not built"
    return vjpmpi.local_device("gpu")


def per_rank(shape, r, dtype=np.float64):
    return (np.arange(np.prod(shape)).reshape(shape) % 7 + 10 * r).astype(dtype)


def on(dev, x):
    return jax.device_put(jnp.asarray(x), dev)


def test_results_stay_on_the_gpu_and_match_numpy(gpu):
    xs = [per_rank((SIZE, 5), r) for r in range(SIZE)]
    x = on(gpu, xs[RANK])
    cases = {
        "allreduce": (lambda v: vjpmpi.allreduce(v, MPI.SUM), sum(xs)),
        "max": (lambda v: vjpmpi.allreduce(v, MPI.MAX), np.max(xs, axis=0)),
        "bcast": (lambda v: vjpmpi.bcast(v, SIZE - 1), xs[-1]),
        "allgather": (lambda v: vjpmpi.allgather(v), np.stack(xs)),
        "alltoall": (lambda v: vjpmpi.alltoall(v), np.stack([xs[r][RANK] for r in range(SIZE)])),
        "reduce_scatter": (lambda v: vjpmpi.reduce_scatter(v, MPI.SUM), sum(xs)[RANK]),
        "scan": (lambda v: vjpmpi.scan(v, MPI.SUM), sum(xs[: RANK + 1])),
        "exscan": (lambda v: vjpmpi.exscan(v, MPI.SUM), sum(xs[:RANK], np.zeros_like(xs[0]))),
        "sendrecv": (lambda v: vjpmpi.sendrecv(v, v, (RANK - 1) % SIZE, (RANK + 1) % SIZE),
                     xs[(RANK - 1) % SIZE]),
    }
    for name, (f, expected) in cases.items():
        for mode in ("eager", "jit"):
            y = (jax.jit(f) if mode == "jit" else f)(x)
            assert y.devices() == {gpu}, (name, mode, y.devices())
            np.testing.assert_array_equal(np.asarray(y), expected, err_msg=f"{name} {mode}")


def test_kernel_output_right_before_and_after_the_collective(gpu):
    """A large array written by a GPU kernel just before the collective, and read
    by another just after, in a jitted loop: exact (stale reads would show)."""
    n = 1 << 24  # 64 MiB of int32

    def body(i, c):
        c = c * 3 + i  # a GPU kernel writes the input ...
        c = vjpmpi.allreduce(c, MPI.SUM)  # ... the collective reads it at once ...
        return c % 1000 - 7  # ... and a kernel reads its output at once

    f = jax.jit(lambda v: jax.lax.fori_loop(0, 12, body, v))
    inputs = [np.arange(n, dtype=np.int64) % 1000 + r for r in range(SIZE)]
    cs = inputs
    for i in range(12):  # NumPy reference: every rank's input is known here
        total = sum(c * 3 + i for c in cs) % 1000 - 7
        cs = [total] * SIZE
    x0 = inputs[RANK].astype(np.int32)
    for _ in range(3):
        got = np.asarray(f(on(gpu, x0)))
        np.testing.assert_array_equal(got, cs[0].astype(np.int32))


def test_gradient_on_the_gpu(gpu):
    x = on(gpu, per_rank((4,), RANK))
    g = jax.jit(jax.grad(lambda v: jnp.sum(vjpmpi.allreduce(v, MPI.SUM) ** 2)))(x)
    total = sum(per_rank((4,), r) for r in range(SIZE))
    np.testing.assert_allclose(np.asarray(g), 2 * SIZE * total)
    assert g.devices() == {gpu}


def test_half_precision_reduction_on_the_gpu(gpu):
    x = on(gpu, per_rank((8,), RANK, np.float32)).astype(jnp.bfloat16)
    y = vjpmpi.allreduce(x, MPI.SUM)
    expected = sum(per_rank((8,), r, np.float32) for r in range(SIZE))
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=1e-2)
