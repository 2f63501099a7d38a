"""Tensor-parallel linear layers (the Megatron pair) on the replicated-value ops."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._mpi import CommRef
from .._replicated import sum_replicated, use_replicated
from ._shard import block, comm_ref, gather_blocks


def _dense(in_features, out_features, use_bias, key, dense):
    if dense is not None:
        return dense
    if key is None:
        raise ValueError("vjpmpi.nn: pass `key=` (or build the layer with `from_dense`)")
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
        dense = _dense(in_features, out_features, use_bias, key, dense)
        layer, axis = type(self).__name__, self._axis
        self.comm = comm_ref(comm, layer)
        start, stop = block((out_features, in_features)[axis], self.comm, layer,
                            ("out_features", "in_features")[axis])
        self.weight = dense.weight[start:stop] if axis == 0 else dense.weight[:, start:stop]
        has_bias = dense.bias is not None
        self.bias = dense.bias[start:stop] if has_bias and axis == 0 else dense.bias
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_dense(cls, layer: eqx.nn.Linear, comm=None, **options):
        """Slice a standard `eqx.nn.Linear` (the same on every rank) into this rank's shard;
        `options`: the layer's keyword (`gather_output=` / `input_is_parallel=`)."""
        return cls(layer.in_features, layer.out_features, layer.bias is not None, comm=comm,
                   dense=layer, **options)

    def _block(self) -> tuple[int, int]:
        """[start, stop) of this rank's block of the split feature axis."""
        n, what = ((self.out_features, "out_features"), (self.in_features, "in_features"))[
            self._axis]
        return block(n, self.comm, type(self).__name__, what)

    def to_dense(self) -> eqx.nn.Linear:
        """Gather the shards into an `eqx.nn.Linear` on every rank."""
        bias = self.bias
        if bias is not None and self._axis == 0:
            bias = gather_blocks(bias, self.comm, 0)
        return _rebuild(self, gather_blocks(self.weight, self.comm, self._axis), bias)


class ColumnParallelLinear(_ShardedLinear):
    """`eqx.nn.Linear` with the weight split by output features over `comm`.

    Shape: replicated `Float[Array, "in"]` -> this rank's block `Float[Array, "out/size"]`,
    or with `gather_output=True` the replicated `Float[Array, "out"]`.
    Transpose: the input is marked with `use_replicated` (its gradient sums all ranks'
    contributions); the gathered output's cotangent is taken as replicated.
    Initialising from `key` gives the same global weights as `eqx.nn.Linear(key=key)`
    on any number of ranks.
    """

    gather_output: bool = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, *,
                 gather_output: bool = False, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.Linear | None = None):
        self.gather_output = gather_output
        self._shard(in_features, out_features, use_bias, key, dense, comm)

    def local(self, x: Float[Array, " in"]) -> Float[Array, " out_block"]:
        """This rank's block of the output, from an input already marked with
        `use_replicated` (layers sharing one input mark it once: one backward allreduce)."""
        y = self.weight @ x
        return y if self.bias is None else y + self.bias

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
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

    Shape: this rank's block `Float[Array, "in/size"]` (`input_is_parallel=True`) or the
    replicated `Float[Array, "in"]` (split on entry) -> replicated `Float[Array, "out"]`.
    Transpose: the partial products are summed with `sum_replicated` (one allreduce
    forward, none backward); the bias is added once, after the reduction.
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
        sequence-parallel block, which reduce-scatters the terms instead."""
        return self.weight @ x

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        if not self.input_is_parallel:
            start, stop = self._block()
            x = use_replicated(x, comm=self.comm)[start:stop]
        y = sum_replicated(self.weight @ x, comm=self.comm)
        return y if self.bias is None else y + self.bias
