"""Vocabulary-parallel embedding."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._mpi import CommRef
from .._replicated import sum_replicated
from ._shard import block, comm_ref, gather_blocks


class VocabParallelEmbedding(eqx.Module):
    """`eqx.nn.Embedding` with the vocabulary (rows) split over `comm`.

    Shape: replicated token ids `Int[Array, "..."]` -> replicated `Float[Array, "... dim"]`.
    Each rank looks up the ids in its range (zeros elsewhere) and the results are
    summed with `sum_replicated`; an id's gradient lands on the rank that owns it.
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
        self.comm = comm_ref(comm, "VocabParallelEmbedding")
        start, stop = block(num_embeddings, self.comm, "VocabParallelEmbedding", "num_embeddings")
        self.weight = dense.weight[start:stop]
        self.num_embeddings, self.embedding_size = num_embeddings, embedding_size

    @classmethod
    def from_dense(cls, layer: eqx.nn.Embedding, comm=None):
        """Slice a standard `eqx.nn.Embedding` (same on every rank) into this rank's rows."""
        return cls(layer.num_embeddings, layer.embedding_size, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.Embedding:
        weight = gather_blocks(self.weight, self.comm, 0)
        return eqx.nn.Embedding(weight=weight)

    def __call__(self, ids: Int[Array, "..."], *, key=None) -> Float[Array, "... dim"]:
        start, stop = block(self.num_embeddings, self.comm, "VocabParallelEmbedding",
                            "num_embeddings")
        mine = (ids >= start) & (ids < stop)
        local = jnp.where(mine, ids - start, 0)
        vectors = jnp.where(mine[..., None], self.weight[local], 0)
        return sum_replicated(vectors, comm=self.comm)
