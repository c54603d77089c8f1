"""Model-level access: find the linear layers of a model and build layer objects from its files."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .arch import expected_features, gptq_config
from .container import ModelFiles, open_model
from .errors import ErrorCode, Exl2Error
from .layers import Linear, layer_from_tensors
from .layout import DETECTION_ORDER, LAYOUTS, Format, SlotStatus, marker_slot

__all__ = ["LayerRef", "find_layers", "load_layer", "dequantize_layer"]

# Names of 2-D ``.weight`` tensors that are not linear layers.
_NOT_LINEAR = ("embed_tokens", "wte", "wpe", "embed_positions", "word_embeddings", "position_embeddings",
               "token_type_embeddings", "norm", "ln_", "layernorm")


@dataclass(frozen=True)
class LayerRef:
    """A linear layer found in a model: its key, detected format and the slot names present."""

    key: str
    format: Format
    slots: tuple[str, ...]
    ambiguous: tuple[Format, ...] = ()


def find_layers(names, shapes: dict[str, tuple] | None = None) -> dict[str, LayerRef]:
    """Group tensor names into linear layers by the layout table's marker slots.

    A key is a layer when ``<key>.q_weight`` (EXL2), ``<key>.qweight`` (GPTQ) or a 2-D ``<key>.weight`` that
    is not an embedding or norm (dense) exists.  ``ambiguous`` lists the other formats whose marker is also
    present for the same key (ExLlamaV2's precedence decides ``format``).
    """
    names = set(names)
    markers = {marker_slot(f): f for f in DETECTION_ORDER}
    found: dict[str, list[Format]] = {}
    for n in names:
        key, _, leaf = n.rpartition(".")
        fmt = markers.get(leaf)
        if fmt is None or not key:
            continue
        if fmt is Format.DENSE:
            if shapes is not None and len(shapes.get(n, ())) != 2:
                continue
            last = key.rsplit(".", 1)[-1]
            if any(tok in last for tok in _NOT_LINEAR):
                continue
        found.setdefault(key, []).append(fmt)
    out = {}
    for key in sorted(found):
        fmts = sorted(found[key], key=DETECTION_ORDER.index)
        fmt = fmts[0]
        slots = tuple(s.name for s in LAYOUTS[fmt] if s.status is not SlotStatus.DERIVED and f"{key}.{s.name}" in names)
        out[key] = LayerRef(key, fmt, slots, tuple(fmts[1:]))
    return out


def load_layer(model: ModelFiles, key: str) -> Linear:
    """Build the layer object for ``key`` (lazy memory-mapped arrays)."""
    candidates = [f for f in DETECTION_ORDER if f"{key}.{marker_slot(f)}" in model]
    if not candidates:
        raise Exl2Error(ErrorCode.LAYER_NOT_FOUND, f"no {key}.q_weight, {key}.qweight or {key}.weight in the model",
                        tensor=key, file=str(model.root))
    fmt = candidates[0]
    tensors, dtypes, files = {}, {}, set()
    for s in LAYOUTS[fmt]:
        name = f"{key}.{s.name}"
        if s.status is SlotStatus.DERIVED or name not in model:
            continue
        info = model.info(name)
        tensors[s.name] = model.get(name)
        dtypes[s.name] = info.dtype
        files.add(str(info.file))
    file = files.pop() if len(files) == 1 else str(model.root)
    hints = {}
    if fmt is Format.EXL2:
        hints["out_features"] = expected_features(model.config, key)[1]
    elif fmt is Format.GPTQ:
        gc = gptq_config(model.config)
        hints.update(bits=gc.bits, v2=gc.v2, group_size=gc.group_size)
    return layer_from_tensors(key, tensors, dtypes, fmt=fmt, file=file, **hints)


def dequantize_layer(path: str | os.PathLike, key: str) -> np.ndarray:
    """Dequantize one linear layer of a file or model directory.

    ``path``: a ``.safetensors`` file or a model directory (sharded or not).  ``key``: the layer prefix, e.g.
    ``model.layers.0.mlp.down_proj``.  Returns float16 [out_features, in_features] (``nn.Linear`` orientation),
    bit-exact with ExLlamaV2 for EXL2 layers; EXL2 padding columns are dropped using ``config.json`` when it
    names the layer's true width.  Raises ``Exl2Error`` on any problem: the layer must pass the checks of
    ``validate --deep`` and decode to finite values (``Linear.dequantize_finite``), the rule every command that
    decodes applies.
    """
    model = open_model(path)
    try:
        return load_layer(model, key).dequantize_finite()
    finally:
        close = getattr(model, "close", None)
        if close:
            close()
