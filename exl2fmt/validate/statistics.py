"""Numbers of the data passes: NaN/Inf counts, weight statistics, weight-vs-reference error metrics.

Every function takes NumPy arrays (any shape, read chunk by chunk so temporary memory stays bounded) and
imports NumPy only when called.
"""

from __future__ import annotations

import math

__all__ = ["nonfinite_count", "weight_stats", "compare_weights", "CHUNK_ELEMS"]


#: Elements per chunk of the chunked passes (bounded temporary memory).
CHUNK_ELEMS = 1 << 22


def nonfinite_count(a, st_dtype: str) -> int:
    """NaN/Inf count of a stored tensor, chunked (bounded memory), on bit patterns where possible
    (``container.dtypes.count_nonfinite``, which the layer checks of ``formats`` share)."""
    from ..container.dtypes import count_nonfinite

    return count_nonfinite(a, st_dtype, CHUNK_ELEMS)


def weight_stats(w) -> dict:
    """{"mean", "std", "absmax", "nonfinite", "numel"} of a float array; NaN/Inf are counted, not averaged.

    float16 (every dequantized weight) goes through one parallel Numba pass on the bit patterns
    (``exl2fmt._stats``); other dtypes through chunked NumPy with float64 accumulation.
    """
    import numpy as np

    if np.asarray(w).dtype == np.float16:
        from .._stats import f16_stats

        return f16_stats(w)
    flat = np.asarray(w).reshape(-1)
    n = flat.size
    s = ss = 0.0
    amax = 0.0
    bad = 0
    for i in range(0, n, CHUNK_ELEMS):
        c = flat[i:i + CHUNK_ELEMS].astype(np.float32)
        fin = np.isfinite(c)
        nb = int(c.size - np.count_nonzero(fin))
        if nb:
            bad += nb
            c = c[fin]
        if c.size:
            s += float(c.sum(dtype=np.float64))
            ss += float(np.dot(c, c))
            amax = max(amax, float(np.abs(c).max()))
    m = n - bad
    mean = s / m if m else 0.0
    var = max(ss / m - mean * mean, 0.0) if m else 0.0
    return {"mean": mean, "std": math.sqrt(var), "absmax": amax, "nonfinite": bad, "numel": int(n)}


def compare_weights(w, ref) -> dict:
    """Relative Frobenius error, max abs error and cosine similarity of ``w`` against ``ref`` (same shape),
    accumulated in float64, chunk by chunk."""
    import numpy as np

    a = np.asarray(w).reshape(-1)
    b = np.asarray(ref).reshape(-1)
    ee = rr = ww = wr = 0.0
    mx = 0.0
    for i in range(0, a.size, CHUNK_ELEMS):
        x = a[i:i + CHUNK_ELEMS].astype(np.float64)
        y = b[i:i + CHUNK_ELEMS].astype(np.float64)
        d = x - y
        ee += float(np.dot(d, d))
        rr += float(np.dot(y, y))
        ww += float(np.dot(x, x))
        wr += float(np.dot(x, y))
        if d.size:
            mx = max(mx, float(np.abs(d).max()))
    rel = math.sqrt(ee / rr) if rr > 0 else (0.0 if ee == 0 else math.inf)
    cos = wr / math.sqrt(ww * rr) if ww > 0 and rr > 0 else (1.0 if ww == rr == 0 else 0.0)
    return {"rel_fro": rel, "max_abs": mx, "cosine": cos}
