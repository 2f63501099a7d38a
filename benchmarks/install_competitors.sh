#!/usr/bin/env bash
# The competitors `benchmarks/run.py` measures that are not vjpmpi's dependencies,
# installed into a virtual environment (default .venv), so that every target is judged:
#   mpi4jax     built from PyPI against the environment's MPI and JAX
#               (tests/install_mpi4jax.sh, as CI does);
#   mpi4py-fft  from PyPI, built against FFTW 3 (Debian's libfftw3-dev, installed here
#               when the headers are missing and this runs as root) and the
#               environment's mpi4py.
#   bash benchmarks/install_competitors.sh [VENV]        (about two minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(cd "${1:-.venv}" && pwd)
bash tests/install_mpi4jax.sh "$VENV"
if [[ ! -e /usr/include/fftw3.h ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get > /dev/null; then
    apt-get install -y -q libfftw3-dev
  else
    echo "mpi4py-fft needs FFTW 3's headers and libraries (Debian: libfftw3-dev)" >&2
    exit 1
  fi
fi
"$VENV/bin/pip" install -q cython setuptools numpy
# Without build isolation: built against the environment's own mpi4py and NumPy.
"$VENV/bin/pip" install -q --no-build-isolation mpi4py-fft
"$VENV/bin/python" -c "import mpi4py_fft; print('mpi4py-fft', mpi4py_fft.__version__, 'installed')"
