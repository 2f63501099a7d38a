"""Optimizer state sharded over the data-parallel ranks (ZeRO stages 1 and 2).

The ranks' gradients travel flattened per dtype (one reduce_scatter and one allgather
per dtype); rank r holds block r of each dtype's flat vector. The inner optimizer sees
the parameters' own tree, each leaf replaced by the part of it in this rank's block (a
run of its elements, shaped (1, ..., 1, k): the leaf's number of axes), so what
addresses leaves by position, label or number of axes (`optax.masked`,
`multi_transform`, weight decay on matrices only) works as on the whole tree. What the
optimizer does to those parts must not depend on the elements it does not see:
`_refusal` traces its update and refuses any computation that mixes the elements of a
parameter-shaped array (a reduction, a norm, a reshape, ...), compares the computation
traced on every rank's shards with the one traced on the whole tree (a mask or constant
decided in Python from a leaf's size changes it), then compares a few steps on shards
with steps on the whole tree (of the same structure, with small shapes). The verdict is
computed alike on every rank (from shapes and fixed probe data), so every rank refuses
together.

`init` returns the inner state wrapped in a `ShardedState`, whose static `parts` say, for
each of its leaves, which parameter it is a part of and which elements
(`vjpmpi.nn.save_checkpoint` stores a parameter's shards as one array and
`load_checkpoint` cuts it again at another number of ranks).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jax_compat import jaxprs_in_params
from .._mpi import SUM
from .._movement import allgather
from .._reductions import reduce_scatter
from ._layout import REPLICATED, Sharded, finish, inexact, leaf_layouts, plan, sync_steps
from ._shard import agree_on_buckets, bucket_bytes_arg, buckets, comm_ref, concat, split_into

if TYPE_CHECKING:  # (optax: the caller's; vjpmpi does not depend on it)
    import optax
    from mpi4py import MPI

# Primitives that act element by element (scalars broadcast): what an update may apply to
# parameter-shaped arrays.
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt
    max min mul ne neg nextafter not or population_count pow real reduce_precision rem
    round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin
    sinh sqrt square sub tan tanh xor
""".split())


class _Layout:
    """Where each inexact leaf's elements fall in the ranks' blocks of its group's flat
    vector (zero-padded to a multiple of the size). A group is a bucket of leaves of
    one dtype (`buckets`: one per dtype without a cap), in the order a backward pass
    produces their gradients."""

    def __init__(self, tree, size: int, cap: int | None = None, whole: frozenset = frozenset()):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        by_dtype: dict[str, list[int]] = {}  # (leaves that are inexact arrays, or
        for i, leaf in enumerate(self.leaves):  # their shapes: ShapeDtypeStruct; not the
            if i in whole:  # split leaves each rank keeps whole: its own block already)
                continue
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact):
                by_dtype.setdefault(jnp.result_type(leaf).name, []).append(i)
        self.groups = dict(enumerate(buckets(self.leaves, by_dtype, cap)))
        self.whole = whole
        self.size = size
        self.block, self.offset, self.group_of = {}, {}, {}
        for name, idx in self.groups.items():
            total = 0
            for i in idx:
                self.offset[i], self.group_of[i] = total, name
                total += int(np.size(self.leaves[i]))
            self.block[name] = -(-total // size)

    def part(self, i: int, r: int) -> tuple[int, int]:
        """[start, stop) of leaf i's flattened elements in rank r's block."""
        b, off, n = self.block[self.group_of[i]], self.offset[i], int(np.size(self.leaves[i]))
        lo, hi = max(off, r * b), min(off + n, (r + 1) * b)
        return (lo - off, hi - off) if lo < hi else (0, 0)

    def shape(self, i: int, r: int) -> tuple[int, ...]:
        lo, hi = self.part(i, r)
        return (1,) * (np.ndim(self.leaves[i]) - 1) + (hi - lo,)

    def shards(self, tree, r: int):
        """`tree` (of this layout's structure) with each inexact leaf cut to rank r's part."""
        leaves = jax.tree_util.tree_leaves(tree)
        out = list(leaves)
        for idx in self.groups.values():
            for i in idx:
                lo, hi = self.part(i, r)
                out[i] = jnp.ravel(leaves[i])[lo:hi].reshape(self.shape(i, r))
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def abstract_shards(self, r: int, empty_as_whole: bool = False):
        """The shapes of `shards(tree, r)` (ShapeDtypeStruct leaves), nothing computed
        (`empty_as_whole`: a leaf with no elements there keeps its whole shape)."""
        out = [jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) if hasattr(a, "dtype")
               else a for a in self.leaves]
        for idx in self.groups.values():
            for i in idx:
                shape = self.shape(i, r)
                if not (empty_as_whole and 0 in shape):
                    out[i] = jax.ShapeDtypeStruct(shape, out[i].dtype)
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def from_block(self, block, name: int, r: int, out: list) -> None:
        """Rank r's block of group `name` cut into its leaves' parts (into `out`)."""
        for i in self.groups[name]:
            lo, hi = self.part(i, r)
            start = self.offset[i] + lo - r * self.block[name]
            out[i] = block[max(start, 0):max(start, 0) + hi - lo].reshape(self.shape(i, r))

    def to_block(self, shards, name: int):
        """The inverse of `from_block`: this group's parts in one block (zero-padded)."""
        flat = [jnp.ravel(shards[i]) for i in self.groups[name]]
        flat = jnp.concatenate(flat) if flat else jnp.zeros(0)
        return jnp.pad(flat, (0, self.block[name] - flat.size))


@dataclasses.dataclass(frozen=True)
class StatePart:
    """What one leaf of the inner optimizer's state holds of the parameters: the state of
    elements `[lo, hi)` of parameter leaf `param` (raveled; this rank's local leaf, of
    shape `shape`, where `mark` (`vjpmpi.nn.layout`'s) says it lives).

    `block` > 0: the leaf is sharded over the data-parallel ranks, in blocks of `block`
    elements of its group's flat vector, where this leaf starts at `shift` (mod `block`);
    `block` == 0: each rank keeps the state of its whole local leaf (`lo, hi = 0, size`)."""

    param: int
    shape: tuple
    mark: Any
    lo: int
    hi: int
    shift: int = 0
    block: int = 0


# A leaf of the inner state that is not a parameter's (a step count, a schedule's state):
# the same on every rank if it is a scalar (None), else one nothing can place (UNPLACED).
UNPLACED = "unplaced"


class ShardedState:
    """`sharded_optimizer`'s state: this rank's state of the inner optimizer (`state`, the
    only child) and, static, what each of its leaves holds of the parameters (`parts`,
    aligned with `jax.tree_util.tree_leaves(state)`: a `StatePart`, None for a scalar that
    is no parameter's, or `UNPLACED`). Indexing and iterating reach into `state`
    (`opt_state[0].mu` as on optax's own state)."""

    __slots__ = ("parts", "state")

    def __init__(self, state, parts: tuple):
        self.state = state
        self.parts = parts

    def __getitem__(self, index):
        return self.state[index]

    def __len__(self) -> int:
        return len(self.state)

    def __iter__(self):
        return iter(self.state)

    def __repr__(self) -> str:
        return f"ShardedState({self.state!r})"

    def _vjpmpi_layout(self):
        """`vjpmpi.nn.layout` of this state: `Sharded` where a leaf holds a run of a
        parameter's elements, the parameter's own mark where it holds its whole local
        leaf, `Replicated` for a scalar (a step count), None for what nothing places."""
        leaves, treedef = jax.tree_util.tree_flatten(self.state)
        marks = []
        for leaf, part in zip(leaves, self.parts, strict=True):
            if isinstance(part, StatePart):
                marks.append(Sharded(part.param, part.lo, part.hi) if part.block
                             else part.mark)
            else:
                marks.append(REPLICATED if part is None and inexact(leaf) else None)
        return ShardedState(jax.tree_util.tree_unflatten(treedef, marks), self.parts)


jax.tree_util.register_pytree_with_keys(
    ShardedState,
    lambda s: (((jax.tree_util.GetAttrKey("state"), s.state),), s.parts),
    lambda parts, children: ShardedState(children[0], parts),
    lambda s: ((s.state,), s.parts))


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def state_parts(state, layout: _Layout, rank: int) -> tuple:
    """For each leaf of `state` (the inner optimizer's, of the shards of `layout`'s tree
    on `rank`), its `StatePart`, None or UNPLACED: a subtree of the parameters' structure
    whose arrays have the shards' shapes (optax's moments, traces: masked-out leaves
    may be empty nodes) holds one leaf per parameter leaf."""
    marks = leaf_layouts(jax.tree_util.tree_unflatten(layout.treedef, layout.leaves))
    records = []
    for i, leaf in enumerate(layout.leaves):
        if not _is_array(leaf):
            records.append(None)
            continue
        shape, n = tuple(np.shape(leaf)), int(np.size(leaf))
        if i in layout.group_of:
            lo, hi = layout.part(i, rank)
            block = layout.block[layout.group_of[i]]
            records.append(StatePart(i, shape, marks[i], lo, hi,
                                     layout.offset[i] % block if block else 0, block))
        else:  # (kept whole: split over the data-parallel ranks, or not inexact)
            records.append(StatePart(i, shape, marks[i], 0, n))
    shapes = [tuple(np.shape(p)) if _is_array(p) else None
              for p in jax.tree_util.tree_leaves(layout.abstract_shards(rank))]

    positions = jax.tree_util.tree_unflatten(layout.treedef, range(len(layout.leaves)))

    def level(x):  # x's children and its node (type, data, arity) as a treedef
        children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
        return children, treedef

    def align(node, ref) -> list | None:
        """(parameter position, leaf) for each leaf of `node`, a subtree of the
        parameters' structure (`ref`: its positions) where whole subtrees may be empty
        nodes (optax.masked's); None where it is not one."""
        if not jax.tree_util.tree_leaves(node):
            return []
        if isinstance(ref, int):
            return [(ref, node)] if _is_array(node) else None
        (node_children, node_def), (ref_children, ref_def) = level(node), level(ref)
        if node_def != ref_def:
            return None
        out = []
        for n, r in zip(node_children, ref_children, strict=True):
            got = align(n, r)
            if got is None:
                return None
            out += got
        return out

    def matched(node):
        pairs = align(node, positions)
        if pairs is None:
            return None
        out, found = [], False
        for i, p in pairs:
            if shapes[i] is None or records[i] is None:
                out.append(None if np.ndim(p) == 0 else UNPLACED)
            elif tuple(np.shape(p)) != shapes[i]:
                return None
            else:
                out.append(records[i])
                found = True
        return out if found else None

    def walk(node) -> list:
        got = matched(node)
        if got is not None:
            return got
        treedef = jax.tree_util.tree_structure(node)
        if jax.tree_util.treedef_is_leaf(treedef):
            return [None if not _is_array(leaf) or np.ndim(leaf) == 0 else UNPLACED
                    for leaf in jax.tree_util.tree_leaves(node)]
        children = jax.tree_util.tree_leaves(node, is_leaf=lambda x: x is not node)
        return [part for child in children for part in walk(child)]

    return tuple(walk(state))


def _mixing(jaxpr) -> str | None:
    """The first operation of `jaxpr` (nested ones included) that mixes the elements of
    an array that is not a scalar, or None."""
    for eqn in jaxpr.eqns:
        shapes = [tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars)
                  if hasattr(v.aval, "shape")]
        if all(s == () for s in shapes):
            continue  # scalar work (step counts, schedules): anything goes
        subs = list(jaxprs_in_params(eqn.params))
        if subs:  # calls, branches, loops, custom derivatives: what they run
            for sub in subs:
                found = _mixing(sub)
                if found:
                    return found
            continue
        name = eqn.primitive.name
        if name == "broadcast_in_dim" and tuple(eqn.invars[0].aval.shape) == ():
            continue
        out = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
        if name in _ELEMENTWISE and all(s in ((), out) for s in shapes):
            continue
        return f"{name} on {[list(s) for s in shapes]}"
    return None


def _program(jaxpr) -> tuple:
    """What `jaxpr` computes, without its arrays' sizes: each equation's primitive, its
    operands (variables by their order of appearance, literals by value), its parameters
    (nested jaxprs likewise; a `shape` as its number of axes) and its results' dtypes and
    numbers of axes. An update traced on arrays of other sizes gives the same program
    unless it depends on the sizes (a mask or a constant decided in Python from a shape)."""
    names: dict = {}

    def var(v):
        if hasattr(v, "val"):  # a literal
            return ("lit", repr(np.asarray(v.val).tolist()), str(v.aval.dtype))
        if id(v) not in names:
            names[id(v)] = len(names)
        aval = v.aval
        return (names[id(v)], str(getattr(aval, "dtype", "")), len(getattr(aval, "shape", ())))

    def value(key, v):
        if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # (first: JAX 0.7's ClosedJaxpr
            return (_program(v.jaxpr), len(v.consts))  # has `eqns` too)
        if hasattr(v, "eqns"):
            return _program(v)
        if isinstance(v, (tuple, list)) and any(hasattr(u, "eqns") or hasattr(u, "jaxpr")
                                                for u in v):
            return tuple(value(key, u) for u in v)
        if key == "shape" and isinstance(v, tuple):
            return ("axes", len(v))
        return repr(v)

    head = tuple(var(v) for v in (*jaxpr.constvars, *jaxpr.invars))
    body = tuple((eqn.primitive.name, tuple(var(v) for v in eqn.invars),
                  tuple(sorted((k, value(k, v)) for k, v in eqn.params.items())),
                  tuple(var(v) for v in eqn.outvars)) for eqn in jaxpr.eqns)
    return head, body, tuple(var(v) for v in jaxpr.outvars)


def _proxy(tree):
    """`tree` with every array leaf replaced by one of the same dtype and number of axes,
    each axis at most 3 long, drawn from a fixed seed (the same on every rank)."""
    gen = np.random.default_rng(20261202)

    def small(leaf):
        if not isinstance(leaf, (jax.Array, np.ndarray)) and not hasattr(leaf, "dtype"):
            return leaf
        shape = tuple(min(int(d), 3) for d in np.shape(leaf))
        return jnp.asarray(gen.standard_normal(shape)).astype(jnp.result_type(leaf))

    return jax.tree_util.tree_map(small, tree)


def _refusal(inner, params, size: int, cap: int | None = None,
             whole: frozenset = frozenset()) -> str | None:
    """Why `inner` cannot run on shards exactly as on the whole tree (None: it can)."""
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) if hasattr(a, "dtype")
        else a, params)
    layout = _Layout(abstract, size, cap, whole)
    # the whole tree, then each rank's shards (every rank traces every rank's, so that all
    # decide alike), each distinct layout of shapes once; a leaf with no elements in a
    # rank's block keeps its whole shape there (what it computes on none does not matter,
    # and JAX traces some operations on empty arrays differently)
    trees = {"the parameters": abstract}
    seen = set()
    for r in range(size):
        shards = layout.abstract_shards(r, empty_as_whole=True)
        key = tuple(np.shape(a) for a in jax.tree_util.tree_leaves(shards))
        if key not in seen:
            seen.add(key)
            trees[f"rank {r}'s shard of them"] = shards
    whole = None
    for what, tree in trees.items():
        try:
            state = jax.eval_shape(inner.init, tree)
            jaxpr = jax.make_jaxpr(inner.update)(tree, state, tree)
        except Exception as err:  # noqa: BLE001 (the trace cannot vouch for it)
            return f"its update could not be traced on {what} ({err!r})"
        found = _mixing(jaxpr.jaxpr)
        if found:
            return (f"its update mixes the elements of a parameter ({found}, traced on "
                    f"{what}), e.g. a global or per-leaf norm, a factored second moment")
        program = _program(jaxpr.jaxpr)
        if whole is None:
            whole = program
        elif program != whole:
            return (f"its update traced on {what} is another computation than on the whole "
                    "parameters: it depends on the parameters' sizes or shapes (e.g. a mask "
                    "or a constant computed from a leaf's size)")
    # element-wise: does it also compute the same on shards? (shape-dependent code)
    with jax.ensure_compile_time_eval():  # (init may be traced under jit: probe now)
        return _differs(inner, params, size, whole)


def _differs(inner, params, size: int, whole: frozenset = frozenset()) -> str | None:
    proxy = _proxy(params)
    small = _Layout(proxy, size, None, whole)
    steps = [jax.tree_util.tree_map(lambda a, s=s: a * s, _proxy(params))
             for s in (1e-3, 1.0, 1e3)]

    def run(p, grads):
        state, out = inner.init(p), []
        for g in grads:
            u, state = inner.update(g, state, p)
            out.append(jax.tree_util.tree_leaves(u))
        return out

    try:
        whole = run(proxy, steps)
        for r in sorted({0, size - 1}):
            parts = run(small.shards(proxy, r), [small.shards(g, r) for g in steps])
            for k, (w, p) in enumerate(zip(whole, parts, strict=True)):
                for i in (i for idx in small.groups.values() for i in idx):
                    lo, hi = small.part(i, r)
                    want = np.ravel(np.asarray(w[i]))[lo:hi].astype(np.float64)
                    got = np.ravel(np.asarray(p[i])).astype(np.float64)
                    if not np.allclose(got, want, rtol=1e-5, atol=1e-12 * (1 + np.abs(want).max(initial=0))):
                        return ("its step on a shard differs from its step on the whole "
                                f"parameters (leaf {i}, step {k + 1}): it depends on the "
                                "parameters' sizes or shapes")
    except Exception as err:  # noqa: BLE001
        return f"its update failed on a shard of the parameters ({err!r})"
    return None


def _blocks_refusal(tree, steps, size: int) -> str | None:
    """Why a leaf split over a part of the data-parallel ranks cannot be sharded (None:
    there is none)."""
    marks = leaf_layouts(tree)
    for (path, _), step, mark in zip(jax.tree_util.tree_flatten_with_path(tree)[0], steps,
                                     marks, strict=True):
        if step is not None and step.kind == "blocks":
            return (f"leaf {jax.tree_util.keystr(path)} ({mark.layer}, split over "
                    f"{mark.comm.size} of the {size} ranks): its blocks would be sharded "
                    "with other blocks; pass comm= the communicator of the ranks that hold "
                    "the same block (the data-parallel one of a grid), or use "
                    "allreduce_gradients")
    return None


def sharded_optimizer(inner: optax.GradientTransformation, *, mean: bool = True,
                      bucket_bytes: int | None = None,
                      comm: MPI.Comm | None = None) -> optax.GradientTransformation:
    """Wrap an optax optimizer so that each rank keeps and updates 1/size of its state.

    ZeRO stages 1 and 2 for data parallelism: `update` reduce-scatters the ranks' local
    gradients (summed, or averaged with `mean`), so each rank gets the reduced gradient
    of its block of the parameters (flattened per dtype, or per bucket of at most
    `bucket_bytes` cut from the last leaf back, as `allreduce_gradients` cuts them:
    inside a jitted step each bucket's reduce_scatter starts as soon as the backward
    pass has produced its gradients, and with asynchronous calls on it travels while
    the backward pass goes on); it runs `inner` on that block
    alone, cut into the parameters' tree (each leaf's part of the block), whose state is
    the only one it keeps (1/size of `inner`'s); and it allgathers the blocks' updates.
    Split parameters (`vjpmpi.nn.layout`: tensor-parallel blocks of a tensor group across
    the data-parallel ranks, experts split over them) are synced as `allreduce_gradients`
    syncs them; a leaf split over the very ranks of `comm` (the experts) is each rank's
    own already: its gradient is not summed with other ranks' and its state is kept
    whole on its rank. A leaf split over a part of `comm` (a tensor group inside the
    ranks) is refused by `init`, naming it: pass the data-parallel communicator of the
    grid. The result equals `inner` applied to `allreduce_gradients(grads, mean=mean)`, step
    for step, for any `inner` that treats each element on its own (sgd, momentum, adam,
    adamw, lion, rmsprop, ..., `masked`, `multi_transform`, weight decay masked by tree
    or by number of axes); `init` refuses, on every rank, one whose update mixes elements
    (`clip_by_global_norm`, `adafactor`, `lamb`, per-leaf clipping) or computes another
    thing on some rank's shards than on the whole parameters (a mask or a constant
    decided from a leaf's size), saying why.

    Args:
        inner (optax.GradientTransformation): the optimizer, one that treats each
            element on its own.
        mean (bool): average the ranks' gradients (else sum them).
        bucket_bytes (int | None): cut each dtype's gradients into buckets of at most
            this many bytes (None: one bucket per dtype); the same on every rank.
        comm (MPI.Intracomm | vjpmpi's CommRef | None): the data-parallel communicator
            (None: vjpmpi's private duplicate of COMM_WORLD).

    Returns:
        An optax `GradientTransformation`: `init(params)` (this rank's 1/size of
            `inner`'s state, in a `ShardedState` that also says which elements of which
            parameter each of its leaves is the state of, for
            `vjpmpi.nn.save_checkpoint`; `state[0]` etc. index the inner state) and
            `update(grads, state, params=None)` (the whole updates, the same on every
            rank, and this rank's new state).

    Raises:
        ValueError: a `bucket_bytes` that is not a positive int or None; from `init` or
            `update`, on every rank, for an `inner` that cannot run on shards exactly as
            on the whole parameters (saying why), or a leaf it cannot sync or shard
            (naming the leaf and its layer).
        TypeError: `comm` is not an mpi4py intracommunicator or None.
        ValueError: when `update` runs, on every rank, where the ranks'
            `bucket_bytes` differ (saying so).

    Shape:
        local gradients (a pytree) -> replicated updates (the same pytree).

    Transpose:
        (not differentiated) one reduce_scatter and one allgather per bucket.
    """
    import optax

    ref = comm_ref(comm, "sharded_optimizer")
    cap = bucket_bytes_arg(bucket_bytes, "sharded_optimizer")
    checked: dict = {}  # the parameters' structure and shapes -> (steps, refusal)

    def layout_of(tree):
        key = (jax.tree_util.tree_structure(tree),
               tuple((np.shape(a), str(jnp.result_type(a))) if hasattr(a, "dtype") else None
                     for a in jax.tree_util.tree_leaves(tree)))
        if key not in checked:
            steps, why, _ = plan(tree, ref, "sharded_optimizer")
            why = why or _blocks_refusal(tree, steps, ref.size)
            whole = frozenset(i for i, st in enumerate(steps) if st and st.kind == "local")
            checked[key] = (steps, whole, None if why else _refusal(inner, tree, ref.size,
                                                                    cap, whole), why)
        steps, whole, refusal, why = checked[key]
        if why is not None:
            raise ValueError(f"vjpmpi.nn.sharded_optimizer: cannot shard the gradient of {why}")
        if refusal is not None:
            raise ValueError(
                f"vjpmpi.nn.sharded_optimizer: the optimizer cannot run on shards of the "
                f"parameters exactly as on all of them: {refusal}. Apply it to the "
                "allreduce_gradients of a plain optimizer instead.")
        return _Layout(tree, ref.size, cap, whole), steps

    def init(params):
        layout = layout_of(params)[0]
        state = inner.init(layout.shards(params, ref.rank))
        return ShardedState(state, state_parts(state, layout, ref.rank))

    def update(grads, state, params=None):
        wrapped = isinstance(state, ShardedState)
        records, state = (state.parts, state.state) if wrapped else (None, state)
        layout, steps = layout_of(grads)
        sync_steps(grads, ref, "sharded_optimizer")  # (the ranks' blocks agreed)
        agree_on_buckets(ref, cap, "sharded_optimizer")
        leaves = layout.leaves
        parts = list(leaves)
        for name, idx in layout.groups.items():
            flat = concat(leaves, idx)
            blocks = jnp.pad(flat, (0, layout.block[name] * ref.size - flat.size))
            block = reduce_scatter(blocks.reshape(ref.size, -1), SUM, comm=ref)
            layout.from_block(block / ref.size if mean else block, name, ref.rank, parts)
        for i in layout.whole:  # split leaves: each rank's own, kept whole
            parts[i] = finish(steps[i], leaves[i], ref, mean)
        mine = jax.tree_util.tree_unflatten(layout.treedef, parts)
        shards = None if params is None else layout.shards(params, ref.rank)
        updates, state = inner.update(mine, state, shards)
        done = jax.tree_util.tree_leaves(updates)
        out = list(leaves)
        for name, idx in layout.groups.items():
            gathered = allgather(layout.to_block(done, name), comm=ref)
            split_into(out, leaves, idx, gathered.reshape(-1))
        for i in layout.whole:
            out[i] = done[i]
        return (jax.tree_util.tree_unflatten(layout.treedef, out),
                ShardedState(state, records) if wrapped else state)

    return optax.GradientTransformation(init, update)
