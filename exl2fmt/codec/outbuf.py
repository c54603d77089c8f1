"""Output buffers of the decoders: 64-byte aligned, and a large one handed back for the next decode.

Why.  A decoder returns a new array.  A fresh anonymous page is zeroed by the kernel on its first touch, so a
function that returns a new 90 MB array pays for writing it twice: the kernel's zeroing (huge pages or not) and
the decode's own stores, which then cannot stream past the cache either (the zeroed lines sit there dirty).  Code
that decodes layer after layer (a converter, ``dequantize_layer`` in a loop) drops each result before it asks for
the next one of the same size.  So a large output lives in its own anonymous mapping (2 MiB aligned, transparent
huge pages asked for), owned by a small object that the returned array and all its views keep alive; when the last
of them dies, the mapping goes back to a one-entry pool instead of to the kernel, and the next request of the same
size class reuses it: no page fault, no zeroing, and the decoder may use non-temporal stores.

What it costs.  At most one freed output mapping stays resident until the next request (a request of another size
class releases it first, so a pooled mapping never coexists with a fresh one) or ``release_pool()``.  Outputs below
``POOL_MIN_BYTES`` are plain ``np.empty`` (their faults are cheap).  Numbers: bench/RESULTS.md (issue 41, helper dec).
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["empty_aligned", "is_reused", "release_pool", "POOL_MIN_BYTES", "POOL_SIZE"]

POOL_MIN_BYTES = 4 << 20  # NumPy's own threshold for asking for huge pages
#: how many dropped output mappings are kept for reuse: 1, or 0 for none (every output then is a fresh mapping
#: and is unmapped when its last array dies; the benchmarks' "fresh output" rows set it)
POOL_SIZE = 1
_HUGE = 2 << 20
_pool: list[mmap.mmap] = []  # at most one mapping; list.pop / append are atomic under the GIL


class _Mapping:
    """Owns one anonymous mapping and exposes ``shape`` uint16 at a 2 MiB aligned address through
    ``__array_interface__`` (every array over it, views included, keeps it alive through its chain of bases);
    when the last one dies the mapping returns to the pool."""

    def __init__(self, mm: mmap.mmap, addr: int, shape: tuple[int, int], reused: bool):
        self.mm = mm
        self.reused = reused
        self.__array_interface__ = {"shape": shape, "typestr": "<u2", "data": (addr, False), "version": 3}

    def __del__(self):
        try:
            _put(self.mm)
        except Exception:  # pragma: no cover - interpreter shutdown (module globals already gone): just unmap
            pass


def _put(mm: mmap.mmap) -> None:
    if POOL_SIZE < 1:
        return  # mm is unmapped when its last reference goes
    _pool.append(mm)
    while len(_pool) > POOL_SIZE:  # keep the newest; an older one is unmapped when its last reference goes
        try:
            _pool.pop(0)
        except IndexError:  # pragma: no cover - a concurrent pop emptied it
            break


def _take(length: int) -> mmap.mmap | None:
    if POOL_SIZE < 1:
        return None
    try:
        mm = _pool.pop()
    except IndexError:
        return None
    return mm if len(mm) == length else None  # another size class: dropped (unmapped) before the new mapping


def release_pool() -> None:
    """Unmap the pooled output mapping, if any (its memory goes back to the system)."""
    while _pool:
        try:
            _pool.pop()
        except IndexError:  # pragma: no cover
            break


def empty_aligned(shape: tuple[int, int]) -> np.ndarray:
    """Uninitialised uint16 array of ``shape`` (C order) whose data starts on a 64-byte boundary (2 MiB from
    ``POOL_MIN_BYTES`` up, where it may reuse the mapping of an output that has since been dropped)."""
    n = int(shape[0]) * int(shape[1])
    if 2 * n < POOL_MIN_BYTES:
        raw = np.empty(n + 32, dtype=np.uint16)
        off = (-raw.ctypes.data % 64) // 2
        return raw[off:off + n].reshape(shape)
    length = -(-2 * n // _HUGE) * _HUGE + _HUGE
    mm = _take(length)
    reused = mm is not None
    if mm is None:
        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
    probe = np.frombuffer(mm, dtype=np.uint8, count=1)
    base = probe.ctypes.data
    del probe  # no export of mm may outlive this call: the owner below holds the mapping itself
    addr = base + (-base % _HUGE)
    return np.asarray(_Mapping(mm, addr, (int(shape[0]), int(shape[1])), reused))


def is_reused(a: np.ndarray) -> bool:
    """True when ``a`` (from ``empty_aligned``, or a view of it) lies in a reused mapping: its pages are resident
    and not in the cache, so non-temporal stores pay off there."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    return bool(getattr(base, "reused", False))
