"""The process-wide defaults ``import semzo`` sets before numpy loads: thread-pool spin limits
and, on AMD Zen 4, OpenBLAS's AVX2 kernels (src/semzo/__init__.py, docs/guide.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import semzo

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9454 48-Core Processor
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl

processor\t: 1
vendor_id\t: AuthenticAMD
"""


def test_only_zen4_gets_the_avx2_kernels():
    assert semzo._zen4(ZEN4)
    zen3 = ZEN4.replace(" avx512f avx512dq avx512bw avx512vl", "")
    zen5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26")
    intel = ZEN4.replace("AuthenticAMD", "GenuineIntel").replace("family\t: 25", "family\t: 6")
    for text in (zen3, zen5, intel, "", "garbage without colons\n\n"):
        assert not semzo._zen4(text)
    # only the first processor's block is read
    assert not semzo._zen4("processor\t: 0\n\n" + ZEN4)


def _env_after_import(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT")}
    env.update(extra)
    code = ("import os, semzo, numpy, threadpoolctl\n"
            "arch = [i.get('architecture') for i in threadpoolctl.threadpool_info()"
            " if i.get('internal_api') == 'openblas']\n"
            "for k in ('OPENBLAS_CORETYPE', 'OPENBLAS_THREAD_TIMEOUT', 'GOMP_SPINCOUNT'):\n"
            "    print(k, os.environ.get(k, '-'))\n"
            "print('ARCH', arch[0] if arch else '-')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def test_defaults_are_set_before_numpy_loads():
    got = _env_after_import({})
    assert got["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert got["GOMP_SPINCOUNT"] == "10000"
    if semzo._zen4():
        assert got["OPENBLAS_CORETYPE"] == "Zen"
        assert got["ARCH"] in ("Zen", "Haswell"), got      # OpenBLAS took it at load
    else:
        assert got["OPENBLAS_CORETYPE"] == "-"


def test_a_value_in_the_environment_wins():
    got = _env_after_import({"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_THREAD_TIMEOUT": "7",
                             "GOMP_SPINCOUNT": "123"})
    assert got["OPENBLAS_CORETYPE"] == "Sandybridge"
    assert got["OPENBLAS_THREAD_TIMEOUT"] == "7"
    assert got["GOMP_SPINCOUNT"] == "123"
    assert got["ARCH"] in ("Sandybridge", "-"), got
