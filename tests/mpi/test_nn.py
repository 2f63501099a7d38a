"""vjpmpi.nn: every sharded layer equals its single-process equinox reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpmpi.nn as vnn
from vjpmpi import _mpi

from helpers import WORLD, kernel_calls

rank, size = WORLD.rank, WORLD.size
F = 12  # divisible by 1, 2, 3 and 4 ranks


def loss_of(layer, x):
    return jnp.sum(jnp.sin(layer(x)))


@eqx.filter_jit
def grads(layer, x):
    """(gradient w.r.t. the layer's parameters, gradient w.r.t. the input)."""
    return eqx.filter_grad(loss_of)(layer, x), jax.grad(lambda v: loss_of(layer, v))(x)


def close(a, b, tol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def shard_rows(w, axis=0):
    k = w.shape[axis] // size
    return jax.lax.slice_in_dim(w, rank * k, (rank + 1) * k, axis=axis)


@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(gather):
    dense = eqx.nn.Linear(7, F, key=jax.random.PRNGKey(1))
    layer = vnn.ColumnParallelLinear.from_dense(dense, gather_output=gather)
    x = jax.random.normal(jax.random.PRNGKey(2), (7,))
    y = eqx.filter_jit(layer)(x)
    close(y, dense(x) if gather else shard_rows(dense(x)))
    if gather:  # replicated loss: gradients equal the single-process ones
        (g, gx), (gd, gxd) = grads(layer, x), grads(dense, x)
        close(gx, gxd)
        close(g.weight, shard_rows(gd.weight))
        close(g.bias, shard_rows(gd.bias))
    close(layer.to_dense().weight, dense.weight)


@pytest.mark.parametrize("parallel_in", [False, True])
def test_row_parallel_linear(parallel_in):
    dense = eqx.nn.Linear(F, 5, key=jax.random.PRNGKey(3))
    layer = vnn.RowParallelLinear.from_dense(dense, input_is_parallel=parallel_in)
    x = jax.random.normal(jax.random.PRNGKey(4), (F,))
    xin = shard_rows(x) if parallel_in else x
    close(eqx.filter_jit(layer)(xin), dense(x))
    g, gx = grads(layer, xin)
    gd, gxd = grads(dense, x)
    close(gx, shard_rows(gxd) if parallel_in else gxd)
    close(g.weight, shard_rows(gd.weight, axis=1))
    close(g.bias, gd.bias)
    close(layer.to_dense().weight, dense.weight)


def test_parallel_mlp_and_init_from_key():
    mlp = eqx.nn.MLP(6, 3, F, depth=1, activation=jnp.tanh, key=jax.random.PRNGKey(5))
    layer = vnn.ParallelMLP.from_dense(mlp)
    x = jax.random.normal(jax.random.PRNGKey(6), (6,))
    close(eqx.filter_jit(layer)(x), mlp(x))
    (g, gx), (gd, gxd) = grads(layer, x), grads(mlp, x)
    close(gx, gxd)
    close(g.column.weight, shard_rows(gd.layers[0].weight))
    close(g.row.weight, shard_rows(gd.layers[1].weight, axis=1))
    close(g.row.bias, gd.layers[1].bias)
    # sharded init from one key = the same global weights on any number of ranks
    from_key = vnn.ColumnParallelLinear(6, F, key=jax.random.PRNGKey(7))
    close(from_key.to_dense().weight, eqx.nn.Linear(6, F, key=jax.random.PRNGKey(7)).weight)


def test_vocab_parallel_embedding():
    dense = eqx.nn.Embedding(F, 4, key=jax.random.PRNGKey(8))
    layer = vnn.VocabParallelEmbedding.from_dense(dense)
    ids = jnp.array([0, 3, F - 1, 5, 3])
    close(eqx.filter_jit(lambda m, v: jax.vmap(m)(v))(layer, ids), jax.vmap(dense)(ids))
    g = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(ids))))(layer)
    gd = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(ids))))(dense)
    close(g.weight, shard_rows(gd.weight))
    close(layer.to_dense().weight, dense.weight)


def test_uneven_split_is_a_clear_error():
    if size == 1:
        pytest.skip("any feature count divides 1 rank")
    with pytest.raises(ValueError, match=r"vjpmpi\.nn\.ColumnParallelLinear: out_features=\d+ "
                                         r"is not divisible by the communicator size"):
        vnn.ColumnParallelLinear(3, size * 2 + 1, key=jax.random.PRNGKey(0))


def test_float32_equivalence():
    dense = eqx.nn.MLP(6, 3, F, depth=1, key=jax.random.PRNGKey(9), dtype=jnp.float32)
    layer = vnn.ParallelMLP.from_dense(dense)
    x = jax.random.normal(jax.random.PRNGKey(10), (6,), jnp.float32)
    np.testing.assert_allclose(layer(x), dense(x), rtol=1e-5, atol=1e-6)
    (g, gx), (gd, gxd) = grads(layer, x), grads(dense, x)
    np.testing.assert_allclose(gx, gxd, rtol=1e-5, atol=1e-6)


def test_allreduce_gradients_one_call_per_dtype_and_optax():

    tree = {"a": jnp.full(3, rank + 1.0), "b": [jnp.ones((2, 2)) * rank, jnp.arange(2.0)],
            "c": jnp.ones(2, jnp.float32) * rank, "n": 7}
    calls = kernel_calls()[0]
    out = vnn.allreduce_gradients(tree)
    assert kernel_calls()[0] - calls == 2  # float64 group + float32 group
    close(out["a"], np.full(3, (size + 1) / 2))
    close(out["b"][0], np.ones((2, 2)) * (size - 1) / 2)
    assert out["c"].dtype == jnp.float32 and out["n"] == 7
    summed = vnn.allreduce_gradients(tree, mean=False)
    close(summed["a"], np.full(3, size * (size + 1) / 2))
    # data-parallel SGD with optax: every rank ends with the same parameters
    params = {"w": jnp.ones(3)}
    opt = optax.sgd(0.1)
    state = opt.init(params)
    for _ in range(3):
        g = jax.grad(lambda p: jnp.sum((p["w"] * (rank + 1)) ** 2))(params)
        updates, state = opt.update(vnn.allreduce_gradients(g), state)
        params = optax.apply_updates(params, updates)
    assert all(np.allclose(p, params["w"]) for p in WORLD.allgather(np.asarray(params["w"])))
    assert isinstance(_mpi.as_comm(None, "x"), _mpi.CommRef)


def test_parallel_multihead_attention():
    heads = 3 if size == 3 else 4  # divisible by the rank count
    dense = eqx.nn.MultiheadAttention(heads, 8, qk_size=3, vo_size=2, key=jax.random.PRNGKey(11))
    layer = vnn.ParallelMultiheadAttention.from_dense(dense)
    q = jax.random.normal(jax.random.PRNGKey(12), (5, 8))
    kv = jax.random.normal(jax.random.PRNGKey(13), (6, 8))
    mask = jnp.tril(jnp.ones((5, 6), bool))
    close(eqx.filter_jit(layer)(q, kv, kv, mask), dense(q, kv, kv, mask))

    def loss(m, a, b):
        return jnp.sum(jnp.sin(m(a, b, b, mask)))

    g, gq = eqx.filter_jit(eqx.filter_grad(lambda m, a: loss(m, a, kv)))(layer, q), \
        jax.grad(lambda a: loss(layer, a, kv))(q)
    gd, gqd = eqx.filter_grad(lambda m, a: loss(m, a, kv))(dense, q), \
        jax.grad(lambda a: loss(dense, a, kv))(q)
    close(gq, gqd)
    close(g.local.query_proj.weight, shard_rows(gd.query_proj.weight))
    close(g.local.value_proj.weight, shard_rows(gd.value_proj.weight))
    close(g.local.output_proj.weight, shard_rows(gd.output_proj.weight, axis=1))
    close(layer.to_dense().query_proj.weight, dense.query_proj.weight)


class Block(eqx.Module):
    """A transformer block: pre-norm attention and MLP with residuals."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.Module
    norm2: eqx.nn.LayerNorm
    mlp: eqx.Module

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


def test_transformer_block_20_optax_steps_matches_single_process():
    k = jax.random.split(jax.random.PRNGKey(14), 3)
    d = 8
    dense = Block(eqx.nn.LayerNorm(d), eqx.nn.MultiheadAttention(4 if size != 3 else 3, d, key=k[0]),
                  eqx.nn.LayerNorm(d), eqx.nn.MLP(d, d, F, depth=1, key=k[1]))
    dense = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a,
                                   dense)
    parallel = Block(dense.norm1, vnn.ParallelMultiheadAttention.from_dense(dense.attn), dense.norm2,
                     vnn.ParallelMLP.from_dense(dense.mlp))
    x = jax.random.normal(k[2], (6, d), jnp.float32)
    target = jnp.cos(x)

    def run(model):
        opt = optax.adam(1e-2)
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(m, s):
            g = eqx.filter_grad(lambda mm: jnp.mean((mm(x) - target) ** 2))(m)
            u, s = opt.update(g, s, m)
            return eqx.apply_updates(m, u), s

        for _ in range(20):
            model, state = step(model, state)
        return model

    # full float32 matmuls: on GPUs XLA's default uses TF32, whose rounding differs
    # between the split and the dense products by more than the tolerance below
    with jax.default_matmul_precision("float32"):
        trained, ref = run(parallel), run(dense)
    gathered = Block(trained.norm1, trained.attn.to_dense(), trained.norm2, trained.mlp.to_dense())
    for a, b in zip(jax.tree_util.tree_leaves(eqx.filter(gathered, eqx.is_inexact_array)),
                    jax.tree_util.tree_leaves(eqx.filter(ref, eqx.is_inexact_array))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_layers_under_filter_vmap():
    dense = eqx.nn.Linear(5, F, key=jax.random.PRNGKey(15))
    layer = vnn.ColumnParallelLinear.from_dense(dense, gather_output=True)
    xs = jax.random.normal(jax.random.PRNGKey(16), (7, 5))
    close(eqx.filter_vmap(layer)(xs), jax.vmap(dense)(xs))
    row = vnn.RowParallelLinear.from_dense(eqx.nn.Linear(F, 3, key=jax.random.PRNGKey(17)),
                                           input_is_parallel=False)
    ys = jax.random.normal(jax.random.PRNGKey(18), (7, F))
    close(eqx.filter_jit(eqx.filter_vmap(row))(ys), jax.vmap(row.to_dense())(ys))
