"""`vjpmpi.fft`: differentiable FFTs of arrays distributed over a process grid.

Slab (a 1-D grid: a communicator or a 1-D `vjpmpi.ProcessGrid`) and pencil (a 2-D
`vjpmpi.ProcessGrid`) decompositions. Each transform is local FFTs along the axes a
rank holds whole and alltoall transposes between them, as one `ordered_collective`:
it works under `jit`, `vmap`, `grad`, `jvp` and `linear_transpose`, and its transpose
is the true adjoint of the global transform.

Layouts (this rank's block; P = the slab's ranks, P0 x P1 = the pencil's grid):

| decomposition | global shape | physical block (input) | spectral block (output) |
| --- | --- | --- | --- |
| slab, 2-D | (N0, N1) | (N0/P, N1) | (N0, N1/P) |
| slab, 3-D | (N0, N1, N2) | (N0/P, N1, N2) | (N0, N1/P, N2) |
| pencil, 3-D | (N0, N1, N2) | (N0/P0, N1/P1, N2) | (N0, N1/P0, N2/P1) |

In general, for a grid of g dimensions: physical splits axis i over grid dimension i,
spectral splits axis i + 1 over grid dimension i; `ProcessGrid.block` with
`axes=range(g)` / `axes=range(1, g + 1)` gives a rank's block. rfftn's last axis has
N//2 + 1 entries, split as evenly as it goes where the spectral layout splits it.
"""

from ._fft import fftn as fftn
from ._fft import ifftn as ifftn
from ._fft import irfftn as irfftn
from ._fft import rfftn as rfftn

__all__ = ["fftn", "ifftn", "rfftn", "irfftn"]
