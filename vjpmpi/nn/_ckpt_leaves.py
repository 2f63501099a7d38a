"""What a checkpoint stores of a tree: each array leaf's global array and the part of it
this rank holds (from `vjpmpi.nn.layout` and `sharded_optimizer`'s state records), and
what the ranks' descriptions, gathered, say about who writes what."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import numpy as np

from .._mpi import DeviceCommRef
from ._layout import Split, leaf_layouts
from ._optim import UNPLACED, ShardedState, StatePart

TRACER = getattr(jax.core, "Tracer", ())  # (a leaf being traced: save under jit)


@dataclasses.dataclass
class Leaf:
    """One array leaf: `value` is this rank's block `block` of `blocks` along `axis` of
    the global array of `shape` (axis None: the whole array), or with `zero` the
    elements [zero.lo, zero.hi) of that block raveled (a `sharded_optimizer` shard)."""

    key: str
    value: Any
    shape: tuple
    dtype: str
    axis: int | None
    blocks: int
    block: int
    zero: StatePart | None = None

    def spec(self) -> dict:
        """Its storage (every rank that holds the leaf must describe the same)."""
        out = {"shape": list(self.shape), "dtype": self.dtype,
               "axis": self.axis or 0, "blocks": self.blocks}
        if self.zero is None:
            local = list(self.shape)
            if self.axis is not None:
                local[self.axis] //= self.blocks
            return {"kind": "array", **out, "chunk": local}
        return {"kind": "zero", **out, "shift": self.zero.shift, "chunk": self.zero.block}

    def piece(self) -> tuple:
        """What it holds of the stored array (ranks holding the same write it once)."""
        if self.zero is None:
            return (self.block,)
        return (self.block, self.zero.lo, self.zero.hi)


def leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "(the tree itself)"


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def state_parts(tree, n: int) -> list:
    """For each leaf of `tree`: its `sharded_optimizer` record where it is in a
    `ShardedState` (a StatePart, None or UNPLACED), else `MODEL`."""
    parts: list = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardedState)):
        if isinstance(node, ShardedState):
            count = len(jax.tree_util.tree_leaves(node.state))
            got = list(node.parts)
            parts += got if len(got) == count else [UNPLACED] * count
        else:
            parts.append(MODEL)
    assert len(parts) == n
    return parts


MODEL = "model"


def describe(tree, op: str) -> tuple[list[Leaf], list[str]]:
    """The array leaves of `tree` and where each lives, and what cannot be stored (never
    raises: every rank must reach the collective that compares the ranks' problems)."""
    try:
        return leaves_of(tree, op)
    except Exception as err:
        return [], [f"cannot read where the leaves of the tree live: {type(err).__name__}: {err}"]


def leaves_of(tree, op: str) -> tuple[list[Leaf], list[str]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    marks = leaf_layouts(tree)
    parts = state_parts(tree, len(flat))
    leaves, problems = [], []
    for (path, x), mark, part in zip(flat, marks, parts, strict=True):
        if isinstance(x, TRACER):
            problems.append(f"leaf {leaf_name(path)} is a traced value: call vjpmpi.nn.{op} "
                            "outside jax.jit, on concrete arrays")
            continue
        if not is_array(x):
            continue
        key = jax.tree_util.keystr(path)
        try:
            dtype = np.dtype(x.dtype)
        except TypeError:
            problems.append(f"leaf {leaf_name(path)} has dtype {x.dtype}, which a checkpoint cannot "
                            "hold (for PRNG keys, store jax.random.key_data(key))")
            continue
        zero = None
        if isinstance(part, str) and part == UNPLACED:
            problems.append(
                f"leaf {leaf_name(path)} of a sharded_optimizer state is a part of no parameter "
                "vjpmpi can place (not in a subtree of the parameters' structure, not a "
                "scalar), so it cannot be resharded")
            continue
        if isinstance(part, StatePart):
            mark = part.mark
            if part.block:
                zero = part
                if int(np.size(x)) != part.hi - part.lo:
                    problems.append(f"leaf {leaf_name(path)} of a sharded_optimizer state has "
                                    f"{int(np.size(x))} elements, its parameter's range here "
                                    f"{part.hi - part.lo}")
                    continue
            elif tuple(np.shape(x)) != part.shape:
                problems.append(f"leaf {leaf_name(path)} of a sharded_optimizer state has shape "
                                f"{tuple(np.shape(x))}, its parameter's is {part.shape}")
                continue
        elif part is None:  # (a scalar of the optimizer's: a step count)
            mark = None
        local = tuple(part.shape) if zero is not None else tuple(np.shape(x))
        if isinstance(mark, Split):
            if isinstance(mark.comm, DeviceCommRef):
                problems.append(
                    f"leaf {leaf_name(path)} ({mark.layer}) is split over a device communicator "
                    f"(vjpmpi.device_comm): vjpmpi.nn.{op} stores leaves split over process "
                    "communicators only; gather it out of the shard_map first")
                continue
            shape = list(local)
            shape[mark.axis] *= mark.comm.size
            leaves.append(Leaf(key, x, tuple(shape), dtype.name, mark.axis, mark.comm.size,
                                mark.comm.rank, zero))
        else:  # Replicated, or not inexact: the same on every rank that holds it
            leaves.append(Leaf(key, x, local, dtype.name, None, 1, 0, zero))
    return leaves, problems


def digest(value) -> int | None:
    """A checksum of a leaf's bytes (None for a shape alone): the ranks that hold the same
    part of a leaf must hold the same values, one of them writing it for all."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return None
    return zlib.crc32(np.ascontiguousarray(np.asarray(value)).view(np.uint8).reshape(-1))


def merge(gathered: list) -> tuple[dict, dict, list[str]]:
    """Every rank's leaves -> ({key: spec}, {(key, piece): writing rank}, problems)."""
    specs: dict = {}
    first: dict = {}
    writers: dict = {}
    pieces: dict = {}
    problems = []
    digests: dict = {}
    for rank, (_, described, _) in enumerate(gathered):
        for key, spec, piece, digest in described:
            held = digests.setdefault((key, tuple(piece)), (rank, digest))
            if held[1] != digest and not any(key in p for p in problems):
                problems.append(
                    f"leaf {key or '(the tree itself)'}: ranks {held[0]} and {rank} hold "
                    "different values of what vjpmpi.nn.layout says is the same part of it "
                    "(a replicated leaf whose copies differ: per-rank state, replicas not "
                    "synced, or pipeline stages holding other layers under the same names: "
                    "give those a name of their own, or a vjpmpi.nn.PipelineStage); only one "
                    "copy could be saved")
            if key not in specs:
                specs[key], first[key] = spec, rank
            elif spec != specs[key]:
                problems.append(f"leaf {key or '(the tree itself)'}: rank {first[key]} holds "
                                f"{specs[key]}, rank {rank} {spec}: every rank must describe "
                                "a leaf's global array alike")
                continue
            writers.setdefault((key, tuple(piece)), rank)
            pieces.setdefault(key, set()).add(tuple(piece))
    for key, spec in specs.items():
        have = pieces[key]
        name = key or "(the tree itself)"
        if spec["kind"] == "array":
            missing = set(range(spec["blocks"])) - {p[0] for p in have}
            if missing:
                problems.append(f"leaf {name}: no rank of the communicator holds its blocks "
                                f"{sorted(missing)} of {spec['blocks']}; save over one that "
                                "holds every block")
            continue
        m = int(np.prod(spec["shape"], dtype=np.int64)) // spec["blocks"]
        for row in range(spec["blocks"] if m else 0):
            covered = 0
            for _, lo, hi in sorted(p for p in have if p[0] == row):
                if lo > covered:
                    break
                covered = max(covered, hi)
            if covered < m:
                problems.append(f"leaf {name}: no rank of the communicator holds the optimizer "
                                f"state of elements {covered}.. of block {row}; save over the "
                                "sharded_optimizer's communicator")
                break
    return specs, writers, problems
