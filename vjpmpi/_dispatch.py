"""Program order across separately dispatched XLA programs on the CPU.

Inside one program the token chain orders the collectives.  Between programs
(eager ops, separately jitted functions) order is the order of dispatch only
if the CPU client runs programs synchronously: with asynchronous dispatch a
program whose inputs are ready can start before an earlier one still waiting
for its inputs, and two ranks could then enter collectives in different
orders.  vjpmpi therefore turns JAX's CPU async dispatch off at import, which
must happen before JAX creates its CPU client (before the first array).
"""

from __future__ import annotations

import warnings

import jax

from ._jax_compat import cpu_client_started

_LATE = (
    "vjpmpi was imported after JAX created its CPU client with asynchronous dispatch, "
    "so separately dispatched programs may run out of order and deadlock MPI. Import "
    "vjpmpi before creating any JAX array, or set JAX_CPU_ENABLE_ASYNC_DISPATCH=false."
)


class OrderingWarning(RuntimeWarning):
    """Emitted at `import vjpmpi` when JAX may run programs out of dispatch order.

    A warning, not an exception: the import goes on.
    vjpmpi turns JAX's asynchronous CPU dispatch off at import, which must happen before JAX
    creates its CPU client. When vjpmpi is imported after a JAX array was created and
    `jax_cpu_enable_async_dispatch` is still on, separately dispatched programs may run
    out of order on different ranks and deadlock MPI. Import vjpmpi before creating any
    JAX array, or set `JAX_CPU_ENABLE_ASYNC_DISPATCH=false`.
    """


def ensure_synchronous_cpu_dispatch() -> bool:
    """Turn off CPU async dispatch; warn (and return False) if it is too late."""
    if not cpu_client_started():
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        return True
    if jax.config.read("jax_cpu_enable_async_dispatch"):
        warnings.warn(_LATE, OrderingWarning, stacklevel=3)
        return False
    return True
