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


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_bound_stops_only_points_certainly_above_it(bits):
    """grid_errors(bound=b): every finite value is the unbounded one bit for bit; a point reads inf only if its
    unbounded error is above b; a zero bound stops every point at its first check (after 8 rows), a bound at
    the maximum or none stops none."""
    rng = np.random.default_rng(20 + bits)
    for rows in (8, 16, 40, 128):
        x = (rng.standard_normal((rows, 80)) * np.exp(rng.standard_normal(80))).astype(np.float32) * 0.02
        trial = _trial(x, bits)
        e = grid_errors(x, trial, bits)
        for b in (0.0, 0.5 * e.min(), e.min(), float(np.median(e)), e.max(), np.inf):
            eb = grid_errors(x, trial, bits, bound=b)
            fin = np.isfinite(eb)
            assert np.array_equal(eb[fin], e[fin])
            assert np.all(e[~fin] > b)
            if b == 0.0 and rows > 8:                   # every point's first check is above 0
                assert not fin.any()
            if b >= e.max() or rows <= 8:
                assert fin.all()


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
            full = best_grid_index(x, trial, bits, "full")
            assert full == int(np.argmin(grid_errors(x, trial, bits)))    # the bounded search is exact
            assert best_grid_index(x, trial, bits, "bracket") == full, (name, bits, rows, a)
            n += 1
    assert n >= 150


def test_unknown_search_is_refused():
    from exl2fmt.codec.scale_search import best_grid_index

    x = np.ones((32, 32), np.float32)
    with pytest.raises(ValueError, match="scale search"):
        best_grid_index(x, _trial(x, 4), 4, "coarse")


def _find_scales_numpy(x, bits, refine=False, search="full"):
    """formats.exl2.find_scales as NumPy array expressions (its implementation before the steps moved into
    kernels): the twin of the kernels' float32 and fp16 arithmetic."""
    from exl2fmt.codec.scale_search import best_grid_index, refine_scale_codes

    def f16(v):
        return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float32)

    maxq = (1 << bits) - 1
    xmax = np.abs(x).max(axis=0) + np.float32(1e-12)
    base = xmax / np.float32(maxq / 2)
    smax = base.max()
    qs = np.clip(np.round(16 * np.sqrt(base / smax)), 1, 16).astype(np.int64)
    trial = ((qs.astype(np.float32) / 16) ** 2 * smax).astype(np.float32)
    best_p = float(P_GRID[best_grid_index(x, trial, bits, search)])
    qsm = np.float16(max(float(np.float16(smax * np.float32(best_p))), 2.0 ** -24))
    m = f16(np.float32(qsm) * np.float32(1 / 256))
    if refine:
        qs = refine_scale_codes(x, (qs - 1).astype(np.uint8), qsm, bits).astype(np.int64) + 1
    s = f16(f16((qs * qs).astype(np.float32)) * m)
    return (qs - 1).astype(np.uint8), qsm, s


def _groups():
    """Groups to search: random with a wide spread of column scales, zero columns, a zero group, a tiny one,
    and 32/64/128-row slices of every trained fixture linear."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(5)
    for rows in (32, 64, 128):
        x = (rng.standard_normal((rows, 96)) * np.exp(2 * rng.standard_normal(96))).astype(np.float32) * 0.02
        x[:, 3] = 0
        yield x
    yield np.zeros((32, 64), np.float32)
    yield np.full((32, 32), 1e-30, np.float32)
    weights = load_file(str(__import__("pathlib").Path(__file__).parent / "fixtures" / "tiny-llama"
                            / "model.safetensors"))
    for k, (name, w) in enumerate(sorted(weights.items())):
        if w.ndim == 2 and "embed" not in name and "lm_head" not in name:
            wt = np.ascontiguousarray(w.astype(np.float32).T)
            rows = (32, 64, 128)[k % 3]
            yield np.ascontiguousarray(wt[32 * (k % 3):32 * (k % 3) + rows])


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_find_scales_equals_its_numpy_twin(bits):
    from exl2fmt.formats.exl2 import find_scales

    n = 0
    for x in _groups():
        for refine in (False, True):
            for search in ("full", "bracket"):
                got, want = find_scales(x, bits, refine, search), _find_scales_numpy(x, bits, refine, search)
                assert np.array_equal(got[0], want[0]) and got[0].dtype == np.uint8
                assert got[1] == want[1] and got[1].dtype == np.float16
                assert np.array_equal(got[2], want[2]) and got[2].dtype == np.float32
                n += 1
    assert n >= 4 * 20
