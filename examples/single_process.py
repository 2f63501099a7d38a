"""The examples' single-process references: computed once, on one rank."""

import time

from mpi4py import MPI


def on_one_rank(compute, comm=MPI.COMM_WORLD, root=0):
    """`compute()` run on `root` alone; its result (any picklable value: convert JAX arrays
    with `np.asarray`) is returned on every rank of `comm`.

    `compute` must not communicate over `comm` (it runs on one rank). The other ranks
    wait in a non-blocking barrier polled with short sleeps instead of a blocking MPI
    call, which spins at full speed and takes a core from the root wherever ranks share
    cores (a laptop, a CI machine)."""
    value = compute() if comm.rank == root else None
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(0.005)
    return comm.bcast(value, root=root)
