"""Lowering: a call of a collective becomes an XLA FFI custom call on the program's
token chain, with its attributes and a description of its call site (what the
watchdog, VJPMPI_CHECK and VJPMPI_TIMEOUT name).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np

from . import _jax_compat as jc
from . import _kernels
from ._mpi import ANY_TAG, RED_NAMES
from ._ordering import unchained
from . import _placement
from ._primitive import DYNAMIC, FFI_ATTRS, ORDERED, RANK_SLOTS, Collective, dynamic_ranks

# Every call's attributes, in the order of the kernels' `call` array (csrc/bindings.h).
CALL_ATTRS = ("comm", *FFI_ATTRS, "site", "sig", "invalid")

_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple(str(pathlib.Path(m.__file__).resolve().parent)
                      for m in (jax, np)) + (_PACKAGE_DIR, "<frozen")


# How a call-site description (VJPMPI_CHECK, VJPMPI_TIMEOUT) shows a parameter.
def _tag_text(name):
    return lambda t: f"{name}=ANY_TAG" if t == ANY_TAG else f"{name}={t}"


_DESCRIBE = {"red": lambda v: RED_NAMES[v], "root": "root={}".format,
             "dest": "dest={}".format, "source": "source={}".format,
             **{k: _tag_text(k) for k in ("tag", "sendtag", "recvtag")}}


def _int64(v: int) -> np.int64:
    # Handles and addresses travel as int64 bit patterns (mpi4py may report an
    # MPICH handle sign-extended to 64 unsigned bits).
    return np.int64(v - (1 << 64) if v >= (1 << 63) else v)


def _user_frame() -> str:
    """`file:line (function)` of the user code that issued the collective being lowered."""
    for frame in jc.user_frames():
        if not frame.file_name.startswith(_PACKAGE_DIR):
            return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    # eager calls: the Python stack of the call being compiled
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY_DIRS):
        f = f.f_back
    if f is None:
        return "an unknown location"
    return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"


def _site(ctx, spec: Collective, params) -> int:
    """Register a description of this call site with the kernels (what the watchdog, the
    check and the timeout name); the hash of its text, the same in every process that
    lowers the same call."""
    if spec.describe is not None:
        call = spec.describe(params)
    else:
        detail = [f"{k}=<each device's>" if params[k] in DYNAMIC else _DESCRIBE[k](params[k])
                  for k in spec.params if k in _DESCRIBE]
        detail += ["from the last rank down"] if spec.fixed.get("reverse") else []
        call = f"{spec.ffi_target()}({', '.join(detail)})"
    n = len(ctx.avals_in) - (1 if dynamic_ranks(params) else 0)
    avals = ", ".join(f"{a.dtype}{list(a.shape)}" for a in ctx.avals_in[:n])
    stage = " [backward]" if "transpose" in str(ctx.name_stack) else ""
    return _kernels.register_site(
        f"{call} on {avals or 'no data'}{stage} at {_user_frame()}")


def lower(ctx, *args, prim, spec: Collective, **params):
    """Lower to `vjpmpi_<target>`, taking the program's chain token and handing on the next.

    The chain runs through every collective of the program in program order, into and
    out of loops, branches and nested calls (see `Ordered`), so XLA cannot reorder two
    collectives, whatever the data dependencies between them on each rank.
    """
    if spec.ffi_target() is None:  # no communication: the identity, token passed on
        token = jc.chain_token(ctx, ORDERED)
        if token is not None:
            jc.set_chain_token(ctx, ORDERED, token)
        return list(args)
    where = None if spec.local else _placement.placement(ctx, spec.name, params["comm"])
    if where == "auto":  # several devices, partitioned by XLA: each device calls on its part
        return _placement.wrap(ctx, prim, spec, params, args)
    dynamic = dynamic_ranks(params)
    arrays = list(args[:-1] if dynamic else args)
    avals_in = list(ctx.avals_in[:len(arrays)])
    aliases = {}
    if spec.alias is not None:
        i, j = spec.alias
        a, b = avals_in[i], ctx.avals_out[j]
        k = spec.alias_apart(params)
        apart = k is not None and same_value(arrays[k], arrays[i])
        if a.shape == b.shape and a.dtype == b.dtype and not apart:
            aliases = {i: j}
    attrs = ffi_attrs(ctx, spec, params)
    target = f"vjpmpi_{spec.ffi_target()}"
    if where is None:
        return chained_call(ctx, spec, target, arrays, avals_in, ctx.avals_out, attrs, aliases)
    # a device call: `where` first (the device's partition, then the call's ranks)
    attrs["dev"] = where.attribute(params.get("level", 1), params.get("layout", 0))
    return chained_call(ctx, spec, target + "_dev", [device_where(spec, params, args), *arrays],
                        [WHERE, *avals_in], ctx.avals_out, attrs,
                        {i + 1: j for i, j in aliases.items()})


def same_value(a, b) -> bool:
    """Whether two lowered operands are one value (the same variable passed twice)."""
    return a is b or a == b


WHERE = jc.ShapedArray((4,), np.int32)  # (a device call's first operand)


def device_where(spec: Collective, params, args):
    """The `where` operand of a device call of `spec` being lowered: the device's partition,
    then the call's root, destination and source (from its `ranks` operand, the last of
    `args`, where each device computes them; else its static parameters)."""
    if dynamic_ranks(params):
        return jc.device_where(args[-1], 0, 0, 0)
    static = dict.fromkeys(RANK_SLOTS.values(), 0)
    for name, attr in spec.params.items():
        if attr in RANK_SLOTS:
            static[RANK_SLOTS[attr]] = int(params[name])
    return jc.device_where(None, static[0], static[1], static[2])


def chained_call(ctx, spec: Collective, target: str, args, avals_in, avals_out, attrs: dict,
                 aliases: dict | None = None) -> list:
    """The FFI custom call `target` (a call of `spec`) on the program's ordering chain:
    `args` (of `avals_in`) and the chain's token in, results of `avals_out` and the next
    token out; returns the results."""
    token = _chain_start(ctx, spec)
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True,
                                operand_output_aliases=aliases or {})
    sub = ctx.replace(avals_in=[*avals_in, jc.abstract_token],
                      avals_out=[*avals_out, jc.abstract_token])
    outs = rule(sub, *args, token, **attrs)
    jc.set_chain_token(ctx, ORDERED, outs[-1])
    return outs[:-1]


# The communicators whose numbers are the same in every process (the default one,
# COMM_WORLD, COMM_SELF: vjpmpi._mpi.default_comm), the only ones an exported program
# may name.
_EXPORTABLE_COMMS = (1, 2, 3)


def ffi_attrs(ctx, spec: Collective, params) -> dict:
    """The FFI attributes of one call of `spec` with `params` (every handler's set)."""
    if params["comm"].id not in _EXPORTABLE_COMMS and jc.lowering_for_export(ctx):
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: a program exported with jax.export names its communicator "
            f"by vjpmpi's number for it, given in order of first use (this one is "
            f"#{params['comm'].id}): in the process that loads it, that number could be "
            "another communicator's. Export programs on the default communicator, "
            "MPI.COMM_WORLD or MPI.COMM_SELF (#1-#3 in every process).")
    attrs = dict.fromkeys(CALL_ATTRS, 0)
    attrs.update({attr: int(_int64(params[k])) for k, attr in spec.params.items()})
    attrs.update({attr: int(v) for attr, v in spec.fixed.items()})
    attrs["comm"] = params["comm"].id
    # (what the watchdog's warnings, VJPMPI_CHECK and VJPMPI_TIMEOUT name; a note describes
    # the call instead)
    attrs["site"] = params.get("note", 0) or _site(ctx, spec, params)
    attrs["sig"] = params.get("sig", 0)
    attrs["invalid"] = params.get("invalid", 0)
    # The kernels read these by position from one int64 array, `call` (one attribute for
    # XLA to decode per call instead of twelve: csrc/bindings.h, AttrsOf); an op's own
    # attributes (the ragged exchange's `form` and `groups`) travel by name.
    extra = {k: np.int64(v) for k, v in attrs.items() if k not in CALL_ATTRS}
    return {"call": np.array([attrs[k] for k in CALL_ATTRS], np.int64), **extra}


def _chain_start(ctx, spec: Collective):
    """The chain's token for a call of `spec` being lowered, after the checks that the
    program can run it (platform, backend built)."""
    platforms = set(ctx.module_context.platforms)
    for other in sorted(platforms - {"cpu", "cuda"}):
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: vjpmpi has no {_BACKEND_NAMES.get(other, other)} backend "
            "(it has CPU and CUDA ones), so a program with collectives cannot be compiled for "
            f"{_BACKEND_NAMES.get(other, other)}")
    if "cuda" in platforms and spec.host_only:
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: has no CUDA kernel yet (host memory only), so a program "
            "with it cannot be compiled for a GPU; run it on the CPU backend")
    if "cuda" in platforms and _kernels.cuda is None:
        raise NotImplementedError(
            f"vjpmpi.{spec.name}: vjpmpi was built without its CUDA backend (no CUDA toolkit "
            "was found at build time), so it cannot run on a GPU. Rebuild it on a machine "
            "with the CUDA headers: VJPMPI_CUDA=1 pip install --no-cache-dir --force-reinstall "
            "vjpmpi")
    token = jc.chain_token(ctx, ORDERED)
    if token is None:
        raise unchained(spec.name, ctx.name_stack)
    return token


_BACKEND_NAMES = {"rocm": "ROCm", "tpu": "TPU", "METAL": "Metal"}
