"""Decode an EXL2 layer and reduce it to statistics in one pass, without materializing the weight.

``validate --deep`` must prove every layer decodes and report its weight statistics; building the fp16
``nn.Linear`` weight for that (a transpose through a permutation, 2 bytes written per weight) costs several
times more than reading the packed file.  This kernel decodes every code with the exact fp16 rounding of
``exl2fmt.codec.exl2.dequantize`` (so the values are bit-identical to the dequantized weight) and folds them
into per-column sums, sums of squares, absolute maxima and non-finite counts.  Statistics do not depend on
row order, so rows are visited in stored order and the permutation is never applied.

``tests/test_codec_stats.py`` checks the result against statistics of ``dequantize``'s output.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..groups import GroupTable
from ..layout import BIT_WIDTHS
from .f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["layer_stats"]

_TILE = 64  # columns per parallel work item
_UNIT_ROWS_C = tuple(BIT_WIDTHS[b].rows_per_unit if b in BIT_WIDTHS else 0 for b in range(9))
_UNIT_WORDS_C = tuple(BIT_WIDTHS[b].words_per_unit if b in BIT_WIDTHS else 0 for b in range(9))


@njit(cache=True, parallel=True)
def _stats_kernel(q_weight_u32, q_scale_u32, qsm_bits, gbits, gqrow, grows, n_out, partial):
    # partial[tile] = (sum, sum of squares, absmax, nonfinite count) over columns [n0, n0 + _TILE) < n_out
    n_tiles = partial.shape[0]
    for ti in prange(n_tiles):
        n0 = ti * _TILE
        T = min(_TILE, n_out - n0)
        scale = np.empty(_TILE, dtype=np.float32)
        s1 = np.zeros(_TILE, dtype=np.float32)
        s2 = np.zeros(_TILE, dtype=np.float32)
        amax = np.zeros(_TILE, dtype=np.float32)
        bad = np.zeros(_TILE, dtype=np.int64)
        tot1 = 0.0
        tot2 = 0.0
        for g in range(gbits.shape[0]):
            b = gbits[g]
            z = np.float32(1 << (b - 1))
            mask = np.uint32((1 << b) - 1)
            m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm_bits[g]) * np.float32(0.00390625)))
            for c in range(T):
                n = n0 + c
                code = (q_scale_u32[g, n >> 3] >> np.uint32(4 * (n & 7))) & np.uint32(15)
                scale[c] = f16_bits_to_f32(f32_to_f16_bits(np.float32((code + 1) * (code + 1)) * m))
                s1[c] = 0.0
                s2[c] = 0.0
            U = _UNIT_ROWS_C[b]
            W = _UNIT_WORDS_C[b]
            for u in range(grows[g] // U):
                qb = gqrow[g] + u * W
                for t in range(U):
                    pos = t * b
                    w = pos >> 5
                    sh = np.uint32(pos & 31)
                    lo = q_weight_u32[qb + w, n0:n0 + T]
                    if (pos & 31) + b > 32:
                        hi = q_weight_u32[qb + w + 1, n0:n0 + T]
                        sh2 = np.uint32(32) - sh
                        for c in range(T):
                            v = np.int32(((lo[c] >> sh) | (hi[c] << sh2)) & mask)
                            x = f16_bits_to_f32(f32_to_f16_bits((np.float32(v) - z) * scale[c]))
                            ax = abs(x)
                            ok = ax <= np.float32(65504.0)
                            x = x if ok else np.float32(0.0)
                            s1[c] += x
                            s2[c] += x * x
                            amax[c] = max(amax[c], x if x >= 0 else -x)
                            bad[c] += 0 if ok else 1
                    else:
                        for c in range(T):
                            v = np.int32((lo[c] >> sh) & mask)
                            x = f16_bits_to_f32(f32_to_f16_bits((np.float32(v) - z) * scale[c]))
                            ax = abs(x)
                            ok = ax <= np.float32(65504.0)
                            x = x if ok else np.float32(0.0)
                            s1[c] += x
                            s2[c] += x * x
                            amax[c] = max(amax[c], x if x >= 0 else -x)
                            bad[c] += 0 if ok else 1
            # fold the group's float32 column sums into float64 totals (a group has <= 32767 rows)
            for c in range(T):
                tot1 += s1[c]
                tot2 += s2[c]
        mx = np.float32(0.0)
        nb = 0
        for c in range(T):
            mx = max(mx, amax[c])
            nb += bad[c]
        partial[ti, 0] = tot1
        partial[ti, 1] = tot2
        partial[ti, 2] = mx
        partial[ti, 3] = nb


def layer_stats(q_weight: np.ndarray, q_scale: np.ndarray, q_scale_max: np.ndarray, groups: GroupTable,
                out_features: int | None = None) -> dict:
    """Decode every weight of an EXL2 layer and return {"mean", "std", "absmax", "nonfinite", "numel"}.

    Arrays as in ``exl2fmt.codec.exl2.dequantize`` (int32 q_weight [Q, N_pad], int32 q_scale [G, N_pad/8],
    float16 q_scale_max [G]); padding columns >= ``out_features`` are excluded.  Values are those of the
    fp16 dequantized weight exactly; the moments exclude NaN/Inf, which are counted in ``nonfinite``.
    """
    qw = np.ascontiguousarray(q_weight)
    qs = np.ascontiguousarray(q_scale)
    qsm = np.ascontiguousarray(q_scale_max)
    if qw.dtype != np.int32 or qw.ndim != 2 or qw.shape[0] != groups.Q or qw.shape[1] % 32:
        raise ValueError(f"q_weight must be int32 [{groups.Q}, N_pad % 32 == 0], got {qw.dtype} {qw.shape}")
    n_pad = qw.shape[1]
    if qs.dtype != np.int32 or qs.shape != (groups.G, n_pad // 8):
        raise ValueError(f"q_scale must be int32 {(groups.G, n_pad // 8)}, got {qs.dtype} {qs.shape}")
    if qsm.dtype != np.float16 or qsm.shape != (groups.G,):
        raise ValueError(f"q_scale_max must be float16 ({groups.G},), got {qsm.dtype} {qsm.shape}")
    for b, r in zip(groups.bits.tolist(), groups.rows.tolist()):
        if r % BIT_WIDTHS[b].rows_per_unit:
            raise ValueError(f"a {b}-bit group of {r} rows is not a whole number of packing units")
    n_out = n_pad if out_features is None else int(out_features)
    n_tiles = (n_out + _TILE - 1) // _TILE
    partial = np.zeros((n_tiles, 4), dtype=np.float64)
    if n_tiles and groups.K:
        _stats_kernel(qw.view(np.uint32), qs.view(np.uint32), qsm.view(np.uint16), groups.bits.astype(np.int64),
                      groups.qrow.astype(np.int64), groups.rows.astype(np.int64), n_out, partial)
    numel = groups.K * n_out
    nonfinite = int(partial[:, 3].sum())
    m = numel - nonfinite
    mean = float(partial[:, 0].sum()) / m if m else 0.0
    var = max(float(partial[:, 1].sum()) / m - mean * mean, 0.0) if m else 0.0
    return {"mean": mean, "std": var ** 0.5, "absmax": float(partial[:, 2].max()) if n_tiles else 0.0,
            "nonfinite": nonfinite, "numel": numel}
