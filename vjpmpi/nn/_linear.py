"""Tensor-parallel linear layers (the Megatron pair) on the replicated-value ops."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._mpi import CommRef
from .._replicated import sum_replicated, use_replicated
from ._shard import block, comm_ref, gather_blocks, own, take, take_block


def _dense(layer, in_features, out_features, use_bias, key, dense):
    if dense is not None:
        got = tuple(dense.weight.shape)
        if got != (out_features, in_features):  # (a slice of another shape: wrong shards)
            raise ValueError(f"vjpmpi.nn.{layer}: argument 'dense' has a weight of shape "
                             f"{got}, but out_features={out_features} and "
                             f"in_features={in_features} make {(out_features, in_features)}")
        return dense
    if key is None:
        raise ValueError(f"vjpmpi.nn.{layer}: pass `key=` (or build the layer with "
                         "`from_dense`)")
    return eqx.nn.Linear(in_features, out_features, use_bias, key=key)


def _rebuild(layer, weight, bias) -> eqx.nn.Linear:
    dense = eqx.nn.Linear(layer.in_features, layer.out_features, bias is not None,
                          dtype=weight.dtype, key=jax.random.PRNGKey(0))
    dense = eqx.tree_at(lambda m: m.weight, dense, weight)
    return dense if bias is None else eqx.tree_at(lambda m: m.bias, dense, bias)


class _ShardedLinear(eqx.Module):
    """A linear layer whose weight is split over `comm` along `_axis` (0: output
    features, 1: input features); the bias is split with the output features."""

    weight: Float[Array, "out_block in_block"]
    bias: Float[Array, " out_block"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)
    _axis = 0

    def _shard(self, in_features, out_features, use_bias, key, dense, comm):
        layer, axis = type(self).__name__, self._axis
        dense = _dense(layer, in_features, out_features, use_bias, key, dense)
        self.comm = comm_ref(comm, layer)
        what = ("out_features", "in_features")[axis]
        weight = take_block(dense.weight, self.comm, layer, what, axis)
        has_bias = dense.bias is not None
        bias = (take_block(dense.bias, self.comm, layer, what) if has_bias and axis == 0
                else dense.bias)
        self.weight, self.bias = own((weight, bias), self.comm)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_dense(cls, layer: eqx.nn.Linear, comm=None, **options):
        """Slice a standard `eqx.nn.Linear` (the same on every rank) into this rank's shard.

        Args:
            layer (eqx.nn.Linear): the whole layer, the same on every rank.
            comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the
                communicator (None: vjpmpi's private duplicate of COMM_WORLD; a
                `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the
                ranks).
            **options (Any): the layer's keyword (`gather_output=` for
                `ColumnParallelLinear`, `input_is_parallel=` for `RowParallelLinear`).

        Returns:
            (ColumnParallelLinear | RowParallelLinear): the layer (of the class it is
                called on) holding this rank's shard of `layer`'s weight and bias.

        Raises:
            ValueError: the split feature axis is not divisible by the communicator's size.
            TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
                or None.
        """
        return cls(layer.in_features, layer.out_features, layer.bias is not None, comm=comm,
                   dense=layer, **options)

    def _block(self) -> tuple[int, int]:
        """[start, stop) of this rank's block of the split feature axis."""
        n, what = ((self.out_features, "out_features"), (self.in_features, "in_features"))[
            self._axis]
        return block(n, self.comm, type(self).__name__, what)

    def to_dense(self) -> eqx.nn.Linear:
        """Gather the shards into an `eqx.nn.Linear` on every rank (an allgather: every
        rank must call it).

        Returns:
            The whole `eqx.nn.Linear` (`(out_features, in_features)` weight), the same on
                every rank.
        """
        bias = self.bias
        if bias is not None and self._axis == 0:
            bias = gather_blocks(bias, self.comm, 0)
        return _rebuild(self, gather_blocks(self.weight, self.comm, self._axis), bias)


class ColumnParallelLinear(_ShardedLinear):
    """`eqx.nn.Linear` with the weight split by output features over `comm`.

    Rank `r` holds rows `r * out_features // size` to `(r + 1) * out_features // size`
    of the weight (and that block of the bias) and computes that block of the output
    from the replicated input. Initialising from `key` gives the same global weights as
    `eqx.nn.Linear(key=key)` on any number of ranks. The first layer of a Megatron-LM
    pair; `RowParallelLinear` (with `input_is_parallel=True`) takes its block as it is.

    On a device communicator (`vjpmpi.device_comm`, the layer built inside the
    `jax.shard_map` body) every device is a rank: it keeps the block of its rank (a traced
    value, sliced with `jax.lax.dynamic_slice`), and each of its parameters varies over
    the mesh axis (each device's own copy, as each process's on a process communicator),
    so that its gradient is the device's own; pass it out of the shard_map split over the
    axis (`out_specs=P(axis)`) and back in the same way.

    Args:
        in_features (int): the input's size.
        out_features (int): the output's size (all ranks together), divisible by the
            communicator's size.
        use_bias (bool): whether the layer has a bias (split with the output features).
        gather_output (bool): return the whole replicated output (False: this rank's
            block of it).
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the weight is split over (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        key (jax.random.PRNGKey | None): the initialisation key, the same on every rank
            (each rank draws the whole layer and keeps its block); needed unless `dense`
            is given.
        dense (eqx.nn.Linear | None): a whole layer (the same on every rank) to split
            instead of drawing one (what `from_dense` passes); its bias, or none, is kept
            whatever `use_bias` says, and `in_features`, `out_features` must be its own.

    Raises:
        ValueError: neither `key` nor `dense` is given, `dense` has a weight of shape other than `(out_features, in_features)`,
            or `out_features` is not divisible by the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        replicated `(in_features,)` -> this rank's block `(out_features // size,)`, or with
        `gather_output=True` the replicated `(out_features,)`.

    Transpose:
        the input is marked with `use_replicated`: the backward pass allreduces the
        input cotangent (its gradient sums all ranks' contributions); the gathered
        output's cotangent is taken as replicated (each rank keeps its slice of it).

    Example:
        ```python
        import jax, jax.numpy as jnp
        import vjpmpi, vjpmpi.nn as vnn

        k1, k2 = jax.random.split(jax.random.PRNGKey(0))  # the same keys on every rank
        col = vnn.ColumnParallelLinear(8, 16, key=k1)  # this rank: 16 // size outputs
        row = vnn.RowParallelLinear(16, 8, key=k2)     # takes that block, sums over ranks
        x = jnp.arange(8.0)
        y = row(jax.nn.relu(col(x)))                   # replicated: the same on every rank
        dense_col, dense_row = col.to_dense(), row.to_dense()
        assert jnp.allclose(y, dense_row(jax.nn.relu(dense_col(x))), atol=1e-5)
        ```
    """

    gather_output: bool = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, *,
                 gather_output: bool = False, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.Linear | None = None):
        self.gather_output = gather_output
        self._shard(in_features, out_features, use_bias, key, dense, comm)

    def local(self, x: Float[Array, " in"]) -> Float[Array, " out_block"]:
        """This rank's block of the output, from an input already marked with
        `use_replicated` (layers sharing one input mark it once: one backward allreduce).

        No communication, forward or backward: `weight @ x + bias` on this rank's block.

        Args:
            x (Array): the input, `(in_features,)`, already marked with `use_replicated`
                (or whose gradient is summed over the ranks otherwise).

        Returns:
            This rank's block of the output, `(out_features // size,)`.
        """
        y = self.weight @ x
        return y if self.bias is None else y + self.bias

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        """Apply the layer to a replicated input.

        Args:
            x (Array): the input, `(in_features,)`, the same on every rank (`jax.vmap`
                for a batch).
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            This rank's block of the output, `(out_features // size,)`, or with
                `gather_output=True` the whole output `(out_features,)` on every rank.
        """
        y = self.local(use_replicated(x, comm=self.comm))
        if not self.gather_output:
            return y
        # Place the block in a zero vector and sum over ranks: a replicated gather
        # whose backward hands each rank its slice of the replicated cotangent.
        start, _ = self._block()
        full = jax.lax.dynamic_update_slice(jnp.zeros((self.out_features,), y.dtype), y, (start,))
        return sum_replicated(full, comm=self.comm)


class RowParallelLinear(_ShardedLinear):
    """`eqx.nn.Linear` with the weight split by input features over `comm`.

    Rank `r` holds columns `r * in_features // size` to `(r + 1) * in_features // size`
    of the weight and the whole bias; each rank multiplies its block of the input, the
    partial products are summed over the ranks and the bias is added once, after the
    reduction. The second layer of a Megatron-LM pair (see `ColumnParallelLinear`).
    Initialising from `key` gives the same global weights as `eqx.nn.Linear(key=key)`.

    On a device communicator (`vjpmpi.device_comm`, the layer built inside the
    `jax.shard_map` body) every device is a rank: it keeps the block of its rank (a traced
    value, sliced with `jax.lax.dynamic_slice`), and each of its parameters varies over
    the mesh axis (each device's own copy, as each process's on a process communicator),
    so that its gradient is the device's own; pass it out of the shard_map split over the
    axis (`out_specs=P(axis)`) and back in the same way.

    Args:
        in_features (int): the input's size (all ranks together), divisible by the
            communicator's size.
        out_features (int): the output's size.
        use_bias (bool): whether the layer has a bias (replicated).
        input_is_parallel (bool): the input is this rank's block of the features (True),
            or the whole replicated input, which the layer splits on entry (False).
        comm (MPI.Intracomm | vjpmpi.DeviceComm | None): the communicator
            the weight is split over (None: vjpmpi's private duplicate of COMM_WORLD; a
            `vjpmpi.device_comm` inside a `jax.shard_map` body: its devices are the ranks).
        key (jax.random.PRNGKey | None): the initialisation key, the same on every rank
            (each rank draws the whole layer and keeps its block); needed unless `dense`
            is given.
        dense (eqx.nn.Linear | None): a whole layer (the same on every rank) to split
            instead of drawing one (what `from_dense` passes); its bias, or none, is kept
            whatever `use_bias` says, and `in_features`, `out_features` must be its own.

    Raises:
        ValueError: neither `key` nor `dense` is given, `dense` has a weight of shape other than `(out_features, in_features)`,
            or `in_features` is not divisible by the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator, a device communicator
            or None.

    Shape:
        this rank's block `(in_features // size,)` (`input_is_parallel=True`) or the
        replicated `(in_features,)` (`input_is_parallel=False`) -> replicated
        `(out_features,)`.

    Transpose:
        the partial products are summed with `sum_replicated`: one allreduce forward,
        none backward (each rank's block gets its slice of the replicated cotangent);
        with `input_is_parallel=False` the input is marked with `use_replicated`, so
        the backward pass allreduces its cotangent.
    """

    input_is_parallel: bool = eqx.field(static=True)
    _axis = 1

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, *,
                 input_is_parallel: bool = True, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.Linear | None = None):
        self._shard(in_features, out_features, use_bias, key, dense, comm)
        self.input_is_parallel = input_is_parallel

    def partial(self, x: Float[Array, " in_block"]) -> Float[Array, " out"]:
        """This rank's term of the output (no sum over ranks, no bias): for a
        sequence-parallel block, which reduce-scatters the terms instead.

        No communication, forward or backward: `weight @ x` on this rank's block.

        Args:
            x (Array): this rank's block of the input, `(in_features // size,)`.

        Returns:
            This rank's term of the output, `(out_features,)`: the output is the sum of
                the ranks' terms plus the bias.
        """
        return self.weight @ x

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        """Apply the layer: this rank's partial product, summed over the ranks, plus bias.

        Args:
            x (Array): this rank's block of the input, `(in_features // size,)`, or with
                `input_is_parallel=False` the whole input `(in_features,)`, the same on
                every rank (`jax.vmap` for a batch).
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            The output, `(out_features,)`, the same on every rank.
        """
        if not self.input_is_parallel:
            start, _ = self._block()
            x = take(use_replicated(x, comm=self.comm), start, self.weight.shape[1])
        y = sum_replicated(self.weight @ x, comm=self.comm)
        return y if self.bias is None else y + self.bias
