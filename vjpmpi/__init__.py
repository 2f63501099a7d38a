"""vjpmpi: strictly ordered, differentiable MPI collectives for JAX (XLA FFI kernels)."""

import importlib.metadata as _metadata

from ._versions import JaxVersionWarning as JaxVersionWarning
from ._versions import check_jax as _check_jax

_check_jax()

from ._dispatch import OrderingWarning as OrderingWarning  # noqa: E402
from ._dispatch import ensure_synchronous_cpu_dispatch as _ensure_sync

_ensure_sync()

from ._movement import allgather as allgather  # noqa: E402
from ._reductions import allreduce as allreduce  # noqa: E402
from ._movement import alltoall as alltoall  # noqa: E402
from ._sync import barrier as barrier  # noqa: E402
from ._movement import bcast as bcast  # noqa: E402
from ._reductions import exscan as exscan  # noqa: E402
from ._sync import fence as fence  # noqa: E402
from ._movement import gather as gather  # noqa: E402
from ._p2p import recv as recv  # noqa: E402
from ._reductions import reduce as reduce  # noqa: E402
from ._reductions import reduce_scatter as reduce_scatter  # noqa: E402
from ._reductions import scan as scan  # noqa: E402
from ._movement import scatter as scatter  # noqa: E402
from ._p2p import send as send  # noqa: E402
from ._p2p import sendrecv as sendrecv  # noqa: E402
from ._replicated import sum_replicated as sum_replicated  # noqa: E402
from ._replicated import use_replicated as use_replicated  # noqa: E402
from ._ragged import allgatherv as allgatherv  # noqa: E402
from ._ragged import alltoallv as alltoallv  # noqa: E402
from ._ragged import gatherv as gatherv  # noqa: E402
from ._ragged import ragged_alltoall as ragged_alltoall  # noqa: E402
from ._ragged import scatterv as scatterv  # noqa: E402
from ._composite import ordered_collective as ordered_collective  # noqa: E402
from ._split import Pending as Pending  # noqa: E402
from ._split import start as start  # noqa: E402
from ._split import wait as wait  # noqa: E402
from ._kernels import async_threshold as async_threshold  # noqa: E402
from ._grid import ProcessGrid as ProcessGrid  # noqa: E402
from . import fft as fft  # noqa: E402
from . import lax as lax  # noqa: E402
from ._devices import DeviceComm as DeviceComm  # noqa: E402
from ._devices import device_comm as device_comm  # noqa: E402
from ._devices import local_device as local_device  # noqa: E402
from ._devices import node_local_rank as node_local_rank  # noqa: E402
from ._kernels import cuda_mode as cuda_mode  # noqa: E402
from ._kernels import custom_call_targets as custom_call_targets  # noqa: E402
from ._kernels import take_trace as take_trace  # noqa: E402
from ._mpi import default_comm as default_comm  # noqa: E402
from ._seam import install as _install_seam  # noqa: E402

_install_seam()  # (vjpmpi's hooks in JAX, once: every primitive above is registered)

__version__ = _metadata.version("vjpmpi")  # (the installed distribution's: pyproject.toml)
