"""The per-group scale search of the EXL2 quantizer, as a Numba kernel.

ExLlamaV2 picks one multiplier ``p`` per group from a grid of 97 values in [0.70, 1.20]: every column's trial
scale ``s_n`` is multiplied by ``p``, the group is rounded with it, and the ``p`` with the smallest
``sum |q * p * s_n - x|^3.5`` wins (spec/exl2.md, "scale search").  Evaluating the grid is the quantizer's
most frequent inner loop (once per group per candidate setting), so it gets a kernel: each grid point is
one parallel work item that sweeps the group once, accumulating per column in float32 and over columns in
float64, in a fixed order, so the result does not depend on the thread count.

``grid_errors`` is checked against a NumPy twin in ``tests/test_scale_search.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["P_GRID", "grid_errors", "best_grid_index", "BRACKET_STEP", "SEARCHES", "refine_scale_codes",
           "REFINE_RADIUS"]

#: Scale codes tried on either side of the searched one by ``refine_scale_codes``.
REFINE_RADIUS = 2

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


#: The ways ``best_grid_index`` searches the grid: every point, or a bracket (see there).
SEARCHES = ("full", "bracket")

#: ``best_grid_index(search="bracket")`` first evaluates every BRACKET_STEP-th grid point.
BRACKET_STEP = 6


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

    ``x`` float32 [R, N] and ``trial`` float32 [N] as in ``grid_errors``."""
    if search == "full":
        return int(np.argmin(grid_errors(x, trial, bits)))
    if search != "bracket":
        raise ValueError(f"scale search must be one of {SEARCHES}, got {search!r}")
    n = len(P_GRID)
    coarse = np.arange(0, n, BRACKET_STEP)
    e_coarse = grid_errors(x, trial, bits, P_GRID[coarse])
    c = int(coarse[int(np.argmin(e_coarse))])
    fine = np.array([i for i in range(max(0, c - BRACKET_STEP + 1), min(n - 1, c + BRACKET_STEP - 1) + 1)
                     if i % BRACKET_STEP], dtype=np.int64)
    idx = np.concatenate([coarse, fine])
    err = np.concatenate([e_coarse, grid_errors(x, trial, bits, P_GRID[fine])])
    order = np.argsort(idx, kind="stable")          # ties go to the lowest index, as np.argmin over the grid
    return int(idx[order][int(np.argmin(err[order]))])


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
