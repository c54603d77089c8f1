"""What ``config.json`` says about a model's linear layers (per architecture: dense, MoE, fused projections).

Only the few facts the core needs: the true out_features of a layer (EXL2 stores N padded to 32, and the
padding must be dropped on dequantization, notably for ``lm_head`` whose N is ``vocab_size``), and the
GPTQ settings in ``quantization_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["expected_features", "GptqConfig", "gptq_config"]


def _int(cfg: dict, *names) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
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


def expected_features(config: dict | None, key: str) -> tuple[int | None, int | None]:
    """(in_features, out_features) that ``config.json`` implies for the linear layer ``key``; None = unknown.

    The MLP width depends on where the layer sits: routed experts (``...experts.{e}.``) use
    ``moe_intermediate_size`` where the config has one (Qwen2/3-MoE, DeepSeek; Mixtral's experts use
    ``intermediate_size``), a shared expert (``...shared_expert.``) ``shared_expert_intermediate_size`` (Qwen2-MoE),
    shared experts (``...shared_experts.``) ``moe_intermediate_size x n_shared_experts`` (DeepSeek).  Fused
    projections: Phi-3's ``qkv_proj`` (q + 2 kv heads) and ``gate_up_proj`` (2 x intermediate); Mixtral's expert
    ``w1``/``w3``/``w2``; Starcoder2's MLP ``c_fc``/``c_proj``.  Attention with low-rank q/kv (``kv_lora_rank``,
    DeepSeek MLA) is not checked.
    """
    cfg = _text_config(config)
    if not cfg:
        return None, None
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    inter = _int(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if ".experts." in key:
        inter = _int(cfg, "moe_intermediate_size") or inter
    elif ".shared_expert." in key:
        inter = _int(cfg, "shared_expert_intermediate_size") or inter
    elif ".shared_experts." in key:
        moe, n_shared = _int(cfg, "moe_intermediate_size"), _int(cfg, "n_shared_experts")
        inter = moe * n_shared if moe and n_shared else None
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim")
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    vocab = _int(cfg, "vocab_size")
    leaf = key.rsplit(".", 1)[-1]
    q_out = heads * head_dim if heads and head_dim else None
    kv_out = kv_heads * head_dim if kv_heads and head_dim else None
    if cfg.get("kv_lora_rank") is not None or cfg.get("q_lora_rank") is not None:
        q_out = kv_out = None                     # multi-head latent attention: other shapes
    table = {
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
    if ".experts." in key:
        table.update({"w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)})
    if ".mlp." in key:
        table.update({"c_fc": (hidden, inter), "c_proj": (inter, hidden)})
    return table.get(leaf, (None, None))


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
    bits = qc.get("bits") if isinstance(qc.get("bits"), int) else None
    gs = qc.get("group_size") if isinstance(qc.get("group_size"), int) else None
    meta = qc.get("meta") if isinstance(qc.get("meta"), dict) else {}
    quantizer = meta.get("quantizer")
    if isinstance(quantizer, list):
        quantizer = ",".join(str(q) for q in quantizer)
    return GptqConfig(bits=bits, group_size=gs, sym=qc.get("sym") if isinstance(qc.get("sym"), bool) else None,
                      desc_act=qc.get("desc_act") if isinstance(qc.get("desc_act"), bool) else None,
                      v2=(fmt == "gptq_v2"), quantizer=quantizer if isinstance(quantizer, str) else None)
