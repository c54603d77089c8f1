"""One module per storage format: its layer class, its pack entry points and its ``inspect`` row.

* ``exl2fmt.formats.exl2``   ``Exl2Linear``, ``exl2_tensors`` / ``quantize_rtn`` / ``find_scales``
* ``exl2fmt.formats.gptq``   ``GptqLinear``, ``gptq_layer_tensors`` (also AWQ's inspect row)
* ``exl2fmt.formats.dense``  ``DenseLinear``
* ``exl2fmt.formats.exl3``   ``Exl3Linear`` (decode: ``exl2fmt.codec.exl3``)

Layer objects are frozen dataclasses holding the layer's arrays under their slot names (the layout table's
enums).  Arrays may be memory maps: building a layer and ``validate()`` (not deep) touch only shapes, dtypes
and the tiny ``q_groups`` vector.  Bit packing lives in ``exl2fmt.codec``; this package sits between the core
(layout, codec, container) and the converters / quantizer / CLI.

    layer = build_layer("model.layers.0.mlp.down_proj", tensors, dtypes, fmt=Format.EXL2, config=config)
    issues = layer.validate(deep=True)      # [] when the layer is valid
    w = layer.dequantize()                  # float16 [out_features, in_features]
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Exl2Error
from ..layout import DETECTION_ORDER, LAYOUTS, Format, marker_slot
from .common import LinearBase, as_float32, numpy_to_st_dtype
from .dense import DenseLinear
from .exl2 import Exl2Linear
from .exl3 import Exl3Linear
from .gptq import GptqLinear

__all__ = ["Exl2Linear", "Exl3Linear", "GptqLinear", "DenseLinear", "Linear", "LinearBase", "LINEAR_CLASSES",
           "layer_from_tensors", "build_layer", "config_hints", "inspect_facts", "numpy_to_st_dtype",
           "as_float32"]

Linear = Exl2Linear | GptqLinear | DenseLinear | Exl3Linear

#: Decoded format -> its layer class.
LINEAR_CLASSES: dict[Format, type] = {Format.EXL2: Exl2Linear, Format.GPTQ: GptqLinear, Format.DENSE: DenseLinear,
                                      Format.EXL3: Exl3Linear}


def layer_from_tensors(key: str, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None,
                       *, fmt: Format | None = None, file: str | None = None, **hints) -> Linear:
    """Build the layer object for ``key`` from slot-name -> array (format detected by marker slot, in
    ExLlamaV2's precedence: q_weight, qweight, weight; then EXL3's trellis).  ``dtypes``: slot name -> safetensors dtype (default:
    from the arrays).  ``hints``: ``out_features`` (EXL2's true N), ``bits`` / ``v2`` / ``group_size`` (GPTQ)."""
    if dtypes is None:
        dtypes = {k: numpy_to_st_dtype(v) for k, v in tensors.items()}
    if fmt is None:
        for f in DETECTION_ORDER:
            if marker_slot(f) in tensors:
                fmt = f
                break
        else:
            raise Exl2Error(ErrorCode.LAYER_NOT_FOUND, "no q_weight, qweight, trellis or weight tensor", tensor=key,
                            file=file)
    names = {s.name for s in LAYOUTS[fmt]}
    t = {k: v for k, v in tensors.items() if k in names}
    d = {k: dtypes[k] for k in t}
    cls = LINEAR_CLASSES[fmt]
    if cls is Exl2Linear:
        return Exl2Linear(key, t, d, out_features_hint=hints.get("out_features"), file=file)
    if cls is Exl3Linear:
        return Exl3Linear(key, t, d, in_features_hint=hints.get("in_features"),
                          out_features_hint=hints.get("out_features"), file=file)
    if cls is GptqLinear:
        return GptqLinear(key, t, d, bits_hint=hints.get("bits"), v2=bool(hints.get("v2", False)),
                          group_size_hint=hints.get("group_size"), file=file)
    return DenseLinear(key, t, d, file=file)


def config_hints(fmt: Format, config: dict | None, key: str) -> dict[str, Any]:
    """What config.json tells a layer of ``fmt`` that its tensors do not: EXL2's true ``out_features``, EXL3's true
    ``in_features`` / ``out_features`` (its tensors hold the sizes padded to 128), GPTQ's
    ``bits`` / ``v2`` / ``group_size`` (``config`` may be None or invalid: the hints are then None)."""
    from ..arch import expected_features, gptq_config

    if fmt is Format.EXL2:
        return {"out_features": expected_features(config, key)[1]}
    if fmt is Format.EXL3:
        k, n = expected_features(config, key)
        return {"in_features": k, "out_features": n}
    if fmt is Format.GPTQ:
        gc = gptq_config(config)
        return {"bits": gc.bits, "v2": gc.v2, "group_size": gc.group_size}
    return {}


def build_layer(key: str, fmt: Format, slots: Mapping[str, Any], read: Callable[[Any], np.ndarray],
                config: dict | None, *, file: str | None = None) -> Linear:
    """The layer object of one detected layer, with the hints config.json gives - the one place that builds a
    layer from a model (``model.load_layer``, the validator and the converters call it).

    ``slots`` maps slot name -> a ``TensorInfo`` (``.dtype``, ``.file``); ``read(info)`` returns its array
    (a memory map or a copy).  ``file``: named in issues when the slots do not all come from one file
    (default None).  Raises ``Exl2Error(FORMAT_UNSUPPORTED)`` for a recognised-only format (AWQ)."""
    if fmt not in LINEAR_CLASSES:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{fmt.value} layers cannot be converted", tensor=key)
    tensors = {s: read(ti) for s, ti in slots.items()}
    dtypes = {s: ti.dtype for s, ti in slots.items()}
    files = {str(ti.file) for ti in slots.values()}
    return layer_from_tensors(key, tensors, dtypes, fmt=fmt, file=files.pop() if len(files) == 1 else file,
                              **config_hints(fmt, config, key))


def inspect_facts(fmt: Format) -> Callable[..., dict]:
    """The per-format part of an ``inspect`` layer row: ``inspect_facts(fmt)(model, info, config, issues)``."""
    from . import dense, exl2, exl3, gptq

    return {Format.EXL2: exl2.inspect_facts, Format.GPTQ: gptq.inspect_facts, Format.AWQ: gptq.inspect_facts,
            Format.EXL3: exl3.inspect_facts, Format.DENSE: dense.inspect_facts}[fmt]
