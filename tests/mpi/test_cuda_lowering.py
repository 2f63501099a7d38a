"""The CUDA backend's lowering, checked on a machine without a GPU.

Every collective, its gradient and a vmapped call are lowered for CUDA
(`lowering_platforms=("cuda",)`) and exported with `jax.export` for CUDA; the
CUDA module must call the same vjpmpi custom-call targets as the CPU module of
the same program, in the same order, on one token chain, and each target must
be one the CUDA backend registers. (Running them needs a GPU: tests/gpu/run_on_gpu.sh.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from mpi4py import MPI

import vjpmpi
from vjpmpi import _kernels, _sync

from helpers import WORLD
from test_api import assert_chain, chain

rank, size = WORLD.rank, WORLD.size
nxt, prv = (rank + 1) % size, (rank - 1) % size

pytestmark = pytest.mark.skipif(_kernels.cuda is None,
                                reason="vjpmpi was built without its CUDA backend")


def _send(v):
    vjpmpi.send(v, nxt, tag=3)
    return v * 2.0


# name -> (function, local input shape)
OPS = {
    "allreduce": (lambda v: vjpmpi.allreduce(v, MPI.SUM), (4, 3)),
    "allreduce_max": (lambda v: vjpmpi.allreduce(v, MPI.MAX), (4, 3)),
    # their derivatives: exscan from the last rank down, the linear recurrence
    "allreduce_prod": (lambda v: vjpmpi.allreduce(v, MPI.PROD), (4, 3)),
    "scan_max": (lambda v: vjpmpi.scan(v, MPI.MAX), (4, 3)),
    "reduce": (lambda v: vjpmpi.reduce(v, MPI.SUM, 0), (4, 3)),
    "bcast": (lambda v: vjpmpi.bcast(v, size - 1), (4, 3)),
    "allgather": (vjpmpi.allgather, (4, 3)),
    "gather": (lambda v: vjpmpi.gather(v, 0), (4, 3)),
    "scatter": (lambda v: vjpmpi.scatter(v, 0), (size, 3) if rank == 0 else (3,)),
    "alltoall": (vjpmpi.alltoall, (size, 3)),
    "reduce_scatter": (lambda v: vjpmpi.reduce_scatter(v, MPI.SUM), (size, 3)),
    "scan": (lambda v: vjpmpi.scan(v, MPI.SUM), (4, 3)),
    "exscan": (lambda v: vjpmpi.exscan(v, MPI.SUM), (4, 3)),
    "send": (_send, (4, 3)),
    "recv": (lambda v: vjpmpi.recv(v, prv, tag=3), (4, 3)),
    "sendrecv": (lambda v: vjpmpi.sendrecv(v, v, prv, nxt), (4, 3)),
    "barrier": (lambda v: (vjpmpi.barrier(), v + 1.0)[1], (4, 3)),
    "sum_replicated": (vjpmpi.sum_replicated, (4, 3)),
    "use_replicated": (lambda v: vjpmpi.use_replicated(v) * 2.0, (4, 3)),
    # private: vjpmpi.nn's pipeline holds values with it
    "hold": (lambda v: _sync.hold(v * 2.0, None), (4, 3)),
}


def programs(name):
    """(label, function, input) for the op, its gradient and a vmapped call."""
    f, shape = OPS[name]
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(shape), jnp.float32)
    loss = lambda v: jnp.sum(f(v) ** 2)  # noqa: E731
    return [("forward", f, x), ("grad", jax.grad(loss), x),
            ("vmap", jax.vmap(f), jnp.stack([x, 2 * x, 3 * x]))]


def targets(text):
    return sorted(set(re.findall(r"stablehlo\.custom_call @(vjpmpi_\w+)", text)))


def unchecked(text):
    return [export.DisabledSafetyCheck.custom_call(t) for t in targets(text)]


@pytest.mark.parametrize("name", list(OPS))
def test_cuda_lowering_matches_cpu(name):
    registered = {f"vjpmpi_{t}" for t in _kernels.cuda.registrations()}
    for label, f, x in programs(name):
        traced = jax.jit(f).trace(x)
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
        ops = [c[0] for c in chain(cpu)]
        assert [c[0] for c in chain(cuda)] == ops, label
        assert set(targets(cuda)) <= registered, (label, targets(cuda))
        if ops:
            assert_chain(cuda, ops)
            assert "has_side_effect = true" in cuda
        # use_replicated runs no collective forward (its transpose does)
        assert ops or (name == "use_replicated" and label != "grad"), (name, label)


@pytest.mark.parametrize("name", list(OPS))
def test_cuda_export(name):
    for label, f, x in programs(name):
        cpu = jax.jit(f).trace(x).lower(lowering_platforms=("cpu",)).as_text()
        exp = export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=unchecked(cpu))(x)
        assert exp.platforms == ("cuda",)
        text = exp.mlir_module()
        ops = [c[0] for c in chain(cpu)]
        assert [c[0] for c in chain(text)] == ops, label
        if ops:
            assert_chain(text, ops)
        # no token crosses the program's boundary: the exported function takes and
        # returns only the user's arrays
        assert len(exp.in_avals) == 1 and not exp.ordered_effects


def test_loop_and_branch_chain_in_the_cuda_module():
    def f(x):
        a = vjpmpi.allgather(x)
        c = jax.lax.fori_loop(0, 2, lambda i, v: vjpmpi.allreduce(v, MPI.MAX), x)
        d = jax.lax.cond(x[0] > 0, lambda v: vjpmpi.bcast(v, 0), lambda v: v, x)
        return a, c, d, vjpmpi.allreduce(x, MPI.SUM)

    text = jax.jit(f).trace(jnp.ones(3)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.create_token") == 1
    loop = re.search(r"(%\w+):\d+ = stablehlo\.while\(%iterArg = ([%\w#]+)", text)
    calls = chain(text)
    assert calls[0][0] == "allgather" and loop.group(2) == calls[0][2]
    # the cond takes the loop's token, the final allreduce the cond's
    case = re.search(rf"(%\w+):\d+ = \"stablehlo\.case\"|(%\w+):\d+ = stablehlo\.if", text)
    assert case is not None
    final = [c for c in calls if c[0] == "allreduce" and c[1].startswith(case.group(1) or
                                                                        case.group(2))]
    assert final, text


def test_multi_platform_lowering():
    f = jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, c: vjpmpi.allreduce(c, MPI.SUM), v))
    text = f.trace(jnp.ones(3)).lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert targets(text) == ["vjpmpi_allreduce"]


@pytest.mark.parametrize("platform,name", [("rocm", "ROCm"), ("tpu", "TPU")])
def test_other_backends_are_a_clear_error(platform, name):
    f = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
    with pytest.raises(NotImplementedError, match=rf"vjpmpi\.allreduce: vjpmpi has no {name} "
                                                   r"backend \(it has CPU and CUDA ones\)"):
        f.trace(jnp.ones(3)).lower(lowering_platforms=(platform,))
