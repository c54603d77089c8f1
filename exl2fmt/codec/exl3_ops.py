"""The building blocks of the EXL3 decoder (``codec.exl3``): 32-bit integer and 16-bit window intrinsics, the
three codebooks (a 16-bit state -> its fp16 value as float32), the Hadamard butterflies over [128, W] fp32 rows,
the A/B and C/D fp16 roundings, and the fused vector passes (LLVM IR on <32 x float> rows where the CPU converts
fp16 in hardware, ``f16.HW_HALF``) with their portable loop twins (``decode_left``, ``right_had``: the pair the
kernel runs).  Numbers and rounding points: spec/exl3.md sections 2-5; the orchestration, the ring tables and the
public API: ``codec.exl3``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..layout import EXL3_CODEBOOKS
from . import exl2, f16
from .cache_deps import watch
from .exl2 import NT_STORES  # the one x86 check, shared with the EXL2 decoder
from .f16 import HW_HALF, f16_bits_to_f32, f32_to_f16_bits

watch(__file__, (exl2.__file__, f16.__file__))  # cached kernels here inline code of these files (cache_deps)

__all__ = ["ADD", "LANES", "MUL1", "MULT", "SLICE", "add32", "decode_left", "decode_pos", "load_rings16", "prefetch",
           "right_had", "shl32", "window16"]

MUL1 = EXL3_CODEBOOKS[2]
MULT = (89226354, 0xCBAC1FED)      # lop3 codebooks: x = s * mult + add (mod 2^32)
ADD = (64248484, 0)
_MUL1_MULT = 0x83DCD12D
_MUL1_K = np.float32(np.array(0x1EEE, dtype=np.uint16).view(np.float16))   # fp16 0x1EEE, exact in fp32
_MUL1_C = np.float32(np.array(0xC931, dtype=np.uint16).view(np.float16))   # fp16 0xC931
_HAD_S = np.float32(1.0 / np.sqrt(128.0))                                  # bits 0x3DB504F3
# The lop3's fp16 half h = (y & 0x8FFF) ^ 0x3B60 as fp32 bits, from y in bits 31..16 shifted right by 3
# (arithmetic): bit 31 = sign, bits 27..13 = (y & 0x0FFF) ^ 0x3B60 (exponent 12..15, so normal, bit 14 clear),
# bits 29..27 |= 112 << 23 (the exponent bias 127 - 15; bit 27 is clear, so the or is the addition).
_LOP3_F32_MASK = (0x80000000 | (0x0FFF << 13)) - (1 << 32)
_LOP3_F32_XOR = (0x3B60 << 13) | (112 << 23)

LANES = 32     # tiles of one tile row decoded side by side (SIMD lanes): 512 output columns
SLICE = 32     # Z columns per right-Hadamard pass: F = 128 x 32 fp32 = 16 KiB (L1)
_VEC = 32       # columns of G and F: the butterflies work on <32 x float> rows
_HALF = 16      # lanes of one register-resident radix-16 / radix-8 pass (16 rows x 16 lanes = 16 zmm)


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
add32 = _binop32("add")
_and32 = _binop32("and_")
_xor32 = _binop32("xor")
shl32 = _binop32("shl")
_lshr32 = _binop32("lshr")


@intrinsic
def window16(typingctx, hi, lo, off):
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
def prefetch(typingctx, arr, off):
    """Hint the cache line holding arr.flat[off] into the caches (llvm.prefetch, read, high locality): a hint,
    never a fault, whatever the address.  arr: any C-contiguous array; off: element offset, not checked."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        ptr = builder.bitcast(builder.gep(a.data, [args[1]]), i8p)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, types.intp), codegen


def _transpose16(builder, rows):
    """16 x 16 transpose of 16 <16 x i32> row vectors (returns the columns): at block sizes 8, 4, 2, 1 the
    off-diagonal blocks of each pair of rows (i, i + h) are swapped, two two-source shuffles per pair and stage."""
    mask_t = ir.VectorType(ir.IntType(32), 16)
    r = list(rows)
    for h in (8, 4, 2, 1):
        ma = ir.Constant(mask_t, [c if not c & h else 16 + c - h for c in range(16)])
        mb = ir.Constant(mask_t, [c + h if not c & h else 16 + c for c in range(16)])
        for i in range(16):
            if not i & h:
                r[i], r[i + h] = builder.shuffle_vector(r[i], r[i + h], ma), builder.shuffle_vector(r[i], r[i + h], mb)
    return r


@intrinsic
def load_rings16(typingctx, tr, tk, tn0, wt, b):
    """wt[b, q, l] = 32-bit ring word q of tile (tk, tn0 + l) for q < nw = tr.shape[2] / 2, l < wt.shape[2], and
    wt[b, nw, :] = wt[b, 0, :] (the first word again at the end).  The 32-bit words are read as they lie (u16
    word 2q low, 2q + 1 high: little-endian uint32), 16 tiles x 16 words at a time, transposed in registers.
    Needs nw % 16 == 0 and wt.shape[2] % 16 == 0, and tiles tn0 .. tn0 + wt.shape[2] - 1 to exist (not checked).
    tr uint16 [tiles_k, tiles_n, 2 nw] C; wt uint32 [*, nw + 1, lanes] C."""
    if not (isinstance(tr, types.Array) and tr.ndim == 3 and tr.layout == "C" and tr.dtype == types.uint16
            and isinstance(wt, types.Array) and wt.ndim == 3 and wt.layout == "C" and wt.dtype == types.uint32):
        return None

    def codegen(context, builder, sig, args):
        tr_v, tk_v, tn0_v, wt_v, b_v = args
        i64, i32 = ir.IntType(64), ir.IntType(32)
        vty = ir.VectorType(i32, 16)
        ta = context.make_array(sig.args[0])(context, builder, tr_v)
        wa = context.make_array(sig.args[3])(context, builder, wt_v)
        tiles_n = builder.extract_value(ta.shape, 1)
        L = builder.extract_value(ta.shape, 2)
        nq = builder.extract_value(wa.shape, 1)
        lanes = builder.extract_value(wa.shape, 2)
        nw = builder.sub(nq, ir.Constant(i64, 1))
        tile0 = builder.add(builder.mul(tk_v, tiles_n), tn0_v)
        wrow0 = builder.mul(b_v, nq)

        def body_q(q0):  # one 16-word block of every group of 16 lanes
            def body_g(g):
                rows = []
                for m in range(16):
                    tile = builder.add(tile0, builder.add(g, ir.Constant(i64, m)))
                    off = builder.add(builder.mul(tile, L), builder.mul(q0, ir.Constant(i64, 2)))
                    ld = builder.load(builder.bitcast(builder.gep(ta.data, [off]), vty.as_pointer()))
                    ld.align = 2
                    rows.append(ld)
                cols = _transpose16(builder, rows)
                for k in range(16):
                    wo = builder.add(builder.mul(builder.add(wrow0, builder.add(q0, ir.Constant(i64, k))), lanes), g)
                    st = builder.store(cols[k], builder.bitcast(builder.gep(wa.data, [wo]), vty.as_pointer()))
                    st.align = 4
                with builder.if_then(builder.icmp_unsigned("==", q0, ir.Constant(i64, 0))):
                    wo = builder.add(builder.mul(builder.add(wrow0, nw), lanes), g)
                    st = builder.store(cols[0], builder.bitcast(builder.gep(wa.data, [wo]), vty.as_pointer()))
                    st.align = 4

            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), lanes, ir.Constant(i64, 16), intp=i64) as (g, _):
                body_g(g)

        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nw, ir.Constant(i64, 16), intp=i64) as (q0, _):
            body_q(q0)
        return context.get_dummy_value()

    return types.void(tr, types.intp, types.intp, wt, types.intp), codegen


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
    x = _xor32(_and32(add32(_mul32(s, mult), add), np.uint32(0x8FFF8FFF)), np.uint32(0x3B603B60))
    v = f16_bits_to_f32(_lo16(x)) + f16_bits_to_f32(_hi16(x))
    return f16_bits_to_f32(f32_to_f16_bits(v))


@njit(cache=True, inline="always")
def _cb_mul1(s):
    """MUL1: x = s * 0x83DCD12D, h = 1024 + byte sum of x, fp16(h * fp16(0x1EEE) + fp16(0xC931)); the product
    (<= 22 significant bits) and the sum (a multiple of 2^-18 below 16) are exact in fp32: one rounding."""
    x = _mul32(s, np.uint32(_MUL1_MULT))
    m = np.uint32(0xFF)
    b = add32(add32(_and32(x, m), _and32(_lshr32(x, 8), m)), add32(_and32(_lshr32(x, 16), m), _lshr32(x, 24)))
    h = _small_to_f32(b) + np.float32(1024.0)
    return f16_bits_to_f32(f32_to_f16_bits(h * _MUL1_K + _MUL1_C))



@njit(cache=True, inline="always")
def decode_pos(wt, b, i, o, cbk, mult, add, dst, row):
    """dst[row, l] = codebook value (fp32) of ring position with window word i, offset o, for the 8 lanes."""
    # row views: indices computed from arguments would each get Numba's negative-index wraparound code,
    # which stops LLVM from vectorising the lane loop
    W = wt.shape[2]
    hi = wt[b, i]
    lo = wt[b, i + 1]
    d = dst[row]
    if cbk == 2:
        for l in range(W):
            d[l] = _cb_mul1(window16(hi[l], lo[l], o))
    else:
        for l in range(W):
            d[l] = _cb_lop3(window16(hi[l], lo[l], o), mult, add)


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
    """F[n, :] = Z[LANES (n % 16) + 8 nb + n // 16, jc : jc + W] as float32, n < 128: the B values of output
    columns 128 nb + n of the work item (Z row 32 c + l holds column 16 l + c). Z uint16, F float32 [128, W]."""
    W = F.shape[1]
    for n in range(128):
        z = Z[LANES * (n & 15) + 8 * nb + (n >> 4), jc:jc + W]   # a view (see decode_pos)
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

def _row_ptr(context, builder, aty, arr, row, col, elem, width=_VEC):
    a = context.make_array(aty)(context, builder, arr)
    off = builder.add(builder.mul(row, builder.extract_value(a.shape, 1)), col)
    return builder.bitcast(builder.gep(a.data, [off]), ir.VectorType(elem, width).as_pointer())


def _vload(builder, ptr, align):
    v = builder.load(ptr)
    v.align = align
    return v


def _vstore(builder, v, ptr, align):
    st = builder.store(v, ptr)
    st.align = align


def _splat(builder, x, n=_VEC):
    vty = ir.VectorType(ir.FloatType(), n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


def _round_twice(builder, v, s, m):
    """fp16 bits of fp16(fp16(v * s) * m), v <n x float>, s and m float scalars."""
    n = v.type.count
    half = ir.VectorType(ir.HalfType(), n)
    a = builder.fpext(builder.fptrunc(builder.fmul(v, _splat(builder, s, n)), half), ir.VectorType(ir.FloatType(), n))
    return builder.bitcast(builder.fptrunc(builder.fmul(a, _splat(builder, m, n)), half), ir.VectorType(ir.IntType(16), n))


def _is_c2(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == dtype


def _decode_value(context, builder, wt_ty, wt_v, b_v, i_v, o_v, mult_v, add_v, mul1, col=0, vw=_VEC):
    """<vw x float>: the fp16 codebook values of the windows (wt[b, i, col:col+vw] : wt[b, i + 1, ..]) << o."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    v32 = ir.VectorType(i32, vw)
    vf = ir.VectorType(f32, vw)
    a = context.make_array(wt_ty)(context, builder, wt_v)
    nq = builder.extract_value(a.shape, 1)
    off = builder.add(builder.mul(builder.add(builder.mul(b_v, nq), i_v), ir.Constant(i64, _VEC)), ir.Constant(i64, col))
    p_hi = builder.bitcast(builder.gep(a.data, [off]), v32.as_pointer())
    p_lo = builder.bitcast(builder.gep(a.data, [builder.add(off, ir.Constant(i64, _VEC))]), v32.as_pointer())
    hi, lo = _vload(builder, p_hi, 4), _vload(builder, p_lo, 4)

    def splat_i(x):
        v = builder.insert_element(ir.Constant(v32, ir.Undefined), builder.trunc(x, i32) if x.type != i32 else x,
                                   ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(v32, ir.Undefined), ir.Constant(v32, [0] * vw))

    def const_i(c):
        return ir.Constant(v32, [c] * vw)

    fshl = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32, v32, v32]), "llvm.fshl.v%di32" % vw)
    st = builder.lshr(builder.call(fshl, [hi, lo, splat_i(o_v)]), const_i(16))
    if mul1:
        x = builder.mul(st, const_i(_MUL1_MULT - (1 << 32)))
        m = const_i(0xFF)
        bsum = builder.add(builder.add(builder.and_(x, m), builder.and_(builder.lshr(x, const_i(8)), m)),
                           builder.add(builder.and_(builder.lshr(x, const_i(16)), m), builder.lshr(x, const_i(24))))
        h = builder.fadd(builder.sitofp(bsum, vf), ir.Constant(vf, [1024.0] * vw))
        v = builder.fadd(builder.fmul(h, ir.Constant(vf, [float(_MUL1_K)] * vw)), ir.Constant(vf, [float(_MUL1_C)] * vw))
    else:
        x = builder.add(builder.mul(st, splat_i(mult_v)), splat_i(add_v))
        # Both fp16 halves straight to their fp32 bits with integer operations (no narrowing, no conversion):
        # after the lop3 every half is a normal fp16 of exponent 12..15 whose bit 14 is 0 (see _LOP3_F32_*), so
        # moving its bits 14..0 to bits 27..13 (an arithmetic shift right by 3 of the half in the top 16 bits,
        # which also keeps its sign in bit 31) and setting bits 29..27 (exponent + 112) gives its exact fp32.
        # The mask and the xor of the lop3 are applied after the shift: one vpternlogd per half.
        three = const_i(3)
        hi_f = builder.xor(builder.and_(builder.ashr(x, three), const_i(_LOP3_F32_MASK)), const_i(_LOP3_F32_XOR))
        lo_f = builder.xor(builder.and_(builder.ashr(builder.shl(x, const_i(16)), three), const_i(_LOP3_F32_MASK)),
                           const_i(_LOP3_F32_XOR))
        v = builder.fadd(builder.bitcast(lo_f, vf), builder.bitcast(hi_f, vf))
    return _rn16_split(builder, v)


def _rn16_split(builder, v):
    """fp32(fp16(v)) for a <n x float> v of a codebook sum, by Veltkamp's split: c = v * (2^13 + 1), then
    c - (c - v) is v rounded to 24 - 13 = 11 significant bits.  Three multiply / add operations on the FP pipes
    instead of the conversion pair vcvtps2ph + vcvtph2ps (slower on AMD Zen 4).  It equals RN16 only where fp16
    has 11 significant bits and no overflow: every codebook value lies in fp16's normal range (|v| in
    [2^-13, 4) for 3INST / MCG, [1.8e-3, 3.5] for MUL1), and the equality, ties included, was checked on all
    65536 states of the three codebooks (tests/test_exl3_codec.py::test_all_states decodes every state)."""
    vty = v.type
    c = builder.fmul(v, ir.Constant(vty, [8193.0] * vty.count))
    return builder.fsub(c, builder.fsub(c, v))


def _opaque_minus_one(builder, vty):
    """A <n x float> of -1.0 that LLVM cannot see through (an empty inline asm, x86 only): fma(b, it, a) then stays
    an fma instead of being folded back into a - b."""
    f32 = ir.FloatType()
    m1 = builder.asm(ir.FunctionType(f32, [f32]), "", "=v,0", [ir.Constant(f32, -1.0)], False)
    return _splat(builder, m1, vty.count)


def _butterflies(builder, x):
    """Radix-len(x) butterflies on rows x[m] = row i + m w: stages w, 2w, ... in order, each pairing
    (x[m], x[m + h]) -> (a + b, a - b) -- exactly the operations of consecutive radix-2 passes.

    On x86 the difference is computed as fma(b, -1, a): one rounding of the exact a - b, the very same value
    (signed zeros included), but issued to the multiply-add units, so the adders and the multiply-add units share
    the butterflies' work (on AMD Zen 4 each kind has two 256-bit pipes)."""
    x = list(x)
    fma = m1 = None
    if NT_STORES:  # x86
        vty = x[0].type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty, vty, vty]),
                                             "llvm.fma.v%df32" % vty.count)
        m1 = _opaque_minus_one(builder, vty)
    h = 1
    while h < len(x):
        for m in range(len(x)):
            if not m & h:
                a, b = x[m], x[m + h]
                x[m] = builder.fadd(a, b)
                x[m + h] = builder.call(fma, [b, m1, a]) if fma is not None else builder.fsub(a, b)
        h *= 2
    return x


def _decode16_codegen(context, builder, sig, args, mul1):
    wt_v, b_v, it_v, ot_v, c_v, mult_v, add_v, dst_v, row_v = args
    i64 = ir.IntType(64)
    it = context.make_array(sig.args[2])(context, builder, it_v)
    ot = context.make_array(sig.args[3])(context, builder, ot_v)
    base = builder.mul(c_v, builder.extract_value(it.shape, 1))
    io = []
    for m in range(16):
        k = builder.add(base, ir.Constant(i64, m))
        io.append((builder.load(builder.gep(it.data, [k])), builder.load(builder.gep(ot.data, [k]))))
    for col in range(0, _VEC, _HALF):   # two halves of 16 lanes: 16 rows of one half fill 16 registers
        x = [_decode_value(context, builder, sig.args[0], wt_v, b_v, i_m, o_m, mult_v, add_v, mul1, col, _HALF)
             for i_m, o_m in io]
        for m, v in enumerate(_butterflies(builder, x)):
            ptr = _row_ptr(context, builder, sig.args[7], dst_v, builder.add(row_v, ir.Constant(i64, m)),
                           ir.Constant(i64, col), ir.FloatType(), _HALF)
            _vstore(builder, v, ptr, 4)
    return context.get_dummy_value()


def _decode16_intrinsic(mul1):
    @intrinsic
    def f(typingctx, wt, b, itab, otab, c, mult, add, dst, row0):
        """Decode the 16 tile elements (row r, column c), r < 16, of the _VEC tiles in wt[b] (window word
        itab[c, r], offset otab[c, r]), apply the Hadamard widths 1, 2, 4, 8 to the 16 rows in registers
        and store them as dst[row0 + r, :_VEC].  itab/otab int64 [16, 16] C, dst float32 2-D C."""
        if not (isinstance(wt, types.Array) and wt.ndim == 3 and wt.layout == "C" and wt.dtype == types.uint32
                and _is_c2(itab, types.int64) and _is_c2(otab, types.int64) and _is_c2(dst, types.float32)):
            return None
        sig = types.void(wt, types.intp, itab, otab, types.intp, types.uint32, types.uint32, dst, types.intp)
        return sig, lambda c_, b_, s_, a_: _decode16_codegen(c_, b_, s_, a_, mul1)

    return f


_decode16_lop3 = _decode16_intrinsic(False)
_decode16_mul1 = _decode16_intrinsic(True)


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
    """Tile column c of the item: decode + widths 1, 2, 4, 8 (16 rows at a time in registers), then widths
    16, 32, 64 (radix 8) with the A/B roundings into G16 (fp16 bits of B)."""
    for tkl in range(8):
        if cbk == 2:
            _decode16_mul1(wt, tkl, itab, otab, c, mult, add, G, 16 * tkl)
        else:
            _decode16_lop3(wt, tkl, itab, otab, c, mult, add, G, 16 * tkl)
    s = _HAD_S
    for i in range(16):
        _bfly8_round(G, i, s, suh, j0 + i, G16, i, 0)


# Fused passes (HW_HALF): the decode feeds the first four butterfly stages in registers, the first pass of
# the right Hadamard reads Z itself (four stages), and the last pass of either Hadamard (three stages) rounds
# and stores.

@intrinsic
def _bfly16_widen(typingctx, Z, zr0, zstep, zc, F, i):
    """F[i + m, :] for m < 16 = widths 1, 2, 4, 8 of the butterflies (in registers, 16 lanes at a time) applied
    to the float32 of Z[zr0 + m zstep, zc : zc + _VEC] (fp16 bits). Z uint16, F float32 2-D C."""
    if not (_is_c2(Z, types.uint16) and _is_c2(F, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        zv, r0, rs, zc_, fv, i_ = args
        i64 = ir.IntType(64)
        vf = ir.VectorType(ir.FloatType(), _HALF)
        for col in range(0, _VEC, _HALF):
            zcol = builder.add(zc_, ir.Constant(i64, col))
            x = []
            for m in range(16):
                row = builder.add(r0, builder.mul(rs, ir.Constant(i64, m)))
                h = _vload(builder, _row_ptr(context, builder, sig.args[0], zv, row, zcol, ir.IntType(16), _HALF), 2)
                x.append(builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), _HALF)), vf))
            for m, v in enumerate(_butterflies(builder, x)):
                ptr = _row_ptr(context, builder, sig.args[4], fv, builder.add(i_, ir.Constant(i64, m)),
                               ir.Constant(i64, col), ir.FloatType(), _HALF)
                _vstore(builder, v, ptr, 4)
        return context.get_dummy_value()

    return types.void(Z, types.intp, types.intp, types.intp, F, types.intp), codegen


def _bfly8_round_intrinsic(nontemporal):
    @intrinsic
    def f(typingctx, src, i, s, scl, k0, dst, d0, dcol):
        """The last three butterfly stages (widths 16, 32, 64, radix 8 in registers) on rows i + 16 m, m < 8,
        of src (float32 rows of _VEC) fused with the rounding: dst[d0 + 16 m, dcol:+_VEC] = fp16(fp16(x_m s)
        scl[k0 + 16 m]).  scl float32 1-D, dst uint16 2-D C (``nontemporal``: the 64-byte row segments must
        start on 32-byte boundaries)."""
        if not (_is_c2(src, types.float32) and _is_c2(dst, types.uint16)
                and isinstance(scl, types.Array) and scl.ndim == 1 and scl.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            sv, i_, sc, scl_v, k0_, dv, d0_, dc = args
            i64 = ir.IntType(64)
            sa = context.make_array(sig.args[3])(context, builder, scl_v)
            ms = [builder.load(builder.gep(sa.data, [builder.add(k0_, ir.Constant(i64, 16 * m))])) for m in range(8)]
            z = ir.Constant(i64, 0)
            x = [_vload(builder, _row_ptr(context, builder, sig.args[0], sv, builder.add(i_, ir.Constant(i64, 16 * m)),
                                          z, ir.FloatType()), 4) for m in range(8)]
            nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]) if nontemporal else None
            for m, v in enumerate(_butterflies(builder, x)):
                ptr = _row_ptr(context, builder, sig.args[5], dv, builder.add(d0_, ir.Constant(i64, 16 * m)), dc,
                               ir.IntType(16))
                st = builder.store(_round_twice(builder, v, sc, ms[m]), ptr)
                st.align = 2
                if nt is not None:
                    st.align = 32
                    st.set_metadata("nontemporal", nt)
            return context.get_dummy_value()

        sig = types.void(src, types.intp, types.float32, scl, types.intp, dst, types.intp, types.intp)
        return sig, codegen

    return f


# Non-temporal stores (x86: movntdq) write the output's whole lines straight to memory, without first reading
# each line into the cache (the read-for-ownership of a plain store; as codec.exl2).  They are weakly
# ordered: each work item ends with store_fence().
_bfly8_round = _bfly8_round_intrinsic(False)
_bfly8_round_nt = _bfly8_round_intrinsic(NT_STORES)


@njit(cache=True)
def _right_had_vec(Z, nb, jc, F, svh, n0, nrows, ncols, out, col0, nt):
    """The right Hadamard of one 128 x _VEC slice and the stores: out[n0 + n, col0 + jj] = D of output column
    n0 + n (n < nrows, jj < ncols), from Z rows LANES (n % 16) + 8 nb + n // 16, columns jc.. (see _load_slice);
    ``nt``: non-temporal stores (out's 64-byte row segments start on 32-byte boundaries; store_fence after)."""
    for i in range(0, 128, 16):   # rows i..i+15: same n // 16, n % 16 = m
        _bfly16_widen(Z, 8 * nb + (i >> 4), LANES, jc, F, i)
    if nrows == 128 and ncols == _VEC:
        s = _HAD_S
        if nt:
            for i in range(16):
                _bfly8_round_nt(F, i, s, svh, n0 + i, out, n0 + i, col0)
        else:
            for i in range(16):
                _bfly8_round(F, i, s, svh, n0 + i, out, n0 + i, col0)
    else:
        for i in range(16):
            _bfly8_rows(F, i, 16)
        _store_slice_loop(F, svh, n0, nrows, ncols, out, col0)


@njit(cache=True)
def _decode_left_loop(wt, itab, otab, c, cbk, mult, add, suh, j0, G, G16):
    for tkl in range(8):
        for r in range(16):
            decode_pos(wt, tkl, itab[c, r], otab[c, r], cbk, mult, add, G, 16 * tkl + r)
    _wht128_rows(G)
    _round_rows_loop(G, suh, j0, 128, G16)


@njit(cache=True)
def _right_had_loop(Z, nb, jc, F, svh, n0, nrows, ncols, out, col0, nt):
    _load_slice_loop(Z, nb, jc, F)
    _wht128_rows(F)
    _store_slice_loop(F, svh, n0, nrows, ncols, out, col0)


if HW_HALF:
    decode_left, right_had = _decode_left_vec, _right_had_vec
else:  # pragma: no cover - software fp16 (no F16C): the loops
    decode_left, right_had = _decode_left_loop, _right_had_loop
