"""Which accelerator a rank should use: one GPU per rank on each node."""

from __future__ import annotations

import jax
from mpi4py import MPI


def node_local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's index among the ranks of `comm` (default COMM_WORLD) on its node.

    Collective over `comm` (MPI `Split_type(COMM_TYPE_SHARED)`): call it on every rank.
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
    Collective over `comm`.
    """
    devices = jax.local_devices(backend=backend)
    return devices[node_local_rank(comm) % len(devices)]
