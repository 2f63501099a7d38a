"""Pipeline parallelism: a model's layers split into stages, one stage per rank of a
stage communicator, micro-batches flowing through them by a schedule that is data.

A schedule is a table of `Slot(step, stage, micro, kind)` rows: at `step`, `stage` runs
micro-batch `micro`'s forward ("F") or backward ("B") pass, one time unit each. `gpipe`
and `one_f_one_b` build theirs from each stage's order of work; a new schedule is a new
table. `pipeline_value_and_grad` walks this rank's rows: a forward pass keeps its
pullback (`jax.vjp`) until the micro-batch's backward pass uses and drops it, so a
schedule's stored activations are the forward passes a stage has run and not yet
taken back (`Schedule.stored`). After each step the stages pass on what that step made:
activations to the next stage, then cotangents to the previous one, the ranks of a
boundary pairing their send and receive in one `sendrecv`.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, NamedTuple, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from .._mpi import as_comm
from .._movement import bcast
from .._p2p import recv, send, sendrecv
from .._sync import agree_on, fence

_OP = "nn.pipeline_value_and_grad"
# The tags of the pipeline's messages on its communicator (activations, cotangents).
FORWARD_TAG, BACKWARD_TAG = 0x5046, 0x5042


class Slot(NamedTuple):
    """One cell of a schedule: at `step`, `stage` runs micro-batch `micro`'s forward
    (`kind` "F") or backward ("B") pass.

    A record read from `Schedule.rows` and `Schedule.grid()` (a `NamedTuple`).

    Attributes:
        step (int): the time unit, from 0.
        stage (int): the stage (the rank of the pipeline's communicator) that runs it.
        micro (int): the micro-batch, from 0.
        kind (str): "F" (forward pass) or "B" (backward pass).
    """

    step: int
    stage: int
    micro: int
    kind: str


def _waits_for(stages: int, stage: int, micro: int, kind: str) -> list[tuple[int, int, str]]:
    """The (stage, micro, kind) cells that must run at an earlier step: a forward pass
    waits for the previous stage's, a backward pass for its own forward pass and the
    next stage's backward pass."""
    if kind == "F":
        return [(stage - 1, micro, "F")] if stage > 0 else []
    return [(stage, micro, "F")] + ([(stage + 1, micro, "B")] if stage + 1 < stages else [])


class Schedule:
    """A pipeline schedule as data: the `Slot(step, stage, micro, kind)` rows of
    `stages` stages and `micro` micro-batches.

    Every (stage, micro-batch, kind) appears once, a stage runs at most one slot per
    step, and each slot comes after the slots it waits for (the previous stage's
    forward pass; its own forward pass and the next stage's backward pass).
    `str(schedule)` draws it as a table, one line per stage. `gpipe`, `one_f_one_b` and
    `from_orders` build schedules; the constructor takes any table and checks it.
    Its `rows` are sorted by step, then stage; `steps` and `bubble` (properties) give
    its length and idle fraction. Two schedules are equal when their stages,
    micro-batches and rows are.

    Args:
        stages (int): the number of stages, at least 1.
        micro (int): the number of micro-batches, at least 1.
        rows (Sequence): the table's `(step, stage, micro, kind)` rows (`Slot`s or
            4-tuples, in any order).
        name (str): the schedule's name, in its repr and error messages.

    Raises:
        ValueError: `stages` or `micro` below 1; a row outside the table (kind not "F"
            or "B", stage or micro-batch out of range, a negative step); a (stage,
            micro-batch, kind) twice or missing; two slots of one stage at one step; a
            slot not after the slots it waits for.
    """

    def __init__(self, stages: int, micro: int, rows: Sequence, name: str = "custom"):
        self.stages, self.micro, self.name = int(stages), int(micro), name
        self.rows = tuple(sorted((Slot(int(t), int(s), int(i), str(k)) for t, s, i, k in rows),
                                 key=lambda r: (r.step, r.stage)))
        self._check()

    def _check(self) -> None:
        def fail(why):
            raise ValueError(f"vjpmpi.nn.Schedule ({self.name}): {why}")

        if self.stages < 1 or self.micro < 1:
            fail(f"needs at least one stage and one micro-batch, got stages={self.stages}, "
                 f"micro={self.micro}")
        at: dict[tuple[int, int, str], int] = {}
        busy: set[tuple[int, int]] = set()
        for r in self.rows:
            if r.kind not in ("F", "B") or not 0 <= r.stage < self.stages or \
                    not 0 <= r.micro < self.micro or r.step < 0:
                fail(f"{r} is outside the table (kind F or B, stage < {self.stages}, "
                     f"micro < {self.micro}, step >= 0)")
            if (r.stage, r.micro, r.kind) in at:
                fail(f"{r.kind}{r.micro} appears twice on stage {r.stage}")
            if (r.step, r.stage) in busy:
                fail(f"stage {r.stage} has two slots at step {r.step}")
            at[r.stage, r.micro, r.kind] = r.step
            busy.add((r.step, r.stage))
        if len(at) != 2 * self.stages * self.micro:
            missing = [f"{k}{i} on stage {s}" for s in range(self.stages)
                       for i in range(self.micro) for k in "FB" if (s, i, k) not in at]
            fail(f"every stage runs F and B of every micro-batch; missing: {missing[:4]}")
        for (s, i, k), t in at.items():
            for w in _waits_for(self.stages, s, i, k):
                if at[w] >= t:
                    fail(f"{k}{i} on stage {s} at step {t} needs {w[2]}{w[1]} of stage "
                         f"{w[0]} at an earlier step (it is at step {at[w]})")

    @property
    def steps(self) -> int:
        """Time units from the first slot to the last (each slot one unit)."""
        return self.rows[-1].step + 1

    @property
    def bubble(self) -> float:
        """The idle fraction of the stages' time: 1 - slots / (stages * steps)."""
        return 1.0 - len(self.rows) / (self.stages * self.steps)

    def stored(self, stage: int) -> int:
        """The most forward passes `stage` has run and not yet taken back at once: its
        peak of stored activations, in micro-batches.

        Args:
            stage (int): the stage, `0 <= stage < stages`.

        Returns:
            The peak number of micro-batches whose activations `stage` holds at once.
        """
        held = peak = 0
        for r in self.rows:
            if r.stage == stage:
                held += 1 if r.kind == "F" else -1
                peak = max(peak, held)
        return peak

    def grid(self) -> list[list[Slot | None]]:
        """`grid[step][stage]`: the slot a stage runs at a step, or None (idle).

        Returns:
            A list of `steps` rows, each a list of `stages` entries: the `Slot` that stage
                runs at that step, or None.
        """
        cells: list[list[Slot | None]] = [[None] * self.stages for _ in range(self.steps)]
        for r in self.rows:
            cells[r.step][r.stage] = r
        return cells

    def __eq__(self, other):
        return isinstance(other, Schedule) and (self.stages, self.micro, self.rows) == (
            other.stages, other.micro, other.rows)

    def __hash__(self):
        return hash((self.stages, self.micro, self.rows))

    def __repr__(self):
        return f"Schedule({self.name}, stages={self.stages}, micro={self.micro})"

    def __str__(self):
        head = ["step"] + [str(t) for t in range(self.steps)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s, cells in enumerate(zip(*self.grid())):
            row = [f"stage {s}"] + [f"{c.kind}{c.micro}" if c else "" for c in cells]
            lines.append("| " + " | ".join(row) + " |")
        return "\n".join(lines)


def from_orders(stages: int, micro: int, orders: Sequence[Sequence[tuple[str, int]]],
                name: str = "custom") -> Schedule:
    """The schedule in which stage `s` runs `orders[s]`, each slot as early as it can.

    Each slot goes at the first step after its stage's previous slot and after every
    slot it waits for (the previous stage's forward pass; its own forward pass and the
    next stage's backward pass).

    Args:
        stages (int): the number of stages.
        micro (int): the number of micro-batches.
        orders (Sequence[Sequence[tuple[str, int]]]): one order per stage: its
            ("F" or "B", micro-batch) pairs, in the order it runs them.
        name (str): the schedule's name.

    Returns:
        The `Schedule`.

    Raises:
        ValueError: for an order that cannot run: not one order per stage, orders that
            wait for each other, or a table that `Schedule` refuses (a pass missing or
            twice, a kind other than "F"/"B", a micro-batch out of range, `stages` or
            `micro` below 1).
    """
    if len(orders) != stages:
        raise ValueError(f"vjpmpi.nn.Schedule ({name}): {len(orders)} orders for {stages} stages")
    done: dict[tuple[int, int, str], int] = {}
    nxt, rows = [0] * stages, []
    total = sum(len(o) for o in orders)
    t = 0
    while len(rows) < total:
        for s in range(stages):
            if nxt[s] < len(orders[s]):
                k, i = orders[s][nxt[s]]
                if all(done.get(w, t) < t for w in _waits_for(stages, s, i, k)):
                    rows.append(Slot(t, s, i, k))
                    done[s, i, k] = t
                    nxt[s] += 1
        t += 1
        if t > 2 * total + 2:  # no slot can be placed any more
            stuck = [f"stage {s}: {orders[s][nxt[s]]}" for s in range(stages)
                     if nxt[s] < len(orders[s])]
            raise ValueError(f"vjpmpi.nn.Schedule ({name}): the orders wait for each other "
                             f"({', '.join(stuck)})")
    return Schedule(stages, micro, rows, name)


def gpipe(stages: int, micro: int) -> Schedule:
    """GPipe: every stage runs all forward passes, then all backward passes.

    The backward passes run in reverse micro-batch order (what `jax.grad` of the forward
    pipeline runs). Stores `micro` micro-batches' activations per stage; bubble
    (stages - 1) / (micro + stages - 1).

    Args:
        stages (int): the number of stages (the pipeline communicator's size), at least 1.
        micro (int): the number of micro-batches, at least 1.

    Returns:
        The `Schedule` (named "gpipe").

    Raises:
        ValueError: `stages` or `micro` below 1.
    """
    return from_orders(stages, micro, [
        [("F", i) for i in range(micro)] + [("B", i) for i in reversed(range(micro))]
        for _ in range(stages)], "gpipe")


def one_f_one_b(stages: int, micro: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron-LM): forward and backward passes in turn.

    Stage `s` runs `stages - 1 - s` forward passes to fill the pipeline, then one
    forward and one backward pass in turn, then the remaining backward passes. Stores at
    most `stages - s` micro-batches' activations on stage `s` (at most `stages`); the
    same bubble as GPipe.

    Args:
        stages (int): the number of stages (the pipeline communicator's size), at least 1.
        micro (int): the number of micro-batches, at least 1.

    Returns:
        The `Schedule` (named "1f1b").

    Raises:
        ValueError: `stages` or `micro` below 1.
    """
    orders = []
    for s in range(stages):
        warm = min(stages - 1 - s, micro)
        order = [("F", i) for i in range(warm)]
        for j in range(micro - warm):
            order += [("F", warm + j), ("B", j)]
        orders.append(order + [("B", j) for j in range(micro - warm, micro)])
    return from_orders(stages, micro, orders, "1f1b")


def _struct(a: Any, what: str) -> jax.ShapeDtypeStruct:
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"vjpmpi.{_OP}: argument 'activation' must be an array or "
                        f"jax.ShapeDtypeStruct (or a sequence of them), got {what}")
    return jax.ShapeDtypeStruct(tuple(a.shape), jnp.dtype(a.dtype))


def _boundaries(activation: Any, stages: int) -> list[jax.ShapeDtypeStruct]:
    """One struct per boundary s -> s + 1."""
    if isinstance(activation, (list, tuple)):
        if len(activation) != stages - 1:
            raise ValueError(f"vjpmpi.{_OP}: argument 'activation' has {len(activation)} "
                             f"entries for the {stages - 1} boundaries of {stages} stages")
        return [_struct(a, type(a).__name__) for a in activation]
    return [_struct(activation, type(activation).__name__)] * (stages - 1)


def _take(tree: PyTree, i) -> PyTree:
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _hold(tree: PyTree, ref) -> PyTree:
    """`tree` as it is at this point of the program (`vjpmpi.fence` on the pipeline's
    communicator: ordered with the pipeline's messages, opaque to XLA's fusion, and in
    place: the result aliases the array)."""
    return fence(tree, comm=ref)


def _add(a: PyTree, b: PyTree, ref) -> PyTree:
    """a + b, computed here (`_hold`)."""
    return _hold(b if a is None else jax.tree_util.tree_map(lambda u, v: u + v, a, b), ref)


def _exchange(out, dest, template, source, tag, ref, tick):
    """Send `out` (or nothing) to `dest` and receive an array like `template` (or
    nothing) from `source`: one sendrecv where both move and share a dtype. The receive
    buffer is made from `tick`, so not before this step."""
    c = ref
    buf = None if template is None else jnp.broadcast_to(tick.astype(template.dtype),
                                                          template.shape)
    if out is not None and buf is not None and out.dtype == buf.dtype:
        return sendrecv(out, buf, source, dest, sendtag=tag, recvtag=tag, comm=c)
    if out is not None:
        send(out, dest, tag=tag, comm=c)
    if buf is not None:
        return recv(buf, source, tag=tag, comm=c)
    return None


def _local_problems(stage, loss, inputs, targets, schedule, bounds, call, key, ref):
    """What is wrong with this rank's arguments (None if nothing): every rank hears it
    through the ranks' agreement, not only the rank that finds it."""
    p, m, s = schedule.stages, schedule.micro, ref.rank
    if not all(jnp.issubdtype(b.dtype, jnp.floating) for b in bounds):
        return f"activations must be real floating point (they carry cotangents), got {bounds}"
    if s == 0 or s == p - 1:
        name, tree = ("inputs", inputs) if s == 0 else ("targets", targets)
        leaves = jax.tree_util.tree_leaves(tree)
        if not leaves:
            return f"stage {s} needs '{name}' (one entry per micro-batch), got {tree!r}"
        for a in leaves:
            if jnp.ndim(a) < 1 or jnp.shape(a)[0] != m:
                return (f"'{name}' on stage {s} must have {m} micro-batches on its first "
                        f"axis (the schedule's), got shape {jnp.shape(a)}")
    x = jax.eval_shape(lambda v: _take(v, 0), inputs) if s == 0 else bounds[s - 1]
    k = None if key is None else jax.random.fold_in(key, 0)
    try:
        y = eqx.filter_eval_shape(call, stage, x, k)
        if s + 1 < p:
            if (y.shape, y.dtype) != (bounds[s].shape, bounds[s].dtype):
                return (f"stage {s} gives {y.dtype}{list(y.shape)} per micro-batch, but "
                        f"the activation to stage {s + 1} is {bounds[s].dtype}"
                        f"{list(bounds[s].shape)}")
        else:
            v = jax.eval_shape(loss, y, jax.eval_shape(lambda v: _take(v, 0), targets))
            if v.shape != () or not jnp.issubdtype(v.dtype, jnp.floating):
                return f"'loss' must return a real scalar per micro-batch, got {v}"
    except Exception as e:  # (the user's function: reported on every rank)
        return f"stage {s} fails on one micro-batch ({x}): {type(e).__name__}: {e}"
    return None


def pipeline_value_and_grad(stage: Callable, loss: Callable, inputs: PyTree, targets: PyTree,
                            *, schedule: Schedule, activation: Any,
                            key: PRNGKeyArray | None = None,
                            comm=None) -> tuple[jax.Array, PyTree]:
    """The loss of a model split into pipeline stages, one per rank of `comm`, and the
    gradient of this rank's stage, running the micro-batches by `schedule`.

    Arguments that do not fit (a stage's output unlike `activation`, the wrong number of
    micro-batches) are an error on every rank when the program runs, named by the rank
    that found it. Its messages use tags 20550 (activations) and 20546 (cotangents) on
    `comm`: give the pipeline a communicator of its own.

    Args:
        stage (Callable): this rank's stage (rank `s` of `comm` is stage `s`), a callable
            pytree such as an `eqx.Module`: `stage(x)`, or `stage(x, key=k)` when `key`
            is given. Differentiated with respect to its floating-point arrays
            (`eqx.filter_vjp`).
        loss (Callable): `loss(y, target)`, the last stage's real scalar loss of one
            micro-batch.
        inputs (PyTree): the first stage's micro-batches, `micro` entries on the first
            axis (other stages may pass None).
        targets (PyTree): the last stage's targets, `micro` entries on the first axis
            (other stages may pass None).
        schedule (Schedule): a `Schedule` of `comm.size` stages, e.g.
            `one_f_one_b(size, micro)`, the same on every rank.
        activation (Array | jax.ShapeDtypeStruct | Sequence): one micro-batch's
            activation between stages (an array or `jax.ShapeDtypeStruct`, floating
            point), or a sequence of one per boundary.
        key (jax.random.PRNGKey | None): dropout key; micro-batch `i` runs with
            `jax.random.fold_in(key, i)`.
        comm (MPI.Intracomm | None): the pipeline's communicator, one
            rank per stage (None: vjpmpi's private duplicate of COMM_WORLD).

    Returns:
        `(loss, grads)`: the mean of the micro-batches' losses on every rank (in the
            default float dtype), and the gradient of that mean with respect to this
            rank's `stage` (a pytree like `stage`, None where not differentiated).

    Raises:
        TypeError: `schedule` is not a `Schedule`; `activation` (or an entry of it) is
            not an array or `jax.ShapeDtypeStruct`; `comm` is not an mpi4py
            intracommunicator or None.
        ValueError: a sequence `activation` whose length is not `stages - 1`; on a
            one-rank communicator, any of the refusals below, at once.
        ValueError: when run, on every rank: a schedule whose number of
            stages is not the communicator's size; arguments that do not fit (a stage's
            output unlike `activation`, non-floating activations, `inputs` or `targets`
            missing or without `micro` entries, a `loss` that is not a real scalar, a
            stage that fails on one micro-batch); ranks whose schedules or activations
            differ.

    Shape:
        micro-batches `inputs[i]` -> scalar loss.

    Transpose:
        each boundary's activation send is matched by a cotangent send back.

    Example:
        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        from mpi4py import MPI
        import vjpmpi, vjpmpi.nn as vnn

        rank = MPI.COMM_WORLD.rank                   # stage `rank` of a 2-stage pipeline
        layers = [eqx.nn.Linear(3, 3, key=jax.random.PRNGKey(s)) for s in range(2)]
        xs, ts = jnp.ones((4, 3)), jnp.zeros((4, 3))  # 4 micro-batches
        loss = lambda y, t: jnp.mean((y - t) ** 2)
        value, grads = vnn.pipeline_value_and_grad(
            layers[rank], loss, xs, ts, schedule=vnn.one_f_one_b(2, 4), activation=jnp.zeros(3))
        whole = lambda ls: jnp.mean(jax.vmap(lambda x, t: loss(ls[1](ls[0](x)), t))(xs, ts))
        want, want_grads = eqx.filter_value_and_grad(whole)(layers)
        assert jnp.allclose(value, want) and jnp.allclose(grads.weight, want_grads[rank].weight)
        ```
    """
    ref = as_comm(comm, _OP)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"vjpmpi.{_OP}: argument 'schedule' must be a vjpmpi.nn.Schedule "
                        f"(e.g. one_f_one_b(stages, micro)), got {type(schedule).__name__}")
    p, m, s = schedule.stages, schedule.micro, ref.rank
    bounds = _boundaries(activation, p) if p == ref.size else []

    def call(st, x, k):
        return st(x) if k is None else st(x, key=k)

    if p != ref.size:
        why = f"the schedule has {p} stages for {ref.size} ranks (one stage per rank)"
    else:
        why = _local_problems(stage, loss, inputs, targets, schedule, bounds, call, key, ref)
    # (the ranks agree on the table and every boundary's shape and dtype: a receive
    # buffer unlike what its sender sends would be an error or a partial message)
    digest = zlib.crc32(repr((schedule.rows, bounds)).encode()) % 65521
    agree_on((p, m, len(schedule.rows), digest), jnp.float32, ref, _OP,
             note=f"stage {s} of a {schedule!r}, activations "
                  f"{[f'{b.dtype}{list(b.shape)}' for b in bounds]}", invalid=why)
    dtype = jnp.zeros(()).dtype  # the default float: exact for any real loss dtype
    if why is not None:  # (the agreement above fails on every rank when it runs)
        return jnp.zeros((), dtype), jax.tree_util.tree_map(
            lambda a: jnp.zeros_like(a) if eqx.is_inexact_array(a) else None, stage)

    acts: dict[int, jax.Array] = {}  # received activations, by micro-batch
    cts: dict[int, jax.Array] = {}  # received (or, last stage, the loss's) cotangents
    pullbacks: dict[int, Callable] = {}
    grads, losses = None, []
    for row in schedule.grid():
        mine, out_f, out_b = row[s], None, None
        left = row[s - 1] if s > 0 else None
        right = row[s + 1] if s + 1 < p else None
        recv_f, recv_b = left and left.kind == "F", right and right.kind == "B"
        if mine is None and not (recv_f or recv_b):
            continue
        # This step's clock: a zero that exists once the program reaches this step.
        # XLA orders computation by data alone; what it uses here (the micro-batch's
        # slice, the receive buffers, so the forward pass) waits for it, or XLA would
        # make them all at the start and hold them.
        tick = _hold(jnp.zeros((), jnp.int32), ref)
        if mine is not None:
            i = mine.micro
            k = None if key is None else jax.random.fold_in(key, i)
            if mine.kind == "F":
                x = _take(inputs, i + tick) if s == 0 else acts.pop(i)
                if s == 0:
                    y, pb = eqx.filter_vjp(lambda st, x=x, k=k: call(st, x, k), stage)
                else:
                    y, pb = eqx.filter_vjp(lambda st, x, k=k: call(st, x, k), stage, x)
                pullbacks[i] = pb
                if s == p - 1:
                    value, loss_pb = jax.vjp(lambda y, t=_take(targets, i + tick): loss(y, t), y)
                    # (the loss is held: the forward pass ends in this step)
                    losses.append(_hold(value, ref))
                    (cts[i],) = loss_pb(jnp.asarray(1 / m, value.dtype))
                else:
                    out_f = y
            else:
                ct = cts.pop(i)
                if s == p - 1:
                    # The last stage made this cotangent itself, in its forward step:
                    # held, the backward pass runs in this step. (Otherwise XLA ran it
                    # right after the forward pass, and under GPipe the last stage's
                    # forward steps took a forward and a backward pass while the
                    # others waited: 2 stages took twice their work, measured.)
                    ct = _hold(ct, ref)
                g = pullbacks.pop(i)(ct)  # (its residuals are dead after this)
                grads = _add(grads, g[0], ref)
                if s > 0:
                    out_b = g[1]
        # what this step made: activations forward, then cotangents backward
        got = _exchange(out_f, s + 1, bounds[s - 1] if recv_f else None, s - 1,
                        FORWARD_TAG, ref, tick)
        if got is not None:
            acts[left.micro] = got
        got = _exchange(out_b, s - 1, bounds[s] if recv_b else None, s + 1,
                        BACKWARD_TAG, ref, tick)
        if got is not None:
            cts[right.micro] = got
    total = (sum(losses) / m).astype(dtype) if s == p - 1 else jnp.zeros((), dtype)
    if p > 1:
        total = bcast(total, p - 1, comm=ref)
    return total, grads
