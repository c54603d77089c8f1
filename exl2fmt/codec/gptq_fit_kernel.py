"""The Numba kernel of ``codec.gptq_fit.fit_group`` (imported on first use: it imports numba).

Defined at module level so that Numba's on-disk cache (``cache=True``) finds it again in the next process (a
function defined inside another one is compiled anew by every process).

``fit(x, s, z, ok, maxq, pairwise, visit, best)``: ``x`` float32 [R, N] (any strides), ``s`` / ``z`` / ``ok``
[C, N] (the candidates' float32 scales and zero points, and which are usable), writes ``best`` int64 [N]:
per column the first candidate with the smallest float64 sum over rows of ``(rec - x)^2`` among the usable
ones (-1 if none), ``rec = fp16((clip(rint(x / s) + z, 0, maxq) - z) * s)`` (``z`` where that is not
finite), every step in float32 as NumPy does it.  ``pairwise`` sums each column as NumPy's pairwise
summation does (blocks of 128 with 8 accumulators), otherwise one row after the other; in that order a
candidate whose partial sum already exceeds the best so far cannot win, and is left early (the result is
the same as summing everything).  Candidates are tried in the order ``visit`` int64 [C] (``gptq_fit._visit_order``:
the middle of the grid first, then outwards, so that the bound is tight early); the choice does not depend
on that order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["fit"]

#: Output columns per parallel work item (on 128 x 2048 groups, 2 cores: 3.0x the speed of the kernel that read
#: ``x`` directly, against 2.4x at 16 and 3.2x at 256, which would leave 16 cores too few items at 2048 columns).
TILE = 64


@njit(cache=True, inline="always", error_model="numpy")
def diff(xv, s, z, maxq):
    """``rec - x`` in float32 for one value and one candidate (see the module docstring)."""
    q = np.float32(np.rint(np.float32(xv / s)) + z)
    fin = np.abs(q) < np.float32(np.inf)
    qc = np.float32(min(max(q, np.float32(0)), maxq))
    q = qc if fin else z
    rec = f16_bits_to_f32(f32_to_f16_bits(np.float32((q - z) * s)))
    return np.float32(rec - xv)


@njit(cache=True, inline="always")
def sq_err(xv, s, z, maxq):
    d = np.float64(diff(xv, s, z, maxq))
    return d * d

@njit(cache=True)
def block_sum(a, lo, cnt):
    """NumPy's pairwise_sum on a[lo:lo + cnt] for cnt <= 128: 8 accumulators, then the rest."""
    if cnt < 8:
        res = 0.0
        for i in range(lo, lo + cnt):
            res += a[i]
        return res
    r = a[lo:lo + 8].copy()
    i = 8
    end = cnt - cnt % 8
    while i < end:
        for k in range(8):
            r[k] += a[lo + i + k]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < cnt:
        res += a[lo + i]
        i += 1
    return res

@njit(cache=True)
def pairwise_sum(a):
    """NumPy's pairwise summation of a float64 [n] (halves cut to multiples of 8, blocks of <= 128),
    without recursion: an explicit stack of (start, count, left sum or -1 while the left half is open)."""
    n = a.shape[0]
    if n <= 128:
        return block_sum(a, 0, n)
    lo_s = np.empty(64, dtype=np.int64)
    cnt_s = np.empty(64, dtype=np.int64)
    left_s = np.empty(64, dtype=np.float64)
    state = np.zeros(64, dtype=np.int64)          # 0: left half to do, 1: right half to do
    top = 0
    lo_s[0], cnt_s[0], state[0] = 0, n, 0
    val = 0.0
    have = False                                  # ``val`` holds a finished child's sum
    while top >= 0:
        cnt = cnt_s[top]
        n2 = cnt // 2
        n2 -= n2 % 8
        if have:
            if state[top] == 0:
                left_s[top] = val
                state[top] = 1
                have = False
            else:
                val = left_s[top] + val
                top -= 1
                continue
        lo = lo_s[top] + (0 if state[top] == 0 else n2)
        c = n2 if state[top] == 0 else cnt - n2
        if c <= 128:
            val = block_sum(a, lo, c)
            have = True
        else:
            top += 1
            lo_s[top], cnt_s[top], state[top] = lo, c, 0
    return val

@njit(cache=True, parallel=True, error_model="numpy")
def fit(x, s, z, ok, maxq, pairwise, visit, best):
    R, N = x.shape
    C = s.shape[0]
    tile = TILE
    chunk = 16                           # rows between two checks of the bound
    for t in prange((N + tile - 1) // tile):
        n0 = t * tile
        n1 = min(N, n0 + tile)
        T = n1 - n0
        acc = np.empty(T, dtype=np.float64)
        col = np.empty(R if pairwise else 0, dtype=np.float64)
        best_err = np.full(T, np.inf)
        best_c = np.full(T, C, dtype=np.int64)
        # the tile's values and the candidate's scales and zero points in arrays of the work item's own
        # (contiguous, unaliased): the row loop below then vectorizes over the tile's columns, 8 float32 lanes
        # with the squares summed in a loop of their own (4 lanes when one loop does both); the pairwise sums
        # read each column as a contiguous run (``xl`` transposed)
        xl = np.empty((T, R) if pairwise else (R, T), dtype=np.float32)
        for rr in range(R):
            for j in range(T):
                if pairwise:
                    xl[j, rr] = x[rr, n0 + j]
                else:
                    xl[rr, j] = x[rr, n0 + j]
        sl = np.empty(T, dtype=np.float32)
        zl = np.empty(T, dtype=np.float32)
        dl = np.empty(T, dtype=np.float32)
        for k in range(C):
            c = visit[k]
            for j in range(T):
                sl[j] = s[c, n0 + j]
                zl[j] = z[c, n0 + j]
            if pairwise:
                for j in range(T):
                    for rr in range(R):
                        col[rr] = sq_err(xl[j, rr], sl[j], zl[j], maxq)
                    acc[j] = pairwise_sum(col)
            else:
                acc[:] = 0.0
                r = 0
                while r < R:
                    r1 = min(R, r + chunk)
                    for rr in range(r, r1):
                        for j in range(T):
                            dl[j] = diff(xl[rr, j], sl[j], zl[j], maxq)
                        for j in range(T):
                            d = np.float64(dl[j])
                            acc[j] += d * d
                    r = r1
                    if r < R:
                        alive = False
                        for j in range(T):
                            if ok[c, n0 + j] and (acc[j] < best_err[j] or (
                                    acc[j] == best_err[j] and c < best_c[j] and best_c[j] < C)):
                                alive = True
                                break
                        if not alive:
                            break
                if r < R:
                    continue
            for j in range(T):       # (an infinite error never wins, not even the first)
                if ok[c, n0 + j] and (acc[j] < best_err[j] or
                                      (acc[j] == best_err[j] and c < best_c[j] and best_c[j] < C)):
                    best_err[j] = acc[j]
                    best_c[j] = c
        for j in range(T):
            best[n0 + j] = best_c[j] if best_c[j] < C else -1
