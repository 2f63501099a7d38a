"""Cross-entropy on vocabulary-sharded logits (no gather of the logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._mpi import MAX
from .._reductions import allreduce
from .._replicated import sum_replicated
from ._shard import block, comm_ref


def vocab_parallel_cross_entropy(logits_shard: Float[Array, "... vocab_block"],
                                 labels: Int[Array, "..."], comm=None) -> Float[Array, "..."]:
    """Softmax cross-entropy with integer labels, from logits split by vocabulary.

    Each rank holds block `rank` of the vocabulary axis (`vocab / size` entries, as
    `ColumnParallelLinear` without `gather_output` gives it). Equals
    `optax.softmax_cross_entropy_with_integer_labels` on the gathered logits, with two
    small allreduces (the maximum, then the sum of exponentials and the label's logit
    together) and no gather.

    Args:
        logits_shard (Array): this rank's block of the logits, `(..., vocab // size)`.
        labels (Array): integer labels `(...)`, ids in the whole vocabulary, the same on
            every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the vocabulary is split over (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).

    Returns:
        The loss of each position, `(...)` (not averaged), the same on every rank.

    Raises:
        ValueError: `labels`' shape is not `logits_shard`'s leading axes.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        `(..., vocab // size)` and `(...)` -> replicated `(...)`.

    Transpose:
        the loss is one replicated value (`sum_replicated`): each rank's logits get
        their block of `softmax - onehot`, with no communication backward (a custom JVP;
        forward mode adds one allreduce, and second derivatives work).
    """
    ref = comm_ref(comm, "vocab_parallel_cross_entropy")
    width = logits_shard.shape[-1]
    if labels.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"vjpmpi.nn.vocab_parallel_cross_entropy: labels of shape {labels.shape} do not "
            f"match the logits' leading axes {logits_shard.shape[:-1]}")
    start, _ = block(width * ref.size, ref, "vocab_parallel_cross_entropy", "vocab")

    def parts(logits, labels):
        # the maximum only shifts the exponentials; the rule below differentiates the
        # loss directly, so no derivative runs through it
        top = allreduce(jnp.max(logits, axis=-1), MAX, comm=ref)
        shifted = logits - top[..., None]
        local = labels - start
        mine = (local >= 0) & (local < width)
        picked = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None], -1)[..., 0]
        sums = sum_replicated(jnp.stack([jnp.sum(jnp.exp(shifted), axis=-1),
                                         jnp.where(mine, picked, 0)]), comm=ref)
        onehot = mine[..., None] & (jnp.arange(width) == local[..., None])
        return jnp.log(sums[0]) - sums[1], (shifted, sums[0], onehot)

    @jax.custom_jvp
    def xent(logits, labels):
        return parts(logits, labels)[0]

    @xent.defjvp
    def xent_jvp(primals, tangents):  # d loss = sum over the vocabulary of (p - onehot) t
        loss, (shifted, total, onehot) = parts(*primals)
        probs = jnp.exp(shifted) / total[..., None]
        return loss, sum_replicated(jnp.sum((probs - onehot) * tangents[0], axis=-1),
                                    comm=ref)

    return xent(logits_shard, labels)
