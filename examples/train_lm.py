"""Train a small transformer language model with pipeline, tensor and data parallelism,
and check it against the same model trained on one process.

    mpiexec -n 4 python examples/train_lm.py               # 2 data x 2 tensor parallel
    mpiexec -n 4 python examples/train_lm.py --pipeline 2  # 2 pipeline stages x 2 tensor
    mpiexec -n 8 python examples/train_lm.py --pipeline 2  # 2 x 2 x 2: the 3-D grid
    mpiexec -n 4 python examples/train_lm.py --experts 8   # 4 data x expert parallel
    mpiexec -n 2 python examples/train_lm.py --checkpoint ck --every 50 --stop 100
    mpiexec -n 4 python examples/train_lm.py --checkpoint ck  # resumed at step 100, 4 ranks

The ranks form a grid of `pipeline` stages x data-parallel groups x tensor-parallel
groups (`Comm.Split`s): tensor-parallel groups of `tp` ranks (2 when the ranks per
stage are even) split the heads, the MLP units and the vocabulary
(`ParallelMultiheadAttention`, `ParallelMLP`, `VocabParallelEmbedding`, a
`ColumnParallelLinear` head and `vocab_parallel_cross_entropy`: the full-vocabulary
logits are never gathered); the data-parallel groups across them train on different
batches, and `sharded_optimizer` keeps 1/dp of the Adam state on each rank. With
`--pipeline p` the model has p transformer blocks, one per stage (the embedding on the
first, the head and the loss on the last), and each step runs the batch as
micro-batches under the 1F1B schedule (`pipeline_value_and_grad`). With `--experts N`
each block's MLP is a mixture of N experts (`ExpertParallelMoE`, top-2, its
load-balancing loss added) split over the ranks, which are all data parallel: each
rank routes its own batch's tokens to the experts' ranks and back. The text is
character-level: Python's own help pages (`pydoc_data`, shipped with CPython), so
nothing is downloaded. Rank 0 shows a progress bar, writes a loss-curve PNG and
compares with plain equinox on one process trained on the same global batches.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse
import json
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import vjpmpi.nn as vnn
from plots import save_loss_curves
from progress import StepBar
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


class Block(eqx.Module):
    """One pre-norm transformer block."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.Module
    norm2: eqx.nn.LayerNorm
    mlp: eqx.Module

    def __call__(self, x):  # (SEQ, DIM) -> (SEQ, DIM)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, MASK)  # self-attention: one backward allreduce
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class LM(eqx.Module):
    """Embedding + learned positions, transformer blocks, final norm, head; or a run of
    them (a pipeline stage: the embedding on the first only, the head on the last)."""

    embed: eqx.Module | None
    pos: jax.Array | None
    blocks: tuple
    norm_f: eqx.nn.LayerNorm | None
    head: eqx.Module | None

    def __call__(self, x):  # ids (SEQ,) or activations (SEQ, DIM) -> activations or logits
        if self.embed is not None:  # (SEQ, vocab) logits, or this rank's vocab block
            x = jax.vmap(self.embed)(x) + self.pos
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = jax.vmap(self.head)(jax.vmap(self.norm_f)(x))
        return x


def dense_model(vocab, key, depth=1):
    k = jax.random.split(key, 5)
    blocks = tuple(Block(eqx.nn.LayerNorm(DIM), eqx.nn.MultiheadAttention(
                             HEADS, DIM, key=jax.random.fold_in(k[2], i) if i else k[2]),
                         eqx.nn.LayerNorm(DIM), eqx.nn.MLP(
                             DIM, DIM, WIDTH, depth=1, key=jax.random.fold_in(k[3], i) if i else k[3]))
                   for i in range(depth))
    return LM(eqx.nn.Embedding(vocab, DIM, key=k[0]), 0.02 * jax.random.normal(k[1], (SEQ, DIM)),
              blocks, eqx.nn.LayerNorm(DIM), eqx.nn.Linear(DIM, vocab, key=k[4]))


def stage_of(model, s, stages):
    """Pipeline stage s of `stages`: block s, with the embedding first and the head last."""
    first, last = s == 0, s == stages - 1
    return LM(model.embed if first else None, model.pos if first else None,
              model.blocks[s:s + 1] if stages > 1 else model.blocks,
              model.norm_f if last else None, model.head if last else None)


def parallel_model(dense, tp):
    def block(b):
        return Block(b.norm1, vnn.ParallelMultiheadAttention.from_dense(b.attn, tp), b.norm2,
                     vnn.ParallelMLP.from_dense(b.mlp, tp))

    return LM(None if dense.embed is None else vnn.VocabParallelEmbedding.from_dense(dense.embed, tp),
              dense.pos, tuple(block(b) for b in dense.blocks), dense.norm_f,
              None if dense.head is None else vnn.ColumnParallelLinear.from_dense(dense.head, tp))


def gathered(model):
    def block(b):
        return Block(b.norm1, b.attn.to_dense(), b.norm2, b.mlp.to_dense())

    return LM(None if model.embed is None else model.embed.to_dense(), model.pos,
              tuple(block(b) for b in model.blocks), model.norm_f,
              None if model.head is None else model.head.to_dense())


def joined(stages):
    """The whole model from its stages (in order)."""
    return LM(stages[0].embed, stages[0].pos, sum((s.blocks for s in stages), ()),
              stages[-1].norm_f, stages[-1].head)


def batches(ids, steps, batch):
    """The same global batches on every rank: (steps, batch, SEQ + 1) windows."""
    starts = np.random.default_rng(0).integers(0, len(ids) - SEQ - 1, (steps, batch))
    return ids[starts[..., None] + np.arange(SEQ + 1)]


def resumed(model, state, checkpoint):
    """`(model, state, step)` from the newest checkpoint in `checkpoint.directory` (the
    arrays this rank holds now, whatever the rank count that saved them), else as given
    at step 0."""
    if checkpoint is None:
        return model, state, 0
    try:
        tree, step = vnn.load_checkpoint(checkpoint.directory, {"model": model, "opt": state},
                                         comm=COMM)
    except FileNotFoundError:
        return model, state, 0
    if COMM.rank == 0:
        print(f"resumed from step {step} of {checkpoint.directory}")
    return tree["model"], tree["opt"], step


def run(step, model, state, data, checkpoint, progress, mean_over):
    """`step` over `data` from the checkpoint's step (or 0) to its `stop` (or the end),
    saving every `checkpoint.every` steps; returns the model, the state, the losses (the
    mean over `mean_over`) and the first step run."""
    model, state, start = resumed(model, state, checkpoint)
    stop = len(data) if checkpoint is None or checkpoint.stop is None else checkpoint.stop
    losses = []
    for i in range(start, stop):
        model, state, loss = step(model, state, jnp.asarray(data[i]))
        loss = float(loss) if mean_over is None else mean_over.allreduce(float(loss)) / mean_over.size
        losses.append(loss)
        if checkpoint is not None and checkpoint.every and (i + 1) % checkpoint.every == 0:
            vnn.save_checkpoint(checkpoint.directory, {"model": model, "opt": state}, i + 1,
                                comm=COMM)
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.3f}")
            progress.update()
    return model, state, losses, start


class Checkpoint(NamedTuple):
    """Where to save (`--checkpoint DIR`), every how many steps, and a step to stop at
    (None: the end), as if the job ended there."""

    directory: str
    every: int
    stop: int | None = None


def train(model, data, xent, opt, progress=None, mean_over=None, pipeline=None,
          checkpoint=None):
    """Adam steps over `data` ((steps, batch, SEQ + 1) windows); with `pipeline` (a
    `(comm, micro)` pair), `model` is this rank's stage, run by the 1F1B schedule; with
    `checkpoint`, resumed from its newest step and saved every `checkpoint.every` steps."""
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(m, windows):
        logits = jax.vmap(m)(windows[:, :-1])
        return jnp.mean(jax.vmap(xent)(logits, windows[:, 1:]))

    if pipeline is None:
        value_and_grad = eqx.filter_value_and_grad(loss_fn)
    else:
        comm, micro = pipeline
        first, last = comm.rank == 0, comm.rank == comm.size - 1
        schedule = vnn.one_f_one_b(comm.size, micro)

        def value_and_grad(m, windows):  # windows: this data group's batch
            mb = windows.reshape(micro, -1, SEQ + 1)  # micro-batches
            act = jax.ShapeDtypeStruct((mb.shape[1], SEQ, DIM), m.blocks[0].norm1.weight.dtype)
            loss, grads = vnn.pipeline_value_and_grad(
                Batched(m), lambda lg, y: jnp.mean(jax.vmap(xent)(lg, y)),
                mb[:, :, :-1] if first else None, mb[:, :, 1:] if last else None,
                schedule=schedule, activation=act, comm=comm)
            return loss, grads.model

    @eqx.filter_jit
    def step(m, s, windows):
        loss, grads = value_and_grad(m, windows)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), s, loss

    model, _, losses, start = run(step, model, state, data, checkpoint, progress, mean_over)
    return model, losses, start


class Batched(eqx.Module):
    """A stage applied to a micro-batch."""

    model: LM

    def __call__(self, x):
        return jax.vmap(self.model)(x)


def max_param_diff(a, b):
    """The largest difference between two models' parameters (same structure required)."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten(eqx.filter(m, eqx.is_inexact_array))
                          for m in (a, b))
    if ta != tb or not la:
        raise ValueError(f"the models differ in structure:\n{ta}\n{tb}")
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(la, lb, strict=True))


def compared(losses, ref, grid, out, title, ylabel, **layout):
    """The run's figures next to the one-process reference's (`ref`: its losses and the
    largest parameter difference); rank 0 prints them and saves the loss curves."""
    ref_losses = ref["ref_losses"]
    result = {**layout, "final_loss": losses[-1], "first_loss": losses[0],
              "reference_final_loss": ref_losses[-1], "max_param_diff": ref["max_param_diff"],
              "max_loss_diff": float(np.max(np.abs(np.subtract(losses, ref_losses))))}
    if COMM.rank == 0:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f}); single process "
              f"{ref_losses[-1]:.4f}; largest loss difference {result['max_loss_diff']:.2e}, "
              f"largest parameter difference {result['max_param_diff']:.2e}")
        if out:
            save_loss_curves(out, {f"vjpmpi, {grid}": losses, "single process": ref_losses},
                             title, ylabel)
    return result


# ------------------------------------------------------ mixture of experts --
AUX = 0.01  # the load-balancing loss's weight


class MoEBlock(eqx.Module):
    """A pre-norm block whose MLP is a mixture of experts, on a batch of windows (the
    experts see every token of this rank's batch at once)."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    moe: vnn.ExpertParallelMoE

    def __call__(self, x):  # (batch, SEQ, DIM) -> (batch, SEQ, DIM), aux
        h = jax.vmap(jax.vmap(self.norm1))(x)
        x = x + jax.vmap(lambda v: self.attn(v, v, v, MASK))(h)
        y, aux = self.moe(jax.vmap(jax.vmap(self.norm2))(x).reshape(-1, DIM))
        return x + y.reshape(x.shape), aux


class MoELM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: tuple
    norm_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __call__(self, windows):  # ids (batch, SEQ) -> logits (batch, SEQ, vocab), aux
        x = jax.vmap(jax.vmap(self.embed))(windows) + self.pos
        aux = 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return jax.vmap(jax.vmap(self.head))(jax.vmap(jax.vmap(self.norm_f))(x)), aux


def moe_model(vocab, experts, key, comm):
    """The dense model's embedding, attention and head with MoE blocks; the experts split
    over `comm` (MPI.COMM_SELF: every expert here, the one-process model)."""
    d = dense_model(vocab, key)
    moe = vnn.ExpertParallelMoE(DIM, WIDTH, experts, top_k=2, comm=MPI.COMM_SELF,
                                key=jax.random.fold_in(key, 99))
    if comm.size > 1:
        moe = vnn.ExpertParallelMoE.from_dense(moe, comm)
    b = d.blocks[0]
    return MoELM(d.embed, d.pos, (MoEBlock(b.norm1, b.attn, b.norm2, moe),), d.norm_f, d.head)


def train_moe(model, data, lr, comm, progress=None, checkpoint=None):
    """Adam steps of the MoE model, each rank on its own windows, through one
    `sharded_optimizer`: `vjpmpi.nn.layout` tells it that the experts are split (their
    gradients hold every rank's tokens' part already: kept on their rank, divided by the
    ranks for the mean) and the rest replicated (averaged over the ranks, its state
    sharded). Every rank adds the same load-balancing loss to its own: the mean over the
    ranks counts it once, as one process does."""
    opt = vnn.sharded_optimizer(optax.adam(lr), comm=comm) if comm.size > 1 else optax.adam(lr)
    states = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(m, windows):
        logits, aux = m(windows[:, :-1])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
        return jnp.mean(xent) + AUX * aux

    @eqx.filter_jit
    def step(m, states, windows):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, windows)
        updates, states = opt.update(grads, states)
        return eqx.apply_updates(m, updates), states, loss

    model, _, losses, start = run(step, model, states, data, checkpoint, progress, comm)
    return model, losses, start


def main_moe(experts, steps, batch, lr, out, show, checkpoint=None):
    size, rank = COMM.size, COMM.rank
    if batch % size or experts % size:
        raise ValueError(f"train_lm: the batch of {batch} and the {experts} experts must "
                         f"split over the {size} ranks")
    ids, alphabet = corpus()
    data = batches(ids, steps, batch)
    mine = data[:, rank * (batch // size):(rank + 1) * (batch // size)]
    key = jax.random.PRNGKey(0)
    model = moe_model(len(alphabet), experts, key, COMM)
    progress = None
    grid = f"{size} data x expert parallel, {experts} experts"
    if show and rank == 0:
        progress = StepBar(steps, f"MoE LM on {size} ranks")
    model, losses, start = train_moe(model, mine, lr, COMM, progress, checkpoint)
    stop = start + len(losses)
    if progress is not None:
        progress.close()
    moe = [blk.moe.to_dense() for blk in model.blocks]  # (a collective: every rank)
    trained = eqx.tree_at(lambda m: [blk.moe for blk in m.blocks], model, moe)
    trained = jax.tree_util.tree_map(np.asarray, eqx.filter(trained, eqx.is_array))

    def reference_run():
        reference, ref_losses, _ = train_moe(
            moe_model(len(alphabet), experts, key, MPI.COMM_SELF), data[:stop], lr, MPI.COMM_SELF)
        return {"ref_losses": ref_losses[start:],
                "max_param_diff": max_param_diff(trained, eqx.filter(reference, eqx.is_array))}

    return compared(losses, on_one_rank(reference_run, COMM), grid, out,
                    "Character-level MoE transformer on Python's help pages",
                    "cross-entropy + load balancing", pp=1, tp=1, dp=size, experts=experts)


def main(steps=150, batch=12, lr=3e-3, pipeline=1, micro=3, out="examples/out/train_lm.png",
         show=True, experts=0, checkpoint=None):
    """Train at this job's rank count and compare with one process (rank 0 prints it).

    `checkpoint` (a `Checkpoint`): resume from its directory's newest step (saved at any
    rank count), save every `every` steps, stop at `stop`; the losses and the comparison
    are then those of the steps this run took."""
    if checkpoint is not None and pipeline != 1:
        raise ValueError("train_lm: --checkpoint runs without --pipeline (this model's stages "
                         "hold different layers under the same names)")
    if experts:
        if pipeline != 1:
            raise ValueError("train_lm: --experts runs without --pipeline (data x expert parallel)")
        return main_moe(experts, steps, batch, lr, out, show, checkpoint)
    size, rank = COMM.size, COMM.rank
    if pipeline < 1 or size % pipeline:
        raise ValueError(f"train_lm: {size} ranks do not split into {pipeline} pipeline stages")
    per_stage = size // pipeline
    tp = 2 if per_stage % 2 == 0 else 1
    dp = per_stage // tp
    if batch % dp or (pipeline > 1 and (batch // dp) % micro):
        raise ValueError(f"train_lm: the batch of {batch} does not split over {dp} data-parallel "
                         f"groups" + (f" into {micro} micro-batches" if pipeline > 1 else ""))
    # rank = (stage * dp + data group) * tp + tensor index
    stage, group, shard = rank // per_stage, (rank // tp) % dp, rank % tp
    tp_comm = COMM.Split(color=rank // tp, key=rank)  # ranks sharing one batch and stage
    dp_comm = COMM.Split(color=stage * tp + shard, key=rank)  # ranks holding the same shards
    pp_comm = COMM.Split(color=group * tp + shard, key=stage)  # one rank per stage
    ids, alphabet = corpus()
    data = batches(ids, steps, batch)
    mine = data[:, group * (batch // dp):(group + 1) * (batch // dp)]

    dense = dense_model(len(alphabet), jax.random.PRNGKey(0), depth=pipeline)
    parallel = parallel_model(stage_of(dense, stage, pipeline), tp_comm)
    opt = vnn.sharded_optimizer(optax.adam(lr), comm=dp_comm)
    xent = lambda lg, y: vnn.vocab_parallel_cross_entropy(lg, y, tp_comm)  # noqa: E731
    progress = None
    grid = f"{dp} data x {tp} tensor parallel"
    if pipeline > 1:
        grid = f"{pipeline} pipeline x " + grid
    if show and rank == 0:
        progress = StepBar(steps, f"LM on {size} ranks ({grid})")
    parallel, losses, start = train(parallel, mine, xent, opt, progress, mean_over=dp_comm,
                                    pipeline=(pp_comm, micro) if pipeline > 1 else None,
                                    checkpoint=checkpoint)
    stop = start + len(losses)
    if progress is not None:
        progress.close()
    mine = gathered(parallel)  # collective over each tensor-parallel group
    stages = pp_comm.gather(jax.tree_util.tree_map(np.asarray, eqx.filter(mine, eqx.is_array)),
                            root=0)  # every stage's arrays to rank 0
    trained = joined(stages) if rank == 0 else None

    def reference_run():  # the same model and global batches, plain equinox on one process
        reference, ref_losses, _ = train(dense, data[:stop],
                                         optax.softmax_cross_entropy_with_integer_labels,
                                         optax.adam(lr))
        return {"ref_losses": ref_losses[start:],
                "max_param_diff": max_param_diff(trained, reference)}

    result = compared(losses, on_one_rank(reference_run, COMM), grid, out,
                      "Character-level transformer on Python's help pages",
                      "cross-entropy (nats per character)", pp=pipeline, tp=tp, dp=dp)
    for comm in (tp_comm, dp_comm, pp_comm):
        comm.Free()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--micro", type=int, default=3, help="micro-batches per step (pipeline)")
    parser.add_argument("--experts", type=int, default=0,
                        help="a mixture of this many experts in each block, split over the ranks")
    parser.add_argument("--out", default="examples/out/train_lm.png")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="resume from DIR's newest checkpoint (saved at any rank count) "
                             "and save one every --every steps")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop", type=int, default=None,
                        help="stop after this step (as if the job ended there)")
    parser.add_argument("--json", metavar="FILE", help="rank 0 writes the figures here")
    args = parser.parse_args()
    result = main(steps=args.steps, pipeline=args.pipeline, micro=args.micro, out=args.out,
                  experts=args.experts, checkpoint=Checkpoint(args.checkpoint, args.every,
                                                              args.stop) if args.checkpoint else None)
    if args.json and COMM.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f)
