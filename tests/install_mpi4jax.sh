#!/usr/bin/env bash
# Build mpi4jax from source into a virtual environment (default .venv), against that
# environment's MPI (its mpicc) and JAX: tests/mpi/test_compat.py compares
# vjpmpi.compat.mpi4jax with mpi4jax itself, and the suite's table expects it there.
# mpi4jax's own tests, from the same source, go to $VENV/mpi4jax-tests:
# tests/test_mpi4jax_suite.py runs them on vjpmpi.compat.mpi4jax.
#   bash tests/install_mpi4jax.sh [VENV]        (about a minute and a half)
# mpi4jax's setup.py takes any `nvcc` on PATH for a CUDA toolkit; an empty CUDA_PATH
# keeps the build CPU-only. Without build isolation it builds against the environment's
# own jax, mpi4py and nanobind; without pip's cache no wheel built for another
# environment (its library path baked in) is reused.
set -euo pipefail
VENV=$(cd "${1:-.venv}" && pwd)
"$VENV/bin/pip" install -q nanobind setuptools wheel
no_cuda=$(mktemp -d)
src=$(mktemp -d)
trap 'rmdir "$no_cuda"; rm -rf "$src"' EXIT
"$VENV/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" \
  "mpi4jax==0.9.1.post2"
CUDA_PATH=$no_cuda MPI4JAX_BUILD_MPICC=$VENV/bin/mpicc \
  "$VENV/bin/pip" install -q --no-build-isolation --no-cache-dir "$src"/mpi4jax-*.tar.gz
tar xzf "$src"/mpi4jax-*.tar.gz -C "$src"
rm -rf "$VENV/mpi4jax-tests"
cp -r "$src"/mpi4jax-*/tests "$VENV/mpi4jax-tests"
"$VENV/bin/python" -c "import mpi4jax; print('mpi4jax', mpi4jax.__version__, 'installed')"
echo "mpi4jax's tests in $VENV/mpi4jax-tests"
