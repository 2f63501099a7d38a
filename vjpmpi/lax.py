"""JAX's named-axis collectives across processes: `jax.lax`'s signatures, inside
`jax.shard_map` over this process's devices, the named axis extended over every process of
vjpmpi's default communicator (global size `P * D`, global index `rank * D + axis_index`).
A `shard_map` program written for one process of `P * D` devices runs across `P`
processes by changing `jax.lax` to `vjpmpi.lax`, with the same values and gradients."""

from ._lax import all_gather as all_gather
from ._lax import all_to_all as all_to_all
from ._lax import axis_index as axis_index
from ._lax import axis_size as axis_size
from ._lax import pmax as pmax
from ._lax import pmean as pmean
from ._lax import pmin as pmin
from ._lax import ppermute as ppermute
from ._lax import psum as psum
from ._lax import psum_scatter as psum_scatter
from ._lax import ragged_all_to_all as ragged_all_to_all

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "psum_scatter",
           "ppermute", "ragged_all_to_all", "axis_index", "axis_size"]
