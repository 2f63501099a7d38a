"""Data-parallel training on a cluster: each rank its slice of the batch, checkpoints.

    mpiexec -n 2 python -m mpi4py examples/train_cluster.py
    mpiexec -n 2 python -m mpi4py examples/train_cluster.py \\
        --checkpoint /tmp/ckpt --every 50 --resume

On Slurm, examples/cluster/train.sbatch runs it with srun (docs/guides/training.md).

An MLP learns scikit-learn's digits (they ship with it: nothing is downloaded).
Every rank holds the whole model. Each step, every rank draws the same global batch
(one seed) and takes its own slice of it by rank. `vjpmpi.nn.sharded_optimizer`
averages the ranks' gradients and keeps 1/size of adamw's state on each rank (ZeRO).
Rank 0 prints the loss averaged over the ranks. With `--checkpoint DIR`, every rank
saves its part every `--every` steps; `--resume` starts from the newest complete
checkpoint in DIR.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse
import os
import socket

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI
from sklearn.datasets import load_digits

import vjpmpi.nn as vnn

TRAIN = 1500  # the first 1500 digits train, the other 297 test


def load_data(dtype):
    """The digits as (images, labels): 1797 rows of 64 pixels, the same on every rank.
    (A larger dataset would be a file that each rank opens with
    `np.load(path, mmap_mode="r")`, so that indexing reads only that rank's rows.)"""
    digits = load_digits()
    return digits.data.astype(dtype) / 16.0, digits.target.astype(np.int32)


# --8<-- [start:data]
def batch_rows(step, batch, seed, n=TRAIN):
    """The rows of the global batch of `step`: a new shuffle each epoch, drawn from
    `seed` and the epoch alone, so every rank (and a resumed run) draws the same."""
    epoch, i = divmod(step, n // batch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[i * batch:(i + 1) * batch]


def my_slice(rows, comm):
    """This rank's part of the global batch's rows (the size divides the batch)."""
    part = len(rows) // comm.size
    return rows[comm.rank * part:(comm.rank + 1) * part]
# --8<-- [end:data]


def cross_entropy(model, x, y):
    logits = jax.vmap(model)(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


# --8<-- [start:step]
def make_step(opt, comm):
    @eqx.filter_jit
    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, x, y)
        # this rank's gradient in; the update of the ranks' mean gradient out
        updates, state = opt.update(grads, state, params(model))
        # the mean of the ranks' losses, for the log
        mean_loss = vjpmpi.allreduce(loss, MPI.SUM, comm=comm) / comm.size
        return eqx.apply_updates(model, updates), state, mean_loss

    return step
# --8<-- [end:step]


def describe(comm):
    """A line on the ranks: how many, on how many nodes, the CPUs each may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    every = comm.gather((socket.gethostname(), cpus), root=0)
    if comm.rank == 0:
        nodes = len({host for host, _ in every})
        cpus = sorted({c for _, c in every if c is not None})
        return f"{comm.size} rank(s) on {nodes} node(s); CPUs per rank: {cpus}"
    return ""


def main(steps=200, batch=64, lr=3e-3, weight_decay=1e-4, checkpoint=None, every=50,
         resume=False, seed=0, log_every=20, dtype=jnp.float32, comm=MPI.COMM_WORLD):
    """Train up to step `steps` (a resumed run goes on to the same number).

    Returns, on every rank, the trained model, the steps this call ran, their losses
    (averaged over the ranks) and the test accuracy."""
    if batch % comm.size or not 0 < batch <= TRAIN:
        raise ValueError(f"--batch {batch}: not a multiple of the {comm.size} "
                         f"rank(s) up to {TRAIN}")
    if every < 1:
        raise ValueError(f"--every {every}: not a positive number of steps")
    log = print if comm.rank == 0 and log_every else (lambda *a: None)
    log(describe(comm))
    x, y = load_data(dtype)
    model = eqx.nn.MLP(64, 10, 64, depth=2, activation=jax.nn.relu, dtype=dtype,
                       key=jax.random.PRNGKey(seed))  # the same on every rank
    # --8<-- [start:loop]
    opt = vnn.sharded_optimizer(optax.adamw(lr, weight_decay=weight_decay), comm=comm)
    state = opt.init(params(model))
    start = 0
    if checkpoint and resume:
        try:  # (no checkpoint yet: start from step 0)
            tree, start = vnn.load_checkpoint(
                checkpoint, {"model": model, "opt": state}, comm=comm)
            model, state = tree["model"], tree["opt"]
            log(f"resumed from {checkpoint} at step {start}")
        except FileNotFoundError:
            log(f"no checkpoint in {checkpoint}: starting at step 0")
    step = make_step(opt, comm)
    losses = []
    for t in range(start, steps):
        rows = my_slice(batch_rows(t, batch, seed), comm)  # this rank's rows
        model, state, loss = step(model, state, x[rows], y[rows])
        losses.append(float(loss))
        done = t + 1
        if log_every and (done % log_every == 0 or done == steps):
            log(f"step {done:5d}  loss {losses[-1]:.4f}")
        if checkpoint and (done % every == 0 or done == steps):
            vnn.save_checkpoint(
                checkpoint, {"model": model, "opt": state}, done, comm=comm)
    # --8<-- [end:loop]
    predict = eqx.filter_jit(lambda m, v: jnp.argmax(jax.vmap(m)(v), axis=-1))
    accuracy = float(jnp.mean(predict(model, x[TRAIN:]) == y[TRAIN:]))
    log(f"test accuracy {accuracy:.4f}")
    return {"model": model, "steps": (start, steps), "losses": losses,
            "accuracy": accuracy}


def parse_args(argv=None):
    """The command line's options, as `main`'s keyword arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps in all")
    parser.add_argument("--batch", type=int, default=64,
                        help="the global batch, a multiple of the number of ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="save checkpoints there (the same path on every node)")
    parser.add_argument("--every", type=int, default=50, metavar="K",
                        help="save every K steps (and after the last)")
    parser.add_argument("--resume", action="store_true",
                        help="start from the newest checkpoint in DIR, if any")
    parser.add_argument("--seed", type=int, default=0)
    return vars(parser.parse_args(argv))


if __name__ == "__main__":
    main(**parse_args())
