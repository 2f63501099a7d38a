"""Pipeline x tensor x data parallelism on one 3-D grid of 8 ranks (2 x 2 x 2): each
stage a tensor-parallel MLP (`ParallelMLP`) split over its 2 ranks, 2 data-parallel
groups with batches of their own, and `sharded_optimizer` over each data group. One
SGD step's loss and parameters (gathered from their shards) equal the dense model's on
one process over both groups' batches (float64, 1e-12)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpmpi.nn as vnn

from helpers import WORLD, PerSample, assert_trees_close

rank, size = WORLD.rank, WORLD.size


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


@pytest.mark.skipif(size != 8, reason="the 3-D grid: 2 stages x 2 tensor x 2 data")
def test_pipeline_times_tensor_times_data():
    # rank = (stage * 2 + data group) * 2 + tensor index
    s, d, t = rank // 4, (rank // 2) % 2, rank % 2
    tensor_comm = WORLD.Split(rank // 2, rank)  # one stage of one data group
    data_comm = WORLD.Split(s * 2 + t, rank)  # the same shards, both data groups
    pipe_comm = WORLD.Split(d * 2 + t, s)  # one rank per stage, in stage order
    m, w, lr = 3, 4, 0.1
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    dense = [eqx.nn.MLP(w, w, 2 * w, depth=1, activation=jnp.tanh, key=k, dtype=jnp.float64)
             for k in keys]
    r = np.random.default_rng(3)
    xs, ys = (jnp.asarray(r.standard_normal((2, m, 3, w))) for _ in range(2))  # per group

    def dense_loss(mlps):  # both groups' batches: the mean of their mean losses
        return sum(loss_fn(jax.vmap(mlps[1])(jax.vmap(mlps[0])(xs[g, i])), ys[g, i])
                   for g in range(2) for i in range(m)) / (2 * m)

    want_loss, want = eqx.filter_value_and_grad(dense_loss)(dense)

    stage = PerSample(vnn.ParallelMLP.from_dense(dense[s], comm=tensor_comm))
    params = eqx.filter(stage, eqx.is_inexact_array)
    opt = vnn.sharded_optimizer(optax.sgd(lr), comm=data_comm)

    @eqx.filter_jit
    def step(st, state):
        loss, g = vnn.pipeline_value_and_grad(
            st, loss_fn, xs[d], ys[d], schedule=vnn.one_f_one_b(2, m),
            activation=jax.ShapeDtypeStruct((3, w), jnp.float64), comm=pipe_comm)
        update, state = opt.update(g, state, eqx.filter(st, eqx.is_inexact_array))
        return loss, eqx.apply_updates(st, update)

    loss, new = step(stage, opt.init(params))
    losses = data_comm.allgather(float(loss))  # each group's own mean loss
    np.testing.assert_allclose(np.mean(losses), float(want_loss), rtol=1e-12)
    assert losses[0] != losses[1]  # the groups did see different batches
    got = eqx.filter_jit(lambda st: st.inner.to_dense())(new)
    stepped = jax.tree_util.tree_map(lambda p, g: p - lr * g, eqx.filter(dense[s], eqx.is_array),
                                     eqx.filter(want[s], eqx.is_array))
    assert_trees_close(eqx.filter(got, eqx.is_array), stepped, rtol=1e-12, atol=1e-14)
    for comm in (pipe_comm, data_comm, tensor_comm):
        comm.Free()
