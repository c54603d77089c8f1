"""exl2fmt: the reference toolkit for the EXL2 quantized-LLM format.

Public API (imported lazily so that ``import exl2fmt`` and the CLI start fast and never pull in numba,
torch or triton before they are needed):

* ``dequantize_layer(path, key) -> numpy.ndarray``  float16 [out_features, in_features]
* ``open_model(path) -> ModelFiles``               hardened safetensors container (file or directory)
* ``load_layer(model, key)``                       ``Exl2Linear`` / ``GptqLinear`` / ``DenseLinear``
* ``Exl2Error``, ``ErrorCode``, ``Issue``          the one exception type and its stable codes
* ``Format``                                       layer formats (``exl2``, ``gptq``, ``dense``)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import ErrorCode, Exl2Error, Issue, Severity  # noqa: E402  (tiny, no heavy imports)

_LAZY = {
    "dequantize_layer": ("exl2fmt.model", "dequantize_layer"),
    "load_layer": ("exl2fmt.model", "load_layer"),
    "find_layers": ("exl2fmt.model", "find_layers"),
    "open_model": ("exl2fmt.container", "open_model"),
    "Exl2Linear": ("exl2fmt.layers", "Exl2Linear"),
    "GptqLinear": ("exl2fmt.layers", "GptqLinear"),
    "DenseLinear": ("exl2fmt.layers", "DenseLinear"),
    "Format": ("exl2fmt.layout", "Format"),
}

__all__ = ["__version__", "ErrorCode", "Exl2Error", "Issue", "Severity", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'exl2fmt' has no attribute {name!r}")
