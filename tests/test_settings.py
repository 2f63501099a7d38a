"""The environment's settings, read at import (docs/guides/troubleshooting.md,
"Environment variables"): on and off spelled alike for every variable that takes them,
an invalid value a ValueError on every rank naming the variable, the value and the words
it takes; and what `vjpmpi.cuda_mode()` reports for each VJPMPI_CUDA_AWARE setting.

Each job imports vjpmpi under mpiexec at 2 and 3 ranks (the settings do not depend on
the rank, but every rank must read them alike) and prints one line per rank.
"""

import textwrap

import pytest

from _mpirun import mpirun

NPROCS = pytest.mark.parametrize("nprocs", [2, 3])


def run_ranks(tmp_path, nprocs, body, env, check=True):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    run = mpirun(nprocs, [str(script)], timeout=120, env=env)
    assert not check or (run.returncode == 0 and not run.timed_out), run.describe()
    return run


# One bad value per job (the job's ranks each import vjpmpi once), and the text each
# rank's ValueError must hold.
BAD = {
    2: ({"VJPMPI_CHECK": "maybe"}, [
        ("VJPMPI_CHECK='maybe' is not a valid setting: VJPMPI_CHECK takes 1/on/true/yes (on) "
         "or 0/off/false/no (off)")]),
    3: ({"VJPMPI_TRACE": "0.5"}, [
        "VJPMPI_TRACE='0.5' is not a valid setting: VJPMPI_TRACE takes 1/on/true/yes"]),
}


@NPROCS
def test_invalid_setting_is_a_value_error_on_every_rank(tmp_path, nprocs):
    env, texts = BAD[nprocs]
    run = run_ranks(tmp_path, nprocs, """
        import sys
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        try:
            import vjpmpi
            sys.stdout.write(f"rank {rank} imported\\n")
        except ValueError as e:
            sys.stdout.write(f"rank {rank} ValueError: {e}\\n")  # (one write: no interleaving)
    """, env)
    for r in range(nprocs):
        line = [ln for ln in run.output.splitlines() if ln.startswith(f"rank {r} ")]
        assert len(line) == 1 and "ValueError: " in line[0], run.describe()
        for text in texts:
            assert text in line[0], run.describe()


# The words of every variable, each read through the parser the import uses (a fresh
# environment per word), and one setting per job read by the import itself.
WORDS = """
    import os, sys
    from mpi4py import MPI
    import vjpmpi
    from vjpmpi import _kernels as k
    rank = MPI.COMM_WORLD.rank
    sys.stdout.write(f"rank {rank} import: check={k.CHECK} trace={k.trace_enabled()}\\n")
    sys.stdout.flush()

    def read(name, value, fn, *args):
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn(*args)
        except ValueError as e:
            return f"ValueError: {e}"
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved

    bad = []
    def expect(got, want, what):
        if got != want:
            bad.append(f"{what}: {got!r}, not {want!r}")

    for name in ("VJPMPI_CHECK", "VJPMPI_TRACE"):
        for w in ("1", "on", "ON", " true ", "yes", "Yes"):
            expect(read(name, w, k._env_switch, name, False), True, f"{name}={w!r}")
        for w in ("0", "off", "Off", "false", " no "):
            expect(read(name, w, k._env_switch, name, True), False, f"{name}={w!r}")
        for w in ("", "  "):
            expect(read(name, w, k._env_switch, name, False), False, f"{name}={w!r}")
        for w in ("abc", "0.5", "2", "auto", "never"):
            got = read(name, w, k._env_switch, name, False)
            expect(isinstance(got, str) and got.startswith(f"ValueError: {name}={w!r} is not "
                   f"a valid setting: {name} takes 1/on/true/yes (on) or 0/off/false/no (off)"),
                   True, f"{name}={w!r}: {got}")
    cuda = lambda: {True: "1", False: "0", "auto": "auto"}[
        k._env_switch("VJPMPI_CUDA_AWARE", "auto", extra=("auto",))]
    for w, want in (("auto", "auto"), ("AUTO", "auto"), ("", "auto"), ("1", "1"), ("on", "1"),
                    ("true", "1"), ("yes", "1"), ("0", "0"), ("off", "0"), ("false", "0"),
                    ("no", "0")):
        expect(read("VJPMPI_CUDA_AWARE", w, cuda), want, f"VJPMPI_CUDA_AWARE={w!r}")
    expect(read("VJPMPI_CUDA_AWARE", "maybe", cuda), "ValueError: VJPMPI_CUDA_AWARE='maybe' "
           "is not a valid setting: VJPMPI_CUDA_AWARE takes auto, 1/on/true/yes (on) or "
           "0/off/false/no (off) (read when vjpmpi is imported)", "VJPMPI_CUDA_AWARE=maybe")
    # the numbers: one error format, naming the variable and what it takes
    for name, fn, w, want in (
            ("VJPMPI_TIMEOUT", k._env_timeout, "inf", float("inf")),
            ("VJPMPI_TIMEOUT", k._env_timeout, " 2.5 ", 2.5),
            ("VJPMPI_TIMEOUT", k._env_timeout, "", 0.0),
            ("VJPMPI_WARN_AFTER", k._env_warn_after, "Off", 0.0),
            ("VJPMPI_WARN_AFTER", k._env_warn_after, "never", 0.0),
            ("VJPMPI_WARN_AFTER", k._env_warn_after, "0", 0.0),
            ("VJPMPI_WARN_AFTER", k._env_warn_after, "", 60.0),
            ("VJPMPI_ASYNC_BYTES", k._env_async_bytes, "4096", 4096),
            ("VJPMPI_ASYNC_BYTES", k._env_async_bytes, "OFF", None),
            ("VJPMPI_ASYNC_BYTES", k._env_async_bytes, "auto", "auto"),
            ("VJPMPI_ASYNC_BYTES", k._env_async_bytes, "", "auto")):
        expect(read(name, w, fn), want, f"{name}={w!r}")
    for name, fn, w, takes in (
            ("VJPMPI_TIMEOUT", k._env_timeout, "soon", "a number of seconds > 0"),
            ("VJPMPI_TIMEOUT", k._env_timeout, "0", "a number of seconds > 0"),
            ("VJPMPI_TIMEOUT", k._env_timeout, "nan", "a number of seconds > 0"),
            ("VJPMPI_WARN_AFTER", k._env_warn_after, "-1", "a number of seconds >= 0, or off"),
            ("VJPMPI_ASYNC_BYTES", k._env_async_bytes, "1.5", "a number of bytes >= 0, auto")):
        got = read(name, w, fn)
        expect(isinstance(got, str) and got.startswith(
            f"ValueError: {name}={w!r} is not a valid setting: {name} takes {takes}"), True,
            f"{name}={w!r}: {got}")
    sys.stdout.write(f"rank {rank} words: bad={bad}\\n")
"""


# (the job's environment, what the import reads from it)
SET = {2: ({"VJPMPI_CHECK": "off", "VJPMPI_TRACE": "no"}, "check=False trace=False"),
       3: ({"VJPMPI_CHECK": " True ", "VJPMPI_TRACE": "false"}, "check=True trace=False")}


@NPROCS
def test_on_and_off_are_spelled_alike_for_every_variable(tmp_path, nprocs):
    env, want = SET[nprocs]
    run = run_ranks(tmp_path, nprocs, WORDS, env, check=False)
    for r in range(nprocs):  # (what the import read, then every word through its parser)
        assert f"rank {r} import: {want}\n" in run.output, run.describe()
    assert run.returncode == 0 and not run.timed_out, run.describe()
    for r in range(nprocs):
        assert f"rank {r} words: bad=[]\n" in run.output, run.describe()


def test_cuda_mode_says_what_the_gpu_collectives_do(tmp_path):
    """`cuda_mode()` under each VJPMPI_CUDA_AWARE setting and each answer of MPI's CUDA
    query (1 yes, 0 no, -1 no query), with the CUDA backend replaced by a stand-in that
    answers the query and reports the mode as csrc/cuda_module.cc does (host-staged
    where VJPMPI_CUDA_AWARE=1 is refused): "refused" where every GPU collective fails."""
    run = run_ranks(tmp_path, 1, """
        import types
        import vjpmpi
        from vjpmpi import _kernels as k
        assert vjpmpi.cuda_mode() in (None, "host-staged", "cuda-aware")
        rows = []
        for setting in ("auto", "0", "1"):
            for aware in (1, 0, -1):
                staged = setting == "0" or aware != 1
                k.cuda = types.SimpleNamespace(
                    cuda_aware_query=lambda a=aware: a,
                    cuda_mode=lambda s=staged: "host-staged" if s else "cuda-aware")
                k.CUDA_AWARE = setting
                rows.append(f"{setting}/{aware}={vjpmpi.cuda_mode()}")
        print("modes", " ".join(rows), flush=True)
    """, {})
    assert ("modes auto/1=cuda-aware auto/0=host-staged auto/-1=host-staged 0/1=host-staged "
            "0/0=host-staged 0/-1=host-staged 1/1=cuda-aware 1/0=refused 1/-1=refused"
            in run.output), run.describe()
