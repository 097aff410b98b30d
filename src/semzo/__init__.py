"""semzo: semantic sharding and zeroth-order fine-tuning of transformers over MPI."""

import os as _os

# Two thread pools take turns on the same cores in every stage: OpenBLAS (the GEMMs) and
# numba's OpenMP layer (the fused kernels). By default each keeps spinning after its work
# (OpenBLAS for 2**28 cycles, libgomp for 300,000 spins), and the spinning pool takes the cores
# the other one needs next. The block-streamed ZO step alternates the two 2(L+2) times per step:
# with these defaults its MiniLM step at 2 threads took 384 ms instead of 559 ms (best of 5,
# three alternations each; docs/zo-kernels.md). Both libraries read them when they load, so
# they are set here, before anything imports numpy; a value already in the environment wins.
for _key, _value in (("OPENBLAS_THREAD_TIMEOUT", "4"), ("GOMP_SPINCOUNT", "10000")):
    _os.environ.setdefault(_key, _value)

__version__ = "0.1.0"


def _drop_stale_numba_caches(root: str = _os.path.dirname(__file__)) -> bool:
    """Delete numba's cached machine code of this package (``*.nbi``, ``*.nbc``) when any of
    its Python sources changed since the caches were checked (a stamp of every source's path,
    size and modification time, kept in ``__pycache__/numba-sources.stamp``); True if it did.

    numba keys a cached function on its own file only, while a kernel compiles the njit
    functions it calls from other files into itself: after an edit of ``semzo/rng.py`` or
    ``semzo/zo/zgen.py`` (or an upgrade that changes them but not ``zo/kernels.py``), the
    kernels would keep running the old generator, z would lose its agreement with the GPU's
    and a resumed run its bits (this happened, 2026-11-27: the tests of a changed z generator
    passed on the old code). Covers the caches beside the sources and under ``NUMBA_CACHE_DIR``;
    does nothing where they cannot be written. About 1 ms (os.stat of the ~130 files)."""
    entries = []
    for dirpath, dirnames, filenames in _os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                st = _os.stat(_os.path.join(dirpath, f))
                entries.append(f"{_os.path.relpath(_os.path.join(dirpath, f), root)} "
                               f"{st.st_size} {st.st_mtime_ns}")
    stamp = "\n".join(entries)
    path = _os.path.join(root, "__pycache__", "numba-sources.stamp")
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == stamp:
                return False
    except (OSError, UnicodeDecodeError):
        pass
    tops = [root]
    if _os.environ.get("NUMBA_CACHE_DIR"):
        tops.append(_os.path.join(_os.environ["NUMBA_CACHE_DIR"],
                                  _os.path.abspath(root).lstrip(_os.sep)))
    try:
        for top in tops:
            for dirpath, _, filenames in _os.walk(top):
                for f in filenames:
                    if f.endswith((".nbi", ".nbc")):
                        try:
                            _os.remove(_os.path.join(dirpath, f))
                        except FileNotFoundError:       # another rank was first
                            pass
        _os.makedirs(_os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{_os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(stamp)
        _os.replace(tmp, path)
    except OSError:                                     # a read-only install: numba caches
        return False                                    # elsewhere or not at all
    return True


_drop_stale_numba_caches()
