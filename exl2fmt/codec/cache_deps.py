"""Numba's on-disk cache made to notice the files a kernel's code comes from, not only its own file.

Why.  ``@njit(cache=True)`` keys a cached kernel on a hash of the source file that defines it.  A kernel of
``codec/exl3.py`` inlines intrinsics and ``inline="always"`` helpers from ``codec/exl3_ops.py`` (and
``exl2.py``, ``f16.py``): after an edit there the cache still hands back the old machine code, so a change looks
like it made no difference (or tests pass on stale code) until someone clears ``__pycache__``.

How.  ``watch(module_file, deps)`` registers, before the module's kernels are decorated, a cache locator that
wraps the one Numba would have picked for functions of ``module_file`` and whose source stamp is Numba's own stamp
plus the SHA-256 of every file in ``deps``.  When a dependency changes, the stamp stored in the cache index no
longer matches, Numba treats the index as stale, recompiles and overwrites it.  Nothing else changes: same cache
directory, same file names; ``NUMBA_CACHE_LOCATOR_CLASSES`` (an explicit locator list) bypasses it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching

__all__ = ["watch"]

_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # holds the locator classes Numba tries in turn
_DEPS: dict[str, tuple[str, ...]] = {}  # absolute module file -> absolute dependency files


def _file_hash(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:  # a dependency that cannot be read: a stamp that matches no earlier one
        return "missing"


class _DepsLocator(caching._CacheLocator):
    """Delegates everything to the default locator of the function's file, adding the dependencies' hashes to
    the source stamp."""

    def __init__(self, inner, deps: tuple[str, ...]):
        self._inner = inner
        self._deps = deps

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), tuple(_file_hash(d) for d in self._deps))

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        deps = _DEPS.get(os.path.abspath(py_file))
        if deps is None:
            return None
        for other in _IMPL._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, deps)
        return None


def watch(module_file: str, deps) -> None:
    """Make the cached kernels defined in ``module_file`` depend on the files ``deps`` as well (call it at import
    time, before the module's ``@njit(cache=True)`` decorators run)."""
    _DEPS[os.path.abspath(module_file)] = tuple(os.path.abspath(d) for d in deps)
    if _DepsLocator not in _IMPL._locator_classes:
        _IMPL._locator_classes.insert(0, _DepsLocator)
