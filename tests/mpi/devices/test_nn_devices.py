"""vjpmpi.nn with a device communicator: every device of P processes x D devices a rank of
`vjpmpi.device_comm`, each layer built inside the jax.shard_map body by slicing the dense
equinox layer with its (traced) rank. Its blocks, forward pass, gradients and `to_dense`
against the dense layer (NumPy formulas, or the dense layer's program on this process),
with each rank's own data where a layer takes per-rank data (a row-parallel layer's input
blocks, a sequence's blocks, data-parallel batches), and the tensor-parallel MLP against
the same layer on the process communicator (split over the P processes).

Runs at P processes of D CPU devices each (tests/test_multirank.py, test_devices).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import vjpmpi
import vjpmpi.nn as vnn

from helpers import WORLD, assert_trees_close, fresh

D = len(jax.devices())
PROCS, PROC = WORLD.size, WORLD.rank
N = PROCS * D  # the device communicator's size
MESH = Mesh(np.array(jax.devices()), ("d",))
RANKS = range(PROC * D, (PROC + 1) * D)  # this process's devices' ranks, in mesh order
F = 24  # divisible by every layout's rank count (2, 3, 4, 6, 8, 12)
XENT = optax.softmax_cross_entropy_with_integer_labels


def comm():
    return vjpmpi.device_comm("d")


def per_device(fn, *split, shared=()):
    """`fn(*this device's entry of each of split, *shared)` on every device (each a rank),
    in one jitted shard_map. `split`: arrays of [D, ...], one entry per device (data of
    this process's ranks, or copies: each device's own); `shared`: the same on every device
    (not varying over the axis). The results' arrays come back [D, ...]; their other leaves
    (a layer's communicator, activation) pass around the shard_map."""
    args = (*split, *shared)

    def run(arrays):
        out_static = []

        def body(arrays):
            mine = jax.tree.map(lambda a: a[0], arrays[:len(split)])
            out = fn(*eqx.combine((*mine, *arrays[len(split):]), static))
            out_arrays, rest = eqx.partition(out, eqx.is_array)
            out_static.append(rest)
            return jax.tree.map(lambda a: a[None], out_arrays)

        specs = (P("d"),) * len(split) + (P(),) * len(shared)
        out = jax.shard_map(body, mesh=MESH, in_specs=(specs,), out_specs=P("d"))(arrays)
        return eqx.combine(out, out_static[0])

    arrays, static = eqx.partition(args, eqx.is_array)
    return eqx.filter_jit(run)(arrays)


def copies(tree):
    """Each device's own copy of `tree` (the same on every rank), for `per_device`."""
    return jax.tree.map(lambda a: jnp.asarray(np.stack([np.asarray(a)] * D)), tree)


def mine(a):
    """This process's devices' rows of `a`, [N, ...] (one row per rank), for `per_device`."""
    return jnp.asarray(np.asarray(a)[PROC * D:(PROC + 1) * D])


def arr(seed, *shape):
    """Standard normal NumPy data, the same on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)


def block(a, r, axis=0):
    """Rank r's block of `a` along `axis`, split over the N ranks (NumPy)."""
    a = np.asarray(a)
    k = a.shape[axis] // N
    return a[(slice(None),) * axis + (slice(r * k, (r + 1) * k),)]


def close(a, b, tol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def device(tree, i):
    """Device i's entry of a `per_device` result."""
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)


def value_and_grads(layer, x):
    """(layer(x), the gradient of sum(sin(layer(x))) w.r.t. the layer and w.r.t. x), on
    this rank."""
    def loss(mx):
        y = mx[0](mx[1])
        return jnp.sum(jnp.sin(y)), y

    (_, y), (g, gx) = eqx.filter_value_and_grad(loss, has_aux=True)((layer, x))
    return y, g, gx


# ----------------------------------------------------------- linear layers --
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(gather):
    dense = fresh(eqx.nn.Linear, 7, F, seed=1)
    x = arr(2, 7)  # replicated: the same on every rank
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    want = w @ x + b
    c = np.cos(want)

    def body(x):
        layer = vnn.ColumnParallelLinear.from_dense(dense, gather_output=gather, comm=comm())
        return layer, *value_and_grads(layer, x), layer.to_dense()

    layer, y, g, gx, back = per_device(body, copies(x))
    for i, r in enumerate(RANKS):  # each device holds and computes its rank's block
        close(layer.weight[i], block(w, r))
        close(layer.bias[i], block(b, r))
        close(y[i], want if gather else block(want, r))
        close(gx[i], w.T @ c)  # the input's gradient sums every rank's block
        close(g.weight[i], block(np.outer(c, x), r))
        close(g.bias[i], block(c, r))
        assert_trees_close(params(device(back, i)), params(dense))


@pytest.mark.parametrize("parallel_in", [False, True])
def test_row_parallel_linear(parallel_in):
    dense = fresh(eqx.nn.Linear, F, 5, seed=3)
    x = arr(4, F)
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    want = w @ x + b
    c = np.cos(want)
    # each rank's own block of the input, or the whole input on every rank
    xs = mine(np.stack([block(x, r) for r in range(N)])) if parallel_in else copies(x)

    def body(x):
        layer = vnn.RowParallelLinear.from_dense(dense, input_is_parallel=parallel_in,
                                                 comm=comm())
        return layer, *value_and_grads(layer, x), layer.to_dense()

    layer, y, g, gx, back = per_device(body, xs)
    for i, r in enumerate(RANKS):
        close(layer.weight[i], block(w, r, axis=1))
        close(y[i], want)
        close(gx[i], block(w.T @ c, r) if parallel_in else w.T @ c)
        close(g.weight[i], block(np.outer(c, x), r, axis=1))
        close(g.bias[i], c)  # the whole bias: each device's own, its own gradient
        assert_trees_close(params(device(back, i)), params(dense))


# --------------------------------------------------------------------- MLP --
@eqx.filter_jit
def dense_run(mlp, x, seq):
    """The dense MLP on one process: (mlp(x), its gradients as value_and_grads gives them;
    the gradients of sum(sin(vmap(mlp)(seq))) w.r.t. mlp and seq)."""
    _, g, gx = value_and_grads(mlp, x)
    gs, gseq = eqx.filter_grad(lambda ms: jnp.sum(jnp.sin(jax.vmap(ms[0])(ms[1]))))((mlp, seq))
    return mlp(x), g, gx, jax.vmap(mlp)(seq), gs, gseq


@eqx.filter_jit
def process_run(mlp, x):
    """The same tensor-parallel MLP on the process communicator (split over the P
    processes): its output and gradients, the parameters' gathered into the dense MLP."""
    layer = vnn.ParallelMLP.from_dense(mlp, comm=WORLD)
    y, g, gx = value_and_grads(layer, x)
    return y, g.to_dense(), gx


@pytest.mark.parametrize("depth", [1, 2])
def test_parallel_mlp_equals_dense_and_the_process_communicator(depth):
    """A column/row pair (and, at depth 2, an unpaired last layer, whole on every device):
    the output, the gradients and the gathered layer against the dense MLP, and against
    the layer on the process communicator; `sequence_parallel` on each rank's own block of
    a sequence against the dense MLP on the whole sequence."""
    mlp = fresh(eqx.nn.MLP, 6, 3, F, depth=depth, activation=jnp.tanh,
                final_activation=jax.nn.sigmoid, seed=5)
    x = arr(6, 6)
    seq = arr(7, 2 * N, 6)  # two positions per rank
    y_d, g_d, gx_d, seq_d, gs_d, gseq_d = dense_run(mlp, x, seq)
    y_p, g_p, gx_p = process_run(mlp, x)

    def body(x, xblock):
        c = comm()
        layer = vnn.ParallelMLP.from_dense(mlp, comm=c)
        y, g, gx = value_and_grads(layer, x)

        def seq_loss(mx):  # the whole sequence's loss, one replicated value
            out = mx[0].sequence_parallel(mx[1])
            return vjpmpi.sum_replicated(jnp.sum(jnp.sin(out)), comm=c), out

        (_, out), (gs, gblock) = eqx.filter_value_and_grad(seq_loss, has_aux=True)(
            (layer, xblock))
        return layer, y, g, g.to_dense(), gx, layer.to_dense(), out, gs.to_dense(), gblock

    layer, y, g, g_dense, gx, back, out, gs, gblock = per_device(
        body, copies(x), mine(seq.reshape(N, 2, 6)))
    for i, r in enumerate(RANKS):
        close(layer.layers[0].weight[i], block(mlp.layers[0].weight, r))
        close(layer.layers[1].weight[i], block(mlp.layers[1].weight, r, axis=1))
        close(y[i], y_d)
        close(gx[i], gx_d)
        close(g.layers[0].weight[i], block(g_d.layers[0].weight, r))
        close(g.layers[1].weight[i], block(g_d.layers[1].weight, r, axis=1))
        if depth == 2:  # the unpaired last layer: whole, each device's own gradient
            close(g.layers[2].weight[i], g_d.layers[2].weight)
        assert_trees_close(params(device(g_dense, i)), params(g_d))  # none missing
        assert_trees_close(params(device(back, i)), params(mlp))
        # the process communicator's layer: the same values (its blocks split otherwise)
        close(y[i], y_p)
        close(gx[i], gx_p)
        assert_trees_close(params(device(g_dense, i)), params(g_p))
        # sequence parallelism: this rank's block of the sequence, and its gradients
        close(out[i], block(seq_d, r))
        close(gblock[i], block(gseq_d, r))
        assert_trees_close(params(device(gs, i)), params(gs_d))


# ------------------------------------------------ vocabulary and attention --
@eqx.filter_jit
def dense_lm(emb, head, ids, labels):
    """A dense embedding, head and cross-entropy on one process: (loss, gradients)."""
    def loss(m):
        return jnp.mean(XENT(jax.vmap(m[1])(jax.vmap(m[0])(ids)), labels))

    return eqx.filter_value_and_grad(loss)((emb, head))


def test_vocab_parallel_embedding_head_and_cross_entropy():
    """An embedding split by vocabulary, a head whose logits stay split by vocabulary and
    their cross-entropy: the loss, the gradients and the gathered table."""
    emb = eqx.nn.Embedding(weight=jnp.asarray(arr(8, F, 4)))
    head = fresh(eqx.nn.Linear, 4, F, seed=9)
    gen = np.random.default_rng(10)
    ids, labels = gen.integers(0, F, 6), gen.integers(0, F, 6)
    loss_d, (ge_d, gh_d) = dense_lm(emb, head, ids, labels)

    def body(ids, labels):
        c = comm()
        layers = (vnn.VocabParallelEmbedding.from_dense(emb, comm=c),
                  vnn.ColumnParallelLinear.from_dense(head, comm=c))

        def loss(m):
            logits = jax.vmap(m[1])(jax.vmap(m[0])(ids))  # this rank's block of the vocabulary
            return jnp.mean(vnn.vocab_parallel_cross_entropy(logits, labels, comm=c))

        value, (ge, gh) = eqx.filter_value_and_grad(loss)(layers)
        return layers[0], value, ge, gh, layers[0].to_dense()

    layer, loss, ge, gh, back = per_device(body, copies(ids), copies(labels))
    for i, r in enumerate(RANKS):
        close(layer.weight[i], block(emb.weight, r))
        close(loss[i], loss_d)
        close(ge.weight[i], block(ge_d.weight, r))  # an id's gradient on the rank owning it
        close(gh.weight[i], block(gh_d.weight, r))
        close(gh.bias[i], block(gh_d.bias, r))
        close(back.weight[i], emb.weight)


@eqx.filter_jit
def dense_attention(m, q, kv, mask, key):
    def loss(mq):
        out = mq[0](mq[1], kv, kv, mask, key=key)
        return jnp.sum(jnp.sin(out)), out

    (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)((m, q))
    return out, grads


def test_parallel_multihead_attention_heads_masks_and_dropout_keys():
    """Each rank's heads, with its heads' rows of a per-head mask and of the dropout keys
    (slices by the traced rank): the output and the gradients against the dense layer."""
    heads = N  # one head per rank
    dense = fresh(eqx.nn.MultiheadAttention, heads, 8, qk_size=3, vo_size=2,
                  use_output_bias=True, dropout_p=0.3, seed=11)
    q, kv = arr(12, 5, 8), arr(13, 6, 8)
    mask = np.random.default_rng(19).random((heads, 5, 6)) < 0.7
    mask[:, :, 0] = True
    key = jax.random.PRNGKey(20)
    out_d, (g_d, gq_d) = dense_attention(dense, q, kv, mask, key)

    def body(q, kv, mask, key):
        layer = vnn.ParallelMultiheadAttention.from_dense(dense, comm=comm())

        def loss(mq):
            out = mq[0](mq[1], kv, kv, mask, key=key)
            return jnp.sum(jnp.sin(out)), out

        (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)((layer, q))
        return out, grads

    out, (g, gq) = per_device(body, copies(q), copies(kv), shared=(mask, key))
    for i, r in enumerate(RANKS):
        close(out[i], out_d)
        close(gq[i], gq_d)
        close(g.query_proj.weight[i], block(g_d.query_proj.weight, r))
        close(g.value_proj.weight[i], block(g_d.value_proj.weight, r))
        close(g.output_proj.weight[i], block(g_d.output_proj.weight, r, axis=1))
        close(g.output_proj.bias[i], g_d.output_proj.bias)


# ----------------------------------------------------------- data parallel --
def test_allreduce_and_sync_gradients_over_every_device():
    """Data parallelism: each rank's own batch, the gradients averaged (or summed) over
    all P x D ranks, in one bucket or several; `sync_gradients` equals
    `allreduce_gradients` of the local gradient."""
    model = fresh(eqx.nn.Linear, 3, 2, seed=12)
    xs, ys = arr(13, N, 4, 3), arr(14, N, 4, 2)  # [rank, batch, ...]
    w, b = np.asarray(model.weight), np.asarray(model.bias)
    err = np.einsum("oi,rbi->rbo", w, xs) + b - ys  # each rank's residuals
    gw = 2 / 8 * np.einsum("rbo,rbi->roi", err, xs)  # each rank's gradient of its mean
    gb = 2 / 8 * err.sum(1)

    def body(model, x, y):
        c = comm()

        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        g = eqx.filter_grad(loss)(model)
        return (g, vnn.allreduce_gradients(g, comm=c),
                vnn.allreduce_gradients(g, mean=False, bucket_bytes=16, comm=c),
                eqx.filter_grad(lambda m: loss(vnn.sync_gradients(m, comm=c)))(model),
                eqx.filter_grad(lambda m: loss(vnn.sync_gradients(m, bucket_bytes=16,
                                                                  comm=c)))(model))

    local, mean, total, synced, synced_buckets = per_device(body, copies(model), mine(xs),
                                                            mine(ys))
    for i, r in enumerate(RANKS):
        close(local.weight[i], gw[r])  # this rank's own gradient
        close(local.bias[i], gb[r])
        for g in (mean, synced, synced_buckets):
            close(g.weight[i], gw.mean(0))
            close(g.bias[i], gb.mean(0))
        close(total.weight[i], gw.sum(0))
        close(total.bias[i], gb.sum(0))


def test_errors_name_the_device_communicator_size():
    """A feature count that the P x D ranks do not divide: refused when the layer is built
    (inside the shard_map, at trace time: nothing runs)."""
    dense = eqx.nn.Linear(3, N + 1, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=rf"vjpmpi\.nn\.ColumnParallelLinear: out_features="
                                         rf"{N + 1} is not divisible by the communicator "
                                         rf"size {N}"):
        per_device(lambda v: vnn.ColumnParallelLinear.from_dense(dense, comm=comm()).weight,
                   jnp.zeros((D, 1)))


def test_split_leaves_synced_over_their_own_device_communicator():
    """A tensor-parallel layer over the device communicator (every device a block), its
    gradient synced over that same communicator (`vjpmpi.nn.layout`: split over the very
    ranks synced over): each device's block is kept (mean) or times the size (sum), never
    summed with the other devices' blocks; under JAX's default check_vma."""
    dense = fresh(eqx.nn.Linear, 3, F, seed=21)
    x = arr(22, 3)
    k = F // N
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    t = 1 - np.tanh(w @ x + b) ** 2  # d sum(tanh(Wx + b)) / d(Wx + b)
    gw, gb = np.outer(t, x), t

    def body(layer, x):
        c = comm()
        col = vnn.ColumnParallelLinear.from_dense(layer, c)
        assert isinstance(vnn.layout(col).weight, vnn.Split)

        def loss(m):
            return jnp.sum(jnp.tanh(m(x)))

        g = eqx.filter_grad(loss)(col)
        return (g, vnn.allreduce_gradients(g, comm=c),
                vnn.allreduce_gradients(g, mean=False, comm=c),
                eqx.filter_grad(lambda m: loss(vnn.sync_gradients(m, comm=c)))(col))

    local, mean, total, synced = per_device(body, shared=(dense, x))
    for i, r in enumerate(RANKS):
        rows = slice(r * k, (r + 1) * k)
        close(local.weight[i], gw[rows])
        for g in (mean, synced):
            close(g.weight[i], gw[rows])
            close(g.bias[i], gb[rows])
        close(total.weight[i], N * gw[rows])
