"""The CPU row loop of one GPTQ group (``quant.gptq._sweep``) as a Numba kernel; imported on first use (it
imports numba).

Defined at module level so that Numba's on-disk cache (``cache=True``) finds it again in the next process (a
function defined inside another one is compiled anew by every process: seconds of every run).

Within a group every output column is independent (row c's error only moves later rows of the same
column), so column tiles run in parallel; the arithmetic is the float32 sequence of the torch path
(``q = clamp(rint(w / s) + z)``, ``w_hat = fp16((q - z) * s)``, ``e = (w - w_hat) / U[c, c]``,
``w_r -= U[c, r] * e`` with two roundings), so both paths give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..codec.f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["kernel", "permute_f32", "unpermute_f32", "unpermute_f16_bits", "permute_both"]


#: Output columns per parallel work item: the tile and its row updates stay in L1/L2.
TILE = 128


@njit(cache=True, parallel=True, error_model="numpy")
def kernel(blk, Ublk, s, z, maxq, codes, err):
    """One group's row loop, in place.

    ``blk`` float32 [r, N] C order: the group's rows (stored order), overwritten with their fp16
    reconstructions; ``Ublk`` float32 [r, r] C order: the group's block of the upper Cholesky factor of the
    inverse Hessian; ``s``, ``z`` float32 [N]: scale (0 = the column rounds to its zero point) and zero point;
    ``maxq`` float32; ``codes`` uint8 [r, N] (written); ``err`` float32 [r, N] (written): each row's scaled
    error ``(w - w_hat) / U[c, c]``.

    Each work item copies its column tile into arrays of its own, so that every inner loop reads and writes
    memory the compiler knows to be unaliased and vectorizes (a loop over ``blk`` and ``err`` directly stays
    scalar: several times slower); the float32 operations and their order are those of the torch path."""
    r, N = blk.shape
    for t in prange((N + TILE - 1) // TILE):
        n0 = t * TILE
        n1 = min(N, n0 + TILE)
        w_ = n1 - n0
        loc = np.empty((r, w_), dtype=np.float32)
        sl = np.empty(w_, dtype=np.float32)
        zl = np.empty(w_, dtype=np.float32)
        e = np.empty(w_, dtype=np.float32)
        for j in range(w_):
            sl[j] = s[n0 + j]
            zl[j] = z[n0 + j]
        for c in range(r):
            for j in range(w_):
                loc[c, j] = blk[c, n0 + j]
        for c in range(r):
            d = Ublk[c, c]
            for j in range(w_):
                w = loc[c, j]
                sn = sl[j]
                zn = zl[j]
                # (w / 0 where sn == 0 is computed and discarded: the select keeps the zero point)
                q = min(max(np.rint(w / sn) + zn, np.float32(0)), maxq)
                q = q if sn > 0 else zn
                wh = f16_bits_to_f32(f32_to_f16_bits(np.float32((q - zn) * sn)))
                e[j] = np.float32((w - wh) / d)
                codes[c, n0 + j] = np.uint8(q)
                loc[c, j] = wh
            for rr in range(c + 1, r):        # the row's error moves the group's later rows of the tile
                u = Ublk[c, rr]
                for j in range(w_):
                    loc[rr, j] = np.float32(loc[rr, j] - np.float32(u * e[j]))
            for j in range(w_):
                err[c, n0 + j] = e[j]
        for c in range(r):
            for j in range(w_):
                blk[c, n0 + j] = loc[c, j]


#: Side of the square tiles the (un-)permuting transposes move through a local buffer (64 x 64 float32: 16 KiB).
_T = 64


@njit(cache=True, parallel=True)
def permute_f32(w, perm, out):
    """``out[k, n] = w[n, perm[k]]`` for n < N: a layer's weight to the sweep's work matrix (stored row order,
    transposed); the inverse of ``unpermute_f32``.

    ``w`` float32 [N, K] C order (the ``nn.Linear`` weight); ``perm`` int64 [K] (input feature of each stored
    row); ``out`` float32 [K, >= N] C order (columns from N on are not touched).  Square tiles go through a small
    local buffer: each tile reads runs of ``w``'s rows (gathered within a row) and writes runs of ``out``'s."""
    N, K = w.shape
    for t in prange((N + _T - 1) // _T):
        n0 = t * _T
        n1 = min(N, n0 + _T)
        buf = np.empty((_T, _T), dtype=np.float32)
        for k0 in range(0, K, _T):
            k1 = min(K, k0 + _T)
            for n in range(n0, n1):
                for k in range(k0, k1):
                    buf[k - k0, n - n0] = w[n, perm[k]]
            for k in range(k0, k1):
                for n in range(n0, n1):
                    out[k, n] = buf[k - k0, n - n0]


@njit(cache=True, parallel=True)
def unpermute_f32(Wt, invperm, out):
    """``out[n, j] = Wt[invperm[j], n]``: the sweep's result back to the layer's shape and feature order.

    ``Wt`` float32 [K, >= N] C order (stored row order); ``invperm`` int32 [K] (stored row of each original
    input feature); ``out`` float32 [N, K] C order (written).  Square tiles go through a small local buffer
    so that both the reads (rows of ``Wt``) and the writes (rows of ``out``) are contiguous runs."""
    N, K = out.shape
    for t in prange((N + _T - 1) // _T):
        n0 = t * _T
        n1 = min(N, n0 + _T)
        buf = np.empty((_T, _T), dtype=np.float32)
        for j0 in range(0, K, _T):
            j1 = min(K, j0 + _T)
            for j in range(j0, j1):
                src = invperm[j]
                for n in range(n0, n1):
                    buf[n - n0, j - j0] = Wt[src, n]
            for n in range(n0, n1):
                for j in range(j0, j1):
                    out[n, j] = buf[n - n0, j - j0]


# (the same tile walk as unpermute_f32, written out again: passing the conversion in as a jitted function would
# key Numba's disk cache on that function object's address, and every process would compile it anew)
@njit(cache=True, parallel=True)
def unpermute_f16_bits(Wt, invperm, out):
    """As ``unpermute_f32``, written as binary16 bit patterns: ``out`` uint16 [N, K] C order (a float16
    array's view).  Rounds to nearest even, so it is exact when ``Wt`` holds fp16 values (the sweep's
    reconstructions)."""
    N, K = out.shape
    for t in prange((N + _T - 1) // _T):
        n0 = t * _T
        n1 = min(N, n0 + _T)
        buf = np.empty((_T, _T), dtype=np.uint16)
        for j0 in range(0, K, _T):
            j1 = min(K, j0 + _T)
            for j in range(j0, j1):
                src = invperm[j]
                for n in range(n0, n1):
                    buf[n - n0, j - j0] = f32_to_f16_bits(Wt[src, n])
            for n in range(n0, n1):
                for j in range(j0, j1):
                    out[n, j] = buf[n - n0, j - j0]


@njit(cache=True, parallel=True)
def permute_both(H, p, out):
    """``out[i, j] = H[p[i], p[j]]``: a square matrix with its rows and columns both reordered by ``p`` (the
    Hessian in processing order, ``gptq.prepare``); a copy, so exact.  ``H`` float32 [K, K] C order, ``p`` int64
    [K] a permutation, ``out`` float32 [K, K] C order (written).  Each output row gathers within one source row
    (K floats: L1/L2-resident), where torch's ``index_select`` along columns reads with a stride of K."""
    K = H.shape[0]
    for i in prange(K):
        src = p[i]
        for j in range(K):
            out[i, j] = H[src, p[j]]
