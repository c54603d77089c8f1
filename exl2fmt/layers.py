"""Old import path of the layer classes, which now live one module per format in ``exl2fmt.formats``.

Kept because tests, benches, the fuzzers and the quantizer import from here; new code imports
``exl2fmt.formats``.
"""

from __future__ import annotations

from .formats import (DenseLinear, Exl2Linear, GptqLinear, Linear, layer_from_tensors,  # noqa: F401
                      numpy_to_st_dtype)
from .formats.common import as_float32 as _as_float32  # noqa: F401  (converters/gptq_to_exl2.py's import)

__all__ = ["Exl2Linear", "GptqLinear", "DenseLinear", "Linear", "layer_from_tensors", "numpy_to_st_dtype"]
