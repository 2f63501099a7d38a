"""`examples/train_lm.py --checkpoint`: a run stopped after a checkpoint and resumed at
another number of ranks continues the loss curve of an uninterrupted run. Steps 1-4 at
2 ranks (2 tensor-parallel, the Adam state on one data-parallel rank), saved at step 4;
steps 5-8 resumed at 4 ranks (2 data x 2 tensor parallel, the Adam state sharded over
2): each part's losses equal the one-process run's same steps, and the parameters after
step 8 equal its parameters (float64, 1e-10; Adam's steps are invariant to a scaled
gradient only up to its epsilon, so this also sees a gradient off by a constant)."""

import json

from _mpirun import ROOT, mpirun

EXAMPLE = str(ROOT / "examples" / "train_lm.py")


def run(tmp_path, nprocs, name, *extra):
    out = tmp_path / f"{name}.json"
    job = mpirun(nprocs, [EXAMPLE, "--steps", "8", "--out", "", "--json", str(out),
                          "--checkpoint", str(tmp_path / "ck"), *extra], timeout=600,
                 env={"JAX_ENABLE_X64": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"})
    assert not job.timed_out and job.returncode == 0, job.describe()
    return json.loads(out.read_text()), job.output


def test_resumed_at_another_rank_count_continues_the_loss_curve(tmp_path):
    first, _ = run(tmp_path, 2, "first", "--every", "4", "--stop", "4")
    assert (first["tp"], first["dp"]) == (2, 1)
    assert first["max_loss_diff"] < 1e-10 and first["max_param_diff"] < 1e-10, first
    assert (tmp_path / "ck" / "step_4").is_dir()
    second, shown = run(tmp_path, 4, "second", "--every", "100")
    assert "resumed from step 4" in shown, shown[-3000:]
    assert (second["tp"], second["dp"]) == (2, 2)
    assert second["max_loss_diff"] < 1e-10, second  # steps 5-8 against one process's
    assert second["max_param_diff"] < 1e-10, second  # after step 8
    assert abs(second["final_loss"] - second["reference_final_loss"]) < 1e-10
    assert second["first_loss"] < first["first_loss"]  # (step 5's, after 4 steps' learning)
