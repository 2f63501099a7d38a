"""Every Python example of the README, the docs pages and the public docstrings runs,
at the rank count it is written for: one `mpiexec` per page (or per package's
docstrings) and rank count (tests/_doc_examples.py collects them,
tests/run_doc_examples.py runs them)."""

import json

import pytest

from _doc_examples import Example, all_examples, fenced, groups
from _mpirun import mpirun

EXAMPLES = all_examples()
GROUPS = groups(EXAMPLES)
TIMEOUT = 600  # seconds per job: a deadlocked example fails the test, never hangs CI


def run(examples, tmp_path, ranks):
    spec = tmp_path / "examples.json"
    spec.write_text(json.dumps([{"where": e.where, "source": e.source} for e in examples]))
    return mpirun(ranks, ["run_doc_examples.py", str(spec)], TIMEOUT)


@pytest.mark.parametrize("group,ranks", list(GROUPS), ids=[f"{g} @{n}" for g, n in GROUPS])
def test_examples_run(group, ranks, tmp_path):
    examples = GROUPS[group, ranks]
    out = run(examples, tmp_path, ranks)
    assert out.returncode == 0 and f"examples passed: {len(examples)}" in out.output, \
        out.describe()


def test_the_docs_hold_enough_examples():
    on_pages = [e for e in EXAMPLES if not e.group.startswith("docstrings")]
    assert len(on_pages) >= 15, [e.where for e in on_pages]
    assert any(e.ranks != 2 for e in EXAMPLES)  # the rank-count marker is read


def test_a_broken_example_fails_its_job_on_every_rank(tmp_path):
    """An example that raises on one rank only, while the others wait in a collective
    for it, ends the job with its name (no hang); a good one before it still runs."""
    page = (
        "Fine:\n\n```python\nimport vjpmpi\n```\n\n<!-- ranks: 2 -->\n```python\n"
        "import jax.numpy as jnp\nfrom mpi4py import MPI\nimport vjpmpi\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n    assert False, 'planted'\n"
        "vjpmpi.allreduce(jnp.ones(2), MPI.SUM).block_until_ready()\n```\n")
    examples = fenced(page, "planted.md", "planted.md")
    assert [e.where for e in examples] == ["planted.md:3", "planted.md:8"]
    out = run(examples, tmp_path, 2)
    assert out.returncode not in (0, None) and not out.timed_out, out.describe()
    assert "EXAMPLE FAILED on rank 1: planted.md:8" in out.output and "planted" in out.output


def test_an_untagged_fence_is_an_error():
    with pytest.raises(ValueError, match="x.md:2: a fence of language ''"):
        fenced("text\n```\nprint(1)\n```\n", "x.md", "x.md")
    assert fenced("```bash\nls\n```\n", "x.md", "x.md") == []
    assert fenced("<!-- ranks: 4 -->\n```python\nx = 1\n```\n", "x.md", "x.md") == [
        Example("x.md", "x.md:2", 4, "x = 1\n")]
