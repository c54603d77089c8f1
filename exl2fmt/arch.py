"""What ``config.json`` says about a model's linear layers (per architecture: dense, MoE, fused projections).

Only the few facts the core needs: the true out_features of a layer (EXL2 stores N padded to 32, and the
padding must be dropped on dequantization, notably for ``lm_head`` whose N is ``vocab_size``), and the
GPTQ settings in ``quantization_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config_values import sane_int

__all__ = ["ties_head", "expected_features", "features_of", "GptqConfig", "gptq_config", "EXLLAMAV2_VERSION", "exl2_quantization_config",
           "GPTQMODEL_V1_ZEROS", "AUTOGPTQ_KEYS", "gptq_quantization_config", "autogptq_quantize_config"]

#: The ExLlamaV2 release whose EXL2 layout, candidate tables and ``quantization_config`` keys exl2fmt follows.
#: ExLlamaV2 writes its own version number as ``quantization_config.version``; exl2fmt writes this one there
#: (the keys ExLlamaV2 writes keep ExLlamaV2's meaning) and names itself under ``producer``.
EXLLAMAV2_VERSION = "0.3.2"


def ties_head(config) -> bool:
    """config.json (a dict) ties the LM head to the input embedding: ``tie_word_embeddings`` true at the top level
    or in a multimodal model's ``text_config``.  Such a model may store no ``lm_head`` at all (the embedding
    serves; ExLlamaV2 0.3.2 maps ``lm_head`` to ``model.embed_tokens`` then)."""
    cfg = config if isinstance(config, dict) else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return cfg.get("tie_word_embeddings") is True or text.get("tie_word_embeddings") is True


def exl2_quantization_config(bits: float, head_bits: int | None, calibration: dict | None, producer_version: str,
                             **ours) -> dict:
    """``config.json`` ``quantization_config`` of an EXL2 model: ExLlamaV2's keys with ExLlamaV2's meaning
    (``quant_method``, ``version`` = ``EXLLAMAV2_VERSION``, ``bits``, ``head_bits``, ``calibration`` {rows,
    length, dataset}), then exl2fmt's own under separate keys: ``producer`` {name, version} and ``ours``."""
    qc = {"quant_method": "exl2", "version": EXLLAMAV2_VERSION, "bits": bits, "head_bits": head_bits,
          "calibration": calibration, "producer": {"name": "exl2fmt", "version": producer_version}}
    qc.update(ours)
    return qc


def _int(cfg: dict, *names) -> int | None:
    """The first of ``names`` that holds a sane size (1..2**31-1, see ``config_values``); None = unknown."""
    for n in names:
        v = sane_int(cfg.get(n))
        if v is not None:
            return v
    return None


def _text_config(config: dict | None) -> dict:
    if not isinstance(config, dict):
        return {}
    tc = config.get("text_config")
    if isinstance(tc, dict):
        merged = dict(config)
        merged.update(tc)
        return merged
    return config


#: Fused projections by ``model_type``: the fused module transformers builds -> its parts in output-row order.
#: EXL2 stores these split (ExLlamaV2's convention; the quantizer splits them too), so a dense model written from
#: an EXL2 source fuses them back for transformers to load it.
FUSED_PROJECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
}


def fused_projections(config: dict | None) -> dict[str, tuple[str, ...]]:
    """{fused leaf name: part leaf names} that transformers expects fused for this ``config.json`` ({} if none)."""
    return FUSED_PROJECTIONS.get(str(_text_config(config).get("model_type", "")), {})


def expected_features(config: dict | None, key: str) -> tuple[int | None, int | None]:
    """(in_features, out_features) that ``config.json`` implies for the linear layer ``key``; None = unknown.

    The MLP width depends on where the layer sits: routed experts (``...experts.{e}.``) use
    ``moe_intermediate_size`` where the config has one (Qwen2/3-MoE, DeepSeek; Mixtral's experts use
    ``intermediate_size``), a shared expert (``...shared_expert.``) ``shared_expert_intermediate_size`` (Qwen2-MoE),
    shared experts (``...shared_experts.``) ``moe_intermediate_size x n_shared_experts`` (DeepSeek).  Fused
    projections: Phi-3's ``qkv_proj`` (q + 2 kv heads) and ``gate_up_proj`` (2 x intermediate); Mixtral's expert
    ``w1``/``w3``/``w2``; Starcoder2's MLP ``c_fc``/``c_proj``.  Attention with low-rank q/kv (``kv_lora_rank``,
    DeepSeek MLA) is not checked.  Multi-token-prediction layers (``names.is_mtp``) have the text sizes, and their
    ``eh_proj`` / ``fc`` join two hidden states (2 x hidden -> hidden).  A vision tower or projector
    (``names.is_vision``) takes its sizes from ``vision_config`` (hidden_size, intermediate_size, heads;
    SigLIP's ``fc1``/``fc2``/``out_proj`` too), never from the text model's: unknown without one.
    ``features_of(config)`` answers the same for many keys of one config.
    """
    return features_of(config)(key)


def features_of(config: dict | None) -> Callable[[str], tuple[int | None, int | None]]:
    """``key -> expected_features(config, key)``, reading ``config`` once (inspect asks for every layer of a
    model): the sizes are taken from the config here, each key then costs a few substring tests and a table
    lookup.  The config must not change while the function is in use."""
    from .names import is_mtp, is_vision

    cfg = _text_config(config)
    if not cfg:
        return lambda key: (None, None)
    text = _features_of_config(cfg)
    vcfg = config.get("vision_config") if isinstance(config, dict) else None
    vision = _features_of_config(vcfg, vision=True) if isinstance(vcfg, dict) else (lambda key: (None, None))
    nl, nextn = _int(cfg, "num_hidden_layers"), _int(cfg, "num_nextn_predict_layers")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    join = (2 * hidden if hidden else None, hidden)

    def features(key: str) -> tuple[int | None, int | None]:
        if is_vision(key):
            return vision(key)
        if key.rsplit(".", 1)[-1] in ("eh_proj", "fc") and is_mtp(key, nl, nextn):
            return join
        return text(key)

    return features


def _features_of_config(cfg: dict, vision: bool = False) -> Callable[[str], tuple[int | None, int | None]]:
    """``features_of`` for one (text or vision) config dict."""
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    inter_dense = _int(cfg, "intermediate_size", "n_inner", "ffn_dim")
    heads = _int(cfg, "num_attention_heads", "n_head", *(("num_heads",) if vision else ()))
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim")
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    vocab = _int(cfg, "vocab_size")
    q_out = heads * head_dim if heads and head_dim else None
    kv_out = kv_heads * head_dim if kv_heads and head_dim else None
    if cfg.get("kv_lora_rank") is not None or cfg.get("q_lora_rank") is not None:
        q_out = kv_out = None                     # multi-head latent attention: other shapes
    moe = _int(cfg, "moe_intermediate_size")
    n_shared = _int(cfg, "n_shared_experts")
    inter_of = {"experts": moe or inter_dense,
                "shared_expert": _int(cfg, "shared_expert_intermediate_size") or inter_dense,
                "shared_experts": moe * n_shared if moe and n_shared else None,
                None: inter_dense}
    tables: dict[tuple, dict] = {}

    def table(where: str | None, mlp: bool) -> dict:
        inter = inter_of[where]
        t = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "qkv_proj": (hidden, q_out + 2 * kv_out if q_out and kv_out else None),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
            "gate_up_proj": (hidden, 2 * inter if inter else None),
            "lm_head": (hidden, vocab),
        }
        if where == "experts":
            t.update({"w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)})
        if mlp:
            t.update({"c_fc": (hidden, inter), "c_proj": (inter, hidden)})
        if vision:  # SigLIP / CLIP encoder layers; the text head is not a vision layer
            t.update({"fc1": (hidden, inter), "fc2": (inter, hidden), "out_proj": (q_out, hidden)})
            t.pop("lm_head")
        return t

    def features(key: str) -> tuple[int | None, int | None]:
        where = ("experts" if ".experts." in key else "shared_expert" if ".shared_expert." in key
                 else "shared_experts" if ".shared_experts." in key else None)
        tk = (where, ".mlp." in key)
        t = tables.get(tk)
        if t is None:
            t = tables[tk] = table(*tk)
        return t.get(key.rsplit(".", 1)[-1], (None, None))

    return features


@dataclass(frozen=True)
class GptqConfig:
    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    v2: bool
    quantizer: str | None


def gptq_config(config: dict | None) -> GptqConfig:
    """The GPTQ settings of ``config.json`` ``quantization_config`` (all None when absent)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return GptqConfig(None, None, None, None, False, None)
    fmt = qc.get("checkpoint_format", qc.get("format"))
    bits = sane_int(qc.get("bits"), 1, 64)
    gs = qc.get("group_size")
    gs = -1 if gs == -1 and sane_int(gs, -1, -1) is not None else sane_int(gs)  # else unknown: never divided by
    meta = qc.get("meta") if isinstance(qc.get("meta"), dict) else {}
    quantizer = meta.get("quantizer")
    if isinstance(quantizer, list):
        quantizer = ",".join(str(q) for q in quantizer)
    return GptqConfig(bits=bits, group_size=gs, sym=qc.get("sym") if isinstance(qc.get("sym"), bool) else None,
                      desc_act=qc.get("desc_act") if isinstance(qc.get("desc_act"), bool) else None,
                      v2=(fmt == "gptq_v2"), quantizer=quantizer if isinstance(quantizer, str) else None)


# ------------------------------------------------------------------------------------------------ GPTQ metadata

#: GPTQModel's loader refuses an asymmetric checkpoint in the v1 (``"gptq"``) format unless ``meta.quantizer``
#: names ``gptqmodel`` at this version or later: from it on GPTQModel writes v1 zero points the standard way
#: (stored = zero point - 1, never negative), which is what exl2fmt writes.  exl2fmt lists it after itself, as
#: the convention the file follows (GPTQModel lists a second quantizer the same way).
GPTQMODEL_V1_ZEROS = "gptqmodel:0.9.0"

#: Every key of AutoGPTQ 0.7's ``BaseQuantizeConfig`` that a file carries; it warns about any other key of
#: ``quantize_config.json`` (``is_marlin_format`` and ``awq_gemm_checkpoint`` are left out: GPTQModel refuses
#: the first and the second describes AWQ).
AUTOGPTQ_KEYS = ("bits", "group_size", "damp_percent", "desc_act", "static_groups", "sym", "true_sequential",
                 "model_name_or_path", "model_file_base_name")


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool, producer_version: str, *,
                             act_group_aware: bool = False, damp_percent: float = 0.01, true_sequential: bool = True,
                             **meta) -> dict:
    """``config.json`` ``quantization_config`` of a GPTQ (v1) model, with the keys GPTQModel 7.x writes:
    ``bits``, ``group_size``, ``desc_act``, ``sym``, ``lm_head``, ``method`` and ``quant_method``, ``format`` and
    ``checkpoint_format`` (both ``"gptq"``), ``pack_dtype`` (``"int32"``), and under ``meta`` the settings that
    do not change inference: ``quantizer`` (``exl2fmt:<version>`` and ``GPTQMODEL_V1_ZEROS``),
    ``damp_percent``, ``static_groups``, ``true_sequential``, ``act_group_aware``, plus ``meta`` extras.
    ``desc_act`` True means a non-monotone ``g_idx`` (act-order); group-aware reordering keeps ``g_idx`` =
    ``k // group_size`` and writes ``desc_act`` False, as GPTQModel does."""
    return {"bits": int(bits), "group_size": int(group_size), "desc_act": bool(desc_act), "sym": bool(sym),
            "lm_head": False, "method": "gptq", "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq",
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"exl2fmt:{producer_version}", GPTQMODEL_V1_ZEROS], "damp_percent": damp_percent,
                     "static_groups": False, "true_sequential": bool(true_sequential),
                     "act_group_aware": bool(act_group_aware), **meta}}


def autogptq_quantize_config(qc: dict) -> dict:
    """``quantize_config.json`` for ``qc`` (``gptq_quantization_config``).  AutoGPTQ and GPTQModel both read
    this file before ``config.json``, so it holds AutoGPTQ's own keys (``AUTOGPTQ_KEYS``: AutoGPTQ reads it
    without a warning; GPTQModel infers ``format``/``method`` gptq and ``pack_dtype`` int32 from their absence),
    and ``meta`` only for an asymmetric model, which GPTQModel refuses to load without ``meta.quantizer``
    (AutoGPTQ then notes that it ignores that one key)."""
    meta = qc.get("meta") or {}
    out = {"bits": qc["bits"], "group_size": qc["group_size"], "damp_percent": meta.get("damp_percent", 0.01),
           "desc_act": qc["desc_act"], "static_groups": meta.get("static_groups", False), "sym": qc["sym"],
           "true_sequential": meta.get("true_sequential", True), "model_name_or_path": None,
           "model_file_base_name": "model"}
    if not qc["sym"]:
        out["meta"] = {"quantizer": list(meta.get("quantizer", []))}
    return out
