import semzo  # noqa: F401, I001  (first: the thread-pool defaults every semzo process gets,
# src/semzo/__init__.py, so that this process runs as `python -m semzo` does)
import sys
from pathlib import Path

import pytest

# tests import helpers (mpiutil) from this folder; MPI scripts live in tests/mpi/
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_thread():
    """One thread for BLAS (and torch, when loaded) for a module's tests: the suite shares 2
    cores with MPI tests, and on an oversubscribed machine a woken BLAS helper thread can wait
    a whole time slice per GEMM. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from threadpoolctl import threadpool_limits

    torch = sys.modules.get("torch")
    old = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    if torch is not None:
        torch.set_num_threads(old)
