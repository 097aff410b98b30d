"""bfloat16 GEMMs on CPUs with bfloat16 dot products (AVX512_BF16) or AMX tiles: the CPU
side of ``model.matmul = "bfloat16"`` (:func:`semzo.model.gemm.matmul_bf16`). AMX (Intel
Sapphire Rapids and later) takes every call of more than :data:`GEMV_ROWS` rows whose K is a
multiple of 32 (the "AMX tiles" section below); the rest of this docstring is the
AVX512_BF16 kernel's.

NumPy's OpenBLAS wheels have no bfloat16 GEMM (``sbgemm`` is not built in), so on the CPU
``matmul_bf16`` used to upcast the weight and the rounded activations to float32 and call
sgemm: the arithmetic of the GPU's tensor cores, at sgemm's speed or below. CPUs with
AVX512_BF16 (Intel Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later) have
``vdpbf16ps``: 16 float32 lanes, each adding the two products of a pair of bfloat16 values,
twice the multiply-adds of a float32 FMA per instruction. Numba cannot express a vector
instruction, but it compiles LLVM IR: :func:`_make_tile` makes a Numba intrinsic that writes
the micro-kernel's loop in IR around LLVM's ``llvm.x86.avx512bf16.dpbf16ps.512``, and Numba's
LLVM (the host's CPU features) turns it into the instructions.

The tile: 48 activation rows (three zmm registers of 16 rows, each lane a pair of bfloat16
values along K) times 8 weight rows (each pair of a weight row broadcast to the 16 lanes,
read in place from the stored bfloat16 bits: the weight is never copied or repacked, so an
in-place ZO perturbation costs nothing here); 24 accumulators. The activations are packed
once per call (rows grouped by 48, pairs interleaved; zero rows pad the last group, whose
tile computes only the 16-row groups it fills), or once for several weights
(:func:`matmul_many`). A full tile is transposed in registers and
stored straight into the output; columns go in chunks whose weight rows (about 256 KiB)
stay in L2 while every row block passes them. The micro-kernel alone: about 228 GFLOP/s a
thread on an AMD EPYC (Zen 4), 3.55 ``vdpbf16ps`` a nanosecond; SmolLM2's GEMMs 199-221.

Arithmetic, as the hardware defines it: every product of two bfloat16 values is exact in
float32; for each output, the float32 accumulator (from 0.0) takes the products pair by pair
in order of K, each pair with one rounding to nearest even or two (the instruction's
definition leaves it to the vendor); subnormal inputs and results are flushed to zero (its
DAZ / FTZ). The sum's order differs from OpenBLAS's and cuBLAS's, so the three agree to
float32 rounding of the sums, not bit for bit. A row's result depends only on that row
(never on how many rows the call has or where they sit in it), so splitting a batch over
threads or ranks leaves the bits unchanged. Machines without the instruction, odd K, or a
weight stored (in, out) (GPT-2's Conv1D) keep the float32 path.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload

from semzo.model import kernels

#: weight rows per tile, 16-row groups of activations per tile, activation rows per tile
NR, NG = 8, 3
MB = 16 * NG


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no name for it)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F, _V16I = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
_V32B = ir.VectorType(_BFloat(), 32)
_DPBF16 = "llvm.x86.avx512bf16.dpbf16ps.512"


@functools.cache
def supported() -> bool:
    """True when the CPU has AVX512_BF16 and Numba compiles for it (``NUMBA_CPU_FEATURES``,
    when set, must name ``+avx512bf16``: without it LLVM cannot lower the instruction and
    would abort the process)."""
    host = get_host_cpu_features()
    feats = config.CPU_FEATURES if config.CPU_FEATURES is not None else host
    return "+avx512bf16" in host.split(",") and "+avx512bf16" in feats.split(",")


def enabled() -> bool:
    """:func:`supported`, unless ``SEMZO_CPU_BF16_DOT=0`` (the switch that keeps the float32
    path, for comparisons; read at every call)."""
    return os.environ.get("SEMZO_CPU_BF16_DOT", "1") != "0" and supported()


def _transpose_plan() -> list[list[tuple[int, int, list[int]]]]:
    """Three rounds of two-source shuffles that turn the 8 accumulators of one 16-row group
    (vector r: weight row r, lane l: activation row l) into 8 vectors whose halves are rows
    of the output (vector j: lanes 0-7 output row 2 j, lanes 8-15 row 2 j + 1, columns r in
    order). Rounds one and two each exchange a bit of the vector's index with a bit of the
    lane's; round three gathers each output vector from the two vectors that hold it. Each
    round: per output vector, (first source, second source, the 16 lanes' indices into the
    two concatenated)."""
    lay = [[(r, lane) for lane in range(16)] for r in range(NR)]
    rounds = []
    for vbit, lbit in ((0, 1), (1, 2)):
        rounds.append([[lay[(v & ~(1 << vbit)) | (((i >> lbit) & 1) << vbit)]
                        [(i & ~(1 << lbit)) | (((v >> vbit) & 1) << lbit)]
                        for i in range(16)] for v in range(NR)])
        lay = rounds[-1]
    rounds.append([[(r, 2 * j + h) for h in range(2) for r in range(NR)] for j in range(NR)])
    plan, prev = [], [[(r, lane) for lane in range(16)] for r in range(NR)]
    for lay in rounds:
        ops = []
        for want in lay:
            src = [u for u in range(NR) if set(want) & set(prev[u])]
            if not 1 <= len(src) <= 2:
                raise AssertionError("transpose plan: an output needs more than two sources")
            a, b = src[0], src[-1]
            ops.append((a, b, [prev[a].index(t) if t in prev[a] else 16 + prev[b].index(t)
                               for t in want]))
        plan.append(ops)
        prev = lay
    return plan


_PLAN = _transpose_plan()


def _emit_tile(builder, a_i, w_i, wst, npr, ng):
    """The tile's loop in IR over the first ``ng`` of the 3 groups of 16 activation rows;
    returns the 8 * ng final accumulators (index r * ng + g)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F, [_V16F, _V32B, _V32B]), _DPBF16)
    ap = builder.inttoptr(a_i, _V16I.as_pointer())
    wp = builder.inttoptr(w_i, _I32.as_pointer())
    zero = ir.Constant(_V16F, None)
    undef = ir.Constant(_V16I, ir.Undefined)
    splat = ir.Constant(_V16I, [0] * 16)
    pre = builder.basic_block
    loop = builder.append_basic_block("bf16tile.loop")
    done = builder.append_basic_block("bf16tile.done")
    builder.cbranch(builder.icmp_signed(">", npr, ir.Constant(_I64, 0)), loop, done)

    builder.position_at_end(loop)
    p = builder.phi(_I64)
    acc = [builder.phi(_V16F) for _ in range(NR * ng)]
    base = builder.mul(p, ir.Constant(_I64, NG))
    av = [builder.bitcast(builder.load(builder.gep(ap, [builder.add(
        base, ir.Constant(_I64, g))]), align=4), _V32B) for g in range(ng)]
    new = []
    for r in range(NR):
        wv = builder.load(builder.gep(wp, [builder.add(
            builder.mul(ir.Constant(_I64, r), wst), p)]), align=4)
        wb = builder.bitcast(builder.shuffle_vector(
            builder.insert_element(undef, wv, ir.Constant(_I32, 0)), undef, splat), _V32B)
        for g in range(ng):
            new.append(builder.call(fn, [acc[r * ng + g], av[g], wb]))
    pn = builder.add(p, ir.Constant(_I64, 1))
    builder.cbranch(builder.icmp_signed("<", pn, npr), loop, done)
    p.add_incoming(ir.Constant(_I64, 0), pre)
    p.add_incoming(pn, loop)
    for a, n in zip(acc, new):
        a.add_incoming(zero, pre)
        a.add_incoming(n, loop)

    builder.position_at_end(done)
    outs = [builder.phi(_V16F) for _ in range(NR * ng)]
    for j, out in enumerate(outs):
        out.add_incoming(zero, pre)
        out.add_incoming(new[j], loop)
    return outs


def _emit_store_out(builder, outs, o_i, ldv, ng: int) -> None:
    """Store the tile's accumulators (:func:`_emit_tile`) into the output at integer address
    ``o_i`` (rows ``ldv`` floats apart): per group, the register transpose of :data:`_PLAN`,
    then 16 runs of 8 floats."""
    v8 = ir.VectorType(_F32, 8)
    row_bytes = builder.mul(ldv, ir.Constant(_I64, 4))
    halves = (ir.Constant(ir.VectorType(_I32, 8), list(range(8))),
              ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
    for g in range(ng):
        vecs = [outs[r * ng + g] for r in range(NR)]
        for ops in _PLAN:
            vecs = [builder.shuffle_vector(vecs[a], vecs[b], ir.Constant(_V16I, mask))
                    for a, b, mask in ops]
        for j, v in enumerate(vecs):
            for h, lanes in enumerate(halves):
                addr = builder.add(o_i, builder.mul(row_bytes,
                                                    ir.Constant(_I64, 16 * g + 2 * j + h)))
                builder.store(builder.shuffle_vector(v, v, lanes),
                              builder.inttoptr(addr, v8.as_pointer()), align=4)


def kernel_ir(ng: int = NG) -> str:
    """The micro-kernel and its direct store as a stand-alone LLVM module (text): a function
    ``bf16_tile_out(a, w, w_stride, npairs, o, ld)`` (i64 arguments) with the IR the Numba
    intrinsics emit, for compiling to other CPUs' code without running it (tests: it must
    lower to ``vdpbf16ps`` on every CPU with AVX512_BF16, and LLVM aborts on a CPU without
    it, which :func:`supported` guards against)."""
    mod = ir.Module(name="semzo_bf16_tile")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [_I64] * 6), name="bf16_tile_out")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    a_i, w_i, wst, npr, o_i, ldv = fn.args
    _emit_store_out(builder, _emit_tile(builder, a_i, w_i, wst, npr, ng), o_i, ldv, ng)
    builder.ret_void()
    return str(mod)


def _int_args(context, builder, sig, args):
    return [context.cast(builder, v, ty, types.intp) for v, ty in zip(args, sig.args)]


def _make_tile(ng: int):
    """The micro-kernel into a buffer, over ``ng`` groups of 16 rows (3: a full tile; 1 or 2:
    the last rows of a call). ``a_addr``: packed activations, ``npairs`` x 3 x 16 uint32 (a
    pair of bfloat16 values each); ``w_addr``: the first of 8 weight rows, ``w_stride``
    uint32 apart, ``npairs`` pairs each; ``t_addr``: 8 x 3 x 16 float32, of which [:, :ng]
    written (weight row r, group g, lane l: the dot product of weight row r with activation
    row 16 g + l). Addresses as integers, 4-byte aligned; npairs >= 0."""

    @intrinsic
    def tile(typingctx, a_addr, w_addr, w_stride, npairs, t_addr):
        for a in (a_addr, w_addr, w_stride, npairs, t_addr):
            if not isinstance(a, types.Integer):
                return None
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            a_i, w_i, wst, npr, t_i = _int_args(context, builder, sig, args)
            outs = _emit_tile(builder, a_i, w_i, wst, npr, ng)
            tp = builder.inttoptr(t_i, _V16F.as_pointer())
            for r in range(NR):
                for g in range(ng):
                    builder.store(outs[r * ng + g],
                                  builder.gep(tp, [ir.Constant(_I64, r * NG + g)]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _make_tile_out(ng: int):
    """The micro-kernel over ``ng`` groups written straight into the output: ``o_addr`` is
    out[m0, n0] of a float32 output whose rows are ``ld`` elements apart, and all
    16 ng x 8 of the tile are inside it. The accumulators are transposed in registers
    (:data:`_PLAN`) and stored as 16 ng runs of 8 floats."""

    @intrinsic
    def tile_out(typingctx, a_addr, w_addr, w_stride, npairs, o_addr, ld):
        for a in (a_addr, w_addr, w_stride, npairs, o_addr, ld):
            if not isinstance(a, types.Integer):
                return None
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp,
                         types.intp)

        def codegen(context, builder, sig, args):
            a_i, w_i, wst, npr, o_i, ldv = _int_args(context, builder, sig, args)
            _emit_store_out(builder, _emit_tile(builder, a_i, w_i, wst, npr, ng),
                            o_i, ldv, ng)
            return context.get_dummy_value()

        return sig, codegen

    return tile_out


_tile1, _tile2, _tile3 = (_make_tile(g) for g in (1, 2, 3))
_tile_out1, _tile_out2, _tile_out3 = (_make_tile_out(g) for g in (1, 2, 3))


@njit(inline="always")
def _tile(ng, a, w, wst, npr, t):
    """:func:`_make_tile`'s kernel for ``ng`` groups."""
    if ng == 3:
        _tile3(a, w, wst, npr, t)
    elif ng == 2:
        _tile2(a, w, wst, npr, t)
    else:
        _tile1(a, w, wst, npr, t)


@njit(inline="always")
def _tile_out(ng, a, w, wst, npr, o, ld):
    """:func:`_make_tile_out`'s kernel for ``ng`` groups."""
    if ng == 3:
        _tile_out3(a, w, wst, npr, o, ld)
    elif ng == 2:
        _tile_out2(a, w, wst, npr, o, ld)
    else:
        _tile_out1(a, w, wst, npr, o, ld)


@njit(cache=True, nogil=True)
def _pack(pairs, ap):
    """ap[b, p, g, l] = pairs[48 b + 16 g + l, p] (zero past the last row)."""
    m_rows, npr = pairs.shape
    for b in range(ap.shape[0]):
        for g in range(NG):
            for lane in range(16):
                m = b * MB + g * 16 + lane
                if m < m_rows:
                    for p in range(npr):
                        ap[b, p, g, lane] = pairs[m, p]
                else:
                    for p in range(npr):
                        ap[b, p, g, lane] = 0


@njit(cache=True, nogil=True)
def _packed(pairs):
    """The activations' pairs (M, P) packed for the tile: (ceil(M / 48), P, NG, 16)."""
    m_rows, npr = pairs.shape
    ap = np.empty(((m_rows + MB - 1) // MB, npr, NG, 16), np.uint32)
    _pack(pairs, ap)
    return ap


@njit(cache=True, nogil=True)
def _gemm(pairs, w32, out):
    """out[m, n] = sum over k of bf16(x)[m, k] * w[n, k] (see the module's arithmetic):
    pairs (M, P) and w32 (N, P) uint32 (bfloat16 pairs, C-contiguous), out (M, N) float32
    with contiguous rows."""
    _gemm_packed(_packed(pairs), pairs.shape[0], w32, out)


@njit(cache=True, nogil=True)
def _gemm_packed(ap, m_rows, w32, out):
    """:func:`_gemm` of activations already packed (:func:`_packed`) for ``m_rows`` rows."""
    nb, npr = ap.shape[0], ap.shape[1]
    n_out = w32.shape[0]
    tile = np.empty((NR, NG, 16), np.float32)
    wtail = np.zeros((NR, npr), np.uint32)
    a0 = np.intp(ap.ctypes.data)
    w0 = np.intp(w32.ctypes.data)
    t0 = np.intp(tile.ctypes.data)
    wt = np.intp(wtail.ctypes.data)
    o0 = np.intp(out.ctypes.data)
    ld = out.strides[0] // 4
    a_step = npr * NG * 16 * 4
    # columns in chunks whose weight rows (about 256 KiB) stay in L2 while every 48-row
    # block of the activations passes them: each tile then writes 48 short runs of one chunk
    nc = max(NR, (262144 // (npr * 4 * NR)) * NR)
    for c0 in range(0, n_out, nc):
        c1 = min(n_out, c0 + nc)
        for b in range(nb):
            mlim = min(MB, m_rows - b * MB)
            ng = (mlim + 15) // 16              # the last block: only the groups it fills
            for n0 in range(c0, c1, NR):
                nr = min(NR, n_out - n0)
                if nr == NR:
                    w_addr = w0 + n0 * npr * 4
                else:
                    for r in range(nr):
                        wtail[r, :] = w32[n0 + r, :]
                    w_addr = wt
                if nr == NR and mlim == 16 * ng:
                    _tile_out(ng, a0 + b * a_step, w_addr, npr, npr,
                              o0 + (b * MB * ld + n0) * 4, ld)
                    continue
                _tile(ng, a0 + b * a_step, w_addr, npr, npr, t0)
                for i in range(mlim):
                    g, lane = i // 16, i % 16
                    for r in range(nr):
                        out[b * MB + i, n0 + r] = tile[r, g, lane]


# ------------------------------------------------------------------ AMX tiles
# Intel's Advanced Matrix Extensions (Sapphire Rapids and later): eight tile registers of
# 16 rows x 64 bytes and ``tdpbf16ps``, a 16 x 16 float32 tile accumulating the 16 x 32
# bfloat16 products of two tiles in one instruction (16 times the multiply-adds of
# ``vdpbf16ps``). The kernel computes out.T's 32 x 32 blocks: its first operand is 16 weight
# rows read in place (a tile row is 32 consecutive bfloat16 values of one weight row, rows a
# weight row apart: the weight is never copied), its second the activations packed per group
# of 16 rows so that a tile is 1 KiB in one piece (:func:`_packed_amx`; read with the stride
# of :func:`_packed`'s 48-row groups, SmolLM2's GEMMs ran 1.05-1.75x slower); two weight
# tiles by two activation tiles, four accumulators.
# Linux hands the tile state to a process only on request (``arch_prctl``), once.

#: tile registers: accumulators 0-3, weight tiles 4-5, activation tiles 6-7
_AMX_W, _AMX_A = (4, 5), (6, 7)
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 0x1022, 0x1023, 18
_VOID, _I8 = ir.VoidType(), ir.IntType(8)
_P8 = _I8.as_pointer()


def _amx_permission() -> bool:
    """Ask Linux for the AMX tile data state of this process (``ARCH_REQ_XCOMP_PERM``); True
    when it is granted (without it the first tile instruction is SIGILL)."""
    import ctypes
    import platform
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(158, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            return False
        mask = ctypes.c_ulong(0)
        if libc.syscall(158, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
            return False
        return bool(mask.value >> _XFEATURE_XTILEDATA & 1)
    except (OSError, AttributeError):
        return False


@functools.cache
def amx_supported() -> bool:
    """True when the CPU has AMX with bfloat16 tiles (``amx-tile``, ``amx-bf16``), Numba
    compiles for them (``NUMBA_CPU_FEATURES``, when set, must name both) and Linux granted
    this process the tile state (asked here, once)."""
    host = get_host_cpu_features().split(",")
    feats = (config.CPU_FEATURES.split(",") if config.CPU_FEATURES is not None else host)
    need = ("+amx-tile", "+amx-bf16")
    return (supported() and all(f in host and f in feats for f in need)
            and _amx_permission())


def amx_enabled() -> bool:
    """:func:`enabled` and :func:`amx_supported`, unless ``SEMZO_CPU_AMX=0`` (keeps the
    ``vdpbf16ps`` kernel, for comparisons; read at every call). Calls of at most
    :data:`GEMV_ROWS` rows keep the ``vdpbf16ps`` GEMV form either way: a generated token
    streams the weight once, which the GEMV does at memory speed and the tiles, computing 32
    rows for the one real row, did at a third of it (bench/generate.py: 20.4 against 36.5
    tokens/s, Intel Xeon)."""
    return (os.environ.get("SEMZO_CPU_AMX", "1") != "0" and enabled()
            and amx_supported())


#: how this process computes ``model.matmul = "bfloat16"`` (:func:`kind`), in words
KINDS = {"amx": "AMX tiles (more than 8 rows and K a multiple of 32; other calls: the "
                "AVX512_BF16 dot products)",
         "dot": "the CPU's AVX512_BF16 dot products",
         "float32": "emulated in float32 (this CPU has no AVX512_BF16, or "
                    "SEMZO_CPU_BF16_DOT=0): the same arithmetic, slower"}


def kind() -> str:
    """``"amx"`` (:func:`amx_enabled`), ``"dot"`` (:func:`enabled`) or ``"float32"``."""
    return "amx" if amx_enabled() else "dot" if enabled() else "float32"


def _t16_plan() -> list[list[tuple[int, int, list[int]]]]:
    """A 16 x 16 transpose in registers: four rounds of two-source shuffles, round b
    exchanging bit b of the vector's index with bit b of the lane's. Each round: per output
    vector, (first source, second source, the 16 lanes' indices into the two concatenated)."""
    plan = []
    for b in range(4):
        ops = []
        for v in range(16):
            lo, hi = v & ~(1 << b), v | (1 << b)
            mask = []
            for lane in range(16):
                src_v = (v & ~(1 << b)) | (((lane >> b) & 1) << b)
                src_l = (lane & ~(1 << b)) | (((v >> b) & 1) << b)
                mask.append(src_l if src_v == lo else 16 + src_l)
            ops.append((lo, hi, mask))
        plan.append(ops)
    return plan


_T16 = _t16_plan()


def _amx_fn(module, name: str, args: list):
    return cgutils.get_or_insert_function(module, ir.FunctionType(_VOID, args),
                                          "llvm.x86." + name)


def _emit_amx(builder, w_i, wst, b0_i, b1_i, npr, t_i) -> None:
    """The AMX kernel's loop in IR: accumulators 0-3 = (weight rows 0-15, 16-31) x
    (activation group b0, b1), over ``npr`` pairs (a multiple of 16) in steps of 16, then
    the four tiles stored at ``t_i`` (tile t = 2 wi + gi: 16 x 16 float32, [weight row,
    activation row]). ``wst``: bytes between weight rows; b0, b1: the groups' first pairs in
    :func:`_packed_amx`'s packing (a pair of 16 rows: 64 bytes). The tile configuration is
    loaded by the caller."""
    load = _amx_fn(builder.module, "tileloadd64", [_I8, _P8, _I64])
    dot = _amx_fn(builder.module, "tdpbf16ps", [_I8, _I8, _I8])
    store = _amx_fn(builder.module, "tilestored64", [_I8, _P8, _I64])
    zero = _amx_fn(builder.module, "tilezero", [_I8])
    c8, c64 = (lambda v: ir.Constant(_I8, v)), (lambda v: ir.Constant(_I64, v))
    p8 = lambda a: builder.inttoptr(a, _P8)
    for t in range(4):
        builder.call(zero, [c8(t)])
    pre = builder.basic_block
    loop = builder.append_basic_block("amx.loop")
    done = builder.append_basic_block("amx.done")
    builder.cbranch(builder.icmp_signed(">", npr, c64(0)), loop, done)
    builder.position_at_end(loop)
    p = builder.phi(_I64)
    woff = builder.mul(p, c64(4))
    w16 = builder.mul(wst, c64(16))
    builder.call(load, [c8(_AMX_W[0]), p8(builder.add(w_i, woff)), wst])
    builder.call(load, [c8(_AMX_W[1]), p8(builder.add(builder.add(w_i, w16), woff)), wst])
    aoff = builder.mul(p, c64(64))
    builder.call(load, [c8(_AMX_A[0]), p8(builder.add(b0_i, aoff)), c64(64)])
    builder.call(load, [c8(_AMX_A[1]), p8(builder.add(b1_i, aoff)), c64(64)])
    for wi in range(2):
        for gi in range(2):
            builder.call(dot, [c8(2 * wi + gi), c8(_AMX_W[wi]), c8(_AMX_A[gi])])
    pn = builder.add(p, c64(16))
    builder.cbranch(builder.icmp_signed("<", pn, npr), loop, done)
    p.add_incoming(c64(0), pre)
    p.add_incoming(pn, loop)
    builder.position_at_end(done)
    for t in range(4):
        builder.call(store, [c8(t), p8(builder.add(t_i, c64(1024 * t))), c64(64)])


def _emit_amx_store_out(builder, t_i, o_i, ldv) -> None:
    """The four stored tiles (:func:`_emit_amx`) into the output at ``o_i`` (out[m0, n0],
    rows ``ldv`` floats apart; all 32 x 32 inside it): each tile transposed in registers
    (:data:`_T16`) and stored as 16 runs of 16 floats."""
    tp = builder.inttoptr(t_i, _V16F.as_pointer())
    row_bytes = builder.mul(ldv, ir.Constant(_I64, 4))
    for t in range(4):
        wi, gi = divmod(t, 2)
        vecs = [builder.load(builder.gep(tp, [ir.Constant(_I64, 16 * t + i)]), align=4)
                for i in range(16)]
        for ops in _T16:
            vecs = [builder.shuffle_vector(vecs[a], vecs[b], ir.Constant(_V16I, mask))
                    for a, b, mask in ops]
        for j, v in enumerate(vecs):
            addr = builder.add(o_i, builder.add(
                builder.mul(row_bytes, ir.Constant(_I64, 16 * gi + j)),
                ir.Constant(_I64, 64 * wi)))
            builder.store(v, builder.inttoptr(addr, _V16F.as_pointer()), align=4)


def amx_ir() -> str:
    """The AMX kernel with its direct store as a stand-alone LLVM module (text), for
    compiling to other CPUs' code without running it (tests)."""
    mod = ir.Module(name="semzo_amx_tile")
    fn = ir.Function(mod, ir.FunctionType(_VOID, [_I64] * 9), name="amx_tile_out")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    cfg, w_i, wst, b0, b1, npr, t_i, o_i, ldv = fn.args
    builder.call(_amx_fn(mod, "ldtilecfg", [_P8]), [builder.inttoptr(cfg, _P8)])
    _emit_amx(builder, w_i, wst, b0, b1, npr, t_i)
    _emit_amx_store_out(builder, t_i, o_i, ldv)
    builder.call(_amx_fn(mod, "tilerelease", []), [])
    builder.ret_void()
    return str(mod)


@intrinsic
def _amx_config(typingctx, cfg_addr):
    """ldtilecfg from the 64-byte configuration at ``cfg_addr`` (this thread's tiles)."""
    if not isinstance(cfg_addr, types.Integer):
        return None
    sig = types.void(types.intp)

    def codegen(context, builder, sig, args):
        (a,) = _int_args(context, builder, sig, args)
        builder.call(_amx_fn(builder.module, "ldtilecfg", [_P8]), [builder.inttoptr(a, _P8)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _amx_release(typingctx):
    """tilerelease: this thread's tiles back to their initial state."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        builder.call(_amx_fn(builder.module, "tilerelease", []), [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _amx_tile(typingctx, w_addr, w_stride, b0, b1, npairs, t_addr):
    """:func:`_emit_amx` into the 4 x 16 x 16 float32 at ``t_addr``."""
    for a in (w_addr, w_stride, b0, b1, npairs, t_addr):
        if not isinstance(a, types.Integer):
            return None
    sig = types.void(*([types.intp] * 6))

    def codegen(context, builder, sig, args):
        _emit_amx(builder, *_int_args(context, builder, sig, args))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _amx_tile_out(typingctx, w_addr, w_stride, b0, b1, npairs, t_addr, o_addr, ld):
    """:func:`_amx_tile`, then the 32 x 32 block stored transposed into the output."""
    for a in (w_addr, w_stride, b0, b1, npairs, t_addr, o_addr, ld):
        if not isinstance(a, types.Integer):
            return None
    sig = types.void(*([types.intp] * 8))

    def codegen(context, builder, sig, args):
        w_i, wst, b0_i, b1_i, npr, t_i, o_i, ldv = _int_args(context, builder, sig, args)
        _emit_amx(builder, w_i, wst, b0_i, b1_i, npr, t_i)
        _emit_amx_store_out(builder, t_i, o_i, ldv)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _packed_amx(pairs):
    """The activations' pairs (M, P) packed for the AMX tiles: (G, P, 16), G = ceil(M / 16)
    rounded up to even, ap[g, p, l] = pairs[16 g + l, p] (zero past the last row)."""
    m_rows, npr = pairs.shape
    n_groups = (m_rows + 15) // 16
    n_groups += n_groups % 2
    ap = np.empty((n_groups, npr, 16), np.uint32)
    for g in range(n_groups):
        for p in range(npr):
            for lane in range(16):
                m = g * 16 + lane
                ap[g, p, lane] = pairs[m, p] if m < m_rows else 0
    return ap


@njit(cache=True, nogil=True)
def _gemm_amx(ap, m_rows, w32, out):
    """out[:m_rows] = the activations packed by
    :func:`_packed_amx` times the weight's rows, by AMX tiles (:func:`amx_enabled`; pairs a
    multiple of 16): 32-row blocks of the weight (they stay in L1) by every pair of 16-row
    groups of the activations. Blocks that fill 32 x 32 of the output are stored directly;
    the last rows or columns go through the tiles' buffer; the last weight rows are copied
    into a zero-padded block (the tiles read 32 rows)."""
    npr = ap.shape[1]
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1                                      # palette 1
    for t in range(8):
        cfg[16 + 2 * t] = 64                        # bytes per row (uint16, little-endian)
        cfg[48 + t] = 16                            # rows
    tiles = np.empty(4 * 256, np.float32)
    wtail = np.zeros((32, npr), np.uint32)
    a0 = np.intp(ap.ctypes.data)
    t0 = np.intp(tiles.ctypes.data)
    o0 = np.intp(out.ctypes.data)
    ld = out.strides[0] // 4
    g_step = npr * 64
    wst = npr * 4
    _amx_config(np.intp(cfg.ctypes.data))
    n_out = w32.shape[0]
    for n0 in range(0, n_out, 32):
        nr = min(32, n_out - n0)
        if nr == 32:
            w_addr = np.intp(w32.ctypes.data) + n0 * wst
        else:
            for r in range(nr):
                wtail[r, :] = w32[n0 + r, :]
            w_addr = np.intp(wtail.ctypes.data)
        for g0 in range(0, ap.shape[0], 2):
            b0 = a0 + g0 * g_step
            mr = min(32, m_rows - g0 * 16)
            if nr == 32 and mr == 32:
                _amx_tile_out(w_addr, wst, b0, b0 + g_step, npr, t0,
                              o0 + (g0 * 16 * ld + n0) * 4, ld)
                continue
            _amx_tile(w_addr, wst, b0, b0 + g_step, npr, t0)
            for t in range(4):
                wi, gi = t // 2, t % 2
                for i in range(min(16, nr - 16 * wi)):
                    for j in range(min(16, mr - 16 * gi)):
                        out[g0 * 16 + 16 * gi + j, n0 + 16 * wi + i] = \
                            tiles[t * 256 + i * 16 + j]
    _amx_release()


def _amx_takes(npr: int) -> bool:
    """AMX tiles for this K: pairs a multiple of 16 (a tile row) and :func:`amx_enabled`."""
    return npr % 16 == 0 and amx_enabled()


def _pack_for(pairs):
    """The activations packed once for the kernel that will take them (:func:`_amx_takes`:
    :func:`_packed_amx`, else :func:`_packed`)."""
    return _packed_amx(pairs) if _amx_takes(pairs.shape[1]) else _packed(pairs)


def _gemm_any(ap, m_rows, w32, out) -> None:
    """The packed activations (:func:`_pack_for`) by one weight: AMX tiles where they run,
    else the ``vdpbf16ps`` kernel."""
    if ap.ndim == 3:
        _gemm_amx(ap, m_rows, w32, out)
    else:
        _gemm_packed(ap, m_rows, w32, out)


# ------------------------------------------------------------------ few rows (GEMV)
#: calls of at most this many activation rows take the GEMV kernel (:func:`_gemv`)
GEMV_ROWS = 8
#: weight rows (output columns) per GEMV tile: one per lane
NV = 16


def _gemv_transpose_plan() -> list[list[tuple[int, int, list[int]]]]:
    """Four rounds of two-source shuffles that transpose 16 vectors of 16 lanes (vector r,
    lane p -> vector p, lane r): round k exchanges bit k of the vector's index with bit k of
    the lane's. Per round, per output vector: (first source, second source, the 16 lanes'
    indices into the two concatenated)."""
    plan, lay = [], [[(v, i) for i in range(NV)] for v in range(NV)]
    for k in range(4):
        bit = 1 << k
        new, ops = [], []
        for v in range(NV):
            want = [lay[v][i] if (v & bit) == (i & bit) else lay[v ^ bit][i ^ bit]
                    for i in range(NV)]
            a, b = min(v, v ^ bit), max(v, v ^ bit)
            ops.append((a, b, [lay[a].index(t) if t in lay[a] else NV + lay[b].index(t)
                               for t in want]))
            new.append(want)
        plan.append(ops)
        lay = new
    if lay != [[(r, p) for r in range(NV)] for p in range(NV)]:
        raise AssertionError("GEMV transpose plan: not a transpose")
    return plan


_GEMV_PLAN = _gemv_transpose_plan()


def _emit_gemv(builder, a_i, ast, w_i, wst, nch, acc_i, mr: int) -> None:
    """The GEMV tile's loop in IR: ``mr`` activation rows (``ast`` uint32 pairs apart) times
    16 weight rows (``wst`` pairs apart), over ``nch`` chunks of 16 pairs. Per chunk the 16
    weight rows' 16 pairs are loaded as they are stored and transposed in registers
    (:data:`_GEMV_PLAN`: vector p, lane r = pair p of weight row r); then, pair by pair in
    order of K, each row's accumulator (lane r: output column r) takes the pair of that
    activation row broadcast against vector p: the operands, and the order, of
    :func:`_emit_tile`'s accumulator for the same output, so the same bits. The ``mr`` x 16
    accumulators are read from and written back to ``acc_i`` (float32)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F, [_V16F, _V32B, _V32B]), _DPBF16)
    ip = builder.inttoptr(a_i, _I32.as_pointer())
    wp = builder.inttoptr(w_i, _I32.as_pointer())
    cp = builder.inttoptr(acc_i, _V16F.as_pointer())
    undef = ir.Constant(_V16I, ir.Undefined)
    splat = ir.Constant(_V16I, [0] * NV)
    init = [builder.load(builder.gep(cp, [ir.Constant(_I64, i)]), align=4) for i in range(mr)]
    pre = builder.basic_block
    loop = builder.append_basic_block("gemv.loop")
    done = builder.append_basic_block("gemv.done")
    builder.cbranch(builder.icmp_signed(">", nch, ir.Constant(_I64, 0)), loop, done)

    builder.position_at_end(loop)
    c = builder.phi(_I64)
    acc = [builder.phi(_V16F) for _ in range(mr)]
    k0 = builder.mul(c, ir.Constant(_I64, NV))
    vecs = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(
        builder.mul(ir.Constant(_I64, r), wst), k0)]), _V16I.as_pointer()), align=4)
        for r in range(NV)]
    for ops in _GEMV_PLAN:
        vecs = [builder.shuffle_vector(vecs[a], vecs[b], ir.Constant(_V16I, mask))
                for a, b, mask in ops]
    # the next tile's weight rows follow these in memory: bring its next KiB towards L1
    pf = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32,
                                                        _I32]), "llvm.prefetch.p0i8")
    nxt = builder.add(w_i, builder.add(builder.mul(wst, ir.Constant(_I64, 4 * NV)),
                                       builder.mul(c, ir.Constant(_I64, 4 * NV * NV))))
    for line in range(NV):
        builder.call(pf, [builder.inttoptr(builder.add(nxt, ir.Constant(_I64, 64 * line)),
                                           ir.IntType(8).as_pointer()),
                          ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
    new = list(acc)
    for p in range(NV):
        wv = builder.bitcast(vecs[p], _V32B)
        for i in range(mr):
            av = builder.load(builder.gep(ip, [builder.add(
                builder.mul(ir.Constant(_I64, i), ast), builder.add(k0, ir.Constant(_I64, p)))]),
                align=4)
            ab = builder.bitcast(builder.shuffle_vector(
                builder.insert_element(undef, av, ir.Constant(_I32, 0)), undef, splat), _V32B)
            new[i] = builder.call(fn, [new[i], ab, wv])
    cn = builder.add(c, ir.Constant(_I64, 1))
    builder.cbranch(builder.icmp_signed("<", cn, nch), loop, done)
    c.add_incoming(ir.Constant(_I64, 0), pre)
    c.add_incoming(cn, loop)
    for a, n, z in zip(acc, new, init):
        a.add_incoming(z, pre)
        a.add_incoming(n, loop)

    builder.position_at_end(done)
    outs = [builder.phi(_V16F) for _ in range(mr)]
    for i, out in enumerate(outs):
        out.add_incoming(init[i], pre)
        out.add_incoming(new[i], loop)
    for i, out in enumerate(outs):
        builder.store(out, builder.gep(cp, [ir.Constant(_I64, i)]), align=4)


def gemv_ir(mr: int = GEMV_ROWS) -> str:
    """The GEMV kernel for ``mr`` rows as a stand-alone LLVM module (text): a function
    ``bf16_gemv(a, a_stride, w, w_stride, nchunks, acc)`` (i64 arguments), for compiling to
    other CPUs' code without running it (as :func:`kernel_ir`)."""
    mod = ir.Module(name="semzo_bf16_gemv")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [_I64] * 6), name="bf16_gemv")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    _emit_gemv(builder, *fn.args, mr)
    builder.ret_void()
    return str(mod)


def _make_gemv(mr: int):
    """The GEMV kernel for ``mr`` rows (:func:`_emit_gemv`): ``a_addr`` the first activation
    row's pairs, rows ``a_stride`` pairs apart; ``w_addr`` the first of 16 weight rows,
    ``w_stride`` pairs apart; ``nchunks`` chunks of 16 pairs; ``acc_addr`` mr x 16 float32
    accumulators, read and written. Addresses as integers, 4-byte aligned."""

    @intrinsic
    def gemv(typingctx, a_addr, a_stride, w_addr, w_stride, nchunks, acc_addr):
        for a in (a_addr, a_stride, w_addr, w_stride, nchunks, acc_addr):
            if not isinstance(a, types.Integer):
                return None
        sig = types.void(*([types.intp] * 6))

        def codegen(context, builder, sig, args):
            _emit_gemv(builder, *_int_args(context, builder, sig, args), mr)
            return context.get_dummy_value()

        return sig, codegen

    return gemv


(_gemv1, _gemv2, _gemv3, _gemv4, _gemv5, _gemv6, _gemv7,
 _gemv8) = (_make_gemv(r) for r in range(1, GEMV_ROWS + 1))


@njit(inline="always")
def _gemv_k(mr, a, ast, w, wst, nch, acc):
    """:func:`_make_gemv`'s kernel for ``mr`` (1 .. GEMV_ROWS) rows."""
    if mr == 1:
        _gemv1(a, ast, w, wst, nch, acc)
    elif mr == 2:
        _gemv2(a, ast, w, wst, nch, acc)
    elif mr == 3:
        _gemv3(a, ast, w, wst, nch, acc)
    elif mr == 4:
        _gemv4(a, ast, w, wst, nch, acc)
    elif mr == 5:
        _gemv5(a, ast, w, wst, nch, acc)
    elif mr == 6:
        _gemv6(a, ast, w, wst, nch, acc)
    elif mr == 7:
        _gemv7(a, ast, w, wst, nch, acc)
    else:
        _gemv8(a, ast, w, wst, nch, acc)


@njit(cache=True, nogil=True)
def _gemv(pairs, w32, out, n_lo, n_hi):
    """out[:, n_lo:n_hi] of :func:`_gemm`'s product for at most GEMV_ROWS rows, with the
    same bits: lanes over weight rows instead of activation rows, so no lane computes a row
    that is not there. The weight is read in place; the last partial chunk of pairs goes
    through zero-padded copies (a zero pair adds +0.0 to an accumulator that is never -0.0:
    its bits do not change), the last partial tile of weight rows through a zero-padded
    copy of them."""
    m_rows, npr = pairs.shape
    nfull = npr // NV
    rem = npr - NV * nfull
    acc = np.empty((GEMV_ROWS, NV), np.float32)
    atail = np.zeros((GEMV_ROWS, NV), np.uint32)
    wtail = np.zeros((NV, NV), np.uint32)
    wpad = np.zeros((NV, npr), np.uint32)
    for i in range(m_rows):
        for p in range(rem):
            atail[i, p] = pairs[i, NV * nfull + p]
    a0 = np.intp(pairs.ctypes.data)
    w0 = np.intp(w32.ctypes.data)
    c0 = np.intp(acc.ctypes.data)
    at = np.intp(atail.ctypes.data)
    wt = np.intp(wtail.ctypes.data)
    wp = np.intp(wpad.ctypes.data)
    for n0 in range(n_lo, n_hi, NV):
        nr = min(NV, n_hi - n0)
        if nr == NV:
            w_addr = w0 + n0 * npr * 4
        else:
            for r in range(NV):
                for p in range(npr):
                    wpad[r, p] = w32[n0 + r, p] if r < nr else 0
            w_addr = wp
        acc[:] = 0.0
        _gemv_k(m_rows, a0, npr, w_addr, npr, nfull, c0)
        if rem:
            for r in range(nr):
                for p in range(rem):
                    wtail[r, p] = w32[n0 + r, NV * nfull + p]
            for r in range(nr, NV):
                for p in range(rem):
                    wtail[r, p] = 0
            _gemv_k(m_rows, at, NV, wt, NV, 1, c0)
        for i in range(m_rows):
            for r in range(nr):
                out[i, n0 + r] = acc[i, r]


@njit(parallel=True, cache=True, nogil=True)
def _gemv_par(pairs, w32, out, parts):
    """:func:`_gemv` with the columns cut into ``parts`` runs of whole tiles, one per
    Numba thread (the same bits: a column's result does not depend on the cut)."""
    n_out = w32.shape[0]
    tiles = (n_out + NV - 1) // NV
    for j in prange(parts):
        lo = min(n_out, NV * (tiles * j // parts))
        hi = min(n_out, NV * (tiles * (j + 1) // parts))
        if hi > lo:
            _gemv(pairs, w32, out, lo, hi)


def _gemv_parts(n_out: int) -> int:
    """Threads for a GEMV call: Numba's (``backend.set_threads``), one on a thread that runs
    a part of a split forward (:func:`kernels.nested`), at most one per 32 columns."""
    if kernels.nested():
        return 1
    return max(1, min(_threads(), n_out // (2 * NV)))


# ------------------------------------------------------------------ float32 products, few rows
def _widen(v):
    pass


@overload(_widen)
def _ol_widen(v):
    if v == types.uint16:                         # bfloat16 bits: exact
        return lambda v: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    return lambda v: v


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def _gemv_f32(x, w, out, n_lo, n_hi):
    """out[i, n] = sum over k of x[i, k] * float32(w[n, k]) for n in [n_lo, n_hi): float32
    products and sums (bfloat16 weight bits widened in registers, exactly; float32 weights
    as they are), each output's sum in the one order LLVM's vectorized loop gives it on this
    CPU, whatever the rows and columns of the call."""
    m_rows, k_in = x.shape
    for n in range(n_lo, n_hi):
        wr = w[n]
        for i in range(m_rows):
            xr = x[i]
            acc = np.float32(0.0)
            for k in range(k_in):
                acc += xr[k] * _widen(wr[k])
            out[i, n] = acc


@njit(parallel=True, cache=True, nogil=True)
def _gemv_f32_par(x, w, out, parts):
    """:func:`_gemv_f32` with the columns cut into ``parts`` runs, one per Numba thread."""
    n_out = w.shape[0]
    for j in prange(parts):
        _gemv_f32(x, w, out, n_out * j // parts, n_out * (j + 1) // parts)


@njit(parallel=True, cache=True, nogil=True)
def _gemv_f32_many_par(x, ws, outs, parts):
    """:func:`_gemv_f32` of one x by each weight of ``ws`` into the matching ``outs``, the
    weights' rows taken as one run of outputs cut into ``parts`` runs, one per Numba thread
    (one launch for a block's q, k and v, or gate and up: the same bits, an output's sum
    does not depend on the cut)."""
    total = 0
    for m in range(len(ws)):
        total += ws[m].shape[0]
    for j in prange(parts):
        lo, hi = total * j // parts, total * (j + 1) // parts
        base = 0
        for m in range(len(ws)):
            n = ws[m].shape[0]
            a, b = max(lo, base), min(hi, base + n)
            if b > a:
                _gemv_f32(x, ws[m], outs[m], a - base, b - base)
            base += n


_num_threads = None


def _threads() -> int:
    """Numba's thread count for this thread, as ``numba.get_num_threads()`` without its
    lock and checks (about 3.5 us of a one-row GEMV's 10 us of Python): its C function once
    the pool is up."""
    global _num_threads
    if _num_threads is None:
        get_num_threads()                        # starts the pool, binds the C function
        from numba.np.ufunc import parallel
        _num_threads = getattr(parallel, "_get_num_threads", get_num_threads)
    return int(_num_threads())


def gemv_f32_usable(x, w, out) -> bool:
    """True when :func:`gemv_f32` takes these operands: NumPy, at most GEMV_ROWS rows of
    float32 activations with contiguous rows, a C-contiguous weight (out, in) of bfloat16
    bits or float32, an out of the product's shape with contiguous rows. Any CPU."""
    return (isinstance(x, np.ndarray) and isinstance(w, np.ndarray) and x.ndim == 2
            and w.ndim == 2 and 0 < x.shape[0] <= GEMV_ROWS and x.dtype == np.float32
            and w.dtype in (np.uint16, np.float32) and x.shape[1] == w.shape[1]
            and w.shape[0] > 0 and w.flags.c_contiguous and x.strides[1] == 4
            and out.shape == (x.shape[0], w.shape[0]) and out.dtype == np.float32
            and out.strides[1] == 4)


def gemv_f32_many(x, ws, outs):
    """``out[...] = x @ float32(W).T`` for each pair of ``ws`` and ``outs`` (each pair
    :func:`gemv_f32_usable`): one parallel launch instead of one a weight, the bits of
    :func:`gemv_f32`. Weights of different dtypes or outs of different layouts (which the
    launch, indexing its tuples by a loop variable, cannot take) go one :func:`gemv_f32`
    each. Returns outs."""
    ws, outs = tuple(ws), tuple(outs)
    if any(w.dtype != ws[0].dtype for w in ws) or \
            len({o.flags.c_contiguous for o in outs}) > 1:
        for w, out in zip(ws, outs):
            gemv_f32(x, w, out)
        return outs
    parts = _gemv_parts(sum(w.shape[0] for w in ws))
    if parts > 1:
        _gemv_f32_many_par(x, ws, outs, parts)
    else:                               # no parallel launch (a part of a split forward)
        for w, out in zip(ws, outs):
            _gemv_f32(x, w, out, 0, w.shape[0])
    return outs


def gemv_f32(x, w, out):
    """``out[...] = x @ float32(W).T`` for a few rows (:func:`gemv_f32_usable`; a generated
    token): float32 products reading the weight in place, each row of it once, streamed
    along K. For bfloat16 storage the float32 path upcast the whole weight (a new float32
    copy, or a per-thread buffer) to multiply one row by it; for float32 weights OpenBLAS's
    one-row products ran at 12-22 GB/s where this streams at 24-33 (AMD EPYC, 2 threads).
    Returns out."""
    parts = _gemv_parts(w.shape[0])
    if parts > 1:
        _gemv_f32_par(x, w, out, parts)
    else:
        _gemv_f32(x, w, out, 0, w.shape[0])
    return out


def usable(xb, w, out, transposed: bool) -> bool:
    """True when :func:`matmul` takes these operands (else the caller's float32 path): the
    kernel is :func:`enabled`, the weight is (out, in), K is even, the bits C-contiguous
    and 4-byte aligned (read as pairs)."""
    return (transposed and xb.ndim == 2 and w.ndim == 2 and xb.shape[1] % 2 == 0
            and xb.shape[1] == w.shape[1] and xb.shape[0] > 0 and w.shape[0] > 0
            and xb.flags.c_contiguous and w.flags.c_contiguous
            and xb.ctypes.data % 4 == 0 and w.ctypes.data % 4 == 0
            and out.shape == (xb.shape[0], w.shape[0]) and enabled())


def matmul_many(xb, ws, outs):
    """:func:`matmul` of one x by each weight of ``ws`` into the matching ``outs`` (each
    pair :func:`usable`): a block's q, k and v, or gate and up. The activations are packed
    once for all of them (3 of 5 packings a block saved: 73 us each for 512 rows of
    SmolLM2's, 1.3 % of its GEMM time; AMD EPYC); the same bits. Returns outs."""
    if xb.shape[0] <= GEMV_ROWS:
        for w, out in zip(ws, outs):
            matmul(xb, w, out)
        return outs
    pairs = xb.view(np.uint32)
    ap = _pack_for(pairs)
    for w, out in zip(ws, outs):
        _gemm_any(ap, pairs.shape[0], w.view(np.uint32), out)
    return outs


def matmul(xb, w, out):
    """``out[...] = x @ W.T`` by bfloat16 dot products: x given as its bfloat16 bits ``xb``
    (M, K), W as bfloat16 bits (N, K), ``out`` float32 (M, N) with contiguous rows (a column
    slice of a wider array is written in place). The caller checked :func:`usable`.
    Returns out."""
    pairs, w32 = xb.view(np.uint32), w.view(np.uint32)
    if pairs.shape[0] <= GEMV_ROWS:
        parts = _gemv_parts(w32.shape[0])
        if parts > 1:
            _gemv_par(pairs, w32, out, parts)
        else:
            _gemv(pairs, w32, out, 0, w32.shape[0])
    else:
        _gemm_any(_pack_for(pairs), pairs.shape[0], w32, out)
    return out
