"""vjpmpi.nn: every sharded layer equals its single-process equinox reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpmpi
import vjpmpi.nn as vnn
from vjpmpi import _mpi

from helpers import WORLD, kernel_calls

rank, size = WORLD.rank, WORLD.size
F = 12  # divisible by 1, 2, 3 and 4 ranks
# The end-to-end cases (20 training steps, dropout, a two-block sequence-parallel
# stack) run at 2 ranks only, for CI time; at 4 ranks the layer cases check the 4-way
# splits and examples/train_lm.py's smoke test trains a 2 x 2 model.
END_TO_END = pytest.mark.skipif(
    size > 2, reason="end-to-end case: runs at 2 ranks (the layer cases cover 4-way splits)")


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


def allreduces_in_grad(model, x):
    """Allreduce calls in what XLA compiled for jit(grad) of sum(model(x)) (parameters
    and input)."""
    params, static = eqx.partition(model, eqx.is_array)
    fn = jax.jit(jax.grad(lambda p, v: jnp.sum(eqx.combine(p, static)(v)), argnums=(0, 1)))
    return fn.lower(params, x).compile().as_text().count('custom_call_target="vjpmpi_allreduce"')


@pytest.mark.parametrize("depth, use_bias", [(0, True), (1, True), (2, False), (3, True)])
def test_parallel_mlp_any_depth_equals_dense(depth, use_bias):
    mlp = eqx.nn.MLP(6, 3, F, depth=depth, activation=jnp.tanh, final_activation=jax.nn.sigmoid,
                     use_bias=use_bias, use_final_bias=not use_bias, key=jax.random.PRNGKey(5))
    layer = vnn.ParallelMLP.from_dense(mlp)
    x = jax.random.normal(jax.random.PRNGKey(6), (6,))
    close(eqx.filter_jit(layer)(x), mlp(x))
    (g, gx), (gd, gxd) = grads(layer, x), grads(mlp, x)
    close(gx, gxd)
    for i, (mine, ref) in enumerate(zip(g.layers[0].layers if depth == 0 else g.layers,
                                        gd.layers)):
        pair, last = i % 2, i + 1 == len(gd.layers)
        if last and i % 2 == 0:  # unpaired last layer: whole on every rank
            close(mine.weight, ref.weight)
        else:  # column layer: rows (and bias) split; row layer: columns split
            close(mine.weight, shard_rows(ref.weight, axis=pair))
            if ref.bias is not None:
                close(mine.bias, ref.bias if pair else shard_rows(ref.bias))
    back = layer.to_dense()  # the round trip gives the dense layer back
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(mlp)
    for a, b in zip(*(jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array)) for m in (back, mlp))):
        close(a, b)
    close(back(x), mlp(x))
    # one allreduce forward and one backward per column/row pair
    assert allreduces_in_grad(layer, x) == 2 * (len(mlp.layers) // 2)


def test_parallel_mlp_init_from_key_and_unsplittable_mlps():
    # sharded init from one key = the same global weights on any number of ranks
    from_key = vnn.ColumnParallelLinear(6, F, key=jax.random.PRNGKey(7))
    close(from_key.to_dense().weight, eqx.nn.Linear(6, F, key=jax.random.PRNGKey(7)).weight)
    layer = vnn.ParallelMLP(6, 3, F, jnp.tanh, depth=2, key=jax.random.PRNGKey(8))
    close(layer.to_dense().layers[1].weight,
          eqx.nn.MLP(6, 3, F, 2, activation=jnp.tanh, key=jax.random.PRNGKey(8)).layers[1].weight)
    learnt = eqx.nn.MLP(6, 3, F, 1, activation=eqx.nn.PReLU(), key=jax.random.PRNGKey(8))
    with pytest.raises(ValueError, match=r"ParallelMLP: a learnt activation"):
        vnn.ParallelMLP.from_dense(learnt)
    with pytest.raises(ValueError, match=r"ParallelMLP: .*scalar"):
        vnn.ParallelMLP.from_dense(eqx.nn.MLP("scalar", 3, F, 1, key=jax.random.PRNGKey(8)))


def test_vocab_parallel_embedding():
    dense = eqx.nn.Embedding(F, 4, key=jax.random.PRNGKey(8))
    layer = vnn.VocabParallelEmbedding.from_dense(dense)
    ids = jnp.array([0, 3, F - 1, 5, 3])
    close(eqx.filter_jit(lambda m, v: jax.vmap(m)(v))(layer, ids), jax.vmap(dense)(ids))
    g = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(ids))))(layer)
    gd = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(ids))))(dense)
    close(g.weight, shard_rows(gd.weight))
    close(layer.to_dense().weight, dense.weight)


@pytest.mark.parametrize("dtype, scale, tol", [(jnp.float64, 3.0, 1e-12),
                                               (jnp.float64, 300.0, 1e-12),
                                               (jnp.float32, 3.0, 1e-5)])
def test_vocab_parallel_cross_entropy_equals_optax(dtype, scale, tol):
    vocab = 4 * F  # divisible by 1-4 ranks
    logits = jax.random.normal(jax.random.PRNGKey(24), (3, 5, vocab), dtype) * scale
    labels = jax.random.randint(jax.random.PRNGKey(25), (3, 5), 0, vocab)
    weights = jax.random.uniform(jax.random.PRNGKey(26), (3, 5), dtype)
    shard = shard_rows(logits, axis=2)  # this rank's block of the vocabulary

    def loss(fn, lg):
        return jnp.sum(fn(lg, labels) * weights)

    mine = jax.jit(lambda lg: vnn.vocab_parallel_cross_entropy(lg, labels))(shard)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    close(mine, ref, tol)
    grad = jax.jit(jax.grad(lambda lg: loss(vnn.vocab_parallel_cross_entropy, lg)))
    xent = optax.softmax_cross_entropy_with_integer_labels
    ref_grad = jax.jit(jax.grad(lambda lg: loss(xent, lg)))
    close(grad(shard), shard_rows(ref_grad(logits), axis=2), tol)
    # forward mode and Hessian-vector products (the same tangent on every rank)
    t = jax.random.normal(jax.random.PRNGKey(30), logits.shape, dtype)
    jvp = jax.jit(lambda a, b: jax.jvp(lambda lg: loss(vnn.vocab_parallel_cross_entropy, lg),
                                       (a,), (b,))[1])
    ref_jvp = jax.jit(lambda a, b: jax.jvp(lambda lg: loss(xent, lg), (a,), (b,))[1])
    close(jvp(shard, shard_rows(t, axis=2)), ref_jvp(logits, t), tol)
    hvp = jax.jit(lambda a, b: jax.jvp(grad, (a,), (b,))[1])
    ref_hvp = jax.jit(lambda a, b: jax.jvp(ref_grad, (a,), (b,))[1])
    close(hvp(shard, shard_rows(t, axis=2)), shard_rows(ref_hvp(logits, t), axis=2), tol)
    # two small allreduces forward (the maximum; the sums), none backward, no gather
    text = grad.lower(shard).compile().as_text()
    assert text.count('custom_call_target="vjpmpi_allreduce"') == 2
    assert "vjpmpi_allgather" not in text


def test_vocab_parallel_head_and_loss_train_like_the_dense_head():
    vocab = 4 * F
    head = eqx.nn.Linear(8, vocab, key=jax.random.PRNGKey(27))
    parallel = vnn.ColumnParallelLinear.from_dense(head)  # logits stay split by vocabulary
    h = jax.random.normal(jax.random.PRNGKey(28), (5, 8))
    labels = jax.random.randint(jax.random.PRNGKey(29), (5,), 0, vocab)

    def loss(layer, hh, fn):
        return jnp.mean(fn(jax.vmap(layer)(hh), labels))

    both = eqx.filter_jit(lambda m, v, fn: (eqx.filter_grad(loss)(m, v, fn),
                                            jax.grad(loss, 1)(m, v, fn)))
    xent = optax.softmax_cross_entropy_with_integer_labels
    (g, gh), (gd, ghd) = both(parallel, h, vnn.vocab_parallel_cross_entropy), both(head, h, xent)
    close(loss(parallel, h, vnn.vocab_parallel_cross_entropy), loss(head, h, xent))
    close(gh, ghd)
    close(g.weight, shard_rows(gd.weight))
    close(g.bias, shard_rows(gd.bias))
    with pytest.raises(ValueError, match=r"vocab_parallel_cross_entropy: labels of shape"):
        vnn.vocab_parallel_cross_entropy(jnp.zeros((5, F)), labels[:3])


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


@pytest.mark.parametrize("mask_kind, dropout, bias", [
    ("none", 0.0, False), ("2d", 0.0, True), ("per-head", 0.0, False),
    pytest.param("2d", 0.3, True, marks=END_TO_END),
    pytest.param("per-head", 0.3, False, marks=END_TO_END)])
def test_parallel_multihead_attention_equals_dense(mask_kind, dropout, bias):
    heads = 3 if size == 3 else 4  # divisible by the rank count
    dense = eqx.nn.MultiheadAttention(heads, 8, qk_size=3, vo_size=2, use_query_bias=bias,
                                      use_value_bias=bias, use_output_bias=bias,
                                      dropout_p=dropout, key=jax.random.PRNGKey(11))
    layer = vnn.ParallelMultiheadAttention.from_dense(dense)
    q = jax.random.normal(jax.random.PRNGKey(12), (5, 8))
    kv = jax.random.normal(jax.random.PRNGKey(13), (6, 8))
    mask = {"none": None, "2d": jnp.tril(jnp.ones((5, 6), bool)),
            "per-head": jax.random.bernoulli(jax.random.PRNGKey(19), 0.7, (heads, 5, 6))
            .at[:, :, 0].set(True)}[mask_kind]
    drop_key = jax.random.PRNGKey(20)  # dropout: the same per-head keys as the dense layer
    call = lambda m, a: m(a, kv, kv, mask, key=drop_key)  # noqa: E731
    close(eqx.filter_jit(call)(layer, q), call(dense, q))

    def loss(m, a):
        return jnp.sum(jnp.sin(call(m, a)))

    both = eqx.filter_jit(lambda m, a: (eqx.filter_grad(loss)(m, a), jax.grad(loss, 1)(m, a)))
    (g, gq), (gd, gqd) = both(layer, q), both(dense, q)
    close(gq, gqd)
    close(g.query_proj.weight, shard_rows(gd.query_proj.weight))
    close(g.value_proj.weight, shard_rows(gd.value_proj.weight))
    close(g.output_proj.weight, shard_rows(gd.output_proj.weight, axis=1))
    if bias:
        close(g.value_proj.bias, shard_rows(gd.value_proj.bias))
        close(g.output_proj.bias, gd.output_proj.bias)
    back = layer.to_dense()
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(dense)
    for a, b in zip(*(jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array)) for m in (back, dense))):
        close(a, b)
    close(call(back, q), call(dense, q))
    if dropout and mask_kind == "per-head":  # 10 Adam steps, a new dropout key each
        def train(m):
            opt = optax.adam(1e-2)
            state = opt.init(eqx.filter(m, eqx.is_inexact_array))

            @eqx.filter_jit
            def step(m, s, k):
                g = eqx.filter_grad(lambda mm: jnp.mean(jnp.sin(mm(q, kv, kv, mask, key=k))))(m)
                u, s = opt.update(g, s, m)
                return eqx.apply_updates(m, u), s

            for i in range(10):
                m, state = step(m, state, jax.random.PRNGKey(100 + i))
            return m

        trained, ref = train(layer).to_dense(), train(dense)
        for a, b in zip(*(jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_inexact_array))
                          for m in (trained, ref))):
            close(a, b, 1e-10)


def test_attention_bad_masks_are_clear_errors():
    layer = vnn.ParallelMultiheadAttention(4 if size != 3 else 3, 8, key=jax.random.PRNGKey(21))
    x = jnp.ones((5, 8))
    with pytest.raises(ValueError, match=r"ParallelMultiheadAttention: mask must have shape"):
        layer(x, x, x, jnp.ones((1, 5), bool))
    with pytest.raises(ValueError, match=r"ParallelMultiheadAttention: a 3-D mask must have "
                                         r"num_heads=\d rows"):
        layer(x, x, x, jnp.ones((2, 5, 5), bool))


def test_self_attention_runs_one_backward_allreduce():
    heads = 3 if size == 3 else 4
    attn = vnn.ParallelMultiheadAttention(heads, 8, key=jax.random.PRNGKey(22))
    x, y = jnp.ones((5, 8)), jnp.full((5, 8), 2.0)
    # forward: the output projection's sum; backward: one per distinct input
    assert allreduces_in_grad(lambda v: attn(v, v, v), x) == 2
    assert allreduces_in_grad(lambda v: (lambda kv: attn(v, kv, kv))(y * v), x) == 3  # kv: one
    assert allreduces_in_grad(lambda v: attn(v, y * v, 2 * v), x) == 4
    # a transformer block: attention and MLP, one allreduce forward and one backward each
    k = jax.random.split(jax.random.PRNGKey(23), 2)
    block = Block(eqx.nn.LayerNorm(8), attn, eqx.nn.LayerNorm(8),
                  vnn.ParallelMLP.from_dense(eqx.nn.MLP(8, 8, F, depth=1, key=k[0])))
    assert allreduces_in_grad(block, x) == 4


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


@END_TO_END
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


# ------------------------------------------------------ sequence parallelism --
class SequenceParallelBlock(Block):
    """Block on this rank's block of the sequence (Megatron-LM's sequence parallelism)."""

    def __call__(self, x, mask=None):
        h = jax.vmap(vnn.replicated(self.norm1))(x)
        x = x + self.attn.sequence_parallel(h, mask)
        return x + self.mlp.sequence_parallel(jax.vmap(vnn.replicated(self.norm2))(x))


@pytest.mark.parametrize("depth", [1, pytest.param(2, marks=END_TO_END)])
def test_sequence_parallel_block_equals_the_block(depth):
    k = jax.random.split(jax.random.PRNGKey(31), 3)
    d, seq, heads = 8, 12, 3 if size == 3 else 4  # seq divisible by 1-4 ranks
    dense = Block(eqx.nn.LayerNorm(d), eqx.nn.MultiheadAttention(heads, d, use_output_bias=True,
                                                                  key=k[0]),
                  eqx.nn.LayerNorm(d), eqx.nn.MLP(d, d, F, depth=depth, key=k[1]))
    tp = Block(dense.norm1, vnn.ParallelMultiheadAttention.from_dense(dense.attn), dense.norm2,
               vnn.ParallelMLP.from_dense(dense.mlp))
    sp = SequenceParallelBlock(tp.norm1, tp.attn, tp.norm2, tp.mlp)
    x = jax.random.normal(k[2], (seq, d))
    target = jnp.cos(3 * x)
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    blk = lambda a: shard_rows(a)  # noqa: E731  (this rank's block of the sequence)

    class Causal(eqx.Module):  # the dense and tensor-parallel blocks with the mask
        inner: Block

        def __call__(self, v):
            h = jax.vmap(self.inner.norm1)(v)
            v = v + self.inner.attn(h, h, h, mask)
            return v + jax.vmap(self.inner.mlp)(jax.vmap(self.inner.norm2)(v))

    close(eqx.filter_jit(lambda m, v: m(v, mask))(sp, blk(x)), blk(Causal(dense)(x)))

    def loss_sp(m):  # the global mean squared error, one replicated value
        local = jnp.sum((m(blk(x), mask) - blk(target)) ** 2)
        return vjpmpi.sum_replicated(local) / target.size

    def loss_full(m):
        return jnp.mean((Causal(m)(x) - target) ** 2)

    g_sp = eqx.filter_jit(eqx.filter_grad(loss_sp))(sp)
    g_tp = eqx.filter_jit(eqx.filter_grad(loss_full))(tp)
    for a, b in zip(*(jax.tree_util.tree_leaves(eqx.filter(g, eqx.is_inexact_array))
                      for g in (g_sp, g_tp))):
        close(a, b)
    # the tensor-parallel layers' collectives become allgathers and reduce_scatters
    params, static = eqx.partition(sp, eqx.is_inexact_array)
    text = jax.jit(jax.grad(lambda p: loss_sp(eqx.combine(p, static)))).lower(params).as_text()
    pairs = 1 + (len(dense.mlp.layers) // 2)
    assert text.count("vjpmpi_allgather") == text.count("vjpmpi_reduce_scatter") == 2 * pairs

    # 10 Adam steps, against the dense block trained on one process
    def run(model, loss):
        opt = optax.adam(1e-2)
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(m, s):
            u, s = opt.update(eqx.filter_grad(loss)(m), s, m)
            return eqx.apply_updates(m, u), s

        for _ in range(10):
            model, state = step(model, state)
        return model

    trained, ref = run(sp, loss_sp), run(dense, loss_full)
    gathered = Block(trained.norm1, trained.attn.to_dense(), trained.norm2, trained.mlp.to_dense())
    for a, b in zip(*(jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_inexact_array))
                      for m in (gathered, ref))):
        close(a, b, 1e-9)
