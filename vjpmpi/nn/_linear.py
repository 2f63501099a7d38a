"""Tensor-parallel linear layers (the Megatron pair) on the replicated-value ops."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._mpi import CommRef
from .._ops import sum_replicated, use_replicated
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


class ColumnParallelLinear(eqx.Module):
    """`eqx.nn.Linear` with the weight split by output features over `comm`.

    Shape: replicated `Float[Array, "in"]` -> this rank's block `Float[Array, "out/size"]`,
    or with `gather_output=True` the replicated `Float[Array, "out"]`.
    Transpose: the input is marked with `use_replicated` (its gradient sums all ranks'
    contributions); the gathered output's cotangent is taken as replicated.
    Initialising from `key` gives the same global weights as `eqx.nn.Linear(key=key)`
    on any number of ranks.
    """

    weight: Float[Array, "out_block in"]
    bias: Float[Array, " out_block"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    gather_output: bool = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, *,
                 gather_output: bool = False, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.Linear | None = None):
        dense = _dense(in_features, out_features, use_bias, key, dense)
        self.comm = comm_ref(comm, "ColumnParallelLinear")
        start, stop = block(out_features, self.comm, "ColumnParallelLinear", "out_features")
        self.weight = dense.weight[start:stop]
        self.bias = None if dense.bias is None else dense.bias[start:stop]
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output

    @classmethod
    def from_dense(cls, layer: eqx.nn.Linear, comm=None, *, gather_output: bool = False):
        """Slice a standard `eqx.nn.Linear` (the same on every rank) into this rank's shard."""
        return cls(layer.in_features, layer.out_features, layer.bias is not None,
                   gather_output=gather_output, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.Linear:
        """Gather the shards into an `eqx.nn.Linear` on every rank."""
        bias = None if self.bias is None else gather_blocks(self.bias, self.comm, 0)
        return _rebuild(self, gather_blocks(self.weight, self.comm, 0), bias)

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        y = self.weight @ use_replicated(x, comm=self.comm.comm)
        if self.bias is not None:
            y = y + self.bias
        if not self.gather_output:
            return y
        # Place the block in a zero vector and sum over ranks: a replicated gather
        # whose backward hands each rank its slice of the replicated cotangent.
        start, _ = block(self.out_features, self.comm, "ColumnParallelLinear", "out_features")
        full = jax.lax.dynamic_update_slice(jnp.zeros((self.out_features,), y.dtype), y, (start,))
        return sum_replicated(full, comm=self.comm.comm)


class RowParallelLinear(eqx.Module):
    """`eqx.nn.Linear` with the weight split by input features over `comm`.

    Shape: this rank's block `Float[Array, "in/size"]` (`input_is_parallel=True`) or the
    replicated `Float[Array, "in"]` (split on entry) -> replicated `Float[Array, "out"]`.
    Transpose: the partial products are summed with `sum_replicated` (one allreduce
    forward, none backward); the bias is added once, after the reduction.
    """

    weight: Float[Array, "out in_block"]
    bias: Float[Array, " out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    input_is_parallel: bool = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, *,
                 input_is_parallel: bool = True, comm=None, key: PRNGKeyArray | None = None,
                 dense: eqx.nn.Linear | None = None):
        dense = _dense(in_features, out_features, use_bias, key, dense)
        self.comm = comm_ref(comm, "RowParallelLinear")
        start, stop = block(in_features, self.comm, "RowParallelLinear", "in_features")
        self.weight = dense.weight[:, start:stop]
        self.bias = dense.bias
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_dense(cls, layer: eqx.nn.Linear, comm=None, *, input_is_parallel: bool = True):
        """Slice a standard `eqx.nn.Linear` (the same on every rank) into this rank's shard."""
        return cls(layer.in_features, layer.out_features, layer.bias is not None,
                   input_is_parallel=input_is_parallel, comm=comm, dense=layer)

    def to_dense(self) -> eqx.nn.Linear:
        """Gather the shards into an `eqx.nn.Linear` on every rank."""
        return _rebuild(self, gather_blocks(self.weight, self.comm, 1), self.bias)

    def __call__(self, x: Float[Array, " in"], *, key=None) -> Float[Array, " out"]:
        if not self.input_is_parallel:
            start, stop = block(self.in_features, self.comm, "RowParallelLinear", "in_features")
            x = use_replicated(x, comm=self.comm.comm)[start:stop]
        y = sum_replicated(self.weight @ x, comm=self.comm.comm)
        return y if self.bias is None else y + self.bias
