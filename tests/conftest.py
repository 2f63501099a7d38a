import sys
from pathlib import Path

# The multi-rank suite runs under mpiexec from test_multirank.py, not in this process.
collect_ignore = ["mpi"]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_finish(session):
    """Start the multi-rank jobs that run beside the single-process tests (EARLY_RANKS)."""
    if "test_multirank" in sys.modules:
        sys.modules["test_multirank"].start_early(session)


def pytest_sessionfinish(session):
    if "test_multirank" in sys.modules:
        sys.modules["test_multirank"].stop_early()


def pytest_terminal_summary(terminalreporter):
    """Each multi-rank job's wall time and slowest tests (rank 0's JUnit times)."""
    jobs = getattr(sys.modules.get("test_multirank"), "JOB_TIMES", None)
    if not jobs:
        return
    write = terminalreporter.write_line
    terminalreporter.section("multi-rank jobs: wall time and slowest tests (rank 0)")
    for job in jobs:
        tests = job["tests"]
        write(f"{job['job']}: {job['wall']:.0f} s wall, {len(tests)} tests, "
              f"{sum(t for t, _ in tests):.0f} s in tests")
        for seconds, name in tests[:10]:
            write(f"  {seconds:7.2f} s  {name}")
