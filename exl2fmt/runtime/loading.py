"""``load_model`` / ``load_tokenizer``: a model directory as a transformers model, quantized layers kept packed.

EXL2 and GPTQ directories: transformers builds the ``*ForCausalLM`` skeleton for config.json with its parameters
on the meta device (buffers such as RoPE tables are real), every linear the files store quantized is replaced by
a packed module (``runtime.linear``) filled from the files, and every other tensor (embeddings, norms, dense
linears, a 16-bit head) is read by its name in the model's dtype.  Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
over the split q/k/v and gate/up that EXL2 stores become a ``FusedLinear`` of the parts.  A quantized ``lm_head``
(EXL2 ``head_bits``) stays packed and untied.  Dense directories load as plain transformers models.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import ErrorCode, Exl2Error
from ..layout import Format
from .linear import Exl2PackedLinear, FusedLinear, GptqPackedLinear, PackedLinear, packed_modules
from .moe import install_packed_experts, stored_param

__all__ = ["load_model", "load_tokenizer", "model_format", "default_dtype"]

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such model directory", file=str(p))
    return p


def model_format(path: str | os.PathLike) -> Format:
    """The quantized format of a model directory's linears (``exl2``, ``gptq``, ``exl3``) or ``dense``."""
    from ..container import open_model
    from ..model import find_layers

    with open_model(path) as mf:
        fmts = {ref.format for ref in find_layers(mf.names()).values()}
    for f in (Format.EXL2, Format.GPTQ, Format.EXL3, Format.AWQ):
        if f in fmts:
            return f
    return Format.DENSE


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU (its fp16 matmuls are slow; the packed kernels compute in float32 anyway), float16 on an
    accelerator."""
    return torch.float32 if device.type == "cpu" else torch.float16


def load_tokenizer(path: str | os.PathLike, **kw: Any):
    """The model directory's tokenizer (``transformers.AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), **kw)


def load_model(path: str | os.PathLike, device: "str | torch.device | None" = None,
               dtype: "torch.dtype | str | None" = None, *, device_map: "str | dict | None" = None,
               max_memory: dict | None = None, offload_folder: "str | os.PathLike | None" = None):
    """A ``*ForCausalLM`` for the model directory ``path``, in eval mode on ``device``.

    ``device`` None: CUDA when torch sees one, else the CPU.  ``dtype`` None: ``default_dtype(device)``; the
    activations and every unquantized tensor use it.  EXL2, GPTQ and EXL3 linears stay packed (``PackedLinear``;
    MoE experts in a ``PackedExperts``); ``model.exl2fmt_format`` names the format.

    ``device_map`` (instead of ``device``): ``"auto"`` / ``"balanced"`` / ``"sequential"``, a dict module ->
    device or ``"disk"``, or one device; ``max_memory`` device -> bytes bounds it, ``offload_folder`` receives
    the tensors of modules placed on ``"disk"`` (``runtime.placement``; dtype None then means float16 when the
    map uses an accelerator, else float32).

    Raises ``Exl2Error``: an unreadable directory, ``ARCH_UNSUPPORTED`` for an architecture transformers does
    not know, ``FORMAT_UNSUPPORTED`` for AWQ, ``PLACEMENT_INFEASIBLE`` for a device_map this machine cannot
    honour.
    """
    if device_map is not None:
        from .placement import AUTO_MAPS

        accel = torch.cuda.is_available() and (
            str(device_map) in AUTO_MAPS or any(str(v) not in ("cpu", "disk") for v in (
                device_map.values() if isinstance(device_map, dict) else [device_map])))
        dev = torch.device("cuda" if accel else "cpu")
    else:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dt = dtype or default_dtype(dev)
    root = _resolve(path)
    fmt = model_format(root)
    if fmt is Format.DENSE:
        from transformers import AutoModelForCausalLM

        if device_map is not None:
            model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dt, device_map=device_map,
                                                         max_memory=max_memory, offload_folder=offload_folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dt)
            model.to(dev)
        model.eval()
        model.exl2fmt_format = "dense"
        return model
    if fmt not in PACKED_FORMATS:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"the runtime runs EXL2, GPTQ, EXL3 and dense models, not "
                        f"{fmt.value}", file=str(root))
    model = _load_packed(root, dt)
    if device_map is not None:
        from .placement import place_model

        place_model(model, device_map, max_memory=max_memory, offload_folder=offload_folder)
    else:
        model.to(dev)
    model.eval()
    model.exl2fmt_format = fmt.value
    return model


def _skeleton(root: Path, config: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..runner.hooks import params_on_meta

    d = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map", "model_type")}
    mtype = config.get("model_type")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(mtype, **d)
    except (ValueError, TypeError, KeyError) as e:
        raise Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"transformers cannot build model type {mtype!r}: {e}",
                        file="config.json") from None
    with params_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(root))
    except (OSError, ValueError):
        pass
    return model


#: the formats the runtime keeps packed
PACKED_FORMATS = (Format.EXL2, Format.GPTQ, Format.EXL3)


def _packed_of(layer: Any) -> PackedLinear:
    if layer.format is Format.EXL2:
        return Exl2PackedLinear.from_layer(layer)
    if layer.format is Format.EXL3:
        from .exl3 import Exl3PackedLinear

        return Exl3PackedLinear.from_layer(layer)
    return GptqPackedLinear.from_layer(layer)


def _set_module(model: nn.Module, key: str, module: nn.Module) -> bool:
    """Put ``module`` at ``key``; False when the parent does not exist."""
    owner, _, leaf = key.rpartition(".")
    try:
        parent = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    setattr(parent, leaf, module)
    return True


def _load_packed(root: Path, dtype: torch.dtype):
    from ..container import open_model
    from ..model import find_layers, load_layer
    from ..runner.weights import WeightSource

    mf = open_model(root)
    try:
        config = mf.config
        if not isinstance(config, dict):
            raise Exl2Error(ErrorCode.CONFIG_MISSING, "the runtime needs config.json", file=str(root))
        model = _skeleton(root, config, dtype)
        refs = find_layers(mf.names())
        names = set(mf.names())
        placed: set[str] = set()
        built = {key: _packed_of(load_layer(mf, key)) for key, ref in refs.items() if ref.format in PACKED_FORMATS}
        in_experts = install_packed_experts(model, built)
        for key, lin in built.items():
            if key in in_experts:
                continue
            ref = refs[key]
            if not _set_module(model, key, lin):
                raise Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"the {type(model).__name__} skeleton has no place for "
                                f"the stored linear {key}", tensor=key, file=str(root))
            placed.update(f"{key}.{s}" for s in ref.slots)
        _fuse(model)
        src = WeightSource(mf)
        missing = []
        # remove_duplicate=False: a head the skeleton tied to the embeddings is listed (and tied again below)
        for name, p in list(model.named_parameters(remove_duplicate=False)):
            if p.device.type != "meta":
                continue
            t = stored_param(name, names, lambda n: src.get(n, dtype=dtype))
            if t is not None:
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                missing.append(name)
        head = model.get_output_embeddings()
        tied = "lm_head.weight" in missing and not isinstance(head, PackedLinear)
        if tied:
            model.config.tie_word_embeddings = True
            head.weight = model.get_input_embeddings().weight
            missing.remove("lm_head.weight")
        elif isinstance(head, PackedLinear):
            model.config.tie_word_embeddings = False
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = [n for n in missing if params.get(n) is not None and params[n].device.type == "meta"]
        if missing:
            raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, f"{len(missing)} tensors of the model are not in the files "
                            f"(first: {missing[0]})", tensor=missing[0], file=str(root))
        for m in packed_modules(model).values():
            m.prepare()
        model.exl2fmt_quantization = config.get("quantization_config")
        return model
    finally:
        mf.close()


def _fuse(model: nn.Module) -> None:
    """Phi-3's fused projections over the split linears EXL2 stores: ``qkv_proj`` = cat(q, k, v) and
    ``gate_up_proj`` = cat(gate, up), where the parts were placed next to a still unloaded fused module."""
    for _, mod in list(model.named_modules()):
        for fused, parts in _FUSED.items():
            f = getattr(mod, fused, None)
            if isinstance(f, nn.Linear) and all(isinstance(getattr(mod, p, None), PackedLinear) for p in parts):
                setattr(mod, fused, FusedLinear([getattr(mod, p) for p in parts]))
