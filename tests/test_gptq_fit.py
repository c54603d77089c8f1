"""The GPTQ group fit (``codec.gptq_fit.fit_group``) and ``rtn_quantize`` against NumPy twins.

Oracle: the textbook NumPy evaluation of every candidate scale (``_fit_group_numpy``: one pass of NumPy ops per
candidate, the sum of squared errors by ``np.sum(axis=0)``, the first smallest wins), which is what exl2fmt
computed before the fit became a Numba kernel with early-abandoned candidates.  The kernel must give the same
codes, scales and zero points bit for bit on every layout NumPy sums differently (rows outer: one row after the
other; columns outer: pairwise), on ties, zero columns and non-finite values.
"""

from __future__ import annotations

import numpy as np
import pytest

from exl2fmt.codec.gptq_fit import _GRID, fit_group, rtn_quantize


def _quant(x, s, z, maxq):
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x / s[None, :]) + z[None, :]
    q = np.where(np.isfinite(q), q, z[None, :])
    return np.clip(q, 0, maxq)


def _fit_group_numpy(x, bits, sym=True, extra_scales=()):
    x = np.asarray(x, dtype=np.float32)
    R, N = x.shape
    maxq = (1 << bits) - 1
    zsym = np.float32(1 << (bits - 1))
    xmin = np.minimum(x.min(axis=0, initial=0), 0)
    xmax = np.maximum(x.max(axis=0, initial=0), 0)
    rng = 2 * np.maximum(np.abs(xmin), xmax) if sym else xmax - xmin
    rng = np.where(rng > 0, rng, np.float32(2)).astype(np.float32)
    base = rng / np.float32(maxq)
    best_err = np.full(N, np.inf)
    best_s = np.zeros(N, dtype=np.float16)
    best_z = np.full(N, zsym, dtype=np.float32)
    for c in [base * p for p in _GRID] + [np.asarray(e, dtype=np.float32) for e in extra_scales]:
        s16 = np.asarray(c, dtype=np.float32).astype(np.float16)
        s = s16.astype(np.float32)
        ok = np.isfinite(s) & (s > 0)
        s = np.where(ok, s, np.float32(1))
        z = np.full(N, zsym, np.float32) if sym else np.clip(np.rint(-xmin / s), 1, maxq).astype(np.float32)
        rec = ((_quant(x, s, z, maxq) - z[None, :]) * s[None, :]).astype(np.float16).astype(np.float32)
        err = np.where(ok, np.sum((rec - x).astype(np.float64) ** 2, axis=0), np.inf)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s16, best_s)
        best_z = np.where(better, z, best_z)
    codes = _quant(x, best_s.astype(np.float32), best_z, maxq).astype(np.uint8)
    return codes, best_s.astype(np.float16), best_z.astype(np.int32)


def _layout(x, how):
    if how == "F":
        return np.asfortranarray(x)
    if how == "cols-strided":                   # rows outer, every other column
        return np.ascontiguousarray(np.concatenate([x, x], 1))[:, ::2]
    if how == "rows-strided":                   # columns outer, every other row
        return np.asfortranarray(np.concatenate([x, x], 0))[::2]
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("how", ["C", "F", "cols-strided", "rows-strided"])
def test_fit_group_kernel_equals_the_numpy_evaluation(how):
    rng = np.random.default_rng(["C", "F", "cols-strided", "rows-strided"].index(how))
    with np.errstate(all="ignore"):
        for trial in range(24):
            R = int(rng.choice([1, 5, 8, 17, 32, 128, 129, 300]))
            N = int(rng.choice([1, 3, 33, 96]))
            x = (rng.standard_normal((R, N)) * 10.0 ** rng.uniform(-6, 1)).astype(np.float32)
            if trial % 3 == 0:
                x[:, : N // 2] = 0                                 # all-zero columns
            if trial % 4 == 1:
                x = np.round(x * 8) / np.float32(8)                # many exact ties between candidates
            if trial % 5 == 2:
                x[0, 0] = [np.inf, np.nan, -np.inf][trial % 3]
            bits, sym = int(rng.choice([2, 3, 4, 8])), bool(trial % 2)
            extra = [rng.uniform(1e-3, 0.1, N).astype(np.float32)] if trial % 3 == 1 else []
            x = _layout(x, how)
            got, want = fit_group(x, bits, sym, extra), _fit_group_numpy(x, bits, sym, extra)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and np.array_equal(g, w), (how, trial, R, N, bits, sym)
            none, s, z = fit_group(x, bits, sym, extra, want_codes=False)        # the GPTQ sweep's call
            assert none is None and np.array_equal(s, want[1]) and np.array_equal(z, want[2])


@pytest.mark.parametrize("act", [False, True])
def test_rtn_quantize_equals_per_group_numpy_fits(act):
    rng = np.random.default_rng(11)
    N, K, gs = 64, 320, 64                       # a last group of 64 rows
    w = rng.standard_normal((N, K)).astype(np.float32)
    perm = rng.permutation(K) if act else None
    codes, scales, zeros, g_idx = rtn_quantize(w, 4, gs, sym=False, perm=perm)
    order = np.arange(K) if perm is None else perm
    for h in range(-(-K // gs)):
        rows = order[h * gs:(h + 1) * gs]
        c, s, z = _fit_group_numpy(w[:, rows].T, 4, False)
        assert np.array_equal(codes[rows], c) and np.array_equal(scales[h], s) and np.array_equal(zeros[h], z)
        assert np.all(g_idx[rows] == h)
