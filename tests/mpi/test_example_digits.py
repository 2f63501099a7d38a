"""Smoke test of the main example: the tensor-parallel run equals the single-process one."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_digits  # noqa: E402


def test_train_digits_matches_single_process():
    result = train_digits.main(steps=40, out=None, show=False)
    # float64 (the suite enables x64), 40 Adam steps: equal up to rounding. (Adam is
    # invariant to a positive scale of the gradient but for its epsilon, so a tolerance
    # this tight also sees a gradient scaled by the rank count.)
    assert result["max_param_diff"] < 1e-10, result
    assert result["max_loss_diff"] < 1e-10, result
    assert result["test_accuracy"] == result["reference_accuracy"]
    assert result["test_accuracy"] > 0.8  # it learns: chance is 0.1
