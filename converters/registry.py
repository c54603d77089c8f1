"""The converter registry: ``register(source, target)`` records the converter of one (source format, target)
pair; ``lookup`` and ``registered_pairs`` read it.

The converter modules import this module (never the ``exl2fmt.converters`` package, whose ``get`` imports them),
so the registry and its users form no import cycle.  Registering a pair twice is a programming error and raises
at import time.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["register", "lookup", "registered_pairs"]

_REGISTRY: dict[tuple[str, str], Callable] = {}


def register(source: str, target: str) -> Callable[[Callable], Callable]:
    """Class/function decorator: make ``fn`` the converter from ``source`` to ``target`` (format strings)."""

    def deco(fn: Callable) -> Callable:
        key = (source, target)
        if key in _REGISTRY:
            raise RuntimeError(f"converter {source} -> {target} registered twice")
        _REGISTRY[key] = fn
        return fn

    return deco


def lookup(source: str, target: str) -> Callable | None:
    """The converter registered for (``source``, ``target``), or None."""
    return _REGISTRY.get((source, target))


def registered_pairs() -> list[tuple[str, str]]:
    """Every registered (source, target) pair, sorted."""
    return sorted(_REGISTRY)
