"""ExLlamaV2's per-group scale search (``exl2fmt.codec.scale_search``): the grid of errors E(p) and its argmin
with an early exit.

Oracle: a NumPy twin written here from the definition (float32 rounding and error terms, each column summed
over rows in row order in float32, the columns summed in column order in float64).  The early-exit argmin must
give exactly the index of the full grid's ``np.argmin``: on random groups, on groups built to tie, for every
bit width, with one thread or several, and on non-finite input (which takes the full grid).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hyp_settings, seeds
from hypothesis import given
from hypothesis import strategies as st

from exl2fmt.codec.scale_search import P_GRID, grid_argmin, grid_errors


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
def test_grid_errors_match_the_numpy_twin_and_the_argmin_its_index(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.standard_normal(96))).astype(np.float32) * 0.02
    trial = _trial(x, bits)
    e = grid_errors(x, trial, bits)
    assert np.array_equal(e, _grid_errors_numpy(x, trial, bits))
    assert grid_argmin(x, trial, bits) == int(np.argmin(e))


@hyp_settings(40)
@given(seed=seeds(), bits=st.sampled_from([2, 3, 4, 5, 6, 8]), rows=st.integers(1, 40),
       cols=st.sampled_from([1, 7, 16, 17, 33, 96]), levels=st.sampled_from([0, 3, 50]))
def test_argmin_with_early_exit_is_the_full_grids_argmin(seed, bits, rows, cols, levels):
    """``levels`` > 0 draws the values from a few levels, so that many grid points tie exactly."""
    rng = np.random.default_rng(seed)
    if levels:
        x = (rng.integers(-levels, levels + 1, (rows, cols)) / levels).astype(np.float32)
    else:
        x = (rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal(cols))).astype(np.float32)
    trial = _trial(x, bits)
    want = int(np.argmin(grid_errors(x, trial, bits)))
    assert grid_argmin(x, trial, bits) == want


def test_argmin_does_not_depend_on_the_thread_count():
    import numba

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((128, 256)) * 0.02).astype(np.float32)
    old = numba.get_num_threads()
    try:
        got = []
        for t in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(t)
            got.append([grid_argmin(x, _trial(x, b), b) for b in (2, 3, 4, 8)])
    finally:
        numba.set_num_threads(old)
    assert all(g == got[0] for g in got)
    assert got[0] == [int(np.argmin(grid_errors(x, _trial(x, b), b))) for b in (2, 3, 4, 8)]


def test_non_finite_input_takes_the_full_grid():
    x = np.ones((4, 8), dtype=np.float32)
    x[1, 3] = np.nan
    trial = np.full(8, 0.1, dtype=np.float32)
    assert grid_argmin(x, trial, 4) == int(np.argmin(grid_errors(x, trial, 4)))
