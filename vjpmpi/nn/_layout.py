"""Where each parameter of a model lives: replicated, or split over a communicator.

One table (`_SPLITS`) says, for each vjpmpi.nn layer that splits parameters, which of
its fields are split, along which axis, and what its gradients mean; `layout` reads a
pytree through it, and `plan` turns a layout into what a gradient sync over a
data-parallel communicator must do with each leaf (`allreduce_gradients`,
`sync_gradients`, `sharded_optimizer` and the checkpoints read it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from mpi4py import MPI

from .._mpi import SUM, DeviceCommRef
from .._reductions import allreduce
from .._sync import agree_on
from ._embedding import VocabParallelEmbedding
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._moe import ExpertParallelMoE
from ._stage import PipelineStage

# The gradient a rank holds for its block of a split parameter:
#   "group": the gradient of the one loss its group shares (the replicated-value
#            convention of the tensor-parallel layers: every rank of the group computes
#            the same loss from replicated inputs; a pipeline's stages share its loss);
#   "summed": the sum over the group's ranks' own losses (exact adjoints: the experts,
#            whose tokens come from every rank of the group and go back through the
#            exchanges' transposes).
_SPLITS: dict[type, tuple[dict[str, int], str]] = {
    ColumnParallelLinear: ({"weight": 0, "bias": 0}, "group"),
    RowParallelLinear: ({"weight": 1}, "group"),
    VocabParallelEmbedding: ({"weight": 0}, "group"),
    ExpertParallelMoE: ({"w1": 0, "b1": 0, "w2": 0, "b2": 0}, "summed"),
    PipelineStage: ({"layers": 0}, "group"),
}


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A parameter every rank holds whole (data-parallel copies): its gradient is this
    rank's part, summed over the data-parallel ranks."""

    def __repr__(self) -> str:
        return "Replicated()"


@dataclasses.dataclass(frozen=True)
class Split:
    """A parameter split over `comm` into `comm.size` equal blocks along `axis`: this rank
    holds block `comm.rank`.

    Attributes:
        comm (object): the communicator it is split over: its `size` and `rank`, and the
            mpi4py communicator as `comm`.
        axis (int): the array axis cut into blocks.
        layer (str): the layer and field, e.g. `'ColumnParallelLinear.weight'`.
        gradient (str): what this rank's gradient of its block is: `'group'` (that of the
            one loss the group's ranks share: tensor parallelism) or `'summed'` (the sum
            over the group's ranks' own losses: expert parallelism).
    """

    comm: Any
    axis: int
    layer: str
    gradient: str

    def __repr__(self) -> str:
        return (f"Split({self.layer}, axis={self.axis}, over {self.comm.size} ranks, "
                f"gradient={self.gradient!r})")


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A leaf of `sharded_optimizer`'s state: the state of a run of one parameter's
    elements, sharded over the data-parallel ranks (ZeRO).

    Attributes:
        parameter (int): the parameter's position among the leaves of the tree given to
            the optimizer's `init`.
        lo (int): the first of its raveled elements whose state this rank holds.
        hi (int): one past the last.
    """

    parameter: int
    lo: int
    hi: int

    def __repr__(self) -> str:
        return f"Sharded(parameter {self.parameter}, elements [{self.lo}, {self.hi}))"


REPLICATED = Replicated()


def _is_layout(x) -> bool:
    return isinstance(x, (Replicated, Split, Sharded))


def _knows_itself(x) -> bool:
    """A node that says where its leaves live (`sharded_optimizer`'s state)."""
    return isinstance(x, eqx.Module) or hasattr(type(x), "_vjpmpi_layout")


def _fields(module) -> list[str]:
    return [f.name for f in dataclasses.fields(module) if not f.metadata.get("static")]


def layout(tree) -> Any:
    """Where each parameter of `tree` lives: replicated, or split over a communicator.

    Read from the `vjpmpi.nn` layers in `tree` (a model, its gradients, or an optax state
    holding parameter-shaped trees: they keep the layers' classes): a tensor-parallel
    linear's or embedding's split weight, an `ExpertParallelMoE`'s experts are `Split`;
    every other inexact array (a router, a layer norm, a row-parallel bias, anything
    outside vjpmpi.nn) is `Replicated`. In `sharded_optimizer`'s state, a sharded leaf is
    `Sharded` (the run of a parameter's elements whose state this rank holds); the state
    of a parameter split over the data-parallel ranks, kept whole, is its `Split`. A tree that has lost its layers (flattened into
    a list or dict) reads as all replicated: pass `layout(model)` with it instead.

    Args:
        tree (PyTree): a model, gradients or optimizer state.

    Returns:
        A pytree of `tree`'s structure whose inexact-array leaves are `Replicated()` or
            `Split(...)` and whose other leaves are None.

    Raises:
        Nothing: any pytree is read (what it holds outside `vjpmpi.nn`'s layers is
            replicated).

    Example:
        ```python
        import jax
        import vjpmpi.nn as vnn

        col = vnn.ColumnParallelLinear(4, 8, key=jax.random.PRNGKey(0))
        where = vnn.layout(col)
        assert isinstance(where.weight, vnn.Split) and where.weight.axis == 0
        ```
    """

    def module(node):
        axes, gradient = _SPLITS.get(type(node), ({}, ""))
        out = _copy(node)
        for field in _fields(node):
            value = getattr(node, field)
            if field in axes:
                mark = Split(node.comm, axes[field], f"{type(node).__name__}.{field}", gradient)
                value = jax.tree_util.tree_map(lambda a, m=mark: m if inexact(a) else None, value)
            else:
                value = marks(value)
            object.__setattr__(out, field, value)
        return out

    def marks(t):
        return jax.tree_util.tree_map(
            lambda x: x._vjpmpi_layout() if hasattr(type(x), "_vjpmpi_layout")
            else module(x) if isinstance(x, eqx.Module)
            else (REPLICATED if inexact(x) else None), t, is_leaf=_knows_itself)

    return marks(tree)


def inexact(x) -> bool:
    """An inexact array, or its shape (`jax.ShapeDtypeStruct`)."""
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and hasattr(x, "shape") and not isinstance(x, type)
            and jnp.issubdtype(dtype, jnp.inexact))


def _copy(module):
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, getattr(module, f.name))
    return new


def leaf_layouts(tree, given=None) -> list:
    """`layout(tree)` (or `given`, a layout of `tree`'s structure) as a list aligned with
    `jax.tree_util.tree_leaves(tree)` (None where the leaf is not an inexact array)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if given is None:
        marks = treedef.flatten_up_to(layout(tree))
    else:
        try:
            marks = treedef.flatten_up_to(given)
        except (ValueError, TypeError) as err:
            raise ValueError("the layout given is not of the tree's structure (pass "
                             "vjpmpi.nn.layout(model) of the model these gradients are of): "
                             f"{err}") from None
    return [m if inexact(leaf) and _is_layout(m) else (REPLICATED if inexact(leaf) else None)
            for m, leaf in zip(marks, leaves, strict=True)]


# ------------------------------------------------------------------ the sync's plan --

@dataclasses.dataclass(frozen=True)
class Step:
    """What a gradient sync over `dp` does with one leaf.

    kind: "sum" (allreduce over dp with the replicated leaves), "local" (no message: the
    gradient is complete here) or "blocks" (summed over the ranks of dp that hold the same
    block: one allreduce of a one-hot stack of `blocks` blocks). `scale`: the factor after
    the sum, before the mean's 1 / dp.size."""

    kind: str
    scale: int = 1
    blocks: int = 1
    block: Any = 0


_overlaps: dict = {}


def _overlap(c, d) -> int:
    """How many ranks of communicator `c` are in `d` (process communicators)."""
    key = (c.id, d.id)
    if key not in _overlaps:
        ranks = MPI.Group.Translate_ranks(c.comm.Get_group(), list(range(c.size)),
                                          d.comm.Get_group())
        _overlaps[key] = sum(r != MPI.UNDEFINED for r in ranks)
    return _overlaps[key]


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "the tree itself"


def plan(tree, dp, op: str, given=None) -> tuple[list, str | None, tuple]:
    """For each leaf of `tree` (a list aligned with its leaves): the `Step` of a sync over
    `dp` (None: not an inexact array), why it cannot be done (None: it can), and what
    every rank of `dp` must agree on (the blocks the "sum" leaves split over `c` hold:
    one block on every rank of dp)."""
    marks = leaf_layouts(tree, given)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    steps, why, agree = [], None, []
    for path, mark in zip(paths, marks, strict=True):
        if mark is None:
            steps.append(None)
            continue
        if isinstance(mark, Replicated) or mark.comm.size == 1:
            steps.append(Step("sum"))
            continue
        c = mark.comm
        what = f"leaf {_leaf_name(path)} ({mark.layer}, split over {c.size} ranks)"
        if isinstance(c, DeviceCommRef) or isinstance(dp, DeviceCommRef):
            shared = c.size if c == dp else -1  # (devices: the same communicator only)
        else:
            shared = _overlap(c, dp)
        if shared == c.size and c.size == dp.size:  # split over the very ranks reduced over
            steps.append(Step("local", c.size if mark.gradient == "group" else 1))
        elif shared == c.size:  # its group inside dp: sum over the holders of its block
            steps.append(Step("blocks", c.size if mark.gradient == "group" else 1,
                              blocks=c.size, block=c.rank))
        elif shared == 1 and mark.gradient == "group":  # across dp: every rank one block
            steps.append(Step("sum"))
            agree.append((c.rank, c.size))
        else:
            steps.append(None)
            if why is None:
                if shared == -1:
                    why = (f"{what}: split over a device communicator other than the one "
                           "synced over; sync it over its own communicator")
                elif shared == 1:
                    why = (f"{what}: its gradient sums the losses of ranks outside the "
                           f"{dp.size}-rank communicator synced over; sync over a "
                           "communicator that holds its whole group")
                else:
                    why = (f"{what}: its communicator and the {dp.size}-rank communicator "
                           "synced over share some ranks but neither holds the other's "
                           "group; sync over one that holds its group, or that shares only "
                           "this rank with it")
    return steps, why, tuple(agree)


def sync_steps(tree, dp, op: str, given=None) -> list:
    """`plan` of a sync of `tree` over `dp`, agreed: a leaf it cannot sync is an error on
    every rank of `dp` (at once on one rank; else when the program runs, through the
    ranks' agreement, which also checks that every rank of dp holds the same block of
    each leaf split across it)."""
    steps, why, agree = plan(tree, dp, op, given)
    invalid = None if why is None else (
        f"vjpmpi.nn.{op}: cannot sync the gradient of {why}. (vjpmpi.nn.layout(model) shows "
        "where each parameter lives; docs/guides/training.md has which sync to use when)")
    if dp.size == 1:
        if invalid is not None:
            raise ValueError(invalid)
        return steps
    if invalid is not None or agree:
        shape = tuple(n for pair in agree for n in pair) if invalid is None else ()
        agree_on(shape, jnp.uint8, dp, f"nn.{op}", invalid=invalid,
                 note=f"vjpmpi.nn.{op}: this rank holds blocks (rank, of size) {agree} of the "
                      "leaves split across the ranks synced over: every rank must hold the same")
    return steps


def finish(step: Step, g, dp, mean: bool):
    """A "local" or "blocks" leaf's synced gradient (`g`: this rank's)."""
    if step.kind == "blocks":
        stack = jnp.zeros((step.blocks, *g.shape), g.dtype).at[step.block].set(g)
        g = allreduce(stack, SUM, comm=dp)[step.block]
    scale = step.scale / dp.size if mean else step.scale
    return g if scale == 1 else g * jnp.asarray(scale, g.dtype)
