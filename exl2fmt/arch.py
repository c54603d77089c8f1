"""What ``config.json`` says about a model's linear layers (Llama-family conventions).

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
    """(in_features, out_features) that ``config.json`` implies for the linear layer ``key``; None = unknown."""
    cfg = _text_config(config)
    if not cfg:
        return None, None
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    inter = _int(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if ".shared_expert." in key:  # Qwen-MoE: the shared expert and the routed experts have their own widths
        inter = _int(cfg, "shared_expert_intermediate_size") or inter
    elif ".experts." in key:
        inter = _int(cfg, "moe_intermediate_size") or inter
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim")
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    vocab = _int(cfg, "vocab_size")
    leaf = key.rsplit(".", 1)[-1]
    q_out = heads * head_dim if heads and head_dim else None
    kv_out = kv_heads * head_dim if kv_heads and head_dim else None
    table = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "lm_head": (hidden, vocab),
    }
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
