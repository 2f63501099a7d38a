"""The main example with a rank per device (`train_digits.py --devices-per-process D`): the
tensor-parallel MLP trained on P processes x D devices (a shard_map over each process's
devices, `vjpmpi.device_comm`) equals the same training on one process, as the run on
P * D processes does (tests/test_example_devices.py compares the two runs themselves)."""

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import train_digits  # noqa: E402

D = len(jax.devices())


def test_train_digits_on_devices_matches_single_process():
    result = train_digits.main(steps=20, out=None, show=False, devices_per_process=D)
    # float64 (the suite enables x64): equal up to rounding. (Adam is invariant to a
    # positive scale of the gradient but for its epsilon, so a tolerance this tight also
    # sees a gradient scaled by the rank count; a device holding another rank's block,
    # or other data, is off by far more.)
    assert result["max_param_diff"] < 1e-10, result
    assert result["max_loss_diff"] < 1e-10, result
    assert result["test_accuracy"] == result["reference_accuracy"]
    assert result["test_accuracy"] > 0.5  # it learns in 20 steps: chance is 0.1
