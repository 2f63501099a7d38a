"""MPI objects as static parameters: communicators, reduction ops and dtypes.

Communicators and ops enter jaxprs as small frozen records: a communicator as
vjpmpi's own number for it (kept on the communicator as an MPI attribute, so every
mpi4py object of it has the same number, and never given to another communicator,
unlike MPI's handle, which MPI hands out again once a communicator is freed), an op
as its code. Fresh `MPI.SUM` or communicator objects never cause a recompilation,
and a program compiled for a freed communicator fails instead of running on the
next communicator that gets its handle.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
from mpi4py import MPI

from . import _jax_compat as jc
from . import _kernels  # (loads the kernels: their reduction and dtype tables)

__all__ = ["CommRef", "DeviceCommRef", "as_comm", "as_red", "check_dtype", "check_red_dtype", "RED_NAMES"]


@dataclasses.dataclass(frozen=True)
class CommRef:
    """A communicator as a static parameter: equal iff vjpmpi's number for it is (1: the
    default communicator, 2: COMM_WORLD, 3: COMM_SELF, then in order of first use)."""

    id: int
    size: int
    rank: int
    comm: Any = dataclasses.field(compare=False, hash=False, repr=False)

    def __post_init__(self):  # hashed on every eager call: once is enough
        object.__setattr__(self, "_hash", hash((self.id, self.size, self.rank)))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"CommRef(#{self.id}, size={self.size}, rank={self.rank})"


@dataclasses.dataclass(frozen=True)
class DeviceCommRef:
    """A device communicator (`vjpmpi.device_comm`) as a static parameter: the process
    communicator `base`, the mesh axis whose devices are its ranks and their number per
    process, `local`. Rank `base.rank * local + axis index`, size `base.size * local`."""

    base: CommRef
    axis: str
    local: int

    @property
    def id(self) -> int:  # (the kernels' number: the process communicator's)
        return self.base.id

    @property
    def size(self) -> int:
        return self.base.size * self.local

    @property
    def comm(self):
        return self.base.comm

    @property
    def rank(self):
        """This device's rank, traced: valid inside the shard_map (its axis index)."""
        return jc.axis_rank(self.axis, self.base.rank * self.local)

    def __repr__(self) -> str:
        return f"DeviceCommRef(#{self.base.id}, axis={self.axis!r}, size={self.size})"


def _int64(v: int) -> int:
    # (mpi4py may report an MPICH handle sign-extended to 64 unsigned bits)
    return v - (1 << 64) if v >= (1 << 63) else v


def _record(comm: MPI.Comm) -> CommRef:
    number = _kernels.cpu.comm_number(_int64(comm.handle))
    return CommRef(number, comm.Get_size(), comm.Get_rank(), comm)


_default_lock = threading.Lock()
_default: CommRef | None = None


def _world_nodes(world: MPI.Intracomm) -> list[int]:
    """The node of each rank of `world` (a duplicate of COMM_WORLD), numbered by the
    node's lowest rank: the processes MPI_COMM_TYPE_SHARED puts together. Collective."""
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        first = np.array([local.allreduce(world.rank, op=MPI.MIN)], np.intc)
    finally:
        local.Free()
    nodes = np.empty(world.size, np.intc)
    world.Allgather(first, nodes)
    return nodes.tolist()


def default_comm() -> MPI.Intracomm:
    """vjpmpi's private duplicate of COMM_WORLD, what `comm=None` means.

    Made when vjpmpi is imported (every rank imports it at the same point of an SPMD
    program), with its agreement window, not at first use: a hidden collective at first
    use would hang any rank whose first vjpmpi call comes at a different point. It returns
    errors (`MPI.ERRORS_RETURN`) and is named `vjpmpi.COMM_WORLD`.

    Returns:
        (MPI.Intracomm): The duplicate communicator (an `MPI.Intracomm` with COMM_WORLD's
            ranks), the same object at every call.

    Raises:
        MPI.Exception: only where MPI was not initialized when vjpmpi was imported, so that
            this first call makes the duplicate (a collective over COMM_WORLD), and MPI
            reports an error.
    """
    global _default
    with _default_lock:
        if _default is None:
            dup = MPI.COMM_WORLD.Dup()
            dup.Set_errhandler(MPI.ERRORS_RETURN)
            dup.Set_name("vjpmpi.COMM_WORLD")
            _kernels.cpu.set_world_nodes(_world_nodes(dup))
            _default = _record(dup)  # (numbers 1, 2, 3: the same in every process)
            # its agreement window, where each rank says whether it has called MPI_Finalize
            # and what it refused at trace time, for the ranks that wait for it on any
            # communicator: made here, where every rank makes it (a first collective that
            # waits for a rank that never comes then learns why)
            _kernels.cpu.open_world(_default.id)
            _record(MPI.COMM_WORLD)
            _record(MPI.COMM_SELF)
        return _default.comm


_FREED = "vjpmpi.{op}: argument 'comm' is a null or freed communicator (MPI.COMM_NULL)"

# Validated communicators by handle (eager calls validate on every call: keep it cheap).
# An entry is used only for the very object it was made from: a freed communicator's
# object has the null handle, and a new object with a reused handle is validated anew.
_checked: dict[int, CommRef] = {}


def as_comm(comm: Any, op: str) -> CommRef:
    """Validate `comm` for op `op` and return its static record (a record given, one
    resolved at the public edge already, is returned as it is)."""
    if type(comm) is DeviceCommRef or hasattr(comm, "_device_ref"):  # (vjpmpi.device_comm)
        ref = comm if type(comm) is DeviceCommRef else comm._device_ref
        as_comm(ref.base, op)
        return ref
    if type(comm) is CommRef:  # (its communicator validated when it was made)
        if MPI.Is_finalized():
            raise RuntimeError(f"vjpmpi.{op}: MPI has been finalized; no collective can run")
        if comm.comm == MPI.COMM_NULL:
            raise ValueError(_FREED.format(op=op))
        return comm
    if comm is None:
        comm = _default.comm if _default is not None else default_comm()
    ref = _checked.get(getattr(comm, "handle", None))
    if ref is not None and ref.comm is comm:
        if MPI.Is_finalized():
            raise RuntimeError(f"vjpmpi.{op}: MPI has been finalized; no collective can run")
        return ref
    if not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"vjpmpi.{op}: argument 'comm' must be an mpi4py intracommunicator or None, "
            f"got {type(comm).__name__}"
        )
    if MPI.Is_finalized():
        raise RuntimeError(f"vjpmpi.{op}: MPI has been finalized; no collective can run")
    if comm == MPI.COMM_NULL:
        raise ValueError(_FREED.format(op=op))
    if comm.Is_inter():
        raise TypeError(
            f"vjpmpi.{op}: argument 'comm' must be an intracommunicator, got an intercommunicator"
        )
    # The record compares by (number, size, rank), so caches keyed on it hit for every
    # object of the same communicator; `.comm` is the object it was validated from.
    ref = _record(comm)
    if len(_checked) > 256:
        _checked.clear()
    _checked[comm.handle] = ref
    return ref


# Reduction codes: a reduction's code is its position in the compiled kernels'
# table (`VJPMPI_REDUCTIONS` in csrc/mpi_ops.h, the one source), each name
# that of its mpi4py op.
RED_NAMES: tuple[str, ...] = _kernels.REDUCTIONS
ANY_TAG: int = MPI.ANY_TAG  # (a receive's tag that matches any, as call sites show it)


class Reduction(int):
    """A reduction code that shows as its name (`red=MAX` in a jaxpr)."""

    def __repr__(self) -> str:
        return RED_NAMES[self]

    __str__ = __repr__


_CODES = tuple(Reduction(i) for i in range(len(RED_NAMES)))
_RED_BY_HANDLE = {getattr(MPI, n).handle: _CODES[i] for i, n in enumerate(RED_NAMES)}
SUM, PROD, MAX, MIN, LAND, LOR, LXOR, BAND, BOR, BXOR = (
    _CODES[RED_NAMES.index(n)]
    for n in ("SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")
)


def as_red(op: Any, name: str) -> int:
    """The reduction code of `op` (an `MPI.Op` such as `MPI.SUM`, or its name; a code
    given, one converted at the public edge already, is returned as it is)."""
    if type(op) is Reduction:
        return op
    if isinstance(op, str):
        key = op.upper()
        if key in RED_NAMES:
            return _CODES[RED_NAMES.index(key)]
    elif isinstance(op, MPI.Op) and op.handle in _RED_BY_HANDLE:
        return _RED_BY_HANDLE[op.handle]
    raise ValueError(
        f"vjpmpi.{name}: argument 'op' must be one of MPI.{', MPI.'.join(RED_NAMES)} "
        f"(or its name as a string), got {op!r}"
    )


def _numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 comes from ml_dtypes, a jax dependency
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


# The dtypes the kernels support (`VJPMPI_KINDS` in csrc/mpi_ops.h).
_DTYPES = frozenset(_numpy_dtype(n) for n in _kernels.DTYPES)


def check_dtype(dtype: Any, op: str, arg: str = "x") -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(
            f"vjpmpi.{op}: argument '{arg}' has unsupported dtype {dtype}; supported: "
            + ", ".join(sorted(str(d) for d in _DTYPES))
        )
    return dtype


def check_red_dtype(red: int, dtype: np.dtype, op: str) -> int:
    """Check that reduction `red` is defined for `dtype`; map bool's aliases."""
    kind = dtype.kind
    if kind == "b":
        # Logical and bitwise ops agree on bool; MAX/MIN are OR/AND.
        alias = {BAND: LAND, BOR: LOR, BXOR: LXOR, MAX: LOR, MIN: LAND}
        red = alias.get(red, red)
        if red in (LAND, LOR, LXOR):
            return red
    elif kind in "iu":
        return red
    elif kind == "f" or dtype.name == "bfloat16":
        if red in (SUM, PROD, MAX, MIN):
            return red
    elif kind == "c":
        if red in (SUM, PROD):
            return red
    raise TypeError(
        f"vjpmpi.{op}: reduction MPI.{RED_NAMES[red]} is not defined for dtype {dtype}"
    )


if MPI.Is_initialized() and not MPI.Is_finalized():
    default_comm()
