"""ExLlamaV2's per-group scale search (``exl2fmt.codec.scale_search``): the grid of errors E(p).

Oracle: a NumPy twin written here from the definition (float32 rounding and error terms, each column summed
over rows in row order in float32, the columns summed in column order in float64).
"""

from __future__ import annotations

import numpy as np
import pytest

from exl2fmt.codec.scale_search import P_GRID, grid_errors



def _grid_errors_numpy(x, trial, bits, pgrid=P_GRID):
    zero = 1 << (bits - 1)
    lo, hi = np.float32(-zero), np.float32((1 << bits) - 1 - zero)
    out = np.empty(len(pgrid))
    for i, p in enumerate(pgrid):
        s = (trial * np.float32(p)).astype(np.float32)
        col = np.zeros(x.shape[1], dtype=np.float32)
        for r in range(x.shape[0]):
            q = np.minimum(np.maximum(np.rint(x[r] / s), lo), hi)
            a = np.abs(q * s - x[r])
            col += a * a * a * np.sqrt(a)
        acc = 0.0
        for v in col:
            acc += float(v)
        out[i] = acc
    return out


def _trial(x, bits):
    """The trial scales find_scales passes to the grid."""
    maxq = (1 << bits) - 1
    base = (np.abs(x).max(axis=0) + np.float32(1e-12)) / np.float32(maxq / 2)
    smax = base.max()
    qs = np.clip(np.round(16 * np.sqrt(base / smax)), 1, 16)
    return ((qs.astype(np.float32) / 16) ** 2 * smax).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_grid_errors_match_the_numpy_twin(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.standard_normal(96))).astype(np.float32) * 0.02
    trial = _trial(x, bits)
    e = grid_errors(x, trial, bits)
    assert np.array_equal(e, _grid_errors_numpy(x, trial, bits))
