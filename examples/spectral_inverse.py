"""Recover the initial state of a 3-D pseudo-spectral advection-diffusion solver by
gradient descent, with distributed FFTs (`vjpmpi.fft`) on a pencil decomposition.

    mpiexec -n 4 python examples/spectral_inverse.py           # writes examples/out/spectral_inverse.png
    mpiexec -n 2 python examples/spectral_inverse.py --quick   # small grid, no picture

A scalar c on the periodic unit cube is carried by a fixed ABC flow v and diffuses:
c_t + v . grad c = nu lap c. Each step keeps c in Fourier space: the gradient comes
from i k c_k (three `irfftn`s), the advection term is formed on the grid and
transformed back (`rfftn`), and diffusion is implicit. The grid is split over a 2-D
process grid (`vjpmpi.ProcessGrid`): each transform is local FFTs plus alltoall
transposes. `jax.grad` differentiates through all of them (the transposes of the
FFTs are FFTs, those of the alltoalls are alltoalls), so the initial field is
recovered from the final one by gradient descent on the globally summed misfit.

The example checks the distributed gradient and the whole descent against the same
solver on the full grid in one process (`jnp.fft`).
"""

import vjpmpi  # first: vjpmpi sets JAX's CPU dispatch up before any array exists

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from plots import save_fields
from single_process import on_one_rank

jax.config.update("jax_enable_x64", True)

NU, DT = 0.02, 0.01  # diffusivity; time step (implicit diffusion: the step map has norm <= 1)
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "spectral_inverse.png"
# (grid size per axis, time steps, descent iterations); sizes divide the grids of 1-4 ranks
FULL = dict(n=32, steps=30, iters=40)
QUICK = dict(n=16, steps=20, iters=15)


def wavenumbers(n: int):
    """Global (kx, ky, kz) of the rfftn spectrum of an n^3 grid, broadcastable."""
    k = 2 * np.pi * np.fft.fftfreq(n, 1 / n)
    kz = 2 * np.pi * np.arange(n // 2 + 1)
    return k[:, None, None], k[None, :, None], kz[None, None, :]


def velocity(n: int):
    """The ABC flow (sin 2pi z + cos 2pi y, sin 2pi x + cos 2pi z, sin 2pi y + cos 2pi x):
    divergence-free, |v| <= 2, chaotic streamlines."""
    x = np.arange(n) / n
    X, Y, Z = np.meshgrid(x, x, x, indexing="ij")
    s, c = lambda a: np.sin(2 * np.pi * a), lambda a: np.cos(2 * np.pi * a)
    return np.stack([s(Z) + c(Y), s(X) + c(Z), s(Y) + c(X)])


def make_solver(n: int, steps: int, rfftn, irfftn, k, v):
    """c0 (grid) -> c(steps) (grid). `rfftn`/`irfftn` and the blocks `k`, `v` are the
    distributed ones or the single-process ones: the solver is the same code."""
    k2 = k[0] ** 2 + k[1] ** 2 + k[2] ** 2

    def step(ck, _):
        grad = [irfftn(1j * ki * ck) for ki in k]
        adv = rfftn(sum(vi * gi for vi, gi in zip(v, grad)))
        return (ck - DT * adv) / (1 + DT * NU * k2), None

    def solve(c0):
        ck = jax.lax.scan(jax.checkpoint(step), rfftn(c0), None, length=steps)[0]
        return irfftn(ck)

    return solve


def true_initial_field(n: int) -> np.ndarray:
    """A few Gaussian blobs of both signs on the periodic cube."""
    x = (np.arange(n) + 0.5) / n
    field = np.zeros((n, n, n))
    for cx, cy, cz, w, amp in [(0.3, 0.3, 0.5, 0.12, 1.0), (0.7, 0.4, 0.3, 0.10, -0.8),
                               (0.5, 0.75, 0.7, 0.14, 0.7)]:
        d = [(x - c + 0.5) % 1.0 - 0.5 for c in (cx, cy, cz)]
        r2 = d[0][:, None, None] ** 2 + d[1][None, :, None] ** 2 + d[2][None, None, :] ** 2
        field += amp * np.exp(-r2 / (2 * w * w))
    return field


def descend(value_and_grad, c, obs, iters: int, lr: float = 1.0):
    """Nesterov-accelerated gradient descent on the (quadratic) misfit."""
    prev, history = c, []
    for i in range(iters):
        y = c + (i / (i + 3)) * (c - prev)
        value, g = value_and_grad(y, obs)
        prev, c = c, y - lr * g
        history.append(float(value))
    return c, history


def main(quick: bool = False, out: str | None = str(DEFAULT_OUT)) -> dict:
    """Run the example; returns the checks (identical on every rank)."""
    cfg = QUICK if quick else FULL
    n, steps, iters = cfg["n"], cfg["steps"], cfg["iters"]
    start = time.perf_counter()
    grid = vjpmpi.ProcessGrid.create(2)  # pencils: axes 0, 1 split, axis 2 whole
    shape, spec_shape = (n, n, n), (n, n, n // 2 + 1)
    phys, spec = (0, 1), (1, 2)  # the grid axes of the physical / spectral layouts

    # This rank's blocks of the wavenumbers (spectral layout) and the flow (physical).
    kb = [grid.local(np.broadcast_to(ki, spec_shape), spec) for ki in wavenumbers(n)]
    vb = [grid.local(vi, phys) for vi in velocity(n)]
    solve = make_solver(n, steps, lambda c: vjpmpi.fft.rfftn(c, grid),
                        lambda ck: vjpmpi.fft.irfftn(ck, grid, n=n), kb, vb)

    def loss(c0, obs):  # the global misfit, the same scalar on every rank
        return vjpmpi.sum_replicated(0.5 * jnp.sum((solve(c0) - obs) ** 2), comm=grid.cart)

    ref_solve = make_solver(n, steps, jnp.fft.rfftn, lambda ck: jnp.fft.irfftn(ck, s=shape, axes=(0, 1, 2)),
                            [jnp.asarray(ki) for ki in wavenumbers(n)],
                            [jnp.asarray(vi) for vi in velocity(n)])

    def ref_loss(c0, obs):
        return 0.5 * jnp.sum((ref_solve(c0) - obs) ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    ref_value_and_grad = jax.jit(jax.value_and_grad(ref_loss))

    truth = true_initial_field(n)
    obs = jax.jit(solve)(grid.local(truth, phys))
    obs_global = grid.gather(obs, shape, phys)

    # 1. The distributed gradient against the single-process one, at a random point.
    probe = np.random.default_rng(0).standard_normal(shape)
    _, g = value_and_grad(grid.local(probe, phys), obs)
    g_ref = on_one_rank(lambda: np.asarray(ref_value_and_grad(
        jnp.asarray(probe), jnp.asarray(obs_global))[1]), grid.cart)
    grad_rel_diff = float(np.abs(grid.gather(g, shape, phys) - g_ref).max()
                          / np.abs(g_ref).max())

    # 2. Recover the initial field from the observation, starting from zero; the same
    #    descent in one process on the full grid.
    c0, history = descend(value_and_grad, jnp.zeros_like(obs), obs, iters)
    recovered = grid.gather(c0, shape, phys)

    def reference_descent():
        c, h = descend(ref_value_and_grad, jnp.zeros(shape), jnp.asarray(obs_global), iters)
        return np.asarray(c), h

    ref_c0, ref_history = on_one_rank(reference_descent, grid.cart)
    run_rel_diff = float(np.abs(recovered - np.asarray(ref_c0)).max() / np.abs(ref_c0).max())
    recovery_rel_error = float(np.linalg.norm(recovered - truth) / np.linalg.norm(truth))
    elapsed = time.perf_counter() - start

    if grid.cart.rank == 0:
        print(f"{n}^3 grid on a {grid.dims[0]}x{grid.dims[1]} process grid, {steps} steps, "
              f"{iters} descent iterations ({elapsed:.1f} s)")
        print(f"  gradient vs single-process solver: max rel. difference {grad_rel_diff:.2e}")
        print(f"  recovered field vs single-process descent: max rel. difference "
              f"{run_rel_diff:.2e}")
        print(f"  loss {history[0]:.3e} -> {history[-1]:.3e}")
        print(f"  recovered initial field: rel. error {recovery_rel_error:.3f} "
              f"(zero guess: 1.000)")
        if out is not None:
            z = int(0.5 * n)
            save_fields(out, [("true initial field (z = 1/2)", truth[:, :, z]),
                              (f"observation after {steps} steps", obs_global[:, :, z]),
                              (f"recovered ({iters} iterations)", recovered[:, :, z])])
            print(f"  wrote {out}")
    grid.free()
    return {"grad_rel_diff": grad_rel_diff, "run_rel_diff": run_rel_diff,
            "recovery_rel_error": recovery_rel_error, "loss_history": history,
            "ref_loss_history": ref_history}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid, fewer iterations")
    parser.add_argument("--out", default=None,
                        help="PNG path (default examples/out/spectral_inverse.png; "
                             "with --quick none unless given)")
    args = parser.parse_args()
    main(quick=args.quick, out=args.out or (None if args.quick else str(DEFAULT_OUT)))
