"""vjpmpi.nn.sharded_optimizer (ZeRO 1/2): step for step equal to plain data
parallelism (allreduce_gradients + the same optax optimizer), with 1/size of the
optimizer state per rank; both against the single-process full-batch gradient (Adam
and RMSprop steps do not change when the gradient is scaled, so a gradient "times size"
bug in both paths would pass the step-for-step comparison alone)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpmpi.nn as vnn

from helpers import WORLD, fresh, rng

rank, size = WORLD.rank, WORLD.size


def batch_loss(p, static, x, y):
    out = jax.vmap(eqx.combine(p["mlp"], static))(x)
    return jnp.mean((out - y) ** 2) + jnp.sum(p["scale"].astype(jnp.float64) ** 2 * 1e-2)


@functools.cache
def model_and_data():
    """A float64 MLP and a float32 vector (two dtype groups, sizes the rank counts do not
    divide), this rank's own batch, and the single-process gradient on every rank's batch
    together: (parameters, this rank's loss, full-batch gradient)."""
    mlp = fresh(eqx.nn.MLP, 5, 2, 7, depth=2, seed=0)
    params = {"mlp": eqx.filter(mlp, eqx.is_inexact_array),
              "scale": jnp.asarray(np.linspace(0.5, 1.5, 3, dtype=np.float32))}
    static = eqx.filter(mlp, eqx.is_inexact_array, inverse=True)
    gen = rng(40)
    x, y = gen.standard_normal((6, 5)), gen.standard_normal((6, 2))

    def loss(p):
        return batch_loss(p, static, x, y)

    # equal batches: the mean of the ranks' losses is the loss of all batches together
    xs, ys = (np.concatenate(WORLD.allgather(a)) for a in (x, y))
    full = eqx.filter_jit(jax.grad(batch_loss))(params, static, xs, ys)
    return params, loss, full


def train(opt, params, loss, sync, steps=12):
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(sync(g), s, p)
        return optax.apply_updates(p, u), s

    history = []
    for _ in range(steps):
        params, state = step(params, state)
        history.append(params)
    return history, state


def first_update(params, history):
    """What the first step added to the parameters (NumPy)."""
    return jax.tree_util.tree_map(lambda a, b: np.asarray(b) - np.asarray(a), params, history[0])


def tol(dtype):
    return 1e-12 if dtype == jnp.float64 else 2e-6


def assert_close_per_dtype(got, want, what):
    """Trees equal in structure (none empty), leaf by leaf to its dtype's tolerance."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), what
    for i, (u, v) in enumerate(zip(jax.tree_util.tree_leaves(want),
                                   jax.tree_util.tree_leaves(got), strict=True)):
        np.testing.assert_allclose(v, u, rtol=tol(u.dtype), atol=tol(u.dtype),
                                   err_msg=f"{what}, leaf {i}")
    assert jax.tree_util.tree_leaves(want), f"{what}: no leaves"


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),  # uses the parameters
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "chain": lambda: optax.chain(optax.scale_by_adam(), optax.scale(-1e-2)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_optimizer_equals_data_parallel_step_for_step(name):
    params, loss, full = model_and_data()
    plain, _ = train(OPTIMIZERS[name](), params, loss, vnn.allreduce_gradients)
    sharded, _ = train(vnn.sharded_optimizer(OPTIMIZERS[name]()), params, loss, lambda g: g)
    assert len(plain) == len(sharded) == 12
    for k, (a, b) in enumerate(zip(plain, sharded, strict=True)):
        assert_close_per_dtype(b, a, f"step {k}")
    if name == "sgd-momentum":
        # The first step of either is -lr times the single-process gradient of all the
        # ranks' batches: the other optimizers' steps do not change when the gradient
        # is scaled, so a gradient "times size" in both paths passes the loop above.
        step = jax.tree_util.tree_map(lambda g: -0.05 * np.asarray(g), full)
        assert_close_per_dtype(first_update(params, plain), step,
                               "allreduce_gradients + sgd: first update")
        assert_close_per_dtype(first_update(params, sharded), step,
                               "sharded_optimizer(sgd): first update")
    # every rank holds the same parameters
    last = np.concatenate([np.ravel(leaf) for leaf in jax.tree_util.tree_leaves(sharded[-1])])
    assert all(np.array_equal(last, other) for other in WORLD.allgather(last))


def test_sum_instead_of_mean():
    params, loss, full = model_and_data()
    plain, _ = train(optax.sgd(0.01), params, loss,
                     lambda g: vnn.allreduce_gradients(g, mean=False), steps=3)
    sharded, _ = train(vnn.sharded_optimizer(optax.sgd(0.01), mean=False), params, loss,
                       lambda g: g, steps=3)
    # the sum of the ranks' gradients is size times the full-batch one: sgd's first
    # step is -0.01 times that, in both paths
    step = jax.tree_util.tree_map(lambda g: -0.01 * size * np.asarray(g), full)
    assert_close_per_dtype(first_update(params, plain), step, "first update, summed")
    assert_close_per_dtype(first_update(params, sharded), step, "sharded first update, summed")
    assert jax.tree_util.tree_structure(plain[-1]) == jax.tree_util.tree_structure(sharded[-1])
    for u, v in zip(jax.tree_util.tree_leaves(plain[-1]), jax.tree_util.tree_leaves(sharded[-1]),
                    strict=True):
        np.testing.assert_allclose(v, u, rtol=1e-6 if u.dtype == jnp.float32 else 1e-12)


def nbytes(tree):
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree) if eqx.is_array(leaf))


def test_state_per_rank_is_one_over_size():
    params, _, _ = model_and_data()
    plain = optax.adam(1e-2).init(params)
    sharded = vnn.sharded_optimizer(optax.adam(1e-2)).init(params)
    n = {dt: sum(leaf.size for leaf in jax.tree_util.tree_leaves(params) if leaf.dtype == dt)
         for dt in (jnp.float64, jnp.float32)}
    # adam keeps two moments per element: each rank those of its block of each dtype's
    # flattened parameters (blocks of n / size rounded up, the last one shorter)
    def mine(count):
        b = -(-count // size)
        return min(count, (rank + 1) * b) - min(count, rank * b)

    blocks = sum(2 * mine(count) * jnp.dtype(dt).itemsize for dt, count in n.items())
    counter = nbytes(plain) - sum(2 * count * jnp.dtype(dt).itemsize for dt, count in n.items())
    assert nbytes(sharded) == blocks + counter
    # the inner optimizer sees the parameters' tree (each leaf its part, as many axes)
    assert (jax.tree_util.tree_structure(sharded[0].mu) ==
            jax.tree_util.tree_structure(plain[0].mu))
    assert ([np.ndim(a) for a in jax.tree_util.tree_leaves(sharded[0].mu)] ==
            [np.ndim(a) for a in jax.tree_util.tree_leaves(plain[0].mu)])
    print(f"\nadam state per rank at {size} ranks: {nbytes(sharded)} bytes, unsharded "
          f"{nbytes(plain)} ({nbytes(sharded) / nbytes(plain):.3f})")


def by_rank(x):
    """(name, scaled by leaf size): element-wise on each element, but not the same on a
    part of a leaf: the numeric comparison of init, not the trace, refuses it."""
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree_util.tree_map(lambda g: g / g.size, u), s))


REFUSED = {
    # the issue's: a global norm above every probe gradient's norm must still be refused
    "clip_by_global_norm": (lambda: optax.chain(optax.clip_by_global_norm(1e6),
                                                optax.adam(1e-2)), "mixes the elements"),
    "lamb": (lambda: optax.lamb(1e-2), "mixes the elements"),  # per-leaf trust ratios
    "adafactor": (lambda: optax.adafactor(1e-2), "mixes the elements"),  # factored moments
    "clip_by_block_rms": (lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(0.1)),
                          "mixes the elements"),
    "shape-dependent": (lambda: optax.chain(by_rank(None), optax.sgd(0.1)),
                        "depends on the parameters' sizes"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_optimizers_that_mix_elements_are_refused_at_init(name):
    """On every rank alike (from the shapes and fixed probes), at init, naming why."""
    make, why = REFUSED[name]
    params, _, _ = model_and_data()
    opt = vnn.sharded_optimizer(make())
    with pytest.raises(ValueError, match=r"vjpmpi\.nn\.sharded_optimizer: the optimizer cannot "
                       r"run on shards of the parameters exactly as on all of them: .*" + why):
        opt.init(params)


def test_a_mask_by_leaf_size_is_refused_where_a_shard_would_see_another():
    """A mask decided in Python from a leaf's size (weight decay on leaves of at least 6
    elements): an 8-element leaf, whose parts on 2 or more ranks have fewer, would lose
    its decay on every rank with no error (each element moved by -0.0015 instead of
    optax's -0.0065 ... -0.0415). `init` refuses it on every rank, whichever rank's shard
    differs; on one rank (the whole leaf) it runs and equals optax."""
    opt = optax.chain(optax.add_decayed_weights(
        0.5, mask=lambda p: jax.tree_util.tree_map(lambda a: a.size >= 6, p)), optax.sgd(0.1))
    params = {"w": jnp.arange(1.0, 9.0), "b": jnp.ones(3)}
    grads = {"w": jnp.full(8, 0.01 * (rank + 1)), "b": jnp.full(3, 0.02 * (rank + 1))}
    sharded = vnn.sharded_optimizer(opt)
    if size > 1:
        with pytest.raises(ValueError, match=r"vjpmpi\.nn\.sharded_optimizer: the optimizer "
                           r"cannot run on shards .*: its update traced on rank \d+'s shard of "
                           r"them is another computation than on the whole parameters: it "
                           r"depends on the parameters' sizes"):
            sharded.init(params)
        return
    got, _ = sharded.update(grads, sharded.init(params), params)
    want, _ = opt.update(vnn.allreduce_gradients(grads), opt.init(params), params)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(want["w"]), -0.1 * (0.01 + 0.5 * np.arange(1, 9)),
                               rtol=1e-6)  # (the decay acts on the whole leaf)


def decay_matrices():  # weight decay on matrices only: a mask by number of axes
    return optax.chain(optax.add_decayed_weights(
        0.1, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)), optax.sgd(0.05))


def by_label():  # another optimizer per leaf, by its position in the tree
    return optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.05, momentum=0.9)},
        lambda p: {"mlp": jax.tree_util.tree_map(lambda _: "adam", p["mlp"]), "scale": "sgd"})


@pytest.mark.parametrize("make", [decay_matrices, by_label], ids=["mask-by-ndim", "labels"])
def test_masks_and_labels_act_as_on_the_whole_tree(make):
    """The inner optimizer sees the parameters' tree: masks and labels by position or
    number of axes give the same steps as plain data parallelism (they used to see one
    flat vector per dtype)."""
    params, loss, _ = model_and_data()
    plain, _ = train(make(), params, loss, vnn.allreduce_gradients, steps=6)
    sharded, _ = train(vnn.sharded_optimizer(make()), params, loss, lambda g: g, steps=6)
    for k, (a, b) in enumerate(zip(plain, sharded, strict=True)):
        assert_close_per_dtype(b, a, f"step {k}")
    # the decay did act (the steps differ from sgd's without it)
    if make is decay_matrices:
        bare, _ = train(optax.sgd(0.05), params, loss, vnn.allreduce_gradients, steps=1)
        w = params["mlp"].layers[0].weight
        assert not np.allclose(np.asarray(sharded[0]["mlp"].layers[0].weight),
                               np.asarray(bare[0]["mlp"].layers[0].weight)), w.shape
