"""`ordered_collective`: user-defined composite collectives as one differentiable unit."""

from __future__ import annotations

import functools
from typing import Callable

import jax


def ordered_collective(fun: Callable | None = None, *, name: str | None = None):
    """Turn a function built from vjpmpi collectives into one ordered, differentiable unit.

    The differentiation rules live on each vjpmpi primitive (JVP = the op on the
    tangents, transpose = the true adjoint, zero cotangents made real so that every
    rank runs every transposed collective), so a composite inherits them exactly:

    - forward: its collectives run in program order on the caller's token chain;
    - reverse mode: their transposes run in exactly the reverse order, on every rank,
      whatever outputs carry zero cotangents;
    - `jax.jvp`, `jax.vmap`, `jax.jit`, `jax.checkpoint` and nesting work unchanged.

    The decorator names the unit in the lowered program (`vjpmpi.<name>`), so it is
    visible in HLO dumps and profiles, and checks that it returns arrays. Use it bare
    (`@vjpmpi.ordered_collective`) or with a name (`@vjpmpi.ordered_collective(name="halo")`).

    Args:
        fun (Callable | None): the function to wrap, of any arguments, returning a pytree
            of arrays; None to get a decorator that takes it (`name` given alone).
        name (str | None): the unit's name in the lowered program (default: `fun`'s
            `__name__`).

    Returns:
        (Callable): The wrapped function (same signature and results as `fun`), or, when
            `fun` is None, a decorator that makes one.

    Raises:
        TypeError: when the wrapped function is called and `fun` returns a leaf that is
            not an array (pytrees of arrays only); and whatever its collectives raise.

    Shape:
        `fun`'s.

    Transpose:
        the composite's own adjoint, assembled from its collectives' partners.

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi
        r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        @vjpmpi.ordered_collective
        def halo(u):  # this rank's cells and, each side, its neighbour's (periodic)
            left = vjpmpi.sendrecv(u[-1:], u[:1], source=(r - 1) % n, dest=(r + 1) % n)
            right = vjpmpi.sendrecv(u[:1], u[-1:], source=(r + 1) % n, dest=(r - 1) % n)
            return jnp.concatenate([left, u, right])
        y, back = jax.vjp(halo, jnp.arange(2.0) + 2 * r)  # 0, 1, ..., 2n - 1 in blocks of 2
        assert y[0] == (2 * r - 1) % (2 * n) and (back(jnp.ones(4))[0] == 2.0).all()
        ```
    """
    if fun is None:
        return functools.partial(ordered_collective, name=name)
    label = f"vjpmpi.{name or getattr(fun, '__name__', 'collective')}"

    @functools.wraps(fun)
    def unit(*args, **kwargs):
        with jax.named_scope(label):
            out = fun(*args, **kwargs)
        for leaf in jax.tree_util.tree_leaves(out):
            if not hasattr(leaf, "shape"):
                raise TypeError(f"{label}: must return arrays (pytrees of arrays), got {leaf!r}")
        return out

    unit.__vjpmpi_ordered_collective__ = True
    return unit
