"""Shared helpers: block partitions of a feature axis over a communicator."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as jc
from .._mpi import CommRef, as_comm
from .._movement import allgather
from .._sync import agree_on


def comm_ref(comm, layer: str) -> CommRef:
    return as_comm(comm, f"nn.{layer}")


def block_length(n: int, ref: CommRef, layer: str, what: str) -> int:
    """The length of each rank's block of `n` features (static); n must divide evenly."""
    if n % ref.size:
        raise ValueError(
            f"vjpmpi.nn.{layer}: {what}={n} is not divisible by the communicator size "
            f"{ref.size}; choose a size that divides it"
        )
    return n // ref.size


def block(n: int, ref: CommRef, layer: str, what: str) -> tuple:
    """[start, stop) of this rank's block of `n` features; n must divide evenly. Ints on a
    process communicator; traced int32 scalars on a device communicator (whose rank is
    each device's own, traced in the shard_map body)."""
    k = block_length(n, ref, layer, what)
    return ref.rank * k, (ref.rank + 1) * k


def take(a, start, length: int, axis: int = 0):
    """`a[start:start + length]` along `axis`: a plain slice where `start` is an int (a
    process communicator's rank), a `dynamic_slice` where it is traced (a device's)."""
    if isinstance(start, int):
        return a[(slice(None),) * axis + (slice(start, start + length),)]
    return jax.lax.dynamic_slice_in_dim(a, start, length, axis)


def take_block(a, ref: CommRef, layer: str, what: str, axis: int = 0):
    """This rank's block of `a` along `axis` (`a.shape[axis]` features split over `ref`)."""
    start, _ = block(a.shape[axis], ref, layer, what)
    return take(a, start, a.shape[axis] // ref.size, axis)


def own(tree, ref: CommRef):
    """`tree` with every inexact array cast to vary over a device communicator's mesh axis
    (under the shard_map's check_vma): each device holds its own copy of a layer's whole
    (replicated) parameters, as each process does, so that their gradients are each
    device's own, not JAX's implicit sum over the axis. The identity on a process
    communicator (and without check_vma)."""
    axis = getattr(ref, "axis", None)
    if axis is None or not jc.check_vma():
        return tree

    def cast(a):
        if eqx.is_inexact_array(a) and axis not in jc.vma_of(jax.typeof(a)):
            return jc.pvary(a, (axis,))
        return a

    return jax.tree_util.tree_map(cast, tree)


def gather_blocks(x, ref: CommRef, axis: int):
    """Concatenate every rank's `x` along `axis` (eager helper for to_dense)."""
    stacked = allgather(x, comm=ref)
    return jnp.concatenate(list(stacked), axis=axis)


def dtype_groups(tree, steps=None):
    """(leaves, treedef, {dtype name: positions of the inexact-array leaves}); with
    `steps` (a sync's plan, aligned with the leaves), those it sums only."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    groups: dict[str, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if eqx.is_inexact_array(leaf) and (steps is None or (steps[i] is not None
                                                     and steps[i].kind == "sum")):
            groups.setdefault(jnp.result_type(leaf).name, []).append(i)
    return leaves, treedef, groups


def concat(leaves, idx):
    """The leaves at `idx`, flattened into one vector."""
    return jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])


def split_into(out: list, leaves, idx, flat) -> None:
    """Cut `flat` (laid out as `concat(leaves, idx)`, maybe padded) back into `out[i]`,
    shaped and typed like `leaves[i]`."""
    offset = 0
    for i in idx:
        n = leaves[i].size
        out[i] = flat[offset:offset + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
        offset += n


def bucket_bytes_arg(value, op: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"vjpmpi.nn.{op}: `bucket_bytes` must be a positive int or None, "
                     f"got {value!r}")


def agree_on_buckets(ref: CommRef, cap: int | None, op: str) -> None:
    """Every rank of `ref` cuts its buckets at the same `bucket_bytes` (`cap`): ranks that
    pass different ones fail together here, saying so, instead of at their first bucket's
    collective (a collective with no data, compared once per program)."""
    if cap is not None and ref.size > 1:
        agree_on((cap,), jnp.uint8, ref, f"nn.{op}",
                 note=f"vjpmpi.nn.{op} with bucket_bytes={cap} (every rank must pass the "
                      "same bucket_bytes)")


def buckets(leaves, groups, cap: int | None) -> list[list[int]]:
    """The inexact leaves (`groups`: positions by dtype) in buckets of one dtype, each a
    run of at most `cap` bytes cut from the group's last leaf back (a larger leaf is a
    bucket of its own; None: one per dtype), the bucket holding the last leaf first:
    the order a backward pass produces the gradients of parameters used in tree order."""
    out: list[list[int]] = []
    for idx in groups.values():
        run: list[int] = []
        size = 0
        for i in reversed(idx):
            n = int(np.size(leaves[i])) * np.dtype(leaves[i].dtype).itemsize
            if run and cap is not None and size + n > cap:
                out.append(run[::-1])
                run, size = [], 0
            run.append(i)
            size += n
        out.append(run[::-1])
    return sorted(out, key=lambda bucket: -bucket[-1])
