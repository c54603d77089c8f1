"""Slow NumPy twin of ``exl2fmt.codec.ggml_fit`` (the GGML block fit), written from its docstring: per
sub-block a search over the inverse scale with a weighted least-squares (scale, min) per trial, super-scales
from the largest sub-block values rounded to fp16, a +-1 search of each integer scale (and minimum), then a
least-squares refit of the super-scales kept only when it lowers the error.  Sums are sequential float64
(``np.cumsum``) so that the twin rounds as the kernel does; everything else is vectorised per sub-block."""

from __future__ import annotations

import numpy as np


def _sum(v: np.ndarray) -> float:
    return float(np.cumsum(np.asarray(v, dtype=np.float64))[-1]) if v.size else 0.0


def _rnd(v, lo, hi):
    return np.clip(np.floor(v + 0.5), lo, hi)


def _h(v: float) -> float:
    return float(np.float16(np.float32(v)))


def fit_affine(x, w, nmax, nonpos, nstep, rmin, rdelta):
    x = x.astype(np.float64)
    w = w.astype(np.float64)
    lo, hi = float(x.min()), float(x.max())
    if nonpos and lo > 0:
        lo = 0.0
    span = hi - lo
    if span <= 0:
        return 0.0, lo
    sw, swx = _sum(w), _sum(w * x)
    best = (np.inf, span / nmax, lo)
    for t in range(nstep + 2):
        iscale = nmax / span if t == 0 else (nmax + rmin + rdelta * (t - 1)) / span
        q = _rnd(iscale * (x - lo), 0, nmax)
        sl, sll, slx = _sum(w * q), _sum(w * q * q), _sum(w * q * x)
        det = sw * sll - sl * sl
        if det <= 0:
            continue
        a = (sw * slx - sl * swx) / det
        b = (sll * swx - sl * slx) / det
        if nonpos and b > 0:
            a, b = slx / sll, 0.0
        if a <= 0:
            continue
        e = _sum(w * (a * q + b - x) ** 2)
        if e < best[0]:
            best = (e, a, b)
    return best[1], best[2]


def fit_sym(x, w, nlo, nhi, nstep, rdelta):
    x = x.astype(np.float64)
    w = w.astype(np.float64)
    m = float(x[np.argmax(np.abs(x))])  # the first of equal magnitudes, as the kernel's strict '>'
    if m == 0:
        return 0.0
    best = (np.inf, m / nlo)
    for t in range(-nstep, nstep + 1):
        q = _rnd((nlo - rdelta * t) / m * x, nlo, nhi)
        slx, sll = _sum(w * q * x), _sum(w * q * q)
        if sll <= 0:
            continue
        if -slx * slx / sll < best[0]:
            best = (-slx * slx / sll, slx / sll)
    return best[1]


def _err_affine(x, w, s, mm, nmax):
    q = _rnd((x + mm) / s, 0, nmax) if s > 0 else np.zeros_like(x)
    return _sum(w * (s * q - mm - x) ** 2), q


def _err_sym(x, w, s, nlo, nhi):
    q = _rnd(x / s, nlo, nhi) if s != 0 else np.zeros_like(x)
    return _sum(w * (s * q - x) ** 2), q


def kquant_affine_block(x, w, sub, nmax, smax, nstep, rmin, rdelta):
    """One super-block (x, w float64 [256]) -> (L [256], ls [nsub], lm [nsub], d, dmin)."""
    xs, ws = x.reshape(-1, sub), w.reshape(-1, sub)
    fits = [fit_affine(a, b, nmax, True, nstep, rmin, rdelta) for a, b in zip(xs, ws)]
    a = np.array([max(f[0], 0.0) for f in fits])
    m = np.array([max(-f[1], 0.0) for f in fits])
    d, dmin = _h(a.max() / smax), _h(m.max() / smax)
    ls, lm, err = np.zeros(len(xs)), np.zeros(len(xs)), 0.0
    for j in range(len(xs)):
        l0 = _rnd(a[j] / d, 0, smax) if d > 0 else 0.0
        m0 = _rnd(m[j] / dmin, 0, smax) if dmin > 0 else 0.0
        trials = [(_err_affine(xs[j], ws[j], d * (l0 + p), dmin * (m0 + q), nmax)[0], l0 + p, m0 + q)
                  for p in (-1, 0, 1) for q in (-1, 0, 1) if 0 <= l0 + p <= smax and 0 <= m0 + q <= smax]
        e, ls[j], lm[j] = min(trials, key=lambda t: t[0])  # the first of equal errors
        err += e
    for _ in range(2):
        u = np.concatenate([ls[j] * _err_affine(xs[j], ws[j], d * ls[j], dmin * lm[j], nmax)[1]
                            for j in range(len(xs))])
        v = np.repeat(-lm, sub)
        suu, suv, svv = _sum(w * u * u), _sum(w * u * v), _sum(w * v * v)
        sux, svx = _sum(w * u * x), _sum(w * v * x)
        det = suu * svv - suv * suv
        if det > 0:
            nd, nm = (sux * svv - suv * svx) / det, (suu * svx - suv * sux) / det
            if nm < 0:
                nd, nm = sux / suu, 0.0
        elif suu > 0:
            nd, nm = sux / suu, 0.0
        else:
            nd, nm = d, dmin
        nd, nm = _h(max(nd, 0.0)), _h(nm)
        e = sum(_err_affine(xs[j], ws[j], nd * ls[j], nm * lm[j], nmax)[0] for j in range(len(xs)))
        if e >= err:
            break
        d, dmin, err = nd, nm, e
    L = np.concatenate([_err_affine(xs[j], ws[j], d * ls[j], dmin * lm[j], nmax)[1] for j in range(len(xs))])
    return L, ls, lm, d, dmin


def kquant_sym_block(x, w, sub, nlo, nhi, slo, shi, nstep, rdelta):
    """One symmetric super-block -> (L [256], ls [nsub], d)."""
    xs, ws = x.reshape(-1, sub), w.reshape(-1, sub)
    a = np.array([fit_sym(p, q, nlo, nhi, nstep, rdelta) for p, q in zip(xs, ws)])
    amax = float(a[np.argmax(np.abs(a))]) if np.abs(a).max() > 0 else 0.0
    d = _h(amax / slo)
    ls, err = np.zeros(len(xs)), 0.0
    for j in range(len(xs)):
        l0 = _rnd(a[j] / d, slo, shi) if d != 0 else 0.0
        trials = [(_err_sym(xs[j], ws[j], d * (l0 + p), nlo, nhi)[0], l0 + p) for p in (-1, 0, 1)
                  if slo <= l0 + p <= shi]
        e, ls[j] = min(trials, key=lambda t: t[0])
        err += e
    for _ in range(2):
        u = np.concatenate([ls[j] * _err_sym(xs[j], ws[j], d * ls[j], nlo, nhi)[1] for j in range(len(xs))])
        suu, sux = _sum(w * u * u), _sum(w * u * x)
        if suu <= 0:
            break
        nd = _h(sux / suu)
        e = sum(_err_sym(xs[j], ws[j], nd * ls[j], nlo, nhi)[0] for j in range(len(xs)))
        if e >= err:
            break
        d, err = nd, e
    L = np.concatenate([_err_sym(xs[j], ws[j], d * ls[j], nlo, nhi)[1] for j in range(len(xs))])
    return L, ls, d


def legacy_sym_block(x, w, nlo, nhi, nstep, rdelta):
    """One 32-weight block -> (L [32], d)."""
    d = _h(fit_sym(x, w, nlo, nhi, nstep, rdelta))
    err, q = _err_sym(x, w, d, nlo, nhi)
    for _ in range(2):
        suu, sux = _sum(w * q * q), _sum(w * q * x)
        if suu <= 0:
            break
        nd = _h(sux / suu)
        e, nq = _err_sym(x, w, nd, nlo, nhi)
        if e >= err:
            break
        d, err, q = nd, e, nq
    return q, d


def legacy_affine_block(x, w, nmax, nstep, rmin, rdelta):
    """One 32-weight block -> (L [32], d, m) with x ~ d * L + m."""
    a, off = fit_affine(x, w, nmax, False, nstep, rmin, rdelta)
    d, m = _h(a), _h(off)
    err, q = _err_affine(x, w, d, -m, nmax)
    for _ in range(2):
        sw, su, suu = _sum(w), _sum(w * q), _sum(w * q * q)
        sx, sux = _sum(w * x), _sum(w * q * x)
        det = sw * suu - su * su
        if det <= 0:
            break
        nd, nm = _h(max((sw * sux - su * sx) / det, 0.0)), _h((suu * sx - su * sux) / det)
        e, nq = _err_affine(x, w, nd, -nm, nmax)
        if e >= err:
            break
        d, m, err, q = nd, nm, e, nq
    return q, d, m


def _nearest(v, kv):
    return np.argmin(np.abs(np.asarray(v, dtype=np.float64)[..., None] - kv), axis=-1)  # first of equal distances


def legacy_nl_block(x, w, kv, nstep, rdelta):
    """One IQ4_NL block -> (indices [32], d): trial scales map the largest-magnitude weight to either end of the
    codebook, each refitted by least squares; the best rounded to fp16 and refitted while the error falls."""
    kv = np.asarray(kv, dtype=np.float64)
    zero = int(_nearest(0.0, kv))

    def err(d):
        q = _nearest(x / d, kv) if d != 0 else np.full(x.shape, zero)
        return _sum(w * (d * kv[q] - x) ** 2), q

    def ls(d):
        k = kv[_nearest(x / d, kv)]
        return _sum(w * k * x), _sum(w * k * k)

    m = float(x[np.argmax(np.abs(x))])
    d = 0.0
    if m != 0:
        best = np.inf
        for end in (kv[0], kv[-1]):
            for t in range(-nstep, nstep + 1):
                sxk, skk = ls(m / (end + rdelta * t * abs(end) / 16.0))
                if skk > 0 and -sxk * sxk / skk < best:
                    best, d = -sxk * sxk / skk, sxk / skk
    d = _h(d)
    e0, q = err(d)
    for _ in range(2):
        if d == 0:
            break
        sxk, skk = ls(d)
        if skk <= 0:
            break
        nd = _h(sxk / skk)
        e, nq = err(nd)
        if e >= e0:
            break
        d, e0, q = nd, e, nq
    return q, d
