"""Converters between weight formats (``exl2fmt.converters``).

A converter is registered for one (source format, target format) pair with ``@register``; ``get`` looks a
pair up and, for an unknown pair, raises ``Exl2Error(USAGE)`` listing the pairs that exist.  Registration of
the same pair twice is a programming error and raises at import time.  No dynamic plugin loading.

The converters themselves (EXL2 -> FP16/BF16, EXL2 <-> GPTQ, FP16 -> EXL2 ...) land in this package module by
module; this file holds only the registry they share.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ErrorCode, Exl2Error

__all__ = ["register", "get", "registered"]

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


def registered() -> list[tuple[str, str]]:
    return sorted(_REGISTRY)


def get(source: str, target: str) -> Callable:
    try:
        return _REGISTRY[(source, target)]
    except KeyError:
        have = ", ".join(f"{s}->{t}" for s, t in registered()) or "none yet"
        raise Exl2Error(ErrorCode.USAGE, f"no converter from {source} to {target}; available: {have}") from None
