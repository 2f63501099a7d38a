"""Smoke test of examples/transpose_cg.py: exact transpose, distributed CG, implicit gradient."""

import sys
from pathlib import Path

import pytest

from helpers import WORLD

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import transpose_cg  # noqa: E402

N = 24  # divisible by 1, 2, 3 and 4 ranks


@pytest.fixture(scope="module")
def results():
    return transpose_cg.main(N)


def test_transpose_is_exact(results):
    assert results["dot_rel_diff"] < 1e-12, results
    assert results["matvec_max_err"] < 1e-12, results
    assert results["transpose_max_err"] < 1e-12, results


def test_cg_solves_the_normal_equations(results):
    assert results["cg_rel_error"] < 1e-9, results
    assert results["cg_replicated_rel_error"] < 1e-9, results
    assert 0 < results["cg_iterations"] <= 1000, results


def test_gradient_through_the_solve(results):
    assert results["grad_rel_error"] < 1e-8, results
    assert results["grad_replicated_rel_error"] < 1e-8, results


def test_results_agree_across_ranks(results):
    assert WORLD.allgather(results) == [results] * WORLD.size
