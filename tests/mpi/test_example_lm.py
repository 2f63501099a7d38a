"""Smoke test of the language-model example: tensor x data parallel, pipeline x tensor
(x data) parallel, and data x expert parallel (a mixture of experts), equal one process."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import pytest  # noqa: E402
import train_lm  # noqa: E402

size = train_lm.COMM.size


def check(result):
    assert result["final_loss"] < result["first_loss"] - 0.5  # it learns
    # float64 (the suite enables x64), 12 Adam steps: the losses and every parameter
    # (gathered from its shards and stages) equal the single-process model's up to
    # rounding. (Adam is invariant to a positive scale of the gradient but for its
    # epsilon, so a tolerance this tight also sees a gradient scaled by the rank count.)
    assert result["max_loss_diff"] < 1e-10, result
    assert abs(result["final_loss"] - result["reference_final_loss"]) < 1e-10, result
    assert result["max_param_diff"] < 1e-10, result


def test_train_lm_matches_single_process():
    if size != 2:  # (1 and 3 ranks: data parallelism alone, as in other tests)
        pytest.skip("the LM example's smoke test runs at 2 ranks (at 4, a 2 x 2 grid: "
                    "tests/test_example_lm_resume.py)")
    result = train_lm.main(steps=12, out=None, show=False)
    assert (result["pp"], result["tp"], result["dp"]) == (1, 2, size // 2)
    check(result)


def test_train_lm_pipelined_matches_single_process():
    if size not in (4, 8):
        pytest.skip("the pipelined LM runs 2 stages x 2 tensor-parallel ranks (x 2 data "
                    "groups at 8 ranks)")
    result = train_lm.main(steps=12, pipeline=2, out=None, show=False)
    assert (result["pp"], result["tp"], result["dp"]) == (2, 2, size // 4)
    check(result)


def test_train_lm_with_experts_matches_single_process():
    if size != 2:
        pytest.skip("the MoE LM runs data x expert parallel at 2 ranks (experts over 4: "
                    "mpi/test_nn_layout.py)")
    result = train_lm.main(steps=12, experts=2 * size, out=None, show=False)
    assert (result["dp"], result["experts"]) == (size, 2 * size)
    check(result)
