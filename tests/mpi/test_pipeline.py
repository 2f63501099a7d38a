"""vjpmpi.nn pipeline parallelism: schedules as tables (validity, bubble, stored
activations), and `pipeline_value_and_grad` against the same model on one process:
loss and every parameter gradient (float64, 1e-12), for GPipe and 1F1B, micro-batch
counts below and above the stage count, stages of different depths and boundary
shapes, dropout keys; 10 SGD steps; the messages each rank runs against the table
(VJPMPI_TRACE); what XLA compiles holding a bounded number of micro-batches under 1F1B;
bad arguments failing on every rank; and pipeline x data parallelism (allreduce_gradients
and sharded_optimizer) and pipeline x tensor parallelism at 4 ranks (the 3-D grid:
test_pipeline_grid.py, at 8)."""

import functools
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn as vnn

from helpers import WORLD, PerSample, assert_trees_close
from hlo_order import _ancestors, parse

rank, size = WORLD.rank, WORLD.size
SCHEDULES = {"gpipe": vnn.gpipe, "1f1b": vnn.one_f_one_b}
WIDTHS = (3, 5, 4, 6, 2)  # boundary s -> s + 1 carries WIDTHS[s + 1] features
# At 3 and 4 ranks (oversubscribed, every stage compiles programs of its own) the
# cases run are fewer micro-batches than stages under GPipe and more under 1F1B; all
# of them run at 2 ranks.
AT_WIDE = {("gpipe", -1), ("1f1b", 3)}
WIDE_SKIP = "at 2 ranks only (each stage compiles its own programs: 3 or 4 on 2 cores)"


class Block(eqx.Module):
    """A stage: rank-dependent depth (stage s has s % 2 + 1 layers), dropout."""

    layers: tuple
    drop: eqx.nn.Dropout

    def __init__(self, s, key):
        keys = jax.random.split(key, 2)
        first = eqx.nn.Linear(WIDTHS[s], WIDTHS[s + 1], key=keys[0], dtype=jnp.float64)
        more = [eqx.nn.Linear(WIDTHS[s + 1], WIDTHS[s + 1], key=keys[1], dtype=jnp.float64)]
        self.layers = (first, *more[: s % 2])
        self.drop = eqx.nn.Dropout(0.25)

    def __call__(self, x, *, key=None):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return self.drop(x, key=key, inference=key is None)


def model(p):
    return [Block(s, k) for s, k in enumerate(jax.random.split(jax.random.PRNGKey(7), p))]


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def data(p, m, batch=3):
    r = np.random.default_rng(11)
    return (jnp.asarray(r.standard_normal((m, batch, WIDTHS[0]))),
            jnp.asarray(r.standard_normal((m, batch, WIDTHS[p]))))


@eqx.filter_jit
def one_process(stages, x, t, key):
    """The whole model on this process: mean over micro-batches, the same keys."""
    def total(stages):
        losses = []
        for i in range(x.shape[0]):
            h = x[i]
            for st in stages:
                h = st(h, key=None if key is None else jax.random.fold_in(key, i))
            losses.append(loss_fn(h, t[i]))
        return sum(losses) / len(losses)
    return eqx.filter_value_and_grad(total)(stages)


def boundaries(p, batch=3):
    return [jax.ShapeDtypeStruct((batch, WIDTHS[s + 1]), jnp.float64) for s in range(p - 1)]


@functools.cache
def pipelined(schedule):
    """The jitted pipeline of `schedule` (one compile per schedule and argument shapes)."""
    return eqx.filter_jit(lambda st, x, t, key: vnn.pipeline_value_and_grad(
        st, loss_fn, x, t, schedule=schedule, activation=boundaries(schedule.stages),
        key=key))


def run(schedule, stage, x, t, key, p):
    return pipelined(schedule)(stage, x if rank == 0 else None,
                               t if rank == p - 1 else None, key)


# ------------------------------------------------------------------- tables --
@pytest.mark.parametrize("name", SCHEDULES)
def test_tables_bubble_and_stored_activations(name):
    for p in range(1, 9):
        for m in range(1, 11):
            sch = SCHEDULES[name](p, m)
            assert sch.steps == 2 * (m + p - 1), (p, m)
            assert sch.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)
            stored = [sch.stored(s) for s in range(p)]
            assert stored == ([m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)])
            assert vnn.Schedule(p, m, sch.rows) == sch  # (the table alone rebuilds it)
    assert str(vnn.one_f_one_b(2, 2)).splitlines()[2:] == [
        "| stage 0 | F0 | F1 |  | B0 |  | B1 |", "| stage 1 |  | F0 | B0 | F1 | B1 |  |"]


def test_bad_tables_are_named_errors():
    rows = list(vnn.gpipe(2, 2).rows)
    with pytest.raises(ValueError, match="B0 on stage 0 at step 3 needs B0 of stage 1"):
        vnn.Schedule(2, 2, [r._replace(step=3) if r[1:] == (0, 0, "B") else
                            r._replace(step=4) if r[1:] == (1, 0, "B") else r for r in rows])
    with pytest.raises(ValueError, match="missing"):
        vnn.Schedule(2, 2, rows[:-1])
    with pytest.raises(ValueError, match="two slots at step 0"):
        vnn.Schedule(2, 2, rows + [vnn.Slot(0, 0, 1, "F")])
    with pytest.raises(ValueError, match="wait for each other"):
        vnn.from_orders(2, 1, [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


# -------------------------------------------------------- against one rank --
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("extra", [-1, 3])  # micro-batches: size - 1 (at least 1), size + 3
def test_equals_one_process(name, extra):
    if size >= 3 and (name, extra) not in AT_WIDE:
        pytest.skip(WIDE_SKIP)
    p, m = size, max(1, size + extra)
    stages = model(p)
    x, t = data(p, m)
    key = jax.random.PRNGKey(3)
    want_loss, want = one_process(stages, x, t, key)
    loss, grads = run(SCHEDULES[name](p, m), stages[rank], x, t, key, p)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-12)
    assert_trees_close(grads, want[rank], rtol=1e-12, atol=1e-14)
    # (dropout on: a key not folded per micro-batch, or none, would differ)
    assert not np.isclose(float(one_process(stages, x, t, None)[0]), float(want_loss))


def test_ten_sgd_steps_equal_one_process():
    p, m = size, size + 3  # (the programs of test_equals_one_process[3-1f1b])
    stages = model(p)
    x, t = data(p, m)
    sch = vnn.one_f_one_b(p, m)
    mine = stages[rank]
    for step in range(10):
        key = jax.random.PRNGKey(step)
        _, g = run(sch, mine, x, t, key, p)
        _, want = one_process(stages, x, t, key)
        mine = eqx.apply_updates(mine, jax.tree_util.tree_map(lambda d: -0.5 * d, g))
        stages = [eqx.apply_updates(st, jax.tree_util.tree_map(lambda d: -0.5 * d, w))
                  for st, w in zip(stages, want, strict=True)]
    assert_trees_close(eqx.filter(mine, eqx.is_array), eqx.filter(stages[rank], eqx.is_array),
                       rtol=1e-12, atol=1e-14)


def test_checkpointed_stage_is_exact():
    if size >= 3:
        pytest.skip(WIDE_SKIP)
    p, m = size, 2
    stages = model(p)
    x, t = data(p, m)
    want_loss, want = one_process(stages, x, t, None)

    class Checkpointed(eqx.Module):
        inner: Block

        def __call__(self, x):
            return eqx.filter_checkpoint(lambda b, x: b(x))(self.inner, x)

    loss, grads = run(vnn.one_f_one_b(p, m), Checkpointed(stages[rank]), x, t, None, p)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-12)
    assert_trees_close(grads.inner, want[rank], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------ messages and memory --
def expected_calls(sch, s):
    """The kernel calls stage `s` runs for `sch`, from the table alone: per step it
    takes part in, the activation message (sendrecv when it both sends and receives at
    once) and the cotangent message; the agreement first and the loss's bcast last
    (neither on one rank). The pipeline's holds (each step's clock, the loss and the
    cotangent held on the last stage, the gradient leaves after a backward pass) call
    no MPI and are not in the trace."""
    calls = ["agree"] if sch.stages > 1 else []
    for row in sch.grid():
        mine = row[s]
        left = row[s - 1] if s > 0 else None
        right = row[s + 1] if s + 1 < sch.stages else None
        send_f = mine is not None and mine.kind == "F" and s + 1 < sch.stages
        send_b = mine is not None and mine.kind == "B" and s > 0
        recv_f = left is not None and left.kind == "F"
        recv_b = right is not None and right.kind == "B"
        for out, inc in ((send_f, recv_f), (send_b, recv_b)):
            calls += (["sendrecv"] if out and inc else ["send"] if out else
                      ["recv"] if inc else [])
    return calls + (["bcast"] if sch.stages > 1 else [])


def _backward_fusions(text):
    """The entry computation's instructions, and those whose computation runs a matmul
    of a backward pass (XLA's op_name: `transpose(jvp(...))`)."""
    comps, entry = parse(text)
    backward, current = set(), None
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
        elif current and " dot(" in line and "transpose(" in line:
            backward.add(current)
    instrs = comps[entry]
    return instrs, [i for i in instrs if i.name in backward or set(i.called) & backward]


@pytest.mark.skipif(size != 2, reason="2 stages: the last one's forward steps all come "
                    "before its backward steps (GPipe)")
def test_last_stage_runs_each_backward_pass_in_its_step():
    """The last stage makes each micro-batch's cotangent in its forward step (from the
    loss), yet runs the backward pass in the table's backward step: under GPipe every
    backward matmul there depends on the last receive of the forward steps. (XLA ran
    them right after each forward pass: the last stage's forward steps then took both
    passes while the first stage waited, and 2 stages took twice their work.)"""
    m, width, batch = 3, 64, 32  # (matmuls large enough to stay matmuls)
    stage = Dense(tuple(eqx.nn.Linear(width, width, key=k, dtype=jnp.float32)
                        for k in jax.random.split(jax.random.PRNGKey(rank), 2)))
    xs = jnp.zeros((m, batch, width), jnp.float32)
    sch = vnn.gpipe(2, m)
    text = jax.jit(lambda st, x: vnn.pipeline_value_and_grad(
        st, loss_fn, x, x, schedule=sch,
        activation=jax.ShapeDtypeStruct((batch, width), jnp.float32))).lower(
            stage, xs).compile().as_text()
    instrs, backward = _backward_fusions(text)
    anc = _ancestors(instrs)
    recvs = [i.name for i in instrs if i.target == "vjpmpi_recv"]
    if rank == 1:
        assert len(recvs) == m and backward
        late = [b.name for b in backward if recvs[-1] in anc(b.name)]
        assert late == [b.name for b in backward], [b.name for b in backward]


@pytest.mark.skipif(os.environ.get("VJPMPI_TRACE") != "1", reason="needs VJPMPI_TRACE=1")
@pytest.mark.parametrize("name", SCHEDULES)
def test_messages_follow_the_table(name):
    if size >= 3 and name == "gpipe":
        pytest.skip(WIDE_SKIP)
    p, m = size, size + 3  # (with a key: the programs of test_equals_one_process[3-...])
    stages = model(p)
    x, t = data(p, m)
    sch = SCHEDULES[name](p, m)
    key = jax.random.PRNGKey(3)
    jax.block_until_ready(run(sch, stages[rank], x, t, key, p))  # (compiled: one run)
    vjpmpi.take_trace()
    jax.block_until_ready(run(sch, stages[rank], x, t, key, p))
    assert vjpmpi.take_trace() == expected_calls(sch, rank)
    # (the check tells the two tables apart)
    assert p == 1 or any(expected_calls(vnn.gpipe(p, m), s) != expected_calls(
        vnn.one_f_one_b(p, m), s) for s in range(p))


def test_hold_is_an_ordered_identity_without_mpi():
    """The pipeline's hold (vjpmpi's private identity): the same bits as the program
    without it, forward, reverse and under vmap (the batch on axis 0 on even ranks, 1 on
    odd ones); in what XLA compiles a custom call on the collectives' one chain, in
    place (its result aliases its operand); at run time no MPI call (no trace entry, no
    kernel call counted) and never asynchronous (threshold 0)."""
    from vjpmpi import _kernels, _sync
    from hlo_order import assert_ordered

    x = np.random.default_rng(rank).standard_normal((5, 4))  # (rank-dependent)

    def program(held):
        def f(v):
            a = vjpmpi.allreduce(v * (rank + 1.0), MPI.SUM)
            h = jnp.sin(a)
            h = _sync.hold(h, None) if held else h
            return vjpmpi.bcast(h * a, size - 1) + h
        return f

    def results(f):
        y, pull = jax.vjp(f, x)
        axis = rank % 2
        yb = jax.vmap(f, in_axes=axis)(np.stack([x, 2 * x, -x], axis=axis))
        return [np.asarray(v) for v in (y, pull(np.cos(y))[0], yb)]

    held, plain = results(jax.jit(program(True))), results(jax.jit(program(False)))
    for a, b in zip(held, plain, strict=True):
        assert a.tobytes() == b.tobytes()
    text = jax.jit(program(True)).lower(x).compile().as_text()
    holds = [ln for ln in text.splitlines() if 'custom_call_target="vjpmpi_hold"' in ln]
    assert len(holds) == 1 and "output_to_operand_aliasing={{0}: (0, {})}" in holds[0], holds
    assert_ordered(text)
    step = jax.jit(program(True))
    jax.block_until_ready(step(x))
    tracing = os.environ.get("VJPMPI_TRACE") == "1"
    if tracing:
        vjpmpi.take_trace()
    calls, async_calls = _kernels.call_counts()[0], _kernels.cpu._async_calls()
    with vjpmpi.async_threshold(0):
        jax.block_until_ready(step(x))
    assert _kernels.call_counts()[0] - calls == 2  # (allreduce, bcast)
    assert _kernels.cpu._async_calls() - async_calls == 2
    if tracing:
        assert vjpmpi.take_trace() == ["allreduce", "bcast"]


class Dense(eqx.Module):
    layers: tuple

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return x


@pytest.mark.skipif(size != 2, reason="at 2 stages only (each stage compiles 4 programs)")
def test_compiled_memory_bounded_under_1f1b():
    """XLA's temporary memory on each stage: under 1F1B about the same for 4 and 12
    micro-batches (at most `size` held), under GPipe it grows with them."""
    width, batch = 64, 32
    act = width * batch * 4
    params, static = eqx.partition(Dense(tuple(
        eqx.nn.Linear(width, width, key=k, dtype=jnp.float32)
        for k in jax.random.split(jax.random.PRNGKey(rank), 3))),
        eqx.is_array)

    def temp(schedule, m):
        xs = jnp.zeros((m, batch, width), jnp.float32)
        f = jax.jit(lambda pr, xs: vnn.pipeline_value_and_grad(
            eqx.combine(pr, static), loss_fn, xs, xs, schedule=schedule(size, m),
            activation=jax.ShapeDtypeStruct((batch, width), jnp.float32)))
        return f.lower(params, xs).compile().memory_analysis().temp_size_in_bytes / act

    ofb = [temp(vnn.one_f_one_b, m) for m in (4, 12)]
    gp = [temp(vnn.gpipe, m) for m in (4, 12)]
    # 8 more micro-batches: under GPipe at least one more activation held for each,
    # under 1F1B less than half of one each (what grows: each step's small buffers, the
    # scalar clock and the calls' results, 64-byte aligned)
    assert ofb[1] < ofb[0] + 4, ofb
    assert gp[1] >= gp[0] + 8, gp


# ------------------------------------------------------------ bad arguments --
@pytest.mark.skipif(size < 2, reason="needs a first and a last stage on different ranks")
def test_wrong_micro_batch_count_fails_on_every_rank():
    """Stage 0 alone reads `inputs`, which has p + 1 micro-batches, not the schedule's 2:
    every rank raises. (Batches of 7 rows: programs no other test runs, so that every
    rank compares its first run with the others' and hears of stage 0's error. A rank that
    ran its program before is inside the collective and cannot be told: vjpmpi then ends
    the job, as it did here at 3 ranks on the batches of 3 an earlier test ran.)"""
    p, batch = size, 7
    stages = model(p)
    x, t = data(p, p + 1, batch)
    f = eqx.filter_jit(lambda st, x, t: vnn.pipeline_value_and_grad(
        st, loss_fn, x, t, schedule=vnn.gpipe(p, 2), activation=boundaries(p, batch)))
    with pytest.raises(Exception, match="must have 2 micro-batches"):
        jax.block_until_ready(f(stages[rank], x if rank == 0 else None,
                                t[:2] if rank == p - 1 else None))


@pytest.mark.skipif(size < 2, reason="needs a boundary between ranks")
def test_ranks_disagreeing_on_an_activation_fail_on_every_rank():
    """The last stage expects a larger activation than its sender sends (a stage and a
    loss that accept any shape, so no local check sees it): an error on every rank."""
    p, m = size, 2
    mine = (3, 3) if rank < p - 1 else (4, 3)
    x = jnp.ones((m, 3, 3))
    f = jax.jit(lambda x: vnn.pipeline_value_and_grad(
        eqx.nn.Lambda(jnp.tanh), lambda y, t: jnp.mean(y ** 2) + 0 * jnp.mean(t), x, x,
        schedule=vnn.gpipe(p, m), activation=jax.ShapeDtypeStruct(mine, jnp.float64)))
    with pytest.raises(Exception, match=r"(disagree|mismatch)(.|\n)*float64\[4, 3\]"):
        jax.block_until_ready(f(x))


def test_schedule_for_another_size_fails():
    with pytest.raises(Exception, match=f"{size + 1} stages for {size} ranks"):
        jax.block_until_ready(run(vnn.gpipe(size + 1, 2), model(size)[rank], *data(size, 2),
                                  None, size))


# ---------------------------------------------------- pipeline x data, 4 ranks --
@pytest.mark.skipif(size != 4, reason="2 stages x 2 data-parallel groups")
def test_pipeline_times_data_parallel():
    stage_comm = WORLD.Split(rank % 2, rank)  # two pipelines: ranks (0, 2) and (1, 3)
    data_comm = WORLD.Split(rank // 2, rank)  # each stage's data group: (0, 1), (2, 3)
    s, d, m = stage_comm.rank, rank % 2, 3
    stages = model(2)
    xs, ts = zip(*[data(2, m) for _ in range(2)])
    xs = [x + g for g, x in enumerate(xs)]  # each data group its own batch
    f = eqx.filter_jit(lambda st, x, t: vnn.pipeline_value_and_grad(
        st, loss_fn, x, t, schedule=vnn.one_f_one_b(2, m), activation=boundaries(2),
        comm=stage_comm))
    loss, local = f(stages[s], xs[d], ts[d])
    g = vnn.allreduce_gradients(local, comm=data_comm, mean=True)
    wants = [one_process(stages, xs[k], ts[k], None) for k in range(2)]
    np.testing.assert_allclose(float(loss), float(wants[d][0]), rtol=1e-12)
    want = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, wants[0][1][s], wants[1][1][s])
    assert_trees_close(g, want, rtol=1e-12, atol=1e-14)
    # ZeRO over each stage's data group: the step is -lr times the mean gradient
    params = eqx.filter(stages[s], eqx.is_inexact_array)
    opt = vnn.sharded_optimizer(optax.sgd(0.1), comm=data_comm)
    update, _ = eqx.filter_jit(opt.update)(local, opt.init(params), params)
    assert_trees_close(update, jax.tree_util.tree_map(lambda a: -0.1 * a, want),
                       rtol=1e-12, atol=1e-14)
    stage_comm.Free()
    data_comm.Free()


@pytest.mark.skipif(size != 4, reason="2 stages x 2 tensor-parallel ranks")
def test_pipeline_times_tensor_parallel():
    """Each stage a tensor-parallel MLP (`ParallelMLP`, its hidden units split over the
    stage's two ranks): loss and the gathered gradient equal the dense model's."""
    s, t, m, w = rank // 2, rank % 2, 3, 4
    pipe_comm = WORLD.Split(t, s)  # stages 0 and 1 of tensor rank t: (0, 2), (1, 3)
    tensor_comm = WORLD.Split(s, t)  # the ranks of stage s: (0, 1), (2, 3)
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    dense = [eqx.nn.MLP(w, w, 2 * w, depth=1, activation=jnp.tanh, key=k, dtype=jnp.float64)
             for k in keys]
    r = np.random.default_rng(2)
    x, y = (jnp.asarray(r.standard_normal((m, 3, w))) for _ in range(2))

    def dense_loss(mlps):
        return sum(loss_fn(jax.vmap(mlps[1])(jax.vmap(mlps[0])(x[i])), y[i])
                   for i in range(m)) / m

    want_loss, want = eqx.filter_value_and_grad(dense_loss)(dense)

    stage = PerSample(vnn.ParallelMLP.from_dense(dense[s], comm=tensor_comm))
    f = eqx.filter_jit(lambda st: vnn.pipeline_value_and_grad(
        st, loss_fn, x, y, schedule=vnn.one_f_one_b(2, m),
        activation=jax.ShapeDtypeStruct((3, w), jnp.float64), comm=pipe_comm))
    loss, g = f(stage)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-12)
    got = eqx.filter_jit(lambda g: g.inner.to_dense())(g)
    assert_trees_close(eqx.filter(got, eqx.is_array), eqx.filter(want[s], eqx.is_array),
                       rtol=1e-12, atol=1e-14)
    pipe_comm.Free()
    tensor_comm.Free()
