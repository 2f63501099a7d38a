"""Tensor-parallel multi-head attention: heads split over the ranks."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._mpi import CommRef
from .._replicated import use_replicated
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._sequence import gather_sequence, scatter_sequence_sum
from ._shard import block, comm_ref, take

_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "output_proj")


def _head(q, k, v, mask, dropout, key, inference):
    """One head's scaled dot-product attention, as eqx.nn.MultiheadAttention computes it
    (softmax in at least float32; dropout on the weights)."""
    logits = jnp.einsum("sd,Sd->sS", q / math.sqrt(q.shape[-1]), k)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
    weights = dropout(weights, key=key, inference=inference)
    return jnp.einsum("sS,Sd->sd", weights, v)


class ParallelMultiheadAttention(eqx.Module):
    """`eqx.nn.MultiheadAttention` with its heads split over `comm`.

    Same call and results as `eqx.nn.MultiheadAttention` (2-D and per-head 3-D masks,
    dropout with the same keys, `process_heads`). Each rank holds `num_heads / size`
    heads (rank `r` heads `r * num_heads // size` onwards): column-parallel
    query/key/value projections, a row-parallel output projection (one
    `sum_replicated`).

    On a device communicator (`vjpmpi.device_comm`, the layer built inside the
    `jax.shard_map` body) every device is a rank: it keeps the block of its rank (a traced
    value, sliced with `jax.lax.dynamic_slice`), and each of its parameters varies over
    the mesh axis (each device's own copy, as each process's on a process communicator),
    so that its gradient is the device's own; pass it out of the shard_map split over the
    axis (`out_specs=P(axis)`) and back in the same way.

    Args:
        num_heads (int): the number of heads (all ranks together), divisible by the
            communicator's size.
        query_size (int): the query's feature size.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the heads are split over (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        key (jax.random.PRNGKey | None): the initialisation key, the same on every rank
            (each rank draws the whole layer and keeps its heads); needed unless `dense`
            is given.
        dense (eqx.nn.MultiheadAttention | None): a whole layer (the same on every rank)
            to split instead of drawing one (what `from_dense` passes); then `num_heads`,
            `query_size` and `**kwargs` are taken from it.
        **kwargs (Any): `eqx.nn.MultiheadAttention`'s other arguments (`key_size`,
            `value_size`, `output_size`, `qk_size`, `vo_size`, the `use_*_bias` flags,
            `dropout_p`, `inference`, `dtype`), used when drawing from `key`.

    Raises:
        ValueError: neither `key` nor `dense` is given, or `num_heads` is not divisible
            by the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        replicated `(q_seq, query_size)`, `(kv_seq, key_size)`, `(kv_seq, value_size)`
        -> replicated `(q_seq, output_size)`.

    Transpose:
        one allreduce backward per distinct input array, so self-attention (`query`,
        `key_` and `value` the same array) has one, as Megatron-LM's fused QKV; the
        output projection's sum is one allreduce forward, none backward.
    """

    query_proj: ColumnParallelLinear
    key_proj: ColumnParallelLinear
    value_proj: ColumnParallelLinear
    output_proj: RowParallelLinear
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, num_heads: int, query_size: int, *, comm=None,
                 key: PRNGKeyArray | None = None,
                 dense: eqx.nn.MultiheadAttention | None = None, **kwargs):
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.ParallelMultiheadAttention: pass `key=` or use "
                                 "`from_dense`")
            dense = eqx.nn.MultiheadAttention(num_heads, query_size, key=key, **kwargs)
        self.comm = comm_ref(comm, "ParallelMultiheadAttention")
        block(dense.num_heads, self.comm, "ParallelMultiheadAttention", "num_heads")
        c = self.comm
        self.query_proj = ColumnParallelLinear.from_dense(dense.query_proj, c)
        self.key_proj = ColumnParallelLinear.from_dense(dense.key_proj, c)
        self.value_proj = ColumnParallelLinear.from_dense(dense.value_proj, c)
        self.output_proj = RowParallelLinear.from_dense(dense.output_proj, c,
                                                        input_is_parallel=True)
        self.dropout = dense.dropout
        self.num_heads, self.query_size = dense.num_heads, dense.query_size
        self.key_size, self.value_size = dense.key_size, dense.value_size
        self.output_size, self.qk_size, self.vo_size = dense.output_size, dense.qk_size, dense.vo_size

    @classmethod
    def from_dense(cls, layer: eqx.nn.MultiheadAttention, comm=None):
        """Split the heads of an `eqx.nn.MultiheadAttention` (the same on every rank).

        Args:
            layer (eqx.nn.MultiheadAttention): the whole layer, the same on every rank.
            comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
                communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
                `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the
                ranks).

        Returns:
            (ParallelMultiheadAttention): the layer holding this rank's heads of `layer`.

        Raises:
            ValueError: `layer.num_heads` is not divisible by the communicator's size.
            TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
                or None.
        """
        return cls(layer.num_heads, layer.query_size, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.MultiheadAttention:
        """Gather the heads back into an `eqx.nn.MultiheadAttention` on every rank
        (allgathers: every rank must call it).

        Returns:
            The whole `eqx.nn.MultiheadAttention` (its dropout rate and `inference` flag
                kept), the same on every rank.
        """
        projs = [getattr(self, name).to_dense() for name in _PROJECTIONS]
        dense = eqx.nn.MultiheadAttention(
            self.num_heads, self.query_size, self.key_size, self.value_size, self.output_size,
            self.qk_size, self.vo_size, *(p.bias is not None for p in projs),
            dropout_p=self.dropout.p, inference=self.dropout.inference,
            dtype=projs[0].weight.dtype, key=jax.random.PRNGKey(0))
        return eqx.tree_at(lambda m: tuple(getattr(m, n) for n in _PROJECTIONS), dense,
                           tuple(projs))

    def __call__(self, query: Float[Array, "q_seq q_size"], key_: Float[Array, "kv_seq k_size"],
                 value: Float[Array, "kv_seq v_size"],
                 mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
                 *, key: PRNGKeyArray | None = None, inference: bool | None = None,
                 deterministic: bool | None = None, process_heads=None
                 ) -> Float[Array, "q_seq o_size"]:
        """Attention of replicated inputs, as `eqx.nn.MultiheadAttention.__call__`.

        Args:
            query (Array): `(q_seq, query_size)`, the same on every rank.
            key_ (Array): `(kv_seq, key_size)`, the same on every rank.
            value (Array): `(kv_seq, value_size)`, the same on every rank.
            mask (Array | None): boolean, `(q_seq, kv_seq)` or per head
                `(num_heads, q_seq, kv_seq)` (all heads: each rank takes its own);
                False where attention is masked out.
            key (jax.random.PRNGKey | None): the dropout key, the same on every rank
                (split per head as the dense layer splits it).
            inference (bool | None): no dropout when True (None: the layer's own flag).
            deterministic (bool | None): equinox's older name of `inference`; when given
                it overrides `inference`.
            process_heads (Callable | None): `process_heads(q, k, v)` on this rank's
                heads, `(seq, num_heads // size, qk_size)` for `q` and `k` and
                `(seq, num_heads // size, vo_size)` for `v`, returning arrays of the same
                shapes (e.g. rotary embeddings).

        Returns:
            The output, `(q_seq, output_size)`, the same on every rank.

        Raises:
            ValueError: `key_` and `value` of different sequence lengths, a `mask` of
                another shape, or a `process_heads` that changes the heads' shapes.
        """
        if deterministic is not None:
            inference = deterministic
        c = self.comm
        # one use_replicated per distinct input array: one backward allreduce each
        xq = use_replicated(query, comm=c)
        xk = xq if key_ is query else use_replicated(key_, comm=c)
        xv = xq if value is query else xk if value is key_ else use_replicated(value, comm=c)
        attn = self._attend(xq, xk, xv, mask, key, inference, process_heads)
        return jax.vmap(self.output_proj)(attn)

    def sequence_parallel(self, x: Float[Array, "seq_block q_size"],
                          mask: Bool[Array, "seq seq"] | Bool[Array, "heads seq seq"] | None = None,
                          *, key: PRNGKeyArray | None = None, inference: bool | None = None,
                          process_heads=None) -> Float[Array, "seq_block o_size"]:
        """Self-attention on a sequence split over the ranks (Megatron-LM's sequence
        parallelism).

        The blocks are allgathered before the projections and the output projection's
        terms reduce-scattered, instead of allreduced (the output bias, replicated, is
        added to every block: its gradient sums over the ranks). Equal to this rank's
        block of `self(full, full, full, mask, key=key)`.

        Args:
            x (Array): this rank's block of the sequence, `(seq // size, query_size)`
                (block `rank`, in rank order).
            mask (Array | None): boolean, over the whole sequence: `(seq, seq)` or per
                head `(num_heads, seq, seq)`.
            key (jax.random.PRNGKey | None): the dropout key, the same on every rank.
            inference (bool | None): no dropout when True (None: the layer's own flag).
            process_heads (Callable | None): as in `__call__`, on the whole sequence's
                heads of this rank.

        Returns:
            This rank's block of the output, `(seq // size, output_size)`.

        Raises:
            ValueError: a `mask` of another shape, or a `process_heads` that changes the
                heads' shapes.

        Shape:
            `(seq // size, query_size)` -> `(seq // size, output_size)` on each rank.

        Transpose:
            the allgather reduce-scatters backward, the reduce_scatter allgathers.
        """
        full = gather_sequence(x, self.comm)
        attn = self._attend(full, full, full, mask, key, inference, process_heads)
        out = scatter_sequence_sum(jax.vmap(self.output_proj.partial)(attn), self.comm)
        bias = self.output_proj.bias  # replicated, added to every block: its gradient sums
        return out if bias is None else out + use_replicated(bias, comm=self.comm)

    def _attend(self, xq, xk, xv, mask, key, inference, process_heads):
        """This rank's heads' attention, `(q_seq, heads / size * vo_size)`, from inputs
        the column-parallel projections take as they are."""
        if xk.shape[0] != xv.shape[0]:
            raise ValueError("vjpmpi.nn.ParallelMultiheadAttention: key_ and value must have "
                             "the same sequence length")
        start, _ = block(self.num_heads, self.comm, "ParallelMultiheadAttention", "num_heads")
        heads = self.num_heads // self.comm.size

        def project(proj, x):
            return jax.vmap(proj.local)(x).reshape(x.shape[0], heads, -1)

        q, k, v = project(self.query_proj, xq), project(self.key_proj, xk), project(
            self.value_proj, xv)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("vjpmpi.nn.ParallelMultiheadAttention: process_heads must "
                                 "not change the shape of the heads")
        # the dense layer's per-head keys and masks, this rank's heads of them
        keys = None if key is None else take(jax.random.split(key, self.num_heads), start, heads)
        per_head = mask is not None and mask.ndim == 3
        want = (xq.shape[0], xk.shape[0])
        if mask is not None and (mask.ndim not in (2, 3) or tuple(mask.shape[-2:]) != want):
            raise ValueError(
                f"vjpmpi.nn.ParallelMultiheadAttention: mask must have shape {want} or "
                f"({self.num_heads}, *{want}), got {mask.shape}")
        if per_head:
            if mask.shape[0] != self.num_heads:
                raise ValueError(
                    f"vjpmpi.nn.ParallelMultiheadAttention: a 3-D mask must have num_heads="
                    f"{self.num_heads} rows, got shape {mask.shape}")
            mask = take(mask, start, heads)
        attn = jax.vmap(
            lambda qh, kh, vh, mh, key_h: _head(qh, kh, vh, mh, self.dropout, key_h, inference),
            in_axes=(1, 1, 1, 0 if per_head else None, None if keys is None else 0),
            out_axes=1)(q, k, v, mask, keys)
        return attn.reshape(xq.shape[0], -1)
