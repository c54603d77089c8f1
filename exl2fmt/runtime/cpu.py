"""CPU kernels of the packed linears: y = x W^T decoded on the fly from EXL2 / GPTQ integers (Numba).

Both formats reduce to one shape: stored input row k of the weight holds, for every output column n, a code v of
``b`` bits at (packed word ``word[k]``, bit ``shift[k]``) of column n, and its weight is
``fp16(fp16(v - Z[g, n]) * S[g, n])`` with g = ``group[k]`` - EXL2: Z = 2^(b-1), S from the 4-bit scale codes and
``q_scale_max``; GPTQ: Z the zero point, S the fp16 scale.  ``v - Z`` is a small integer and S an fp16 value, so
their float32 product is exact and one rounding to fp16 (F16C where the CPU has it) gives the weight bit for bit as
``convert --to fp16`` writes it.  The activations are taken in stored row order (EXL2: ``x[:, q_perm]``).

* ``gemm_small``: few rows (decode, batch 1): the weight is never formed; each parallel work item owns 32 output
  columns, keeps the tile's scales / zeros for every group in a small table and accumulates ``M x 32`` sums while
  it walks the packed words once.  Memory traffic is the packed bytes: that is what makes batch-1 decode fast.
* ``decode_rows``: many rows (prefill): stored rows [k0, k1) decoded into a float32 scratch tile [k1 - k0, N]
  that the caller multiplies with BLAS (``torch.addmm``) tile after tile; the scratch is bounded and reused.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..codec.f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["TILE", "exl2_row_table", "gptq_row_table", "exl2_tile_params", "gemm_small_exl2", "gemm_small_gptq",
           "decode_rows_exl2", "decode_rows_gptq"]

TILE = 32  # output columns per work item (EXL2's N_pad is a multiple of 32)


def exl2_row_table(bits: np.ndarray, row_start: np.ndarray, qrow: np.ndarray, rows: np.ndarray,
                   rows_per_unit: np.ndarray, words_per_unit: np.ndarray) -> np.ndarray:
    """int32 [K, 4]: (packed word, bit shift, group, bits) of every stored row of an EXL2 layer (its
    ``GroupTable`` columns; ``rows_per_unit`` / ``words_per_unit`` indexed by bit width)."""
    K = int(np.asarray(rows).sum())
    tab = np.empty((K, 4), dtype=np.int32)
    for g in range(len(bits)):
        b, r0, q0, r = int(bits[g]), int(row_start[g]), int(qrow[g]), int(rows[g])
        U, W = int(rows_per_unit[b]), int(words_per_unit[b])
        i = np.arange(r)
        u = i // U
        pos = (i - u * U) * b
        tab[r0:r0 + r, 0] = q0 + u * W + (pos >> 5)
        tab[r0:r0 + r, 1] = pos & 31
        tab[r0:r0 + r, 2] = g
        tab[r0:r0 + r, 3] = b
    return tab


def gptq_row_table(K: int, bits: int, g_idx: np.ndarray) -> np.ndarray:
    """int32 [K, 4] of a GPTQ layer: 32 rows of a column form one bit string of ``bits`` words (packed along K)."""
    k = np.arange(K)
    pos = (k % 32) * bits
    tab = np.empty((K, 4), dtype=np.int32)
    tab[:, 0] = (k // 32) * bits + (pos >> 5)
    tab[:, 1] = pos & 31
    tab[:, 2] = np.asarray(g_idx, dtype=np.int64)
    tab[:, 3] = bits
    return tab


@njit(cache=True)
def exl2_tile_params(qs, qsm, gbits, n0, width, g0, g1, S, Z):
    """S[g, c], Z[g, c] of an EXL2 tile (columns n0 .. n0 + width, groups g0 .. g1): s = fp16(fp16((c+1)^2) * m),
    m = fp16(q_scale_max / 256), Z = 2^(b-1)."""
    for g in range(g0, g1):
        m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm[g]) * np.float32(0.00390625)))
        z = np.float32(1 << (gbits[g] - 1))
        for c in range(width):
            n = n0 + c
            code = (np.uint32(qs[g, n >> 3]) >> np.uint32(4 * (n & 7))) & np.uint32(15)
            S[g, c] = f16_bits_to_f32(f32_to_f16_bits(np.float32((code + 1) * (code + 1)) * m))
            Z[g, c] = z


@njit(cache=True)
def _gptq_tile_params(scales, zeros, zoff, n0, width, S, Z):
    for g in range(scales.shape[0]):
        for c in range(width):
            S[g, c] = f16_bits_to_f32(scales[g, n0 + c])
            Z[g, c] = np.float32(zeros[g, n0 + c]) + zoff


@njit(cache=True, inline="always")
def _decode_full(r0, r1, s0, s1, mask, straddle, n0, Sg, Zg, w):
    # a compile-time trip count (TILE): LLVM unrolls and vectorises this loop
    if straddle:
        for c in range(TILE):
            v = np.float32(np.int32(((r0[n0 + c] >> s0) | (r1[n0 + c] << s1)) & mask))
            w[c] = f16_bits_to_f32(f32_to_f16_bits((v - Zg[c]) * Sg[c]))
    else:
        for c in range(TILE):
            v = np.float32(np.int32((r0[n0 + c] >> s0) & mask))
            w[c] = f16_bits_to_f32(f32_to_f16_bits((v - Zg[c]) * Sg[c]))


@njit(cache=True, inline="always")
def _decode_row(qw, wi, sh, b, n0, width, Sg, Zg, w):
    """w[c] = W[k, n0 + c] for c < width, row k at (word wi, shift sh, b bits); Sg / Zg the row's group."""
    mask = np.uint32((1 << b) - 1)
    straddle = sh + b > 32
    r0 = qw[wi]
    r1 = qw[wi + 1] if straddle else r0
    s0, s1 = np.uint32(sh), np.uint32((32 - sh) & 31)
    if width == TILE:
        _decode_full(r0, r1, s0, s1, mask, straddle, n0, Sg, Zg, w)
    else:
        for c in range(width):
            v = np.float32(np.int32(((r0[n0 + c] >> s0) | ((r1[n0 + c] << s1) if straddle else np.uint32(0))) & mask))
            w[c] = f16_bits_to_f32(f32_to_f16_bits((v - Zg[c]) * Sg[c]))


@njit(cache=True, inline="always")
def _accumulate(x, qw, tab, S, Z, n0, width, k0, k1, acc, w):
    M = x.shape[0]
    for k in range(k0, k1):
        g = tab[k, 2]
        _decode_row(qw, tab[k, 0], tab[k, 1], tab[k, 3], n0, width, S[g], Z[g], w)
        for m in range(M):
            xv = x[m, k]
            a = acc[m]
            for c in range(TILE):
                a[c] += xv * w[c]


@njit(cache=True, parallel=True)
def gemm_small_exl2(x, qw, qs, qsm, gbits, tab, y):
    """y[M, N] = x[M, K] (stored row order, float32) @ W[K, N] of an EXL2 layer (N <= N_pad columns written)."""
    N = y.shape[1]
    G = gbits.shape[0]
    for ti in prange((N + TILE - 1) // TILE):
        n0 = ti * TILE
        width = min(TILE, N - n0)
        S = np.empty((G, TILE), dtype=np.float32)
        Z = np.empty((G, TILE), dtype=np.float32)
        exl2_tile_params(qs, qsm, gbits, n0, width, 0, G, S, Z)
        acc = np.zeros((x.shape[0], TILE), dtype=np.float32)
        w = np.zeros(TILE, dtype=np.float32)
        _accumulate(x, qw, tab, S, Z, n0, width, 0, tab.shape[0], acc, w)
        for m in range(x.shape[0]):
            for c in range(width):
                y[m, n0 + c] = acc[m, c]


@njit(cache=True, parallel=True)
def gemm_small_gptq(x, qw, scales, zeros, zoff, tab, y):
    """y[M, N] = x[M, K] @ W[K, N] of a GPTQ layer (``scales`` fp16 bits [G, N], ``zeros`` stored fields
    uint8 [G, N], true zero = field + ``zoff``)."""
    N = y.shape[1]
    G = scales.shape[0]
    for ti in prange((N + TILE - 1) // TILE):
        n0 = ti * TILE
        width = min(TILE, N - n0)
        S = np.empty((G, TILE), dtype=np.float32)
        Z = np.empty((G, TILE), dtype=np.float32)
        _gptq_tile_params(scales, zeros, zoff, n0, width, S, Z)
        acc = np.zeros((x.shape[0], TILE), dtype=np.float32)
        w = np.zeros(TILE, dtype=np.float32)
        _accumulate(x, qw, tab, S, Z, n0, width, 0, tab.shape[0], acc, w)
        for m in range(x.shape[0]):
            for c in range(width):
                y[m, n0 + c] = acc[m, c]


@njit(cache=True, inline="always")
def _decode_tile(qw, tab, S, Z, n0, width, k0, k1, out):
    for k in range(k0, k1):
        g = tab[k, 2]
        _decode_row(qw, tab[k, 0], tab[k, 1], tab[k, 3], n0, width, S[g], Z[g], out[k - k0, n0:])


@njit(cache=True, parallel=True)
def decode_rows_exl2(qw, qs, qsm, gbits, tab, k0, k1, out):
    """out[k - k0, n] = W[k, n] (float32, stored row order) for k in [k0, k1), n < out.shape[1]."""
    N = out.shape[1]
    g0, g1 = tab[k0, 2], tab[k1 - 1, 2] + 1  # EXL2 groups are contiguous in stored order
    for ti in prange((N + TILE - 1) // TILE):
        n0 = ti * TILE
        width = min(TILE, N - n0)
        S = np.empty((g1, TILE), dtype=np.float32)
        Z = np.empty((g1, TILE), dtype=np.float32)
        exl2_tile_params(qs, qsm, gbits, n0, width, g0, g1, S, Z)
        _decode_tile(qw, tab, S, Z, n0, width, k0, k1, out)


@njit(cache=True, parallel=True)
def decode_rows_gptq(qw, scales, zeros, zoff, tab, k0, k1, out):
    N = out.shape[1]
    G = scales.shape[0]
    for ti in prange((N + TILE - 1) // TILE):
        n0 = ti * TILE
        width = min(TILE, N - n0)
        S = np.empty((G, TILE), dtype=np.float32)
        Z = np.empty((G, TILE), dtype=np.float32)
        _gptq_tile_params(scales, zeros, zoff, n0, width, S, Z)
        _decode_tile(qw, tab, S, Z, n0, width, k0, k1, out)
