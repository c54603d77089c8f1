"""GPU kernels for EXL2 (``exl2fmt.kernels``).

This package never imports torch or triton at import time: the CLI's inspect/validate must start without
them.  ``available()`` says whether the optional kernel stack is installed (``pip install exl2fmt[kernels]``).
The kernels import the layout from ``exl2fmt.layout``; they never define it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["available"]


def available() -> dict[str, bool]:
    """Which optional kernel dependencies are importable, without importing them."""
    return {name: importlib.util.find_spec(name) is not None for name in ("torch", "triton")}
