"""Numba reference codecs for EXL2 (spec/exl2.md sections 3-5).

Every public function is pure: arrays in, new arrays out, no I/O.  Argument contracts:

* ``codes``      uint8 [K, N_pad], C order: integer code of stored row k, column n, in [0, 2^b_g).
* ``q_weight``   int32 [Q, N_pad], C order: packed codes (``pack_q_weight`` layout).
* ``q_scale``    int32 [G, N_pad/8], C order: 4-bit scale codes c, column 8m+i in bits [4i, 4i+4) of word m.
* ``scale_codes`` uint8 [G, N_pad]: the codes c in [0, 15] (c = upstream qscale - 1).
* ``q_scale_max`` float16 [G].
* ``q_invperm``  int32 [K]: stored row of original input feature j.
* ``groups``     a ``GroupTable`` (``exl2fmt.groups``) describing bits and rows of each group.

The slow NumPy twins in ``exl2fmt.codec.oracle`` define the same functions the obvious way; tests assert
the two agree bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..groups import GroupTable
from ..layout import BIT_WIDTHS
from ._f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = [
    "pack_q_weight", "unpack_q_weight", "pack_q_scale", "unpack_q_scale", "dequantize",
    "dequantize_stored", "invert_permutation", "is_permutation",
]

# Per-width constants indexed by bit width (0 where undefined); kept as arrays for Numba.
_UNIT_ROWS = np.zeros(9, dtype=np.int64)
_UNIT_WORDS = np.zeros(9, dtype=np.int64)
for _b, _w in BIT_WIDTHS.items():
    _UNIT_ROWS[_b] = _w.rows_per_unit
    _UNIT_WORDS[_b] = _w.words_per_unit

_JBLOCK = 256  # input features per block of the un-permuting transpose (K is a multiple of 32)
_TILE = 32  # output columns per parallel work item in dequantize (N_pad is a multiple of 32)


def _unit_table(groups: GroupTable):
    """Flatten groups into packing units: (bits, first stored row, first packed row) per unit."""
    ub, ur, uq = [], [], []
    for b, r0, q0, rows in zip(groups.bits.tolist(), groups.row_start.tolist(), groups.qrow.tolist(),
                               groups.rows.tolist()):
        U = int(_UNIT_ROWS[b])
        W = int(_UNIT_WORDS[b])
        n = rows // U
        ub.extend([b] * n)
        ur.extend(range(r0, r0 + n * U, U))
        uq.extend(range(q0, q0 + n * W, W))
    return (np.asarray(ub, dtype=np.int64), np.asarray(ur, dtype=np.int64), np.asarray(uq, dtype=np.int64))


# ----------------------------------------------------------------------------------------------
# q_weight
# ----------------------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _pack_units(codes, ubits, urow, uqrow, unit_rows, unit_words, out):
    n_cols = codes.shape[1]
    for u in prange(ubits.shape[0]):
        b = ubits[u]
        U = unit_rows[b]
        W = unit_words[b]
        r0 = urow[u]
        q0 = uqrow[u]
        for w in range(W):
            for n in range(n_cols):
                out[q0 + w, n] = 0
        for t in range(U):
            pos = t * b
            w = pos >> 5
            s = pos & 31
            spill = s + b > 32
            for n in range(n_cols):
                v = np.uint32(codes[r0 + t, n])
                out[q0 + w, n] |= v << np.uint32(s)
                if spill:
                    out[q0 + w + 1, n] |= v >> np.uint32(32 - s)


@njit(cache=True, parallel=True)
def _unpack_units(q_weight_u32, ubits, urow, uqrow, unit_rows, out):
    n_cols = q_weight_u32.shape[1]
    for u in prange(ubits.shape[0]):
        b = ubits[u]
        U = unit_rows[b]
        r0 = urow[u]
        q0 = uqrow[u]
        mask = np.uint32((1 << b) - 1)
        for t in range(U):
            pos = t * b
            w = pos >> 5
            s = pos & 31
            spill = s + b > 32
            for n in range(n_cols):
                v = q_weight_u32[q0 + w, n] >> np.uint32(s)
                if spill:
                    v |= q_weight_u32[q0 + w + 1, n] << np.uint32(32 - s)
                out[r0 + t, n] = np.uint8(v & mask)


def _check_groups_fit(groups: GroupTable, K: int, what: str) -> None:
    if groups.K != K:
        raise ValueError(f"{what}: groups cover {groups.K} rows but the array has {K}")
    for g, (b, r) in enumerate(zip(groups.bits.tolist(), groups.rows.tolist())):
        if r % int(_UNIT_ROWS[b]):
            raise ValueError(f"{what}: group {g} has {r} rows, not a multiple of the {b}-bit unit "
                             f"({int(_UNIT_ROWS[b])} rows)")


def pack_q_weight(codes: np.ndarray, groups: GroupTable) -> np.ndarray:
    """Pack integer codes into ``q_weight``.

    ``codes``: uint8 (or any integer dtype) [K, N_pad], stored row order; group g's rows must lie in
    [0, 2^bits_g).  Returns int32 [Q, N_pad].  Raises ValueError on out-of-range codes or a bad group table.

    Example (one column, 4 bits): codes 0,1,...,7 -> word 0x76543210.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [K, N_pad], got shape {codes.shape}")
    _check_groups_fit(groups, codes.shape[0], "pack_q_weight")
    if codes.size:
        for g, (b, r0, r) in enumerate(zip(groups.bits.tolist(), groups.row_start.tolist(), groups.rows.tolist())):
            blk = codes[r0:r0 + r]
            if blk.size and (int(blk.max()) >= (1 << b) or int(blk.min()) < 0):
                raise ValueError(f"pack_q_weight: group {g} ({b} bits) has codes outside [0, {(1 << b) - 1}]")
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.empty((groups.Q, codes.shape[1]), dtype=np.uint32)
    ub, ur, uq = _unit_table(groups)
    if ub.size:
        _pack_units(codes, ub, ur, uq, _UNIT_ROWS, _UNIT_WORDS, out)
    return out.view(np.int32)


def unpack_q_weight(q_weight: np.ndarray, groups: GroupTable) -> np.ndarray:
    """Inverse of ``pack_q_weight``: int32 [Q, N_pad] -> uint8 codes [K, N_pad] in stored row order."""
    q_weight = np.asarray(q_weight)
    if q_weight.ndim != 2 or q_weight.shape[0] != groups.Q:
        raise ValueError(f"unpack_q_weight: q_weight shape {q_weight.shape} does not have {groups.Q} packed rows")
    qw = np.ascontiguousarray(q_weight).view(np.uint32)
    out = np.empty((groups.K, q_weight.shape[1]), dtype=np.uint8)
    ub, ur, uq = _unit_table(groups)
    if ub.size:
        _unpack_units(qw, ub, ur, uq, _UNIT_ROWS, out)
    return out


# ----------------------------------------------------------------------------------------------
# q_scale
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _pack_rows4(codes, out):
    G, M = out.shape
    for g in range(G):
        for m in range(M):
            acc = np.uint32(0)
            for i in range(8):
                acc |= np.uint32(codes[g, 8 * m + i]) << np.uint32(4 * i)
            out[g, m] = acc


@njit(cache=True)
def _unpack_rows4(q_scale_u32, out):
    G, M = q_scale_u32.shape
    for g in range(G):
        for m in range(M):
            word = q_scale_u32[g, m]
            for i in range(8):
                out[g, 8 * m + i] = np.uint8((word >> np.uint32(4 * i)) & np.uint32(15))


def pack_q_scale(scale_codes: np.ndarray) -> np.ndarray:
    """uint8 [G, N_pad] codes c in [0, 15] -> ``q_scale`` int32 [G, N_pad/8].

    Example: codes 0,1,...,7 in one row -> word 0x76543210.
    """
    c = np.asarray(scale_codes)
    if c.ndim != 2 or c.shape[1] % 8:
        raise ValueError(f"scale codes must be [G, N_pad] with N_pad a multiple of 8, got {c.shape}")
    if c.size and (int(c.max()) > 15 or int(c.min()) < 0):
        raise ValueError("scale codes must lie in [0, 15]")
    out = np.empty((c.shape[0], c.shape[1] // 8), dtype=np.uint32)
    _pack_rows4(np.ascontiguousarray(c, dtype=np.uint8), out)
    return out.view(np.int32)


def unpack_q_scale(q_scale: np.ndarray) -> np.ndarray:
    """``q_scale`` int32 [G, N_pad/8] -> uint8 codes [G, N_pad]."""
    q = np.ascontiguousarray(q_scale)
    if q.ndim != 2:
        raise ValueError(f"q_scale must be 2-D, got shape {q.shape}")
    out = np.empty((q.shape[0], q.shape[1] * 8), dtype=np.uint8)
    _unpack_rows4(q.view(np.uint32), out)
    return out


# ----------------------------------------------------------------------------------------------
# permutations
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _invert(perm, out):
    n = perm.shape[0]
    for i in range(n):
        out[i] = -1
    for i in range(n):
        p = perm[i]
        if p < 0 or p >= n or out[p] != -1:
            return i
        out[p] = i
    return -1


def invert_permutation(perm: np.ndarray) -> np.ndarray:
    """Inverse of a permutation of 0..K-1 (int array [K]) as int32 [K]; q_perm <-> q_invperm.

    Raises ValueError naming the first position where ``perm`` stops being a permutation.
    """
    p = np.ascontiguousarray(perm).astype(np.int64, copy=False)
    out = np.empty(p.shape[0], dtype=np.int64)
    bad = _invert(p, out)
    if bad >= 0:
        raise ValueError(f"not a permutation: entry {bad} = {int(p[bad])} is out of range or repeated")
    return out.astype(np.int32)


def is_permutation(perm: np.ndarray) -> bool:
    p = np.ascontiguousarray(perm).astype(np.int64, copy=False)
    return _invert(p, np.empty(p.shape[0], dtype=np.int64)) < 0


# ----------------------------------------------------------------------------------------------
# dequantization
# ----------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _dequant_tile(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, n0, tmp):
    """Dequantize columns [n0, n0 + TILE) of every stored row into tmp[K, TILE] (fp16 bits).

    The inner loop runs over the TILE columns: contiguous loads from q_weight, contiguous stores to tmp,
    so LLVM vectorizes the unpack, the int->float, the multiply and the fp16 rounding.
    """
    T = tmp.shape[1]
    scale = np.empty(T, dtype=np.float32)
    for g in range(gbits.shape[0]):
        b = gbits[g]
        z = np.float32(1 << (b - 1))
        mask = np.uint32((1 << b) - 1)
        # m = fp16(q_scale_max * 2^-8); s = fp16(fp16((c+1)^2) * m)
        m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm_bits[g]) * np.float32(0.00390625)))
        for c in range(T):
            n = n0 + c
            code = (q_scale_u32[g, n >> 3] >> np.uint32(4 * (n & 7))) & np.uint32(15)
            f = np.float32((code + 1) * (code + 1))
            scale[c] = f16_bits_to_f32(f32_to_f16_bits(f * m))
        U = _UNIT_ROWS_C[b]
        W = _UNIT_WORDS_C[b]
        r0 = grow0[g]
        q0 = gqrow[g]
        for u in range(grows[g] // U):
            qb = q0 + u * W
            kb = r0 + u * U
            for t in range(U):
                pos = t * b
                w = pos >> 5
                sh = np.uint32(pos & 31)
                lo = q_weight_u32[qb + w, n0:n0 + T]
                dst = tmp[kb + t]
                if (pos & 31) + b > 32:
                    # the value straddles two words: low bits from word w, high bits from word w + 1
                    hi = q_weight_u32[qb + w + 1, n0:n0 + T]
                    sh2 = np.uint32(32) - sh
                    for c in range(T):
                        v = np.int32(((lo[c] >> sh) | (hi[c] << sh2)) & mask)
                        dst[c] = f32_to_f16_bits((np.float32(v) - z) * scale[c])
                else:
                    for c in range(T):
                        v = np.int32((lo[c] >> sh) & mask)
                        dst[c] = f32_to_f16_bits((np.float32(v) - z) * scale[c])


_UNIT_ROWS_C = tuple(int(x) for x in _UNIT_ROWS)
_UNIT_WORDS_C = tuple(int(x) for x in _UNIT_WORDS)


@njit(cache=True, parallel=True)
def _dequant_linear(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, invperm, n_out, out):
    K = invperm.shape[0]
    n_tiles = (n_out + _TILE - 1) // _TILE
    for ti in prange(n_tiles):
        n0 = ti * _TILE
        tmp = np.empty((K, _TILE), dtype=np.uint16)
        _dequant_tile(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, n0, tmp)
        # Un-permute and transpose: stored row invperm[j] (one 64-byte line of tmp holding all TILE
        # columns) becomes column j of TILE output rows.
        n_here = min(_TILE, n_out - n0)
        for j0 in range(0, K, _JBLOCK):
            j1 = min(j0 + _JBLOCK, K)
            for c in range(n_here):
                dst = out[n0 + c]
                for j in range(j0, j1):
                    dst[j] = tmp[invperm[j], c]


@njit(cache=True, parallel=True)
def _dequant_stored(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, out):
    K, n_pad = out.shape
    for ti in prange(n_pad // _TILE):
        n0 = ti * _TILE
        tmp = np.empty((K, _TILE), dtype=np.uint16)
        _dequant_tile(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, n0, tmp)
        for k in range(K):
            for c in range(_TILE):
                out[k, n0 + c] = tmp[k, c]


def _common_args(q_weight, q_scale, q_scale_max, groups: GroupTable):
    q_weight = np.ascontiguousarray(q_weight)
    q_scale = np.ascontiguousarray(q_scale)
    qsm = np.ascontiguousarray(q_scale_max)
    if q_weight.dtype != np.int32 or q_weight.ndim != 2:
        raise ValueError(f"q_weight must be int32 [Q, N_pad], got {q_weight.dtype} {q_weight.shape}")
    n_pad = q_weight.shape[1]
    if n_pad % _TILE:
        raise ValueError(f"q_weight has {n_pad} columns; N_pad must be a multiple of 32")
    if q_weight.shape[0] != groups.Q:
        raise ValueError(f"q_weight has {q_weight.shape[0]} rows; the groups need {groups.Q}")
    if q_scale.dtype != np.int32 or q_scale.shape != (groups.G, n_pad // 8):
        raise ValueError(f"q_scale must be int32 {(groups.G, n_pad // 8)}, got {q_scale.dtype} {q_scale.shape}")
    if qsm.dtype != np.float16 or qsm.shape != (groups.G,):
        raise ValueError(f"q_scale_max must be float16 ({groups.G},), got {qsm.dtype} {qsm.shape}")
    _check_groups_fit(groups, groups.K, "dequantize")
    return (q_weight.view(np.uint32), q_scale.view(np.uint32), qsm.view(np.uint16),
            groups.bits.astype(np.int64), groups.row_start.astype(np.int64), groups.qrow.astype(np.int64),
            groups.rows.astype(np.int64))


def dequantize(q_weight: np.ndarray, q_scale: np.ndarray, q_scale_max: np.ndarray, groups: GroupTable,
               q_invperm: np.ndarray, out_features: int | None = None) -> np.ndarray:
    """Full dequantization to the ``nn.Linear`` weight: float16 [out_features, K], C order.

    Bit-exact with ExLlamaV2's reconstruction: m = fp16(q_scale_max/256), s = fp16(fp16((c+1)^2) * m),
    w = fp16(fp16(q - 2^(b-1)) * s), then W[q_perm[k], n] = w(k, n) and the N padding is dropped
    (``out_features`` defaults to N_pad).  ``q_invperm`` must be a permutation (checked).
    """
    args = _common_args(q_weight, q_scale, q_scale_max, groups)
    n_pad = q_weight.shape[1]
    n_out = n_pad if out_features is None else int(out_features)
    if not (0 <= n_out <= n_pad):
        raise ValueError(f"out_features {n_out} must lie in [0, N_pad={n_pad}]")
    inv = np.ascontiguousarray(q_invperm).astype(np.int64, copy=False)
    if inv.shape != (groups.K,) or not is_permutation(inv):
        raise ValueError(f"q_invperm must be a permutation of 0..{groups.K - 1}")
    out = np.empty((n_out, groups.K), dtype=np.uint16)
    if n_out and groups.K:
        _dequant_linear(*args, inv, n_out, out)
    return out.view(np.float16)


def dequantize_stored(q_weight: np.ndarray, q_scale: np.ndarray, q_scale_max: np.ndarray,
                      groups: GroupTable) -> np.ndarray:
    """Dequantize without un-permuting: float16 [K, N_pad] in stored row order (what kernels see)."""
    args = _common_args(q_weight, q_scale, q_scale_max, groups)
    out = np.empty((groups.K, q_weight.shape[1]), dtype=np.uint16)
    if out.size:
        _dequant_stored(*args, out)
    return out.view(np.float16)
