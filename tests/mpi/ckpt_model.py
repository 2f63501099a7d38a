"""A small model of every kind of leaf a checkpoint stores, for the checkpoint tests
(tests/mpi/test_checkpoint.py, tests/mpi/ckpt_reshard.py), in float64.

- `lin`: a data-parallel `eqx.nn.Linear` (replicated);
- `col`, `row`: a tensor-parallel pair (`ColumnParallelLinear`, `RowParallelLinear`
  from the same dense layers), split over `comm` (2 -> 4 ranks: another split);
- `moe`: an `ExpertParallelMoE` of 12 experts split over `comm`;
- `stages`: a `PipelineStage` of 12 stacked linear layers over `comm` (the stages
  regrouped: 12 / size layers each; not in the loss, so its optimizer state stays zero);
- the `sharded_optimizer(optax.adam)` state over `comm` (ZeRO shards).

The loss of rank r is `A + size * b_r`: A the tensor-parallel pair's loss on a batch
every rank shares (the replicated-value convention: one loss for the group), b_r this
rank's share of the data-parallel part on its own rows of one global batch
(`sum(y * w) / N + aux / size`). With the optimizer's mean over the ranks, each step
minimizes `A + sum_r b_r`, whatever the number of ranks.

`gather_global` assembles every array leaf's global array on every rank from the
layouts alone (`vjpmpi.nn.layout`, `ShardedState.parts`), independently of the
checkpoint code.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import vjpmpi.nn as vnn
from helpers import fresh
from vjpmpi.nn._layout import leaf_layouts
from vjpmpi.nn._optim import ShardedState, StatePart

D, H, HM, E, N, S = 4, 12, 3, 12, 12, 5  # width, TP hidden, expert hidden, experts, rows
LR = 0.05


@functools.cache
def dense():
    """The whole layers (every rank the same), float64, drawn by NumPy."""
    return (fresh(eqx.nn.Linear, D, D, dtype=jnp.float64, seed=1),
            fresh(eqx.nn.Linear, D, H, dtype=jnp.float64, seed=2),
            fresh(eqx.nn.Linear, H, D, dtype=jnp.float64, seed=3),
            fresh(vnn.ExpertParallelMoE, D, HM, E, comm=MPI.COMM_SELF, seed=4),
            eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, dtype=jnp.float64, key=k))(
                jax.random.split(jax.random.PRNGKey(5), 12)))


def build(comm, salt: float = 0.0):
    """The model split over `comm` (`salt`: added to every array, another model of the
    same structure)."""
    lin, d1, d2, moe, stack = dense()
    m = {"lin": lin, "col": vnn.ColumnParallelLinear.from_dense(d1, comm),
         "row": vnn.RowParallelLinear.from_dense(d2, comm),
         "moe": vnn.ExpertParallelMoE.from_dense(moe, comm),
         "stages": vnn.PipelineStage(stack, comm)}
    if salt:
        m = jax.tree_util.tree_map(lambda a: a + salt if eqx.is_inexact_array(a) else a, m)
    return m


def optimizer(comm):
    return vnn.sharded_optimizer(optax.adam(LR), comm=comm)


def data():
    g = np.random.default_rng(11)
    return g.standard_normal((S, D)), g.standard_normal((N, D)), g.standard_normal((N, D))


def _loss(m, shared, x, w, size):
    a = jnp.mean(jax.vmap(lambda v: m["row"](jax.nn.relu(m["col"](v))))(shared) ** 2)
    y, aux = m["moe"](jax.vmap(m["lin"])(x))
    b = jnp.sum(y * w) / N + 0.1 * aux / size
    return a + size * b, (a, b)


@functools.cache
def stepper(size, rank):
    """One jitted training step at this layout: (model, state) -> (model, state, J)
    with J the objective `A + sum_r b_r` of the model before the step."""
    shared, xs, ws = data()
    rows = slice(rank * N // size, (rank + 1) * N // size)
    x, w = xs[rows], ws[rows]

    def step(m, state, opt):
        g, (a, b) = jax.grad(_loss, has_aux=True)(m, shared, x, w, size)
        u, state = opt.update(g, state, m)
        return eqx.apply_updates(m, u), state, a, b

    return jax.jit(step, static_argnums=2)


def train_step(m, state, comm, opt):
    """One step over `comm` (mpi4py); returns (model, state, J before the step)."""
    m, state, a, b = stepper(comm.Get_size(), comm.Get_rank())(m, state, opt)
    return m, state, float(a) + comm.allreduce(float(b))


def _allgather(comm, x):
    return comm.allgather(np.asarray(x))


def gather_global(tree, comm) -> dict:
    """{key path: the leaf's global array (NumPy)} on every rank of `comm`, for every
    array leaf: split leaves' blocks concatenated, sharded_optimizer state as its
    parameter's global shape. Collective over `comm` (and the leaves' communicators)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    marks = leaf_layouts(tree)
    parts = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardedState)):
        parts += list(node.parts) if isinstance(node, ShardedState) else ["model"]
    out = {}
    for ((path, x), mark, part) in zip(flat, marks, parts, strict=True):
        if not isinstance(x, jax.Array):
            continue
        key = jax.tree_util.keystr(path)
        if isinstance(part, StatePart):
            mark = part.mark
            if part.block:  # a range of the raveled local block: gather the ranges
                c = mark.comm if isinstance(mark, vnn.Split) else None
                where = (c.rank if c else 0, part.lo, part.hi)
                got = comm.allgather((where, np.asarray(x).reshape(-1)))
                blocks = c.size if c else 1
                n = int(np.prod(part.shape))
                rows = np.full((blocks, n), np.nan)
                for (b, lo, hi), v in got:
                    rows[b, lo:hi] = v
                locals_ = [r.reshape(part.shape) for r in rows]
                out[key] = (np.concatenate(locals_, mark.axis) if c else locals_[0])
                continue
        elif part is None:
            mark = None
        if isinstance(mark, vnn.Split):
            out[key] = np.concatenate(_allgather(mark.comm.comm, x), mark.axis)
        else:
            out[key] = np.asarray(x)
    return out
