"""The elementwise steps of the bf16 difference scoring (``quant.scoring``) on the CPU, as Numba kernels;
imported on first use (it imports numba).

torch runs an elementwise op whose operands differ in dtype (fp16 - fp32 into bf16, fp32 + bf16) through its
generic casting loop, several times slower than the same op on one dtype: on a 1B layer these steps were a
tenth of the measurement's time (bench/RESULTS.md, issue 18).  Each kernel here computes exactly what the torch expression
named in its docstring computes (float32 arithmetic, one rounding to bf16 by round-to-nearest-even), so the two
paths give the same bits (tests/test_scoring.py compares them on every call shape).

bf16 and fp16 arrays travel as their uint16 bit patterns (``tensor.view(torch.int16).numpy().view(np.uint16)``
or ``scoring._u16``); every array is C-ordered and 2-D, rows run in parallel.
"""

from __future__ import annotations

from numba import njit, prange

from ..codec.f16 import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits

__all__ = ["sub_f16_to_bf16", "sub_f16_f16_to_bf16", "sub_f16_bf16_to_bf16", "sub_f32_to_bf16", "add_bf16"]


@njit(cache=True, parallel=True)
def sub_f16_to_bf16(a, b, out):
    """``torch.sub(a, b, out=out)`` for ``a`` fp16 bits uint16 [R, C], ``b`` float32 [R, C], ``out`` bf16 bits
    uint16 [R, C]: each difference in float32, rounded once to bf16."""
    R, C = b.shape
    for r in prange(R):
        for c in range(C):
            out[r, c] = f32_to_bf16_bits(f16_bits_to_f32(a[r, c]) - b[r, c])


@njit(cache=True, parallel=True)
def sub_f16_f16_to_bf16(a, b, out):
    """``torch.sub(a, b.float(), out=out)`` for ``a``, ``b`` fp16 bits uint16 [R, C], ``out`` bf16 bits uint16
    [R, C]: both widened exactly, the difference in float32, rounded once to bf16 (``b`` being the exact fp16
    copy of a float32 weight, the bits of ``sub_f16_to_bf16`` with that weight)."""
    R, C = b.shape
    for r in prange(R):
        for c in range(C):
            out[r, c] = f32_to_bf16_bits(f16_bits_to_f32(a[r, c]) - f16_bits_to_f32(b[r, c]))


@njit(cache=True, parallel=True)
def sub_f16_bf16_to_bf16(a, b, out):
    """``torch.sub(a, b.float(), out=out)`` for ``a`` fp16 bits, ``b`` bf16 bits, ``out`` bf16 bits, all uint16
    [R, C]."""
    R, C = b.shape
    for r in prange(R):
        for c in range(C):
            out[r, c] = f32_to_bf16_bits(f16_bits_to_f32(a[r, c]) - bf16_bits_to_f32(b[r, c]))


@njit(cache=True, parallel=True)
def sub_f32_to_bf16(a, b, out):
    """``torch.sub(a, b, out=out)`` for ``a``, ``b`` float32 [R, C], ``out`` bf16 bits uint16 [R, C]."""
    R, C = b.shape
    for r in prange(R):
        for c in range(C):
            out[r, c] = f32_to_bf16_bits(a[r, c] - b[r, c])


@njit(cache=True, parallel=True)
def add_bf16(y, p, out):
    """``torch.add(y, p, out=out)`` for ``y`` float32 [R, C], ``p`` bf16 bits uint16 [R, C], ``out`` float32
    [R, C] (may be ``y`` itself: ``y.add_(p)``)."""
    R, C = y.shape
    for r in prange(R):
        for c in range(C):
            out[r, c] = y[r, c] + bf16_bits_to_f32(p[r, c])
