"""A pytest plugin for mpi4jax's own test suite, run on vjpmpi (tests/test_mpi4jax_suite.py):
`import mpi4jax` gives `vjpmpi.compat.mpi4jax`, and each rank writes the outcome of every
test it ran to `$VJPMPI_SUITE_OUT/rank<r>.json`."""

import json
import os
import sys

import pytest
from mpi4py import MPI

import vjpmpi.compat.mpi4jax

sys.modules["mpi4jax"] = vjpmpi.compat.mpi4jax
_OUTCOMES: dict[str, str] = {}


@pytest.hookimpl
def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        # (a failed setup or teardown counts as the test's outcome)
        if report.nodeid not in _OUTCOMES or report.outcome == "failed":
            _OUTCOMES[report.nodeid] = report.outcome


@pytest.hookimpl
def pytest_sessionfinish(session):
    out = os.environ.get("VJPMPI_SUITE_OUT")
    if out:
        with open(os.path.join(out, f"rank{MPI.COMM_WORLD.rank}.json"), "w") as fh:
            json.dump(_OUTCOMES, fh, indent=1, sort_keys=True)
