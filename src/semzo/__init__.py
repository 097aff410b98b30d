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


def _zen4(cpuinfo: str | None = None) -> bool:
    """AMD Zen 4 (family 0x19 with AVX-512): its AVX-512 runs as two 256-bit halves, and
    OpenBLAS's AVX2 kernels ("Zen", the Haswell ones) beat the AVX-512 ("SkylakeX") kernels that
    OpenBLAS picks for it: float32 GEMMs of the shapes of a MiniLM layer ran 5-8 % faster at one
    and two threads, a 16 x 64 MiniLM forward 124-125 -> 119-122 ms (docs/guide.md, "BLAS kernels").
    Zen 3 has no AVX-512 (OpenBLAS already picks Zen) and Zen 5 (family 0x1a) runs AVX-512 at
    full width: both keep OpenBLAS's choice. ``cpuinfo``: the text of /proc/cpuinfo (read when
    None; Linux only, False elsewhere)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read(1 << 14)
        except OSError:
            return False
    info = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, _, val = line.partition(":")
        info[key.strip()] = val.strip()
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


# OpenBLAS reads OPENBLAS_CORETYPE when numpy loads it: only then, and only if unset.
if "OPENBLAS_CORETYPE" not in _os.environ and _zen4():
    _os.environ["OPENBLAS_CORETYPE"] = "Zen"

__version__ = "0.1.0"
