"""Every Python example of the README, the docs pages and the public docstrings runs,
at the rank count and CPU devices per rank it is written for: one `mpiexec` per page
(or per package's docstrings), rank count and device count (tests/_doc_examples.py
collects them, tests/run_doc_examples.py runs them)."""

import json

import pytest

from _doc_examples import Example, all_examples, fenced, groups
from _mpirun import device_env, mpirun

EXAMPLES = all_examples()
GROUPS = groups(EXAMPLES)
TIMEOUT = 600  # seconds per job: a deadlocked example fails the test, never hangs CI


def run(examples, tmp_path, ranks, devices=1):
    spec = tmp_path / "examples.json"
    spec.write_text(json.dumps([{"where": e.where, "source": e.source} for e in examples]))
    env = device_env(devices) if devices > 1 else None
    return mpirun(ranks, ["run_doc_examples.py", str(spec)], TIMEOUT, env)


def failure_reports(tmp_path) -> str:
    """What the job's failing ranks wrote to their report files (run_doc_examples.py):
    the launcher may drop their printed output when the job aborts, never these."""
    return "".join(f.read_text() for f in sorted(tmp_path.glob("failed-rank*.txt")))


def job_id(group, ranks, devices):
    return f"{group} @{ranks}" + (f"x{devices}dev" if devices > 1 else "")


@pytest.mark.parametrize("group,ranks,devices", list(GROUPS),
                         ids=[job_id(*key) for key in GROUPS])
def test_examples_run(group, ranks, devices, tmp_path):
    examples = GROUPS[group, ranks, devices]
    out = run(examples, tmp_path, ranks, devices)
    assert out.returncode == 0 and f"examples passed: {len(examples)}" in out.output, \
        out.describe()


def test_the_docs_hold_enough_examples():
    on_pages = [e for e in EXAMPLES if not e.group.startswith("docstrings")]
    assert len(on_pages) >= 15, [e.where for e in on_pages]
    assert any(e.ranks != 2 for e in EXAMPLES)  # the rank-count marker is read
    assert any(e.devices > 1 for e in EXAMPLES)  # and the devices marker


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
    reports = failure_reports(tmp_path)
    assert reports.startswith("EXAMPLE FAILED on rank 1: planted.md:8"), out.describe()
    assert "AssertionError: planted" in reports and "rank 0" not in reports


def test_a_broken_devices_example_fails_its_job(tmp_path):
    """A `<!-- devices: 2 -->` example runs in a job whose ranks have 2 CPU devices each
    (a good one sees them), and one that fails there (a wrong value from a device
    communicator on one device of one rank) ends the job with its name."""
    page = (
        "<!-- ranks: 2, devices: 2 -->\n```python\nimport jax\n"
        "assert len(jax.local_devices()) == 2\n```\n\n<!-- devices: 2 -->\n```python\n"
        "import jax, jax.numpy as jnp, numpy as np\nfrom jax.sharding import Mesh, "
        "PartitionSpec as P\nfrom mpi4py import MPI\nimport vjpmpi\n"
        "mesh = Mesh(np.array(jax.local_devices()), ('d',))\n"
        "def body(x):\n    c = vjpmpi.device_comm('d')\n"
        "    return vjpmpi.allreduce(x, MPI.SUM, comm=c) + (c.rank == 3)\n"
        "y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('d'), out_specs=P('d')))(jnp.ones(2))\n"
        "assert (np.asarray(y) == 4).all(), 'planted on devices'\n```\n")
    examples = fenced(page, "planted.md", "planted.md")
    assert [(e.where, e.ranks, e.devices) for e in examples] == [
        ("planted.md:2", 2, 2), ("planted.md:8", 2, 2)]
    out = run(examples, tmp_path, 2, 2)
    assert out.returncode not in (0, None) and not out.timed_out, out.describe()
    reports = failure_reports(tmp_path)
    assert reports.startswith("EXAMPLE FAILED on rank 1: planted.md:8"), out.describe()
    # (not "examples passed" absent from the output: MPICH's MPI_Abort sometimes lets the
    # other ranks' MPI_Barrier return before the job is killed, plain mpi4py too, so rank 0
    # may print it; the exit code is what says the job failed)
    assert "planted on devices" in reports and "rank 0" not in reports


def test_an_untagged_fence_is_an_error():
    with pytest.raises(ValueError, match="x.md:2: a fence of language ''"):
        fenced("text\n```\nprint(1)\n```\n", "x.md", "x.md")
    assert fenced("```bash\nls\n```\n", "x.md", "x.md") == []
    assert fenced("<!-- ranks: 4 -->\n```python\nx = 1\n```\n", "x.md", "x.md") == [
        Example("x.md", "x.md:2", 4, "x = 1\n")]
    # a block that only includes a script (pymdownx.snippets) is not an example: the
    # script's smoke test runs it; a line of code beside the include makes it one
    assert fenced('```python\n--8<-- "examples/moe.py"\n```\n', "x.md", "x.md") == []
    assert len(fenced('```python\n--8<-- "examples/moe.py"\nx = 1\n```\n', "x.md", "x.md")) == 1
    with pytest.raises(ValueError, match="a fence of language ''"):
        fenced('```\n--8<-- "examples/moe.py"\n```\n', "x.md", "x.md")


def test_the_layout_annotations():
    def one(note):
        (ex,) = fenced(f"{note}\n```python\nx = 1\n```\n", "x.md", "x.md")
        return ex.ranks, ex.devices

    assert one("") == (2, 1)
    assert one("<!-- ranks: 3 -->") == (3, 1)
    assert one("<!-- devices: 4 -->") == (2, 4)
    assert one("<!-- ranks: 1, devices: 2 -->") == one("<!--devices:2,ranks:1-->") == (1, 2)
    for bad in ("<!-- devices: 2; ranks: 1 -->", "<!-- ranks: 2, ranks: 3 -->",
                "<!-- devices: 0 -->", "<!-- devices -->"):
        with pytest.raises(ValueError, match="annotation"):
            one(bad)
    assert {key: len(v) for key, v in groups([
        Example("p.md", "p.md:1", 2, ""), Example("p.md", "p.md:5", 2, "", 2),
        Example("p.md", "p.md:9", 2, "")]).items()} == {("p.md", 2, 1): 2, ("p.md", 2, 2): 1}
