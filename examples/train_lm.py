"""Train a small transformer language model with tensor and data parallelism, and check
it against the same model trained on one process.

    mpiexec -n 4 python examples/train_lm.py     # 2 data-parallel x 2 tensor-parallel ranks

The ranks form a 2-D grid (two `Comm.Split`s): tensor-parallel groups of `tp` ranks
(2 when the rank count is even) split the heads, the MLP units and the vocabulary
(`ParallelMultiheadAttention`, `ParallelMLP`, `VocabParallelEmbedding`, a
`ColumnParallelLinear` head and `vocab_parallel_cross_entropy`: the full-vocabulary
logits are never gathered); the data-parallel groups across them train on different
batches, and `sharded_optimizer` keeps 1/dp of the Adam state on each rank. The text
is character-level: Python's own help pages (`pydoc_data`, shipped with CPython), so
nothing is downloaded. Rank 0 shows a progress bar, writes a loss-curve PNG and
compares with plain equinox on one process trained on the same global batches.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import vjpmpi.nn as vnn
from plots import save_loss_curves
from single_process import on_one_rank

COMM = MPI.COMM_WORLD
SEQ, DIM, HEADS, WIDTH = 32, 32, 4, 64  # heads and widths divisible by tp = 1 or 2
MASK = jnp.tril(jnp.ones((SEQ, SEQ), bool))


def corpus(chars=200_000):
    """The first `chars` characters of Python's help pages, as ids, and the alphabet
    (padded to a multiple of 4 entries so that any tp in 1, 2, 4 splits it)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))[:chars]
    alphabet = sorted(set(text))
    alphabet += ["\0"] * (-len(alphabet) % 4)
    index = {c: i for i, c in enumerate(alphabet)}
    return np.array([index[c] for c in text], np.int32), alphabet


class LM(eqx.Module):
    """Embedding + learned positions, one pre-norm transformer block, final norm, head."""

    embed: eqx.Module
    pos: jax.Array
    norm1: eqx.nn.LayerNorm
    attn: eqx.Module
    norm2: eqx.nn.LayerNorm
    mlp: eqx.Module
    norm_f: eqx.nn.LayerNorm
    head: eqx.Module

    def __call__(self, ids):  # (SEQ,) -> logits (SEQ, vocab), or this rank's vocab block
        x = jax.vmap(self.embed)(ids) + self.pos
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, MASK)  # self-attention: one backward allreduce
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return jax.vmap(self.head)(jax.vmap(self.norm_f)(x))


def dense_model(vocab, key):
    k = jax.random.split(key, 5)
    return LM(eqx.nn.Embedding(vocab, DIM, key=k[0]), 0.02 * jax.random.normal(k[1], (SEQ, DIM)),
              eqx.nn.LayerNorm(DIM), eqx.nn.MultiheadAttention(HEADS, DIM, key=k[2]),
              eqx.nn.LayerNorm(DIM), eqx.nn.MLP(DIM, DIM, WIDTH, depth=1, key=k[3]),
              eqx.nn.LayerNorm(DIM), eqx.nn.Linear(DIM, vocab, key=k[4]))


def parallel_model(dense, tp):
    return LM(vnn.VocabParallelEmbedding.from_dense(dense.embed, tp), dense.pos, dense.norm1,
              vnn.ParallelMultiheadAttention.from_dense(dense.attn, tp), dense.norm2,
              vnn.ParallelMLP.from_dense(dense.mlp, tp), dense.norm_f,
              vnn.ColumnParallelLinear.from_dense(dense.head, tp))


def gathered(model):
    return LM(model.embed.to_dense(), model.pos, model.norm1, model.attn.to_dense(), model.norm2,
              model.mlp.to_dense(), model.norm_f, model.head.to_dense())


def batches(ids, steps, batch):
    """The same global batches on every rank: (steps, batch, SEQ + 1) windows."""
    starts = np.random.default_rng(0).integers(0, len(ids) - SEQ - 1, (steps, batch))
    return ids[starts[..., None] + np.arange(SEQ + 1)]


def train(model, data, xent, opt, progress=None, mean_over=None):
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(m, windows):
        logits = jax.vmap(m)(windows[:, :-1])
        return jnp.mean(jax.vmap(xent)(logits, windows[:, 1:]))

    @eqx.filter_jit
    def step(m, s, windows):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, windows)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), s, loss

    losses = []
    for windows in data:
        model, state, loss = step(model, state, jnp.asarray(windows))
        loss = float(loss) if mean_over is None else mean_over.allreduce(float(loss)) / mean_over.size
        losses.append(loss)
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.3f}")
            progress.update()
    return model, losses


def max_param_diff(a, b):
    """The largest difference between two models' parameters (same structure required)."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten(eqx.filter(m, eqx.is_inexact_array))
                          for m in (a, b))
    if ta != tb or not la:
        raise ValueError(f"the models differ in structure:\n{ta}\n{tb}")
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(la, lb, strict=True))


def main(steps=150, batch=12, lr=3e-3, out="examples/out/train_lm.png", show=True):
    size, rank = COMM.size, COMM.rank
    tp = 2 if size % 2 == 0 else 1
    dp = size // tp
    if batch % dp:
        raise ValueError(f"train_lm: the batch of {batch} does not split over {dp} data-parallel groups")
    tp_comm = COMM.Split(color=rank // tp, key=rank)  # ranks sharing one batch
    dp_comm = COMM.Split(color=rank % tp, key=rank)  # ranks holding the same shards
    ids, alphabet = corpus()
    data = batches(ids, steps, batch)
    mine = data[:, dp_comm.rank * (batch // dp):(dp_comm.rank + 1) * (batch // dp)]

    dense = dense_model(len(alphabet), jax.random.PRNGKey(0))
    parallel = parallel_model(dense, tp_comm)
    opt = vnn.sharded_optimizer(optax.adam(lr), comm=dp_comm)
    xent = lambda lg, y: vnn.vocab_parallel_cross_entropy(lg, y, tp_comm)  # noqa: E731
    progress = None
    if show and rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=steps, mininterval=0.5,
                        desc=f"LM on {size} ranks ({dp} data x {tp} tensor parallel)")
    parallel, losses = train(parallel, mine, xent, opt, progress, mean_over=dp_comm)
    if progress is not None:
        progress.close()
    trained = gathered(parallel)  # collective over each tensor-parallel group

    def reference_run():  # the same model and global batches, plain equinox on one process
        reference, ref_losses = train(dense, data, optax.softmax_cross_entropy_with_integer_labels,
                                      optax.adam(lr))
        return {"ref_losses": ref_losses, "max_param_diff": max_param_diff(trained, reference)}

    ref = on_one_rank(reference_run, COMM)
    ref_losses = ref["ref_losses"]
    result = {"tp": tp, "dp": dp, "final_loss": losses[-1], "first_loss": losses[0],
              "reference_final_loss": ref_losses[-1], "max_param_diff": ref["max_param_diff"],
              "max_loss_diff": float(np.max(np.abs(np.subtract(losses, ref_losses))))}
    if rank == 0:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f}); single process "
              f"{ref_losses[-1]:.4f}; largest loss difference {result['max_loss_diff']:.2e}, "
              f"largest parameter difference {result['max_param_diff']:.2e}")
        if out:
            save_loss_curves(out, {f"vjpmpi, {dp} data x {tp} tensor parallel": losses,
                                   "single process": ref_losses},
                             "Character-level transformer on Python's help pages",
                             "cross-entropy (nats per character)")
    tp_comm.Free()
    dp_comm.Free()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="examples/out/train_lm.png")
    args = parser.parse_args()
    main(steps=args.steps, out=args.out)
