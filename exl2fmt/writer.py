"""Assemble EXL2 layer tensors: from integer codes (exact writer) or from float weights by round-to-nearest.

``exl2_tensors`` packs already-chosen codes into the on-disk slots.  ``quantize_rtn`` chooses codes with
ExLlamaV2's per-group scale search (``AdaptiveQuantizer.find_params``: base scales, 4-bit quadratic codes,
a 97-point grid over p in [0.70, 1.20] minimising sum |err|^3.5) but without GPTQ error feedback; it is what
the embedded sample and the golden vectors use.  The calibrated GPTQ quantizer lives in ``converters``.
"""

from __future__ import annotations

import numpy as np

from .groups import encode_q_groups, group_table_from_rows
from .layout import BIT_WIDTHS, Tier, pad32, plan_rows

__all__ = ["exl2_tensors", "quantize_rtn", "find_scales"]

def exl2_tensors(codes: np.ndarray, scale_codes: np.ndarray, q_scale_max: np.ndarray,
                 bits_rows: list[tuple[int, int]], q_invperm: np.ndarray,
                 bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Pack one layer.  ``codes`` uint8 [K, N_pad] (stored order), ``scale_codes`` uint8 [G, N_pad] in 0..15,
    ``q_scale_max`` [G] (stored as float16), ``q_invperm`` [K], ``bias`` [N] or [N_pad] (zero-padded).
    Returns slot name -> array with the dtypes of the layout table."""
    from .codec.exl2 import pack_q_scale, pack_q_weight

    gt = group_table_from_rows(bits_rows)
    out = {
        "q_weight": pack_q_weight(codes, gt),
        "q_scale": pack_q_scale(scale_codes),
        "q_scale_max": np.asarray(q_scale_max).astype(np.float16),
        "q_groups": encode_q_groups(bits_rows),
        "q_invperm": np.asarray(q_invperm).astype(np.int32),
    }
    if bias is not None:
        n_pad = codes.shape[1]
        b = np.zeros(n_pad, dtype=np.float16)
        b[: len(bias)] = np.asarray(bias).astype(np.float16)
        out["bias"] = b
    return out


def _f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def find_scales(x: np.ndarray, bits: int, refine: bool = False):
    """Scale search for one group (ExLlamaV2's ``find_params``).  ``x`` float32 [rows, N_pad].

    Returns (scale_codes uint8 [N_pad] in 0..15, q_scale_max float16 scalar, s float32 [N_pad] = the exact
    fp16 scales used to quantize).  All-zero columns get code 0.  An all-zero group gets the smallest positive
    q_scale_max (the validator requires > 0); its scales round to 0 and every code is the zero point.
    ``refine``: afterwards, each column takes the nearby code with the smallest squared error
    (``codec.scale_search.refine_scale_codes``; exl2fmt's, not ExLlamaV2's).
    """
    from .codec.scale_search import P_GRID, grid_errors, refine_scale_codes

    x = np.ascontiguousarray(x, dtype=np.float32)
    maxq = (1 << bits) - 1
    xmax = np.abs(x).max(axis=0) + np.float32(1e-12)
    base = xmax / np.float32(maxq / 2)
    smax = base.max()
    qs = np.clip(np.round(16 * np.sqrt(base / smax)), 1, 16).astype(np.int64)
    trial = ((qs.astype(np.float32) / 16) ** 2 * smax).astype(np.float32)
    best_p = float(P_GRID[int(np.argmin(grid_errors(x, trial, bits)))])
    qsm = np.float16(max(float(np.float16(smax * np.float32(best_p))), 2.0 ** -24))
    m = _f16(np.float32(qsm) * np.float32(1 / 256))
    if refine:
        qs = refine_scale_codes(x, (qs - 1).astype(np.uint8), qsm, bits).astype(np.int64) + 1
    s = _f16(_f16((qs * qs).astype(np.float32)) * m)
    return (qs - 1).astype(np.uint8), qsm, s


def quantize_rtn(weight: np.ndarray, tiers: list[Tier], perm: np.ndarray | None = None,
                 bias: np.ndarray | None = None, refine_scales: bool = False) -> dict[str, np.ndarray]:
    """Quantize an ``nn.Linear`` weight [N, K] (any float dtype) to EXL2 tensors by round-to-nearest.

    ``perm`` [K]: stored row k holds input feature perm[k] (act-order); default identity.  K must be a
    multiple of 32; N is zero-padded to a multiple of 32.  ``refine_scales``: see ``find_scales(refine=)``.
    """
    w = np.asarray(weight, dtype=np.float32)
    N, K = w.shape
    n_pad = pad32(N)
    W = np.zeros((K, n_pad), dtype=np.float32)
    W[:, :N] = w.T
    if perm is None:
        perm = np.arange(K)
    perm = np.asarray(perm, dtype=np.int64)
    Ws = W[perm]
    bits_rows = plan_rows(K, tiers)
    codes = np.empty((K, n_pad), dtype=np.uint8)
    scale_codes = np.empty((len(bits_rows), n_pad), dtype=np.uint8)
    qsm = np.empty(len(bits_rows), dtype=np.float16)
    r0 = 0
    for g, (b, r) in enumerate(bits_rows):
        x = Ws[r0:r0 + r]
        c, m, s = find_scales(x, b, refine=refine_scales)
        z = BIT_WIDTHS[b].zero_point
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.rint(x / np.where(s > 0, s, 1)) + z, z)
        codes[r0:r0 + r] = np.clip(q, 0, (1 << b) - 1).astype(np.uint8)
        scale_codes[g] = c
        qsm[g] = m
        r0 += r
    invperm = np.argsort(perm).astype(np.int32)
    return exl2_tensors(codes, scale_codes, qsm, bits_rows, invperm, bias)
