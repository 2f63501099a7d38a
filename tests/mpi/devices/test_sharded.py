"""Sharded arrays: a jax.Array split over this process's devices (or replicated), passed
to a collective in and outside jit; the process is the rank and each device moves its own
part. Values against the same call on the same array held by one device, the results'
shardings, derivatives, what XLA compiles (each device's call on its own part), a process
communicator inside shard_map, and the errors.

Runs at P processes of D CPU devices each (tests/test_multirank.py, test_devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import vjpmpi

from helpers import WORLD

D = len(jax.devices())
PROCS, PROC = WORLD.size, WORLD.rank
MESH = Mesh(np.array(jax.devices()), ("d",))
ONE = jax.devices()[0]


def value(shape, salt=0):
    g = np.random.default_rng(77 + 13 * PROC + salt)
    return g.standard_normal(shape)


def split(x, *spec):
    return jax.device_put(jnp.asarray(x), NamedSharding(MESH, P(*spec)))


def whole(x):
    return jax.device_put(jnp.asarray(x), ONE)


nxt, prv = (PROC + 1) % PROCS, (PROC - 1) % PROCS
OPS = {  # name: (op, shape of x)
    "allreduce": (lambda x: vjpmpi.allreduce(x, MPI.SUM), (4 * D, 3)),
    "allreduce_max": (lambda x: vjpmpi.allreduce(x, MPI.MAX), (4 * D, 3)),
    "bcast": (lambda x: vjpmpi.bcast(x, PROCS - 1), (2 * D, 5)),
    "reduce": (lambda x: vjpmpi.reduce(x, MPI.SUM, 0), (2 * D, 3)),
    "allgather": (vjpmpi.allgather, (2 * D, 3)),
    "gather": (lambda x: vjpmpi.gather(x, 0), (2 * D, 3)),
    "scatter": (lambda x: vjpmpi.scatter(x, 0), (PROCS, 2 * D, 3)),
    "alltoall": (vjpmpi.alltoall, (PROCS, 2 * D, 3)),
    "reduce_scatter": (lambda x: vjpmpi.reduce_scatter(x, MPI.SUM), (PROCS, 2 * D, 3)),
    "scan": (lambda x: vjpmpi.scan(x, MPI.SUM), (2 * D, 3)),
    "exscan": (lambda x: vjpmpi.exscan(x, MPI.PROD), (2 * D, 3)),
    "sendrecv": (lambda x: vjpmpi.sendrecv(x, x, prv, nxt), (2 * D, 3)),
    "allgatherv": (lambda x: vjpmpi.allgatherv(x, 2 + PROC % 2, capacity=3 * PROCS)[0],
                   (3, 2 * D)),
}


def _shape(name):
    op, shape = OPS[name]
    if name == "scatter" and PROC != 0:
        return shape[1:]
    return shape


RANK_AXIS = {"scatter": PROC == 0, "alltoall": True, "reduce_scatter": True}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_sharded_array_gives_the_one_device_value(name, how):
    """Split along each axis of the per-rank block (the same on every process: the rank
    axis, where this rank's input has one, whole), along the rank axis, and replicated."""
    op, _ = OPS[name]
    x = value(_shape(name))
    want = np.asarray(op(whole(x)))
    f = op if how == "eager" else jax.jit(op)
    lead = (None,) if RANK_AXIS.get(name, False) else ()
    block = x.shape[len(lead):]
    for spec in [("d",), (None, "d"), (), ("rank",)]:
        if spec == ("rank",):  # (the rank axis split: taken apart along the block instead,
            # as an array without one split along the block's first axis)
            if name not in RANK_AXIS:
                continue
            if PROCS % D or block[0] % D:  # (the same on every rank: x's rank axis is PROCS)
                continue
            spec, lead_spec = ((), ("d",)) if lead else (("d",), ())
        else:
            if len(spec) > len(block) or (spec and block[len(spec) - 1] % D):
                continue
            lead_spec = lead
        got = f(split(x, *lead_spec, *spec))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{name} {how} {spec}")


def test_an_elementwise_collective_keeps_the_sharding():
    for spec in [("d",), (None, "d"), ()]:
        x = split(value((2 * D, 2 * D)), *spec)
        for op in (lambda v: vjpmpi.allreduce(v, MPI.SUM), lambda v: vjpmpi.bcast(v, 0),
                   lambda v: vjpmpi.scan(v, MPI.SUM), lambda v: vjpmpi.sendrecv(v, v, prv, nxt)):
            assert op(x).sharding.is_equivalent_to(x.sharding, 2), spec
    g = vjpmpi.allgather(split(value((2 * D, 3)), "d"))
    assert g.sharding.is_equivalent_to(NamedSharding(MESH, P(None, "d")), 3)


def test_each_device_moves_its_own_part():
    """What XLA compiles for a jit of a split array: one device call per device, on its
    part (the operand's per-device shape), and no gather of the array before it."""
    x = split(value((4 * D, 3)), "d")
    hlo = jax.jit(lambda v: vjpmpi.allreduce(v * 2, MPI.SUM)).lower(x).compile().as_text()
    target = "vjpmpi_allreduce_dev" if D > 1 else "vjpmpi_allreduce"  # (one device: the process's)
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]
    assert len(calls) == 1, hlo
    assert f"f64[4,3]" in calls[0], calls[0]  # each device's part: 4 of the 4 * D rows
    assert "all-gather" not in hlo and "all-reduce" not in hlo


def test_derivatives_of_a_sharded_array():
    x = split(value((4 * D, 3)), "d")

    def loss(v):
        y = vjpmpi.allreduce(jnp.sin(v), MPI.SUM)
        z = vjpmpi.sendrecv(y * v, y, prv, nxt)
        return jnp.sum(z ** 2)

    g = jax.jit(jax.grad(loss))(x)
    want = jax.jit(jax.grad(loss))(whole(np.asarray(x)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-12)
    v = jax.vmap(lambda u: vjpmpi.allreduce(u, MPI.SUM))(x)
    np.testing.assert_allclose(np.asarray(v), np.asarray(
        jax.vmap(lambda u: vjpmpi.allreduce(u, MPI.SUM))(whole(np.asarray(x)))))


def test_arrays_typed_by_their_split():
    """Arrays on a mesh of explicit axes (`jax.make_mesh`'s default: the split is part of
    the type): in jit, values and derivatives against one device, the results typed as
    JAX's rules say (a rank axis in front unsplit), over one mesh axis and two."""
    from jax.sharding import AxisType
    shapes = [((D,), ("e",))] + ([((2, D // 2), ("e", "f"))] if D % 2 == 0 and D > 2 else [])
    for dims, names in shapes:
        mesh = jax.make_mesh(dims, names, axis_types=(AxisType.Explicit,) * len(dims))
        x = value((PROCS, 2 * D * PROCS, 2 * D), salt=5)
        for spec in [P(None, names[0]), P(None, None, names), P(None, *names), P()]:
            xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
            ops = {
                "allreduce": lambda v: vjpmpi.allreduce(v * 2, MPI.SUM),
                "allgather": lambda v: vjpmpi.allgather(v[0]),
                "reduce_scatter": lambda v: vjpmpi.reduce_scatter(v, MPI.SUM),
                "sendrecv": lambda v: vjpmpi.sendrecv(v, v, prv, nxt),
                "alltoallv": lambda v: vjpmpi.alltoallv(
                    v[0], jnp.full((PROCS,), 1), capacity=PROCS)[0],
            }
            for name, op in ops.items():
                got = jax.jit(op)(xs)
                np.testing.assert_allclose(np.asarray(got), np.asarray(op(whole(x))),
                                           rtol=1e-12, err_msg=f"{name} {spec}")
                typed = NamedSharding(mesh, jax.typeof(got).sharding.spec)
                assert got.sharding.is_equivalent_to(typed, got.ndim), (name, spec)
            loss = lambda v: jnp.sum(jnp.sin(vjpmpi.reduce_scatter(vjpmpi.alltoall(v),  # noqa: E731
                                                                   MPI.SUM)) ** 2)
            with jax.set_mesh(mesh):
                g = jax.jit(jax.grad(loss))(xs)
            np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(loss)(whole(x))),
                                       rtol=1e-12, err_msg=f"grad {spec}")
        allgathered = jax.jit(lambda v: vjpmpi.allgather(v))(
            jax.device_put(jnp.asarray(x[0]), NamedSharding(mesh, P(names[0]))))
        assert tuple(jax.typeof(allgathered).sharding.spec) == (None, names[0], None)


def test_a_process_communicator_inside_shard_map():
    """Inside shard_map a process communicator's call is each device's own: device i of
    every process exchanges with device i of the others (its shard)."""
    f = jax.jit(jax.shard_map(lambda v: vjpmpi.allreduce(v, MPI.SUM) + 0 * v, mesh=MESH,
                              in_specs=P("d"), out_specs=P("d")))
    x = jnp.arange(2.0 * D) + 10 * PROC
    want = sum(np.arange(2.0 * D) + 10 * p for p in range(PROCS))
    np.testing.assert_allclose(np.asarray(f(x)), want)
    # under grad with JAX's check_vma (the transpose's cotangent carries the typing)
    g = jax.jit(jax.grad(lambda v: jnp.sum(f(v) ** 2)))(x)
    np.testing.assert_allclose(np.asarray(g), 2 * PROCS * want)


def test_processes_that_split_differently_fail_on_every_rank():
    """Process 0 splits its array along the rows, the others along the columns: the
    processes' programs differ in their layout, an error on every rank (not a wrong sum
    of unrelated parts). (A program's first run: the ranks compare every collective of a
    run they have not yet verified together, VJPMPI_CHECK=1 every run.)"""
    if PROCS < 2 or D < 2:
        pytest.skip("needs two processes of two devices or more")
    spec = ("d",) if PROC == 0 else (None, "d")
    x = split(value((2 * D, 2 * D + 2 * D)), *spec)
    with pytest.raises(Exception, match=r"the ranks disagree|differ"):
        np.asarray(vjpmpi.allreduce(x, MPI.SUM))
    assert float(vjpmpi.allreduce(jnp.ones(()), MPI.SUM)) == PROCS  # (still in step)
