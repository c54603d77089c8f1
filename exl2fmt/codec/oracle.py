"""Slow, obviously-correct NumPy / pure-Python twins of the Numba codecs.

Used only by tests and benchmarks as an independent oracle.  They follow the spec text literally:
the bit-string rule with Python integers, numpy's own float16 arithmetic for the rounding order, and
``numpy.argsort`` for permutations.  Nothing here shares code with ``exl2fmt.codec.exl2`` / ``gptq``.
"""

from __future__ import annotations

import numpy as np

UNIT = {2: (16, 1), 3: (32, 3), 4: (8, 1), 5: (32, 5), 6: (16, 3), 8: (4, 1)}


def pack_q_weight(codes: np.ndarray, bits_rows: list[tuple[int, int]]) -> np.ndarray:
    """codes [K, N] (stored order) -> int32 [Q, N] by building each unit's bit string as a Python int."""
    codes = np.asarray(codes)
    n_cols = codes.shape[1]
    out_rows = []
    r = 0
    for b, rows in bits_rows:
        U, W = UNIT[b]
        for u in range(rows // U):
            words = np.zeros((W, n_cols), dtype=np.uint32)
            for n in range(n_cols):
                acc = 0
                for t in range(U):
                    acc |= int(codes[r + u * U + t, n]) << (t * b)
                for w in range(W):
                    words[w, n] = (acc >> (32 * w)) & 0xFFFFFFFF
            out_rows.append(words)
        r += rows
    if not out_rows:
        return np.zeros((0, n_cols), dtype=np.int32)
    return np.concatenate(out_rows).view(np.int32)


def unpack_q_weight(q_weight: np.ndarray, bits_rows: list[tuple[int, int]]) -> np.ndarray:
    qw = np.asarray(q_weight).view(np.uint32)
    n_cols = qw.shape[1]
    K = sum(r for _, r in bits_rows)
    out = np.zeros((K, n_cols), dtype=np.uint8)
    r = 0
    q = 0
    for b, rows in bits_rows:
        U, W = UNIT[b]
        for u in range(rows // U):
            for n in range(n_cols):
                acc = 0
                for w in range(W):
                    acc |= int(qw[q + w, n]) << (32 * w)
                for t in range(U):
                    out[r + u * U + t, n] = (acc >> (t * b)) & ((1 << b) - 1)
            q += W
        r += rows
    return out


def pack_q_scale(scale_codes: np.ndarray) -> np.ndarray:
    c = np.asarray(scale_codes).astype(np.uint64)
    G, N = c.shape
    out = np.zeros((G, N // 8), dtype=np.uint64)
    for i in range(8):
        out |= c[:, i::8] << np.uint64(4 * i)
    return out.astype(np.uint32).view(np.int32)


def unpack_q_scale(q_scale: np.ndarray) -> np.ndarray:
    q = np.asarray(q_scale).view(np.uint32)
    G, M = q.shape
    out = np.zeros((G, M * 8), dtype=np.uint8)
    for i in range(8):
        out[:, i::8] = (q >> np.uint32(4 * i)) & np.uint32(15)
    return out


def encode_q_groups(bits_rows) -> np.ndarray:
    vals = []
    qrow = 0
    for b, r in bits_rows:
        vals += [b, qrow]
        qrow += r * b // 32
    return np.array(vals, dtype=np.int16)


def dequantize_stored(q_weight, q_scale, q_scale_max, bits_rows) -> np.ndarray:
    """Ŵ_stored [K, N_pad] float16 using numpy float16 arithmetic in the spec's order."""
    codes = unpack_q_weight(q_weight, bits_rows)
    c = unpack_q_scale(q_scale)
    K, n_pad = codes.shape
    out = np.zeros((K, n_pad), dtype=np.float16)
    r = 0
    for g, (b, rows) in enumerate(bits_rows):
        m = np.float16(q_scale_max[g]) * np.float16(1.0 / 256.0)              # fp16 * fp16 -> fp16
        s = (((c[g].astype(np.int32) + 1) ** 2).astype(np.float16) * m)       # [N_pad] fp16
        q = codes[r:r + rows].astype(np.int32) - (1 << (b - 1))
        out[r:r + rows] = q.astype(np.float16) * s[None, :]                   # fp16 * fp16 -> fp16
        r += rows
    return out


def dequantize(q_weight, q_scale, q_scale_max, bits_rows, q_invperm, out_features=None) -> np.ndarray:
    w = dequantize_stored(q_weight, q_scale, q_scale_max, bits_rows)
    q_perm = np.argsort(np.asarray(q_invperm), kind="stable")
    W = np.empty_like(w)
    W[q_perm] = w                                     # W[q_perm[k]] = Ŵ_stored[k]
    n = w.shape[1] if out_features is None else out_features
    return np.ascontiguousarray(W[:, :n].T)


# ---------------------------------------------------------------------------------------------- GPTQ


def gptq_pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [R, C], R a multiple of 32 -> int32 [R*bits/32, C]: 32 codes -> `bits` words per column."""
    codes = np.asarray(codes)
    R, C = codes.shape
    out = np.zeros((R * bits // 32, C), dtype=np.uint32)
    for blk in range(R // 32):
        for col in range(C):
            acc = 0
            for i in range(32):
                acc |= int(codes[32 * blk + i, col]) << (bits * i)
            for w in range(bits):
                out[bits * blk + w, col] = (acc >> (32 * w)) & 0xFFFFFFFF
    return out.view(np.int32)


def gptq_unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    w = np.asarray(words).view(np.uint32)
    Rw, C = w.shape
    out = np.zeros((Rw * 32 // bits, C), dtype=np.uint8)
    for blk in range(Rw // bits):
        for col in range(C):
            acc = 0
            for j in range(bits):
                acc |= int(w[bits * blk + j, col]) << (32 * j)
            for i in range(32):
                out[32 * blk + i, col] = (acc >> (bits * i)) & ((1 << bits) - 1)
    return out


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v2: bool = False) -> np.ndarray:
    """nn.Linear weight [N, K] float16: W[n, k] = fp16(fp16(q - z) * fp16(scale)) with g = g_idx[k]."""
    q = gptq_unpack_rows(qweight, bits).astype(np.int32)                 # [K, N]
    zf = gptq_unpack_rows(np.asarray(qzeros).T.copy(), bits).T.astype(np.int32)   # [G, N]
    z = zf if v2 else zf + 1
    s = np.asarray(scales).astype(np.float16)
    g = np.asarray(g_idx).astype(np.int64)
    W = (q - z[g]).astype(np.float16) * s[g]
    return np.ascontiguousarray(W.T)
