"""``np``: numpy, imported on first attribute access.

The header-only commands (``inspect``, structural ``validate``) go through modules that also hold array code
(``exl2fmt.formats``, ``exl2fmt.groups``, the container reader); importing numpy costs more than inspecting a
70B model's headers (bench/RESULTS.md, issue 18), so those modules name numpy through this proxy and pay the
import only when they touch an array.  Use ``from exl2fmt.lazynp import np`` exactly like ``import numpy as
np``; code that runs array work in tight loops should import numpy itself.
"""

from __future__ import annotations

__all__ = ["np"]


class _LazyNumpy:
    __slots__ = ()

    def __getattr__(self, name: str):
        import numpy

        return getattr(numpy, name)

    def __repr__(self) -> str:
        return "<numpy, imported on first use>"


np = _LazyNumpy()
