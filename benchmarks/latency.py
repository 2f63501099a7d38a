"""Small-message latency of vjpmpi against mpi4py's buffer API, in one run.

    mpiexec -n 2 python benchmarks/latency.py

Medians over repetitions, timed on rank 0 after a barrier. Reports per-op cost of
allreduce(SUM) inside a jitted fori_loop, one jitted call containing one
allreduce, and one eager call, next to mpi4py's Allreduce on NumPy buffers.
"""

import vjpmpi  # first: sets synchronous CPU dispatch before any array exists

import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.rank
REPS, N = 7, 2000


def median_time(fn, n):
    times = []
    for _ in range(REPS):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times))


def bench(elements):
    x_np = np.ones(elements, np.float32)
    y_np = np.empty_like(x_np)
    x = jnp.asarray(x_np)

    def mpi4py_loop():
        for _ in range(N):
            comm.Allreduce(x_np, y_np, op=MPI.SUM)

    loop = jax.jit(lambda v: jax.lax.fori_loop(
        0, N, lambda i, c: vjpmpi.allreduce(c, MPI.SUM) * (1.0 / comm.size), v))
    one = jax.jit(lambda v: vjpmpi.allreduce(v, MPI.SUM))
    loop(x).block_until_ready()
    one(x).block_until_ready()
    vjpmpi.allreduce(x, MPI.SUM).block_until_ready()

    def one_loop():
        for _ in range(N):
            y = one(x)
        y.block_until_ready()

    def eager_loop():
        for _ in range(N):
            y = vjpmpi.allreduce(x, MPI.SUM)
        y.block_until_ready()

    return {
        "mpi4py Allreduce": median_time(mpi4py_loop, N),
        "vjpmpi fori_loop": median_time(lambda: loop(x).block_until_ready(), N),
        "vjpmpi jit call": median_time(one_loop, N),
        "vjpmpi eager": median_time(eager_loop, N),
    }


if __name__ == "__main__":
    rows = [(n, bench(n)) for n in (1, 16, 256)]
    if rank == 0:
        print(f"allreduce(SUM) float32, {comm.size} ranks, median per op (us)")
        names = list(rows[0][1])
        print("| elements | " + " | ".join(names) + " | fori / mpi4py |")
        print("|---" * (len(names) + 2) + "|")
        for n, r in rows:
            cells = " | ".join(f"{r[k] * 1e6:.2f}" for k in names)
            print(f"| {n} | {cells} | {r['vjpmpi fori_loop'] / r['mpi4py Allreduce']:.2f} |")
