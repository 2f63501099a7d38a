import sys
from pathlib import Path

# The multi-rank suite runs under mpiexec from test_multirank.py, not in this process.
collect_ignore = ["mpi"]
sys.path.insert(0, str(Path(__file__).resolve().parent))
