"""Checkpoints across jobs of other rank counts (run by tests/test_checkpoint_reshard.py):

    python ckpt_reshard.py save DIR       two steps, save step 2, write DIR/reference.npz:
                                          every leaf's global array (vjpmpi-independent
                                          gather), the objective after one more step
    python ckpt_reshard.py interrupt DIR  three steps, then a save of step 3 in which
                                          rank 1 dies after writing its first array
    python ckpt_reshard.py load DIR       load the newest complete step at this rank
                                          count: the same global arrays, bit for bit;
                                          one more step: the same objective (1e-12)

Every rank prints `ckpt_reshard <mode> ok` at the end.
"""

import os
import sys

import jax
import numpy as np
from mpi4py import MPI

import vjpmpi  # noqa: F401  (first: sets synchronous CPU dispatch)
import vjpmpi.nn as vnn
from vjpmpi.nn import _checkpoint

jax.config.update("jax_enable_x64", True)
if os.environ.get("VJPMPI_TEST_SHARED_COMPILES"):  # (as the suite's conftest.py)
    from _shared_compiles import share_compiles

    share_compiles(os.environ["VJPMPI_TEST_SHARED_COMPILES"])

from ckpt_model import build, gather_global, optimizer, train_step  # noqa: E402

WORLD = MPI.COMM_WORLD


def trained(steps):
    m = build(WORLD)
    opt = optimizer(WORLD)
    state = opt.init(m)
    for _ in range(steps):
        m, state, _ = train_step(m, state, WORLD, opt)
    return m, state, opt


def dense_model(m):
    return {"lin.weight": m["lin"].weight, "col": m["col"].to_dense().weight,
            "row": m["row"].to_dense().weight, "moe.w1": m["moe"].to_dense().w1,
            "stages": m["stages"].to_dense().weight}


def save(directory):
    m, state, opt = trained(2)
    vnn.save_checkpoint(directory, {"model": m, "opt": state}, 2, comm=WORLD)
    ref = gather_global({"model": m, "opt": state}, WORLD)
    dense = {f"dense {k}": np.asarray(v) for k, v in dense_model(m).items()}
    m, state, _ = train_step(m, state, WORLD, opt)
    _, _, after = train_step(m, state, WORLD, opt)  # (J after one step)
    if WORLD.rank == 0:
        np.savez(os.path.join(directory, "reference.npz"), **ref, **dense,
                 objective_next=np.float64(after))


def interrupt(directory):
    m, state, _ = trained(3)
    original = _checkpoint._write_piece

    def dies(store, leaf):
        original(store, leaf).result()
        os._exit(1)

    if WORLD.rank == 1:
        _checkpoint._write_piece = dies
    vnn.save_checkpoint(directory, {"model": m, "opt": state}, 3, comm=WORLD)
    raise AssertionError("rank 1 should have died during the save")


def load(directory):
    ref = dict(np.load(os.path.join(directory, "reference.npz")))
    like_m = build(WORLD, salt=1.0)  # (other values: all must come from the checkpoint)
    opt = optimizer(WORLD)
    tree, step = vnn.load_checkpoint(directory, {"model": like_m, "opt": opt.init(like_m)},
                                     comm=WORLD)
    assert step == 2, step
    got = gather_global(tree, WORLD)
    saved = {k: v for k, v in ref.items() if k.startswith("[")}
    assert sorted(got) == sorted(saved), (sorted(got), sorted(saved))
    for k, v in saved.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (
            f"leaf {k} differs after loading at {WORLD.size} ranks")
    for k, v in dense_model(tree["model"]).items():
        assert np.array_equal(np.asarray(v), ref[f"dense {k}"]), f"dense {k}"
    m, state, _ = train_step(tree["model"], tree["opt"], WORLD, opt)
    _, _, after = train_step(m, state, WORLD, opt)
    want = float(ref["objective_next"])
    assert abs(after - want) <= 1e-12 * abs(want), (after, want, after - want)


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    {"save": save, "interrupt": interrupt, "load": load}[mode](directory)
    print(f"ckpt_reshard {mode} ok on rank {WORLD.rank} of {WORLD.size}", flush=True)
