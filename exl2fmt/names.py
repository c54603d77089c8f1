"""Tensor and layer names: the small toolbox that inspect, validate and the converters share.

* ``has_control_chars``: a name ``errors.escape_name`` would escape (control, format, separator or other
  non-printable characters).
* ``natural_key``: sort key with digit runs compared as numbers (``layers.2`` before ``layers.10``).
* ``block_of`` / ``is_head``: the decoder block a layer key belongs to; whether a key is the output head.
* ``is_vision`` / ``is_mtp``: a key of a vision tower or multimodal projector; a key of a multi-token-prediction
  module (``mtp.*``, ``*.mtp_layers.N.*``, or a block ``layers.N`` past ``num_hidden_layers`` that the config's
  ``num_nextn_predict_layers`` accounts for, as DeepSeek-V3 / GLM-4.5 store them).
* ``layer_order_key``: model order (blocks 0, 1, 2, ... 10; attention before MLP; projections in the order a
  forward pass uses them; then the layers outside blocks; the head last).

Standard library only (core tier): importing it costs nothing.
"""

from __future__ import annotations

import re

__all__ = ["has_control_chars", "natural_key", "block_of", "is_head", "is_vision", "is_mtp", "layer_order_key"]


def has_control_chars(text: str) -> bool:
    """True when ``escape_name`` would change ``text`` (a control, format, separator or other non-printable
    character)."""
    return not str(text).isprintable()


_DIGIT_RUNS = re.compile(r"(\d+)")
_BLOCK_RE = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks|block|blk)\.(\d+))\.")


def natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in _DIGIT_RUNS.split(s)]


def block_of(key: str) -> str | None:
    """``model.layers.12`` for ``model.layers.12.mlp.down_proj``; None outside decoder blocks."""
    m = _BLOCK_RE.match(key)
    return m.group(1) if m else None


def is_head(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return last in ("lm_head", "output") or key.endswith("lm_head")


#: module names that open a vision tower or a multimodal projector (Qwen2-VL ``visual``, LLaVA / Gemma 3 /
#: Mistral 3 ``vision_tower`` and ``multi_modal_projector``, Idefics / SmolVLM ``vision_model``, ...)
_VISION_PARTS = ("visual", "vision_tower", "vision_model", "vision_encoder", "vision_embed_tokens",
                 "multi_modal_projector", "mm_projector")
_MTP_PARTS = ("mtp", "mtp_layers")


def is_vision(key: str) -> bool:
    """True for a tensor or layer key inside a vision tower or multimodal projector."""
    return any(p in _VISION_PARTS for p in key.split("."))


def is_mtp(key: str, num_hidden_layers: int | None = None, nextn_layers: int | None = None) -> bool:
    """True for a key of a multi-token-prediction module: under ``mtp`` / ``mtp_layers``, or (given the config's
    ``num_hidden_layers`` and ``num_nextn_predict_layers``) in a block ``layers.N`` with
    ``num_hidden_layers <= N < num_hidden_layers + num_nextn_predict_layers``."""
    if any(p in _MTP_PARTS for p in key.split(".")):
        return True
    if num_hidden_layers and nextn_layers and not is_vision(key):
        m = _BLOCK_RE.match(key)
        if m and m.group(1).split(".")[-2] == "layers":
            return num_hidden_layers <= int(m.group(2)) < num_hidden_layers + nextn_layers
    return False


# Within a block, list projections in the order a forward pass uses them.
_LEAF_ORDER = {name: i for i, name in enumerate(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"))}


_MODULE_ORDER = {"self_attn": 0, "attn": 0, "attention": 0, "mlp": 1, "feed_forward": 1, "block_sparse_moe": 1}


def layer_order_key(key: str):
    parent, _, leaf = key.rpartition(".")
    block, _, module = parent.rpartition(".")
    order = (natural_key(block), _MODULE_ORDER.get(module, 2), natural_key(module),
             _LEAF_ORDER.get(leaf, len(_LEAF_ORDER)), natural_key(leaf))
    if block_of(key) is not None:
        return (0, *order)
    return (2 if is_head(key) else 1, *order)
