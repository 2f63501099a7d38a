"""vjpmpi.nn.ExpertParallelMoE against the same layer on one process (float64).

- Every rank has a batch of its own; the one-process layer (every expert, MPI.COMM_SELF,
  from the same key) runs on all the ranks' batches in rank order. Outputs, the
  load-balancing loss and every gradient equal (1e-12): the experts' on their rank, the
  router's summed over the ranks; top-1 and top-2; dropout off and on (same key).
- A capacity factor: each expert takes at most its capacity from each rank, as the
  one-process layer does on that rank's batch alone.
- One key gives the same layer as `from_dense`; `to_dense` gives the whole layer back.
- A training step of the whole layer through `sharded_optimizer` (adam: the router's
  state sharded, the experts' whole on their rank, from `vjpmpi.nn.layout`) equals adam
  on the one-process layer.
- Refusals: experts not a multiple of the size, top_k outside 1-2.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import vjpmpi
from helpers import WORLD, assert_trees_close
from vjpmpi.nn import ExpertParallelMoE

rank, size = WORLD.rank, WORLD.size
D, H, T = 6, 8, 10  # width, expert hidden width, tokens per rank
E = 2 * size  # experts: two per rank
KEY = jax.random.PRNGKey(7)


def _batch(seed=0):
    g = np.random.default_rng(seed)
    xs = g.standard_normal((size * T, D))
    ws = g.standard_normal((size * T, D))  # the loss's weights per output
    return xs, ws


def _dense(**kw):
    return ExpertParallelMoE(D, H, E, comm=MPI.COMM_SELF, key=KEY, **kw)


def _loss(layer, x, w, total, key=None, alpha=0.1):
    """This rank's part of the one-process loss `sum(y * w) / total + alpha * aux`: every
    rank holds the same aux, so each adds 1/size of it (the sum over the ranks' losses,
    which exact adjoints differentiate, is then the one-process loss)."""
    y, aux = layer(x, key=key)
    return jnp.sum(y * w) / total + alpha * aux / layer.comm.size, (y, aux)


@pytest.mark.parametrize("top_k,dropout", [(1, 0.0), (2, 0.0), (2, 0.3)])
def test_equals_one_process(top_k, dropout):
    kw = dict(top_k=top_k, dropout=dropout)
    dense = _dense(**kw)
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    assert_trees_close(layer, ExpertParallelMoE(D, H, E, comm=WORLD, key=KEY, **kw),
                       rtol=0, atol=0, what="key vs from_dense leaf")
    xs, ws = _batch(top_k)
    mine = slice(rank * T, (rank + 1) * T)
    key = jax.random.PRNGKey(3) if dropout else None
    grad = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=3)
    g, (y, aux) = grad(layer, xs[mine], ws[mine], size * T, key)
    gd, (yd, auxd) = grad(dense, xs, ws, size * T, key)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd)[mine], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(aux), float(auxd), rtol=1e-12)
    assert float(jnp.abs(y).sum()) > 0
    if dropout:  # (the masks acted)
        y0, _ = jax.jit(lambda m, v: m(v))(layer, xs[mine])
        assert float(jnp.mean(y == 0)) > float(jnp.mean(y0 == 0)) + 0.02
    lo = rank * (E // size)
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_allclose(np.asarray(getattr(g, name)),
                                   np.asarray(getattr(gd, name))[lo:lo + E // size],
                                   rtol=1e-12, atol=1e-12, err_msg=name)
    router = vjpmpi.allreduce(g.router, MPI.SUM)
    np.testing.assert_allclose(np.asarray(router), np.asarray(gd.router), rtol=1e-12, atol=1e-12)
    assert float(jnp.abs(gd.router).sum()) > 0 and float(jnp.abs(gd.w1).sum()) > 0


def test_capacity_factor_caps_each_expert_per_rank():
    dense = _dense(top_k=2, capacity_factor=0.5)
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    xs, ws = _batch(5)
    mine = xs[rank * T:(rank + 1) * T]
    y, _ = jax.jit(lambda m, x: m(x))(layer, mine)
    yd, _ = jax.jit(lambda m, x: m(x))(dense, mine)  # (its caps: this rank's batch alone)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), rtol=1e-12, atol=1e-12)
    full, _ = jax.jit(lambda m, x: m(x))(_dense(top_k=2), mine)
    assert not np.allclose(np.asarray(y), np.asarray(full))  # (some rows were dropped)
    # the dropped rows have no gradient path: the experts' gradients equal the one-process
    # layer's on this rank's batch, summed over the ranks
    g = jax.jit(jax.grad(lambda m: jnp.sum(m(mine)[0] * ws[:T])))(layer)
    gd = jax.jit(jax.grad(lambda m: jnp.sum(m(mine)[0] * ws[:T])))(dense)
    lo = rank * (E // size)
    total = vjpmpi.allreduce(gd.w1, MPI.SUM)[lo:lo + E // size]
    np.testing.assert_allclose(np.asarray(g.w1), np.asarray(total), rtol=1e-12, atol=1e-12)


def test_to_dense_gives_the_whole_layer():
    dense = _dense(top_k=2)
    back = ExpertParallelMoE.from_dense(dense, WORLD).to_dense()
    assert_trees_close(back, dense, rtol=0, atol=0)


def test_step_through_sharded_optimizer_equals_one_process():
    dense = _dense(top_k=2)
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    xs, ws = _batch(9)
    mine = slice(rank * T, (rank + 1) * T)
    # the whole layer through one optimizer: vjpmpi.nn.layout tells it that the experts
    # are split (kept whole on their rank, not summed) and the router replicated
    opt = vjpmpi.nn.sharded_optimizer(optax.adam(1e-2), mean=False)
    dense_opt = optax.adam(1e-2)

    @jax.jit
    def step(m, state):
        g, _ = jax.grad(_loss, has_aux=True)(m, xs[mine], ws[mine], size * T)
        u, state = opt.update(g, state)
        return eqx.apply_updates(m, u), state

    @jax.jit
    def dense_step(m, state):
        g, _ = jax.grad(_loss, has_aux=True)(m, xs, ws, size * T)
        u, state = dense_opt.update(eqx.filter(g, eqx.is_array), state)
        return eqx.apply_updates(m, u), state

    state = opt.init(layer)
    d_state = dense_opt.init(eqx.filter(dense, eqx.is_array))
    for _ in range(3):
        layer, state = step(layer, state)
        dense, d_state = dense_step(dense, d_state)
    assert_trees_close(layer.to_dense(), dense, rtol=1e-10, atol=1e-12)


def test_refusals():
    if size > 1:  # (one rank holds any number of experts)
        with pytest.raises(ValueError, match=f"num_experts={2 * size + 1} is not a multiple"):
            ExpertParallelMoE(D, H, 2 * size + 1, comm=WORLD, key=KEY)
    with pytest.raises(ValueError, match="top_k=3: 1 or 2"):
        ExpertParallelMoE(D, H, E, top_k=3, comm=WORLD, key=KEY)
