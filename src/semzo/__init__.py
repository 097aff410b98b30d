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
