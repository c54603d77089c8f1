"""Old import path of the EXL2 pack entry points, which now live in ``exl2fmt.formats.exl2``.

Kept because tests, benches, the fuzzers, spec/malformed and the quantizer import from here; new code
imports ``exl2fmt.formats.exl2``.
"""

from __future__ import annotations

from .formats.exl2 import exl2_tensors, find_scales, quantize_rtn  # noqa: F401

__all__ = ["exl2_tensors", "quantize_rtn", "find_scales"]
