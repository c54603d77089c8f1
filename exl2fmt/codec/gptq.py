"""Numba reference codecs for GPTQ ``qweight`` / ``qzeros`` (2, 3, 4, 8 bits) and GPTQ dequantization.

Packing rule (gptq-gguf-formats A2): along the packed axis, 32 consecutive codes form one little-endian
bit string of 32*b bits, cut into b int32 words.  ``qweight`` is packed along K (rows), ``qzeros`` along N
(columns).  For a single tier this is the same bit string EXL2 uses, so ``qweight`` packing reuses the EXL2
unit packer with one group of K rows.

Zero points: v1 (``checkpoint_format`` "gptq") stores z - 1 in each field, v2 ("gptq_v2") stores z.
Reading v1, exl2fmt uses z = field + 1 without masking, like the exllama/vLLM kernels and llama.cpp's
converter; a v1 field equal to 2^b - 1 is ambiguous across tools and is reported by the validator
(GPTQ_ZEROS_AMBIGUOUS).

Arrays:
* ``codes``   uint8 [K, N]; ``qweight`` int32 [K*b/32, N]
* ``zeros``   int [G, N] (true zero points z); ``qzeros`` int32 [G, N*b/32]
* ``scales``  float16 [G, N] (bf16 given as uint16 bit patterns must be converted by the caller)
* ``g_idx``   int32 [K], group of each input row in original order
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..groups import group_table_from_rows
from ..layout import GPTQ_BITS
from . import exl2 as _exl2
from .f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["pack_qweight", "unpack_qweight", "pack_qzeros", "unpack_qzeros", "zeros_from_fields",
           "fields_from_zeros", "dequantize"]


def _check_bits(bits: int) -> None:
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ bits must be one of {GPTQ_BITS}, got {bits}")


def pack_qweight(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [K, N] codes in [0, 2^bits) -> ``qweight`` int32 [K*bits/32, N].  K must be a multiple of 32."""
    _check_bits(bits)
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[0] % 32:
        raise ValueError(f"codes must be [K, N] with K a multiple of 32, got {codes.shape}")
    return _exl2.pack_q_weight(codes, group_table_from_rows([(bits, codes.shape[0])]))


def unpack_qweight(qweight: np.ndarray, bits: int) -> np.ndarray:
    """``qweight`` int32 [K*bits/32, N] -> uint8 codes [K, N]."""
    _check_bits(bits)
    qweight = np.asarray(qweight)
    if qweight.ndim != 2 or qweight.shape[0] % bits:
        raise ValueError(f"qweight must be [K*{bits}/32, N], got {qweight.shape}")
    K = qweight.shape[0] * 32 // bits
    return _exl2.unpack_q_weight(qweight, group_table_from_rows([(bits, K)]))


def pack_qzeros(fields: np.ndarray, bits: int) -> np.ndarray:
    """Stored zero fields int [G, N] (N a multiple of 32) -> ``qzeros`` int32 [G, N*bits/32]."""
    fields = np.asarray(fields)
    if fields.ndim != 2 or fields.shape[1] % 32:
        raise ValueError(f"zero fields must be [G, N] with N a multiple of 32, got {fields.shape}")
    return np.ascontiguousarray(pack_qweight(np.ascontiguousarray(fields.T), bits).T)


def unpack_qzeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """``qzeros`` int32 [G, N*bits/32] -> stored fields uint8 [G, N] (not yet offset, see zeros_from_fields)."""
    qzeros = np.asarray(qzeros)
    if qzeros.ndim != 2:
        raise ValueError(f"qzeros must be 2-D, got {qzeros.shape}")
    _check_bits(bits)
    words = qzeros.shape[1]
    if (words * 32) % bits:
        raise ValueError(f"{words} qzeros words per row do not hold a whole number of {bits}-bit fields")
    # For 2/4/8 bits a word holds whole fields, so N need only be a multiple of 32/bits: pad the word
    # count to whole 32-field blocks, unpack, and cut the padding off again.
    t = np.ascontiguousarray(qzeros.T)
    pad = (-words) % bits
    if pad:
        t = np.concatenate([t, np.zeros((pad, t.shape[1]), dtype=t.dtype)])
    fields = unpack_qweight(t, bits).T
    return np.ascontiguousarray(fields[:, : words * 32 // bits])


def zeros_from_fields(fields: np.ndarray, v2: bool) -> np.ndarray:
    """Stored fields -> true zero points (int32): v2 stores z, v1 stores z - 1."""
    f = np.asarray(fields).astype(np.int32)
    return f if v2 else f + 1


def fields_from_zeros(zeros: np.ndarray, bits: int, v2: bool) -> np.ndarray:
    """True zero points -> stored fields.  v1 needs z >= 1 (a zero point of 0 has no v1 encoding)."""
    z = np.asarray(zeros).astype(np.int64)
    f = z if v2 else z - 1
    if f.size and (f.min() < 0 or f.max() > (1 << bits) - 1):
        raise ValueError(f"zero points out of range for {'v2' if v2 else 'v1'} {bits}-bit fields")
    return f.astype(np.uint8)


@njit(cache=True, parallel=True)
def _dequant(codes, zeros, scale_bits, g_idx, out):
    # codes [K, N] u8, zeros [G, N] i32, scale_bits [G, N] u16 (fp16), g_idx [K] -> out [N, K] u16
    K, N = codes.shape
    n_tiles = (N + 31) // 32
    for ti in prange(n_tiles):
        n0 = ti * 32
        n1 = min(n0 + 32, N)
        for k in range(K):
            g = g_idx[k]
            for n in range(n0, n1):
                q = np.float32(np.int32(codes[k, n]) - zeros[g, n])
                out[n, k] = f32_to_f16_bits(q * f16_bits_to_f32(scale_bits[g, n]))


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
               bits: int, *, v2: bool = False, group_size: int | None = None) -> np.ndarray:
    """GPTQ layer -> ``nn.Linear`` weight float16 [N, K]: W[n, k] = fp16(fp16(q - z) * scale) with
    g = g_idx[k] (or k // group_size without g_idx).  ``scales`` float16 [G, N] (float32 is rounded to fp16
    first, as ExLlamaV2 does).
    """
    codes = unpack_qweight(qweight, bits)
    K, N = codes.shape
    fields = unpack_qzeros(qzeros, bits)
    G = fields.shape[0]
    if K and not G:  # guard: the Numba loop below would read zeros[-1] / scales[-1] of empty arrays
        raise ValueError(f"qzeros and scales hold no groups (G = 0) for K = {K} rows")
    if fields.shape[1] != N:
        raise ValueError(f"qzeros decode to {fields.shape[1]} columns, qweight has {N}")
    scales = np.asarray(scales)
    if scales.shape != (G, N):
        raise ValueError(f"scales must be {(G, N)}, got {scales.shape}")
    scale_bits = np.ascontiguousarray(scales.astype(np.float16)).view(np.uint16)
    if g_idx is None:
        # Without g_idx, rows are in contiguous groups; with no group size given, derive it from G.
        gs = group_size if group_size and group_size > 0 else -(-K // max(G, 1))
        g = np.minimum(np.arange(K) // gs, G - 1)
    else:
        g = np.asarray(g_idx).astype(np.int64)
        if g.shape != (K,):
            raise ValueError(f"g_idx must have shape ({K},), got {g.shape}")
        if K and (g.min() < 0 or g.max() >= G):
            raise ValueError(f"g_idx values must lie in 0..{G - 1}")
    out = np.empty((N, K), dtype=np.uint16)
    _dequant(codes, zeros_from_fields(fields, v2), scale_bits, np.ascontiguousarray(g), out)
    return out.view(np.float16)
