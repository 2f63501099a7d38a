#!/usr/bin/env bash
# GPU check of the CUDA backend: one script, run once on a machine with an NVIDIA GPU.
#   bash tests/gpu/run_on_gpu.sh [OUT_DIR]
# Installs vjpmpi with JAX's pip CUDA plugin into a fresh venv, then on 2 ranks
# sharing the GPU(s): the GPU tests (tests/mpi/test_gpu.py), the whole multi-rank
# suite on the GPU backend, and the GPU benchmark. Logs go to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-${OUT:-/tmp/vjpmpi-gpu}}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
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
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"; (cd tests && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
  echo "exit $? ($name)"; tail -3 "$OUT/$name.log"
}
$V/python -c "import vjpmpi, jax; print(jax.devices(), vjpmpi.cuda_mode())" | tee "$OUT/setup.txt"
run gpu_tests 300 $V/mpiexec -n 2 $V/python -m pytest mpi/test_gpu.py -q -p no:cacheprovider
run gpu_suite 1200 $V/mpiexec -n 2 $V/python -m pytest mpi -q -p no:cacheprovider
run gpu_bench 600 $V/python ../benchmarks/run.py --gpu --out "$OUT/bench"
