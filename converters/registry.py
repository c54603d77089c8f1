"""The route table: every conversion ``convert`` can do, one entry per (source format, target) pair.

Sources are ``exl2``, ``gptq``, ``dense`` (detected from the model by ``exl2fmt.detect``) and ``gguf`` (a
``.gguf`` file); targets are ``fp16``, ``bf16``, ``gptq``, ``exl2`` and ``gguf``.  An entry (``Route``) runs
either

* a ``Converter`` class (``converters.base``: plan, produce and verify unit by unit), registered by its module
  with ``@register(source, target)`` and driven by ``base.run_conversion`` on the opened model; or
* a driver function ``driver(job)`` for a route with its own pipeline (the quantizer, the GGUF writer and
  reader, GGUF -> quantized), registered in ``converters.routes``.

``opens_source`` routes are chosen from the paths alone, before SRC is opened: a ``.gguf`` source, or the
``gguf`` target, whose driver opens and detects SRC itself.  The others are chosen once SRC is open and its
format detected.

The converter modules import this module (never the ``exl2fmt.converters`` package, whose ``get`` imports them),
so the registry and its users form no import cycle.  Registering a pair twice is a programming error and raises
at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Route", "register", "lookup", "route", "routes_to", "registered_pairs"]


@dataclass(frozen=True)
class Route:
    """One conversion: ``run`` is a ``Converter`` class (``driver`` False) or a driver function ``run(job)``."""

    source: str
    target: str
    run: Callable
    driver: bool = False
    opens_source: bool = False


_REGISTRY: dict[tuple[str, str], Route] = {}


def register(source: str, target: str, *, driver: bool = False,
             opens_source: bool = False) -> Callable[[Callable], Callable]:
    """Class/function decorator: make ``fn`` the converter (or, ``driver=True``, the driver function) from
    ``source`` to ``target`` (format strings)."""

    def deco(fn: Callable) -> Callable:
        key = (source, target)
        if key in _REGISTRY:
            raise RuntimeError(f"converter {source} -> {target} registered twice")
        _REGISTRY[key] = Route(source, target, fn, driver, opens_source)
        return fn

    return deco


def route(source: str, target: str) -> Route | None:
    """The route of (``source``, ``target``), or None."""
    return _REGISTRY.get((source, target))


def lookup(source: str, target: str) -> Callable | None:
    """The converter (or driver) registered for (``source``, ``target``), or None."""
    r = _REGISTRY.get((source, target))
    return None if r is None else r.run


def routes_to(target: str) -> list[Route]:
    """Every route into ``target``."""
    return [r for k, r in sorted(_REGISTRY.items()) if k[1] == target]


def registered_pairs() -> list[tuple[str, str]]:
    """Every registered (source, target) pair, sorted."""
    return sorted(_REGISTRY)
