"""vjpmpi.nn.ExpertParallelMoE on inputs past the even case (issue 60), against the same
layer on one process (float64, 1e-12; at 2 and the odd 3 ranks).

- Uneven token counts (`max_tokens=`, the same on every rank), zero tokens on a rank
  (an empty output, the same aux), every token to rank 0's experts: the one-process layer
  on every rank's tokens in rank order, equal with its gradients (with dropout too); a
  capacity factor with uneven counts caps each rank's rows as on its batch alone.
- Mixed dtypes: float32 tokens into a float64 layer and bfloat16 into float32 compute in
  JAX's promoted dtype (as eqx.nn.Linear): the output's dtype and the one-process values.
- Refusals: uneven counts without `max_tokens`, a rank past `max_tokens` (every rank
  fails, then goes on); `jax.vmap` (the layer's own message, also through jit and grad,
  and with the layer batched).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from helpers import WORLD
from vjpmpi.nn import ExpertParallelMoE

rank, size = WORLD.rank, WORLD.size
D, H, T = 6, 8, 10  # width, expert hidden width, tokens per rank (even case)
E = 2 * size  # experts: two per rank
KEY = jax.random.PRNGKey(7)


def _batch(seed=0):
    g = np.random.default_rng(seed)
    xs = g.standard_normal((size * 13, D))
    ws = g.standard_normal((size * 13, D))  # the loss's weights per output
    return xs, ws


def _dense(**kw):
    return ExpertParallelMoE(D, H, E, comm=MPI.COMM_SELF, key=KEY, **kw)


def _loss(layer, x, w, total, key=None, alpha=0.1):
    """This rank's part of the one-process loss `sum(y * w) / total + alpha * aux` (each
    rank holds the same aux and adds 1/size of it)."""
    y, aux = layer(x, key=key)
    return jnp.sum(y * w) / total + alpha * aux / layer.comm.size, (y, aux)


# tokens per rank: uneven, with zero on some ranks (the one-process layer: all of them)
UNEVEN = {"uneven": [3, 13, 7, 5], "zero": [4, 0, 6, 0], "zero_first": [0, 9, 2, 11]}


def _to_rank0_experts(layer):
    """The layer with a router that sends every token of `_batch` (shifted by 10) to rank
    0's experts (experts 0 and 1: top-2 picks those two)."""
    router = jnp.zeros_like(layer.router).at[0, 0].set(3.0).at[1, 0].set(2.0)
    return eqx.tree_at(lambda m: m.router, layer, router)


@pytest.mark.parametrize("counts,top_k,dropout,skew", [
    ("uneven", 1, 0.0, True), ("uneven", 2, 0.3, False), ("zero_first", 1, 0.3, False),
    ("zero", 2, 0.0, True)])
def test_uneven_and_zero_token_counts_equal_one_process(counts, top_k, dropout, skew):
    n = UNEVEN[counts][:size]
    starts = np.cumsum([0] + n)
    mine = slice(starts[rank], starts[rank + 1])
    dense = _dense(top_k=top_k, dropout=dropout)
    xs, ws = _batch(11)
    xs, ws = xs[:starts[-1]], ws[:starts[-1]]
    if skew:
        dense = _to_rank0_experts(dense)
        xs = xs.copy()
        xs[:, 0] = np.abs(xs[:, 0]) + 10.0
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    key = jax.random.PRNGKey(5) if dropout else None
    bound = max(n)

    def loss(m, x, w, key, max_tokens):
        y, aux = m(x, key=key, max_tokens=max_tokens)
        return jnp.sum(y * w) / starts[-1] + 0.1 * aux / m.comm.size, (y, aux)

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=4)
    g, (y, aux) = grad(layer, xs[mine], ws[mine], key, bound)
    gd, (yd, auxd) = grad(dense, xs, ws, key, None)
    assert y.shape == (n[rank], D) and y.dtype == yd.dtype
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd)[mine], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(aux), float(auxd), rtol=1e-12)
    assert float(jnp.abs(yd).sum()) > 0
    lo = rank * (E // size)
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_allclose(np.asarray(getattr(g, name)),
                                   np.asarray(getattr(gd, name))[lo:lo + E // size],
                                   rtol=1e-12, atol=1e-12, err_msg=name)
    router = vjpmpi.allreduce(g.router, MPI.SUM)
    np.testing.assert_allclose(np.asarray(router), np.asarray(gd.router), rtol=1e-12, atol=1e-12)
    if skew:  # (every row went to rank 0's experts: the others' got no gradient)
        assert float(jnp.abs(gd.w1[2:]).sum()) == 0 and float(jnp.abs(gd.w1[:2]).sum()) > 0


def test_uneven_counts_with_a_capacity_factor():
    n = UNEVEN["uneven"][:size]
    starts = np.cumsum([0] + n)
    dense = _dense(top_k=2, capacity_factor=0.5)
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    xs, _ = _batch(12)
    mine = xs[starts[rank]:starts[rank + 1]]
    y, _ = jax.jit(lambda m, x: m(x, max_tokens=max(n)))(layer, mine)
    yd, _ = jax.jit(lambda m, x: m(x))(dense, mine)  # (its caps: this rank's batch alone)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_dtype,layer_dtype", [(jnp.float32, jnp.float64),
                                                 (jnp.bfloat16, jnp.float32)])
def test_mixed_dtypes_compute_as_jax_promotes(x_dtype, layer_dtype):
    dense = jax.tree.map(lambda a: a.astype(layer_dtype) if eqx.is_array(a) else a,
                         _dense(top_k=2))
    layer = ExpertParallelMoE.from_dense(dense, WORLD)
    xs, ws = _batch(13)
    xs, ws = jnp.asarray(xs[:size * T], x_dtype), ws[:size * T]
    mine = slice(rank * T, (rank + 1) * T)
    grad = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=3)
    g, (y, aux) = grad(layer, xs[mine], ws[mine], size * T)
    gd, (yd, auxd) = grad(dense, xs, ws, size * T)
    want = jnp.result_type(x_dtype, layer_dtype)
    assert y.dtype == want and yd.dtype == want and aux.dtype == want
    assert g.w1.dtype == layer_dtype
    # the same as the tokens cast first, as eqx.nn.Linear's `weight @ x` promotes
    yc, _ = jax.jit(lambda m, x: m(x))(dense, xs.astype(want))
    np.testing.assert_array_equal(np.asarray(yd), np.asarray(yc))
    tol = 1e-12 if want == jnp.float64 else 1e-5
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd)[mine], rtol=tol, atol=tol)
    np.testing.assert_allclose(float(aux), float(auxd), rtol=tol)
    lo = rank * (E // size)
    np.testing.assert_allclose(np.asarray(g.w1), np.asarray(gd.w1)[lo:lo + E // size],
                               rtol=tol, atol=tol)


def test_refuses_uneven_counts_without_max_tokens_and_a_rank_past_it():
    # (counts and bounds no other test of this file uses: a rank that has run an agreement
    # of the same shape before cannot be told of a disagreement there, and the job ends)
    layer = ExpertParallelMoE.from_dense(_dense(), WORLD)
    n = [5, 12, 8, 6][:size]
    x = jnp.asarray(_batch(14)[0][:n[rank]])
    if size > 1:  # (one rank's counts cannot differ)
        with pytest.raises(Exception, match="max_tokens=None: every rank must pass as many"):
            jax.block_until_ready(jax.jit(lambda m, v: m(v))(layer, x))
    with pytest.raises(Exception, match=f"rank {int(np.argmax(n))} passes 12 tokens, more "
                       "than max_tokens=11"):
        jax.block_until_ready(jax.jit(lambda m, v: m(v, max_tokens=11))(layer, x))
    with pytest.raises(ValueError, match="max_tokens=-1: None or a Python int"):
        layer(x, max_tokens=-1)
    # the communicator goes on after the refusals
    y, _ = jax.jit(lambda m, v: m(v, max_tokens=17))(layer, x)
    assert y.shape == (n[rank], D)


def test_refuses_vmap_with_its_own_message():
    layer = ExpertParallelMoE.from_dense(_dense(top_k=2), WORLD)
    xb = jnp.asarray(_batch(15)[0][:2 * T].reshape(2, T, D))
    msg = "ExpertParallelMoE: cannot be batched by jax.vmap"
    with pytest.raises(ValueError, match=msg):
        jax.vmap(lambda v: layer(v))(xb)
    with pytest.raises(ValueError, match=msg):
        jax.vmap(jax.jit(lambda v: layer(v)[0]))(xb)
    with pytest.raises(ValueError, match=msg):
        jax.vmap(jax.grad(lambda v: jnp.sum(layer(v)[0])))(xb)
    with pytest.raises(ValueError, match=msg):  # (the layer batched, the tokens not)
        stacked = jax.tree.map(lambda a: jnp.stack([a, a]) if eqx.is_array(a) else a, layer)
        jax.vmap(lambda m: m(xb[0])[0])(stacked)
    # unbatched, the same program runs (the guard is the identity)
    y, _ = jax.jit(lambda m, v: m(v))(layer, xb[0])
    assert y.shape == (T, D)
