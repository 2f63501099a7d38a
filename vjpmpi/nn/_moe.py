"""Expert parallelism: a mixture-of-experts layer whose experts are split over a communicator,
tokens dispatched to their experts' ranks and back with `vjpmpi.ragged_alltoall`."""

from __future__ import annotations

import math
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float, PRNGKeyArray
from mpi4py import MPI

from .._mpi import SUM, CommRef
from .._movement import allgather
from .._reductions import allreduce, exscan
from .._ragged import ragged_alltoall
from .._sync import agree_on
from ._shard import comm_ref


def _exclusive(v, axis=-1):
    return jnp.cumsum(v, axis=axis) - v


_NO_VMAP = ("vjpmpi.nn.ExpertParallelMoE: cannot be batched by jax.vmap (each batch element "
            "would need its own exchanges and its own global load-balancing loss); call the "
            "layer once per batch element, or fold the batch into the tokens "
            "(x.reshape(-1, in_size)) if one routing and one aux over them all is meant")


@custom_vmap
def _refuse_vmap(arrays):
    """The identity on `arrays`; under `jax.vmap` (batching any of them, with or without
    `jax.jit` between) it raises the layer's refusal."""
    return arrays


@_refuse_vmap.def_vmap
def _refuse_vmap_rule(axis_size, in_batched, arrays):
    raise ValueError(_NO_VMAP)


@jax.custom_jvp
def _no_vmap(arrays):
    """`_refuse_vmap`, differentiable to any order (custom_vmap has no reverse mode of its
    own: the primal goes through it, the tangents around it)."""
    return _refuse_vmap(arrays)


@_no_vmap.defjvp
def _no_vmap_jvp(primals, tangents):
    return _no_vmap(primals[0]), tangents[0]


class ExpertParallelMoE(eqx.Module):
    """A mixture-of-experts layer (MLP experts, a learned top-k router) with the experts
    split over `comm`: rank `q` holds experts `q * E/size` to `(q + 1) * E/size - 1`.

    Each rank routes its own tokens; the rows for each expert go to its rank and come back
    through two `ragged_alltoall`s (counts decided at run time, no padding of the experts
    to the worst case: dropless, unless `capacity_factor` caps what each expert takes from
    each rank). Router: softmax of `x @ router.T`; top-1 takes the chosen expert's
    probability as its gate (Switch), top-2 the two probabilities renormalised (GShard).
    The auxiliary load-balancing loss is Switch's `E * sum_e f_e * P_e` over the global
    batch (every rank's tokens: `f_e` the fraction of assignments to expert `e`, `P_e` its
    mean router probability), the same value on every rank.

    Gradients (exact adjoints, of the sum of every rank's loss): the experts' hold every
    rank's tokens' part already (they come back through the exchanges' transposes), the
    router's only this rank's. `allreduce_gradients`, `sync_gradients` and
    `sharded_optimizer` know this from `vjpmpi.nn.layout`: they sum the router's over the
    ranks and leave the experts' as they are (divided by the size for the mean), so that
    the result is the gradient of the ranks' mean loss, the same as one process's. Each
    rank adds the same `aux` to its loss: its gradient counts once in that mean, with no
    scaling by hand (its sums over the ranks are `allreduce`s, whose transposes sum every
    rank's cotangent).

    Args:
        in_size (int): the tokens' width.
        hidden_size (int): each expert MLP's hidden width.
        num_experts (int): experts in all, a multiple of the communicator's size.
        top_k (int): experts per token, 1 or 2.
        activation (Callable): the experts' activation.
        capacity_factor (float | None): None: dropless; else each expert takes at most
            `ceil(capacity_factor * tokens * top_k / num_experts)` rows from each rank
            (the first in token order), the others dropped (no output from it).
        dropout (float): dropout rate on the experts' outputs (with `key=` in the call).
        comm (MPI.Intracomm | None): the communicator the experts are
            split over (None: vjpmpi's private duplicate of COMM_WORLD).
        key (jax.random.PRNGKey | None): one key, the same on every rank: every rank
            draws the whole layer and keeps its experts (the one-process layer from the
            same key is equal); needed unless `dense` is given.
        dense (ExpertParallelMoE | None): (internal) the whole layer to split (what
            `from_dense` passes).

    Raises:
        ValueError: `num_experts` not a multiple of the size, `top_k` not 1 or 2, a
            `dropout` outside [0, 1), or neither `key` nor `dense`.
        TypeError: `comm` is not an mpi4py intracommunicator or None.

    Shape:
        this rank's `(tokens, in_size)` -> (`(tokens, in_size)`, aux `()`). The ranks'
        token counts may differ (`max_tokens=` in the call; zero too: that rank's output
        is `(0, in_size)`); mixed dtypes of the tokens and the layer compute in JAX's
        promoted dtype, as `eqx.nn.Linear` does (float32 tokens into a float64 layer:
        float64 out).

    Transpose:
        the dispatch exchange's is the return exchange and the other way round.
    """

    router: Float[Array, "experts in"]
    w1: Float[Array, "local in hidden"]
    b1: Float[Array, "local hidden"]
    w2: Float[Array, "local hidden in"]
    b2: Float[Array, "local in"]
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    activation: Callable = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, in_size: int, hidden_size: int, num_experts: int, *, top_k: int = 1,
                 activation: Callable = jax.nn.gelu, capacity_factor: float | None = None,
                 dropout: float = 0.0, comm=None, key: PRNGKeyArray | None = None,
                 dense: "ExpertParallelMoE | None" = None):
        self.comm = comm_ref(comm, "ExpertParallelMoE")
        size = self.comm.size
        if num_experts % size:
            raise ValueError(f"vjpmpi.nn.ExpertParallelMoE: num_experts={num_experts} is not a "
                             f"multiple of the communicator's size {size}")
        if top_k not in (1, 2):
            raise ValueError(f"vjpmpi.nn.ExpertParallelMoE: top_k={top_k}: 1 or 2")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"vjpmpi.nn.ExpertParallelMoE: dropout={dropout} is not in [0, 1)")
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.ExpertParallelMoE: pass `key=` or use `from_dense`")
            kr, k1, k2 = jax.random.split(key, 3)
            lim1, lim2 = 1 / math.sqrt(in_size), 1 / math.sqrt(hidden_size)
            e = num_experts
            params = dict(
                router=jax.random.uniform(kr, (e, in_size), minval=-lim1, maxval=lim1),
                w1=jax.random.uniform(k1, (e, in_size, hidden_size), minval=-lim1, maxval=lim1),
                b1=jnp.zeros((e, hidden_size)),
                w2=jax.random.uniform(k2, (e, hidden_size, in_size), minval=-lim2, maxval=lim2),
                b2=jnp.zeros((e, in_size)))
        else:
            params = {k: getattr(dense, k) for k in ("router", "w1", "b1", "w2", "b2")}
        local = num_experts // size
        lo = self.comm.rank * local
        self.router = params["router"]
        for k in ("w1", "b1", "w2", "b2"):
            setattr(self, k, params[k][lo:lo + local])
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.dropout, self.activation = capacity_factor, dropout, activation

    @classmethod
    def from_dense(cls, dense: "ExpertParallelMoE", comm=None) -> "ExpertParallelMoE":
        """Split a whole layer (every expert on this process: one on `MPI.COMM_SELF`, the
        same on every rank) over `comm`.

        Args:
            dense (ExpertParallelMoE): the whole layer, on a one-rank communicator, the
                same on every rank.
            comm (MPI.Intracomm | None): the communicator (None:
                vjpmpi's private duplicate of COMM_WORLD).

        Returns:
            The layer holding this rank's experts of `dense` (and the whole router).

        Raises:
            ValueError: `dense` is not on a one-rank communicator, or its `num_experts`
                is not a multiple of `comm`'s size.
            TypeError: `comm` is not an mpi4py intracommunicator or None.
        """
        if dense.comm.size != 1:
            raise ValueError("vjpmpi.nn.ExpertParallelMoE.from_dense: the layer to split must "
                             "hold every expert (a layer on a one-rank communicator)")
        return cls(dense.w1.shape[1], dense.w1.shape[2], dense.num_experts, top_k=dense.top_k,
                   activation=dense.activation, capacity_factor=dense.capacity_factor,
                   dropout=dense.dropout, comm=comm, dense=dense)

    def to_dense(self) -> "ExpertParallelMoE":
        """Gather every expert into a whole layer on `MPI.COMM_SELF`, on every rank
        (allgathers: every rank must call it).

        Returns:
            The whole `ExpertParallelMoE` (every expert, on `MPI.COMM_SELF`), the same on
                every rank.
        """
        whole = {k: allgather(getattr(self, k), comm=self.comm).reshape(
            -1, *getattr(self, k).shape[1:]) for k in ("w1", "b1", "w2", "b2")}
        whole["router"] = self.router
        return ExpertParallelMoE(self.w1.shape[1], self.w1.shape[2], self.num_experts,
                                 top_k=self.top_k, activation=self.activation,
                                 capacity_factor=self.capacity_factor, dropout=self.dropout,
                                 comm=MPI.COMM_SELF, dense=_Params(**whole))

    def __call__(self, x: Float[Array, "tokens in"], *, key: PRNGKeyArray | None = None,
                 max_tokens: int | None = None
                 ) -> tuple[Float[Array, "tokens in"], Float[Array, ""]]:
        """Route this rank's tokens to their experts and back.

        Args:
            x (Array): this rank's tokens, shape `(tokens, in_size)`.
            key (jax.random.PRNGKey | None): the dropout key, the same on every rank (each
                token's mask is drawn from it and the token's place in the global batch,
                so the one-process layer on every rank's tokens in rank order draws the
                same); None: no dropout.
            max_tokens (int | None): the most tokens any rank passes, the same on every
                rank (a Python int: the buffer that receives rows for this rank's experts
                holds `size * max_tokens * top_k`, every token of every rank could come
                here); None: every rank passes as many tokens as this one (checked: ranks
                with other counts fail together, naming `max_tokens`).

        Returns:
            `(y, aux)`: the layer's output for these tokens, `(tokens, in_size)`, and the
                load-balancing loss, a scalar, the same on every rank.

        Raises:
            ValueError: `x` is not of shape `(tokens, in_size)`, `max_tokens` is not None
                or an int >= 0, or the call is batched by `jax.vmap` (each batch element
                would need its own exchanges and aux: call the layer per element).
            ValueError: when it runs, on every rank, where the ranks'
                token counts differ and `max_tokens` is None, a rank has more tokens than
                `max_tokens`, or the ranks pass different `max_tokens` or dtypes (the
                ranks' agreement, before any data moves; where a rank ran the same program
                before, the job ends with that text instead).
        """
        comm, size, rank = self.comm, self.comm.size, self.comm.rank
        x = jnp.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.w1.shape[1]:
            raise ValueError(f"vjpmpi.nn.ExpertParallelMoE: x must have shape (tokens, "
                             f"{self.w1.shape[1]}), got {tuple(x.shape)}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
                max_tokens, int) or max_tokens < 0):
            raise ValueError(f"vjpmpi.nn.ExpertParallelMoE: max_tokens={max_tokens!r}: None or "
                             "a Python int >= 0, the same on every rank")
        n_tok, k, e = x.shape[0], self.top_k, self.num_experts
        local = e // size
        # mixed dtypes: JAX's promotion, as eqx.nn.Linear's `weight @ x`
        arrays = (x, self.router, self.w1, self.b1, self.w2, self.b2)
        dt = jnp.result_type(*arrays)
        x, router, w1, b1, w2, b2 = (a.astype(dt) for a in _no_vmap(arrays))
        # the most rows any rank sends: one static bound, the same on every rank (checked
        # here, before any data moves: a rank past it, or ranks of other views, fail on
        # every rank)
        bound = n_tok if max_tokens is None else max_tokens
        if max_tokens is None:
            note = (f"vjpmpi.nn.ExpertParallelMoE: {n_tok} tokens of dtype {dt} on this rank "
                    f"({rank}), max_tokens=None: every rank must pass as many (uneven token "
                    "counts need `max_tokens=`, the most any rank passes, on every rank)")
            refused = None
        else:
            note = (f"vjpmpi.nn.ExpertParallelMoE: max_tokens={max_tokens}, dtype {dt} "
                    f"({n_tok} tokens on this rank, {rank})")
            refused = None if n_tok <= max_tokens else (
                f"vjpmpi.nn.ExpertParallelMoE: rank {rank} passes {n_tok} tokens, more than "
                f"max_tokens={max_tokens}")
        agree_on((size, bound, x.shape[1]), dt, comm, "nn.ExpertParallelMoE", note=note,
                 invalid=refused)
        probs = jax.nn.softmax(x @ router.T, axis=-1)
        top_p, top_e = jax.lax.top_k(probs, k)
        gates = top_p if k == 1 else top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        flat = top_e.reshape(-1)  # (token, slot) in token order
        chosen = jax.nn.one_hot(flat, e, dtype=jnp.int32)
        keep = jnp.ones(flat.shape, bool)
        if self.capacity_factor is not None:  # the first `cap` rows of each expert
            cap = math.ceil(self.capacity_factor * n_tok * k / e)
            place = jnp.sum((jnp.cumsum(chosen, axis=0) - chosen) * chosen, axis=1)
            keep = place < cap
        # load balancing over the global batch: sums over the ranks whose transpose sums
        # every rank's cotangent (each rank's loss holds the same aux)
        stats = allreduce(jnp.concatenate([
            jnp.sum(probs, axis=0),
            jax.lax.stop_gradient(jnp.sum(chosen, axis=0).astype(probs.dtype)),
            jnp.full((1,), n_tok, probs.dtype)]), SUM, comm=comm)
        total = stats[-1]
        aux = e * jnp.sum(stats[e:2 * e] / (total * k) * stats[:e] / total)
        # dispatch: rows sorted by expert (dropped ones last), one slice per expert
        order = jnp.argsort(jnp.where(keep, flat, e), stable=True)
        counts = jnp.sum(chosen * keep[:, None], axis=0).astype(jnp.int32)  # (e,)
        every = allgather(counts, comm=comm)  # (size, e): [source rank, expert]
        mine = every[:, rank * local:(rank + 1) * local]  # (size, local): what comes here
        per_expert = jnp.sum(mine, axis=0)
        start = _exclusive(per_expert)  # each local expert's first row here
        # slice g (expert g on rank g // local) of rank j lands on that rank at
        # (its expert's start there) + (rows from ranks before j)
        totals = jnp.sum(every, axis=0)  # (e,)
        group_start = _exclusive(totals.reshape(size, local), axis=1).reshape(-1)
        before = _exclusive(every, axis=0)  # (size, e)
        # every rank's rows could come here: each of the size ranks sends at most bound * k
        # (at most local * its cap with a capacity factor, the cap from its own count)
        rows_in = size * bound * k
        if self.capacity_factor is not None:
            rows_in = min(rows_in, size * local * math.ceil(self.capacity_factor * bound * k / e))
        # (buffers of at least one row: a rank with no tokens sends and receives nothing)
        n_rows = n_tok * k
        xs = jnp.zeros((max(n_rows, 1), x.shape[1]), dt).at[:n_rows].set(x[order // k])
        recv = ragged_alltoall(xs, jnp.zeros((max(rows_in, 1), x.shape[1]), dt),
                               _exclusive(counts), counts, group_start + before[rank],
                               mine.reshape(-1), comm=comm)
        out = self._experts(recv, per_expert, (w1, b1, w2, b2))
        # back: this rank's rows of local expert e from rank j go to j's sorted rows
        theirs = _exclusive(every, axis=1)[:, rank * local:(rank + 1) * local]  # (size, local)
        back = ragged_alltoall(
            out, jnp.zeros((max(n_rows, 1), x.shape[1]), dt),
            (start[None, :] + before[:, rank * local:(rank + 1) * local]).reshape(-1),
            mine.reshape(-1), theirs.reshape(-1),
            counts.reshape(size, local).reshape(-1), comm=comm)
        back = back[:n_rows]
        rows = jnp.zeros_like(back).at[order].set(back).reshape(n_tok, k, x.shape[1])
        if self.dropout and key is not None:
            offset = exscan(jnp.asarray(n_tok, jnp.int32), SUM, comm=comm)
            ids = offset + jnp.arange(n_tok, dtype=jnp.int32)
            masks = jax.vmap(lambda i: jax.random.bernoulli(
                jax.random.fold_in(key, i), 1.0 - self.dropout, rows.shape[1:]))(ids)
            rows = jnp.where(masks, rows / (1.0 - self.dropout), 0.0)
        gates = jnp.where(keep.reshape(n_tok, k), gates, 0.0)
        return jnp.einsum("tk,tkd->td", gates, rows), aux

    def _experts(self, rows, per_expert, params):
        """Each local expert's MLP (`params`: w1, b1, w2, b2) on its rows (grouped, back to
        back from row 0); rows past them are zeros."""
        w1, b1, w2, b2 = params
        n = jnp.sum(per_expert)
        which = jnp.clip(jnp.searchsorted(jnp.cumsum(per_expert), jnp.arange(rows.shape[0]),
                                          side="right"), 0, per_expert.shape[0] - 1)
        valid = (jnp.arange(rows.shape[0]) < n)[:, None]
        h = jax.lax.ragged_dot(rows, w1, per_expert) + b1[which]
        h = jnp.where(valid, self.activation(h), 0.0)
        out = jax.lax.ragged_dot(h, w2, per_expert) + b2[which]
        return jnp.where(valid, out, 0.0)


class _Params:
    """The whole layer's arrays (to_dense's `dense=`)."""

    def __init__(self, **arrays):
        self.__dict__.update(arrays)
