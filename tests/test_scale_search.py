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


def _bracket_pick(e: np.ndarray, step: int) -> int:
    """The bracketing search read from its definition, on a full error vector ``e`` [97]: the best of every
    step-th point, then the best point strictly between that one's coarse neighbours (lowest index on ties)."""
    coarse = list(range(0, len(e), step))
    c = min(coarse, key=lambda i: (e[i], i))
    seen = set(coarse) | {i for i in range(c - step + 1, c + step) if 0 <= i < len(e)}
    return min(seen, key=lambda i: (e[i], i))


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_bracket_search_picks_the_best_point_it_evaluates(bits):
    """On noisy random groups, where E(p) is bumpy, the bracket may miss the global minimum; whatever it returns
    must be the twin's pick from the full grid's own values (every E(p) it evaluates is the full grid's)."""
    from exl2fmt.codec.scale_search import BRACKET_STEP, best_grid_index

    rng = np.random.default_rng(10 + bits)
    for trial_no in range(12):
        rows = (32, 64, 128)[trial_no % 3]
        x = (rng.standard_normal((rows, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32) * 0.02
        trial = _trial(x, bits)
        e = grid_errors(x, trial, bits)
        assert best_grid_index(x, trial, bits, "full") == int(np.argmin(e))
        assert best_grid_index(x, trial, bits, "bracket") == _bracket_pick(e, BRACKET_STEP)


def test_bracket_search_agrees_with_the_full_grid_on_trained_weights():
    """The approximation the measurement makes, on real (trained) weights: groups of 32/64/128 stored rows of
    every linear of the fixture, at every bit width; the bracket finds the full search's multiplier in all."""
    from safetensors.numpy import load_file

    from exl2fmt.codec.scale_search import best_grid_index

    weights = load_file(str(__import__("pathlib").Path(__file__).parent / "fixtures" / "tiny-llama"
                            / "model.safetensors"))
    rng = np.random.default_rng(0)
    n = 0
    for name, w in sorted(weights.items()):
        if w.ndim != 2 or "embed" in name or "lm_head" in name:
            continue
        wt = np.ascontiguousarray(w.astype(np.float32).T)          # [K, N]: stored rows
        for bits in (2, 3, 4, 5, 6, 8):
            rows = (32, 64, 128)[n % 3]
            a = int(rng.integers(0, wt.shape[0] // 32 - rows // 32 + 1)) * 32
            x = np.ascontiguousarray(wt[a:a + rows])
            trial = _trial(x, bits)
            assert best_grid_index(x, trial, bits, "bracket") == best_grid_index(x, trial, bits, "full"), \
                (name, bits, rows, a)
            n += 1
    assert n >= 150


def test_unknown_search_is_refused():
    from exl2fmt.codec.scale_search import best_grid_index

    x = np.ones((32, 32), np.float32)
    with pytest.raises(ValueError, match="scale search"):
        best_grid_index(x, _trial(x, 4), 4, "coarse")
