"""GPTQ round-to-nearest fitting (gptq-gguf-formats A1-A5): the group fit that the GPTQ sweep and the converters
share (the layer assembly is ``formats.gptq.gptq_layer_tensors``).

Arrays (all C order):

* ``codes``   uint8 [K, N]: code of input row j (ORIGINAL order), output column n, in [0, 2^bits)
* ``scales``  float16 [G, N]; ``zeros`` int [G, N] (true zero points z, not the stored v1 field z - 1)
* ``g_idx``   int32 [K]: group of each original input row

Dequantization (what every GPTQ reader computes): ``W[n, j] = fp16(fp16(q[j, n] - z[g, n]) * scales[g, n])``
with ``g = g_idx[j]``; ``q - z`` is exact in fp16 and the product of two fp16 values is exact in float32, so
float32 arithmetic followed by one rounding to fp16 gives exactly that value.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fit_group", "rtn_quantize", "reconstruct", "trivial_g_idx"]

#: Multipliers of the range-derived scale tried by ``fit_group`` (the best fp16 scale per column wins).
_GRID = np.linspace(0.55, 1.25, 57, dtype=np.float32)


def reconstruct(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """fp16(fp16(q - z) * s) for codes [R, N], scale [N] (fp16), zero [N]: float32 [R, N] of fp16 values."""
    q = codes.astype(np.float32) - np.asarray(zero, dtype=np.float32)[None, :]
    return (q * np.asarray(scale, dtype=np.float16).astype(np.float32)[None, :]).astype(np.float16).astype(np.float32)


def _quant(x, s, z, maxq):
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x / s[None, :]) + z[None, :]
    q = np.where(np.isfinite(q), q, z[None, :])
    return np.clip(q, 0, maxq)


def fit_group(x: np.ndarray, bits: int, sym: bool = True, extra_scales=(), want_codes: bool = True
              ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Round-to-nearest with the best fp16 scale per column.

    ``x`` float32 [R, N]: the values of one group.  Candidates per column: the GPTQ range scale (A5: sym
    ``2*amax/maxq``, asym ``(xmax - xmin)/maxq`` with the range including 0) times each multiplier of a grid
    over [0.55, 1.25], plus ``extra_scales`` (float [N] arrays, e.g. the source scale times 2^k); each is
    rounded to fp16 and the one with the smallest squared reconstruction error wins (the first on a tie).
    Asymmetric zero points are clamped to [1, maxq] so that the v1 field z - 1 is never negative (A3).

    The squared errors are summed in float64 over the rows in NumPy's order for ``x``'s layout (one row after
    the other when rows are the outer axis in memory, NumPy's pairwise summation when the columns are), so the
    choice is the one of ``np.sum(err ** 2, axis=0)``; the candidates' errors are evaluated by a Numba kernel
    (``codec.gptq_fit_kernel.fit``).

    Returns (codes uint8 [R, N], scales float16 [N], zeros int32 [N]); codes None with ``want_codes=False``
    (the GPTQ sweep rounds the rows itself, one at a time).
    """
    x = np.asarray(x, dtype=np.float32)
    R, N = x.shape
    maxq = (1 << bits) - 1
    zsym = np.float32(1 << (bits - 1))
    xmin = np.minimum(x.min(axis=0, initial=0), 0)
    xmax = np.maximum(x.max(axis=0, initial=0), 0)
    if sym:
        amax = np.maximum(np.abs(xmin), xmax)
        rng = 2 * amax
    else:
        rng = xmax - xmin
    rng = np.where(rng > 0, rng, np.float32(2)).astype(np.float32)  # A5: an all-zero group fits [-1, 1]
    base = rng / np.float32(maxq)
    cands = np.stack([base * p for p in _GRID] + [np.asarray(e, dtype=np.float32) for e in extra_scales])
    with np.errstate(over="ignore"):
        s16 = cands.astype(np.float16)                                 # [C, N]
    s = s16.astype(np.float32)
    ok = np.isfinite(s) & (s > 0)
    s = np.where(ok, s, np.float32(1))
    if sym:
        z = np.full(s.shape, zsym, dtype=np.float32)
    else:
        z = np.clip(np.rint(-xmin[None, :] / s), 1, maxq).astype(np.float32)
    best = np.empty(N, dtype=np.int64)
    if R and N:
        pairwise = N == 1 or (R > 1 and abs(x.strides[0]) < abs(x.strides[1]))
        _fit_kernel()(x, s, z, ok, np.float32(maxq), pairwise, _visit_order(s.shape[0]), best)
    else:
        best[:] = -1
    found = best >= 0
    pick = np.where(found, best, 0)
    cols = np.arange(N)
    best_s = np.where(found, s16[pick, cols], np.float16(0)).astype(np.float16)
    best_z = np.where(found, z[pick, cols], zsym).astype(np.float32)
    codes = _quant(x, best_s.astype(np.float32), best_z, maxq).astype(np.uint8) if want_codes else None
    return codes, best_s, best_z.astype(np.int32)


def _fit_kernel():
    from .gptq_fit_kernel import fit

    return fit


def _visit_order(C: int) -> np.ndarray:
    """0..C-1 from the middle outwards: C//2, C//2 + 1, C//2 - 1, ..."""
    mid = C // 2
    return np.array(sorted(range(C), key=lambda c: (abs(c - mid), c < mid)), dtype=np.int64)




def trivial_g_idx(K: int, group_size: int) -> np.ndarray:
    gs = K if group_size == -1 else group_size
    return (np.arange(K) // gs).astype(np.int32)


def rtn_quantize(weight: np.ndarray, bits: int, group_size: int, *, sym: bool = True,
                 perm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Quantize an ``nn.Linear`` weight [N, K] to GPTQ codes by round-to-nearest (no calibration).

    ``perm`` [K] (act-order): processing order of the input rows; group h holds rows perm[h*gs:(h+1)*gs], and
    ``g_idx[perm[i]] = i // gs`` (qweight rows stay in original order, as GPTQ writes them).  ``group_size``
    -1 = one group.  Returns (codes uint8 [K, N], scales float16 [G, N], zeros int32 [G, N], g_idx int32 [K]).
    """
    w = np.asarray(weight, dtype=np.float32)
    N, K = w.shape
    gs = K if group_size == -1 else int(group_size)
    order = np.arange(K) if perm is None else np.asarray(perm, dtype=np.int64)
    G = -(-K // gs)
    wp = w[:, order]                             # [N, K], input rows in processing order (one copy)
    codes_p = np.empty((K, N), dtype=np.uint8)
    scales = np.empty((G, N), dtype=np.float16)
    zeros = np.empty((G, N), dtype=np.int32)
    for h in range(G):                           # each group a strided view [gs, N]: no copy
        codes_p[h * gs:(h + 1) * gs], scales[h], zeros[h] = fit_group(wp[:, h * gs:(h + 1) * gs].T, bits, sym)
    codes = np.empty((K, N), dtype=np.uint8)
    codes[order] = codes_p
    g_idx = np.empty(K, dtype=np.int32)
    g_idx[order] = np.arange(K) // gs
    return codes, scales, zeros, g_idx
