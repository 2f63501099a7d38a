"""Smoke test of the mixture-of-experts example (examples/moe.py, docs/guides/layers.md),
float64: with the example's default gradient sync (`allreduce_gradients`) on the whole
model, the expert-parallel run equals the one-process model on every rank's tokens (the
three syncs on a model with experts: mpi/test_nn_layout.py); with a capacity factor, the
layer equals the one-process layer on each rank's tokens alone."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import moe  # noqa: E402


def test_moe_example_matches_one_process():
    result = moe.main(steps=3)
    for sync in ("allreduce",):
        run = result[sync]
        assert run["losses"][-1] < run["losses"][0], (sync, run)  # it learns
        assert run["max_loss_diff"] < 1e-12, (sync, run)
        assert run["max_param_diff"] < 1e-12, (sync, run)
    capacity = result["capacity"]
    assert capacity["max_diff"] < 1e-12, capacity
    assert 0 < capacity["tokens_capped"] < 1, capacity  # (the cap dropped some, not all)
