"""Every vjpmpi collective once, printed rank by rank.

    mpiexec -n 2 python examples/demo.py
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import jax
import jax.numpy as jnp
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
nxt, prv = (rank + 1) % size, (rank - 1) % size
blocks = lambda x: jnp.stack([x + j for j in range(size)])  # noqa: E731  (size, *x.shape)

COLLECTIVES = [
    ("allreduce(SUM)", lambda x: vjpmpi.allreduce(x, MPI.SUM)),
    ("reduce(MAX, root=0)", lambda x: vjpmpi.reduce(x, MPI.MAX, 0)),
    ("bcast(root=0)", lambda x: vjpmpi.bcast(x, 0)),
    ("allgather", lambda x: vjpmpi.allgather(x)),
    ("gather(root=0)", lambda x: vjpmpi.gather(x, 0)),
    ("scatter(root=0)", lambda x: vjpmpi.scatter(blocks(x) if rank == 0 else x, 0)),
    ("alltoall", lambda x: vjpmpi.alltoall(blocks(x))),
    ("reduce_scatter(SUM)", lambda x: vjpmpi.reduce_scatter(blocks(x), MPI.SUM)),
    ("scan(SUM)", lambda x: vjpmpi.scan(x, MPI.SUM)),
    ("exscan(SUM)", lambda x: vjpmpi.exscan(x, MPI.SUM)),
    ("sendrecv(ring)", lambda x: vjpmpi.sendrecv(x, x, prv, nxt)),
]


@jax.jit
def run_all(x):
    outs = [fn(x) for _, fn in COLLECTIVES]  # executed in this order on every rank
    vjpmpi.barrier()
    return outs


x = jnp.arange(3.0) + 10 * rank
results = run_all(x)
for r in range(size):
    if r == rank:
        print(f"--- rank {rank} of {size}: x = {x.tolist()}")
        for (name, _), value in zip(COLLECTIVES, results):
            print(f"  {name:22s} {value.tolist()}")
    comm.Barrier()
