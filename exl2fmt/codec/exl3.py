"""Numba codec for EXL3 (ExLlamaV3 trellis) linear layers: the fast twin of the NumPy oracle ``tests/exl3_oracle.py``.

Format and rounding points: spec/exl3.md sections 1-5.  Every public function is pure
(arrays in, new arrays out, no I/O) and bit-exact with the NumPy oracle ``tests/exl3_oracle.py`` (tests/test_exl3_codec.py).

Argument contracts (all arrays any memory order; they are made C-contiguous on entry):

* ``trellis``   int16 (uint16 accepted) [tiles_k, tiles_n, 8*K2]: tile (tk, tn) covers input rows
                16 tk .. 16 tk + 15 and output columns 16 tn .. 16 tn + 15 of W_hat [in_p, out_p]; its words
                form one tail-biting ring of 128*K2 bits (spec/exl3.md, section 2).
* ``K2``        int, 2 * bits per weight: 2..16, or 3 / 5 / 7 for the half rates 1.5 / 2.5 / 3.5 (mul1 only).
* ``codebook``  "3inst", "mcg" or "mul1" (the marker tensor present: none / mcg / mul1).
* ``suh``       float16 [in_p]  input-side scales; with ``legacy_signs=True`` the legacy ``su``:
                int16 [in_p / 16], 16 signs per word, LSB first, set bit = -1.
* ``svh``       float16 [out_p] output-side scales; legacy ``sv``: int16 [out_p / 16].

Outputs: ``decode_states`` uint16 [in_p, out_p] and ``inner_weight`` float16 [in_p, out_p], row-major with
rows = input features (W_hat as exllamav3 reconstructs it); ``dequantize`` float16 [out_features, in_features],
C order (``nn.Linear.weight``).

How ``dequantize`` runs.  Every step of the Hadamard stage stays inside a 128 x 128 block of W_hat (spec/exl3.md
section 5).  A work item is 128 input rows x 512 output columns (the _LANES = 32 tiles of a tile row, side by
side in the SIMD lanes: the same ring position has the same window offset in every tile); items are spread
over the threads in static chunks that reuse their buffers.

1. ring words of the item's 8 x 32 tiles as uint32 wt [8, 4 K2 + 1, 32] (tile row, word, tile column), the
   first word repeated at the end so that a 16-bit window never needs a modulo (32 x 32 register transposes
   of the trellis when 8 K2 is a multiple of 32);
2. for each tile column c (16): the 128 input rows j of the 32 output columns n = 16 tn + c are decoded
   (window -> codebook -> fp32) 8 rows at a time straight into the butterflies of widths 1, 2, 4 (registers),
   then into G [128, 32]; widths 8, 16, 32 run over the rows of G (radix 8, 32 lanes at once) and width 64
   also forms A = fp16(. * s), B = fp16(A * suh[j]) into
   G16 [128, 32] uint16, which goes transposed (32 x 32 in registers) into Z [512, 128] (row 32 c + l);
3. for each 128 output columns x 32 input rows slice: the right Hadamard over n reads Z in its first stage
   and its last stage forms C = fp16(. * s), D = fp16(C * svh[n]) straight into out[n, j] (64-byte rows).

The butterflies run in the oracle's hadamard_128's order (widths 1, 2, 4, ..., 64, each add/sub rounded to fp32, then
one fp32 multiply by s = fp32(1/sqrt(128))), up to three stages at a time in registers (radix 8; radix 4 in the
portable loops): the very same operations in the same order, so the
result is bit-identical.  Where the CPU has no hardware fp16 conversion (HW_HALF false) the portable loop twins
of these steps run instead (same bits; test_loop_fallback_path).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..layout import EXL3_CODEBOOKS, Exl3Slot
from .exl2 import transpose_store  # 32 x 32 uint16 transpose in registers
from .f16 import HW_HALF, f16_bits_to_f32, f32_to_f16_bits

__all__ = ["CODEBOOKS", "decode_states", "inner_weight", "dequantize", "unpack_sign_bits", "check_k2"]

#: codebook name ("3inst", "mcg", "mul1": the layout table's EXL3_CODEBOOKS) -> kernel id
CODEBOOKS = {name: i for i, name in enumerate(EXL3_CODEBOOKS)}
_MUL1 = EXL3_CODEBOOKS[2]
_MULT = (89226354, 0xCBAC1FED)      # lop3 codebooks: x = s * mult + add (mod 2^32)
_ADD = (64248484, 0)
_MUL1_MULT = 0x83DCD12D
_MUL1_K = np.float32(np.array(0x1EEE, dtype=np.uint16).view(np.float16))   # fp16 0x1EEE, exact in fp32
_MUL1_C = np.float32(np.array(0xC931, dtype=np.uint16).view(np.float16))   # fp16 0xC931
_HAD_S = np.float32(1.0 / np.sqrt(128.0))                                  # bits 0x3DB504F3

_LANES = 32     # tiles of one tile row decoded side by side (SIMD lanes): 512 output columns
_SLICE = 32     # Z columns per right-Hadamard pass: F = 128 x 32 fp32 = 16 KiB (L1)
_VEC = 32       # columns of G and F: the butterflies work on <32 x float> rows


# ----------------------------------------------------------------------------------------------
# 32-bit integer intrinsics (Numba widens uint32 arithmetic to 64 bits, halving the vector width)
# ----------------------------------------------------------------------------------------------

def _as_i32(builder, v, t):
    i32 = ir.IntType(32)
    if t.bitwidth > 32:
        return builder.trunc(v, i32)
    if t.bitwidth < 32:
        return builder.zext(v, i32)
    return v


def _binop32(op):
    @intrinsic
    def f(typingctx, a, b):
        if not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            x, y = (_as_i32(builder, v, t) for v, t in zip(args, signature.args))
            return getattr(builder, op)(x, y)

        return types.uint32(a, b), codegen

    return f


_mul32 = _binop32("mul")
_add32 = _binop32("add")
_and32 = _binop32("and_")
_xor32 = _binop32("xor")
_shl32 = _binop32("shl")
_lshr32 = _binop32("lshr")


@intrinsic
def _window16(typingctx, hi, lo, off):
    """(hi:lo << off) >> 48 for 0 <= off < 32: the 16 ring bits starting ``off`` bits into word ``hi``
    (MSB first), with the bits past the word taken from ``lo``.  One llvm.fshl.i32 and a shift."""
    if not all(isinstance(t, types.Integer) for t in (hi, lo, off)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a, b, s = (_as_i32(builder, v, t) for v, t in zip(args, signature.args))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, i32, i32]), "llvm.fshl.i32")
        return builder.lshr(builder.call(fn, [a, b, s]), ir.Constant(i32, 16))

    return types.uint32(hi, lo, off), codegen


@intrinsic
def _lo16(typingctx, x):
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.trunc(args[0], ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def _hi16(typingctx, x):
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = _as_i32(builder, args[0], signature.args[0])
        return builder.trunc(builder.lshr(v, ir.Constant(ir.IntType(32), 16)), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def _small_to_f32(typingctx, x):
    """uint32 below 2^31 -> float32 (exact for the byte sums here): a signed conversion, which vectorises."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.sitofp(_as_i32(builder, args[0], signature.args[0]), ir.FloatType())

    return types.float32(x), codegen


# ----------------------------------------------------------------------------------------------
# Codebooks: 16-bit state (uint32) -> the fp16 value, returned as float32 (exact)
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _cb_lop3(s, mult, add):
    """3INST / MCG: x = s * mult + add, lop3 (x & 0x8FFF8FFF) ^ 0x3B603B60, fp16(lo half + hi half).
    The sum of the two fp16 halves is exact in fp32, so one rounding to fp16 follows."""
    x = _xor32(_and32(_add32(_mul32(s, mult), add), np.uint32(0x8FFF8FFF)), np.uint32(0x3B603B60))
    v = f16_bits_to_f32(_lo16(x)) + f16_bits_to_f32(_hi16(x))
    return f16_bits_to_f32(f32_to_f16_bits(v))


@njit(cache=True, inline="always")
def _cb_mul1(s):
    """MUL1: x = s * 0x83DCD12D, h = 1024 + byte sum of x, fp16(h * fp16(0x1EEE) + fp16(0xC931)); the product
    (<= 22 significant bits) and the sum (a multiple of 2^-18 below 16) are exact in fp32: one rounding."""
    x = _mul32(s, np.uint32(_MUL1_MULT))
    m = np.uint32(0xFF)
    b = _add32(_add32(_and32(x, m), _and32(_lshr32(x, 8), m)), _add32(_and32(_lshr32(x, 16), m), _lshr32(x, 24)))
    h = _small_to_f32(b) + np.float32(1024.0)
    return f16_bits_to_f32(f32_to_f16_bits(h * _MUL1_K + _MUL1_C))


# ----------------------------------------------------------------------------------------------
# Ring tables
# ----------------------------------------------------------------------------------------------

def check_k2(K2) -> int:
    """K2 = 2 * rate as an int; ValueError unless it is one exllamav3 reads (2..16, 3, 5, 7)."""
    if isinstance(K2, (bool, np.bool_)) or not isinstance(K2, (int, np.integer)):
        raise ValueError(f"K2 must be an int (2 * bits per weight), got {K2!r}")
    k2 = int(K2)
    if not (2 <= k2 <= 16 or k2 in (3, 5, 7)):
        raise ValueError(f"K2 = {k2} is not an EXL3 rate (2 * rate with rate 1..8, 1.5, 2.5, 3.5)")
    return k2


def _ring_tables(k2: int):
    """Per ring position t (0..255): the window's first 32-bit word and bit offset in it, and tpos [16, 16]:
    tpos[c, r] = the ring position holding tile element (row r, column c) (tensor-core order, spec/exl3.md)."""
    t = np.arange(256, dtype=np.int64)
    e = ((t + 1) * k2) // 2                                  # window end e(t) (spec/exl3.md)
    p = (e - 16) % (128 * k2)                                # window start, wrapped (tail-biting)
    lane, j = t // 8, t % 8
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = lane // 4 + 8 * (j >> 2)
    tpos = np.empty((16, 16), dtype=np.int64)
    tpos[c, r] = t
    return p >> 5, p & 31, tpos


def _prep_trellis(trellis, k2: int) -> np.ndarray:
    tr = np.asarray(trellis)
    if tr.ndim != 3 or tr.dtype not in (np.int16, np.uint16):
        raise ValueError(f"trellis must be int16 [tiles_k, tiles_n, 8*K2], got {tr.dtype} {tr.shape}")
    if tr.shape[2] != 8 * k2:
        raise ValueError(f"trellis last dim {tr.shape[2]} != 8 * K2 = {8 * k2}")
    return np.ascontiguousarray(tr).view(np.uint16)


def _codebook_id(codebook, k2: int) -> int:
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {sorted(CODEBOOKS)}, got {codebook!r}")
    if k2 % 2 and codebook != _MUL1:
        raise ValueError(f"half rate {k2 / 2} requires the mul1 codebook, got {codebook!r}")
    return CODEBOOKS[codebook]


# ----------------------------------------------------------------------------------------------
# Shared decode step: 8 tiles of one tile row, side by side in the lanes
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def _load_rings_t(tr, tk, tn0, wt, b, T16):
    """_load_rings for a full set of _LANES tiles when 8 K2 is a multiple of 32 (K2 = 4, 8, 12, 16): the tiles'
    words are a [_LANES, 8 K2] uint16 block of tr[tk], transposed 32 x 32 at a time in registers into
    T16 uint16 [>= 8 K2, _LANES], then paired into 32-bit words along the lanes (a vector loop)."""
    L = tr.shape[2]
    src = tr[tk]
    for m in range(0, L, 32):
        transpose_store(src, tn0, m, T16, m, 0)
    dst = wt[b]
    W = dst.shape[1]
    nw = L // 2
    for q in range(nw):
        lo = T16[2 * q]
        hi = T16[2 * q + 1]
        d = dst[q]
        for l in range(W):
            d[l] = _add32(lo[l], _shl32(hi[l], 16))
    d0 = dst[0]
    dn = dst[nw]
    for l in range(W):
        dn[l] = d0[l]


@njit(cache=True, inline="always")
def _load_rings(tr, tk, tn0, nlanes, wt, b):
    """wt[b, q, l] = 32-bit ring word q of tile (tk, tn0 + l) (u16 word 2q low, 2q+1 high), q < 4 K2, and
    wt[b, 4 K2, l] = wt[b, 0, l]; lanes l >= nlanes are 0.
    tr uint16 [tiles_k, tiles_n, 8 K2]; wt uint32 [*, 4 K2 + 1, _LANES]."""
    nw = tr.shape[2] // 2
    dst = wt[b]                      # views: no negative-index fix-ups in the loops
    for l in range(_LANES):
        if l < nlanes:
            src = tr[tk, tn0 + l]
            for q in range(nw):
                dst[q, l] = _add32(src[2 * q], _shl32(src[2 * q + 1], 16))
            dst[nw, l] = dst[0, l]
        else:
            for q in range(nw + 1):
                dst[q, l] = 0


@njit(cache=True, inline="always")
def _decode_pos(wt, b, i, o, cbk, mult, add, dst, row):
    """dst[row, l] = codebook value (fp32) of ring position with window word i, offset o, for the 8 lanes."""
    # row views: indices computed from arguments would each get Numba's negative-index wraparound code,
    # which stops LLVM from vectorising the lane loop
    W = wt.shape[2]
    hi = wt[b, i]
    lo = wt[b, i + 1]
    d = dst[row]
    if cbk == 2:
        for l in range(W):
            d[l] = _cb_mul1(_window16(hi[l], lo[l], o))
    else:
        for l in range(W):
            d[l] = _cb_lop3(_window16(hi[l], lo[l], o), mult, add)


@njit(cache=True, parallel=True)
def _states_kernel(tr, widx, woff, tpos, out):
    """out uint16 [16 tiles_k, 16 tiles_n] = states (row-major tiles)."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + _LANES - 1) // _LANES
    for item in prange(tiles_k * ng):
        tk = item // ng
        tn0 = (item % ng) * _LANES
        nl = min(_LANES, tiles_n - tn0)
        wt = np.empty((1, L // 2 + 1, _LANES), dtype=np.uint32)
        _load_rings(tr, tk, tn0, nl, wt, 0)
        st = np.empty(_LANES, dtype=np.uint32)
        for c in range(16):
            for r in range(16):
                t = tpos[c, r]
                i = widx[t]
                o = woff[t]
                for l in range(_LANES):
                    st[l] = _window16(wt[0, i, l], wt[0, i + 1, l], o)
                for l in range(nl):
                    out[16 * tk + r, 16 * (tn0 + l) + c] = np.uint16(st[l])


@njit(cache=True, parallel=True)
def _inner_kernel(tr, widx, woff, tpos, cbk, mult, add, out):
    """out uint16 [16 tiles_k, 16 tiles_n] = fp16 bits of W_hat."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + _LANES - 1) // _LANES
    for item in prange(tiles_k * ng):
        tk = item // ng
        tn0 = (item % ng) * _LANES
        nl = min(_LANES, tiles_n - tn0)
        wt = np.empty((1, L // 2 + 1, _LANES), dtype=np.uint32)
        _load_rings(tr, tk, tn0, nl, wt, 0)
        v = np.empty((1, _LANES), dtype=np.float32)
        for c in range(16):
            for r in range(16):
                t = tpos[c, r]
                _decode_pos(wt, 0, widx[t], woff[t], cbk, mult, add, v, 0)
                for l in range(nl):
                    out[16 * tk + r, 16 * (tn0 + l) + c] = f32_to_f16_bits(v[0, l])


# ----------------------------------------------------------------------------------------------
# Hadamard: butterflies over the rows of a [128, W] fp32 buffer, widths 1..64, radix 4
# ----------------------------------------------------------------------------------------------

def _is_f32_c2(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == types.float32


def _butterfly_codegen(context, builder, signature, args, radix):
    """Rows i + k w (k < radix) of a float32 [*, _VEC] C array, loaded as <_VEC x float> vectors."""
    arr_v, i_v, w_v = args
    a = context.make_array(signature.args[0])(context, builder, arr_v)
    cols = builder.extract_value(a.shape, 1)
    vec = ir.VectorType(ir.FloatType(), _VEC).as_pointer()
    ptrs = []
    for k in range(radix):
        row = builder.add(i_v, builder.mul(w_v, ir.Constant(ir.IntType(64), k)))
        ptrs.append(builder.bitcast(builder.gep(a.data, [builder.mul(row, cols)]), vec))
    x = []
    for p in ptrs:
        ld = builder.load(p)
        ld.align = 4
        x.append(ld)
    if radix == 2:
        y = [builder.fadd(x[0], x[1]), builder.fsub(x[0], x[1])]
    else:  # stage w: (x0, x1), (x2, x3); stage 2w: (y0, y2), (y1, y3) -- the two radix-2 passes' very operations
        y0, y1 = builder.fadd(x[0], x[1]), builder.fsub(x[0], x[1])
        y2, y3 = builder.fadd(x[2], x[3]), builder.fsub(x[2], x[3])
        y = [builder.fadd(y0, y2), builder.fadd(y1, y3), builder.fsub(y0, y2), builder.fsub(y1, y3)]
    for p, v in zip(ptrs, y):
        st = builder.store(v, p)
        st.align = 4
    return context.get_dummy_value()


@intrinsic
def _bfly2_rows(typingctx, arr, i, w):
    """(row i, row i + w) -> (a + b, a - b) over the first _VEC columns; float32 2-D C array, no bounds check.
    (An explicit vector: LLVM does not vectorise the scalar loop, whose aliasing it cannot rule out.)"""
    if not _is_f32_c2(arr):
        return None
    return types.void(arr, types.intp, types.intp), lambda c, b, sg, a: _butterfly_codegen(c, b, sg, a, 2)


@intrinsic
def _bfly4_rows(typingctx, arr, i, w):
    """Stages w and 2w on rows i, i + w, i + 2w, i + 3w (radix 4, the same operations as two radix-2 stages)."""
    if not _is_f32_c2(arr):
        return None
    return types.void(arr, types.intp, types.intp), lambda c, b, sg, a: _butterfly_codegen(c, b, sg, a, 4)


@njit(cache=True, inline="always")
def _wht128_rows(buf):
    """Unscaled WHT over the 128 rows of buf float32 [128, _VEC]: widths 1, 2 | 4, 8 | 16, 32 | 64."""
    for w in (1, 4, 16):
        for base in range(0, 128, 4 * w):
            for i in range(base, base + w):
                _bfly4_rows(buf, i, w)
    for i in range(64):
        _bfly2_rows(buf, i, 64)


# ----------------------------------------------------------------------------------------------
# Full dequantization
# ----------------------------------------------------------------------------------------------

# The elementwise steps live in functions of their own (compiled apart, not inlined), whose lane loops run to
# runtime bounds: inside the kernel Numba's array analysis turns the bounds into constants, LLVM then unrolls
# the 32-trip loops completely and fails to re-vectorise them (it cannot rule out aliasing without the loop
# vectoriser's runtime checks) -- 10x slower, measured.

@njit(cache=True)
def _round_rows_loop(G, suh, j0, nrows, G16):
    """G16[j, :] = fp16 bits of fp16(fp16(G[j, :] * s) * suh[j0 + j]) for j < nrows (A, then B).
    G float32 [>= nrows, W], G16 uint16 [>= nrows, W], suh float32."""
    s = _HAD_S
    W = G.shape[1]
    for j in range(nrows):
        sj = suh[j0 + j]
        g = G[j]
        g16 = G16[j]
        for l in range(W):
            a = f16_bits_to_f32(f32_to_f16_bits(g[l] * s))
            g16[l] = f32_to_f16_bits(a * sj)


@njit(cache=True)
def _load_slice_loop(Z, nb, jc, F):
    """F[n, :] = Z[_LANES (n % 16) + 8 nb + n // 16, jc : jc + W] as float32, n < 128: the B values of output
    columns 128 nb + n of the work item (Z row 32 c + l holds column 16 l + c). Z uint16, F float32 [128, W]."""
    W = F.shape[1]
    for n in range(128):
        z = Z[_LANES * (n & 15) + 8 * nb + (n >> 4), jc:jc + W]   # a view (see _decode_pos)
        f = F[n]
        for jj in range(W):
            f[jj] = f16_bits_to_f32(z[jj])


@njit(cache=True)
def _store_slice_loop(F, svh, n0, nrows, ncols, out, col0):
    """out[n0 + n, col0 + jj] = fp16(fp16(F[n, jj] * s) * svh[n0 + n]) (C, then D), n < nrows, jj < ncols."""
    s = _HAD_S
    for n in range(nrows):
        sv = svh[n0 + n]
        f = F[n]
        o = out[n0 + n, col0:col0 + ncols]
        for jj in range(ncols):
            cval = f16_bits_to_f32(f32_to_f16_bits(f[jj] * s))
            o[jj] = f32_to_f16_bits(cval * sv)


# Vector code for targets with hardware fp16 conversion (HW_HALF: x86 F16C, Arm): LLVM IR on <32 x float> /
# <32 x half> rows, so nothing depends on the loop vectoriser.  fmul without fast-math flags is the IEEE
# multiply, fptrunc to half rounds to nearest even: the same numbers as the portable loops above.

def _row_ptr(context, builder, aty, arr, row, col, elem):
    a = context.make_array(aty)(context, builder, arr)
    off = builder.add(builder.mul(row, builder.extract_value(a.shape, 1)), col)
    return builder.bitcast(builder.gep(a.data, [off]), ir.VectorType(elem, _VEC).as_pointer())


def _vload(builder, ptr, align):
    v = builder.load(ptr)
    v.align = align
    return v


def _vstore(builder, v, ptr, align):
    st = builder.store(v, ptr)
    st.align = align


def _splat(builder, x):
    vty = ir.VectorType(ir.FloatType(), _VEC)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), _VEC), [0] * _VEC))


def _round_twice(builder, v, s, m):
    """fp16 bits of fp16(fp16(v * s) * m), v <_VEC x float>, s and m float scalars."""
    half = ir.VectorType(ir.HalfType(), _VEC)
    a = builder.fpext(builder.fptrunc(builder.fmul(v, _splat(builder, s)), half), ir.VectorType(ir.FloatType(), _VEC))
    return builder.bitcast(builder.fptrunc(builder.fmul(a, _splat(builder, m)), half), ir.VectorType(ir.IntType(16), _VEC))


def _is_c2(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == dtype


def _decode_value(context, builder, wt_ty, wt_v, b_v, i_v, o_v, mult_v, add_v, mul1):
    """<_VEC x float>: the fp16 codebook values of the windows (wt[b, i, :] : wt[b, i + 1, :]) << o."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    v32 = ir.VectorType(i32, _VEC)
    vf = ir.VectorType(f32, _VEC)
    vh = ir.VectorType(ir.HalfType(), _VEC)
    a = context.make_array(wt_ty)(context, builder, wt_v)
    nq = builder.extract_value(a.shape, 1)
    off = builder.mul(builder.add(builder.mul(b_v, nq), i_v), ir.Constant(i64, _VEC))
    p_hi = builder.bitcast(builder.gep(a.data, [off]), v32.as_pointer())
    p_lo = builder.bitcast(builder.gep(a.data, [builder.add(off, ir.Constant(i64, _VEC))]), v32.as_pointer())
    hi, lo = _vload(builder, p_hi, 4), _vload(builder, p_lo, 4)

    def splat_i(x):
        v = builder.insert_element(ir.Constant(v32, ir.Undefined), builder.trunc(x, i32) if x.type != i32 else x,
                                   ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(v32, ir.Undefined), ir.Constant(v32, [0] * _VEC))

    def const_i(c):
        return ir.Constant(v32, [c] * _VEC)

    fshl = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32, v32, v32]), "llvm.fshl.v%di32" % _VEC)
    st = builder.lshr(builder.call(fshl, [hi, lo, splat_i(o_v)]), const_i(16))
    if mul1:
        x = builder.mul(st, const_i(_MUL1_MULT - (1 << 32)))
        m = const_i(0xFF)
        bsum = builder.add(builder.add(builder.and_(x, m), builder.and_(builder.lshr(x, const_i(8)), m)),
                           builder.add(builder.and_(builder.lshr(x, const_i(16)), m), builder.lshr(x, const_i(24))))
        h = builder.fadd(builder.sitofp(bsum, vf), ir.Constant(vf, [1024.0] * _VEC))
        v = builder.fadd(builder.fmul(h, ir.Constant(vf, [float(_MUL1_K)] * _VEC)), ir.Constant(vf, [float(_MUL1_C)] * _VEC))
    else:
        x = builder.add(builder.mul(st, splat_i(mult_v)), splat_i(add_v))
        x = builder.xor(builder.and_(x, const_i(0x8FFF8FFF - (1 << 32))), const_i(0x3B603B60))
        v16 = ir.VectorType(ir.IntType(16), _VEC)
        lo16 = builder.fpext(builder.bitcast(builder.trunc(x, v16), vh), vf)
        hi16 = builder.fpext(builder.bitcast(builder.trunc(builder.lshr(x, const_i(16)), v16), vh), vf)
        v = builder.fadd(lo16, hi16)
    return builder.fpext(builder.fptrunc(v, vh), vf)   # RN16, kept in fp32


def _butterflies(builder, x):
    """Radix-len(x) butterflies on rows x[m] = row i + m w: stages w, 2w, ... in order, each pairing
    (x[m], x[m + h]) -> (a + b, a - b) -- exactly the operations of consecutive radix-2 passes."""
    x = list(x)
    h = 1
    while h < len(x):
        for m in range(len(x)):
            if not m & h:
                x[m], x[m + h] = builder.fadd(x[m], x[m + h]), builder.fsub(x[m], x[m + h])
        h *= 2
    return x


def _decode8_codegen(context, builder, sig, args, mul1):
    wt_v, b_v, it_v, ot_v, c_v, r0_v, mult_v, add_v, dst_v, row_v = args
    i64 = ir.IntType(64)
    it = context.make_array(sig.args[2])(context, builder, it_v)
    ot = context.make_array(sig.args[3])(context, builder, ot_v)
    base = builder.add(builder.mul(c_v, builder.extract_value(it.shape, 1)), r0_v)
    x = []
    for m in range(8):
        k = builder.add(base, ir.Constant(i64, m))
        i_m = builder.load(builder.gep(it.data, [k]))
        o_m = builder.load(builder.gep(ot.data, [k]))
        x.append(_decode_value(context, builder, sig.args[0], wt_v, b_v, i_m, o_m, mult_v, add_v, mul1))
    for m, v in enumerate(_butterflies(builder, x)):
        ptr = _row_ptr(context, builder, sig.args[8], dst_v, builder.add(row_v, ir.Constant(i64, m)),
                       ir.Constant(i64, 0), ir.FloatType())
        _vstore(builder, v, ptr, 4)
    return context.get_dummy_value()


def _decode8_intrinsic(mul1):
    @intrinsic
    def f(typingctx, wt, b, itab, otab, c, r0, mult, add, dst, row0):
        """Decode tile elements (row r0 + m, column c), m < 8, of the _VEC tiles in wt[b] (window word
        itab[c, r0 + m], offset otab[c, r0 + m]), apply the Hadamard widths 1, 2, 4 to the 8 rows in registers
        and store them as dst[row0 + m, :_VEC].  itab/otab int64 [16, 16] C, dst float32 2-D C."""
        if not (isinstance(wt, types.Array) and wt.ndim == 3 and wt.layout == "C" and wt.dtype == types.uint32
                and _is_c2(itab, types.int64) and _is_c2(otab, types.int64) and _is_c2(dst, types.float32)):
            return None
        sig = types.void(wt, types.intp, itab, otab, types.intp, types.intp, types.uint32, types.uint32, dst,
                         types.intp)
        return sig, lambda c_, b_, s_, a_: _decode8_codegen(c_, b_, s_, a_, mul1)

    return f


_decode8_lop3 = _decode8_intrinsic(False)
_decode8_mul1 = _decode8_intrinsic(True)


@intrinsic
def _bfly8_rows(typingctx, arr, i, w):
    """Stages w, 2w, 4w on rows i + m w, m < 8 (radix 8, in registers)."""
    if not _is_f32_c2(arr):
        return None

    def codegen(context, builder, sig, args):
        arr_v, i_v, w_v = args
        i64 = ir.IntType(64)
        ptrs = [_row_ptr(context, builder, sig.args[0], arr_v, builder.add(i_v, builder.mul(w_v, ir.Constant(i64, m))),
                         ir.Constant(i64, 0), ir.FloatType()) for m in range(8)]
        x = [_vload(builder, p, 4) for p in ptrs]
        for p, v in zip(ptrs, _butterflies(builder, x)):
            _vstore(builder, v, p, 4)
        return context.get_dummy_value()

    return types.void(arr, types.intp, types.intp), codegen


@njit(cache=True)
def _decode_left_vec(wt, itab, otab, c, cbk, mult, add, suh, j0, G, G16):
    """Tile column c of the item: decode + widths 1, 2, 4 (8 rows at a time in registers), widths 8, 16, 32
    (radix 8), width 64 with the A/B roundings into G16 (fp16 bits of B)."""
    for tkl in range(8):
        for r0 in range(0, 16, 8):
            if cbk == 2:
                _decode8_mul1(wt, tkl, itab, otab, c, r0, mult, add, G, 16 * tkl + r0)
            else:
                _decode8_lop3(wt, tkl, itab, otab, c, r0, mult, add, G, 16 * tkl + r0)
    for i in range(8):
        _bfly8_rows(G, i, 8)
    for i in range(8):
        _bfly8_rows(G, 64 + i, 8)
    s = _HAD_S
    for i in range(64):
        _bfly2_round(G, i, 64, s, suh[j0 + i], suh[j0 + i + 64], G16, i, i + 64, 0)


# Fused passes (HW_HALF): the decode feeds the first three butterfly stages in registers, the first pass of
# the right Hadamard reads Z itself, and the last pass of either Hadamard rounds and stores.

@intrinsic
def _bfly8_widen(typingctx, Z, zr0, zstep, zc, F, i):
    """F[i + m, :] for m < 8 = widths 1, 2, 4 of the butterflies (in registers) applied to the float32 of
    Z[zr0 + m zstep, zc : zc + _VEC] (fp16 bits). Z uint16, F float32 2-D C."""
    if not (_is_c2(Z, types.uint16) and _is_c2(F, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        zv, r0, rs, zc_, fv, i_ = args
        i64 = ir.IntType(64)
        vf = ir.VectorType(ir.FloatType(), _VEC)
        x = []
        for m in range(8):
            row = builder.add(r0, builder.mul(rs, ir.Constant(i64, m)))
            h = _vload(builder, _row_ptr(context, builder, sig.args[0], zv, row, zc_, ir.IntType(16)), 2)
            x.append(builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), _VEC)), vf))
        for m, v in enumerate(_butterflies(builder, x)):
            ptr = _row_ptr(context, builder, sig.args[4], fv, builder.add(i_, ir.Constant(i64, m)), ir.Constant(i64, 0), ir.FloatType())
            _vstore(builder, v, ptr, 4)
        return context.get_dummy_value()

    return types.void(Z, types.intp, types.intp, types.intp, F, types.intp), codegen


@intrinsic
def _bfly2_round(typingctx, src, i, w, s, m0, m1, dst, d0, d1, dcol):
    """Last butterfly stage fused with the rounding: a = src[i], b = src[i + w] (float32 rows of _VEC);
    dst[d0, dcol:+_VEC] = fp16(fp16((a + b) s) m0), dst[d1, dcol:+_VEC] = fp16(fp16((a - b) s) m1)."""
    if not (_is_c2(src, types.float32) and _is_c2(dst, types.uint16)):
        return None

    def codegen(context, builder, sig, args):
        sv, i_, w_, sc, m0_, m1_, dv, d0_, d1_, dc = args
        i64 = ir.IntType(64)
        z = ir.Constant(i64, 0)
        a = _vload(builder, _row_ptr(context, builder, sig.args[0], sv, i_, z, ir.FloatType()), 4)
        b = _vload(builder, _row_ptr(context, builder, sig.args[0], sv, builder.add(i_, w_), z, ir.FloatType()), 4)
        _vstore(builder, _round_twice(builder, builder.fadd(a, b), sc, m0_),
                _row_ptr(context, builder, sig.args[6], dv, d0_, dc, ir.IntType(16)), 2)
        _vstore(builder, _round_twice(builder, builder.fsub(a, b), sc, m1_),
                _row_ptr(context, builder, sig.args[6], dv, d1_, dc, ir.IntType(16)), 2)
        return context.get_dummy_value()

    sig = types.void(src, types.intp, types.intp, types.float32, types.float32, types.float32, dst, types.intp,
                     types.intp, types.intp)
    return sig, codegen


@njit(cache=True)
def _right_had_vec(Z, nb, jc, F, svh, n0, nrows, ncols, out, col0):
    """The right Hadamard of one 128 x _VEC slice and the stores: out[n0 + n, col0 + jj] = D of output column
    n0 + n (n < nrows, jj < ncols), from Z rows _LANES (n % 16) + 8 nb + n // 16, columns jc.. (see _load_slice)."""
    for i in range(0, 128, 8):   # rows i..i+7: same n // 16, n % 16 = i % 16 + m
        _bfly8_widen(Z, _LANES * (i & 15) + 8 * nb + (i >> 4), _LANES, jc, F, i)
    for i in range(8):
        _bfly8_rows(F, i, 8)
    for i in range(8):
        _bfly8_rows(F, 64 + i, 8)
    if nrows == 128 and ncols == _VEC:
        s = _HAD_S
        for i in range(64):
            _bfly2_round(F, i, 64, s, svh[n0 + i], svh[n0 + i + 64], out, n0 + i, n0 + i + 64, col0)
    else:
        for i in range(64):
            _bfly2_rows(F, i, 64)
        _store_slice_loop(F, svh, n0, nrows, ncols, out, col0)


@njit(cache=True)
def _decode_left_loop(wt, itab, otab, c, cbk, mult, add, suh, j0, G, G16):
    for tkl in range(8):
        for r in range(16):
            _decode_pos(wt, tkl, itab[c, r], otab[c, r], cbk, mult, add, G, 16 * tkl + r)
    _wht128_rows(G)
    _round_rows_loop(G, suh, j0, 128, G16)


@njit(cache=True)
def _right_had_loop(Z, nb, jc, F, svh, n0, nrows, ncols, out, col0):
    _load_slice_loop(Z, nb, jc, F)
    _wht128_rows(F)
    _store_slice_loop(F, svh, n0, nrows, ncols, out, col0)


if HW_HALF:
    _decode_left, _right_had = _decode_left_vec, _right_had_vec
else:  # pragma: no cover - software fp16 (no F16C): the loops
    _decode_left, _right_had = _decode_left_loop, _right_had_loop


@njit(cache=True, parallel=True)
def _dequant_kernel(tr, itab, otab, cbk, mult, add, suh, svh, out, n_chunks):
    """tr uint16 [tiles_k, tiles_n, 8 K2] (tiles_k, tiles_n multiples of 8); suh float32 [in_p];
    svh float32 [out_p]; out uint16 [out_features, in_features] (fp16 bits), C order.

    Work item: 128 input rows x 512 output columns (the _LANES = 32 tiles of a tile row side by side)."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + _LANES - 1) // _LANES
    n_items = (tiles_k // 8) * ng
    n_chunks = max(1, min(n_items, n_chunks))
    for chunk in prange(n_chunks):
        # buffers once per chunk of work items (Z alone is 128 KiB: malloc would mmap and fault it in each time)
        wt = np.empty((8, L // 2 + 1, _LANES), dtype=np.uint32)
        G = np.empty((128, _LANES), dtype=np.float32)
        G16 = np.empty((128, _LANES), dtype=np.uint16)
        Z = np.empty((16 * _LANES, 128), dtype=np.uint16)   # row 32 c + l: output column 16 (tn0 + l) + c
        F = np.empty((128, _SLICE), dtype=np.float32)
        T16 = np.empty((L, _LANES), dtype=np.uint16)
        for item in range(chunk * n_items // n_chunks, (chunk + 1) * n_items // n_chunks):
            _dequant_item(tr, itab, otab, cbk, mult, add, suh, svh, out, item, ng, wt, G, G16, Z, F, T16)


@njit(cache=True)
def _dequant_item(tr, itab, otab, cbk, mult, add, suh, svh, out, item, ng, wt, G, G16, Z, F, T16):
    """One work item of _dequant_kernel: input rows 128 bi.., output columns 16 tn0 .. 16 tn0 + 511."""
    tiles_n = tr.shape[1]
    n_out, n_in = out.shape
    bi = item // ng
    tn0 = (item - bi * ng) * _LANES
    nl = min(_LANES, tiles_n - tn0)          # a multiple of 8
    j0 = 128 * bi
    if nl == _LANES and tr.shape[2] % 32 == 0:
        for tkl in range(8):
            _load_rings_t(tr, 8 * bi + tkl, tn0, wt, tkl, T16)
    else:
        for tkl in range(8):
            _load_rings(tr, 8 * bi + tkl, tn0, nl, wt, tkl)
    for c in range(16):
        _decode_left(wt, itab, otab, c, cbk, mult, add, suh, j0, G, G16)
        for jb in range(0, 128, 32):
            transpose_store(G16, jb, 0, Z, _LANES * c, jb)
    for nb in range(nl // 8):
        n0 = 16 * tn0 + 128 * nb
        nrows = min(128, n_out - n0)
        if nrows <= 0:
            break
        for jc in range(0, 128, _SLICE):
            ncols = min(_SLICE, n_in - j0 - jc)
            if ncols <= 0:
                break
            _right_had(Z, nb, jc, F, svh, n0, nrows, ncols, out, j0 + jc)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def decode_states(trellis: np.ndarray, K2: int) -> np.ndarray:
    """int16 trellis [tiles_k, tiles_n, 8 K2] -> uint16 states [16 tiles_k, 16 tiles_n] (row = input)."""
    k2 = check_k2(K2)
    tr = _prep_trellis(trellis, k2)
    widx, woff, tpos = _ring_tables(k2)
    out = np.empty((16 * tr.shape[0], 16 * tr.shape[1]), dtype=np.uint16)
    if out.size:
        _states_kernel(tr, widx, woff, tpos, out)
    return out


def inner_weight(trellis: np.ndarray, K2: int, codebook: str) -> np.ndarray:
    """W_hat: float16 [16 tiles_k, 16 tiles_n] = codebook(state), exact (the oracle's inner_weight's array)."""
    k2 = check_k2(K2)
    cbk = _codebook_id(codebook, k2)
    tr = _prep_trellis(trellis, k2)
    widx, woff, tpos = _ring_tables(k2)
    out = np.empty((16 * tr.shape[0], 16 * tr.shape[1]), dtype=np.uint16)
    if out.size:
        _inner_kernel(tr, widx, woff, tpos, cbk, np.uint32(_MULT[cbk % 2]), np.uint32(_ADD[cbk % 2]), out)
    return out.view(np.float16)


def unpack_sign_bits(packed: np.ndarray) -> np.ndarray:
    """Legacy su/sv: int16 [m] (16 signs a word, LSB first, set bit = -1) -> float16 +-1 [16 m]."""
    u = np.ascontiguousarray(packed)
    if u.ndim != 1 or u.dtype not in (np.int16, np.uint16):
        raise ValueError(f"legacy sign words must be int16 [m], got {u.dtype} {u.shape}")
    bits = (u.view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & np.uint16(1)
    return np.where(bits.reshape(-1) != 0, np.float16(-1), np.float16(1)).astype(np.float16)


def _scales(v, n: int, legacy: bool, name: str) -> np.ndarray:
    v = np.asarray(v)
    if legacy:
        if v.shape != (n // 16,) or v.dtype not in (np.int16, np.uint16):
            raise ValueError(f"legacy {name} must be int16 [{n // 16}], got {v.dtype} {v.shape}")
        v = unpack_sign_bits(v)
    elif v.shape != (n,) or v.dtype != np.float16:
        raise ValueError(f"{name} must be float16 [{n}], got {v.dtype} {v.shape}")
    return v.astype(np.float32)


def _empty_aligned(shape: tuple[int, int]) -> np.ndarray:
    """np.empty uint16 ``shape`` (C order) starting on a 64-byte boundary, so that the 64-byte row segments the
    kernel stores are whole cache lines when the row length allows (as exl2fmt.codec.exl2)."""
    n = shape[0] * shape[1]
    raw = np.empty(n + 32, dtype=np.uint16)
    off = (-raw.ctypes.data % 64) // 2
    return raw[off:off + n].reshape(shape)


def dequantize(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, K2: int, codebook: str,
               in_features: int, out_features: int, *, legacy_signs: bool = False) -> np.ndarray:
    """One EXL3 linear -> float16 [out_features, in_features], C order (nn.Linear.weight).

    Bit-exact with the oracle's dequantize: A = fp16(H_l W_hat), B = fp16(A * suh), C = fp16(B H_r),
    D = fp16(C * svh), W = D[:in_features, :out_features]^T, H in 128-blocks with the oracle's fp32 order.
    ``legacy_signs``: ``suh``/``svh`` are the legacy packed sign words ``su``/``sv`` (int16 [in_p/16], [out_p/16]).
    The padded sizes in_p = 16 tiles_k, out_p = 16 tiles_n must be multiples of 128 that pad the features by
    less than 128 (spec/exl3.md, section 1)."""
    k2 = check_k2(K2)
    cbk = _codebook_id(codebook, k2)
    tr = _prep_trellis(trellis, k2)
    in_p, out_p = 16 * tr.shape[0], 16 * tr.shape[1]
    if in_p % 128 or out_p % 128:
        raise ValueError(f"padded shape {in_p}x{out_p} is not a multiple of 128")
    in_f, out_f = int(in_features), int(out_features)
    if not (0 < in_f <= in_p and in_p - in_f < 128 and 0 < out_f <= out_p and out_p - out_f < 128):
        raise ValueError(f"trellis {in_p}x{out_p} does not pad {in_f}x{out_f} to 128")
    su = _scales(suh, in_p, legacy_signs, Exl3Slot.SU if legacy_signs else Exl3Slot.SUH)
    sv = _scales(svh, out_p, legacy_signs, Exl3Slot.SV if legacy_signs else Exl3Slot.SVH)
    widx, woff, tpos = _ring_tables(k2)
    out = _empty_aligned((out_f, in_f))
    _dequant_kernel(tr, widx[tpos], woff[tpos], cbk, np.uint32(_MULT[cbk % 2]), np.uint32(_ADD[cbk % 2]), su, sv, out,
                    4 * get_num_threads())
    return out.view(np.float16)
