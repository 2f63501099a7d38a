"""Which accelerator a rank should use: one GPU per rank on each node."""

from __future__ import annotations

import jax
from mpi4py import MPI


def node_local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's index among the ranks of `comm` on its node.

    Collective over `comm` (MPI `Split_type(COMM_TYPE_SHARED)`): call it on every rank.

    Args:
        comm (MPI.Intracomm | None): the communicator (None: `MPI.COMM_WORLD`).

    Returns:
        (int): This rank's rank among the ranks of `comm` that share its node (0 for the
            first).

    Raises:
        AttributeError: when `comm` is not an mpi4py communicator (it has no
            `Split_type`).
        MPI.Exception: when MPI reports an error in the split.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.rank
    finally:
        node.Free()


def local_device(backend: str = "gpu", comm: MPI.Intracomm | None = None):
    """The device of `backend` this rank should use: local rank modulo devices per node.

    Use it as `jax.config.update("jax_default_device", vjpmpi.local_device())` once at
    start-up, or set `CUDA_VISIBLE_DEVICES` from `node_local_rank()` before JAX starts.
    Collective over `comm` (it calls `node_local_rank`): call it on every rank.

    Args:
        backend (str): the JAX backend whose devices to choose from (`"gpu"`, `"cpu"`,
            ...).
        comm (MPI.Intracomm | None): the communicator whose ranks share the node's
            devices (None: `MPI.COMM_WORLD`).

    Returns:
        (jax.Device): One of `jax.local_devices(backend=backend)`: number
            `node_local_rank(comm)` modulo their count.

    Raises:
        RuntimeError: when JAX has no such backend (e.g. `"gpu"` on a machine without
            one), from `jax.local_devices`.
        AttributeError: when `comm` is not an mpi4py communicator.
        MPI.Exception: when MPI reports an error in the split.
    """
    devices = jax.local_devices(backend=backend)
    return devices[node_local_rank(comm) % len(devices)]
