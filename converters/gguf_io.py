"""The GGUF file primitives both directions share: open a file through exl2fmt's bounded reader, its pre-scan, and
the decode of tensor data to float32.  ``gguf_write`` verifies its output with them and ``gguf_read`` converts
with them; neither imports the other.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import ErrorCode, Exl2Error
from .base import bf16_bits_to_f32

__all__ = ["open_gguf", "prescan_gguf", "decode", "ggml_type"]


def open_gguf(path: str | os.PathLike):
    """``(reader, prescan dict)`` for a GGUF file; ``Exl2Error`` on any problem (UNSUPPORTED_INPUT without the
    ``gguf`` package, GGUF_INVALID for a bad file).  ``reader`` is ``exl2fmt.gguf_scan.GgufFile``: the bounded
    walk of the whole header (counts, string and array lengths, alignment, types, offsets, data extents checked
    before anything is allocated) with the part of ``gguf.GGUFReader``'s interface used here (``fields``,
    ``get_field(k).contents()``, ``tensors`` with ``data`` memory-mapped); metadata arrays are decoded only when
    asked for, so a long array costs nothing unless the tokenizer needs it."""
    from ..gguf_scan import open_gguf_file
    from ..inspect import gguf_scan_summary

    p = str(path)
    try:
        import gguf  # noqa: F401  (the ggml type table and block decoders)
    except ImportError:
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "reading GGUF needs the optional gguf package: pip install "
                        "'exl2fmt[gguf]'", file=p) from None
    if not os.path.isfile(p):
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such file", file=p)
    reader = open_gguf_file(p)
    return reader, gguf_scan_summary(reader)


def prescan_gguf(path: str | os.PathLike) -> dict:
    """The bounded pre-scan of ``open_gguf`` alone (tensor table, counts, alignment; no ``gguf.GGUFReader``)."""
    from ..inspect import gguf_prescan

    p = str(path)
    if not os.path.isfile(p):
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such file", file=p)
    return gguf_prescan(p)


def ggml_type(name: str):
    """``gguf.GGMLQuantizationType`` member of a ggml type name (``"Q8_0"``, ``"F16"``, ...)."""
    import gguf

    return gguf.GGMLQuantizationType[name]


def decode(data: np.ndarray, gtype: str) -> np.ndarray:
    """float32 values of GGUF data (numpy order) of type ``gtype`` (``F32``/``F16``/``BF16`` or a block type)."""
    from gguf import quants

    if gtype == "F32":
        return np.asarray(data, dtype=np.float32)
    if gtype == "F16":
        return np.asarray(data).view(np.float16).astype(np.float32)
    if gtype == "BF16":
        return bf16_bits_to_f32(np.asarray(data).view(np.uint16))
    return quants.dequantize(np.asarray(data), ggml_type(gtype))
