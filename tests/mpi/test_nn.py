"""vjpmpi.nn: every sharded layer equals its single-process equinox reference.

What this file costs is XLA compiling (each jax.random shape alone takes a second or
more on CPU), so: parameters and data are drawn with NumPy (`fresh`), jax.random only
where it is what a test checks (init from a key, dropout keys); the references are
NumPy formulas or one jitted program per dense model; one compiled program per sharded
model gives its output, its gradients and the HLO whose collectives a test counts.
"""

import itertools
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import vjpmpi
import vjpmpi.nn as vnn
from vjpmpi import _mpi

from helpers import _SHAPES_KEY, WORLD, assert_trees_close, fresh, kernel_calls

rank, size = WORLD.rank, WORLD.size
F = 12  # divisible by 1, 2, 3 and 4 ranks
HEADS = 3 if size == 3 else 4  # attention heads: divisible by the rank count
ALLREDUCE = 'custom_call_target="vjpmpi_allreduce"'
ADAM = optax.adam(1e-2)
XENT = optax.softmax_cross_entropy_with_integer_labels


# ------------------------------------------------------------------ helpers --
def arr(seed, *shape, dtype=np.float64):
    """Standard normal NumPy data, the same on every rank."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def close(a, b, tol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def shard_rows(w, axis=0):
    """This rank's block of `w` along `axis` (NumPy)."""
    w = np.asarray(w)
    k = w.shape[axis] // size
    return w[(slice(None),) * axis + (slice(rank * k, (rank + 1) * k),)]


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def sharded_as(local, full):
    """`full`, the single-process model's gradient, cut as the sharded model holds its
    parameters, in the tree structure of `local` (the sharded model's gradient): the
    array leaves pair up in order (the sharded layers keep the dense layers' order), and
    each is kept whole where the shapes agree, else cut to this rank's block of the one
    axis that is `size` times longer."""
    mine, treedef = jax.tree_util.tree_flatten(local)
    theirs = jax.tree_util.tree_leaves(full)
    assert mine and len(mine) == len(theirs), (len(mine), len(theirs))
    out = []
    for a, b in zip(mine, theirs, strict=True):
        b = np.asarray(b)
        split = [ax for ax in range(b.ndim) if b.shape[ax] != a.shape[ax]]
        assert a.ndim == b.ndim and len(split) <= 1, (a.shape, b.shape)
        if split:
            assert b.shape[split[0]] == size * a.shape[split[0]], (a.shape, b.shape)
            b = shard_rows(b, split[0])
        out.append(b)
    return jax.tree_util.tree_unflatten(treedef, out)


def adam_state(model):
    """ADAM.init of the model's parameters flattened into one vector (zeros), made
    without compiling anything."""
    flat = jax.eval_shape(lambda p: ravel_pytree(p)[0], params(model))
    return jax.tree_util.tree_map(lambda s: jnp.asarray(np.zeros(s.shape, s.dtype)),
                                  jax.eval_shape(ADAM.init, flat))


def adam_update(model, g, state):
    """ADAM on the gradient `g` flattened into one vector (Adam acts element-wise, so this
    is optax's Adam on the tree, in a few XLA kernels instead of several per leaf)."""
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params(model))
    flat_g, unflatten = ravel_pytree(g)
    updates, state = ADAM.update(flat_g, state)
    return eqx.apply_updates(model, unflatten(updates)), state


@eqx.filter_jit
def run(model, x):
    """(model(x), gradient of sum(sin(model(x))) w.r.t. the model's parameters, w.r.t.
    x): one forward and one backward pass, one program per model structure."""

    def loss(mx):
        y = mx[0](mx[1])
        return jnp.sum(jnp.sin(y)), y

    (_, y), (g, gx) = eqx.filter_value_and_grad(loss, has_aux=True)((model, x))
    return y, g, gx


def allreduces(model, x):
    """Allreduce calls in what XLA compiled for jit(grad) w.r.t. the parameters and the
    input: the program that `run(model, x)` compiled, read back (not compiled again)."""
    return run.lower(model, x).compile().compiled.as_text().count(ALLREDUCE)


to_dense = eqx.filter_jit(lambda layer: layer.to_dense())  # to_dense in one program

_turns = itertools.count()  # every rank counts the calls below alike


def on_one_rank(compute):
    """compute(), a single-process reference (no MPI inside), run on one rank (each call
    the next, in turn), its result (a pytree of arrays, as NumPy) sent to every rank.
    The other ranks sleep meanwhile: at 3-4 ranks on 2 cores every rank compiling the
    same single-process program would cost 1.5-2 times one."""
    owner = next(_turns) % size
    result = error = None
    if rank == owner:
        try:
            result = jax.tree_util.tree_map(np.asarray, compute())
        except Exception as err:  # noqa: BLE001 (every rank must reach the bcast)
            error = f"{type(err).__name__}: {err}"
    done = WORLD.Ibarrier()
    while not done.Test():
        time.sleep(0.002)
    result, error = WORLD.bcast((result, error), root=owner)
    if error is not None:
        raise AssertionError(f"the reference computed on rank {owner} failed: {error}")
    return result


def adam_step(loss):
    """A jitted Adam step on `loss(model, *data) -> (value, aux)`, returning what the
    tests compare too: (aux, gradient, stepped model, optimizer state)."""

    @eqx.filter_jit
    def step(model, state, *data):
        (_, aux), g = eqx.filter_value_and_grad(loss, has_aux=True)(model, *data)
        return (aux, g, *adam_update(model, g, state))

    return step


# ----------------------------------------------------------- linear layers --
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(gather):
    dense = fresh(eqx.nn.Linear, 7, F, seed=1)
    layer = vnn.ColumnParallelLinear.from_dense(dense, gather_output=gather)
    x = arr(2, 7)
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    want = w @ x + b  # dense(x)
    y, g, gx = run(layer, x)
    close(y, want if gather else shard_rows(want))
    # Gradients equal the single-process ones: the loss is replicated (gather), or
    # its sum over the ranks is the dense loss and the input's gradient sums them.
    c = np.cos(want)
    close(gx, w.T @ c)
    close(g.weight, shard_rows(np.outer(c, x)))
    close(g.bias, shard_rows(c))
    back = to_dense(layer)
    close(back.weight, dense.weight)
    assert_trees_close(params(back), params(dense))


@pytest.mark.parametrize("parallel_in", [False, True])
def test_row_parallel_linear(parallel_in):
    dense = fresh(eqx.nn.Linear, F, 5, seed=3)
    layer = vnn.RowParallelLinear.from_dense(dense, input_is_parallel=parallel_in)
    x = arr(4, F)
    xin = shard_rows(x) if parallel_in else x
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    want = w @ x + b
    y, g, gx = run(layer, xin)
    close(y, want)
    c = np.cos(want)
    close(gx, shard_rows(w.T @ c) if parallel_in else w.T @ c)
    close(g.weight, shard_rows(np.outer(c, x), axis=1))
    close(g.bias, c)
    back = to_dense(layer)
    close(back.weight, dense.weight)
    assert_trees_close(params(back), params(dense))


@pytest.mark.parametrize("depth, use_bias", [(0, True), (1, True), (2, False), (3, True)])
def test_parallel_mlp_any_depth_equals_dense(depth, use_bias):
    mlp = fresh(eqx.nn.MLP, 6, 3, F, depth=depth, activation=jnp.tanh,
                final_activation=jax.nn.sigmoid, use_bias=use_bias,
                use_final_bias=not use_bias, seed=5)
    layer = vnn.ParallelMLP.from_dense(mlp)
    x = arr(6, 6)
    y, g, gx = run(layer, x)
    back = to_dense(layer)  # the round trip gives the dense layer back
    yd, gd, gxd, y_back = on_one_rank(lambda: (*run(mlp, x), run(back, x)[0]))
    close(y, yd)
    close(gx, gxd)
    for i, (mine, ref) in enumerate(zip(g.layers[0].layers if depth == 0 else g.layers,
                                        gd.layers, strict=True)):
        pair, last = i % 2, i + 1 == len(gd.layers)
        if last and i % 2 == 0:  # unpaired last layer: whole on every rank
            close(mine.weight, ref.weight)
        else:  # column layer: rows (and bias) split; row layer: columns split
            close(mine.weight, shard_rows(ref.weight, axis=pair))
            if ref.bias is not None:
                close(mine.bias, ref.bias if pair else shard_rows(ref.bias))
    assert_trees_close(g, sharded_as(g, gd))  # every parameter, none missing
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(mlp)
    assert_trees_close(params(back), params(mlp))
    close(y_back, yd)  # back(x) == mlp(x)
    # one allreduce forward and one backward per column/row pair
    assert allreduces(layer, x) == 2 * (len(mlp.layers) // 2)


@eqx.filter_jit
def inits_from_keys():
    """[(sharded layer drawn from a key and gathered, the dense layer from that key)]:
    one program (drawn eagerly, every jax.random shape would be a compile of its own)."""
    k7, k8, k22 = (jax.random.PRNGKey(k) for k in (7, 8, 22))
    return [(vnn.ColumnParallelLinear(6, F, key=k7).to_dense(), eqx.nn.Linear(6, F, key=k7)),
            (vnn.ParallelMLP(6, 3, F, jnp.tanh, depth=2, key=k8).to_dense(),
             eqx.nn.MLP(6, 3, F, 2, activation=jnp.tanh, key=k8)),
            (vnn.ParallelMultiheadAttention(HEADS, F, key=k22).to_dense(),
             eqx.nn.MultiheadAttention(HEADS, F, key=k22))]


def test_parallel_mlp_init_from_key_and_unsplittable_mlps():
    # sharded init from one key = the same global weights on any number of ranks
    pairs = inits_from_keys()
    assert len(pairs) == 3
    for gathered, dense in pairs:
        assert_trees_close(params(gathered), params(dense))
    learnt = fresh(eqx.nn.MLP, 6, 3, F, 1, activation=eqx.nn.PReLU(), seed=8)
    with pytest.raises(ValueError, match=r"ParallelMLP: a learnt activation"):
        vnn.ParallelMLP.from_dense(learnt)
    with pytest.raises(ValueError, match=r"ParallelMLP: .*scalar"):
        vnn.ParallelMLP.from_dense(fresh(eqx.nn.MLP, "scalar", 3, F, 1, seed=8))



def test_a_dense_layer_of_other_shape_is_refused():
    """`dense=` sliced with other feature counts would give wrong shards: refused, naming
    the layer and the shapes; so is a layer with neither `key` nor `dense`."""
    lin = eqx.nn.Linear(F, 2 * F, key=jax.random.PRNGKey(1))  # weight (2F, F)
    for cls in (vnn.ColumnParallelLinear, vnn.RowParallelLinear):
        name = cls.__name__
        with pytest.raises(ValueError, match=rf"vjpmpi\.nn\.{name}: argument 'dense' has a "
                                             rf"weight of shape \({2 * F}, {F}\), but "
                                             rf"out_features={F} and in_features={2 * F}"):
            cls(2 * F, F, dense=lin)
        with pytest.raises(ValueError, match=rf"vjpmpi\.nn\.{name}: pass `key=`"):
            cls(F, F)
        assert cls(F, 2 * F, dense=lin).to_dense().weight.shape == (2 * F, F)
    emb = eqx.nn.Embedding(F, 3, key=jax.random.PRNGKey(2))
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: argument 'dense' has a "
                                         rf"table of shape \({F}, 3\)"):
        vnn.VocabParallelEmbedding(F, 4, dense=emb)

# ------------------------------------------------------------- vocabulary --
@eqx.filter_jit
def embed(layer, ids):
    """(the embedding of each id, the gradient of sum(sin(...)) w.r.t. the weights)."""

    def loss(m):
        y = jax.vmap(m)(ids)
        return jnp.sum(jnp.sin(y)), y

    (_, y), g = eqx.filter_value_and_grad(loss, has_aux=True)(layer)
    return y, g


def test_vocab_parallel_embedding():
    w = arr(8, F, 4)
    dense = eqx.nn.Embedding(weight=jnp.asarray(w))
    layer = vnn.VocabParallelEmbedding.from_dense(dense)
    ids = np.array([0, 3, F - 1, 5, 3])
    y, g = embed(layer, ids)
    close(y, w[ids])
    gw = np.zeros_like(w)
    np.add.at(gw, ids, np.cos(w[ids]))  # each id's rows get cos of its embedding
    close(g.weight, shard_rows(gw))
    back = layer.to_dense()  # eager
    close(back.weight, dense.weight)
    assert_trees_close(params(back), params(dense))


def xent_loss(fn, logits, labels, weights):
    return jnp.sum(fn(logits, labels) * weights)


# the gradient alone: its compiled HLO is checked
xent_grad = jax.jit(jax.grad(
    lambda lg, labels, w: xent_loss(vnn.vocab_parallel_cross_entropy, lg, labels, w)))


@jax.jit
def xent_more(shard, t, labels, w):
    """vocab_parallel_cross_entropy's losses, JVP and Hessian-vector product."""
    loss = lambda lg: xent_loss(vnn.vocab_parallel_cross_entropy, lg, labels, w)  # noqa: E731
    return (vnn.vocab_parallel_cross_entropy(shard, labels), jax.jvp(loss, (shard,), (t,))[1],
            jax.jvp(jax.grad(loss), (shard,), (t,))[1])


@jax.jit
def xent_reference(logits, t, labels, w):
    """optax's losses, gradient, JVP and Hessian-vector product (one process)."""
    loss = lambda lg: xent_loss(XENT, lg, labels, w)  # noqa: E731
    return (XENT(logits, labels), jax.grad(loss)(logits), jax.jvp(loss, (logits,), (t,))[1],
            jax.jvp(jax.grad(loss), (logits,), (t,))[1])


@pytest.mark.parametrize("dtype, scale, tol", [(jnp.float64, 3.0, 1e-12),
                                               (jnp.float64, 300.0, 1e-12),
                                               (jnp.float32, 3.0, 1e-5)])
def test_vocab_parallel_cross_entropy_equals_optax(dtype, scale, tol):
    vocab = 4 * F  # divisible by 1-4 ranks
    gen = np.random.default_rng(24)
    logits = (gen.standard_normal((3, 5, vocab)) * scale).astype(dtype)
    labels = gen.integers(0, vocab, (3, 5))
    weights = gen.uniform(size=(3, 5)).astype(dtype)
    shard = shard_rows(logits, axis=2)  # this rank's block of the vocabulary
    # forward mode and Hessian-vector products (the same tangent on every rank)
    t = gen.standard_normal(logits.shape).astype(dtype)
    mine, jvp, hvp = xent_more(shard, shard_rows(t, axis=2), labels, weights)
    ref, ref_grad, ref_jvp, ref_hvp = on_one_rank(
        lambda: xent_reference(logits, t, labels, weights))
    close(mine, ref, tol)
    close(xent_grad(shard, labels, weights), shard_rows(ref_grad, axis=2), tol)
    close(jvp, ref_jvp, tol)
    close(hvp, shard_rows(ref_hvp, axis=2), tol)
    # two small allreduces forward (the maximum; the sums), none backward, no gather
    text = xent_grad.lower(shard, labels, weights).compile().as_text()
    assert text.count(ALLREDUCE) == 2
    assert "vjpmpi_allgather" not in text


@eqx.filter_jit
def head_loss(layer, h, labels, fn):
    """(mean of fn on the layer's logits, its gradient w.r.t. the layer's parameters,
    w.r.t. h)."""
    value, (g, gh) = eqx.filter_value_and_grad(
        lambda mh: jnp.mean(fn(jax.vmap(mh[0])(mh[1]), labels)))((layer, h))
    return value, g, gh


def test_vocab_parallel_head_and_loss_train_like_the_dense_head():
    vocab = 4 * F
    head = fresh(eqx.nn.Linear, 8, vocab, seed=27)
    parallel = vnn.ColumnParallelLinear.from_dense(head)  # logits stay split by vocabulary
    h = arr(28, 5, 8)
    labels = np.random.default_rng(29).integers(0, vocab, (5,))
    loss, g, gh = head_loss(parallel, h, labels, vnn.vocab_parallel_cross_entropy)
    loss_d, gd, ghd = on_one_rank(lambda: head_loss(head, h, labels, XENT))
    close(loss, loss_d)
    close(gh, ghd)
    close(g.weight, shard_rows(gd.weight))
    close(g.bias, shard_rows(gd.bias))
    with pytest.raises(ValueError, match=r"vocab_parallel_cross_entropy: labels of shape"):
        vnn.vocab_parallel_cross_entropy(np.zeros((5, F)), labels[:3])


def test_uneven_split_is_a_clear_error():
    if size == 1:
        pytest.skip("any feature count divides 1 rank")
    with pytest.raises(ValueError, match=r"vjpmpi\.nn\.ColumnParallelLinear: out_features=\d+ "
                                         r"is not divisible by the communicator size"):
        # traced, not run: the check is at construction (nothing drawn or compiled)
        eqx.filter_eval_shape(lambda k: vnn.ColumnParallelLinear(3, size * 2 + 1, key=k),
                              _SHAPES_KEY)


def test_float32_equivalence():
    dense = fresh(eqx.nn.MLP, 6, 3, F, depth=1, dtype=jnp.float32, seed=9)
    layer = vnn.ParallelMLP.from_dense(dense)
    x = arr(10, 6, dtype=np.float32)
    y, g, gx = run(layer, x)
    yd, gd, gxd = on_one_rank(lambda: run(dense, x))
    assert y.dtype == gx.dtype == g.layers[0].weight.dtype == jnp.float32
    np.testing.assert_allclose(y, yd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, gxd, rtol=1e-5, atol=1e-6)
    assert_trees_close(g, sharded_as(g, gd), rtol=1e-5, atol=1e-6)


def test_allreduce_gradients_one_call_per_dtype_and_optax():
    a = jnp.asarray  # (no compile: the arrays are made by NumPy)
    tree = {"a": a(np.full(3, rank + 1.0)), "b": [a(np.ones((2, 2)) * rank), a(np.arange(2.0))],
            "c": a(np.ones(2, np.float32) * rank), "n": 7}
    calls = kernel_calls()[0]
    out = vnn.allreduce_gradients(tree)
    assert kernel_calls()[0] - calls == 2  # float64 group + float32 group
    close(out["a"], np.full(3, (size + 1) / 2))
    close(out["b"][0], np.ones((2, 2)) * (size - 1) / 2)
    assert out["c"].dtype == jnp.float32 and out["n"] == 7
    half = (size - 1) / 2  # the mean of the ranks
    assert_trees_close(out, {"a": np.full(3, (size + 1) / 2),
                             "b": [np.ones((2, 2)) * half, np.arange(2.0)],
                             "c": np.ones(2, np.float32) * half, "n": 7})
    summed = vnn.allreduce_gradients(tree, mean=False)
    close(summed["a"], np.full(3, size * (size + 1) / 2))
    assert_trees_close(summed, {"a": np.full(3, size * (size + 1) / 2),
                                "b": [np.ones((2, 2)) * size * half, size * np.arange(2.0)],
                                "c": np.ones(2, np.float32) * size * half, "n": 7})
    # data-parallel SGD with optax: every rank ends with the same parameters
    params_ = {"w": a(np.ones(3))}
    opt = optax.sgd(0.1)
    state = opt.init(params_)

    @jax.jit
    def step(p, s):
        g = vnn.allreduce_gradients(jax.grad(lambda q: jnp.sum((q["w"] * (rank + 1)) ** 2))(p))
        updates, s = opt.update(g, s)
        return optax.apply_updates(p, updates), s, g

    # the single-process gradient of the mean over ranks of sum((w (r+1))^2): 2 c w
    c = np.mean(np.arange(1, size + 1) ** 2)
    for k in range(3):
        params_, state, g = step(params_, state)
        assert_trees_close(g, {"w": np.full(3, 2 * c * (1 - 0.2 * c) ** k)})
    close(params_["w"], np.full(3, (1 - 0.2 * c) ** 3))
    assert all(np.allclose(p, params_["w"]) for p in WORLD.allgather(np.asarray(params_["w"])))
    assert isinstance(_mpi.as_comm(None, "x"), _mpi.CommRef)


# ---------------------------------------------------------------- attention --
@eqx.filter_jit
def attention_step(m, state, q, kv, mask, key, scale):
    """m(q, kv, kv, mask, key=key) and the gradient of scale * sum(sin(...)) w.r.t. m's
    parameters and w.r.t. q, in one program; with an Adam `state`, also one Adam step
    of m (and the new state): the same program checks and trains."""

    def loss(mq):
        out = mq[0](mq[1], kv, kv, mask, key=key)
        return scale * jnp.sum(jnp.sin(out)), out

    (_, out), (g, gq) = eqx.filter_value_and_grad(loss, has_aux=True)((m, q))
    return (out, g, gq) + (() if state is None else adam_update(m, g, state))


@pytest.mark.parametrize("mask_kind, dropout, bias", [
    ("none", 0.0, False), ("2d", 0.0, True), ("per-head", 0.0, False), ("2d", 0.3, True),
    ("per-head", 0.3, False)])
def test_parallel_multihead_attention_equals_dense(mask_kind, dropout, bias):
    dense = fresh(eqx.nn.MultiheadAttention, HEADS, 8, qk_size=3, vo_size=2,
                  use_query_bias=bias, use_value_bias=bias, use_output_bias=bias,
                  dropout_p=dropout, seed=11)
    layer = vnn.ParallelMultiheadAttention.from_dense(dense)
    q, kv = arr(12, 5, 8), arr(13, 6, 8)
    per_head = np.random.default_rng(19).random((HEADS, 5, 6)) < 0.7
    per_head[:, :, 0] = True
    mask = {"none": None, "2d": np.tril(np.ones((5, 6), bool)), "per-head": per_head}[mask_kind]
    drop_key = jax.random.PRNGKey(20)  # dropout: the same per-head keys as the dense layer
    one, trains = np.asarray(1.0), dropout and mask_kind == "per-head"
    mean = np.asarray(1 / (q.shape[0] * 8))  # the training loss: mean(sin(attention))

    def train(m):  # 10 Adam steps, a new dropout key each: (trained m, each step's gradient)
        state, grads = adam_state(m), []
        for i in range(10):
            _, g_i, _, m, state = attention_step(m, state, q, kv, mask,
                                                 jax.random.PRNGKey(100 + i), mean)
            grads.append(g_i)
        return m, grads

    out, g, gq, *_ = attention_step(layer, adam_state(layer) if trains else None, q, kv, mask,
                                    drop_key, one)
    back = to_dense(layer)
    if trains:
        trained, grads = train(layer)
        trained = to_dense(trained)

    def reference():  # the dense layer on one process
        state_d = adam_state(dense) if trains else None
        out_d, gd, gqd, *_ = attention_step(dense, state_d, q, kv, mask, drop_key, one)
        ref = {"out": out_d, "g": gd, "gq": gqd,
               "back": attention_step(back, state_d, q, kv, mask, drop_key, one)[0]}
        if trains:
            ref["trained"], ref["grads"] = train(dense)
            ref["trained"] = params(ref["trained"])
        return ref

    ref = on_one_rank(reference)
    out_d, gd, gqd = ref["out"], ref["g"], ref["gq"]
    close(out, out_d)
    close(gq, gqd)
    close(g.query_proj.weight, shard_rows(gd.query_proj.weight))
    close(g.value_proj.weight, shard_rows(gd.value_proj.weight))
    close(g.output_proj.weight, shard_rows(gd.output_proj.weight, axis=1))
    if bias:
        close(g.value_proj.bias, shard_rows(gd.value_proj.bias))
        close(g.output_proj.bias, gd.output_proj.bias)
    assert_trees_close(g, sharded_as(g, gd))  # every projection, the key's included
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(dense)
    assert_trees_close(params(back), params(dense))
    close(ref["back"], out_d)  # back(q, kv, kv) == dense(q, kv, kv)
    if trains:
        # Adam's steps do not change when a gradient is scaled: compare the gradients too
        for k, (g_k, gd_k) in enumerate(zip(grads, ref["grads"], strict=True)):
            assert_trees_close(g_k, sharded_as(g_k, gd_k), 1e-10, what=f"step {k}: leaf")
        assert_trees_close(params(trained), ref["trained"], 1e-10)


def test_attention_bad_masks_are_clear_errors():
    layer = vnn.ParallelMultiheadAttention.from_dense(
        fresh(eqx.nn.MultiheadAttention, HEADS, 8, seed=21))
    x = np.ones((5, 8))
    with pytest.raises(ValueError, match=r"ParallelMultiheadAttention: mask must have shape"):
        layer(x, x, x, np.ones((1, 5), bool))
    with pytest.raises(ValueError, match=r"ParallelMultiheadAttention: a 3-D mask must have "
                                         r"num_heads=\d rows"):
        layer(x, x, x, np.ones((2, 5, 5), bool))


def test_self_attention_runs_one_backward_allreduce():
    attn = vnn.ParallelMultiheadAttention.from_dense(
        fresh(eqx.nn.MultiheadAttention, HEADS, 8, seed=22))
    x, y = np.ones((5, 8)), np.full((5, 8), 2.0)
    # forward: the output projection's sum; backward: one per distinct input
    assert allreduces(lambda v: attn(v, v, v), x) == 2
    assert allreduces(lambda v: (lambda kv: attn(v, kv, kv))(y * v), x) == 3  # kv: one
    assert allreduces(lambda v: attn(v, y * v, 2 * v), x) == 4
    # a transformer block: attention and MLP, one allreduce forward and one backward each
    block = Block(fresh(eqx.nn.LayerNorm, 8, seed=23), attn, fresh(eqx.nn.LayerNorm, 8, seed=24),
                  vnn.ParallelMLP.from_dense(fresh(eqx.nn.MLP, 8, 8, F, depth=1, seed=25)))
    assert allreduces(block, x) == 4


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


def block_mse(model, x, target):
    out = model(x)
    return jnp.mean((out - target) ** 2), out


block_step = adam_step(block_mse)


def test_transformer_block_20_optax_steps_matches_single_process():
    d, f32 = 8, jnp.float32
    dense = Block(fresh(eqx.nn.LayerNorm, d, dtype=f32, seed=14),
                  fresh(eqx.nn.MultiheadAttention, HEADS, d, dtype=f32, seed=15),
                  fresh(eqx.nn.LayerNorm, d, dtype=f32, seed=16),
                  fresh(eqx.nn.MLP, d, d, F, depth=1, dtype=f32, seed=17))
    parallel = Block(dense.norm1, vnn.ParallelMultiheadAttention.from_dense(dense.attn), dense.norm2,
                     vnn.ParallelMLP.from_dense(dense.mlp))
    x = arr(18, 6, d, dtype=np.float32)
    target = np.cos(x)

    def run20(model):
        state, grads = adam_state(model), []
        for _ in range(20):
            _, g, model, state = block_step(model, state, x, target)
            grads.append(g)
        return model, grads

    # full float32 matmuls: on GPUs XLA's default uses TF32, whose rounding differs
    # between the split and the dense products by more than the tolerance below
    def reference():  # the dense block on one process
        with jax.default_matmul_precision("float32"):
            ref, grads_d = run20(dense)
        return params(ref), grads_d

    with jax.default_matmul_precision("float32"):
        trained, grads = run20(parallel)
    gathered = Block(trained.norm1, to_dense(trained.attn), trained.norm2, to_dense(trained.mlp))
    ref, grads_d = on_one_rank(reference)
    # Adam's steps do not change when a gradient is scaled: compare the gradients too
    for k, (g, gd) in enumerate(zip(grads, grads_d, strict=True)):
        assert_trees_close(g, sharded_as(g, gd), rtol=1e-4, atol=1e-5, what=f"step {k}: leaf")
    assert_trees_close(params(gathered), ref, rtol=1e-4, atol=1e-5)


def test_layers_under_filter_vmap():
    dense = fresh(eqx.nn.Linear, 5, F, seed=15)
    layer = vnn.ColumnParallelLinear.from_dense(dense, gather_output=True)
    xs = arr(16, 7, 5)
    close(eqx.filter_vmap(layer)(xs), xs @ np.asarray(dense.weight).T + np.asarray(dense.bias))
    row_dense = fresh(eqx.nn.Linear, F, 3, seed=17)
    row = vnn.RowParallelLinear.from_dense(row_dense, input_is_parallel=False)
    ys = arr(18, 7, F)
    close(eqx.filter_jit(eqx.filter_vmap(row))(ys),
          ys @ np.asarray(row_dense.weight).T + np.asarray(row_dense.bias))


# ------------------------------------------------------ sequence parallelism --
class SequenceParallelBlock(Block):
    """Block on this rank's block of the sequence (Megatron-LM's sequence parallelism)."""

    def __call__(self, x, mask=None):
        h = jax.vmap(vnn.replicated(self.norm1))(x)
        x = x + self.attn.sequence_parallel(h, mask)
        return x + self.mlp.sequence_parallel(jax.vmap(vnn.replicated(self.norm2))(x))


class Causal(eqx.Module):
    """The dense or tensor-parallel block with an attention mask."""

    inner: Block

    def __call__(self, v, mask):
        h = jax.vmap(self.inner.norm1)(v)
        v = v + self.inner.attn(h, h, h, mask)
        return v + jax.vmap(self.inner.mlp)(jax.vmap(self.inner.norm2)(v))


def full_mse(model, x, target, mask):
    out = Causal(model)(x, mask)
    return jnp.mean((out - target) ** 2), out


def sequence_mse(model, x_block, target_block, mask, n):
    """The global mean squared error, one replicated value, from this rank's block."""
    out = model(x_block, mask)
    return vjpmpi.sum_replicated(jnp.sum((out - target_block) ** 2)) / n, out


full_step, sequence_step = adam_step(full_mse), adam_step(sequence_mse)


def as_block(tree):
    return Block(tree.norm1, tree.attn, tree.norm2, tree.mlp)


@pytest.mark.parametrize("depth", [1, 2])
def test_sequence_parallel_block_equals_the_block(depth):
    d, seq = 8, 12  # seq divisible by 1-4 ranks
    dense = Block(fresh(eqx.nn.LayerNorm, d, seed=31),
                  fresh(eqx.nn.MultiheadAttention, HEADS, d, use_output_bias=True, seed=32),
                  fresh(eqx.nn.LayerNorm, d, seed=33), fresh(eqx.nn.MLP, d, d, F, depth=depth,
                                                             seed=34))
    tp = Block(dense.norm1, vnn.ParallelMultiheadAttention.from_dense(dense.attn), dense.norm2,
               vnn.ParallelMLP.from_dense(dense.mlp))
    sp = SequenceParallelBlock(tp.norm1, tp.attn, tp.norm2, tp.mlp)
    x = arr(35, seq, d)
    target = np.cos(3 * x)
    mask = np.tril(np.ones((seq, seq), bool))
    sp_data = (shard_rows(x), shard_rows(target), mask, target.size)  # this rank's block

    def train(model, step, *data):  # 10 Adam steps: [(output, gradient)], trained model
        state, seen = adam_state(model), []
        for _ in range(10):
            out, g, model, state = step(model, state, *data)
            seen.append((out, g))
        return seen, model

    sp_seen, trained = train(sp, sequence_step, *sp_data)
    _, g_tp, _, _ = full_step(tp, adam_state(tp), x, target, mask)
    gathered = Block(trained.norm1, to_dense(trained.attn), trained.norm2, to_dense(trained.mlp))

    def reference():  # the dense block trained on one process
        seen, ref = train(dense, full_step, x, target, mask)
        return seen, params(ref)

    dense_seen, ref = on_one_rank(reference)
    (out_sp, g_sp), (out_d, g_d) = sp_seen[0], dense_seen[0]  # before the first step
    close(out_sp, shard_rows(out_d))
    assert_trees_close(params(as_block(g_sp)), params(g_tp))
    # ... and the single-process gradient: both distributed ones scaled alike would pass above
    assert_trees_close(as_block(g_sp), sharded_as(as_block(g_sp), g_d))
    # the tensor-parallel layers' collectives become allgathers and reduce_scatters
    # (counted in the step's program: its one forward and one backward pass)
    text = sequence_step.lower(sp, adam_state(sp), *sp_data).as_text()
    pairs = 1 + (len(dense.mlp.layers) // 2)
    assert text.count("vjpmpi_allgather") == text.count("vjpmpi_reduce_scatter") == 2 * pairs

    # 10 Adam steps, against the dense block trained on one process; Adam's steps do
    # not change when a gradient is scaled: compare every step's gradient too
    for k, ((_, g), (_, gd)) in enumerate(zip(sp_seen, dense_seen, strict=True)):
        assert_trees_close(as_block(g), sharded_as(as_block(g), gd), 1e-9, what=f"step {k}: leaf")
    assert_trees_close(params(gathered), ref, 1e-9)
