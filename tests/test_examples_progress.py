"""The examples' progress bar: compiling is its own phase, the rate counts run steps only."""

import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from progress import StepBar  # noqa: E402


def test_the_bar_starts_after_the_compiling_step():
    out = io.StringIO()
    bar = StepBar(total=40, desc="train", file=out)
    bar.set_postfix(loss="1.0")
    time.sleep(1.0)  # the first step: compiling
    bar.update()
    assert "train: compiling the training step" in out.getvalue()
    for _ in range(10):  # the run steps: 20 ms each
        time.sleep(0.02)
        bar.set_postfix(loss="0.5")
        bar.update()
    meter = bar.bar.format_dict
    rate = (meter["n"] - meter["initial"]) / meter["elapsed"]
    bar.close()
    assert meter["n"] == 11 and meter["total"] == 40
    # ~50 steps/s: the compile's second is not in the rate (it would make it ~10/s)
    assert rate > 20, (rate, meter)
    assert "loss=0.5" in out.getvalue()
