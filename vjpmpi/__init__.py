"""vjpmpi: strictly ordered, differentiable MPI collectives for JAX (XLA FFI kernels)."""

from ._ops import allgather as allgather
from ._ops import allreduce as allreduce
from ._ops import alltoall as alltoall
from ._ops import barrier as barrier
from ._ops import bcast as bcast
from ._ops import exscan as exscan
from ._ops import gather as gather
from ._ops import recv as recv
from ._ops import reduce as reduce
from ._ops import reduce_scatter as reduce_scatter
from ._ops import scan as scan
from ._ops import scatter as scatter
from ._ops import send as send
from ._ops import sendrecv as sendrecv
from ._mpi import default_comm as default_comm

__version__ = "0.1.0"
