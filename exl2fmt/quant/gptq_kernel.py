"""The CPU row loop of one GPTQ group (``quant.gptq._sweep``) as a Numba kernel; imported on first use (it
imports numba).

Defined at module level so that Numba's on-disk cache (``cache=True``) finds it again in the next process (a
function defined inside another one is compiled anew by every process: seconds of every run).

Within a group every output column is independent (row c's error only moves later rows of the same
column), so column tiles run in parallel; the arithmetic is the float32 sequence of the torch path
(``q = clamp(rint(w / s) + z)``, ``w_hat = fp16((q - z) * s)``, ``e = (w - w_hat) / U[c, c]``,
``w_r -= U[c, r] * e`` with two roundings), so both paths give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..codec._f16 import f16_bits_to_f32, f32_to_f16_bits

__all__ = ["kernel"]


@njit(cache=True, parallel=True)
def kernel(blk, Ublk, s, z, maxq, codes, err):
    r, N = blk.shape
    tile = 64
    for t in prange((N + tile - 1) // tile):
        n0 = t * tile
        n1 = min(N, n0 + tile)
        for c in range(r):
            d = Ublk[c, c]
            for n in range(n0, n1):
                w = blk[c, n]
                sn = s[n]
                if sn > 0:
                    q = np.rint(w / sn) + z[n]
                    if q < 0:
                        q = np.float32(0)
                    elif q > maxq:
                        q = np.float32(maxq)
                else:
                    q = z[n]
                wh = f16_bits_to_f32(f32_to_f16_bits(np.float32((q - z[n]) * sn)))
                err[c, n] = np.float32((w - wh) / d)
                codes[c, n] = np.uint8(q)
                blk[c, n] = wh
            for rr in range(c + 1, r):        # contiguous inner loop over the tile's columns
                u = Ublk[c, rr]
                for n in range(n0, n1):
                    blk[rr, n] = np.float32(blk[rr, n] - np.float32(u * err[c, n]))
