"""What a program on several devices of a process may not do, and the errors it gets on
every rank (the ranks still in step afterwards): processes whose meshes differ, a
shard_map that leaves mesh axes to XLA, a second Python thread on a communicator that
another thread's device programs use; and what the CUDA backend lowers (on a machine
without a GPU: the same device calls, on one token chain).

Runs at P processes of D CPU devices each (tests/test_multirank.py, test_devices).
"""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import vjpmpi
from vjpmpi import _kernels

from helpers import WORLD

D = len(jax.devices())
PROCS, PROC = WORLD.size, WORLD.rank
# what a run's failure raises (docs/concepts/agreement.md): ValueError at the call on one
# device; jax.errors.JaxRuntimeError where a program over several devices is used
RUN_ERROR = ValueError if D == 1 else jax.errors.JaxRuntimeError
MESH = Mesh(np.array(jax.devices()), ("d",))


def in_step():
    """A collective on every rank after the error: the ranks are still in step."""
    assert float(vjpmpi.allreduce(jnp.ones(()), MPI.SUM)) == PROCS


def test_processes_whose_meshes_differ_fail_on_every_rank():
    """Process 0 names its devices' axis "d" in a mesh of one axis, the others lay the same
    devices out as a mesh of two axes: the device communicators' layouts differ (the
    processes agree on them before any data moves)."""
    if PROCS < 2:
        pytest.skip("needs two processes")
    mesh = MESH if PROC == 0 else Mesh(np.array(jax.devices()).reshape(D, 1), ("d", "e"))
    spec = P("d") if PROC == 0 else P(("d", "e"))

    def body(v):
        return vjpmpi.allreduce(v, MPI.SUM, comm=vjpmpi.device_comm("d"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    with pytest.raises(RUN_ERROR, match=r"(the ranks disagree|collective "
                                                         r"mismatch) .*layout of the "
                                                         r"process's devices"):
        np.asarray(f(jnp.ones(3 * D)))
    in_step()


def test_processes_with_other_device_counts_fail_on_every_rank():
    """Process 0 runs its program on all its devices, the others on one: the processes
    disagree on the devices' duplicates of the communicator (their number)."""
    if PROCS < 2 or D < 2:
        pytest.skip("needs two processes of two devices or more")
    devices = jax.devices() if PROC == 0 else jax.devices()[:1]
    mesh = Mesh(np.array(devices), ("d",))
    f = jax.jit(jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM) + 0 * v, mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    # (process 0's program on several devices raises when its result is used, the others'
    # on one at the call: docs/concepts/agreement.md)
    raised = jax.errors.JaxRuntimeError if len(devices) > 1 else ValueError
    with pytest.raises(raised, match=r"the ranks disagree|collective mismatch"):
        np.asarray(f(jnp.ones(len(devices) * 7)))
    in_step()


def test_a_shard_map_that_leaves_axes_to_xla_is_refused():
    if D < 2:
        pytest.skip("needs two devices")
    mesh = Mesh(np.array(jax.devices()).reshape(D, 1), ("d", "e"))
    f = jax.jit(jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM), mesh=mesh,
                              in_specs=P("e"), out_specs=P("e"), axis_names={"e"}))
    with pytest.raises(NotImplementedError, match=r"leaves mesh axes \['d'\] to XLA"):
        f.lower(jnp.ones(4))
    in_step()


def test_a_second_python_thread_on_the_communicator_is_refused():
    """XLA's device threads run a communicator's device calls; a second Python thread
    that traces a collective on a communicator the first one owns is refused there (its
    programs' devices would race with the first's)."""
    f = jax.jit(jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM, comm=vjpmpi.device_comm("d")),
                              mesh=MESH, in_specs=P("d"), out_specs=P("d")))
    np.asarray(f(jnp.ones(D)))  # (this thread owns the default communicator)
    errors = []

    def other():
        try:
            jax.jit(jax.shard_map(lambda v: vjpmpi.allreduce(v * 2, MPI.SUM), mesh=MESH,
                                  in_specs=P("d"), out_specs=P("d")))(jnp.ones(D))
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread" in errors[0], errors
    in_step()


# --------------------------------------------------------------------- CUDA --
def _targets(text):
    return sorted(set(re.findall(r"custom_call @(vjpmpi_\w+)", text)))


def _chain(text):
    return re.findall(r"custom_call @(vjpmpi_\w+)", text)


def _programs():
    def body(v):
        c = vjpmpi.device_comm("d")
        y = vjpmpi.allreduce(v, MPI.SUM, comm=c)
        y = vjpmpi.bcast(y, c.size - 1 + 0 * c.rank, comm=c)
        y = vjpmpi.sendrecv(y, y, (c.rank - 1) % c.size, (c.rank + 1) % c.size, comm=c)
        return vjpmpi.lax.psum(y, "d") + vjpmpi.allgather(v, comm=c).sum()

    f = jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d"))
    x = jnp.ones(3 * D, jnp.float32)
    xs = jax.device_put(jnp.ones((4 * D, 3), jnp.float32), NamedSharding(MESH, P("d")))
    return [("device_comm", f, x), ("grad", jax.grad(lambda v: jnp.sum(f(v) ** 2)), x),
            ("vmap", jax.vmap(f), jnp.stack([x, 2 * x])),
            ("sharded", lambda v: vjpmpi.scan(v, MPI.SUM), xs)]


@pytest.mark.skipif(_kernels.cuda is None, reason="vjpmpi was built without its CUDA backend")
def test_device_calls_lower_for_cuda():
    registered = {f"vjpmpi_{t}" for t in _kernels.cuda.registrations()}
    for label, f, x in _programs():
        traced = jax.jit(f).trace(x)
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert _chain(cuda) == _chain(cpu) and _chain(cpu), label
        # (one device: a sharded array is a one-device array, its call the process's)
        device = label != "sharded" or D > 1
        assert all(t.endswith("_dev") == device for t in _targets(cuda)), (label, _targets(cuda))
        assert set(_targets(cuda)) <= registered, (label, _targets(cuda))
        checks = [export.DisabledSafetyCheck.custom_call(t) for t in _targets(cpu)]
        exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(x)
        assert _chain(str(exp.mlir_module())) == _chain(cpu), label


@pytest.mark.skipif(_kernels.cuda is None, reason="vjpmpi was built without its CUDA backend")
def test_host_only_device_calls_are_refused_for_cuda():
    def body(v):
        c = vjpmpi.device_comm("d")
        p = vjpmpi.start(vjpmpi.sendrecv, v, v, (c.rank - 1) % c.size, (c.rank + 1) % c.size,
                         comm=c)
        return vjpmpi.wait(p)

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d")))
    with pytest.raises(NotImplementedError, match=r"runs on CPU only"):
        f.trace(jnp.ones(D)).lower(lowering_platforms=("cuda",))
