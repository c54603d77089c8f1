"""The integer fits of the GGML block quantizers, as Numba kernels (the packing into ggml's block bytes is
``ggml_quant``; the slow twin is ``tests/ggml_twin.py``).

Every GGML block type stores small integers ``L`` and, per block or sub-block, a scale (and for the affine types
a minimum) so that a weight decodes to ``scale * L`` (symmetric types) or ``scale * L - min`` (affine types).
The K-quants (super-blocks of 256 weights) store the sub-block scales themselves as small integers times one
fp16 super-scale, ``d * ls`` (and ``dmin * lm``).  The fit here, per sub-block then per super-block:

1. **Sub-block fit** (``fit_affine`` / ``fit_sym``): a short search over the inverse scale.  Each trial rounds
   the sub-block to integers with it, then solves the weighted least-squares problem for the best (scale, min)
   given those integers (a 2x2 system; 1x1 for the symmetric types), and the trial with the smallest weighted
   squared error wins.  The minimum of a K-quant is stored unsigned, so there the offset is kept <= 0.
2. **Super-scales**: ``d`` (and ``dmin``) map the largest sub-block scale (minimum) to the top of the integer
   scale range and are rounded to fp16; each sub-block's integer scale is rounded from its own fit.
3. **Local search**: each sub-block tries its integer scale (and minimum) one step up and down, re-rounding its
   weights each time, and keeps the pair with the smallest weighted error.
4. **Refit**: with every integer fixed, ``d`` (and ``dmin``) are solved again by least squares over the whole
   super-block, rounded to fp16, the weights re-rounded, and the result is kept only if its error is smaller.

The legacy 32-weight types (Q4_0, Q5_0, Q8_0 symmetric; Q4_1, Q5_1 affine with a signed fp16 minimum) are the
same fit with one sub-block and an fp16 scale (and minimum) instead of integer ones.

Arrays: ``x`` float32 [N, K] C order (the weights, finite), ``w`` float32 [N, K] or [1, K] (importance of each
weight; uniform ones minimise the plain squared error); outputs ``L`` int8 [N, K], ``sc`` / ``mn`` int8
[N, K / sub] (integer sub-block scales and minimums), ``dd`` / ``dm`` uint16 [N, K / block] (fp16 bits).
Rounding is ``floor(v + 0.5)`` everywhere; sums are float64 in a fixed order, so results do not depend on the
thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["fit_affine", "fit_sym", "kquant_affine", "kquant_sym", "legacy_sym", "legacy_affine", "legacy_nl"]


@njit(cache=True, inline="always")
def _rnd(v, lo, hi):
    q = np.floor(v + 0.5)
    return min(max(q, lo), hi)


@njit(cache=True, inline="always")
def _h(v):
    """``v`` rounded to fp16, as float64 (the value a decoder multiplies)."""
    return np.float64(f16_bits_to_f32(f32_to_f16_bits(np.float32(v))))


@njit(cache=True)
def fit_affine(x, w, o, n, nmax, nonpos, nstep, rmin, rdelta):
    """(scale, offset) with ``x[o:o+n] ~ scale * L + offset``, L in [0, nmax]; ``nonpos``: offset <= 0."""
    lo = x[o]
    hi = x[o]
    sw = 0.0
    swx = 0.0
    for i in range(o, o + n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sw += w[i]
        swx += np.float64(w[i]) * x[i]
    lo = np.float64(lo)
    hi = np.float64(hi)
    if nonpos and lo > 0.0:
        lo = 0.0
    span = hi - lo
    if span <= 0.0:
        return 0.0, lo
    best_e = np.inf
    best_a = span / nmax
    best_b = lo
    for t in range(nstep + 2):
        iscale = nmax / span if t == 0 else (nmax + rmin + rdelta * (t - 1)) / span
        sl = 0.0
        sll = 0.0
        slx = 0.0
        for i in range(o, o + n):
            wi = np.float64(w[i])
            q = _rnd(iscale * (x[i] - lo), 0.0, nmax)
            sl += wi * q
            sll += wi * q * q
            slx += wi * q * x[i]
        det = sw * sll - sl * sl
        if det <= 0.0:
            continue
        a = (sw * slx - sl * swx) / det
        b = (sll * swx - sl * slx) / det
        if nonpos and b > 0.0:
            b = 0.0
            a = slx / sll
        if a <= 0.0:
            continue
        e = 0.0
        for i in range(o, o + n):
            q = _rnd(iscale * (x[i] - lo), 0.0, nmax)
            r = a * q + b - x[i]
            e += np.float64(w[i]) * (r * r)
        if e < best_e:
            best_e = e
            best_a = a
            best_b = b
    return best_a, best_b


@njit(cache=True)
def fit_sym(x, w, o, n, nlo, nhi, nstep, rdelta):
    """scale with ``x[o:o+n] ~ scale * L``, L in [nlo, nhi] (nlo < 0): the weight of largest magnitude maps
    near ``nlo``; 0.0 for an all-zero sub-block."""
    m = np.float64(x[o])
    for i in range(o, o + n):
        if abs(x[i]) > abs(m):
            m = np.float64(x[i])
    if m == 0.0:
        return 0.0
    best_e = np.inf
    best_a = m / nlo
    for t in range(-nstep, nstep + 1):
        iscale = (nlo - rdelta * t) / m
        slx = 0.0
        sll = 0.0
        for i in range(o, o + n):
            wi = np.float64(w[i])
            q = _rnd(iscale * x[i], nlo, nhi)
            slx += wi * q * x[i]
            sll += wi * q * q
        if sll <= 0.0:
            continue
        e = -slx * slx / sll  # the weighted error less the constant sum(w x^2)
        if e < best_e:
            best_e = e
            best_a = slx / sll
    return best_a


# ------------------------------------------------------------------------------------------ affine K-quants


@njit(cache=True)
def _sub_affine(x, w, o, n, s, mm, nmax, L, write):
    """Weighted error of one sub-block decoded as ``s * L - mm`` with L rounded from x; writes L if asked."""
    e = 0.0
    for i in range(o, o + n):
        q = _rnd((x[i] + mm) / s, 0.0, nmax) if s > 0.0 else 0.0
        if write:
            L[i] = np.int8(q)
        r = s * q - mm - x[i]
        e += np.float64(w[i]) * (r * r)
    return e


@njit(cache=True)
def _block_affine(x, w, o, sub, nsub, nmax, smax, nstep, rmin, rdelta, a, m, ls, lm):
    """One affine super-block at x[o:o+256]: fills ``ls``/``lm`` (int, [nsub]) and returns (d, dmin, err)."""
    amax = 0.0
    mmax = 0.0
    for j in range(nsub):
        aj, bj = fit_affine(x, w, o + j * sub, sub, nmax, True, nstep, rmin, rdelta)
        a[j] = max(aj, 0.0)
        m[j] = max(-bj, 0.0)
        amax = max(amax, a[j])
        mmax = max(mmax, m[j])
    d = _h(amax / smax)
    dmin = _h(mmax / smax)
    err = 0.0
    for j in range(nsub):
        l0 = _rnd(a[j] / d, 0.0, smax) if d > 0.0 else 0.0
        m0 = _rnd(m[j] / dmin, 0.0, smax) if dmin > 0.0 else 0.0
        best = np.inf
        for da in range(-1, 2):
            la = l0 + da
            if la < 0 or la > smax:
                continue
            for dm_ in range(-1, 2):
                lmm = m0 + dm_
                if lmm < 0 or lmm > smax:
                    continue
                e = _sub_affine(x, w, o + j * sub, sub, d * la, dmin * lmm, nmax, x, False)
                if e < best:
                    best = e
                    ls[j] = la
                    lm[j] = lmm
        err += best
    return d, dmin, err


@njit(cache=True)
def _refit_affine(x, w, o, sub, nsub, nmax, ls, lm, d, dmin, L):
    """Least-squares (d, dmin) for fixed integers (L from the current d, dmin), rounded to fp16."""
    suu = 0.0
    suv = 0.0
    svv = 0.0
    sux = 0.0
    svx = 0.0
    for j in range(nsub):
        s = d * ls[j]
        mm = dmin * lm[j]
        for i in range(o + j * sub, o + (j + 1) * sub):
            wi = np.float64(w[i])
            q = _rnd((x[i] + mm) / s, 0.0, nmax) if s > 0.0 else 0.0
            u = ls[j] * q
            v = -lm[j]
            suu += wi * u * u
            suv += wi * u * v
            svv += wi * v * v
            sux += wi * u * x[i]
            svx += wi * v * x[i]
    det = suu * svv - suv * suv
    if det > 0.0:
        nd = (sux * svv - suv * svx) / det
        nm = (suu * svx - suv * sux) / det
        if nm < 0.0:
            nm = 0.0
            nd = sux / suu
    elif suu > 0.0:
        nd = sux / suu
        nm = 0.0
    else:
        return d, dmin
    return _h(max(nd, 0.0)), _h(nm)


@njit(cache=True, parallel=True)
def kquant_affine(x, w, sub, nmax, smax, nstep, rmin, rdelta, L, sc, mn, dd, dm):
    """Affine K-quant fit (Q4_K: sub 32, nmax 15, smax 63; Q5_K: 32, 31, 63; Q2_K: 16, 3, 15)."""
    N, K = x.shape
    nsub = 256 // sub
    for r in prange(N):
        xr = x[r]
        wr = w[r] if w.shape[0] > 1 else w[0]
        a = np.empty(nsub)
        m = np.empty(nsub)
        ls = np.zeros(nsub)
        lm = np.zeros(nsub)
        for s in range(K // 256):
            o = s * 256
            d, dmin, err = _block_affine(xr, wr, o, sub, nsub, nmax, smax, nstep, rmin, rdelta, a, m, ls, lm)
            for _ in range(2):
                nd, nm = _refit_affine(xr, wr, o, sub, nsub, nmax, ls, lm, d, dmin, L[r])
                e = 0.0
                for j in range(nsub):
                    e += _sub_affine(xr, wr, o + j * sub, sub, nd * ls[j], nm * lm[j], nmax, L[r], False)
                if e >= err:
                    break
                d, dmin, err = nd, nm, e
            for j in range(nsub):
                _sub_affine(xr, wr, o + j * sub, sub, d * ls[j], dmin * lm[j], nmax, L[r], True)
                sc[r, s * nsub + j] = np.int8(ls[j])
                mn[r, s * nsub + j] = np.int8(lm[j])
            dd[r, s] = f32_to_f16_bits(np.float32(d))
            dm[r, s] = f32_to_f16_bits(np.float32(dmin))


# --------------------------------------------------------------------------------------- symmetric K-quants


@njit(cache=True)
def _sub_sym(x, w, o, n, s, nlo, nhi, L, write):
    """Weighted error of one sub-block decoded as ``s * L`` with L rounded from x; writes L if asked."""
    e = 0.0
    for i in range(o, o + n):
        q = _rnd(x[i] / s, nlo, nhi) if s != 0.0 else 0.0
        if write:
            L[i] = np.int8(q)
        r = s * q - x[i]
        e += np.float64(w[i]) * (r * r)
    return e


@njit(cache=True, parallel=True)
def kquant_sym(x, w, sub, nlo, nhi, slo, shi, nstep, rdelta, L, sc, dd):
    """Symmetric K-quant fit (Q6_K: sub 16, L -32..31, scales -128..127; Q3_K: 16, -4..3, -32..31)."""
    N, K = x.shape
    nsub = 256 // sub
    for r in prange(N):
        xr = x[r]
        wr = w[r] if w.shape[0] > 1 else w[0]
        a = np.empty(nsub)
        ls = np.zeros(nsub)
        for s in range(K // 256):
            o = s * 256
            amax = 0.0
            for j in range(nsub):
                a[j] = fit_sym(xr, wr, o + j * sub, sub, nlo, nhi, nstep, rdelta)
                if abs(a[j]) > abs(amax):
                    amax = a[j]
            d = _h(amax / slo)
            err = 0.0
            for j in range(nsub):
                l0 = _rnd(a[j] / d, slo, shi) if d != 0.0 else 0.0
                best = np.inf
                for da in range(-1, 2):
                    la = l0 + da
                    if la < slo or la > shi:
                        continue
                    e = _sub_sym(xr, wr, o + j * sub, sub, d * la, nlo, nhi, xr, False)
                    if e < best:
                        best = e
                        ls[j] = la
                err += best
            for _ in range(2):  # refit d for the fixed integers
                suu = 0.0
                sux = 0.0
                for j in range(nsub):
                    sj = d * ls[j]
                    for i in range(o + j * sub, o + (j + 1) * sub):
                        u = ls[j] * (_rnd(xr[i] / sj, nlo, nhi) if sj != 0.0 else 0.0)
                        suu += np.float64(wr[i]) * u * u
                        sux += np.float64(wr[i]) * u * xr[i]
                if suu <= 0.0:
                    break
                nd = _h(sux / suu)
                e = 0.0
                for j in range(nsub):
                    e += _sub_sym(xr, wr, o + j * sub, sub, nd * ls[j], nlo, nhi, xr, False)
                if e >= err:
                    break
                d, err = nd, e
            for j in range(nsub):
                _sub_sym(xr, wr, o + j * sub, sub, d * ls[j], nlo, nhi, L[r], True)
                sc[r, s * nsub + j] = np.int8(ls[j])
            dd[r, s] = f32_to_f16_bits(np.float32(d))


# ----------------------------------------------------------------------------------- legacy 32-weight types


@njit(cache=True, parallel=True)
def legacy_sym(x, w, nlo, nhi, nstep, rdelta, L, dd):
    """Q4_0 (-8..7), Q5_0 (-16..15), Q8_0 (-128..127): one fp16 scale per 32 weights."""
    N, K = x.shape
    for r in prange(N):
        xr = x[r]
        wr = w[r] if w.shape[0] > 1 else w[0]
        for b in range(K // 32):
            o = b * 32
            d = _h(fit_sym(xr, wr, o, 32, nlo, nhi, nstep, rdelta))
            err = _sub_sym(xr, wr, o, 32, d, nlo, nhi, xr, False)
            for _ in range(2):
                suu = 0.0
                sux = 0.0
                for i in range(o, o + 32):
                    u = _rnd(xr[i] / d, nlo, nhi) if d != 0.0 else 0.0
                    suu += np.float64(wr[i]) * u * u
                    sux += np.float64(wr[i]) * u * xr[i]
                if suu <= 0.0:
                    break
                nd = _h(sux / suu)
                e = _sub_sym(xr, wr, o, 32, nd, nlo, nhi, xr, False)
                if e >= err:
                    break
                d, err = nd, e
            _sub_sym(xr, wr, o, 32, d, nlo, nhi, L[r], True)
            dd[r, b] = f32_to_f16_bits(np.float32(d))


@njit(cache=True, parallel=True)
def legacy_affine(x, w, nmax, nstep, rmin, rdelta, L, dd, dm):
    """Q4_1 (0..15), Q5_1 (0..31): fp16 scale ``d`` and fp16 minimum ``m`` per 32 weights, x ~ d * L + m."""
    N, K = x.shape
    for r in prange(N):
        xr = x[r]
        wr = w[r] if w.shape[0] > 1 else w[0]
        for b in range(K // 32):
            o = b * 32
            a, off = fit_affine(xr, wr, o, 32, nmax, False, nstep, rmin, rdelta)
            d = _h(a)
            mm = _h(off)
            err = _sub_affine(xr, wr, o, 32, d, -mm, nmax, xr, False)
            for _ in range(2):
                sw = 0.0
                su = 0.0
                suu = 0.0
                sx = 0.0
                sux = 0.0
                for i in range(o, o + 32):
                    wi = np.float64(wr[i])
                    u = _rnd((xr[i] - mm) / d, 0.0, nmax) if d > 0.0 else 0.0
                    sw += wi
                    su += wi * u
                    suu += wi * u * u
                    sx += wi * xr[i]
                    sux += wi * u * xr[i]
                det = sw * suu - su * su
                if det <= 0.0:
                    break
                nd = _h(max((sw * sux - su * sx) / det, 0.0))
                nm = _h((suu * sx - su * sux) / det)
                e = _sub_affine(xr, wr, o, 32, nd, -nm, nmax, xr, False)
                if e >= err:
                    break
                d, mm, err = nd, nm, e
            _sub_affine(xr, wr, o, 32, d, -mm, nmax, L[r], True)
            dd[r, b] = f32_to_f16_bits(np.float32(d))
            dm[r, b] = f32_to_f16_bits(np.float32(mm))


# ------------------------------------------------------------------------------------ IQ4_NL (non-linear 4-bit)


@njit(cache=True, inline="always")
def _nearest(v, kv):
    """Index of the entry of ``kv`` (float64 [16], ascending) nearest to v (the lower one on a tie)."""
    best = 0
    bd = abs(v - kv[0])
    for j in range(1, kv.shape[0]):
        dj = abs(v - kv[j])
        if dj < bd:
            bd = dj
            best = j
    return best


@njit(cache=True)
def _sub_nl(x, w, o, n, d, kv, zero, L, write):
    """Weighted error of one block decoded as ``d * kv[L]`` with L the nearest entry to x / d."""
    e = 0.0
    for i in range(o, o + n):
        q = _nearest(x[i] / d, kv) if d != 0.0 else zero
        if write:
            L[i] = np.int8(q)
        r = d * kv[q] - x[i]
        e += np.float64(w[i]) * (r * r)
    return e


@njit(cache=True)
def _ls_nl(x, w, o, n, d, kv):
    """(sum w x k, sum w k^2) over the block, k the codebook value each weight rounds to at scale d."""
    sxk = 0.0
    skk = 0.0
    for i in range(o, o + n):
        k = kv[_nearest(x[i] / d, kv)]
        sxk += np.float64(w[i]) * k * x[i]
        skk += np.float64(w[i]) * k * k
    return sxk, skk


@njit(cache=True, parallel=True)
def legacy_nl(x, w, kv, nstep, rdelta, L, dd):
    """IQ4_NL: one fp16 scale per 32 weights, each weight ``d * kv[L]`` (kv the format's 16 fixed values).
    Trials map the weight of largest magnitude to either end of the codebook, widened or narrowed by
    ``rdelta`` per step; each is refitted by least squares; the best is rounded to fp16 and refitted again."""
    N, K = x.shape
    zero = _nearest(0.0, kv)
    for r in prange(N):
        xr = x[r]
        wr = w[r] if w.shape[0] > 1 else w[0]
        for b in range(K // 32):
            o = b * 32
            m = np.float64(xr[o])
            for i in range(o, o + 32):
                if abs(xr[i]) > abs(m):
                    m = np.float64(xr[i])
            d = 0.0
            if m != 0.0:
                best_e = np.inf
                for end in (kv[0], kv[kv.shape[0] - 1]):
                    for t in range(-nstep, nstep + 1):
                        sxk, skk = _ls_nl(xr, wr, o, 32, m / (end + rdelta * t * abs(end) / 16.0), kv)
                        if skk <= 0.0:
                            continue
                        e = -sxk * sxk / skk
                        if e < best_e:
                            best_e = e
                            d = sxk / skk
            d = _h(d)
            err = _sub_nl(xr, wr, o, 32, d, kv, zero, xr, False)
            for _ in range(2):
                if d == 0.0:
                    break
                sxk, skk = _ls_nl(xr, wr, o, 32, d, kv)
                if skk <= 0.0:
                    break
                nd = _h(sxk / skk)
                e = _sub_nl(xr, wr, o, 32, nd, kv, zero, xr, False)
                if e >= err:
                    break
                d, err = nd, e
            _sub_nl(xr, wr, o, 32, d, kv, zero, L[r], True)
            dd[r, b] = f32_to_f16_bits(np.float32(d))
