"""Gradient syncs that know where each parameter lives (`vjpmpi.nn.layout`), float64.

A model mixing data, tensor and expert parallelism (a replicated `eqx.nn.Linear`, a
column/row tensor-parallel pair over a tensor group of `TP` ranks, an
`ExpertParallelMoE` over every rank, a replicated head) against the same model on one
process (`to_dense`, `MPI.COMM_SELF`), on the data-parallel groups' batches together:
- `allreduce_gradients` (one call per dtype, or buckets), `sync_gradients` and
  `sharded_optimizer` (sgd, whose update is the synced gradient) over every rank equal
  the one-process gradient of the mean loss (1e-12), the tensor-parallel leaves summed
  only over the ranks holding the same block, the experts' left as they are; the sum
  (`mean=False`) equals it times the number of ranks. Each rank adds the same
  load-balancing loss to its own: no scaling by hand.
- On a data x tensor grid (4 ranks), the same syncs over the data-parallel communicator.
- Refused on every rank, naming the leaf and its layer: experts synced over ranks that do
  not hold their group; `sharded_optimizer` over every rank of a grid (the tensor blocks
  would be sharded together); data-parallel ranks holding different blocks of a leaf
  split across them (the ranks' agreement); a `layout=` of another structure. The ranks
  stay in step after each refusal.
- A pipeline of equal layers (`PipelineStage`) against the whole stack on one process:
  its stages' gradients synced over the pipeline's ranks are each stage's own.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn as vnn
from helpers import WORLD

rank, size = WORLD.rank, WORLD.size
TP = 2 if size % 2 == 0 else size  # the tensor groups' size: a grid at 4 ranks
DP = size // TP
D, H, T, E = 4, 6, 5, 2 * size  # width, hidden width, tokens per rank, experts
TP_COMM = WORLD.Split(rank // TP, rank)  # ranks 2g, 2g + 1: tensor group g
DP_COMM = WORLD.Split(rank % TP, rank)  # the ranks holding the same tensor block
GROUP = rank // TP  # this rank's data-parallel group: its tensor group's batch


class Net(eqx.Module):
    inp: eqx.nn.Linear
    col: eqx.Module
    row: eqx.Module
    moe: vnn.ExpertParallelMoE | None
    head: eqx.nn.Linear

    def __call__(self, x, w):
        h = jax.vmap(self.inp)(x)
        h = h + jax.vmap(lambda v: self.row(jnp.tanh(self.col(v))))(h)
        aux = 0.0
        if self.moe is not None:
            y, aux = self.moe(h)
            h = h + y
        return jnp.mean(jnp.sum(jax.vmap(self.head)(h) * w, axis=-1)) + 0.1 * aux


def dense_net(moe=True):
    k = jax.random.split(jax.random.PRNGKey(3), 5)
    return Net(eqx.nn.Linear(D, D, key=k[0]), eqx.nn.Linear(D, 2 * TP, key=k[1]),
               eqx.nn.Linear(2 * TP, D, key=k[2]),
               vnn.ExpertParallelMoE(D, H, E, top_k=2, comm=MPI.COMM_SELF, key=k[3])
               if moe else None, eqx.nn.Linear(D, 3, key=k[4]))


def split_net(dense, tp=TP_COMM, ep=WORLD):
    return Net(dense.inp, vnn.ColumnParallelLinear.from_dense(dense.col, tp),
               vnn.RowParallelLinear.from_dense(dense.row, tp),
               None if dense.moe is None else vnn.ExpertParallelMoE.from_dense(dense.moe, ep),
               dense.head)


def gathered(g):
    """The synced gradients (a Net of shards) as the one-process Net's."""
    return Net(g.inp, g.col.to_dense(), g.row.to_dense(),
               None if g.moe is None else g.moe.to_dense(), g.head)


def batches():
    r = np.random.default_rng(11)
    return r.standard_normal((DP, T, D)), r.standard_normal((DP, T, 3))


@functools.cache
def reference(moe=True):
    """The one-process gradient of the mean loss over the data-parallel groups' batches."""
    xs, ws = batches()
    return jax.jit(jax.grad(lambda m: m(xs.reshape(-1, D), ws.reshape(-1, 3))))(dense_net(moe))


@functools.cache
def local_grad(moe=True):
    """This rank's own gradient of its loss (no sync)."""
    xs, ws = batches()
    return jax.jit(jax.grad(lambda m: m(xs[GROUP], ws[GROUP])))(split_net(dense_net(moe)))


def assert_close(got, want, scale=1.0):
    gl, wl = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(gl) == len(wl) and len(gl) >= 8
    for i, (a, b) in enumerate(zip(gl, wl, strict=True)):
        np.testing.assert_allclose(np.asarray(a), scale * np.asarray(b), rtol=1e-12,
                                   atol=1e-12, err_msg=f"leaf {i}")


def synced(mode, net, comm):
    xs, ws = batches()
    if mode == "sync":
        return jax.jit(jax.grad(lambda m: vnn.sync_gradients(m, comm=comm, bucket_bytes=200)(
            xs[GROUP], ws[GROUP])))(net)
    g = local_grad(net.moe is not None)
    if mode == "allreduce":
        return jax.jit(lambda g: vnn.allreduce_gradients(g, comm=comm))(g)
    if mode == "buckets":
        return jax.jit(lambda g: vnn.allreduce_gradients(g, comm=comm, bucket_bytes=200))(g)
    if mode == "sum":
        return jax.jit(lambda g: vnn.allreduce_gradients(g, comm=comm, mean=False))(g)
    opt = vnn.sharded_optimizer(optax.sgd(-1.0), comm=comm)  # the update: + the gradient
    return jax.jit(lambda g, s: opt.update(g, s)[0])(g, opt.init(net))


@pytest.mark.parametrize("mode", ["allreduce", "buckets", "sync", "sum", "zero"])
def test_mixed_model_equals_one_process(mode):
    dense = dense_net()
    net = split_net(dense)
    where = vnn.layout(net)
    assert isinstance(where.col.weight, vnn.Split) and where.col.weight.axis == 0
    assert isinstance(where.row.weight, vnn.Split) and where.row.weight.axis == 1
    assert isinstance(where.row.bias, vnn.Replicated)
    assert where.moe.w1.gradient == "summed" and isinstance(where.moe.router, vnn.Replicated)
    if mode == "zero" and TP < size:  # tensor blocks of a part of the ranks: refused
        with pytest.raises(ValueError, match=r"leaf \.col\.weight \(ColumnParallelLinear"
                                             r"\.weight, split over 2 of the 4 ranks\)"):
            synced(mode, net, WORLD)
        return
    got = gathered(synced(mode, net, WORLD))
    assert_close(got, reference(), scale=size if mode == "sum" else 1.0)


@pytest.mark.parametrize("mode", ["allreduce", "sync", "zero"])
def test_grid_synced_over_the_data_parallel_ranks(mode):
    dense = dense_net(moe=False)
    net = split_net(dense)
    assert_close(gathered(synced(mode, net, DP_COMM)), reference(moe=False))


def _refused(run, match):
    with pytest.raises(ValueError, match=match):
        jax.block_until_ready(run())
    # the ranks are still in step
    assert float(vjpmpi.allreduce(jnp.ones(()), MPI.SUM)) == size


def test_experts_synced_over_ranks_outside_their_group_refused():
    g = local_grad()
    # each rank alone (a communicator of one) cannot sum what the experts hold
    _refused(lambda: vnn.allreduce_gradients(g, comm=MPI.COMM_SELF),
             r"leaf \.moe\.w1 \(ExpertParallelMoE\.w1, split over .* sums the losses of "
             "ranks outside")
    if DP > 1 and TP > 1:  # experts over a tensor group, synced over the data ranks
        moe = vnn.ExpertParallelMoE(D, H, 2 * TP, comm=TP_COMM, key=jax.random.PRNGKey(0))
        _refused(lambda: jax.jit(lambda m: vnn.allreduce_gradients(m, comm=DP_COMM))(moe),
                 r"ExpertParallelMoE\.w1, split over 2 ranks\): its gradient sums")


@pytest.mark.skipif(size != 4, reason="a 'diagonal' communicator needs a 2 x 2 grid")
def test_data_ranks_holding_other_blocks_refused_by_the_agreement():
    diagonal = WORLD.Split(int(rank in (1, 2)), rank)  # {0, 3}, {1, 2}: other tensor blocks
    col = vnn.ColumnParallelLinear(D, 4, comm=TP_COMM, key=jax.random.PRNGKey(0))
    _refused(lambda: jax.jit(lambda m: vnn.allreduce_gradients(m, comm=diagonal))(col),
             "every rank must hold the same")


def test_layout_of_another_structure_refused():
    net = split_net(dense_net(moe=False))
    with pytest.raises(ValueError, match="not of the tree's structure"):
        vnn.allreduce_gradients(local_grad(False), layout=vnn.layout(net.col))


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


def test_pipeline_stages_are_not_summed_with_each_other():
    """A pipeline of equal layers (`PipelineStage`, 2 per stage, one stage per rank)
    against the whole stack on one process; the stages' gradients synced over the
    pipeline's ranks are each stage's own (summed with the others', as before, they would
    mix the stages)."""
    keys = jax.random.split(jax.random.PRNGKey(5), 2 * size)
    stack = eqx.filter_vmap(lambda k: Block(eqx.nn.Linear(D, D, key=k)))(keys)
    stage = vnn.PipelineStage(stack)
    where = vnn.layout(stage)
    assert where.layers.linear.weight.layer == "PipelineStage.layers"
    xs = np.random.default_rng(2).standard_normal((4, D))
    loss = lambda y, t: jnp.sum(y * t)  # noqa: E731
    value, g = jax.jit(lambda st: vnn.pipeline_value_and_grad(
        st, loss, xs if rank == 0 else None, xs if rank == size - 1 else None,
        schedule=vnn.one_f_one_b(size, 4), activation=jnp.zeros(D)))(stage)
    whole = vnn.PipelineStage(stack, comm=MPI.COMM_SELF)
    want_value, want = jax.value_and_grad(
        lambda st: jnp.mean(jax.vmap(lambda x: loss(st(x), x))(xs)))(whole)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-12)
    got = jax.jit(vnn.allreduce_gradients)(g)  # (over the pipeline's ranks)
    lo = 2 * rank
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b)[lo:lo + 2], rtol=1e-12,
                                   atol=1e-12)
    assert_close_leaves = jax.tree_util.tree_leaves(stage.to_dense())
    for a, b in zip(assert_close_leaves, jax.tree_util.tree_leaves(stack), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
