"""A tensor-parallel MLP and the data-parallel gradient all-reduce."""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree
from mpi4py import MPI

from .._mpi import SUM, CommRef, as_comm
from .._reductions import allreduce
from .._replicated import use_replicated
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._layout import finish, sync_steps
from ._sequence import gather_sequence, replicated, scatter_sequence_sum
from ._shard import (agree_on_buckets, bucket_bytes_arg, buckets, comm_ref, concat, dtype_groups,
                     own, split_into)


def _identity(x):
    return x


def _plain(fn, what: str):
    """`fn` when it is a plain function; learnt (per-neuron) activations have arrays."""
    if any(eqx.is_array(leaf) for leaf in jax.tree_util.tree_leaves(fn)):
        raise ValueError(f"vjpmpi.nn.ParallelMLP: a learnt {what} (one with parameters, "
                         "copied per neuron by eqx.nn.MLP) cannot be split; use a function")
    return fn


class ParallelMLP(eqx.Module):
    """`eqx.nn.MLP` of any depth with its linear layers split in pairs over `comm`.

    Layers 0-1, 2-3, ... are column-/row-parallel pairs (`ColumnParallelLinear`,
    `RowParallelLinear`: the hidden units of each pair split over the ranks); an
    unpaired last layer (even depth) is kept whole on every rank, and a depth-0 MLP
    (one layer) is kept as it is. Built from `key`, it holds the shards of
    `eqx.nn.MLP(..., key=key)`; `to_dense` gathers that MLP back.

    On a device communicator (`vjpmpi.device_comm`, the layer built inside the
    `jax.shard_map` body) every device is a rank: it keeps the block of its rank (a traced
    value, sliced with `jax.lax.dynamic_slice`), and each of its parameters varies over
    the mesh axis (each device's own copy, as each process's on a process communicator),
    so that its gradient is the device's own; pass it out of the shard_map split over the
    axis (`out_specs=P(axis)`) and back in the same way.

    Args:
        in_size (int): the input's size.
        out_size (int): the output's size.
        width_size (int): the hidden layers' size, divisible by the communicator's size
            (where there is a pair to split).
        activation (Callable): the hidden layers' activation, a plain function (not a
            learnt one with parameters).
        depth (int): the number of hidden layers, as in `eqx.nn.MLP`.
        final_activation (Callable): the activation after the last layer (default: the
            identity), a plain function.
        use_bias (bool): whether the hidden layers have biases.
        use_final_bias (bool): whether the last layer has a bias.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the hidden units are split over (None: vjpmpi's private duplicate of COMM_WORLD;
            a `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the
            ranks).
        key (jax.random.PRNGKey | None): the initialisation key, the same on every rank;
            needed unless `dense` is given.
        dense (eqx.nn.MLP | None): a whole MLP (the same on every rank) to split instead
            of drawing one (what `from_dense` passes); its sizes, depth, activations and
            biases are used instead of the arguments above (`in_size` to
            `use_final_bias`).

    Raises:
        ValueError: neither `key` nor `dense` is given; the MLP was built with
            `scan=True` or a `'scalar'` input or output size; an activation with
            parameters (a learnt one); `width_size` not divisible by the
            communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        replicated `(in_size,)` -> replicated `(out_size,)`.

    Transpose:
        per pair one allreduce forward (the row layer's sum) and one backward (the
        column layer's input cotangent), as in Megatron-LM; the whole last layer needs
        none.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi, vjpmpi.nn as vnn

        rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        mlp = vnn.ParallelMLP(4, 3, 8, depth=2, key=jax.random.PRNGKey(0))  # same key everywhere
        dense = mlp.to_dense()                      # the eqx.nn.MLP, whole on every rank
        x = jnp.linspace(-1.0, 1.0, 4)
        assert jnp.allclose(mlp(x), dense(x), atol=1e-5)  # replicated (3,) on every rank
        seq = jax.random.normal(jax.random.PRNGKey(1), (2 * size, 4))
        mine = seq[2 * rank:2 * rank + 2]           # this rank's block of the sequence
        want = jax.vmap(dense)(seq)[2 * rank:2 * rank + 2]
        assert jnp.allclose(mlp.sequence_parallel(mine), want, atol=1e-5)
        ```
    """

    layers: tuple
    activation: Callable = eqx.field(static=True)
    final_activation: Callable = eqx.field(static=True)
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)
    width_size: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    use_final_bias: bool = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, in_size: int, out_size: int, width_size: int,
                 activation: Callable = jax.nn.gelu, *, depth: int = 1,
                 final_activation: Callable = _identity, use_bias: bool = True,
                 use_final_bias: bool = True, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.MLP | None = None):
        if dense is None:
            if key is None:
                raise ValueError("vjpmpi.nn.ParallelMLP: pass `key=` or use `from_dense`")
            dense = eqx.nn.MLP(in_size, out_size, width_size, depth, activation=activation,
                               final_activation=final_activation, use_bias=use_bias,
                               use_final_bias=use_final_bias, key=key)
        if getattr(dense, "scan", False) or "scalar" in (dense.in_size, dense.out_size):
            raise ValueError("vjpmpi.nn.ParallelMLP: an eqx.nn.MLP built with scan=True or "
                             "a 'scalar' input/output cannot be split; build it without")
        self.activation = _plain(dense.activation, "activation")
        self.final_activation = _plain(dense.final_activation, "final_activation")
        self.comm = comm_ref(comm, "ParallelMLP")
        layers, n = [], len(dense.layers)
        if dense.depth == 0:  # nothing to split: the MLP itself, whole on every rank
            layers, n = [own(dense, self.comm)], 0
        for i, layer in enumerate(dense.layers[:n]):
            if i % 2 == 0 and i + 1 < n:
                layers.append(ColumnParallelLinear.from_dense(layer, comm))
            elif i % 2:
                layers.append(RowParallelLinear.from_dense(layer, comm, input_is_parallel=True))
            else:
                layers.append(own(layer, self.comm))
        self.layers = tuple(layers)
        self.in_size, self.out_size = dense.in_size, dense.out_size
        self.width_size, self.depth = dense.width_size, dense.depth
        self.use_bias, self.use_final_bias = dense.use_bias, dense.use_final_bias

    @classmethod
    def from_dense(cls, mlp: eqx.nn.MLP, comm=None):
        """Shard an `eqx.nn.MLP` (the same on every rank): any depth, its activations kept.

        Args:
            mlp (eqx.nn.MLP): the whole MLP, the same on every rank.
            comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
                communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
                `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the
                ranks).

        Returns:
            (ParallelMLP): the layer holding this rank's shards of `mlp`.

        Raises:
            ValueError: as the constructor (`scan=True`, a `'scalar'` size, a learnt
                activation, a width not divisible by the communicator's size).
            TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
                or None.
        """
        return cls(mlp.in_size, mlp.out_size, mlp.width_size, comm=comm, dense=mlp)

    def to_dense(self) -> eqx.nn.MLP:
        """Gather the shards into an `eqx.nn.MLP` on every rank (allgathers, where there
        is a pair: every rank must call it).

        Returns:
            The whole `eqx.nn.MLP`, the same on every rank (a depth-0 MLP: the one it
                holds).
        """
        if self.depth == 0:
            return self.layers[0]
        layers = tuple(layer if isinstance(layer, eqx.nn.Linear) else layer.to_dense()
                       for layer in self.layers)
        mlp = eqx.nn.MLP(self.in_size, self.out_size, self.width_size, self.depth,
                         activation=self.activation, final_activation=self.final_activation,
                         use_bias=self.use_bias, use_final_bias=self.use_final_bias,
                         key=jax.random.PRNGKey(0))
        return eqx.tree_at(lambda m: m.layers, mlp, layers)

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        """Apply the MLP to a replicated input.

        Args:
            x (Array): the input, `(in_size,)`, the same on every rank (`jax.vmap` for a
                batch).
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            The output, `(out_size,)`, the same on every rank.
        """
        if self.depth == 0:  # the eqx.nn.MLP itself
            return self.layers[0](x)
        for i, layer in enumerate(self.layers):
            x = self._activate(i, layer(x))
        return x

    def _activate(self, i: int, x):
        """What follows layer `i`: the activation, or the final one after the last."""
        return self.activation(x) if i + 1 < len(self.layers) else self.final_activation(x)

    def sequence_parallel(self, x: Float[Array, "seq_block in"]) -> Float[Array, "seq_block out"]:
        """The MLP on a sequence split over the ranks (Megatron-LM's sequence parallelism).

        Each column/row pair allgathers the sequence before its column layer and
        reduce-scatters its row layer's terms, instead of an allreduce; an unpaired last
        layer runs on the block (its parameters marked `replicated`, so that their
        gradients sum over the ranks). Equal to this rank's block of
        `jax.vmap(self)(full)`.

        Args:
            x (Array): this rank's block of the sequence, `(seq // size, in_size)`
                (block `rank`, in rank order).

        Returns:
            This rank's block of the output sequence, `(seq // size, out_size)`.

        Shape:
            `(seq // size, in_size)` -> `(seq // size, out_size)` on each rank.

        Transpose:
            the allgathers reduce-scatter backward, the reduce_scatters allgather.
        """
        act, comm = self._activate, self.comm
        if self.depth == 0:
            return jax.vmap(replicated(self.layers[0], comm))(x)
        i = 0
        while i < len(self.layers):
            layer = self.layers[i]
            if isinstance(layer, ColumnParallelLinear):
                row = self.layers[i + 1]
                h = act(i, jax.vmap(layer.local)(gather_sequence(x, comm)))
                x = scatter_sequence_sum(jax.vmap(row.partial)(h), comm)
                # the replicated bias meets every block: its gradient sums over ranks
                x = x if row.bias is None else x + use_replicated(row.bias, comm=comm)
                x = act(i + 1, x)
                i += 2
            else:  # the unpaired last layer, whole on every rank, on the block
                x = act(i, jax.vmap(replicated(layer, comm))(x))
                i += 1
        return x


def allreduce_gradients(grads: PyTree, *, mean: bool = True, bucket_bytes: int | None = None,
                        comm: MPI.Comm | None = None, layout: PyTree | None = None) -> PyTree:
    """All-reduce (mean or sum) the gradients `grads` over the data-parallel `comm`.

    Where each parameter lives comes from the `vjpmpi.nn` layers in `grads` (gradients
    from `eqx.filter_grad` keep them; `vjpmpi.nn.layout`), or from `layout`:
    - a replicated leaf (every rank holds the whole parameter) is summed over `comm`;
    - a leaf split over the very ranks of `comm` (a tensor-parallel layer over them, an
      `ExpertParallelMoE`'s experts) is not summed with other ranks' other blocks: its
      gradient is complete on its rank. An expert's, which holds every rank's tokens'
      part, is divided by the size for the mean; a tensor-parallel block's, the gradient
      of the one loss its ranks share, is kept as it is (multiplied by the size for the
      sum);
    - a leaf split over a part of `comm` (a tensor group inside a data x tensor grid) is
      summed over the ranks holding the same block (one allreduce of a stack of the
      blocks: pass the data-parallel communicator instead to move less);
    - a leaf split across `comm` (each rank of `comm` in another tensor group, holding
      the same block) is summed as a replicated one; the ranks' agreement checks, when
      the program runs, that every rank of `comm` holds the same block.
    The result is then the gradient of the mean (or sum) of the ranks' losses, as one
    process computes it on the whole batch. A leaf it cannot sync (experts summed over
    ranks outside their group, a communicator that shares only some ranks with the
    leaf's) is an error on every rank naming the leaf and its layer.

    Leaves summed alike of one dtype are flattened into one buffer, so a pytree of any
    number of leaves costs one MPI call per dtype; with `bucket_bytes`, one call per run of at
    most that many bytes, the last leaves first (inside a jitted step, each starts as
    soon as the backward pass has produced its leaves: see `sync_gradients`). The
    result is the same bit for bit either way (where MPI's sum does not depend on the
    message size: tests/mpi/test_async.py checks it at 1-4 ranks). Non-array leaves pass through unchanged.
    Works on gradients from `eqx.filter_grad` and as a step before `optax` updates.

    On a device communicator (`vjpmpi.device_comm`) each device is a rank: give each its
    own copy of the parameters (passed to the `jax.shard_map` split over the mesh axis, as
    each process holds its own), so that their gradients are each device's. A parameter
    that does not vary over the axis (passed whole, `P()`) has from JAX already the sum of
    every device's gradient (the transpose of its implicit `pvary`): reduced again here,
    it would count `size` times.

    Args:
        grads (PyTree): a pytree (gradients), of the same structure, shapes and dtypes on
            every rank.
        mean (bool): divide the sum by the communicator's size.
        bucket_bytes (int | None): one allreduce per run of at most this many bytes
            (None: one per dtype); the same on every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
            data-parallel communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        layout (PyTree | None): where each parameter lives, `vjpmpi.nn.layout(model)`, for
            gradients that have lost the model's layers (None: read from `grads`).

    Returns:
        `grads` with every inexact-array leaf synced as above: the replicated leaves the
            same on every rank.

    Raises:
        ValueError: a `bucket_bytes` that is not a positive int or None; a `layout` of
            another structure; on a one-rank `comm`, a leaf it cannot sync (naming it).
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.
        ValueError: when run, on every rank, where the ranks'
            `bucket_bytes` differ (saying so), a leaf it cannot sync (naming the leaf and
            its layer), or ranks of `comm` that hold different blocks of a leaf split
            across them.

    Shape:
        the pytree -> the same pytree.

    Transpose:
        allreduce(SUM) (scaled by 1/size for the mean).

    Example:
        ```python
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi.nn as vnn

        # a tensor-parallel layer over every rank, the same input everywhere
        col = vnn.ColumnParallelLinear(3, 2 * MPI.COMM_WORLD.size, key=jax.random.PRNGKey(0))
        x = jnp.arange(3.0)
        grads = jax.grad(lambda m: jnp.sum(jnp.tanh(m(x))))(col)
        synced = vnn.allreduce_gradients(grads)  # each rank's block: its own, complete
        assert jnp.allclose(synced.weight, grads.weight)
        ```
    """
    ref = as_comm(comm, "nn.allreduce_gradients")
    cap = bucket_bytes_arg(bucket_bytes, "allreduce_gradients")
    steps = sync_steps(grads, ref, "allreduce_gradients", layout)
    agree_on_buckets(ref, cap, "allreduce_gradients")
    leaves, treedef, groups = dtype_groups(grads, steps)
    out = list(leaves)
    for bucket in buckets(leaves, groups, cap):
        total = allreduce(concat(leaves, bucket), SUM, comm=ref)
        split_into(out, leaves, bucket, total / ref.size if mean else total)
    for i, step in enumerate(steps):
        if step is not None and step.kind != "sum":
            out[i] = finish(step, leaves[i], ref, mean)
    return jax.tree_util.tree_unflatten(treedef, out)


def _bucket_sync(comm, size: int, mean: bool):
    """The identity, whose derivative all-reduces the cotangent (then / size for the mean)."""

    @jax.custom_vjp
    def sync(flat):
        return flat

    def fwd(flat):
        return flat, None

    def bwd(_, ct):
        total = allreduce(ct, SUM, comm=comm)
        return (total / size if mean else total,)

    sync.defvjp(fwd, bwd)
    return sync


def _leaf_sync(step, comm, mean: bool):
    """The identity, whose derivative is a split leaf's sync (`finish`)."""

    @jax.custom_vjp
    def sync(leaf):
        return leaf

    def fwd(leaf):
        return leaf, None

    def bwd(_, ct):
        return (finish(step, ct, comm, mean),)

    sync.defvjp(fwd, bwd)
    return sync


def sync_gradients(model: PyTree, *, mean: bool = True, bucket_bytes: int | None = 25 << 20,
                   comm: MPI.Comm | None = None, layout: PyTree | None = None) -> PyTree:
    """`model` unchanged, whose gradient comes back all-reduced over `comm` (mean or sum).

    The allreduce runs bucket by bucket inside the backward pass: data-parallel training
    whose gradient sync overlaps the rest of the backward pass (as PyTorch DDP's
    `bucket_cap_mb`).

    Apply it inside the loss, to the parameters: ``loss(sync_gradients(model), x, y)``.
    The inexact-array leaves of each dtype are cut, from the last leaf back (the order
    a backward pass produces the gradients of layers applied in tree order), into
    buckets of at most `bucket_bytes` (a larger leaf is a bucket of its own; None: one
    per dtype). Each bucket is one allreduce, issued as soon as the backward pass has
    produced its gradients, in the same order on every rank; a bucket of at least the
    asynchronous threshold (by default 1 MiB on a communicator across nodes:
    vjpmpi.async_threshold) travels while the backward pass goes on. The gradient
    equals `allreduce_gradients` of the local gradient, bit for bit: split parameters
    (tensor-parallel blocks, experts) are synced as `allreduce_gradients` says, from the
    layers in `model` (`vjpmpi.nn.layout`) or `layout`.

    On a device communicator (`vjpmpi.device_comm`) each device is a rank: give each its
    own copy of the parameters (passed to the `jax.shard_map` split over the mesh axis, as
    each process holds its own), so that their gradients are each device's. A parameter
    that does not vary over the axis (passed whole, `P()`) has from JAX already the sum of
    every device's gradient (the transpose of its implicit `pvary`): reduced again here,
    it would count `size` times.

    Args:
        model (PyTree): a pytree (the parameters, as the loss uses them), of the same
            structure, shapes and dtypes on every rank.
        mean (bool): divide the gradient's sum by the communicator's size.
        bucket_bytes (int | None): the most bytes of one bucket (None: one per dtype);
            the same on every rank.
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
            data-parallel communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        layout (PyTree | None): where each parameter lives, `vjpmpi.nn.layout(model)`, for
            a `model` that has lost its layers (None: read from `model`).

    Returns:
        `model` unchanged (the same leaves' values), with the gradient sync on its
            derivative.

    Raises:
        ValueError: a `bucket_bytes` that is not a positive int or None; a `layout` of
            another structure; on a one-rank `comm`, a leaf it cannot sync (naming it).
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.
        ValueError: when run, on every rank, where the ranks'
            `bucket_bytes` differ (saying so), a leaf it cannot sync (naming the leaf and
            its layer), or ranks of `comm` that hold different blocks of a leaf split
            across them.

    Shape:
        the identity on the pytree.

    Transpose:
        allreduce(SUM) of each bucket's cotangent (scaled by 1/size for the mean).

    Example:
        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        from mpi4py import MPI
        import vjpmpi, vjpmpi.nn as vnn

        model = eqx.nn.Linear(3, 1, key=jax.random.PRNGKey(0))  # the same on every rank
        x = jnp.full((3,), MPI.COMM_WORLD.rank + 1.0)            # each rank's own data

        def loss(m, x):
            return jnp.sum(m(x) ** 2)

        synced = eqx.filter_grad(lambda m, x: loss(vnn.sync_gradients(m), x))(model, x)
        local = eqx.filter_grad(loss)(model, x)                  # this rank's gradient alone
        assert jnp.allclose(synced.weight, vnn.allreduce_gradients(local).weight)
        ```
    """
    ref = as_comm(comm, "nn.sync_gradients")
    cap = bucket_bytes_arg(bucket_bytes, "sync_gradients")
    steps = sync_steps(model, ref, "sync_gradients", layout)
    agree_on_buckets(ref, cap, "sync_gradients")
    leaves, treedef, groups = dtype_groups(model, steps)
    out = list(leaves)
    for i, step in enumerate(steps):  # (split leaves: after the buckets, backward)
        if step is not None and step.kind != "sum":
            out[i] = _leaf_sync(step, ref, mean)(leaves[i])
    sync = _bucket_sync(ref, ref.size, mean)
    # applied in reverse: the backward pass runs the transposes in reverse, so it
    # reduces the bucket of the last leaf first, in allreduce_gradients' order
    for bucket in reversed(buckets(leaves, groups, cap)):
        split_into(out, leaves, bucket, sync(concat(leaves, bucket)))
    return jax.tree_util.tree_unflatten(treedef, out)
