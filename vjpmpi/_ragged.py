"""Variable-size exchanges: `ragged_alltoall` (JAX's ragged all-to-all over a communicator)
and the mpi4py-style v-collectives with run-time counts in a static capacity.

One primitive pair carries all of them (kernel `vjpmpi_ragged_alltoall`, csrc/ragged.h):
the forward exchange, linear in `(operand, output)`, and its transpose, the reverse
exchange. Offsets and sizes are int32 operands known only at run time; every rank's are
gathered to every rank inside the call, so a bad count is the same error everywhere.
The v-collectives are packed forms: the kernel places each received block after the
previous one, in source-rank order, instead of at an offset the sender names.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from ._bind import bind, refuse_here
from ._derive import make_primitive
from ._jax_compat import ShapedArray, Zero, instantiate_zeros, is_undefined_primal
from ._mpi import DeviceCommRef, as_comm
from ._primitive import Collective
from ._validate import array, rank

__all__ = ["ragged_alltoall", "alltoallv", "allgatherv", "gatherv", "scatterv"]

# The public op a call is (the kernel's `form`: the names its errors use).
_FORMS = {"ragged_alltoall": 0, "alltoallv": 1, "allgatherv": 2, "gatherv": 3, "scatterv": 4}
_PARAMS = {"form": "form", "groups": "groups", "root": "root"}


def _forward_avals(p, operand, output, *meta):
    return [output, meta[0].update(dtype=jnp.dtype(jnp.int32), weak_type=False)]


def _reverse_avals(p, ct, acc, *meta):
    return [acc, ct]


_NAMES = {code: name for name, code in _FORMS.items()}


def _describe(reverse):
    def describe(p):  # e.g. "gatherv(root=1, reverse exchange)"
        detail = [f"root={p['root']}"] if _NAMES[p["form"]] in ("gatherv", "scatterv") else []
        detail += [f"{p['groups']} batched"] if p["groups"] > 1 else []
        detail += ["reverse exchange"] if reverse else []
        return f"{_NAMES[p['form']]}({', '.join(detail)})"
    return describe


def _block(p, avals):  # what the ranks agree on: the number of slices and one row's shape
    return (avals[2].shape[0], *avals[0].shape[1:])


def _call(reverse, a0, a1, meta, p, *, tangent=False):
    """Bind the forward (a0 the operand, a1 the output) or reverse exchange (a0 the
    output-shaped cotangent, a1 the operand-shaped accumulator)."""
    pair = _LIN if tangent else _PRIM
    params = {k: p[k] for k in ("comm", *_PARAMS)}
    return pair[reverse].bind(a0, a1, *meta, **params)


def _jvp(reverse):
    def jvp(primals, tangents, outs, p):  # linear in (a0, a1); the int32 operands are fixed
        a0, a1, *meta = primals
        t0, t1 = (instantiate_zeros(t) for t in tangents[:2])
        r0, r1 = _call(reverse, t0, t1, meta, p, tangent=True)
        if reverse:
            return [r0, r1]
        return [r0, Zero(jax.typeof(outs[1]).to_tangent_aval())]
    return jvp


def _zeros_like_arg(arg):
    aval = arg.aval if is_undefined_primal(arg) else jax.typeof(arg)
    return jnp.zeros(aval.shape, aval.dtype)


def _transpose_forward(cts, args, p):
    # y = M(output) + S(operand): the reverse exchange gives S^T(ct) (added into zeros)
    # and M(ct) (ct with the received rows zeroed) in one call.
    operand, output, *meta = args
    a, b = _call(1, cts[0], _zeros_like_arg(operand), meta, p)
    return [a if is_undefined_primal(operand) else None,
            b if is_undefined_primal(output) else None, None, None, None, None]


def _transpose_reverse(cts, args, p):
    # (acc + S^T(ct), M(ct)): back to ct through S(ct_a) + M(ct_b), the forward exchange.
    ct, acc, *meta = args
    ct_a, ct_b = cts
    y, _ = _call(0, ct_a, ct_b, meta, p)
    return [y if is_undefined_primal(ct) else None, ct_a if is_undefined_primal(acc) else None,
            None, None, None, None]


def _batch(reverse):
    """vmap folds the batch into one call: batch element b's slices follow b-1's within
    each destination, as a group of their own (the kernel counts a group's offsets from
    its segment of the operand and the output: each rank knows only its own rows)."""
    def rule(prim, args, dims, p):
        n_batch = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        moved = [jnp.broadcast_to(a[None], (n_batch, *a.shape)) if d is None
                 else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        a0, a1, *meta = moved
        size = p["comm"].size
        n = meta[0].shape[1]
        per = n // size

        def fold(m):  # (B, size * per) -> size * B * per, destination (or source) first
            return m.reshape(n_batch, size, per).transpose(1, 0, 2).reshape(-1)
        r0, r1 = prim.bind(a0.reshape(-1, *a0.shape[2:]), a1.reshape(-1, *a1.shape[2:]),
                           *map(fold, meta),
                           **{**p, "groups": p["groups"] * n_batch})
        r0 = r0.reshape(n_batch, -1, *r0.shape[1:])
        if reverse:
            r1 = r1.reshape(n_batch, -1, *r1.shape[1:])
        else:
            r1 = r1.reshape(size, n_batch, per).transpose(1, 0, 2).reshape(n_batch, n)
        return [r0, r1], [0, 0]
    return rule


_SPECS = [
    Collective("ragged_alltoall", _forward_avals, _PARAMS, alias=(1, 0),
               linear=lambda p: False, nonlinear_jvp=_jvp(0), transpose=_transpose_forward,
               block=_block, batch=_batch(0), host_only=True, split=False, pairs=True, describe=_describe(False)),
    Collective("ragged_alltoall_reversed", _reverse_avals, _PARAMS, fixed={"reverse": 1},
               alias=(1, 0), target="ragged_alltoall", linear=lambda p: False,
               nonlinear_jvp=_jvp(1), transpose=_transpose_reverse, block=_block,
               batch=_batch(1), host_only=True, split=False, pairs=True, describe=_describe(True)),
]
_PRIM, _LIN = zip(*(make_primitive(s) for s in _SPECS))


# ----------------------------------------------------------------- checks --
def _rows(x, op, arg):
    x = array(x, op, arg)
    if x.ndim == 0:
        raise ValueError(f"vjpmpi.{op}: argument '{arg}' must have a leading axis of rows, "
                         "got a scalar")
    if x.shape[0] >= 2**31:
        raise ValueError(f"vjpmpi.{op}: argument '{arg}' has {x.shape[0]} rows; the "
                         "exchange counts rows in int32 (at most 2**31 - 1)")
    return x


def _ints(x, op, arg, shape):
    """An integer array of `shape`, as int32 (values past int32 clipped, so that they
    stay out of range for the kernel's checks instead of wrapping into range)."""
    x = array(x, op, arg)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"vjpmpi.{op}: argument '{arg}' must be an integer array, "
                        f"got dtype {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"vjpmpi.{op}: argument '{arg}' must have shape {shape}, "
                         f"got {tuple(x.shape)}")
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):  # (a negative bound would wrap)
        if jnp.iinfo(x.dtype).bits >= 32:
            x = jnp.minimum(x, 2**31 - 1)
    elif jnp.iinfo(x.dtype).bits > 32:
        x = jnp.clip(x, -(2**31), 2**31 - 1)
    return x.astype(jnp.int32)


def _capacity(capacity, op):
    try:
        c = operator.index(capacity)
    except TypeError:
        raise TypeError(f"vjpmpi.{op}: argument 'capacity' must be a Python int, "
                        f"got {type(capacity).__name__}") from None
    if not 0 <= c < 2**31:
        raise ValueError(f"vjpmpi.{op}: argument 'capacity'={c} must be in 0..2**31 - 1")
    return c


def _exchange(op, x, out, io, ss, oo, rs, comm, root=0):
    outs = bind(_PRIM[0], [x, out, io, ss, oo, rs], comm, form=_FORMS[op], groups=1, root=root)
    return outs[0], outs[1]


def _exclusive(counts):
    # (a masked sum, not a cumulative one: inside a shard_map of several devices JAX
    # 0.12's program token reaches the body's instructions as control predecessors, and
    # XLA:CPU's rewrite of a cumulative sum then fails, "cannot remove instruction")
    counts = jnp.asarray(counts).astype(jnp.int32)
    i = jnp.arange(counts.shape[0])
    return jnp.sum(jnp.where(i[None, :] < i[:, None], counts[None, :], 0), axis=1,
                   dtype=jnp.int32)


# --------------------------------------------------------------- public --
def ragged_alltoall(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                    comm=None) -> jax.Array:
    """`jax.lax.ragged_all_to_all` over the ranks of `comm`, offsets and sizes known at run time.

    With `n = len(input_offsets)` and `per = n // size`, slice `i` of this rank's
    `operand` (rows `input_offsets[i]` to `input_offsets[i] + send_sizes[i]`) goes to
    rank `i // per`, which writes it at row `output_offsets[i]` of its `output`
    (`output_offsets` name rows on the receiver, as in JAX); `recv_sizes[j * per + s]` is
    the size of the `s`-th slice this rank receives from rank `j`. Rows not received keep
    `output`'s values. One call into MPI; every rank's offsets and sizes are gathered to
    every rank inside it, so a bad one is the same error everywhere. Linear in
    `(operand, output)`.

    Args:
        operand (ArrayLike): the rows to send, shape `(rows, *row)`.
        output (ArrayLike): the result's initial value, shape `(out_rows, *row)`, the
            dtype and row shape of `operand`.
        input_offsets (ArrayLike): int, shape `(n,)`, `n` a multiple of the size: where
            each slice starts in `operand`.
        send_sizes (ArrayLike): int, shape `(n,)`, the rows of each slice sent.
        output_offsets (ArrayLike): int, shape `(n,)`, where each sent slice lands on its
            receiver.
        recv_sizes (ArrayLike): int, shape `(n,)`, the rows of each slice received.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (jax.Array): `output` with the received slices written in (its shape and dtype).

    Raises:
        TypeError: when an array argument is not an array (or convertible to one) of a dtype
            MPI can carry, `output`'s dtype or row shape differs from `operand`'s, an offset
            or size array is not of an integer dtype, or `comm` is not an mpi4py
            intracommunicator or None.
        ValueError: when `operand` or `output` is a scalar or has 2**31 rows or more,
            `input_offsets` is not one-dimensional with a length that is a multiple of the
            communicator's size, another offset or size array has not its shape, or
            `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host callback,
            or when another thread already runs collectives on `comm`.
        ValueError: when the call runs, on every rank alike: a negative
            offset or size, a slice past its operand or its receiver's output, a
            `recv_sizes` entry that differs from its sender's `send_sizes`, two slices
            written over the same rows of one output, or ranks that disagree on the call.

    Shape:
        `(rows, *row)`, `(out_rows, *row)` -> `(out_rows, *row)`.

    Transpose:
        the reverse exchange (each received slice's cotangent back to the rows it came
        from, added; the received rows' cotangent taken out of `output`'s).
    """
    op = "ragged_alltoall"
    c = as_comm(comm, op)
    x = _rows(operand, op, "operand")
    out = _rows(output, op, "output")
    if out.dtype != x.dtype or out.shape[1:] != x.shape[1:]:
        raise TypeError(f"vjpmpi.{op}: argument 'output' ({out.dtype}{list(out.shape)}) must "
                        f"have the dtype and row shape of 'operand' ({x.dtype}{list(x.shape)})")
    n_shape = jnp.shape(input_offsets)
    if len(n_shape) != 1 or n_shape[0] % c.size:
        raise ValueError(f"vjpmpi.{op}: argument 'input_offsets' must be one-dimensional with a "
                         f"length that is a multiple of the communicator's size {c.size}, got "
                         f"shape {tuple(n_shape)}")
    meta = [_ints(v, op, name, tuple(n_shape)) for v, name in
            zip((input_offsets, send_sizes, output_offsets, recv_sizes),
                ("input_offsets", "send_sizes", "output_offsets", "recv_sizes"))]
    y, _ = _exchange(op, x, out, *meta, c)
    return y


def alltoallv(x, send_counts, *, capacity: int, comm=None) -> tuple[jax.Array, jax.Array]:
    """Send `send_counts[j]` rows of `x` to rank `j` (its blocks back to back from row 0).

    mpi4py's `Alltoallv` with run-time counts in a static capacity; the counts travel with
    the call. Linear in `x`.

    Args:
        x (ArrayLike): shape `(rows, *row)`: the block for rank 0, then rank 1's, ...
        send_counts (ArrayLike): int, shape `(size,)`, the rows for each rank.
        capacity (int): the rows of the result.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (tuple[jax.Array, jax.Array]): `(y, recv_counts)`: `y` of shape `(capacity, *row)`
            and `x`'s dtype holds the blocks received, in rank order from row 0, zeros
            after; `recv_counts` (int32, shape `(size,)`): `recv_counts[i]` rows came from
            rank `i`.

    Raises:
        TypeError: when an array argument is not an array (or convertible to one) of a dtype
            MPI can carry, `send_counts` is not of an integer dtype, `capacity` is not an
            int, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `x` is a scalar or has 2**31 rows or more, `send_counts` has not
            shape `(size,)`, `capacity` is outside `0..2**31 - 1`, or `comm` is
            `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host callback,
            or when another thread already runs collectives on `comm`.
        ValueError: when the call runs, on every rank alike: a negative
            count, counts past the rows of `x`, more rows received than `capacity`, or
            ranks that disagree on the call.

    Shape:
        `(rows, *row)` -> `(capacity, *row)`, `(size,)`.

    Transpose:
        the reverse exchange (rows past a count get a zero cotangent).
    """
    op = "alltoallv"
    c = as_comm(comm, op)
    x = _rows(x, op, "x")
    counts = _ints(send_counts, op, "send_counts", (c.size,))
    zero = jnp.zeros(c.size, jnp.int32)
    out = jnp.zeros((_capacity(capacity, op), *x.shape[1:]), x.dtype)
    return _exchange(op, x, out, _exclusive(counts), counts, zero, zero, c)


def allgatherv(x, count, *, capacity: int, comm=None) -> tuple[jax.Array, jax.Array]:
    """Concatenate every rank's first `count` rows of `x`, in rank order, on every rank.

    MPI_Allgatherv with run-time counts in a static capacity. Linear in `x`.

    Args:
        x (ArrayLike): shape `(rows, *row)`.
        count (ArrayLike): int scalar, the rows this rank contributes.
        capacity (int): the rows of the result.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (tuple[jax.Array, jax.Array]): `(y, counts)`: `y` of shape `(capacity, *row)` and
            `x`'s dtype, the contributions back to back from row 0, zeros after; `counts`
            (int32, shape `(size,)`), `counts[i]` rank `i`'s count.

    Raises:
        TypeError: when an array argument is not an array (or convertible to one) of a dtype
            MPI can carry, `count` is not of an integer dtype, `capacity` is not an int, or
            `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `x` is a scalar or has 2**31 rows or more, `count` is not a scalar,
            `capacity` is outside `0..2**31 - 1`, or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host callback,
            or when another thread already runs collectives on `comm`.
        ValueError: when the call runs, on every rank alike: a negative
            count, a count past the rows of `x`, more rows in all than `capacity`, or
            ranks that disagree on the call.

    Shape:
        `(rows, *row)` -> `(capacity, *row)`, `(size,)`.

    Transpose:
        each rank's rows' cotangents summed over the ranks, back to that rank.
    """
    op = "allgatherv"
    c = as_comm(comm, op)
    x = _rows(x, op, "x")
    k = _ints(count, op, "count", ())
    zero = jnp.zeros(c.size, jnp.int32)
    out = jnp.zeros((_capacity(capacity, op), *x.shape[1:]), x.dtype)
    return _exchange(op, x, out, zero, jnp.full(c.size, k), zero, zero, c)


def gatherv(x, count, *, root: int, capacity: int, comm=None) -> tuple[jax.Array, jax.Array]:
    """Concatenate every rank's first `count` rows of `x`, in rank order, on `root`.

    MPI_Gatherv with run-time counts in a static capacity. Linear in `x`.

    Args:
        x (ArrayLike): shape `(rows, *row)`.
        count (ArrayLike): int scalar, the rows this rank contributes.
        root (int | jax.Array): the rank that receives.
        capacity (int): the rows of the root's result (read on `root` only).
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (tuple[jax.Array, jax.Array]): On `root`, `(y, counts)`: `y` of shape `(capacity,
            *row)` and `x`'s dtype (the contributions back to back, zeros after),
            `counts[i]` rank `i`'s count (int32). Elsewhere `(x, zeros)`: `x` unchanged (as
            `gather` gives it) and no rows received (on a device communicator, zeros of
            the root's shape: every device has one shape).

    Raises:
        TypeError: when an array argument is not an array (or convertible to one) of a dtype
            MPI can carry, `count` is not of an integer dtype, `root` is not an int, or
            `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `root` is outside the communicator, `x` is a scalar or has 2**31
            rows or more, `count` is not a scalar, or `comm` is `MPI.COMM_NULL` or freed;
            on every rank, when the root's `capacity` is not an int in `0..2**31 - 1` (the
            root raises at trace time, the ranks that wait in the call for it stop with
            its message).
        RuntimeError: when MPI has been finalized, when called from inside a host callback,
            or when another thread already runs collectives on `comm`.
        ValueError: when the call runs, on every rank alike: a negative
            count, a count past the rows of `x`, more rows than `capacity`, or ranks that
            disagree on the call.

    Shape:
        `(rows, *row)` -> `(capacity, *row)` on `root`, `(rows, *row)` elsewhere.

    Transpose:
        scatterv of the root's cotangent (plus the identity's off the root).
    """
    op = "gatherv"
    c = as_comm(comm, op)
    root = rank(root, c, op, "root")
    x = _rows(x, op, "x")
    k = _ints(count, op, "count", ())
    zero = jnp.zeros(c.size, jnp.int32)
    rows = 0
    devices = isinstance(c, DeviceCommRef)  # (one shape on every device: zeros off the root)
    if devices:
        rows = _capacity(capacity, op)
    elif c.rank == root:  # (only the root uses it: the ranks that wait stop with its message)
        try:
            rows = _capacity(capacity, op)
        except (TypeError, ValueError) as e:
            refuse_here(c, op, str(e), root=root)
    out = jnp.zeros((rows, *x.shape[1:]), x.dtype)
    sizes = jnp.where(jnp.arange(c.size) == root, k, 0).astype(jnp.int32)
    y, counts = _exchange(op, x, out, zero, sizes, zero, zero, c, root)
    return (y, counts) if devices or c.rank == root else (x, counts)


def scatterv(x, counts, *, root: int, capacity: int, comm=None) -> tuple[jax.Array, jax.Array]:
    """Send `counts[j]` rows of `root`'s `x` to rank `j` (its blocks back to back).

    MPI_Scatterv with run-time counts in a static capacity. Linear in `x`.

    Args:
        x (ArrayLike): on `root`, shape `(rows, *row)`, the blocks for ranks 0, 1, ...
            back to back; elsewhere a template of the row shape and dtype (any rows).
        counts (ArrayLike): int, shape `(size,)`, the rows for each rank (the root's
            are used; other ranks may pass anything of that shape).
        root (int | jax.Array): the rank that sends.
        capacity (int): the rows of the result.
        comm (MPI.Intracomm | DeviceComm | None): the communicator (None: vjpmpi's private
            duplicate of COMM_WORLD; a `vjpmpi.device_comm`: the devices of a shard_map).

    Returns:
        (tuple[jax.Array, jax.Array]): `(y, count)`: `y` of shape `(capacity, *row)` and
            `x`'s dtype, this rank's block from row 0, zeros after; `count` (an int32
            scalar), its rows.

    Raises:
        TypeError: when an array argument is not an array (or convertible to one) of a dtype
            MPI can carry, `counts` is not of an integer dtype, `root` or `capacity` is not
            an int, or `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `root` is outside the communicator, `x` is a scalar or has 2**31
            rows or more, `counts` has not shape `(size,)`, `capacity` is outside `0..2**31
            - 1`, or `comm` is `MPI.COMM_NULL` or freed.
        RuntimeError: when MPI has been finalized, when called from inside a host callback,
            or when another thread already runs collectives on `comm`.
        ValueError: when the call runs, on every rank alike: a negative
            count, counts past the rows of the root's `x`, a block larger than
            `capacity`, or ranks that disagree on the call.

    Shape:
        `(rows, *row)` on `root`, a template elsewhere -> `(capacity, *row)`, `()`.

    Transpose:
        gatherv of the cotangents' first `count` rows onto `root`.
    """
    op = "scatterv"
    c = as_comm(comm, op)
    root = rank(root, c, op, "root")
    x = _rows(x, op, "x")
    given = _ints(counts, op, "counts", (c.size,))
    zero = jnp.zeros(c.size, jnp.int32)
    if isinstance(c, DeviceCommRef):  # (each device's rank: traced)
        sizes = jnp.where(c.rank == root, given, zero)
    else:
        sizes = given if c.rank == root else zero
    out = jnp.zeros((_capacity(capacity, op), *x.shape[1:]), x.dtype)
    y, received = _exchange(op, x, out, _exclusive(sizes), sizes, zero, zero, c, root)
    return y, received[root]
