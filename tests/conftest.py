import sys
from pathlib import Path

# tests import helpers (mpiutil) from this folder; MPI scripts live in tests/mpi/
sys.path.insert(0, str(Path(__file__).parent))
