"""Smoke run of the benchmark suite (tiny sizes): every figure is produced, none is judged."""

import json
import math
import subprocess
import sys

from _mpirun import ROOT


def numbers(tree, path=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


DEVICE_TIMES = ("psum", "allreduce", "ranks_4x1", "gloo", "sharded", "one_device",
                "eager_sharded", "eager_one_device", "psum_vs_4x1", "allreduce_vs_4x1",
                "psum_vs_gloo", "allreduce_vs_gloo", "sharded_vs_one", "eager_sharded_vs_one")


def check_devices(dev, why):
    """The devices part at its two smallest sizes: 2 processes x 2 devices, 4 x 1, and
    gloo's psum at 2 x 2, every figure timed, vjpmpi's sums exact and gloo's checked."""
    assert dev is not None, why
    assert (dev["procs"], dev["devices"], dev["ranks_procs"]) == (2, 2, 4)
    assert dev["gloo_why"] is None and dev["gloo_collectives"] == "gloo"
    assert [r["bytes"] for r in dev["rows"]] == [4096, 16384]
    for r in dev["rows"]:
        assert r["right"] and r["right_sharded"], r
        assert isinstance(r["gloo_right"], bool), r  # (recorded, not judged: gloo's values)
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in DEVICE_TIMES), r


def test_benchmark_suite_smoke(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    res = json.loads((tmp_path / "results.json").read_text())
    main, gloo = res["main"], res["gloo"]
    assert gloo is not None, res["gloo_why"]
    assert main["mpi4jax"] is not None or main["mpi4jax_why"]
    for part in (main, gloo):
        for path, value in numbers(part):
            # (`agreement.window` is a difference of two timings, a first run's less the
            # next one's, and a pipeline's measured `*_bubble` is 1 - alone / pipelined:
            # on a busy machine's tiny runs either can come out below zero)
            assert math.isfinite(value) and (value >= 0 or path.endswith((".window", "_bubble"))), (
                path, value)
    # every latency size, every bandwidth op, every backward op was timed
    assert [r["elements"] for r in main["latency"]] == [1, 16, 256]
    assert {r["op"] for r in main["bandwidth"]} == {"allreduce", "bcast", "allgather", "alltoall"}
    assert len(main["backward"]) == 6 and all(r["fwd"] > 0 and r["vg"] > 0
                                              for r in main["backward"])
    assert all(r["floor"] > 0 and r["vjpmpi"] > 0 for r in main["bandwidth"])
    net = main["net"]
    assert net is not None, main["net_why"]
    assert [r["elements"] for r in net["latency"]] == [1, 16, 256]
    assert {r["op"] for r in net["bandwidth"]} == {"allreduce", "bcast"}
    assert net["env"] and all(r["vjpmpi"] > 0 and r["floor"] > 0 for r in net["bandwidth"])
    # the nonlinear derivatives and their memory at 2 ranks (--quick: fewer counts)
    assert [p["ranks"] for p in main["nonlinear"]] == [2], main["nonlinear"]
    for part in main["nonlinear"]:
        assert [r["op"] for r in part["rows"]] == ["allreduce MAX", "allreduce PROD"]
        assert all(r["fwd"] > 0 and r["vg"] > 0 and r["mpi_adj"] > 0 for r in part["rows"])
    # vjpmpi.fft at 1 and 2 ranks (mpi4py-fft where installed; jnp.fft alone at 1)
    assert [p["ranks"] for p in main["fft"]] == [1, 2], main["fft"]
    for part in main["fft"]:
        timed = [r for r in part["rows"] if "kind" in r and r["kind"] in ("slab", "pencil")]
        assert [r["kind"] for r in timed] == ["slab", "pencil"], part
        assert all(r["fwd"] > 0 and r["vg"] > 0 for r in timed), part
        assert all(r["mpi4py_fft"] is not None for r in timed) or part["mpi4py_fft_why"]
    assert any(r.get("single_jnp", 0) > 0 for r in main["fft"][0]["rows"])
    mem = main["memory"]
    assert mem is not None and mem["ranks"] == 2, main["memory_why"]
    assert all(r["fwd_xla"] > 0 and r["vg_xla"] > 0 for r in mem["rows"])
    # the overlap part (shared memory in the smoke run) and the asynchronous calls' cost
    ovl, asy = main["overlap"], main["async"]
    assert ovl is not None, main["overlap_why"]
    assert all(ovl["mlp"][k] > 0 for k in ("compute", "forward", "after", "overlapped",
                                           "allreduce", "zero_after", "zero_overlapped"))
    assert [h["rows"] for h in ovl["halo"]] == [8, 8]
    assert all(h[k] > 0 for h in ovl["halo"] for k in ("compute", "after", "overlapped"))
    hx = ovl["halo_exchanges"]
    assert all(hx[k] > 0 for k in ("vjpmpi", "sync", "mpi4py"))
    assert all(hx[k] > 0 and 0 <= hx[k + "_slower"] <= hx["reps"] for k in (
        "vjpmpi_vs_mpi4py", "sync_vs_mpi4py", "call_vjpmpi_vs_mpi4py", "call_sync_vs_mpi4py"))
    assert asy is not None, main["async_why"]
    assert [r["bytes"] for r in asy["rows"]] == [64, 1 << 16]
    assert all(r[k] > 0 for r in asy["rows"] for k in ("sync", "default", "64k", "async"))
    # the pipeline's bubble at 2 stages, measured, and the tables' at 2-8 stages
    pipe = main["pipeline"]
    assert pipe is not None and pipe["ranks"] == 2, main["pipeline_why"]
    assert [r["micro"] for r in pipe["measured"]] == [1, 2, 4]
    assert all(r[k] > 0 for r in pipe["measured"] for k in ("alone", "gpipe", "1f1b"))
    assert [(t["stages"], t["micro"]) for t in pipe["tables"]] == [
        (2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32)]
    # the watchdog's default and the point-to-point check, each on and off in turn
    assert set(main["watchdog"]) == {"call_on", "call_off", "fori_on", "fori_off",
                                     "ring_check_off", "ring_check_on"}
    assert all(v > 0 for v in main["watchdog"].values())
    # the ragged exchange against mpi4py's Alltoallv (uniform and skewed), the MoE step
    rag = main["ragged"]
    assert rag is not None and rag["ranks"] == 2, main["ragged_why"]
    assert [(r["bytes"], r["skew"]) for r in rag["rows"]] == [
        (b, s) for b in (1 << 10, 1 << 20) for s in ("uniform", "skewed")]
    assert all(r[k] > 0 for r in rag["rows"] for k in ("vjpmpi", "alltoallv", "with_counts"))
    assert rag["moe"]["ep"] > 0 and rag["moe"]["all_experts"] > 0
    # many devices per process (2 x 2, 4 x 1, gloo at 2 x 2), its two smallest sizes
    check_devices(main["devices"], main["devices_why"])
    text = (tmp_path / "results.md").read_text()
    assert "## Many devices per process" in text
    assert "## Variable-size exchange: ragged_alltoall against mpi4py's Alltoallv" in text
    assert "## Cost of the watchdog's default, and of the point-to-point check" in text
    assert "## Nonlinear derivatives" in text and "## Peak memory" in text
    assert "## Distributed FFT" in text
    assert "## Network path: shared memory off" in text
    assert "## Overlap: communication while XLA computes" in text
    assert "## Pipeline parallelism: the bubble" in text
    assert "## Targets:" in text and "| target | measured | met |" in text
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_parity_targets_need_every_later_round_to_say_slower():
    """run.py's parity judgement: a size is slower where one round's sign test says so
    (12+ of 15) and so does every later round the part timed (a second round in the same
    job, a round in a job of its own); an unconfirmed size is named with every round's
    figures, a confirmed one fails the target, and rows without later rounds (an older
    run's results) keep the one-round rule."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run import at_or_under, confirmed, slower_limit
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert slower_limit(15) == 12 and slower_limit(2) == 3

    def row(nbytes, ratio, slower, again=None, fresh=None):
        r = {"bytes": nbytes, "r": ratio, "r_slower": slower}
        if again is not None:
            r["r_again"], r["r_slower_again"] = again
        if fresh is not None:
            r["r_fresh"], r["r_slower_fresh"] = fresh
        return r

    fine = [row(4096, 0.97, 6), row(1 << 20, 1.01, 9)]
    text, met = at_or_under(fine, "r", 15)
    assert met and text.startswith("1.01x at worst (1 MiB, longer in 9 of 15")
    # found slower once, not again: met, and the size named with both rounds' figures
    text, met = at_or_under(fine + [row(4 << 20, 1.04, 13, (0.99, 7))], "r", 15)
    assert met and "not slower when timed again: 4 MiB (1.04x, 13 of 15; again: 0.99x, 7 of 15)" in text
    # found slower twice, and no job of its own timed it: missed
    text, met = at_or_under(fine + [row(4 << 20, 1.08, 14, (1.06, 13))], "r", 15)
    assert not met and "slower (longer in 12+ of 15): 4 MiB 1.08x (again: 1.06x, 13 of 15)" in text
    # found slower twice, not in a job of its own: met, every round named
    text, met = at_or_under(fine + [row(4 << 20, 1.08, 14, (1.06, 13), (0.97, 5))], "r", 15)
    assert met and ("not slower when timed again: 4 MiB (1.08x, 14 of 15; again: 1.06x, 13 of "
                    "15; in a job of its own: 0.97x, 5 of 15)") in text
    # slower in all three rounds: missed
    text, met = at_or_under(fine + [row(4 << 20, 1.08, 14, (1.06, 13), (1.05, 12))], "r", 15)
    assert not met and ("4 MiB 1.08x (again: 1.06x, 13 of 15; in a job of its own: 1.05x, "
                        "12 of 15)") in text
    # one round only (no second round recorded): slower at 12 of 15
    text, met = at_or_under(fine + [row(4 << 20, 1.02, 12)], "r", 15)
    assert not met and "slower (longer in 12+ of 15): 4 MiB 1.02x" in text
    # the sizes run_p2p times in a job of their own: both rounds of the job said slower
    r = {"bytes": 1, "a": 1.1, "a_slower": 13, "a_again": 1.1, "a_slower_again": 12,
         "b": 1.1, "b_slower": 13, "b_again": 1.0, "b_slower_again": 11, "c": 1.1, "c_slower": 14}
    assert confirmed(r, 15) == ["a"] and confirmed(r, 2) == []
    # (a comparison no target judges is never timed again)
    r.update(carry_vs_floor=1.4, carry_vs_floor_slower=15, carry_vs_floor_again=1.4,
             carry_vs_floor_slower_again=15)
    assert confirmed(r, 15) == ["a"]
    # too few repetitions for a verdict: the medians
    assert at_or_under([row(4096, 1.01, 2)], "r", 2) == ("1.01x", False)
    assert at_or_under([row(4096, 0.99, 2)], "r", 2) == ("0.99x", True)


def test_the_halo_target_judges_each_steps_exchanges_in_two_rounds():
    """run.py's halo target: the exchanges' marginal cost per step against mpi4py's (what
    a call pays once, JAX's dispatch, cancels out), slower only where a second round says
    so too; the per-call figures are shown, not judged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run import overlap_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    o = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())["main"][
        "overlap"]
    o["halo"] = [{k: v for k, v in h.items() if not k.startswith("halos")} for h in o["halo"]]

    def judge(per_step, slower, again=None, call_slower=15):
        hx = {"cols": 1 << 18, "steps": 4, "halo_bytes": 1 << 20, "reps": 15,
              "vjpmpi": 0.0792, "sync": 0.0792, "mpi4py": 0.0791,
              "vjpmpi_vs_mpi4py": per_step, "vjpmpi_vs_mpi4py_slower": slower,
              "sync_vs_mpi4py": 1.0, "sync_vs_mpi4py_slower": 8,
              "call_vjpmpi_vs_mpi4py": 1.003, "call_vjpmpi_vs_mpi4py_slower": call_slower,
              "call_sync_vs_mpi4py": 1.003, "call_sync_vs_mpi4py_slower": call_slower}
        if again is not None:
            hx["vjpmpi_vs_mpi4py_again"], hx["vjpmpi_vs_mpi4py_slower_again"] = again
        checks = []
        text = overlap_report({**o, "halo_exchanges": hx}, None, None, "not run",
                              lambda name, value, ok: checks.append((name, value, ok)))
        (found,) = [c for c in checks if c[0].startswith("halo exchanges")]
        assert "| 1 MiB rows |" in "\n".join(text)
        return found[1], found[2]

    # every call longer (its dispatch), each step not: met
    value, met = judge(0.9995, 7)
    assert met and value.startswith("1.00x at worst (1 MiB, longer in 7 of 15")
    # each step longer in 13 of 15, not again: met, both rounds named
    value, met = judge(1.0008, 13, (0.9993, 6))
    assert met and "not slower when timed again: 1 MiB (1.00x, 13 of 15; again: 1.00x, 6 of 15)" in value
    # longer in both rounds: missed
    value, met = judge(1.0008, 13, (1.0006, 12))
    assert not met and "slower (longer in 12+ of 15): 1 MiB" in value
