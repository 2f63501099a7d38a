#!/usr/bin/env bash
# GPU check of the CUDA backend: one script, run once on a machine with an NVIDIA GPU.
#   bash tests/gpu/run_on_gpu.sh [OUT_DIR]
# Installs vjpmpi with JAX's pip CUDA plugin into a fresh venv, then on 2 ranks
# sharing the GPU(s): the GPU tests (tests/mpi/test_gpu.py), the whole multi-rank
# suite on the GPU backend, and the GPU benchmark. Writes to OUT_DIR:
#   summary.txt                 one line per step and per-rank pass/fail/skip counts
#   <step>.log                  each step's output
#   <step>.rank<R>.xml          per-test results of each rank (JUnit XML); the suite
#                               runs one step per test file (suite_<file>)
#   bench/results.md            the GPU benchmark tables
# Exits non-zero when a step fails, or when every GPU test skipped (no GPU seen).
# VJPMPI_GPU_VENV=<venv> reuses an existing environment instead of installing one;
# GPU_JAX_PLATFORMS overrides JAX_PLATFORMS (default cuda,cpu) for a dry run;
# GPU_SUITE (test files, default: every tests/mpi/test_*.py), GPU_SUITE_TIMEOUT (per
# file, default 900 s) and GPU_BENCH=0 (skip the benchmark) size the run to the time a
# borrowed machine has. With a JAX outside vjpmpi's tested
# range the import warning is recorded in setup.log and does not fail the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="$(mkdir -p "${1:-${OUT:-/tmp/vjpmpi-gpu}}" && cd "${1:-${OUT:-/tmp/vjpmpi-gpu}}" && pwd)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ -n "${VJPMPI_GPU_VENV:-}" ]; then
  V="$(cd "$VJPMPI_GPU_VENV" && pwd)/bin"
else
  python3 -m venv /tmp/vjpmpi-gpu-venv
  V=/tmp/vjpmpi-gpu-venv/bin
  $V/pip install -q --upgrade pip
  # A wheel built beforehand (dist/*.whl) is used as is; otherwise build here
  # (needs the CUDA headers and static runtime, e.g. /usr/local/cuda).
  WHEEL=$(ls dist/vjpmpi-*.whl 2>/dev/null | head -1)
  $V/pip install -q "jax[cuda13]" 2>&1 | tail -2
  if [ -n "$WHEEL" ]; then
    $V/pip install -q "$WHEEL[mpich,test]" 2>&1 | tail -2
  else
    VJPMPI_CUDA=1 $V/pip install -q ".[mpich,test]" 2>&1 | tail -2
  fi
fi
export JAX_PLATFORMS="${GPU_JAX_PLATFORMS:-cuda,cpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
# VJPMPI_TRACE: the tests that compare every rank's sequence of collectives run too
export PYTHONUNBUFFERED=1 VJPMPI_TRACE=1 OUT
: > "$OUT/summary.txt"
status=0

step() {  # name, timeout, command...: run in tests/, log, record the exit code
  local name=$1 limit=$2; shift 2
  echo "== $name"
  (cd tests && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

# each rank writes its own JUnit file (PMI_RANK: MPICH, OMPI_COMM_WORLD_RANK: Open MPI)
pytest_ranks() {  # name, pytest arguments...
  local name=$1; shift
  echo "exec $V/python -m pytest $* -q -rA -p no:cacheprovider" \
    "-W 'ignore:vjpmpi is tested with JAX'" \
    "--junitxml=\"\$OUT/$name.rank\${PMI_RANK:-\${OMPI_COMM_WORLD_RANK:-0}}.xml\""
}

step setup 300 $V/python -c "import vjpmpi, jax, jaxlib, mpi4py; print('jax', jax.__version__,
  'jaxlib', jaxlib.__version__, 'mpi4py', mpi4py.__version__, jax.devices(), vjpmpi.cuda_mode())"
cp "$OUT/setup.log" "$OUT/setup.txt"
step gpu_tests 300 $V/mpiexec -n 2 bash -c "$(pytest_ranks gpu_tests mpi/test_gpu.py)"
[ "${GPU_BENCH:-1}" = 0 ] || step gpu_bench 900 $V/python ../benchmarks/run.py --gpu-only --out "$OUT/bench"
# the suite one file per job: a failing test ends its job (every rank aborts), not the run
for f in ${GPU_SUITE:-$(cd tests && ls mpi/test_*.py)}; do
  name="suite_$(basename "$f" .py)"
  step "$name" "${GPU_SUITE_TIMEOUT:-900}" $V/mpiexec -n 2 bash -c "$(pytest_ranks "$name" "$f")"
done

# per-rank counts, and the rule that a run where every GPU test skipped is a failure
$V/python - "$OUT" <<'EOF' || status=1
import glob, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
gpu_passed = None
with open(f"{out}/summary.txt", "a") as summary:
    for path in sorted(glob.glob(f"{out}/*.rank*.xml")):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed = n - f - e - s
        name = path.rsplit("/", 1)[1][:-4]
        summary.write(f"{name}: {passed} passed, {f} failed, {e} errors, {s} skipped\n")
        for case in suite.iter("testcase"):
            result = ("failed" if case.find("failure") is not None or case.find("error") is not None
                      else "skipped" if case.find("skipped") is not None else "passed")
            summary.write(f"  {case.get('classname')}::{case.get('name')} {result}\n")
        if name.startswith("gpu_tests."):
            gpu_passed = max(gpu_passed or 0, passed)
    if not gpu_passed:
        summary.write("FAILED: no GPU test passed (all skipped, or none ran): no GPU was used\n")
        sys.exit(1)
EOF
cat "$OUT/summary.txt" | grep -v "^  "
exit $status
