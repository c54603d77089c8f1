"""Checksums of written bytes: what a converter produced vs what is on disk.

``Checksum`` is Fletcher-style over little-endian 64-bit words (see its docstring), fed incrementally, so the
same value comes out of a tensor produced in memory (``ShardWriter.feed``) and of the same bytes re-read from
the file in windows (``checksum_of_file_range``).  The word loop is compiled with Numba (GIL released), which is
why this module is not imported by ``exl2fmt.container`` itself: only a streaming writer and the verify pass
need it.
"""

from __future__ import annotations

import mmap

import numpy as np
from numba import njit

__all__ = ["Checksum", "checksum", "checksum_of_file_range"]


@njit(nogil=True, cache=True)
def _fletcher_words(words, state):
    """state: uint64[2] = (a, b), updated in place (uint64 arithmetic wraps mod 2^64)."""
    a = state[0]
    b = state[1]
    for i in range(words.shape[0]):
        a += words[i]
        b += a
    state[0] = a
    state[1] = b


class Checksum:
    """Fletcher-style checksum of a byte string: two running sums mod 2^64 over its little-endian 64-bit words
    (the last word zero-padded), a = sum(w_i), b = sum(a_i), plus the length.  Any changed word changes a, any
    moved word changes b; it runs at memory speed (Numba, GIL released) and identically over a tensor produced
    in memory and over the same bytes re-read from the file in windows."""

    __slots__ = ("state", "n", "_tail")

    def __init__(self):
        self.state, self.n, self._tail = np.zeros(2, dtype=np.uint64), 0, b""

    def update(self, data) -> "Checksum":
        d = np.frombuffer(data, dtype=np.uint8)
        if self._tail:
            d = np.concatenate([np.frombuffer(self._tail, dtype=np.uint8), d])
            self.n -= len(self._tail)
        k = d.size // 8 * 8
        if k:
            _fletcher_words(d[:k].view(np.uint64), self.state)
        self._tail = d[k:].tobytes()
        self.n += d.size
        return self

    def digest(self) -> tuple[int, int, int]:
        st = self.state.copy()
        if self._tail:
            _fletcher_words(np.frombuffer(self._tail + b"\0" * (8 - len(self._tail)), dtype=np.uint64), st)
        return int(st[0]), int(st[1]), self.n


def checksum(data) -> tuple[int, int, int]:
    return Checksum().update(data).digest()


def checksum_of_file_range(path: str, offset: int, length: int, window: int = 64 << 20) -> tuple[int, int, int]:
    """``checksum`` of ``length`` bytes of ``path`` at ``offset``, read through short-lived memory maps (no
    copy, and the mapped pages leave the resident set with each window)."""
    c = Checksum()
    if length == 0:
        return c.digest()
    gran = mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        pos, end = offset, offset + length
        while pos < end:
            base = pos - pos % gran
            n = min(end, base + window) - base
            with mmap.mmap(f.fileno(), n, offset=base, access=mmap.ACCESS_READ) as mm:
                mv = memoryview(mm)
                try:
                    c.update(mv[pos - base:n])
                finally:
                    mv.release()
            pos = base + n
    return c.digest()
