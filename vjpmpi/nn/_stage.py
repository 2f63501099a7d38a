"""A pipeline stage of equal layers: a stack of layers split over the pipeline's ranks."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._mpi import CommRef
from .._movement import allgather
from ._shard import block_length, comm_ref


def _stack_length(arrays, what: str) -> int:
    lengths = {int(jnp.shape(a)[0]) if jnp.ndim(a) else None
               for a in jax.tree_util.tree_leaves(arrays)}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"vjpmpi.nn.PipelineStage: {what} must be layers stacked on a leading "
                         f"axis (every array of the same length on axis 0, e.g. from "
                         f"eqx.filter_vmap), got leading lengths {sorted(map(str, lengths))}")
    return lengths.pop()


class PipelineStage(eqx.Module):
    """Rank `s`'s stage of a pipeline of equal layers: layers `s * k` to `(s + 1) * k - 1`
    of a stack of `n` (`k = n / size`), run in order.

    The layers are one equinox module stacked on a leading axis (`eqx.filter_vmap` of its
    constructor over keys), the same on every rank; each rank keeps its block of the
    stack. `vjpmpi.nn.layout` marks the stack `Split` along axis 0 over `comm`, so that
    the gradient syncs never sum one stage's layers with another's and a checkpoint saved
    at one number of stages loads at another (the stack regrouped). Pass it as the
    `stage` of `pipeline_value_and_grad` (whose gradient of a stage is that of the loss
    the stages share).

    Args:
        layers (PyTree): the whole stack: a callable module whose array leaves all have
            the number of layers `n` on axis 0, the same on every rank.
        comm (MPI.Intracomm | None): the pipeline's communicator, one
            rank per stage (None: vjpmpi's private duplicate of COMM_WORLD); `n` must be a
            multiple of its size.

    Raises:
        ValueError: array leaves of different lengths on axis 0 (not a stack), or a
            number of layers that is not a multiple of the communicator's size.
        TypeError: `comm` is not an mpi4py intracommunicator or None.

    Shape:
        a layer's input -> its output (the layers of this stage applied in order).

    Transpose:
        no communication (the pipeline's messages are `pipeline_value_and_grad`'s).

    Example:
        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        from mpi4py import MPI
        import vjpmpi.nn as vnn

        size = MPI.COMM_WORLD.size
        keys = jax.random.split(jax.random.PRNGKey(0), 2 * size)
        stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(keys)  # 2 per stage
        stage = vnn.PipelineStage(stack)
        assert stage.layers.weight.shape == (2, 3, 3)
        assert stage.to_dense().weight.shape == (2 * size, 3, 3)
        ```
    """

    layers: PyTree
    count: int = eqx.field(static=True)
    comm: CommRef = eqx.field(static=True)

    def __init__(self, layers: PyTree, comm=None):
        self.comm = comm_ref(comm, "PipelineStage")
        arrays, static = eqx.partition(layers, eqx.is_array)
        n = _stack_length(arrays, "argument 'layers'")
        k = block_length(n, self.comm, "PipelineStage", "the number of layers")
        lo = self.comm.rank * k
        self.layers = eqx.combine(jax.tree_util.tree_map(lambda a: a[lo:lo + k], arrays), static)
        self.count = n

    def __call__(self, x, *, key=None):
        """Apply this stage's layers in order (a `jax.lax.scan` over the stack).

        Args:
            x (Array): the first layer's input.
            key (jax.random.PRNGKey | None): unused (equinox's layer signature).

        Returns:
            (Array): the last layer's output.
        """
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, a):
            return eqx.combine(a, static)(h), None

        return jax.lax.scan(body, x, arrays)[0]

    def to_dense(self) -> PyTree:
        """Gather every stage's layers into the whole stack on every rank (an allgather:
        every rank must call it).

        Returns:
            (PyTree): the stack of all `count` layers, as given to the constructor.
        """
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        whole = jax.tree_util.tree_map(
            lambda a: allgather(a, comm=self.comm).reshape(self.count, *a.shape[1:]), arrays)
        return eqx.combine(whole, static)
