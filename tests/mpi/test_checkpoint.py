"""vjpmpi.nn.save_checkpoint / load_checkpoint within one job (float64; the model of
ckpt_model.py: data-, tensor- and expert-parallel layers, `sharded_optimizer(adam)`
state). tests/test_checkpoint_reshard.py saves and loads across jobs of other sizes.

- Saved and loaded at the same layout: every leaf bit for bit, the step count too.
- Loaded by fewer ranks (groups of 2) and by each rank alone (`MPI.COMM_SELF`): every
  leaf's global array (gathered without the checkpoint code) bit for bit.
- `ShardedState.parts` place each shard: the gathered Adam moments equal optax's on the
  whole parameters.
- A data x tensor grid (tensor blocks held by several ranks, the optimizer over the data
  ranks: ZeRO ranges of split leaves): each block and range written by one rank only,
  and loaded whole, and on a grid of another tensor split.
- `keep`, leftovers of interrupted saves, incomplete steps, replacing a step.
- Errors on every rank: no directory, no checkpoint, a checkpoint of another model (a
  leaf of another shape or dtype, a missing leaf, an extra one, on one rank only), a
  leaf split over a device communicator, a traced leaf, an optimizer-state leaf that
  is no parameter's, bad arguments, copies of a replicated leaf that differ between
  ranks (the last rank's only).
- zarr v2 where tensorstore lacks zarr3.
"""

import functools
import itertools
import json
import os
import pathlib
import re
import shutil
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import vjpmpi
import vjpmpi.nn as vnn
from ckpt_model import build, dense, gather_global, optimizer
from helpers import WORLD, fresh
from vjpmpi.nn import _checkpoint

rank, size = WORLD.rank, WORLD.size


@pytest.fixture
def directory():
    """A fresh directory, the same on every rank, removed afterwards."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="vjpmpi-ckpt-") if rank == 0 else None)
    yield path
    WORLD.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _gradient(m):
    """A gradient for `m`: the cosine of each parameter (each rank's block of the global
    one, and the same on every rank for the replicated ones)."""
    return jax.tree_util.tree_map(jnp.cos, eqx.filter(m, eqx.is_inexact_array))


@functools.cache
def _update(opt):
    return jax.jit(lambda g, s, p: opt.update(g, s, p))


@functools.cache
def trained():
    """The model over WORLD and its sharded Adam state after two updates."""
    m = build(WORLD)
    opt = optimizer(WORLD)
    state = opt.init(m)
    for _ in range(2):
        u, state = _update(opt)(_gradient(m), state, m)
        m = eqx.apply_updates(m, u)
    return m, state


def _equal_trees(got, want, what):
    g, w = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in g] == [p for p, _ in w], what
    assert w, what
    for (path, a), (_, b) in zip(g, w, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, jax.tree_util.keystr(path))
        assert np.array_equal(a, b), f"{what}: leaf {jax.tree_util.keystr(path)} differs"


def _equal_globals(got: dict, want: dict, what):
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), f"{what}: leaf {k}"


def test_round_trip_at_the_same_layout_bit_for_bit(directory):
    m, state = trained()
    where = vnn.save_checkpoint(directory, {"model": m, "opt": state}, 5)
    assert where == pathlib.Path(directory) / "step_5" and (where / "manifest.json").is_file()
    like_m = build(WORLD, salt=1.0)
    like = {"model": like_m, "opt": optimizer(WORLD).init(like_m)}
    tree, step = vnn.load_checkpoint(directory, like)
    assert step == 5
    _equal_trees(tree, {"model": m, "opt": state}, "loaded")
    assert int(tree["opt"][0].count) == 2 and type(tree["opt"]) is type(state)
    assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(tree))
    # the manifest: every array leaf by key path, its global shape and dtype
    manifest = json.loads((where / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["ranks"] == size
    leaf = manifest["leaves"]["['model']['col'].weight"]
    assert leaf["shape"] == [12, 4] and leaf["dtype"] == "float64"
    assert leaf["chunk"] == [12 // size, 4]  # (chunked by the saving ranks' blocks)
    mu = manifest["leaves"]["['opt'].state[0].mu['lin'].weight"]
    assert mu["kind"] == "zero" and mu["shape"] == [4, 4]


def test_loaded_by_fewer_ranks_and_by_each_rank_alone(directory):
    m, state = trained()
    vnn.save_checkpoint(directory, {"model": m, "opt": state}, 1)
    saved = gather_global({"model": m, "opt": state}, WORLD)
    group = WORLD.Split(rank // 2, rank)  # (groups of two, the last maybe of one)
    try:
        for comm in (group, MPI.COMM_SELF):
            like_m = build(comm, salt=2.0)
            tree, _ = vnn.load_checkpoint(
                directory, {"model": like_m, "opt": optimizer(comm).init(like_m)}, comm=comm)
            _equal_globals(gather_global(tree, comm), saved, f"loaded by {comm.size} ranks")
            whole = tree["model"]["col"].to_dense().weight
            assert np.array_equal(whole, m["col"].to_dense().weight)
    finally:
        group.Free()


def test_state_parts_place_every_shard():
    """The gathered Adam moments equal optax's on the whole parameters, fed the gradient
    the sharded optimizer averaged (the experts': each rank's own over size)."""
    m = build(WORLD)
    opt = optimizer(WORLD)
    g = _gradient(m)
    _, state = _update(opt)(g, opt.init(m), m)
    got = gather_global({"opt": state}, WORLD)
    grads = gather_global({"g": g}, WORLD)
    for key, value in grads.items():
        leaf = key.removeprefix("['g']")
        if "['moe']" in leaf and "router" not in leaf:
            value = value / size
        mu, nu = got[f"['opt'].state[0].mu{leaf}"], got[f"['opt'].state[0].nu{leaf}"]
        np.testing.assert_allclose(mu, 0.1 * value, rtol=1e-14, atol=1e-16, err_msg=leaf)
        np.testing.assert_allclose(nu, 0.001 * value ** 2, rtol=1e-13, atol=1e-18,
                                   err_msg=leaf)


def _grid(tp):
    """(data comm, tensor comm) of a data x tensor grid with `tp` tensor ranks."""
    tensor = WORLD.Split(rank // tp, rank)
    data = WORLD.Split(rank % tp, rank)
    return data, tensor


def _grid_model(tensor, salt=0.0):
    lin, d1, d2, _, _ = dense()
    m = {"lin": lin, "col": vnn.ColumnParallelLinear.from_dense(d1, tensor),
         "row": vnn.RowParallelLinear.from_dense(d2, tensor)}
    return jax.tree_util.tree_map(lambda a: a + salt if eqx.is_inexact_array(a) else a, m)


def test_a_grid_writes_each_block_once_and_reshards(directory, monkeypatch):
    tp = 2 if size % 2 == 0 else 1
    data, tensor = _grid(tp)
    others = []
    try:
        m = _grid_model(tensor)
        opt = vnn.sharded_optimizer(optax.adam(0.1), comm=data)
        u, state = _update(opt)(_gradient(m), opt.init(m), m)
        tree = {"model": eqx.apply_updates(m, u), "opt": state}
        written = []
        original = _checkpoint._write_piece

        def record(store, leaf):
            written.append((leaf.key, leaf.piece()))
            return original(store, leaf)

        monkeypatch.setattr(_checkpoint, "_write_piece", record)
        vnn.save_checkpoint(directory, tree, 3)
        monkeypatch.undo()
        everyone = [w for ws in WORLD.allgather(written) for w in ws]
        assert len(everyone) == len(set(everyone))  # (no block or range written twice)
        by_key = {}
        for key, piece in everyone:
            by_key.setdefault(key, []).append(piece)
        assert by_key["['model']['lin'].weight"] == [(0,)]  # (one of the `size` holders)
        assert sorted(by_key["['model']['col'].weight"]) == [(b,) for b in range(tp)]
        ranges = sorted(by_key["['opt'].state[0].mu['col'].weight"])
        for row in range(tp):  # (each tensor block's elements: data ranks' ranges, tiled)
            ends = [(lo, hi) for r, lo, hi in ranges if r == row]
            assert ends[0][0] == 0 and ends[-1][1] == 12 // tp * 4, ends
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ends)), ends
        # each range starts and ends on a chunk boundary (or the row's ends): no chunk
        # is written by two ranks
        manifest = json.loads((pathlib.Path(directory) / "step_3" / "manifest.json").read_text())
        for key, pieces in by_key.items():
            spec = manifest["leaves"][key]
            if spec["kind"] == "zero":
                m = int(np.prod(spec["shape"])) // spec["blocks"]
                for _, lo, hi in pieces:
                    assert lo == 0 or (spec["shift"] + lo) % spec["chunk"] == 0, (key, lo)
                    assert hi == m or (spec["shift"] + hi) % spec["chunk"] == 0, (key, hi)
        saved = gather_global(tree, WORLD)
        # loaded whole, and on a grid of another tensor split (all ranks tensor-parallel)
        for comm, t2 in ((MPI.COMM_SELF, 1), (WORLD, size)):
            d2, t2c = (MPI.COMM_SELF, MPI.COMM_SELF) if comm is MPI.COMM_SELF else _grid(t2)
            others += [c for c in (d2, t2c) if c is not MPI.COMM_SELF]
            like_m = _grid_model(t2c, salt=3.0)
            like = {"model": like_m,
                    "opt": vnn.sharded_optimizer(optax.adam(0.1), comm=d2).init(like_m)}
            got, _ = vnn.load_checkpoint(directory, like, comm=comm)
            _equal_globals(gather_global(got, WORLD if comm is WORLD else MPI.COMM_SELF),
                           saved, f"the grid's checkpoint on {t2} tensor ranks")
    finally:
        for c in (data, tensor, *others):
            c.Free()


def _small(value):
    """A small tree: a replicated vector and a tensor-parallel layer, all `value`."""
    col = vnn.ColumnParallelLinear.from_dense(fresh(eqx.nn.Linear, 3, 12, seed=0), WORLD)
    tree = {"v": jnp.zeros(5), "col": col}
    return jax.tree_util.tree_map(lambda a: jnp.full_like(a, value), tree)


def _listing(directory):
    return sorted(os.listdir(directory))


def test_keep_leftovers_and_incomplete_steps(directory):
    for s in (1, 2, 3, 4):
        vnn.save_checkpoint(directory, _small(float(s)), s, keep=2)
    assert _listing(directory) == ["step_3", "step_4"]
    WORLD.Barrier()
    if rank == 0:  # an interrupted save of another step, one of this step, an incomplete
        for name in ("step_1.tmp-x", "step_6.tmp-y", "step_9"):  # step (no manifest)
            os.makedirs(os.path.join(directory, name, "junk"))
    WORLD.Barrier()
    vnn.save_checkpoint(directory, _small(5.0), 5, keep=None)
    assert _listing(directory) == ["step_3", "step_4", "step_5", "step_9"]
    like = _small(0.0)
    tree, step = vnn.load_checkpoint(directory, like)  # (step_9 is not complete)
    assert step == 5 and float(tree["col"].weight[0, 0]) == 5.0
    tree, step = vnn.load_checkpoint(directory, like, step=3)
    assert step == 3 and float(tree["v"][0]) == 3.0
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint of step 1 in .*"
                       r"complete steps: \[3, 4, 5\]"):
        vnn.load_checkpoint(directory, like, step=1)
    vnn.save_checkpoint(directory, _small(7.0), 5, keep=None)  # (step 5 again: replaced)
    tree, step = vnn.load_checkpoint(directory, like)
    assert step == 5 and float(tree["col"].bias[0]) == 7.0
    vnn.save_checkpoint(directory, _small(6.0), 6, keep=1)
    assert _listing(directory) == ["step_6", "step_9"]


def test_no_checkpoint_is_file_not_found_naming_the_directory(directory):
    missing = os.path.join(directory, "nothing here")
    with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
        vnn.load_checkpoint(missing, _small(0.0))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in " + re.escape(
            repr(directory))):
        vnn.load_checkpoint(directory, _small(0.0))


def test_a_checkpoint_of_another_model_names_the_leaf(directory):
    vnn.save_checkpoint(directory, _small(1.0), 1)
    other = dict(_small(0.0), v=jnp.zeros(6))  # another global shape
    with pytest.raises(ValueError, match=re.escape("leaf ['v']: the checkpoint") +
                       r".*holds float64\[5\], the tree given float64\[6\]"):
        vnn.load_checkpoint(directory, other)
    other = dict(_small(0.0), v=jnp.zeros(5, jnp.float32))  # another dtype
    with pytest.raises(ValueError, match=r"leaf \['v'\].*float64\[5\], the tree given "
                       r"float32\[5\]"):
        vnn.load_checkpoint(directory, other)
    other = dict(_small(0.0), w=jnp.zeros(2))  # a leaf the checkpoint lacks
    with pytest.raises(ValueError, match=re.escape("leaf ['w'] of the tree given is not in "
                                                   "the checkpoint")):
        vnn.load_checkpoint(directory, other)
    other = {"v": jnp.zeros(5)}  # leaves of the checkpoint the tree lacks
    with pytest.raises(ValueError, match=re.escape("holds leaves that no rank's tree has: "
                                                   "['col'].bias, ['col'].weight")):
        vnn.load_checkpoint(directory, other)
    # another model on the last rank only: every rank raises, naming it
    other = _small(0.0)
    if rank == size - 1:
        other = dict(other, v=jnp.zeros((5, 1)))
    with pytest.raises(ValueError, match=r"leaf \['v'\].*float64\[5, 1\]"):
        vnn.load_checkpoint(directory, other)


def test_what_cannot_be_saved_is_refused_on_every_rank(directory):
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("d",))
    linear = fresh(eqx.nn.Linear, 3, 12, seed=0)
    on_devices = jax.shard_map(
        lambda: vnn.ColumnParallelLinear.from_dense(linear, vjpmpi.device_comm("d")),
        mesh=mesh, in_specs=(), out_specs=P("d"))()
    with pytest.raises(ValueError, match=re.escape("leaf ['col'].weight (ColumnParallelLinear"
                                                   ".weight) is split over a device")):
        vnn.save_checkpoint(directory, {"col": on_devices}, 1)
    with pytest.raises(ValueError, match=r"leaf \['v'\] is a traced value"):
        jax.jit(lambda v: vnn.save_checkpoint(directory, {"v": v}, 1) and v)(jnp.ones(2))
    odd = optax.GradientTransformation(lambda p: jnp.zeros(3), lambda u, s, p=None: (u, s))
    state = vnn.sharded_optimizer(odd).init({"v": jnp.ones(4)})
    with pytest.raises(ValueError, match=re.escape("leaf ['opt'].state of a sharded_optimizer"
                                                   " state is a part of no parameter")):
        vnn.save_checkpoint(directory, {"opt": state}, 1)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="`step` must be an int >= 0"):
            vnn.save_checkpoint(directory, {"v": jnp.ones(2)}, bad)
    with pytest.raises(ValueError, match="`keep` must be an int >= 1"):
        vnn.save_checkpoint(directory, {"v": jnp.ones(2)}, 1, keep=0)
    if WORLD.size > 1:  # copies of a replicated leaf that differ (only one could be saved)
        last = WORLD.size - 1
        v = jnp.ones(3).at[0].set(2.0 if WORLD.rank == last else 1.0)
        with pytest.raises(ValueError, match=re.escape("leaf ['v']: ranks 0 and "
                                                       f"{last} hold different values")):
            vnn.save_checkpoint(directory, {"v": v, "same": jnp.ones(2)}, 1)
    assert _listing(directory) == []  # (nothing was written)


def test_zarr_v2_where_tensorstore_lacks_zarr3(directory, monkeypatch):
    monkeypatch.setattr(_checkpoint, "_DRIVER", "zarr")
    where = vnn.save_checkpoint(directory, _small(2.0), 2)
    assert json.loads((where / "manifest.json").read_text())["driver"] == "zarr"
    assert any(f == ".zarray" for _, _, fs in os.walk(where) for f in fs)
    tree, _ = vnn.load_checkpoint(directory, _small(0.0))
    _equal_trees(tree, _small(2.0), "zarr v2")
