"""vjpmpi's hooks in JAX, installed once, when vjpmpi is imported: the effects of the
chain and of tangent collectives, dead code elimination that keeps what communicates,
tangent rules that run on every rank, the ordered lowering, the batching of loops
whose condition communicates, and JAX's implicit sums over mesh axes that vjpmpi extends
across processes (`_jax_compat.install` says what each patch is).
"""

from __future__ import annotations

from . import _jax_compat as jc
from ._lax import extended, extended_psum
from ._ordering import batched_while, mark, unchained_jaxpr
from ._primitive import (COLLECTIVES, LINEARIZED, ORDERED, binds_collective, communicates,
                         contains_collective)


def install() -> None:
    """Install the seam (idempotent: `_jax_compat.install` runs once)."""
    jc.install(ordered=ORDERED, linearized=LINEARIZED, communicates=communicates,
               binds_collective=binds_collective, is_own=COLLECTIVES.__contains__,
               contains=contains_collective, mark=mark, unchained=unchained_jaxpr,
               batched_while=batched_while, extended=extended, extended_psum=extended_psum)
