"""semzo drops numba's cached kernels when any of its sources changed (numba itself only
looks at the file a cached function is defined in, not at the njit functions it compiled in
from other files)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import semzo


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_caches_are_dropped_exactly_when_a_source_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    _write(tmp_path / "a.py", "x = 1\n")
    _write(tmp_path / "sub" / "b.py", "y = 2\n")
    old = [tmp_path / "__pycache__" / "a.f-1.py311.nbi",
           tmp_path / "sub" / "__pycache__" / "b.g-3.py311.1.nbc"]
    for p in old:
        _write(p, "stale")
    keep = tmp_path / "sub" / "__pycache__" / "b.cpython-311.pyc"
    _write(keep, "bytecode")
    assert semzo._drop_stale_numba_caches(str(tmp_path)) is True      # no stamp yet
    assert not any(p.exists() for p in old) and keep.exists()
    assert (tmp_path / "__pycache__" / "numba-sources.stamp").exists()
    fresh = tmp_path / "sub" / "__pycache__" / "b.g-3.py311.nbi"
    _write(fresh, "fresh")
    assert semzo._drop_stale_numba_caches(str(tmp_path)) is False     # nothing changed
    assert fresh.exists()
    _write(tmp_path / "sub" / "b.py", "y = 20\n")                     # an edited source
    assert semzo._drop_stale_numba_caches(str(tmp_path)) is True
    assert not fresh.exists() and keep.exists()
    _write(tmp_path / "c.py", "")                                     # a new source
    _write(fresh, "fresh")
    assert semzo._drop_stale_numba_caches(str(tmp_path)) is True
    assert not fresh.exists()


def test_caches_under_numba_cache_dir_are_dropped_too(tmp_path, monkeypatch):
    pkg, cache = tmp_path / "pkg", tmp_path / "cache"
    _write(pkg / "a.py", "x = 1\n")
    mirrored = cache / os.path.abspath(pkg).lstrip(os.sep) / "a.f-1.py311.nbi"
    other = cache / "elsewhere" / "z.h-1.py311.nbi"
    _write(mirrored, "stale")
    _write(other, "not ours")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    assert semzo._drop_stale_numba_caches(str(pkg)) is True
    assert not mirrored.exists() and other.exists()


def test_a_kernel_sees_the_edit_of_a_function_it_calls_from_another_file(tmp_path):
    """The failure the guard prevents, with numba itself: g (cached, in g.py) calls f (f.py);
    f is edited; g's cache alone would still return the old f's value."""
    pkg = tmp_path / "pkg"
    _write(pkg / "__init__.py", "")
    _write(pkg / "f.py", """
        from numba import njit

        @njit(cache=True)
        def f(x):
            return x + 1
        """)
    _write(pkg / "g.py", """
        from numba import njit
        from pkg.f import f

        @njit(cache=True)
        def g(x):
            return f(x) * 10
        """)
    run = ("import sys, semzo; guard = sys.argv[1] == '1'\n"
           "if guard: semzo._drop_stale_numba_caches(sys.argv[2])\n"
           "from pkg.g import g; print(g(1))")

    def value(guard: bool) -> int:
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}"}
        env.pop("NUMBA_CACHE_DIR", None)
        r = subprocess.run([sys.executable, "-c", run, "1" if guard else "0", str(pkg)],
                           capture_output=True, text=True, env=env, timeout=300, check=True)
        return int(r.stdout.split()[-1])

    assert value(False) == 20
    _write(pkg / "f.py", """
        from numba import njit

        @njit(cache=True)
        def f(x):
            return x + 2
        """)
    assert value(False) == 20                  # numba alone: g's stale machine code
    assert value(True) == 30                   # the guard drops it: g recompiled
