"""The per-group scale search of the EXL2 quantizer, as a Numba kernel.

ExLlamaV2 picks one multiplier ``p`` per group from a grid of 97 values in [0.70, 1.20]: every column's trial
scale ``s_n`` is multiplied by ``p``, the group is rounded with it, and the ``p`` with the smallest
``sum |q * p * s_n - x|^3.5`` wins (spec/exl2.md, "scale search").  Evaluating the grid is the quantizer's
most frequent inner loop (once per group per candidate setting), so it gets a kernel: each grid point is
one parallel work item that sweeps the group once, accumulating per column in float32 and over columns in
float64, in a fixed order, so the result does not depend on the thread count.  A point may be given a bound
(the best error already known) and then stops once its partial error is certainly above it.

``grid_errors`` is checked against a NumPy twin in ``tests/test_scale_search.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["P_GRID", "grid_errors", "best_grid_index", "BRACKET_STEP", "SEARCHES", "refine_scale_codes",
           "REFINE_RADIUS", "search_start", "final_scales"]

#: Scale codes tried on either side of the searched one by ``refine_scale_codes``.
REFINE_RADIUS = 2

#: The 97 multipliers ExLlamaV2 tries (float32, as its kernel computes them).
P_GRID = np.linspace(0.70, 1.20, 97, dtype=np.float32)


#: A point of ``_grid_errors`` with a bound checks every this many rows whether its error so far exceeds it.
BOUND_CHECK_ROWS = 8


@njit(cache=True)
def _lower_sum(col):
    """sum(col) for col float32 >= 0, in float64 with eight interleaved partial sums (so it pipelines), scaled
    down by 1e-9 of itself: never above the exact sum, so never above ``_grid_errors``' sequential float64 sum
    of the same or larger values (each rounded sum of N <= 2^20 non-negative terms is within N * 2^-53 of the
    exact one)."""
    a = np.zeros(8, dtype=np.float64)
    n8 = col.shape[0] - col.shape[0] % 8
    for n in range(0, n8, 8):
        for k in range(8):
            a[k] += col[n + k]
    t = 0.0
    for n in range(n8, col.shape[0]):
        t += col[n]
    for k in range(8):
        t += a[k]
    return t * (1.0 - 1e-9)


@njit(cache=True, parallel=True, fastmath=False)
def _grid_errors(x, trial, pgrid, zero, maxq, bound, out):
    R, N = x.shape
    lo = np.float32(-zero)
    hi = np.float32(maxq - zero)
    for pi in prange(pgrid.shape[0]):
        p = pgrid[pi]
        s = np.empty(N, dtype=np.float32)
        col = np.zeros(N, dtype=np.float32)
        for n in range(N):
            s[n] = trial[n] * p
        over = False
        for r in range(R):
            # independent per column: the loop vectorizes without reassociating any sum
            for n in range(N):
                v = x[r, n]
                q = min(max(np.rint(v / s[n]), lo), hi)
                a = abs(q * s[n] - v)
                col[n] += a * a * a * np.sqrt(a)
            # the error only grows with more rows: once a lower bound of it passes ``bound`` the point cannot be
            # the minimum (the columns' values so far are not changed by the check)
            if r % BOUND_CHECK_ROWS == BOUND_CHECK_ROWS - 1 and r + 1 < R and bound < np.inf:
                if _lower_sum(col) > bound:
                    over = True
                    break
        if over:
            out[pi] = np.inf
        else:
            acc = 0.0
            for n in range(N):
                acc += col[n]
            out[pi] = acc


def grid_errors(x: np.ndarray, trial: np.ndarray, bits: int, pgrid: np.ndarray = P_GRID,
                bound: float = np.inf) -> np.ndarray:
    """E(p) for every p of ``pgrid``.

    ``x``      float32 [R, N], C order: the (error-compensated) rows of one group, N = padded out features.
    ``trial``  float32 [N]: the trial scales ``(qs_n / 16)^2 * smax``; every entry must be > 0.
    ``bits``   the group's bit width (codes clamp to [-2^(b-1), 2^(b-1) - 1] before the zero point).
    ``bound``  points whose error is certainly above it may stop early and read ``inf``; every other value is
               the same, bit for bit, as without a bound.
    Returns float64 [len(pgrid)].
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    trial = np.ascontiguousarray(trial, dtype=np.float32)
    out = np.empty(len(pgrid), dtype=np.float64)
    _grid_errors(x, trial, np.ascontiguousarray(pgrid, dtype=np.float32), 1 << (bits - 1), (1 << bits) - 1,
                 float(bound), out)
    return out


@njit(cache=True)
def _trial_scales(x, half_maxq, qs, trial):
    """The search's start for one group (ExLlamaV2's ``find_params``), in float32 as NumPy computes it:
    base_n = (max_r |x[r, n]| + 1e-12) / half_maxq, smax = max_n base_n, qs_n = clip(rint(16 sqrt(base_n /
    smax)), 1, 16) (int64 [N], written), trial_n = (qs_n / 16)^2 smax (float32 [N], written).  Returns smax;
    NaN propagates as in NumPy's max."""
    R, N = x.shape
    base = np.zeros(N, dtype=np.float32)
    for r in range(R):
        for n in range(N):
            a = abs(x[r, n])
            if a > base[n] or a != a:
                base[n] = a
    smax = np.float32(0.0)
    for n in range(N):
        base[n] = (base[n] + np.float32(1e-12)) / half_maxq
        if n == 0 or base[n] > smax or base[n] != base[n]:
            smax = base[n]
    for n in range(N):
        q = min(max(np.rint(np.float32(16) * np.sqrt(base[n] / smax)), np.float32(1)), np.float32(16))
        qs[n] = np.int64(q)
        t = np.float32(qs[n]) / np.float32(16)
        trial[n] = t * t * smax
    return smax


@njit(cache=True)
def _final_scales(qs, m, s, codes):
    """s_n = fp16(fp16(qs_n^2) * m) as float32, codes_n = qs_n - 1 (uint8), for qs int64 [N] in 1..16 and m the
    fp16 value q_scale_max / 256 (float32)."""
    for n in range(qs.shape[0]):
        s[n] = _f16r(_f16r(np.float32(qs[n] * qs[n])) * m)
        codes[n] = np.uint8(qs[n] - 1)


#: The ways ``best_grid_index`` searches the grid: every point, or a bracket (see there).
SEARCHES = ("full", "bracket")

#: ``best_grid_index(search="bracket")`` first evaluates every BRACKET_STEP-th grid point.
BRACKET_STEP = 6
_COARSE = np.arange(0, len(P_GRID), BRACKET_STEP)

def _spread(idx: np.ndarray) -> np.ndarray:
    """``idx`` with its even positions first, then its odd ones: the kernel's parallel loop hands each thread a
    contiguous run of points, and the points a bound stops early are the ones far from the best, so a run of
    neighbours would leave one thread all the points that run to the end."""
    return np.concatenate([idx[0::2], idx[1::2]])


_REST = _spread(np.array([i for i in range(len(P_GRID)) if i % BRACKET_STEP], dtype=np.int64))
_P_COARSE, _P_REST = P_GRID[_COARSE], P_GRID[_REST]


def best_grid_index(x: np.ndarray, trial: np.ndarray, bits: int, search: str = "full") -> int:
    """Index into ``P_GRID`` of the smallest ``grid_errors`` value (the first one on ties).

    ``search="full"`` evaluates all 97 points (ExLlamaV2's search).  ``search="bracket"`` evaluates every
    ``BRACKET_STEP``-th point (0, 6, ..., 96: 17 points), then every point strictly between the best of those and
    its two coarse neighbours (at most 10 more), and returns the best point evaluated: at most 27 evaluations
    instead of 97.  Each E(p) it evaluates is bit for bit the full search's value for that p (the kernel
    computes every point on its own), so the bracket returns the full search's index whenever that index lies
    within the bracket, i.e. unless E has a lower point more than one coarse step away from the coarse minimum.
    On 1008 groups of the trained fixture's weights (2-8 bits, 32-128 rows) it agreed with the full search every
    time; the quantizer uses it only to score candidates in the measurement (``QuantOptions.measure_search``).

    Both evaluate the coarse points first and bound the others by the best coarse value: a point stops as soon
    as its error so far is certainly above it (``grid_errors(bound=)``), which cannot change the result, since
    such a point is worse than one already evaluated, while every value that could be the minimum is computed
    in full, bit for bit as without the bound.

    ``x`` float32 [R, N] and ``trial`` float32 [N] as in ``grid_errors``."""
    if search not in SEARCHES:
        raise ValueError(f"scale search must be one of {SEARCHES}, got {search!r}")
    n = len(P_GRID)
    # the coarse points first; the best of them bounds the rest, which stop once certainly worse
    e = np.full(n, np.inf)
    ec = e[_COARSE] = grid_errors(x, trial, bits, _P_COARSE)
    best = float(ec.min())
    if search == "full":
        rest, p_rest = _REST, _P_REST
    else:
        c = int(_COARSE[int(np.argmin(ec))])
        rest = _spread(np.array([i for i in range(max(0, c - BRACKET_STEP + 1),
                                                  min(n - 1, c + BRACKET_STEP - 1) + 1) if i % BRACKET_STEP],
                                dtype=np.int64))
        p_rest = P_GRID[rest]
    e[rest] = grid_errors(x, trial, bits, p_rest, bound=best)
    return int(np.argmin(e))                         # ties go to the lowest index, as over the whole grid


def search_start(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(qs int64 [N] in 1..16, trial float32 [N], smax float32) for the group ``x`` float32 [R, N] C order at
    ``bits``: see ``_trial_scales``."""
    N = x.shape[1]
    qs, trial = np.empty(N, dtype=np.int64), np.empty(N, dtype=np.float32)
    smax = _trial_scales(x, np.float32(((1 << bits) - 1) / 2), qs, trial)
    return qs, trial, np.float32(smax)


def final_scales(qs: np.ndarray, m: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [N] = qs - 1, s float32 [N] = the exact fp16 scales fp16(fp16(qs^2) * m)) for qs int64 [N]
    and m = fp16(q_scale_max / 256)."""
    N = qs.shape[0]
    s, codes = np.empty(N, dtype=np.float32), np.empty(N, dtype=np.uint8)
    _final_scales(np.ascontiguousarray(qs, dtype=np.int64), np.float32(m), s, codes)
    return codes, s


@njit(cache=True)
def _f16r(v):
    return f16_bits_to_f32(f32_to_f16_bits(np.float32(v)))


@njit(cache=True, parallel=True, fastmath=False)
def _refine(x, codes, m, zero, maxq, radius, out):
    R, N = x.shape
    for n in prange(N):
        best_c = codes[n]
        best_e = np.inf
        # the searched code first, so that it wins ties; then outwards, lower side first
        for t in range(2 * radius + 1):
            d = 0 if t == 0 else ((t + 1) // 2 if t % 2 == 0 else -((t + 1) // 2))
            c = np.int64(codes[n]) + d
            if c < 0 or c > 15:
                continue
            s = _f16r(_f16r(np.float32((c + 1) * (c + 1))) * m)
            e = 0.0
            for r in range(R):
                v = x[r, n]
                if s > 0:
                    q = min(max(np.rint(v / s) + zero, np.float32(0)), np.float32(maxq))
                else:
                    q = np.float32(zero)
                w = _f16r((q - zero) * s)
                e += (np.float64(w) - np.float64(v)) ** 2
            if e < best_e:
                best_e = e
                best_c = c
        out[n] = best_c


def refine_scale_codes(x: np.ndarray, codes: np.ndarray, q_scale_max, bits: int,
                       radius: int = REFINE_RADIUS) -> np.ndarray:
    """exl2fmt's refinement of the searched scale codes (not in ExLlamaV2): with the group's ``q_scale_max``
    fixed, each column independently takes the code within ``radius`` of its searched one whose exact fp16 scale
    ``fp16(fp16((c + 1)^2) * fp16(q_scale_max / 256))`` gives the smallest squared round-to-nearest error of its
    rows (ties keep the searched code, then the nearer, lower code).  The search rounds ``16 sqrt(base / smax)``
    to a code before ``p`` is chosen; on the real MiniLM weights choosing each column's code afterwards lowers
    the RTN weight error by about 5 % at 4 bits and 10 % at 2 bits.

    ``x`` float32 [R, N]: the group's rows; ``codes`` uint8 [N] in 0..15.  Returns uint8 [N]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = np.float32(np.float16(np.float32(np.float16(q_scale_max)) * np.float32(1 / 256)))
    out = np.empty(x.shape[1], dtype=np.int64)
    _refine(x, np.ascontiguousarray(codes, dtype=np.uint8), m, np.float32(1 << (bits - 1)),
            np.float32((1 << bits) - 1), int(radius), out)
    return out.astype(np.uint8)
