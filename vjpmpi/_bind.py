"""Binding a collective: the checks at each call (host callbacks, the thread that owns
a communicator, argument errors that must reach every rank), the eager path (one
compiled program per primitive and parameters, kept) and the primitives' impl.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, NoReturn, Sequence

import jax
import jax.numpy as jnp

from . import _jax_compat as jc
from . import _kernels
from . import _placement
from ._mpi import CommRef, DeviceCommRef
from ._primitive import DYNAMIC, RANK_SLOTS, SPEC_OF

_IN_CALLBACK = (
    "vjpmpi.{op}: called from inside a host callback (jax.pure_callback, io_callback or "
    "debug.callback). The callback runs in the middle of another compiled program, "
    "ordered only by data dependencies, so its collectives could pair with different "
    "collectives on different ranks. Call vjpmpi in the traced program instead.")


# Eager calls: one jitted function per (primitive, parameters), kept, so that a call
# outside any trace goes straight to JAX's compiled-call fast path (by shape and
# dtype) instead of dispatching the primitive on its own.
_EAGER: dict = {}
_EAGER_MAX = 512


# Communicator number -> the Python thread that owns its collectives (the first that
# traced or ran one on it; the kernels hold the same record, see `claim_thread`).
_OWNERS: dict[int, int] = {}


def _claim(comm: CommRef, op: str) -> None:
    """This thread may run collectives on `comm` only if it owns it (the first thread to
    ask does): MPI leaves collectives issued from several threads on one communicator
    in no defined order across ranks."""
    me = threading.get_native_id()
    if _OWNERS.get(comm.id) == me:
        return
    owner, error = _kernels.cpu.claim_thread(comm.id, me)
    if error:
        raise RuntimeError(f"vjpmpi.{op}: {error}")
    _OWNERS[comm.id] = owner


def refusal(op: str, why: str) -> int:
    """An argument error that must reach every rank it concerns: the op is bound with it
    (parameter `invalid`, the hash of its text) instead of raising here, on one rank while
    the others would wait for this one forever. When the op runs, a collective fails on
    every rank of its communicator (the ranks' agreement carries the text), and a
    point-to-point op, whose peers cannot be told, ends the job with the text."""
    return _kernels.register_site(why if why.startswith("vjpmpi.") else f"vjpmpi.{op}: {why}")


def refuse_here(comm: CommRef, op: str, why: str, *, root: int = -1) -> NoReturn:
    """Raise `ValueError(why)` for an argument error that only this rank can see (the
    ranks that pair with it cannot check it), at trace time: this rank does not enter the
    collective. The ranks that do wait in it (their collective there one past this rank's
    count) stop with the same text, and every rank ends up at the same next call: this
    rank's note in the default communicator's window says what it refused (op, `root`; -1:
    an op without one). A rank that waits in it raises the text once this rank runs another
    call there (whose agreement waits for that), or once the note has stood for a second
    (or, inside MPI already, the job ends with it). A retry of the same call (same op and
    root) pairs with theirs, and ranks that never make the refused call (mpi4jax's tests
    of a root's bad input) pair with this rank's next call as usual."""
    text = why if why.startswith("vjpmpi.") else f"vjpmpi.{op}: {why}"
    _kernels.cpu.note_refusal(comm.id, op, root, text)
    raise ValueError(text)


def enter(prim: jc.Primitive, comm: CommRef, *, invalid: str | None = None,
          note: str | None = None, **params) -> dict:
    """The checks of a call of `prim` on `comm` as this thread makes it, before it is bound
    (or started: `vjpmpi.start`); returns its parameters besides `comm` (exactly those its
    spec declares, and `invalid` / `note`, registered). `invalid`: an argument error for
    `refusal`; `note`: what this rank's call is, shown for it when the ranks disagree
    (instead of its call site; not compared)."""
    if invalid is not None:
        params["invalid"] = refusal(prim.name.removeprefix("vjpmpi_"), invalid)
    if note is not None:
        params["note"] = _kernels.register_site(note)
    if jc.inside_host_callback():
        raise RuntimeError(_IN_CALLBACK.format(op=prim.name.removeprefix("vjpmpi_")))
    if not SPEC_OF[prim].point_to_point:
        _claim(comm, prim.name.removeprefix("vjpmpi_"))
    return params


def run(prim: jc.Primitive, args: Sequence, comm: CommRef, params: dict) -> list:
    """Bind `prim` on `args` with the parameters `enter` gave: in the trace, or eagerly.
    On a device communicator, arrays that do not vary over its axis are cast to (each
    device's call is its own), and ranks that each device computes go into the `ranks`
    operand."""
    if not jc.outside_traces():
        if isinstance(comm, DeviceCommRef):
            if jc.check_vma():
                args = [a if comm.axis in jc.vma_of(jax.typeof(a)) else jc.pvary(a, (comm.axis,))
                        for a in args]
            params, ranks = ranks_operand(SPEC_OF[prim], params)
            args = [*args, *ranks]
        return prim.bind(*args, comm=comm, **params)
    sharded = _placement.sharded_call(prim, SPEC_OF[prim], {"comm": comm, **params}, args)
    if sharded is not None:  # (each device its own part of the array)
        return sharded
    return eager(prim, {"comm": comm, **params})(*args)


def ranks_operand(spec, params: dict) -> tuple[dict, list]:
    """`params` with each rank that is a traced value replaced by its `DYNAMIC` entry, and
    the `ranks` operand holding the three ranks ([] where every rank is static)."""
    entries, dynamic = [0, 0, 0], False
    out = dict(params)
    for name, attr in spec.params.items():
        slot = RANK_SLOTS.get(attr)
        if slot is None or name not in params:
            continue
        v = params[name]
        if isinstance(v, int):
            entries[slot] = v
        else:
            entries[slot], out[name], dynamic = v, DYNAMIC[slot], True
    if not dynamic:
        return params, []
    return out, [jnp.stack([jnp.asarray(e, jnp.int32) for e in entries])]


def bind(prim: jc.Primitive, args: Sequence, comm: CommRef, **params) -> list:
    """Bind `prim` on `args` with its static parameters (`enter`, then `run`)."""
    return run(prim, args, comm, enter(prim, comm, **params))


def eager(prim: jc.Primitive, params: dict) -> Callable:
    """The jitted call of `prim` with `params` that eager calls run (kept while its
    communicator lives: a communicator's programs are its own)."""
    key = (prim, *params.items())  # (bind and JAX both pass `comm` first)
    call = _EAGER.get(key)
    if call is None:
        _forget_freed()
        if len(_EAGER) >= _EAGER_MAX:  # e.g. a fresh MPI.Status object on every call
            _EAGER.clear()
        call = _EAGER[key] = jax.jit(functools.partial(prim.bind, **params))
    return call


def _forget_freed() -> None:
    """Drop the eager programs of freed communicators (they can never run again)."""
    alive: dict[int, bool] = {}
    for key in list(_EAGER):
        number = dict(key[1:])["comm"].id
        if number not in alive:
            alive[number] = _kernels.cpu.comm_alive(number)
        if not alive[number]:
            del _EAGER[key]


def apply(prim: jc.Primitive, *args, **params) -> list:
    """`prim` on concrete arrays, bound outside any trace by JAX itself (an eager
    backward pass, or the body of a jit that `jax.disable_jit()` runs as Python)."""
    with jax.disable_jit(False):  # compiled whatever the caller's setting, as JAX's own
        return eager(prim, params)(*args)
