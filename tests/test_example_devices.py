"""The main example with a rank per device equals its run with a rank per process:
`train_digits.py --devices-per-process 2` on 2 processes (4 ranks: 2 x 2 CPU devices, the
flag set by the example itself before JAX starts) against the example on 4 processes, in
float32, a few training steps: the same accuracy and the same parameters."""

import numpy as np

from _mpirun import ROOT, mpirun

EXAMPLE = str(ROOT / "examples" / "train_digits.py")
STEPS = "10"


def run_example(tmp_path, nprocs, name, *extra):
    out = tmp_path / f"{name}.npz"
    # (more ranks than CI's 2 cores: MPICH's waits sleep, as in test_multirank's jobs)
    run = mpirun(nprocs, [EXAMPLE, "--steps", STEPS, "--out", "", "--save", str(out), *extra],
                 timeout=600, env={"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"})
    assert not run.timed_out and run.returncode == 0, run.describe()
    return np.load(out), run.output


def test_two_processes_of_two_devices_equal_four_processes(tmp_path):
    devices, shown = run_example(tmp_path, 2, "devices", "--devices-per-process", "2")
    processes, _ = run_example(tmp_path, 4, "processes")
    assert "on 4 ranks (2 processes x 2 devices)" in shown, shown[-3000:]
    assert sorted(devices.files) == sorted(processes.files)
    params = [k for k in devices.files if k.startswith("param")]
    assert len(params) == 4 and all(devices[k].dtype == np.float32 for k in params)
    assert devices["losses"].shape == (int(STEPS),)
    assert float(devices["test_accuracy"]) == float(processes["test_accuracy"])
    for k in devices.files:
        assert devices[k].dtype == processes[k].dtype and devices[k].shape == processes[k].shape
        np.testing.assert_allclose(devices[k], processes[k], rtol=0, atol=1e-6, err_msg=k)
