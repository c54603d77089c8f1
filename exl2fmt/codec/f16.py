"""IEEE binary16 helpers for Numba code (Numba's CPU target has no float16 type).

fp16 values travel as their uint16 bit patterns.  Arithmetic is done in float32 and rounded back with
``f32_to_f16_bits`` (round to nearest, ties to even, like ``__float2half_rn`` and ``numpy.float16``).
A product of two fp16 values, or of a small integer and an fp16 value, is exact in float32, so
"multiply in float32, round once" equals a true fp16 multiply: this is how the reference decoder
reproduces ExLlamaV2's fp16 rounding order bit for bit.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _bitcast_f32_u32(typingctx, x):
    if x != types.float32:
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def _bitcast_u32_f32(typingctx, x):
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        # Numba widens uint32 arithmetic to 64 bits; keep the low 32 bits of the pattern.
        i32 = context.get_value_type(types.uint32)
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, i32)
        elif x.bitwidth < 32:
            v = builder.zext(v, i32)
        return builder.bitcast(v, context.get_value_type(types.float32))

    return sig, codegen


_MAGIC_DENORM = np.uint32(126 << 23)  # 0.5f: adding it lets the FPU round a tiny value to a half subnormal


@njit(cache=True, inline="always")
def f32_to_f16_bits_sw(f):
    """float32 -> binary16 bit pattern (uint16), round to nearest even; overflow -> inf; NaN stays NaN."""
    x = _bitcast_f32_u32(np.float32(f))
    sign = (x >> np.uint32(16)) & np.uint32(0x8000)
    a = x & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # >= 65536: inf or nan (65520..65535.99 handled by the normal path)
        if a > np.uint32(0x7F800000):
            return np.uint16(sign | np.uint32(0x7E00))
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # below 2^-14: the result is subnormal or zero
        r = _bitcast_f32_u32(_bitcast_u32_f32(a) + _bitcast_u32_f32(_MAGIC_DENORM)) - _MAGIC_DENORM
        return np.uint16(sign | r)
    mant_odd = (a >> np.uint32(13)) & np.uint32(1)
    a = a + np.uint32(0xC8000FFF) + mant_odd  # rebias exponent (-112 << 23) and add the rounding bias
    return np.uint16(sign | (a >> np.uint32(13)))


@njit(cache=True, inline="always")
def f16_bits_to_f32_sw(h):
    """binary16 bit pattern -> float32 (exact)."""
    h32 = np.uint32(h)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    e = (h32 >> np.uint32(10)) & np.uint32(0x1F)
    m = h32 & np.uint32(0x3FF)
    if e == 0:
        # subnormal (or zero): m * 2^-24, exact in float32
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    if e == 31:
        return _bitcast_u32_f32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return _bitcast_u32_f32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@intrinsic
def _fptrunc_half(typingctx, x):
    """LLVM ``fptrunc float -> half``: one vcvtps2ph (x86 F16C) / fcvt (Arm) instruction, IEEE RNE."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _fpext_half(typingctx, x):
    if not isinstance(x, types.Integer) or x.bitwidth != 16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


@njit(cache=True, inline="always")
def f32_to_f16_bits_hw(f):
    return _fptrunc_half(np.float32(f))


@njit(cache=True, inline="always")
def f16_bits_to_f32_hw(h):
    return _fpext_half(np.uint16(h))


def _has_hw_half() -> bool:
    """True where LLVM lowers half conversions to single instructions (no libcall needed)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine in ("x86_64", "amd64"):
        try:
            return "+f16c" in _llvm.get_host_cpu_features().flatten()
        except Exception:  # pragma: no cover - very old llvmlite
            return False
    return False


HW_HALF = _has_hw_half()
#: The conversions used by the codecs: hardware where available, the bit-exact software twin elsewhere.
f32_to_f16_bits = f32_to_f16_bits_hw if HW_HALF else f32_to_f16_bits_sw
f16_bits_to_f32 = f16_bits_to_f32_hw if HW_HALF else f16_bits_to_f32_sw


@njit(cache=True)
def f32_array_to_f16_bits_sw(src, out):
    """Software rounding of a float32 array into ``out`` (uint16); used to test the bit tricks."""
    s = src.ravel()
    o = out.ravel()
    for i in range(s.size):
        o[i] = f32_to_f16_bits_sw(s[i])


@njit(cache=True)
def f16_bits_array_to_f32_sw(src, out):
    s = src.ravel()
    o = out.ravel()
    for i in range(s.size):
        o[i] = f16_bits_to_f32_sw(s[i])


@njit(cache=True)
def f32_array_to_f16_bits(src, out):
    """Round a float32 array (any shape, C order) into ``out`` (uint16, same size)."""
    s = src.ravel()
    o = out.ravel()
    for i in range(s.size):
        o[i] = f32_to_f16_bits(s[i])


# --- bfloat16 (the top half of a float32) ----------------------------------------------------------------


@njit(cache=True, inline="always")
def f32_to_bf16_bits(f):
    """float32 -> bfloat16 bit pattern (uint16), round to nearest even, as torch's ``.to(torch.bfloat16)``:
    overflow rounds to inf, a NaN becomes the quiet NaN 0x7FC0 (as torch's scalar conversion)."""
    x = _bitcast_f32_u32(np.float32(f))
    if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, inline="always")
def bf16_bits_to_f32(h):
    """bfloat16 bit pattern -> float32 (exact)."""
    return _bitcast_u32_f32(np.uint32(h) << np.uint32(16))
