"""Vocabulary-parallel embedding."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._mpi import CommRef
from .._replicated import sum_replicated
from ._shard import block, comm_ref, gather_blocks, take_block


class VocabParallelEmbedding(eqx.Module):
    """`eqx.nn.Embedding` with the vocabulary (rows) split over `comm`.

    Rank `r` holds rows `r * num_embeddings // size` to
    `(r + 1) * num_embeddings // size` of the table. Each rank looks up the ids in its
    range (zeros elsewhere) and the results are summed with `sum_replicated`; an id's
    gradient lands on the rank that owns it. Built from `key`, it holds the rows of
    `eqx.nn.Embedding(num_embeddings, embedding_size, key=key)`.

    On a device communicator (`vjpmpi.device_comm`, the layer built inside the
    `jax.shard_map` body) every device is a rank: it keeps the block of its rank (a traced
    value, sliced with `jax.lax.dynamic_slice`), and each of its parameters varies over
    the mesh axis (each device's own copy, as each process's on a process communicator),
    so that its gradient is the device's own; pass it out of the shard_map split over the
    axis (`out_specs=P(axis)`) and back in the same way.

    Args:
        num_embeddings (int): the vocabulary's size (all ranks together), divisible by
            the communicator's size.
        embedding_size (int): the size of each embedding vector.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the vocabulary is split over (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        key (jax.random.PRNGKey | None): the initialisation key, the same on every rank
            (each rank draws the whole table and keeps its rows); needed unless `dense`
            is given.
        dense (eqx.nn.Embedding | None): a whole table (the same on every rank) to split
            instead of drawing one (what `from_dense` passes); `num_embeddings` and
            `embedding_size` must be its own.

    Raises:
        ValueError: neither `key` nor `dense` is given, `dense` has a table of shape other than `(num_embeddings, embedding_size)`,
            or `num_embeddings` is not divisible by the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        replicated token ids `(...)` -> replicated `(..., embedding_size)`.

    Transpose:
        the lookups are summed with `sum_replicated`: one allreduce forward, none
        backward (each rank's rows get the cotangents of the ids it owns).
    """

    weight: Float[Array, "vocab_block dim"]
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, num_embeddings: int, embedding_size: int, *, comm=None,
                 key: PRNGKeyArray | None = None, dense: eqx.nn.Embedding | None = None):
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.VocabParallelEmbedding: pass `key=` or use `from_dense`")
            dense = eqx.nn.Embedding(num_embeddings, embedding_size, key=key)
        elif tuple(dense.weight.shape) != (num_embeddings, embedding_size):
            raise ValueError("vjpmpi.nn.VocabParallelEmbedding: argument 'dense' has a table "
                             f"of shape {tuple(dense.weight.shape)}, but num_embeddings="
                             f"{num_embeddings} and embedding_size={embedding_size} make "
                             f"{(num_embeddings, embedding_size)}")
        self.comm = comm_ref(comm, "VocabParallelEmbedding")
        self.weight = take_block(dense.weight, self.comm, "VocabParallelEmbedding",
                                 "num_embeddings")
        self.num_embeddings, self.embedding_size = num_embeddings, embedding_size

    @classmethod
    def from_dense(cls, layer: eqx.nn.Embedding, comm=None):
        """Slice a standard `eqx.nn.Embedding` (same on every rank) into this rank's rows.

        Args:
            layer (eqx.nn.Embedding): the whole table, the same on every rank.
            comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
                communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
                `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the
                ranks).

        Returns:
            (VocabParallelEmbedding): the layer holding this rank's rows of `layer`.

        Raises:
            ValueError: `layer.num_embeddings` is not divisible by the communicator's size.
            TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
                or None.
        """
        return cls(layer.num_embeddings, layer.embedding_size, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.Embedding:
        """Gather the rows into an `eqx.nn.Embedding` on every rank (an allgather: every
        rank must call it).

        Returns:
            The whole `eqx.nn.Embedding`, `(num_embeddings, embedding_size)`, the same on
                every rank.
        """
        weight = gather_blocks(self.weight, self.comm, 0)
        return eqx.nn.Embedding(weight=weight)

    def __call__(self, ids: Int[Array, "..."], *, key=None) -> Float[Array, "... dim"]:
        """Look up token ids, the same on every rank.

        Args:
            ids (Array): integer token ids of any shape `(...)`, in the whole vocabulary,
                the same on every rank.
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            The embeddings, `(..., embedding_size)`, the same on every rank (an id that
                no rank holds, outside `[0, num_embeddings)`, gives zeros).
        """
        start, stop = block(self.num_embeddings, self.comm, "VocabParallelEmbedding",
                            "num_embeddings")
        mine = (ids >= start) & (ids < stop)
        local = jnp.where(mine, ids - start, 0)
        vectors = jnp.where(mine[..., None], self.weight[local], 0)
        return sum_replicated(vectors, comm=self.comm)
