"""The CPU's bfloat16 GEMM by AVX512_BF16 dot products (semzo.model.gemm_cpu): exact where
float32 sums are exact, within float32 rounding of the sums otherwise, every tail of the
48 x 8 tile, a column slice written in place, a row's bits independent of the other rows,
matmul_bf16 taking it and falling back where it must, and the switch that keeps float32.

The kernel tests need a CPU with AVX512_BF16 (Intel Cooper Lake / Sapphire Rapids and later,
AMD Zen 4 and later) and skip elsewhere, naming why; the fallback tests run everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from semzo.model import gemm_cpu
from semzo.model.gemm import matmul_bf16
from semzo.model.storage import to_bits, to_float32

needs_dot = pytest.mark.skipif(not gemm_cpu.supported(),
                               reason="this CPU has no AVX512_BF16 (vdpbf16ps)")


def bits(a):
    return to_bits(np.asarray(a, np.float32))


@needs_dot
@pytest.mark.parametrize("m", [1, 15, 16, 47, 48, 49, 64, 80, 100])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 77])
@pytest.mark.parametrize("k", [2, 6, 96])
def test_exact_where_float32_sums_are_exact(m, n, k):
    """Small integers: every product and partial sum is an integer below 2^24, so any order
    of float32 sums gives the exact product; the kernel must give it bit for bit, through
    every tail of its tile (rows past 48: one, two or three groups of 16, full or not;
    weight rows past 8) and the direct stores."""
    r = np.random.default_rng(m * 1000 + n * 10 + k)
    x = r.integers(-8, 9, (m, k))
    w = r.integers(-8, 9, (n, k))
    out = np.full((m, n), np.nan, np.float32)
    assert gemm_cpu.usable(bits(x), bits(w), out, True)
    gemm_cpu.matmul(bits(x), bits(w), out)
    assert np.array_equal(out, (x @ w.T).astype(np.float32))


@needs_dot
@pytest.mark.parametrize("shape", [(130, 576, 70), (49, 1536, 17), (64, 288, 1000)])
def test_within_float32_rounding_of_the_sums(shape):
    """Random values: within K roundings of the float32 accumulator of the float64 product
    of the bfloat16 values (products are exact; a pair is added with one rounding or two,
    as the vendor's instruction does it)."""
    m, k, n = shape
    r = np.random.default_rng(k)
    xb, w = bits(r.standard_normal((m, k))), bits(r.standard_normal((n, k)))
    out = np.empty((m, n), np.float32)
    gemm_cpu.matmul(xb, w, out)
    xf, wf = to_float32(xb).astype(np.float64), to_float32(w).astype(np.float64)
    ref = xf @ wf.T
    bound = (k + 1) * 2.0 ** -24 * (np.abs(xf) @ np.abs(wf).T)
    assert np.all(np.abs(out - ref) <= bound)
    assert np.abs(out - ref).max() > 0               # float32 sums, not float64 ones


@needs_dot
def test_column_slice_in_place_and_rows_independent(monkeypatch):
    """The AVX512_BF16 kernel's (AMX tiles off: test_amx_rows_independent_and_slices_in_place
    is theirs)."""
    monkeypatch.setenv("SEMZO_CPU_AMX", "0")
    r = np.random.default_rng(5)
    xb, w = bits(r.standard_normal((100, 64))), bits(r.standard_normal((20, 64)))
    wide = np.full((100, 31), -7.0, np.float32)
    gemm_cpu.matmul(xb, w, wide[:, 5:25])
    assert np.all(wide[:, :5] == -7.0) and np.all(wide[:, 25:] == -7.0)
    whole = np.empty((100, 20), np.float32)
    gemm_cpu.matmul(xb, w, whole)
    assert np.array_equal(wide[:, 5:25], whole)
    # a row's bits do not depend on which other rows share the call (threads, ranks)
    for lo, hi in ((0, 1), (3, 52), (48, 100), (17, 18), (20, 100), (36, 100)):
        part = np.empty((hi - lo, 20), np.float32)
        gemm_cpu.matmul(np.ascontiguousarray(xb[lo:hi]), w, part)
        assert np.array_equal(part, whole[lo:hi])


@needs_dot
def test_matmul_bf16_takes_the_dot_products_and_the_switch_keeps_float32(monkeypatch):
    r = np.random.default_rng(6)
    x = r.standard_normal((60, 128)).astype(np.float32)
    w = bits(r.standard_normal((40, 128)))
    want = np.empty((60, 40), np.float32)
    gemm_cpu.matmul(to_bits(x), w, want)
    got = matmul_bf16(x, w, np.empty((60, 40), np.float32))
    assert np.array_equal(got, want)
    monkeypatch.setenv("SEMZO_CPU_BF16_DOT", "0")
    assert not gemm_cpu.enabled()
    f32 = matmul_bf16(x, w, np.empty((60, 40), np.float32))
    assert np.array_equal(f32, to_float32(to_bits(x)) @ to_float32(w).T)
    assert not np.array_equal(f32, want)             # another order of the float32 sums
    assert np.abs(f32 - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("m", [1, 8, 9, 60, 100])
def test_several_weights_share_one_packing_of_the_activations(m, monkeypatch):
    """matmul_bf16_many (q, k, v or gate and up with bfloat16 GEMMs): each weight's outputs,
    written into column slices of one array, are matmul_bf16's bits for that weight alone
    (the activations packed once for all; tails of rows and columns; few rows take the GEMV
    form); a weight it cannot take (odd K) sends every one through matmul_bf16; bad operands
    are refused as matmul_bf16 refuses them. Without the instruction: the float32 path."""
    from semzo.model.gemm import matmul_bf16_many
    r = np.random.default_rng(m)
    x = r.standard_normal((m, 96)).astype(np.float32)
    ws = [bits(r.standard_normal((n, 96))) for n in (40, 9, 17)]
    alone = [matmul_bf16(x, w, np.empty((m, w.shape[0]), np.float32)) for w in ws]
    big = np.full((m, 70), np.nan, np.float32)
    outs = (big[:, :40], big[:, 40:49], big[:, 49:66])
    packs = []
    real, real_amx = gemm_cpu._packed, gemm_cpu._packed_amx
    monkeypatch.setattr(gemm_cpu, "_packed", lambda p: packs.append(p.shape) or real(p))
    monkeypatch.setattr(gemm_cpu, "_packed_amx",
                        lambda p: packs.append(p.shape) or real_amx(p))
    matmul_bf16_many(x, ws, outs, to_bits(x))
    assert np.array_equal(big[:, :66], np.concatenate(alone, axis=1))
    assert np.isnan(big[:, 66:]).all()
    if gemm_cpu.enabled():
        assert packs == ([] if m <= gemm_cpu.GEMV_ROWS else [(m, 48)])
    big[:] = np.nan
    matmul_bf16_many(x, ws, outs)                      # xb made here: the same bits
    assert np.array_equal(big[:, :66], np.concatenate(alone, axis=1))
    with pytest.raises(ValueError, match="the weight must be"):
        matmul_bf16_many(x, [ws[0], ws[1].astype(np.float32)], outs[:2])
    xo = r.standard_normal((m, 5)).astype(np.float32)     # odd K: the float32 path for all
    wo = [bits(r.standard_normal((3, 5))), bits(r.standard_normal((4, 5)))]
    oo = (np.empty((m, 3), np.float32), np.empty((m, 4), np.float32))
    matmul_bf16_many(xo, wo, oo)
    for w, o in zip(wo, oo):
        assert np.array_equal(o, matmul_bf16(xo, w, np.empty_like(o)))


@needs_dot
@pytest.mark.parametrize("m", range(1, gemm_cpu.GEMV_ROWS + 1))
def test_few_rows_take_the_gemv_kernel_with_the_gemm_kernels_bits(m, monkeypatch):
    """Calls of at most GEMV_ROWS rows (a generated token, say) take the GEMV kernel (lanes
    over weight rows, the weight transposed in registers): the 48 x 8 kernel's bits, for
    every tail of pairs (K mod 32) and of weight rows (N mod 16), with infinities and NaNs
    among the activations and the weights (a NaN's payload included). The reference is
    the 48 x 8 kernel, so AMX tiles (which larger calls take where the CPU has them) are
    switched off here."""
    monkeypatch.setenv("SEMZO_CPU_AMX", "0")
    r = np.random.default_rng(100 + m)
    for k in (2, 30, 32, 34, 96, 576):
        for n in (1, 15, 16, 17, 77):
            x = r.standard_normal((m, k)).astype(np.float32)
            w = r.standard_normal((n, k)).astype(np.float32)
            if k >= 30 and n >= 15:
                x[0, 3], w[2, 5], w[4, k - 1] = np.inf, -np.inf, np.nan
            xb, wb = bits(x), bits(w)
            ref = np.full((m, n), 3.0, np.float32)
            gemm_cpu._gemm(xb.view(np.uint32), wb.view(np.uint32), ref)
            got = np.full((m, n), 5.0, np.float32)
            gemm_cpu.matmul(xb, wb, got)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (m, k, n)


@needs_dot
def test_gemv_columns_cut_over_threads_keep_the_bits():
    """The GEMV's columns cut into runs of whole tiles, one per Numba thread: the same bits
    for any cut; a call from a part of a split forward (kernels.nested) does not cut."""
    from semzo.model import kernels
    r = np.random.default_rng(9)
    xb, w = bits(r.standard_normal((3, 96))), bits(r.standard_normal((333, 96)))
    pairs, w32 = xb.view(np.uint32), w.view(np.uint32)
    one = np.empty((3, 333), np.float32)
    gemm_cpu._gemv(pairs, w32, one, 0, 333)
    for parts in (2, 3, 5, 21):
        cut = np.full((3, 333), np.nan, np.float32)
        gemm_cpu._gemv_par(pairs, w32, cut, parts)
        assert np.array_equal(cut, one), parts
    assert not kernels.nested()
    saved = kernels.get_threads()
    kernels.set_threads(2)
    try:
        seen = kernels.run_slices(lambda sl: (kernels.nested(), gemm_cpu._gemv_parts(333)),
                                  [slice(0, 1), slice(1, 2)])
        # a run_slices call from inside a part runs its parts in turn (no pool deadlock)
        inner = kernels.run_slices(
            lambda sl: kernels.run_slices(lambda s2: s2.start, [slice(0, 1), slice(5, 6)]),
            [slice(0, 1), slice(1, 2)])
    finally:
        kernels.set_threads(saved)
    assert seen == [(True, 1), (True, 1)] and not kernels.nested()
    assert inner == [[0, 5], [0, 5]]


@pytest.mark.parametrize("k", [1, 7, 64, 576, 1000])
@pytest.mark.parametrize("storage", ["bfloat16", "float32"])
def test_few_rows_of_float32_products_read_the_weight_in_place(k, storage):
    """float32 products of a few rows (any CPU), the weight read in place (bfloat16 bits
    widened exactly, or float32): within K float32 roundings of the float64 product; a row's
    bits the same alone or among 8, for any cut of the columns over threads; a NaN in a
    row's input makes that row NaN and no other."""
    r = np.random.default_rng(k)
    n = 77
    x = r.standard_normal((8, k)).astype(np.float32)
    w = r.standard_normal((n, k)).astype(np.float32)
    if storage == "bfloat16":
        w = bits(w)
    out = np.full((8, n), 7.0, np.float32)
    assert gemm_cpu.gemv_f32_usable(x, w, out)
    gemm_cpu.gemv_f32(x, w, out)
    wf = (to_float32(w) if storage == "bfloat16" else w).astype(np.float64)
    ref = x.astype(np.float64) @ wf.T
    bound = (k + 1) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(wf).T)
    assert np.all(np.abs(out - ref) <= bound)
    for lo, hi in ((0, 1), (3, 4), (2, 7)):
        part = np.empty((hi - lo, n), np.float32)
        gemm_cpu.gemv_f32(x[lo:hi], w, part)
        assert np.array_equal(part, out[lo:hi])
    for parts in (2, 3, 5):
        cut = np.empty_like(out)
        gemm_cpu._gemv_f32_par(x, w, cut, parts)
        assert np.array_equal(cut, out)
    x[2, k // 2] = np.nan
    gemm_cpu.gemv_f32(x, w, out)
    assert np.all(np.isnan(out[2])) and not np.isnan(np.delete(out, 2, axis=0)).any()
    assert not gemm_cpu.gemv_f32_usable(np.ones((9, k), np.float32), w, np.empty((9, n)))
    assert not gemm_cpu.gemv_f32_usable(x, w.astype(np.float64), out)


@pytest.mark.parametrize("storage", ["bfloat16", "float32"])
def test_several_weights_in_one_launch_keep_each_ones_bits(storage):
    """gemv_f32_many (a block's q, k, v or gate and up: one x, one launch): each weight's
    outputs, written into column slices of one array, are gemv_f32's bits for that weight
    alone, for any cut of the weights' rows over threads (cuts across weight boundaries
    included) and from a part of a split forward (no launch)."""
    from semzo.model import kernels
    r = np.random.default_rng(11)
    for k in (1, 30, 576):
        ws = [r.standard_normal((n, k)).astype(np.float32) for n in (40, 9, 9)]
        if storage == "bfloat16":
            ws = [bits(w) for w in ws]
        for rows in (1, 5, 8):
            x = r.standard_normal((rows, k)).astype(np.float32)
            alone = [gemm_cpu.gemv_f32(x, w, np.empty((rows, w.shape[0]), np.float32))
                     for w in ws]
            big = np.full((rows, 60), np.nan, np.float32)
            outs = (big[:, :40], big[:, 40:49], big[:, 49:58])
            gemm_cpu.gemv_f32_many(x, ws, outs)
            assert np.array_equal(big[:, :58], np.concatenate(alone, axis=1))
            assert np.isnan(big[:, 58:]).all()              # nothing written past the last
            for parts in (2, 3, 7, 58):
                big[:] = np.nan
                gemm_cpu._gemv_f32_many_par(x, tuple(ws), outs, parts)
                assert np.array_equal(big[:, :58], np.concatenate(alone, axis=1)), parts
            big[:] = np.nan
            saved = kernels.get_threads()
            kernels.set_threads(2)
            try:
                kernels.run_slices(lambda sl, x=x, ws=ws, outs=outs:
                                   gemm_cpu.gemv_f32_many(x, ws, outs),
                                   [slice(0, 1)] * 2)
            finally:
                kernels.set_threads(saved)
            assert np.array_equal(big[:, :58], np.concatenate(alone, axis=1))
    # outs of different layouts (a C-contiguous array beside column slices), weights of
    # different dtypes: one gemv_f32 each, the same bits
    w16 = bits(r.standard_normal((9, 30)))
    w32 = r.standard_normal((9, 30)).astype(np.float32)
    x = r.standard_normal((3, 30)).astype(np.float32)
    big = np.empty((3, 20), np.float32)
    outs = (big[:, :9], np.empty((3, 9), np.float32))
    gemm_cpu.gemv_f32_many(x, [w16, w32], outs)
    for w, o in zip((w16, w32), outs):
        assert np.array_equal(o, gemm_cpu.gemv_f32(x, w, np.empty((3, 9), np.float32)))


def test_operands_it_does_not_take_go_to_float32():
    x16 = bits(np.ones((4, 6)))
    w = bits(np.ones((3, 6)))
    out = np.empty((4, 3), np.float32)
    assert not gemm_cpu.usable(x16, w, out, False)                  # GPT-2's (in, out)
    assert not gemm_cpu.usable(bits(np.ones((4, 5))), bits(np.ones((3, 5))), out, True)
    assert not gemm_cpu.usable(x16, w, np.empty((4, 2), np.float32), True)
    buf = np.zeros(3 * 6 + 1, np.uint16)
    assert not gemm_cpu.usable(x16, buf[1:].reshape(3, 6), out, True)  # 2 bytes off
    assert not gemm_cpu.usable(x16[:0], w, out[:0], True)
    # the odd K still gives the right product, by the float32 path
    r = np.random.default_rng(7)
    x = r.standard_normal((5, 9)).astype(np.float32)
    wo = bits(r.standard_normal((4, 9)))
    got = matmul_bf16(x, wo, np.empty((5, 4), np.float32))
    assert np.array_equal(got, to_float32(to_bits(x)) @ to_float32(wo).T)


def test_numba_without_the_feature_is_not_supported(monkeypatch):
    """Compiling the intrinsic for a target without +avx512bf16 would abort the process in
    LLVM: supported() must say no when NUMBA_CPU_FEATURES leaves the feature out."""
    from numba.core import config
    gemm_cpu.supported.cache_clear()
    try:
        monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512bf16")
        assert not gemm_cpu.supported()
    finally:
        monkeypatch.undo()
        gemm_cpu.supported.cache_clear()


def test_transpose_plan_places_every_value():
    """The register transpose of the direct stores, simulated: output row 2j + h of group g,
    column r, is the accumulator of weight row r at lane 2j + h."""
    vecs = [[(r, lane) for lane in range(16)] for r in range(gemm_cpu.NR)]
    for ops in gemm_cpu._PLAN:
        vecs = [[(vecs[a] + vecs[b])[i] for i in mask] for a, b, mask in ops]
    for j, v in enumerate(vecs):
        assert v[:8] == [(r, 2 * j) for r in range(8)]
        assert v[8:] == [(r, 2 * j + 1) for r in range(8)]


def test_to_bits_one_pass_is_numpys_rule():
    """storage.to_bits takes one Numba pass for float32 NumPy input (every bfloat16 GEMM's
    activations): the same bits as the NumPy expression it replaced, over a sweep of all
    float32 patterns (NaNs, infinities, ties, subnormals, the largest finite values)."""
    u = np.arange(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32)
    u = np.concatenate([np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                                  0xFFFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000,
                                  0x3F818000, 0x00008000, 0x80018000], np.uint32), u])
    u = u[:u.size - u.size % 11]
    n = u.copy()
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    r = ((n + np.uint32(0x7FFF) + ((n >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    want = np.where(nan, ((n >> 16) | np.uint32(0x40)).astype(np.uint16), r)
    got = to_bits(u.view(np.float32).reshape(-1, 11))
    assert got.shape == (u.size // 11, 11) and got.dtype == np.uint16
    assert np.array_equal(got.reshape(-1), want)
    assert np.array_equal(to_bits(u.view(np.float32)[::3]), want[::3])     # strided input


LOWER = """
import sys
import llvmlite.binding as llvm
from semzo.model import gemm_cpu
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
n = int(sys.argv[2])
mod = llvm.parse_assembly(gemm_cpu.gemv_ir(n) if sys.argv[3] == "gemv" else gemm_cpu.kernel_ir(n))
mod.verify()
tm = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
    cpu=sys.argv[1], features="", opt=3)
asm = tm.emit_assembly(mod)
lines = [x for x in asm.splitlines() if "vdpbf16ps" in x]
print("dpbf16", len(lines), sum("zmm" in x for x in lines))
"""


@pytest.mark.parametrize("cpu", ["sapphirerapids", "cooperlake", "graniterapids", "znver4",
                                 "znver5", "skylake-avx512"])
@pytest.mark.parametrize("kernel, ng", [("tile", 1), ("tile", 3), ("gemv", 1), ("gemv", 8)])
def test_the_kernel_lowers_to_vdpbf16ps_for_every_cpu_that_has_it(cpu, kernel, ng):
    """On any host (no kernel is run): the micro-kernel's IR compiled for Intel's and AMD's
    CPUs with AVX512_BF16 gives 8 x ng zmm vdpbf16ps per iteration of its loop (the GEMV
    kernel: 16 per row, ng rows; LLVM may unroll a loop: a multiple); for a CPU without it
    (Skylake-SP) LLVM aborts the process, which is why supported() must say no there, and why
    this runs in a child process."""
    import subprocess
    import sys

    from llvmlite import binding as llvm
    if "x86" not in llvm.get_process_triple():
        pytest.skip("not an x86 host: llvmlite may lack the x86 target")
    proc = subprocess.run([sys.executable, "-c", LOWER, cpu, str(ng), kernel],
                          capture_output=True, text=True, timeout=120, check=False)
    if cpu == "skylake-avx512":
        assert proc.returncode != 0 and "LLVM ERROR" in proc.stderr, proc.stdout
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, zmm = map(int, proc.stdout.split()[1:3])
    per = (16 if kernel == "gemv" else 8) * ng
    assert n > 0 and n % per == 0 and zmm == n, proc.stdout


# ------------------------------------------------------------------ AMX tiles
needs_amx = pytest.mark.skipif(not gemm_cpu.amx_supported(),
                               reason="this CPU (or Linux) gives no AMX bfloat16 tiles")


def _spy_amx(monkeypatch):
    """Count the calls that reach the AMX kernel (through _gemm_any's lookup)."""
    calls = []
    real = gemm_cpu._gemm_amx
    monkeypatch.setattr(gemm_cpu, "_gemm_amx", lambda *a: calls.append(1) or real(*a))
    return calls


@needs_amx
@pytest.mark.parametrize("m", [1, 8, 9, 15, 16, 17, 31, 32, 33, 48, 49, 97])
@pytest.mark.parametrize("n", [1, 15, 16, 31, 32, 33, 77])
@pytest.mark.parametrize("k", [32, 96])
def test_amx_exact_where_float32_sums_are_exact(m, n, k, monkeypatch):
    """Small integers (every partial sum exact in float32): the tiles give the exact product
    bit for bit through every tail: rows (one group or two, full or not; a lone last group
    with a zero group), weight rows (the zero-padded block), the direct 32 x 32 stores.
    Calls of at most GEMV_ROWS rows keep the GEMV form (exact too)."""
    calls = _spy_amx(monkeypatch)
    r = np.random.default_rng(m * 1000 + n * 10 + k)
    x = r.integers(-8, 9, (m, k))
    w = r.integers(-8, 9, (n, k))
    out = np.full((m, n), np.nan, np.float32)
    gemm_cpu.matmul(bits(x), bits(w), out)
    assert np.array_equal(out, (x @ w.T).astype(np.float32))
    assert len(calls) == (0 if m <= gemm_cpu.GEMV_ROWS else 1)


@needs_amx
def test_amx_rows_independent_and_slices_in_place(monkeypatch):
    """A row's bits do not depend on the other rows of a call the tiles take (9 to 100 of
    them: threads, ranks); a call of at most GEMV_ROWS rows (a generated token) has the GEMV
    form's bits, the 48 x 8 kernel's, within float32 rounding of the tiles'; a column slice
    is written in place; within float32 rounding of the sums of the float64 product."""
    r = np.random.default_rng(11)
    xb, w = bits(r.standard_normal((100, 576))), bits(r.standard_normal((333, 576)))
    whole = np.empty((100, 333), np.float32)
    calls = _spy_amx(monkeypatch)
    gemm_cpu.matmul(xb, w, whole)
    assert calls == [1]
    for lo, hi in ((3, 12), (48, 100), (20, 100), (36, 100), (0, 9), (50, 67)):
        part = np.full((hi - lo, 333), np.nan, np.float32)
        gemm_cpu.matmul(np.ascontiguousarray(xb[lo:hi]), w, part)
        assert np.array_equal(part, whole[lo:hi]), (lo, hi)
    few = np.full((5, 333), np.nan, np.float32)
    gemm_cpu.matmul(np.ascontiguousarray(xb[:5]), w, few)
    dot = np.empty_like(whole)
    gemm_cpu._gemm(xb.view(np.uint32), w.view(np.uint32), dot)
    assert len(calls) == 7 and np.array_equal(few, dot[:5])
    wide = np.full((100, 400), -7.0, np.float32)
    gemm_cpu.matmul(xb, w, wide[:, 40:373])
    assert np.all(wide[:, :40] == -7.0) and np.all(wide[:, 373:] == -7.0)
    assert np.array_equal(wide[:, 40:373], whole)
    xf, wf = to_float32(xb).astype(np.float64), to_float32(w).astype(np.float64)
    bound = 577 * 2.0 ** -24 * (np.abs(xf) @ np.abs(wf).T)
    assert np.all(np.abs(whole - xf @ wf.T) <= bound)
    assert np.all(np.abs(whole - dot) <= 2 * bound)


@needs_amx
def test_amx_switch_and_odd_k_keep_the_dot_kernel(monkeypatch):
    """SEMZO_CPU_AMX=0, or K not a multiple of 32 (a tile row), take the AVX512_BF16 kernel
    (its bits); the finetune stage's log names what each rank computes with."""
    r = np.random.default_rng(12)
    for k, amx in ((64, False), (48, True)):
        xb, w = bits(r.standard_normal((60, k))), bits(r.standard_normal((40, k)))
        if amx:
            monkeypatch.delenv("SEMZO_CPU_AMX", raising=False)
        else:
            monkeypatch.setenv("SEMZO_CPU_AMX", "0")
        assert gemm_cpu.kind() == ("amx" if amx else "dot")
        calls = _spy_amx(monkeypatch)
        got = np.empty((60, 40), np.float32)
        gemm_cpu.matmul(xb, w, got)
        want = np.empty((60, 40), np.float32)
        gemm_cpu._gemm(xb.view(np.uint32), w.view(np.uint32), want)
        assert calls == [] and np.array_equal(got, want)
        monkeypatch.undo()


def test_numba_without_amx_is_not_amx_supported(monkeypatch):
    """Compiling the tile intrinsics for a target without +amx-tile aborts the process in
    LLVM ('Cannot select'): amx_supported() must say no when NUMBA_CPU_FEATURES leaves the
    features out."""
    from numba.core import config
    gemm_cpu.amx_supported.cache_clear()
    try:
        monkeypatch.setattr(config, "CPU_FEATURES", "+avx512bf16,-amx-tile,-amx-bf16")
        assert not gemm_cpu.amx_supported()
        assert gemm_cpu.kind() in ("dot", "float32")
    finally:
        monkeypatch.undo()
        gemm_cpu.amx_supported.cache_clear()


def test_t16_plan_transposes():
    """The register transpose of the AMX stores, simulated: output vector j lane i is input
    vector i lane j."""
    vecs = [[(v, lane) for lane in range(16)] for v in range(16)]
    for ops in gemm_cpu._T16:
        vecs = [[(vecs[a] + vecs[b])[i] for i in mask] for a, b, mask in ops]
    assert vecs == [[(i, j) for i in range(16)] for j in range(16)]


LOWER_AMX = """
import sys
import llvmlite.binding as llvm
from semzo.model import gemm_cpu
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
mod = llvm.parse_assembly(gemm_cpu.amx_ir())
mod.verify()
tm = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
    cpu=sys.argv[1], features="", opt=3)
asm = tm.emit_assembly(mod).splitlines()
print("amx", *(sum(op in x for x in asm) for op in ("tdpbf16ps", "tileloadd", "ldtilecfg")))
"""


@pytest.mark.parametrize("cpu", ["sapphirerapids", "graniterapids", "znver4"])
def test_the_amx_kernel_lowers_to_tile_instructions(cpu):
    """On any x86 host (nothing run): the AMX kernel's IR compiled for Intel's CPUs with AMX
    gives 4 tdpbf16ps and 4 tile loads per iteration; for one without (Zen 4) LLVM aborts,
    which is why amx_supported() checks the features (a child process)."""
    import subprocess
    import sys

    from llvmlite import binding as llvm
    if "x86" not in llvm.get_process_triple():
        pytest.skip("not an x86 host: llvmlite may lack the x86 target")
    proc = subprocess.run([sys.executable, "-c", LOWER_AMX, cpu],
                          capture_output=True, text=True, timeout=120, check=False)
    if cpu == "znver4":
        assert "LLVM ERROR" in proc.stderr, proc.stdout
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["amx", "4", "4", "1"], proc.stdout
