"""The per-group scale search of the EXL2 quantizer, as a Numba kernel.

ExLlamaV2 picks one multiplier ``p`` per group from a grid of 97 values in [0.70, 1.20]: every column's trial
scale ``s_n`` is multiplied by ``p``, the group is rounded with it, and the ``p`` with the smallest
``sum |q * p * s_n - x|^3.5`` wins (spec/exl2.md, "scale search").  Evaluating the grid is the quantizer's
most frequent inner loop (once per group per candidate setting), so it gets a kernel: each grid point is
one parallel work item that sweeps the group once, accumulating per column in float32 and over columns in
float64, in a fixed order, so the result does not depend on the thread count.

``grid_errors`` is checked against a NumPy twin in ``tests/test_quant_gptq.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["P_GRID", "grid_errors"]

#: The 97 multipliers ExLlamaV2 tries (float32, as its kernel computes them).
P_GRID = np.linspace(0.70, 1.20, 97, dtype=np.float32)


@njit(cache=True, parallel=True, fastmath=False)
def _grid_errors(x, trial, pgrid, zero, maxq, out):
    R, N = x.shape
    lo = np.float32(-zero)
    hi = np.float32(maxq - zero)
    for pi in prange(pgrid.shape[0]):
        p = pgrid[pi]
        s = np.empty(N, dtype=np.float32)
        col = np.zeros(N, dtype=np.float32)
        for n in range(N):
            s[n] = trial[n] * p
        for r in range(R):
            # independent per column: the loop vectorizes without reassociating any sum
            for n in range(N):
                v = x[r, n]
                q = min(max(np.rint(v / s[n]), lo), hi)
                a = abs(q * s[n] - v)
                col[n] += a * a * a * np.sqrt(a)
        acc = 0.0
        for n in range(N):
            acc += col[n]
        out[pi] = acc


def grid_errors(x: np.ndarray, trial: np.ndarray, bits: int, pgrid: np.ndarray = P_GRID) -> np.ndarray:
    """E(p) for every p of ``pgrid``.

    ``x``      float32 [R, N], C order: the (error-compensated) rows of one group, N = padded out features.
    ``trial``  float32 [N]: the trial scales ``(qs_n / 16)^2 * smax``; every entry must be > 0.
    ``bits``   the group's bit width (codes clamp to [-2^(b-1), 2^(b-1) - 1] before the zero point).
    Returns float64 [len(pgrid)].
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    trial = np.ascontiguousarray(trial, dtype=np.float32)
    out = np.empty(len(pgrid), dtype=np.float64)
    _grid_errors(x, trial, np.ascontiguousarray(pgrid, dtype=np.float32), 1 << (bits - 1), (1 << bits) - 1, out)
    return out
