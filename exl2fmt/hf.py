"""``import exl2fmt.hf``: transformers loads EXL2 (and GPTQ, where its own path is missing) packed.

transformers has no EXL2 quantizer: ``from_pretrained`` of an EXL2 directory "succeeds" with every quantized linear
randomly initialised.  Importing this module registers one (``register()``, idempotent) through transformers'
plugin API (``register_quantization_config`` / ``register_quantizer``): before the weights are read, every linear
the checkpoint stores as EXL2 is replaced by an ``Exl2PackedLinear`` whose buffers carry the checkpoint's own names
(``q_weight`` ...), found from the safetensors headers, so transformers' loader fills them; afterwards the packed
modules build their tables.  Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` become a ``FusedLinear`` over the split
parts EXL2 stores.

GPTQ: transformers' own GPTQ quantizer needs optimum / gptqmodel (CUDA-oriented); where neither is installed the
``gptq`` method is served by ``GptqPackedLinear`` the same way (transformers' ``GPTQConfig`` is kept).

ExLlamaV2 models often carry no ``quantization_config``: pass ``quantization_config=Exl2Config()`` to
``from_pretrained``, or use ``exl2fmt.load_model``, which decides from the tensors.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["register", "Exl2Config", "Exl2HfQuantizer", "Exl3Config", "Exl3HfQuantizer", "GptqCpuHfQuantizer"]

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .arch import expected_features
from .layout import Exl2Slot, Exl3Slot, Format, GptqSlot
from .runtime.linear import Exl2PackedLinear, FusedLinear, GptqPackedLinear, PackedLinear, packed_modules
from .runtime.moe import install_packed_experts

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Exl2Config(QuantizationConfigMixin):
    """``quantization_config`` of an EXL2 model (ExLlamaV2's keys kept as given)."""

    def __init__(self, bits: float | None = None, head_bits: int | None = None, **kwargs: Any):
        self.quant_method = "exl2"
        self.bits, self.head_bits = bits, head_bits
        for k, v in kwargs.items():
            if k != "quant_method":
                setattr(self, k, v)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _files_root(checkpoint_files) -> Path | None:
    files = [f for f in (checkpoint_files or []) if f]
    return Path(files[0]).parent if files else None


def _place(model, key: str, module) -> None:
    owner, _, leaf = key.rpartition(".")
    parent = model.get_submodule(owner) if owner else model
    setattr(parent, leaf, module)


def _fuse(model) -> None:
    for _, mod in list(model.named_modules()):
        for fused, parts in _FUSED.items():
            f = getattr(mod, fused, None)
            if isinstance(f, torch.nn.Linear) and all(isinstance(getattr(mod, p, None), PackedLinear) for p in parts):
                setattr(mod, fused, FusedLinear([getattr(mod, p) for p in parts]))


class _PackedQuantizer(HfQuantizer):
    """What the EXL2 and GPTQ quantizers share: swap in packed modules from the headers, prepare after loading."""

    requires_calibration = False
    fmt: Format

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.pre_quantized = True

    def validate_environment(self, *args, **kwargs):
        return

    def _modules(self, mf, config) -> dict[str, PackedLinear]:
        raise NotImplementedError

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from .container import open_model

        root = _files_root(checkpoint_files)
        if root is None:
            raise ValueError(f"exl2fmt's {self.fmt.value} quantizer needs local safetensors checkpoint files")
        with open_model(root) as mf:
            built = self._modules(mf, mf.config)
        in_experts = install_packed_experts(model, built)
        for key, module in built.items():
            if key not in in_experts:
                _place(model, key, module)
        _fuse(model)
        if "lm_head" in built:
            model.config.tie_word_embeddings = False
            if hasattr(model.config, "get_text_config"):
                model.config.get_text_config().tie_word_embeddings = False
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for m in packed_modules(model).values():
            # a module offloaded with its buffers (device_map with offload_buffers=True) holds meta tensors
            # until accelerate's hook brings them in: it builds its tables in its first forward
            if not any(b.device.type == "meta" for b in m.buffers(recurse=False)):
                m.prepare()
            else:
                m.mark_offloaded()
        return model

    def is_serializable(self, **kwargs) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


class Exl2HfQuantizer(_PackedQuantizer):
    """transformers quantizer of the ``exl2`` method: ``Exl2PackedLinear`` for every EXL2 linear."""

    fmt = Format.EXL2

    def _modules(self, mf, config):
        from .groups import decode_q_groups
        from .layout import pad32
        from .model import find_layers

        out = {}
        for key, ref in find_layers(mf.names()).items():
            if ref.format is not Format.EXL2:
                continue
            qw = mf.info(f"{key}.{Exl2Slot.Q_WEIGHT}")
            q_rows, n_pad = (int(s) for s in qw.shape)
            groups = decode_q_groups(mf.get(f"{key}.{Exl2Slot.Q_GROUPS}"), q_rows)
            n = expected_features(config, key)[1]
            n = n if n is not None and pad32(n) == n_pad else n_pad
            inv = mf.info(f"{key}.{Exl2Slot.Q_INVPERM}")
            with torch.device("meta"):
                out[key] = Exl2PackedLinear(groups.K, n, n_pad, groups.G, q_rows, bias="bias" in ref.slots,
                                            invperm_dtype=torch.int16 if inv.dtype == "I16" else torch.int32,
                                            has_perm=Exl2Slot.Q_PERM in ref.slots)
        return out


class GptqCpuHfQuantizer(_PackedQuantizer):
    """``gptq`` served by ``GptqPackedLinear`` (where optimum / gptqmodel are missing)."""

    fmt = Format.GPTQ

    def _modules(self, mf, config):
        from .arch import gptq_config
        from .model import find_layers

        gc = gptq_config(config)
        out = {}
        for key, ref in find_layers(mf.names()).items():
            if ref.format is not Format.GPTQ:
                continue
            qw, qz = mf.info(f"{key}.{GptqSlot.QWEIGHT}").shape, mf.info(f"{key}.{GptqSlot.QZEROS}").shape
            N = int(qw[1])
            bits = gc.bits or int(qz[1]) * 32 // N
            with torch.device("meta"):
                out[key] = GptqPackedLinear(int(qw[0]) * 32 // bits, N, bits, int(qz[0]), bias="bias" in ref.slots,
                                            g_idx=GptqSlot.G_IDX in ref.slots, v2=bool(gc.v2), group_size=gc.group_size)
        return out


class Exl3Config(QuantizationConfigMixin):
    """``quantization_config`` of an EXL3 model (ExLlamaV3's keys kept as given)."""

    def __init__(self, bits: float | None = None, head_bits: int | None = None, **kwargs: Any):
        self.quant_method = "exl3"
        self.bits, self.head_bits = bits, head_bits
        for k, v in kwargs.items():
            if k != "quant_method":
                setattr(self, k, v)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Exl3HfQuantizer(_PackedQuantizer):
    """transformers quantizer of the ``exl3`` method: ``Exl3PackedLinear`` for every EXL3 linear (CPU decode)."""

    fmt = Format.EXL3

    def _modules(self, mf, config):
        from .formats.exl3 import codebook_of_slots, fits_padding, rate_of_last_dim
        from .model import find_layers
        from .runtime.exl3 import Exl3PackedLinear

        out = {}
        for key, ref in find_layers(mf.names()).items():
            if ref.format is not Format.EXL3:
                continue
            tk, tn, last = (int(v) for v in mf.info(f"{key}.{Exl3Slot.TRELLIS}").shape)
            K_p, N_p = 16 * tk, 16 * tn
            hint = expected_features(config, key)
            K = hint[0] if hint[0] is not None and fits_padding(hint[0], K_p) else K_p
            N = hint[1] if hint[1] is not None and fits_padding(hint[1], N_p) else N_p
            rate = rate_of_last_dim(last)
            if rate is None:
                raise ValueError(f"{key}.trellis: last dim {last} is not 16 x an EXL3 rate")
            b = f"{key}.{Exl3Slot.BIAS}"
            with torch.device("meta"):
                out[key] = Exl3PackedLinear(K, N, K_p, N_p, int(2 * rate), codebook=codebook_of_slots(ref.slots),
                                            legacy_signs=Exl3Slot.SUH not in ref.slots,
                                            bias=int(mf.info(b).shape[0]) if b in mf else None)
        return out


def _own_gptq_missing() -> bool:
    return not any(importlib.util.find_spec(m) for m in ("gptqmodel", "optimum"))


_registered = False


def register(gptq: bool | None = None) -> None:
    """Register the ``exl2`` quantization config and quantizer with transformers (idempotent).  ``gptq`` True
    also serves the ``gptq`` method (default: when neither optimum nor gptqmodel is installed)."""
    global _registered
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    if "exl2" not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config("exl2")(Exl2Config)
    if "exl2" not in AUTO_QUANTIZER_MAPPING:
        register_quantizer("exl2")(Exl2HfQuantizer)
    if "exl3" not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config("exl3")(Exl3Config)
    if "exl3" not in AUTO_QUANTIZER_MAPPING:
        register_quantizer("exl3")(Exl3HfQuantizer)
    if gptq if gptq is not None else _own_gptq_missing():
        AUTO_QUANTIZER_MAPPING["gptq"] = GptqCpuHfQuantizer
    _registered = True


if os.environ.get("EXL2FMT_HF_NO_REGISTER", "") in ("", "0"):
    register()
