"""Distributed checkpoints that reshard: each rank writes the blocks it holds, any number
of ranks reads them back.

A checkpoint is a directory `step_<N>/` of zarr arrays (zarr v3, or v2 where the
installed tensorstore lacks the `zarr3` driver), one per array leaf, each the leaf's
global array: a split parameter whole (chunked by the saving ranks' blocks), a
`sharded_optimizer` state leaf as its parameter's raveled elements (a row per block of a
split parameter, chunked by the data-parallel ranks' ranges), plus `manifest.json`: per
leaf (by `jax.tree_util.keystr` of its path) its global shape, dtype and storage. Each
chunk is written by one rank; the manifest last, by rank 0, into a temporary directory
renamed to `step_<N>` after every rank has written: a step directory holding a manifest
is complete. Loading reads, for each leaf of the tree given (built at the rank count and
split of now), the part this rank holds under `vjpmpi.nn.layout`.

Why tensorstore and not Orbax: Orbax's multi-process saving synchronizes JAX processes
(`jax.experimental.multihost_utils.sync_global_devices` or the barriers of the
`jax.distributed` client, which it requires to be initialized) and describes where each
part of an array lives by a `jax.Array`'s sharding over a global device mesh. vjpmpi's
ranks are separate single-process JAX programs joined by MPI, with no global mesh and no
coordination service, so it would need MPI barriers and its own layouts anyway; what is
left, writing and reading array regions of a zarr store, is what tensorstore does.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import uuid

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import DeviceCommRef, as_comm
from ._ckpt_leaves import Leaf, describe, digest, is_array, merge

MANIFEST = "manifest.json"
FORMAT = "vjpmpi.nn checkpoint"
VERSION = 1
_STEP = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_(\d+)\.tmp-.*")
_DRIVER: str | None = None  # "zarr3", or "zarr" (v2) where tensorstore lacks zarr3


def _tensorstore(op: str):
    try:
        import tensorstore
    except ImportError:
        raise ImportError(f"vjpmpi.nn.{op} needs tensorstore: pip install 'vjpmpi[checkpoint]' "
                          "(or tensorstore>=0.1.60)") from None
    return tensorstore


def _driver(ts) -> str:
    global _DRIVER
    if _DRIVER is None:
        try:
            ts.Spec({"driver": "zarr3", "kvstore": {"driver": "memory"}})
            _DRIVER = "zarr3"
        except ValueError:
            _DRIVER = "zarr"
    return _DRIVER


# ------------------------------------------------------------- where leaves live --

# -------------------------------------------------------------------- storage --

def _storage_shape(spec: dict) -> tuple[list[int], list[int]]:
    """The stored zarr array's shape and chunk shape."""
    if spec["kind"] == "array":
        return list(spec["shape"]), [max(1, int(c)) for c in spec["chunk"]]
    m = int(np.prod(spec["shape"], dtype=np.int64)) // spec["blocks"]
    return [spec["blocks"], spec["shift"] + m], [1, max(1, spec["chunk"])]


def _ts_spec(path: pathlib.Path, driver: str, spec: dict | None = None) -> dict:
    out = {"driver": driver, "kvstore": {"driver": "file", "path": str(path)}}
    if spec is None:
        return out
    shape, chunk = _storage_shape(spec)
    if driver == "zarr3":
        out["metadata"] = {"shape": shape, "data_type": spec["dtype"], "chunk_grid": {
            "name": "regular", "configuration": {"chunk_shape": chunk}}}
    else:
        dtype = spec["dtype"] if spec["dtype"] == "bfloat16" else np.dtype(spec["dtype"]).str
        out["metadata"] = {"shape": shape, "chunks": chunk, "dtype": dtype, "compressor": None}
    return out


def _block_box(shape, axis, blocks, block) -> list[slice]:
    box = [slice(0, int(n)) for n in shape]
    if axis is not None and blocks > 1:
        k = int(shape[axis]) // blocks
        box[axis] = slice(block * k, (block + 1) * k)
    return box


def _region_reader(store, spec: dict, box: list[slice]):
    """Start reading `box` of the stored leaf's global array; returns a function that
    waits and gives it (NumPy)."""
    shape = tuple(spec["shape"])
    if spec["kind"] == "array":
        future = store[tuple(box)].read()
        return lambda: np.asarray(future.result())
    # rows of raveled blocks along `axis`: read the rows the box meets, whole
    axis, blocks, shift = spec["axis"], spec["blocks"], spec["shift"]
    m = int(np.prod(shape, dtype=np.int64)) // blocks
    out_shape = tuple(b.stop - b.start for b in box)
    if not shape or blocks == 1:
        rows, k = [0], None
    else:
        k = shape[axis] // blocks
        lo, hi = box[axis].start, box[axis].stop
        if hi <= lo or 0 in out_shape:
            return lambda: np.zeros(out_shape, spec["dtype"])
        rows = list(range(lo // k, (hi - 1) // k + 1))
    futures = [store[r, shift:shift + m].read() for r in rows]

    def finish():
        if k is None:
            whole = np.asarray(futures[0].result()).reshape(shape)
            return whole[tuple(box)]
        local = list(shape)
        local[axis] = k
        part = np.concatenate([np.asarray(f.result()).reshape(local) for f in futures], axis)
        sub = list(box)
        sub[axis] = slice(box[axis].start - rows[0] * k, box[axis].stop - rows[0] * k)
        return part[tuple(sub)]

    return finish


def _leaf_reader(store, spec: dict, leaf: Leaf):
    """Start reading this rank's part of `leaf` from its stored array."""
    box = _block_box(leaf.shape, leaf.axis, leaf.blocks, leaf.block)
    target = tuple(np.shape(leaf.value))
    z = leaf.zero
    if z is None:
        read = _region_reader(store, spec, box)
        return lambda: read().reshape(target)
    if z.hi <= z.lo:
        return lambda: np.zeros(target, spec["dtype"])
    same = (spec["kind"] == "zero" and spec["blocks"] == leaf.blocks
            and (leaf.blocks == 1 or spec["axis"] == leaf.axis))
    if same:  # the row it was saved in: its range, wherever the saving ranks cut it
        shift = spec["shift"]
        future = store[leaf.block, shift + z.lo:shift + z.hi].read()
        return lambda: np.asarray(future.result()).reshape(target)
    # the slab of the local block's first axis that holds elements [lo, hi)
    local = z.shape
    if local:
        inner = int(np.prod(local[1:], dtype=np.int64))
        r0, r1 = z.lo // inner, -(-z.hi // inner)
        box[0] = slice(box[0].start + r0, box[0].start + r1)
        skip = r0 * inner
    else:
        skip = 0
    read = _region_reader(store, spec, box)
    return lambda: read().reshape(-1)[z.lo - skip:z.hi - skip].reshape(target)


# ---------------------------------------------------------------- agreement --

def _agree(comm, error: BaseException | None, op: str) -> None:
    """Every rank learns whether any failed (a collective: also a barrier); all raise."""
    said = comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(said) if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"vjpmpi.nn.{op}: rank {r} failed: {m}")


def _refuse(op: str, problems: list[str], cls=ValueError):
    shown = sorted(set(problems))
    more = f"\n  ... and {len(shown) - 12} more" if len(shown) > 12 else ""
    raise cls(f"vjpmpi.nn.{op}: " + "\n  ".join(shown[:12]) + more)


def _array_names(keys) -> dict[str, str]:
    """A directory name for each leaf's array (its place in sorted order, and the key)."""
    out = {}
    for i, key in enumerate(sorted(keys)):
        slug = re.sub(r"[^A-Za-z0-9_]+", ".", key).strip(".")[:80]
        out[key] = f"{i:05d}" + (f".{slug}" if slug else "")
    return out


# ----------------------------------------------------------------------- save --

def _int(value, what: str, op: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"vjpmpi.nn.{op}: `{what}` must be an int >= {low}, got {value!r}")
    return int(value)


def _process_comm(comm, op: str):
    ref = as_comm(comm, f"nn.{op}")
    if isinstance(ref, DeviceCommRef):
        raise TypeError(f"vjpmpi.nn.{op}: `comm` must be a process communicator (an mpi4py "
                        "intracommunicator or None), not a device communicator")
    return ref.comm


def _write_piece(store, leaf: Leaf):
    """Start writing this rank's part of `leaf` (a future)."""
    data = np.asarray(leaf.value)
    if leaf.zero is None:
        return store[tuple(_block_box(leaf.shape, leaf.axis, leaf.blocks, leaf.block))].write(data)
    z = leaf.zero
    return store[leaf.block, z.shift + z.lo:z.shift + z.hi].write(data.reshape(-1))


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _discard(path: pathlib.Path, token: str) -> None:
    """Remove a step directory: renamed out of the complete ones first (atomic), then
    deleted (an interrupted deletion leaves a leftover, never a broken step)."""
    gone = path.with_name(f"{path.name}.tmp-{token}-deleted")
    try:
        os.rename(path, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def _complete_steps(directory: pathlib.Path) -> list[int]:
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for e in entries if (m := _STEP.fullmatch(e.name))
                  and (e / MANIFEST).is_file())


def _publish(directory: pathlib.Path, tmp: pathlib.Path, manifest: dict, step: int,
             keep: int | None, token: str) -> pathlib.Path:
    """(Rank 0, every rank's blocks written.) The manifest, the rename, old steps."""
    tmp.mkdir(parents=True, exist_ok=True)
    part = tmp / (MANIFEST + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / MANIFEST)
    _fsync_dir(tmp)
    final = directory / f"step_{step}"
    if final.exists():  # (a step saved again: the new one replaces it)
        _discard(final, token)
    os.rename(tmp, final)
    _fsync_dir(directory)
    for entry in directory.iterdir():  # leftovers of interrupted saves of other steps
        m = _LEFTOVER.fullmatch(entry.name)
        if m and int(m.group(1)) != step:
            shutil.rmtree(entry, ignore_errors=True)
    if keep is not None:
        steps = _complete_steps(directory)
        kept = set(steps[-keep:]) | {step}
        for old in steps:
            if old not in kept:
                _discard(directory / f"step_{old}", token)
    return final


def save_checkpoint(directory, tree, step: int, *, comm=None,
                    keep: int | None = 2) -> pathlib.Path:
    """Save a model and optimizer state split over ranks, each rank writing its blocks.

    Every rank of `comm` calls it with its own `tree` (e.g. `{"model": model, "opt":
    opt_state}`), eagerly (outside `jax.jit`). Each array leaf is stored as its global
    array (a zarr array, through tensorstore), wherever `vjpmpi.nn.layout` says it lives:
    a split parameter's blocks, each written by one rank holding it (the lowest), a
    replicated one by one rank, a `sharded_optimizer` state leaf as the raveled elements
    of its parameter, written by ranges. Other leaves (Python numbers, functions, static
    fields) are not stored: `load_checkpoint` takes them from the tree it is given. The
    ranks write into a temporary directory; after all have written, rank 0 writes the
    manifest (each leaf's key path, global shape and dtype) and renames the directory to
    `directory/step_<step>`, so a save interrupted half way leaves the previous
    checkpoints as they were; then it removes all but the newest `keep` complete steps
    (never this one) and leftovers of interrupted saves of other steps.

    Args:
        directory (str | os.PathLike): the checkpoints' directory, the same path on
            every rank (a shared file system across nodes); made if missing.
        tree (PyTree): this rank's model and/or optimizer state.
        step (int): the step number (>= 0); saving a step again replaces it.
        comm (MPI.Intracomm | None): the ranks that save together, holding every block
            of every split leaf (None: vjpmpi's private duplicate of COMM_WORLD).
        keep (int | None): how many complete steps to keep, the newest by number (this
            one always); None: all of them.

    Returns:
        (pathlib.Path): `directory/step_<step>`, the same on every rank.

    Raises:
        ValueError: on every rank, for a leaf split over a device communicator, a traced
            leaf, a `sharded_optimizer` state leaf no parameter's, a leaf the ranks
            describe differently, blocks that no rank of `comm` holds, or a bad `step` or
            `keep`.
        TypeError: `comm` is not a process communicator.
        ImportError: tensorstore is not installed (`pip install 'vjpmpi[checkpoint]'`).
        RuntimeError: on the other ranks, where a rank failed to write (that rank raises
            its own error); the checkpoint is then not published.

    Example:
        ```python
        import shutil, tempfile
        import jax, optax
        from mpi4py import MPI
        import vjpmpi.nn as vnn

        world = MPI.COMM_WORLD  # (one directory for all ranks)
        path = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
        model = vnn.ColumnParallelLinear(4, 8, key=jax.random.PRNGKey(0))
        opt = vnn.sharded_optimizer(optax.adam(1e-3))
        tree = {"model": model, "opt": opt.init(model)}
        where = vnn.save_checkpoint(path, tree, step=100)
        assert where.name == "step_100" and (where / "manifest.json").exists()
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(path)
        ```
    """
    op = "save_checkpoint"
    ts = _tensorstore(op)
    step = _int(step, "step", op, 0)
    if keep is not None:
        keep = _int(keep, "keep", op, 1)
    mpi = _process_comm(comm, op)
    directory = pathlib.Path(directory)
    leaves, problems = describe(tree, op)
    token = f"{os.getpid():x}{uuid.uuid4().hex[:10]}"
    gathered = mpi.allgather((token, [(leaf.key, leaf.spec(), leaf.piece(), digest(leaf.value))
                                      for leaf in leaves], problems))
    problems = [p for _, _, ps in gathered for p in ps]
    if problems:
        _refuse(op, problems)
    specs, writers, problems = merge(gathered)
    if problems:
        _refuse(op, problems)
    driver, names = _driver(ts), _array_names(specs)
    tmp = directory / f"step_{step}.tmp-{gathered[0][0]}"
    context = ts.Context()
    rank = mpi.rank
    mine = [leaf for leaf in leaves if writers[(leaf.key, leaf.piece())] == rank
            and (leaf.zero is None or leaf.zero.hi > leaf.zero.lo)]  # (not empty ranges)
    creators = {}
    for (key, _), r in writers.items():
        creators[key] = min(r, creators.get(key, r))
    error = None
    try:  # each array's metadata, by the lowest rank that writes it
        futures = [ts.open(_ts_spec(tmp / names[k], driver, specs[k]), create=True,
                           context=context) for k, r in creators.items() if r == rank]
        for f in futures:
            f.result()
    except Exception as err:
        error = err
    _agree(mpi, error, op)
    try:
        stores = {k: ts.open(_ts_spec(tmp / names[k], driver), open=True, write=True,
                             context=context) for k in {leaf.key for leaf in mine}}
        writes = [_write_piece(stores[leaf.key].result(), leaf) for leaf in mine]
        for w in writes:
            w.result()
    except Exception as err:
        error = err
    try:
        _agree(mpi, error, op)  # every rank's blocks written
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    status = None
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "driver": driver,
                    "ranks": mpi.size,
                    "leaves": {k: {"array": names[k], **spec} for k, spec in specs.items()}}
        try:
            _publish(directory, tmp, manifest, step, keep, gathered[0][0])
        except Exception as err:
            status = f"{type(err).__name__}: {err}"
            error = err
    status = mpi.bcast(status, root=0)
    if error is not None:
        raise error
    if status is not None:
        raise RuntimeError(f"vjpmpi.nn.{op}: rank 0 failed to publish the checkpoint: {status}")
    return directory / f"step_{step}"


# ----------------------------------------------------------------------- load --

def _find(directory: pathlib.Path, step: int | None) -> tuple:
    """(Rank 0.) ("ok", step, manifest) or (exception class name, message)."""
    op = "vjpmpi.nn.load_checkpoint"
    if not directory.is_dir():
        return ("FileNotFoundError", f"{op}: no checkpoint directory {str(directory)!r}")
    steps = _complete_steps(directory)
    if not steps:
        return ("FileNotFoundError", f"{op}: no complete checkpoint in {str(directory)!r}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        return ("FileNotFoundError", f"{op}: no complete checkpoint of step {step} in "
                f"{str(directory)!r} (complete steps: {steps})")
    try:
        with open(directory / f"step_{step}" / MANIFEST) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        return ("ValueError", f"{op}: cannot read the manifest of step {step} in "
                f"{str(directory)!r}: {err}")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return ("ValueError", f"{op}: step {step} in {str(directory)!r} is not a checkpoint "
                f"of this format ({FORMAT!r} version {VERSION})")
    return ("ok", step, manifest)


def load_checkpoint(directory, like, *, step: int | None = None, comm=None):
    """Load a checkpoint into the layout of now: any number of ranks, any split.

    Every rank of `comm` calls it with `like`, a tree of the structure wanted now (e.g.
    `{"model": model, "opt": opt.init(model)}` built at the current number of ranks and
    split; its arrays' values do not matter, `jax.ShapeDtypeStruct` leaves do too). For
    each array leaf of `like` (by its key path) it reads, from the stored global array,
    the part this rank holds under `vjpmpi.nn.layout(like)`: its block of a split
    parameter, its range of a `sharded_optimizer` state leaf, however the saving ranks
    held them. Other leaves come from `like`.

    Args:
        directory (str | os.PathLike): the checkpoints' directory (`save_checkpoint`'s).
        like (PyTree): this rank's tree of the structure, shapes and dtypes wanted.
        step (int | None): the step to load (None: the newest complete one).
        comm (MPI.Intracomm | None): the ranks that load together (None: vjpmpi's
            private duplicate of COMM_WORLD).

    Returns:
        (tuple): `(tree, step)`: `like` with every array leaf read from the checkpoint
            (JAX arrays of `like`'s dtypes), and the step loaded.

    Raises:
        FileNotFoundError: on every rank, where `directory` holds no complete checkpoint
            (or none of `step`), naming the directory.
        ValueError: on every rank, for a checkpoint of another model: a leaf of `like`
            that it lacks, one of another global shape or dtype (naming the leaf's key
            path and both), leaves it holds that no rank's `like` has; or a leaf of
            `like` that cannot be placed (as `save_checkpoint`).
        TypeError: `comm` is not a process communicator.
        ImportError: tensorstore is not installed (`pip install 'vjpmpi[checkpoint]'`).

    Example:
        ```python
        import shutil, tempfile
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import vjpmpi.nn as vnn

        world = MPI.COMM_WORLD
        path = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
        col = vnn.ColumnParallelLinear(4, 8, key=jax.random.PRNGKey(0))
        vnn.save_checkpoint(path, {"col": col}, step=7)
        # each rank alone (MPI.COMM_SELF): the whole layer, from every rank's block
        whole = vnn.ColumnParallelLinear(4, 8, key=jax.random.PRNGKey(1), comm=MPI.COMM_SELF)
        tree, step = vnn.load_checkpoint(path, {"col": whole}, comm=MPI.COMM_SELF)
        assert step == 7 and jnp.array_equal(tree["col"].weight, col.to_dense().weight)
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(path)
        ```
    """
    op = "load_checkpoint"
    ts = _tensorstore(op)
    if step is not None:
        step = _int(step, "step", op, 0)
    mpi = _process_comm(comm, op)
    directory = pathlib.Path(directory)
    found = None
    if mpi.rank == 0:
        try:
            found = _find(directory, step)
        except Exception as err:
            found = (type(err).__name__, f"vjpmpi.nn.{op}: {err}")
    found = mpi.bcast(found, root=0)
    if found[0] != "ok":
        raise {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError}.get(
            found[0], OSError)(found[1])
    _, step, manifest = found
    stored = manifest["leaves"]
    where = directory / f"step_{step}"
    leaves, problems = describe(like, op)
    for leaf in leaves:
        spec = stored.get(leaf.key)
        name = leaf.key or "(the tree itself)"
        if spec is None:
            problems.append(f"leaf {name} of the tree given is not in the checkpoint "
                            f"{str(where)!r} (a checkpoint of another model?)")
        elif tuple(spec["shape"]) != leaf.shape or spec["dtype"] != leaf.dtype:
            problems.append(f"leaf {name}: the checkpoint {str(where)!r} holds "
                            f"{spec['dtype']}{list(spec['shape'])}, the tree given "
                            f"{leaf.dtype}{list(leaf.shape)} (global shapes; a checkpoint "
                            "of another model?)")
    gathered = mpi.allgather(([leaf.key for leaf in leaves], problems))
    problems = [p for _, ps in gathered for p in ps]
    wanted = {k for keys, _ in gathered for k in keys}
    extra = sorted(set(stored) - wanted)
    if extra:
        problems.append(f"the checkpoint {str(where)!r} holds leaves that no rank's tree "
                        f"has: {', '.join(k or '(the tree itself)' for k in extra[:12])}"
                        + (f" ... ({len(extra)} in all)" if len(extra) > 12 else "")
                        + " (a checkpoint of another model?)")
    if problems:
        _refuse(op, problems)
    driver, context = manifest.get("driver", "zarr3"), ts.Context()
    opened = {k: ts.open(_ts_spec(where / stored[k]["array"], driver), open=True, read=True,
                         context=context) for k in {leaf.key for leaf in leaves}}
    readers = [_leaf_reader(opened[leaf.key].result(), stored[leaf.key], leaf)
               for leaf in leaves]
    values = {leaf.key: jnp.asarray(read(), dtype=leaf.dtype)
              for leaf, read in zip(leaves, readers, strict=True)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = [values.get(jax.tree_util.keystr(path), x) if is_array(x) else x
           for path, x in flat]
    return jax.tree_util.tree_unflatten(treedef, out), step
