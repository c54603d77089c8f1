"""Model-level access: find the linear layers of a model and build layer objects from its files."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .container import ModelFiles, open_model
from .detect import layer_candidates
from .errors import ErrorCode, Exl2Error
from .formats import Linear, build_layer
from .layout import DETECTION_ORDER, Format, marker_slot, slot_names

__all__ = ["LayerRef", "find_layers", "load_layer", "dequantize_layer"]

@dataclass(frozen=True)
class LayerRef:
    """A linear layer found in a model: its key, detected format and the slot names present."""

    key: str
    format: Format
    slots: tuple[str, ...]
    ambiguous: tuple[Format, ...] = ()


def find_layers(names, shapes: dict[str, tuple] | None = None) -> dict[str, LayerRef]:
    """Group tensor names into linear layers by the layout table's marker slots.

    A key is a layer when ``<key>.q_weight`` (EXL2), ``<key>.qweight`` (GPTQ), ``<key>.trellis`` (EXL3) or a 2-D
    ``<key>.weight`` that is not an embedding or norm (dense) exists.  ``ambiguous`` lists the other formats whose marker is also
    present for the same key (ExLlamaV2's precedence decides ``format``).
    """
    names = set(names)
    found = layer_candidates({n: (shapes.get(n, ()) if shapes is not None else None) for n in names},
                             recognised=False)
    out = {}
    for key in sorted(found):
        fmts = sorted(found[key], key=DETECTION_ORDER.index)
        fmt = fmts[0]
        slots = tuple(s for s in slot_names(fmt, derived=False) if f"{key}.{s}" in names)
        out[key] = LayerRef(key, fmt, slots, tuple(fmts[1:]))
    return out


def load_layer(model: ModelFiles, key: str) -> Linear:
    """Build the layer object for ``key`` (lazy memory-mapped arrays)."""
    candidates = [f for f in DETECTION_ORDER if f"{key}.{marker_slot(f)}" in model]
    if not candidates:
        raise Exl2Error(ErrorCode.LAYER_NOT_FOUND, f"no {key}.q_weight, {key}.qweight, {key}.trellis or {key}.weight "
                        "in the model",
                        tensor=key, file=str(model.root))
    fmt = candidates[0]
    slots = {s: model.info(f"{key}.{s}") for s in slot_names(fmt, derived=False) if f"{key}.{s}" in model}
    return build_layer(key, fmt, slots, lambda info: model.get(info.name), model.config, file=str(model.root))


def dequantize_layer(path: str | os.PathLike, key: str) -> np.ndarray:
    """Dequantize one linear layer of a file or model directory.

    ``path``: a ``.safetensors`` file or a model directory (sharded or not).  ``key``: the layer prefix, e.g.
    ``model.layers.0.mlp.down_proj``.  Returns float16 [out_features, in_features] (``nn.Linear`` orientation),
    bit-exact with ExLlamaV2 for EXL2 layers; EXL2 padding columns (EXL3: padding rows and columns) are dropped
    using ``config.json`` when it names the layer's true width.  Raises ``Exl2Error`` on any problem: the layer must pass the checks of
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
