"""A row-block distributed matrix, its exact transpose, and conjugate gradients.

    mpiexec -n 2 python examples/transpose_cg.py

Rank r owns the row block A_r (n/size rows of a global n x n matrix A) and the
matching block x_r of a distributed vector x. The product y = A x is
y_r = A_r @ allgather(x). vjpmpi transposes allgather into reduce_scatter(SUM),
so `jax.linear_transpose` of that product is exactly A^T, with inner products
taken as sums over ranks. The script checks:

1. the dot-product test <A x, w> = <x, A^T w>, and A^T w against dense NumPy;
2. a hand-written distributed CG on M = A^T A + I (global dot products via
   allreduce), and `jax.scipy.sparse.linalg.cg` on a replicated vector with the
   operator sum_replicated(A_r^T A_r use_replicated(x)) + x, both against
   `np.linalg.solve`;
3. the gradient of a scalar function of the solution with respect to the
   right-hand side (implicit, through `lax.custom_linear_solve`), against the
   dense M^{-T} g.
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
SHIFT = 1.0  # M = A^T A + SHIFT * I is symmetric positive definite
CG_TOL = 1e-14  # relative residual at which both CG solvers stop


# ------------------------------------------------------------------ data --
def global_matrix(n: int, seed: int = 0) -> np.ndarray:
    """The same n x n matrix on every rank (entries ~ N(0, 1/n), so ||A|| ~ 2)."""
    return np.random.default_rng(seed).standard_normal((n, n)) / np.sqrt(n)


def local_random(m: int, seed: int) -> jnp.ndarray:
    """A length-m block of a random distributed vector, different on every rank."""
    rng = np.random.default_rng([seed, COMM.rank])
    return jnp.asarray(rng.standard_normal(m))


def to_global(x_local) -> np.ndarray:
    """Concatenate every rank's block in rank order (plain mpi4py, for references)."""
    return np.concatenate(COMM.allgather(np.asarray(x_local)))


def global_dot(a, b) -> float:
    """<a, b> of two distributed vectors: the sum over ranks of the local dots."""
    return COMM.allreduce(float(jnp.vdot(a, b)), op=MPI.SUM)


def rel_error(value: np.ndarray, reference: np.ndarray) -> float:
    """||value - reference|| / ||reference|| (2-norms)."""
    return float(np.linalg.norm(value - reference) / np.linalg.norm(reference))


# ---------------------------------------------------- distributed operator --
def make_operator(a_local):
    """y_r = A_r @ x for the distributed x; returns (matvec, rmatvec, normal)."""

    def matvec(x_local):
        return a_local @ vjpmpi.allgather(x_local).reshape(-1)

    x_block = jax.ShapeDtypeStruct(a_local.shape[:1], a_local.dtype)  # x_r: as long as A_r is tall
    transpose = jax.linear_transpose(matvec, x_block)

    def rmatvec(w_local):  # (A^T w)_r = block r of sum_s A_s^T w_s: a reduce_scatter
        return transpose(w_local)[0]

    def normal(x_local):  # M x = A^T A x + SHIFT x
        return rmatvec(matvec(x_local)) + SHIFT * x_local

    return matvec, rmatvec, normal


# -------------------------------------------------------- distributed CG --
def distributed_cg(apply_m, b, *, tol=CG_TOL, maxiter=1000):
    """Conjugate gradients on a distributed vector; returns (x, iterations).

    Every dot product is global (allreduce), so all ranks take the same branch
    of the loop condition and issue the same collectives.
    """

    def gdot(u, v):
        return vjpmpi.allreduce(jnp.vdot(u, v), MPI.SUM)

    stop = tol**2 * gdot(b, b)

    def keep_going(state):
        _, _, _, rr, k = state
        return (rr > stop) & (k < maxiter)

    def step(state):
        x, r, p, rr, k = state
        mp = apply_m(p)
        alpha = rr / gdot(p, mp)
        x = x + alpha * p
        r = r - alpha * mp
        rr_new = gdot(r, r)
        return x, r, r + (rr_new / rr) * p, rr_new, k + 1

    x0 = jnp.zeros_like(b)
    x, _, _, _, k = jax.lax.while_loop(keep_going, step, (x0, b, b, gdot(b, b), 0))
    return x, k


def distributed_solve(apply_m, b):
    """(M^{-1} b, CG iterations), differentiable in b: the VJP is one more CG solve.

    `custom_linear_solve` differentiates implicitly (M is symmetric, so the
    transposed solve is the same CG) instead of unrolling the loop.
    """
    return jax.lax.custom_linear_solve(
        apply_m, b, distributed_cg, symmetric=True, has_aux=True
    )


def local_objective(x):
    """f(x) = sum(sin x) + |x|^2 / 2 over the entries held here."""
    return jnp.sum(jnp.sin(x)) + 0.5 * jnp.vdot(x, x)


def distributed_objective(x_local):
    """f of a distributed x, the same on every rank."""
    return vjpmpi.sum_replicated(local_objective(x_local))  # allreduce forward, identity backward


def objective_grad_reference(x: np.ndarray) -> np.ndarray:
    return np.cos(x) + x


# ------------------------------------------------------ replicated variant --
def make_replicated_operator(a_local):
    """M x for an x held whole on every rank: the sum over ranks of A_r^T A_r x, plus x."""

    def apply_m(x):
        partial_sum = a_local.T @ (a_local @ vjpmpi.use_replicated(x))
        return vjpmpi.sum_replicated(partial_sum) + SHIFT * x

    return apply_m


# ------------------------------------------------------------------- main --
def main(n: int = 48) -> dict:
    """Run every check at global size n (divisible by the rank count); same dict on every rank."""
    rank, size = COMM.rank, COMM.size
    if n % size:
        raise ValueError(f"n={n} is not divisible by the number of ranks ({size})")
    m = n // size
    a_global = global_matrix(n)
    m_global = a_global.T @ a_global + SHIFT * np.eye(n)
    a_local = jnp.asarray(a_global[rank * m:(rank + 1) * m])
    matvec, rmatvec, normal = make_operator(a_local)

    # 1. dot-product test and A^T w against dense NumPy
    x, w = local_random(m, 1), local_random(m, 2)
    ax, atw = jax.jit(lambda u, v: (matvec(u), rmatvec(v)))(x, w)
    lhs, rhs = global_dot(ax, w), global_dot(x, atw)
    dot_rel_diff = abs(lhs - rhs) / max(abs(lhs), abs(rhs))
    transpose_max_err = float(np.max(np.abs(to_global(atw) - a_global.T @ to_global(w))))
    matvec_max_err = float(np.max(np.abs(to_global(ax) - a_global @ to_global(x))))

    # 2. solve M x = b and 3. differentiate f(x(b)) in b, one compiled program per solver
    b = local_random(m, 3)
    b_global = to_global(b)
    x_ref = np.linalg.solve(m_global, b_global)
    grad_ref = np.linalg.solve(m_global.T, objective_grad_reference(x_ref))

    def distributed_loss(rhs):
        sol, iters = distributed_solve(normal, rhs)
        return distributed_objective(sol), (sol, iters)

    (_, (sol, iters)), grad = jax.jit(jax.value_and_grad(distributed_loss, has_aux=True))(b)
    cg_rel_error = rel_error(to_global(sol), x_ref)
    grad_rel_error = rel_error(to_global(grad), grad_ref)

    apply_rep = make_replicated_operator(a_local)

    def replicated_loss(rhs):  # rhs, sol and f are whole (and equal) on every rank
        sol = jax.scipy.sparse.linalg.cg(apply_rep, rhs, tol=CG_TOL, atol=0.0)[0]
        return local_objective(sol), sol

    (_, sol_rep), grad_rep = jax.jit(jax.value_and_grad(replicated_loss, has_aux=True))(
        jnp.asarray(b_global)
    )
    cg_replicated_rel_error = rel_error(np.asarray(sol_rep), x_ref)
    grad_replicated_rel_error = rel_error(np.asarray(grad_rep), grad_ref)

    results = {
        "n": n,
        "ranks": size,
        "inner_Ax_w": lhs,
        "inner_x_ATw": rhs,
        "dot_rel_diff": dot_rel_diff,
        "matvec_max_err": matvec_max_err,
        "transpose_max_err": transpose_max_err,
        "cg_iterations": int(iters),
        "cg_rel_error": cg_rel_error,
        "cg_replicated_rel_error": cg_replicated_rel_error,
        "grad_rel_error": grad_rel_error,
        "grad_replicated_rel_error": grad_replicated_rel_error,
    }
    # Local references differ only by rounding; report the worst rank so the dict agrees everywhere.
    errors = [k for k in results if k.endswith(("_err", "_error", "_diff"))]
    return {**results, **{k: COMM.allreduce(results[k], op=MPI.MAX) for k in errors}}


if __name__ == "__main__":
    import time

    start = time.perf_counter()
    res = main()
    elapsed = time.perf_counter() - start
    if COMM.rank == 0:
        print(f"n = {res['n']} on {res['ranks']} rank(s), M = A^T A + {SHIFT:g} I")
        print(f"  <A x, w>   = {res['inner_Ax_w']:+.16e}")
        print(f"  <x, A^T w> = {res['inner_x_ATw']:+.16e}")
        print(f"  dot-product test, relative difference     {res['dot_rel_diff']:.2e}")
        print(f"  A x   vs dense NumPy, max abs error       {res['matvec_max_err']:.2e}")
        print(f"  A^T w vs dense NumPy, max abs error       {res['transpose_max_err']:.2e}")
        print(f"  distributed CG vs np.linalg.solve, rel    {res['cg_rel_error']:.2e}"
              f"  ({res['cg_iterations']} iterations)")
        print(f"  jax.scipy cg (replicated) vs solve, rel   {res['cg_replicated_rel_error']:.2e}")
        print(f"  df/db (distributed) vs M^-T f'(x), rel    {res['grad_rel_error']:.2e}")
        print(f"  df/db (replicated)  vs M^-T f'(x), rel    {res['grad_replicated_rel_error']:.2e}")
        print(f"  total time {elapsed:.2f} s")
