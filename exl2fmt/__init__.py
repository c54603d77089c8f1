"""exl2fmt: the reference toolkit for the EXL2 quantized-LLM format.

Library API (every name is imported on first use, so ``import exl2fmt`` and the CLI start fast and never pull
in numba, torch or triton before they are needed):

* ``inspect_model(path) -> dict``                   headers only: format, layers, bits; a ``.gguf`` file too
                                                    (``exl2fmt.inspect``; ``spec/inspect.schema.json``)
* ``validate_model(path, deep=False, ...)``         every check, as a ``Report`` of PASS / WARN / FAIL
                                                    (``exl2fmt.validate``)
* ``convert(src, dst, to)``                         between EXL2 / GPTQ / FP16 / BF16 / GGUF (EXL3 -> FP16 / BF16 / GGUF), verified, atomic
                                                    (``exl2fmt.converters``)
* ``quantize(src, dst, "exl2"|"gptq", bits=...)``   FP16/BF16 -> EXL2 / GPTQ, calibrated (needs the ``quant`` extra)
* ``dequantize_layer(path, key) -> numpy.ndarray``  float16 [out_features, in_features], bit-exact with ExLlamaV2
* ``open_model(path) -> ModelFiles``                hardened safetensors container (file or directory)
* ``load_layer(model, key)``                        ``Exl2Linear`` / ``GptqLinear`` / ``DenseLinear`` / ``Exl3Linear``
* ``Exl2Error``, ``ErrorCode``, ``Issue``           the one exception type and its stable codes
* ``load_model(path, device=None, dtype=None)``     a transformers model, EXL2 / GPTQ / EXL3 linears kept packed (needs
                                                    torch and transformers; ``exl2fmt.runtime``; ``device_map=``
                                                    ``max_memory=`` ``offload_folder=`` spread it over devices and
                                                    disk); ``load_tokenizer(path)``
* ``Format``                                        layer formats (``exl2``, ``gptq``, ``dense``, ``exl3``; ``awq`` recognised only)

Example (the bundled sample model: 15 EXL2 layers of a tiny Llama)::

    >>> import pathlib, tempfile
    >>> import exl2fmt
    >>> from exl2fmt.sample import write_sample
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = write_sample(d / "model")
    >>> info = exl2fmt.inspect_model(d / "model")
    >>> info["format"]["name"], len(info["layers"])
    ('exl2', 15)
    >>> exl2fmt.validate_model(d / "model").exit_code
    0
    >>> w = exl2fmt.dequantize_layer(d / "model", "model.layers.0.mlp.down_proj")
    >>> w.dtype.name, w.shape
    ('float16', (256, 704))
    >>> exl2fmt.convert(d / "model", d / "fp16", "fp16").verified
    True
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import ErrorCode, Exl2Error, Issue, Severity  # noqa: E402  (tiny, no heavy imports)

#: public name -> (module, attribute), resolved on first access (module ``__getattr__``)
_LAZY = {
    "inspect_model": ("exl2fmt.inspect", "inspect_model"),
    "validate_model": ("exl2fmt.validate", "validate_model"),
    "convert": ("exl2fmt.converters", "convert"),
    "quantize": ("exl2fmt.converters", "quantize"),
    "dequantize_layer": ("exl2fmt.model", "dequantize_layer"),
    "load_layer": ("exl2fmt.model", "load_layer"),
    "find_layers": ("exl2fmt.model", "find_layers"),
    "open_model": ("exl2fmt.container", "open_model"),
    "Exl2Linear": ("exl2fmt.formats", "Exl2Linear"),
    "GptqLinear": ("exl2fmt.formats", "GptqLinear"),
    "DenseLinear": ("exl2fmt.formats", "DenseLinear"),
    "Format": ("exl2fmt.layout", "Format"),
    "load_model": ("exl2fmt.runtime.loading", "load_model"),
    "load_tokenizer": ("exl2fmt.runtime.loading", "load_tokenizer"),
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
