"""Weight statistics of a float16 array from a histogram of its bit patterns (used by ``validate --deep``).

Imported only by the deep path: importing this module imports Numba.  One parallel pass counts how often each
of the 65536 fp16 bit patterns occurs (integer increments only, no float arithmetic, no float32 copy of the
weight); mean, standard deviation, absmax and the NaN/Inf count then follow exactly from the 65536 counts
(float64 sums of exact values).  Faster than converting and reducing, and more accurate.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

__all__ = ["f16_stats"]

_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
_FINITE = np.isfinite(_VALUES)
#: below this many elements the values are reduced directly (the histogram's fixed cost is 65536 counts)
_SMALL = 1 << 16


@njit(cache=True, parallel=True)
def _histograms(bits, n_chunks, out):
    n = bits.size
    step = (n + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        h = out[c]
        for i in range(c * step, min(n, (c + 1) * step)):
            h[bits[i]] += 1


def f16_stats(w: np.ndarray) -> dict:
    """{"mean", "std", "absmax", "nonfinite", "numel"} of a float16 array (NaN/Inf excluded from the moments)."""
    bits = np.ascontiguousarray(w).reshape(-1).view(np.uint16)
    n = int(bits.size)
    if n < _SMALL:
        # the histogram costs 65536 counts per call: for a small array that is far more work than the array
        # (a header of 100k tiny layers would take hours), so reduce its values directly (float64, exact values)
        x = bits.view(np.float16).astype(np.float64)
        x = x[np.isfinite(x)]
        m = int(x.size)
        mean = float(x.sum()) / m if m else 0.0
        var = max(float(x @ x) / m - mean * mean, 0.0) if m else 0.0
        return {"mean": mean, "std": var ** 0.5, "absmax": float(np.abs(x).max()) if m else 0.0,
                "nonfinite": n - m, "numel": n}
    n_chunks = max(1, min(2 * get_num_threads(), n // (1 << 18)))
    hist = np.zeros((n_chunks, 1 << 16), dtype=np.int64)
    if n:
        _histograms(bits, n_chunks, hist)
    counts = hist.sum(axis=0)
    fin = counts[_FINITE]
    vals = _VALUES[_FINITE]
    m = int(fin.sum())
    mean = float(fin @ vals) / m if m else 0.0
    var = max(float(fin @ (vals * vals)) / m - mean * mean, 0.0) if m else 0.0
    used = vals[fin > 0]
    return {"mean": mean, "std": var ** 0.5, "absmax": float(np.abs(used).max()) if used.size else 0.0,
            "nonfinite": n - m, "numel": n}
