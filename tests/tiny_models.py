"""Tiny random decoder models per architecture, made with transformers' own config classes (no hub).

``make_tiny(arch, directory)`` saves a seeded random fp16 model (2 layers, hidden 64) with ``save_pretrained`` and
returns the directory; ``ARCHS`` lists the architectures and the config overrides that exercise what is special
about each (sliding windows, Gemma 2's soft-capping and extra norms, Granite's multipliers, Cohere's parallel
block, Starcoder2's biased non-gated MLP).  Shared by the quantizer's and the validator's tests.
"""

from __future__ import annotations

from pathlib import Path

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=160, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)

#: model_type -> (config class name in transformers, overrides of BASE)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 16, "final_logit_softcapping": 5.0,
                                "attn_logit_softcapping": 20.0}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0,
                                  "attention_multiplier": 0.2}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": 8}),
    "phi3": ("Phi3Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "decoder_sparse_step": 1}),
    # Qwen2-MoE: a shared expert (a dense MLP of all tokens, scaled by its 16-bit sigmoid gate) beside the experts
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1}),
    # decoder-only architectures outside ExLlamaV2's list, calibrated with a warning (Olmo2: post-norms only)
    "olmo2": ("Olmo2Config", {}),
    "stablelm": ("StableLmConfig", {}),
}

#: architectures ExLlamaV2 does not load whose layers the engine drives all the same
OTHER = ("olmo2", "stablelm")

#: the architectures the calibrated quantizer handles today (dense decoder layers of nn.Linear; Phi-3 fused)
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "cohere", "granite", "starcoder2", "phi3")

#: mixture-of-experts architectures (transformers' fused 3-D experts; per-expert tensors in the checkpoint)
MOE = ("mixtral", "qwen3_moe")

#: MoE models with what else a MoE model holds: Qwen2-MoE's shared expert, dense MLP layers among the MoE ones
#: (``mlp_only_layers``); ``make_tiny(MOE_EXTRA[name][0], d, **MOE_EXTRA[name][1])``
MOE_EXTRA = {"qwen2_moe": ("qwen2_moe", {}),
             "qwen3_moe_mlp_only": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
             "qwen2_moe_mlp_only": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]})}


def width_dims(arch: str, hidden: int, vocab_size: int = 512) -> dict:
    """Overrides of ``BASE`` for a tiny ``arch`` model ``hidden`` wide, valid for every architecture of ``ARCHS``.

    ``hidden`` must be a positive multiple of 128, so that a 128-row group tiles every linear's input exactly.
    Attention: ``max(4, hidden // 64)`` heads of ``hidden / heads`` features (head_dim x heads = hidden, which the
    architectures that derive head_dim from hidden (Phi-3, Cohere, StarCoder2) require), half as many K/V heads.
    Dense MLP width ``2 x hidden``; a MoE model has 4 experts of width ``hidden`` (Qwen2-MoE's shared expert
    ``2 x hidden``).  At 128 these are the dims of the 2026-12-02 per-architecture tables (bench/arch_quality.py):
    4 heads of 32, 2 K/V heads, MLP 256, experts 128."""
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden must be a positive multiple of 128, got {hidden}")
    heads = max(4, hidden // 64)
    d = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
             num_key_value_heads=heads // 2, head_dim=hidden // heads, vocab_size=vocab_size)
    if arch == "mixtral":
        d["intermediate_size"] = hidden
    elif arch in ("qwen3_moe", "qwen2_moe"):
        d["moe_intermediate_size"] = hidden
        if arch == "qwen2_moe":
            d["shared_expert_intermediate_size"] = 2 * hidden
    return d


def make_config(arch: str, **overrides):
    import transformers

    cls_name, extra = ARCHS[arch]
    return getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})


def make_tiny(arch: str, directory: "str | Path", seed: int = 0, std: float = 0.05, starved_expert: int | None = None,
              **overrides) -> Path:
    """Save a seeded random fp16 ``arch`` model in ``directory`` (created) and return it.  Weights are drawn
    N(0, std) (norm weights around their neutral value), so activations are not vanishingly small.

    ``starved_expert`` (MoE models): no token is routed to this expert.  Every embedding gets a large constant
    in feature 0, which the small random layers leave nearly unchanged, so every router input has a large
    positive feature 0; the expert's router row gets a large negative weight there, so its logit is far below
    every other expert's for any token."""
    import torch
    import transformers

    cfg = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                neutral = 0.0 if arch.startswith("gemma") or name.endswith("bias") else 1.0
                p.copy_(neutral + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        if starved_expert is not None:
            model.get_input_embeddings().weight[:, 0] = 4.0
            for layer in model.model.layers:
                layer.mlp.gate.weight[starved_expert, 0] = -4.0
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(d)
    return d


def exl2_rtn_copy(src_dir, out, seed=0):
    """Returns the quantized layer keys.  An EXL2 model of a dense tiny model: every decoder linear (Phi-3's fused qkv/gate_up split into q/k/v and
    gate/up, as ExLlamaV2 stores them) and an untied head quantized round-to-nearest 4-bit g32 in a random
    act-order permutation; everything else as stored."""
    import json

    import numpy as np

    from exl2fmt.container import open_model, write_sharded
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.layout import Tier

    src_dir, out = Path(src_dir), Path(out)
    cfg = json.loads((src_dir / "config.json").read_text())
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    k = cfg["num_key_value_heads"] * cfg["head_dim"]
    m = open_model(src_dir)
    dense = {n: np.array(m.get(n)) for n in m.names()}
    m.close()
    rng = np.random.default_rng(seed)
    out_t, linears = {}, {}
    for name, arr in dense.items():
        key = name[:-len(".weight")]
        if name.endswith("qkv_proj.weight"):
            base = key[:-len("qkv_proj")]
            linears.update({base + "q_proj": arr[:q], base + "k_proj": arr[q:q + k], base + "v_proj": arr[q + k:]})
        elif name.endswith("gate_up_proj.weight"):
            base, half = key[:-len("gate_up_proj")], arr.shape[0] // 2
            linears.update({base + "gate_proj": arr[:half], base + "up_proj": arr[half:]})
        elif name.endswith("_proj.weight") or name == "lm_head.weight":
            linears[key] = arr
        else:
            out_t[name] = arr
    for key, w in linears.items():
        perm = rng.permutation(w.shape[1])
        for slot, arr in quantize_rtn(w, [Tier(1.0, 4, 32)], perm).items():
            out_t[f"{key}.{slot}"] = arr
    out.mkdir()
    write_sharded(out, out_t, max_shard_bytes=1 << 40, prefix="output", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return sorted(linears)
