"""One small table per architecture: what the GGUF bridge does differently for each model family.

Everything an architecture changes is a field of its ``ArchSpec`` below, and each spec cites the llama.cpp
converter class (``convert_hf_to_gguf.py`` / ``conversion/*.py`` at the commit in spec/vectors/gguf/README.md)
whose output it matches byte for byte (goldens in spec/vectors/gguf/, checked by tests/test_gguf_arch.py).
Tensor names come from the ``gguf`` package's tables (``gguf_map``), metadata keys from its ``GGUFWriter``
methods / ``Keys`` constants; nothing here spells a GGUF key by hand except through those.

The hyper-parameters every architecture shares are written by ``write_common_hparams`` (the generic text-model
block of llama.cpp's converter: the first of several config keys that is present, e.g. ``max_position_embeddings``
then ``n_positions``; rope base and linear/yarn scaling from ``rope_parameters`` / ``rope_scaling`` /
``rope_theta``; ``key_length``/``value_length`` when the config has ``head_dim``).  A spec's ``hparams`` adds what
its family needs on top.

Fields:

* ``gguf_arch``    the ``general.architecture`` string (a ``gguf.MODEL_ARCH_NAMES`` value).
* ``hf_class``     the Hugging Face class written back by GGUF -> HF (``config.json`` ``architectures``).
* ``permute_qk``   Q/K rows go from rotate-half to interleaved pairs (``gguf_map.permute_qk``): only the
                   families llama.cpp runs with its NORM rope and whose converter permutes (Llama, Mistral,
                   Granite); NEOX-rope families keep Hugging Face's order.
* ``norm_offset``  added to every ``*norm.weight`` on the way to GGUF (Gemma stores ``w`` and multiplies by
                   ``1 + w``; llama.cpp stores ``1 + w``) and subtracted on the way back.
* ``skip``         Hugging Face tensors llama.cpp does not write (Gemma's ``lm_head`` is the tied embedding).
* ``hparams``      ``(config, writer) -> None``: the family's own metadata.
* ``config_back``  ``(get, cfg) -> None``: the family's own ``config.json`` keys rebuilt from GGUF metadata
                   (``get(key_suffix)`` reads ``{arch}.{key_suffix}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ArchSpec", "SPECS", "spec_for_model_type", "spec_for_gguf_arch", "write_common_hparams",
           "find_hparam", "phi3_rope_factors", "ROPE_FACTOR_TENSORS", "phi3_longrope_back"]


def find_hparam(cfg: dict, keys, default=None):
    """The value of the first key of ``keys`` present (not None) in ``cfg``."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def rope_params(cfg: dict) -> dict:
    """Rope settings in transformers 5's ``rope_parameters`` shape, whichever way the config spells them."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp = dict(rp.get("full_attention", rp))
    if "rope_theta" not in rp and find_hparam(cfg, ("rope_theta", "rotary_emb_base")) is not None:
        rp["rope_theta"] = find_hparam(cfg, ("rope_theta", "rotary_emb_base"))
    if "rope_type" not in rp and rp.get("type") is not None:
        rp["rope_type"] = rp["type"]
    return rp


def write_common_hparams(cfg: dict, w, n_layer: int, warnings: list[str], *, head_dim_keys: bool = True) -> None:
    """The metadata llama.cpp's generic text-model converter writes for every architecture (see module doc)."""
    import gguf

    w.add_block_count(n_layer)
    for keys, add in (
        (("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
          "model_max_length"), w.add_context_length),
        (("hidden_size", "n_embd", "dim"), w.add_embedding_length),
        (("intermediate_size", "n_inner", "hidden_dim"), w.add_feed_forward_length),
        (("num_attention_heads", "n_head", "n_heads"), w.add_head_count),
        (("num_key_value_heads", "n_kv_heads"), w.add_head_count_kv),
    ):
        v = find_hparam(cfg, keys)
        if v is not None:
            add(v)
    rp = rope_params(cfg)
    kind, factor = rp.get("rope_type"), rp.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        for k, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                       ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                       ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rp.get(k) is not None:
                add(rp[k])
        af = rp.get("attention_factor", rp.get("attn_factor"))
        if af is not None:
            w.add_rope_scaling_yarn_attn_factor(af)
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif kind not in (None, "default"):
        warnings.append(f"rope type {kind!r} is not written to GGUF; long-context behaviour will differ")
    if rp.get("rope_theta") is not None:
        w.add_rope_freq_base(rp["rope_theta"])
    swa = dict((cfg.get("rope_parameters") or {}).get("sliding_attention") or {})
    local = swa.get("rope_theta", find_hparam(cfg, ("local_rope_theta", "rope_local_theta", "rope_theta_local",
                                                    "swa_rope_theta", "rope_local_base_freq")))
    if local is not None:
        w.add_rope_freq_base_swa(local)
    for keys, add in ((("rms_norm_eps", "norm_eps"), w.add_layer_norm_rms_eps),
                      (("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"), w.add_layer_norm_eps),
                      (("num_local_experts", "num_experts", "n_routed_experts"), w.add_expert_count),
                      (("num_experts_per_tok", "num_experts_per_token", "top_k_experts"), w.add_expert_used_count)):
        v = find_hparam(cfg, keys)
        if v is not None:
            add(v)
    if head_dim_keys and cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _llama_hparams(cfg: dict, w) -> None:
    # conversion/llama.py LlamaModel.set_gguf_parameters: vocab_size and rope.dimension_count (head_dim or
    # hidden / heads) on top of the generic block.
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(_head_dim(cfg))


def _granite_hparams(cfg: dict, w) -> None:
    # conversion/granite.py GraniteModel: the llama block, head_dim ignored, the four multipliers as scales.
    _llama_hparams({k: v for k, v in cfg.items() if k != "head_dim"}, w)
    for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if cfg.get(key):
            add(cfg[key])


def _granite_back(get, cfg: dict) -> None:
    for key, suffix in (("attention_multiplier", "attention.scale"), ("embedding_multiplier", "embedding_scale"),
                        ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
        v = get(suffix)
        if isinstance(v, (int, float)):
            cfg[key] = float(v)


def _llama_back(get, cfg: dict) -> None:
    cfg["attention_bias"] = cfg.pop("_has_q_bias", False)
    cfg["mlp_bias"] = False


def _gemma_hparams(cfg: dict, w) -> None:
    # conversion/gemma.py GemmaModel.set_gguf_parameters: its own short list (no rope base, no vocab size)
    # replaces the generic block; see ArchSpec.common = False.
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])


def _gemma_tokenizer(w, src_dir) -> None:
    # conversion/gemma.py GemmaModel.set_vocab: SentencePiece, then add_space_prefix = False.
    w.add_add_space_prefix(False)


def _llama_tokenizer(w, src_dir) -> None:
    # conversion/llama.py LlamaModel.set_vocab: tokenizer_config.json's add_prefix_space, when present.
    from pathlib import Path

    p = Path(src_dir) / "tokenizer_config.json" if src_dir is not None else None
    if p is not None and p.is_file():
        from exl2fmt.container import jsonload
        from exl2fmt.errors import Exl2Error

        try:  # the guarded loader: caps, and every parser error (deep nesting, 5000-digit ints) an Exl2Error
            v = jsonload.load_json(p, jsonload.TOKENIZER_CONFIG).get("add_prefix_space")
        except (Exl2Error, AttributeError):
            return
        if isinstance(v, bool):
            w.add_add_space_prefix(v)


def _gemma2_hparams(cfg: dict, w) -> None:
    # conversion/gemma.py Gemma2Model.set_gguf_parameters: Gemma's list plus both softcaps and the window.
    _gemma_hparams(cfg, w)
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])


def _gemma3_hparams(cfg: dict, w) -> None:
    # conversion/gemma.py Gemma3Model.set_gguf_parameters: the generic block, then its own defaults on top.
    w.add_context_length(cfg.get("max_position_embeddings", 131072))
    w.add_head_count(cfg.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_key_length(cfg.get("head_dim", 256))
    w.add_value_length(cfg.get("head_dim", 256))
    w.add_rope_freq_base(rope_params(cfg).get("rope_theta", 1_000_000.0))
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg["sliding_window"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", 4))


def _gemma2_back(get, cfg: dict) -> None:
    _gemma_back(get, cfg)
    for key, suffix in (("attn_logit_softcapping", "attn_logit_softcapping"),
                        ("final_logit_softcapping", "final_logit_softcapping")):
        v = get(suffix)
        cfg[key] = float(v) if isinstance(v, (int, float)) else None
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # llama.cpp scales by 1/sqrt(head_dim) for Gemma 2


def _gemma3_back(get, cfg: dict) -> None:
    _gemma_back(get, cfg)
    v = get("final_logit_softcapping")
    cfg["final_logit_softcapping"] = float(v) if isinstance(v, (int, float)) else None
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    swa = get("rope.freq_base_swa")
    if isinstance(swa, (int, float)):
        cfg["rope_local_base_freq"] = float(swa)


def _qwen_moe_hparams(cfg: dict, w) -> None:
    # conversion/qwen.py Qwen2MoeModel.set_gguf_parameters (Qwen3MoeModel inherits it).
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _moe_back(get, cfg: dict) -> None:
    for key, suffix in (("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                        ("moe_intermediate_size", "expert_feed_forward_length"),
                        ("shared_expert_intermediate_size", "expert_shared_feed_forward_length")):
        v = get(suffix)
        if isinstance(v, int) and not isinstance(v, bool):
            cfg[key] = v


def _qwen2_moe_back(get, cfg: dict) -> None:
    _moe_back(get, cfg)
    cfg["norm_topk_prob"] = SPECS["qwen2_moe"].extra["topk_renormalized"]


def _qwen3_moe_back(get, cfg: dict) -> None:
    _moe_back(get, cfg)
    cfg["norm_topk_prob"] = SPECS["qwen3_moe"].extra["topk_renormalized"]


def router_semantics_warning(cfg: dict) -> str | None:
    """A warning when the source's router renormalization (``norm_topk_prob``, transformers' default False) is
    not what llama.cpp computes for its architecture: GGUF has no key for it, llama.cpp hard-codes it per
    architecture (``extra["topk_renormalized"]``), so the GGUF would run as a different model."""
    spec = SPECS.get(cfg.get("model_type"))
    want = None if spec is None else spec.extra.get("topk_renormalized")
    if want is None:
        return None
    have = bool(cfg.get("norm_topk_prob", False))
    if have == want:
        return None
    return (f"config.json norm_topk_prob is {have}, but llama.cpp's {spec.gguf_arch} always "
            f"{'renormalizes' if want else 'keeps'} the top-{cfg.get('num_experts_per_tok', 'k')} router weights "
            f"({'' if want else 'un'}normalized; GGUF has no key for it): llama.cpp will not compute this model's "
            "outputs")


def _mixtral_back(get, cfg: dict) -> None:
    cfg.pop("_has_q_bias", None)
    for key, suffix in (("num_local_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count")):
        v = get(suffix)
        if isinstance(v, int) and not isinstance(v, bool):
            cfg[key] = v


def _cohere_hparams(cfg: dict, w) -> None:
    # conversion/command_r.py CommandR2Model: context length from model_max_length first, logit_scale, and an
    # explicit rope scaling type NONE.
    import gguf

    n_ctx = find_hparam(cfg, ("model_max_length", "max_position_embeddings"))
    if n_ctx is not None:
        w.add_context_length(n_ctx)
    w.add_logit_scale(cfg["logit_scale"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _layernorm_back(get, cfg: dict) -> None:
    eps = get("attention.layer_norm_epsilon")
    if isinstance(eps, (int, float)):
        cfg["layer_norm_eps"] = cfg["norm_epsilon"] = float(eps)


def _cohere_back(get, cfg: dict) -> None:
    _layernorm_back(get, cfg)
    v = get("logit_scale")
    if isinstance(v, (int, float)):
        cfg["logit_scale"] = float(v)
    cfg["use_qk_norm"] = False


def _starcoder2_back(get, cfg: dict) -> None:
    _layernorm_back(get, cfg)
    cfg["use_bias"] = True
    cfg["hidden_act"] = "gelu_pytorch_tanh"


#: the 1-D F32 tensors llama.cpp's Phi-3 converter writes for long-rope models (gguf MODEL_TENSOR.ROPE_FACTORS_*)
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def phi3_rope_factors(cfg: dict, file: str | None = None):
    """``(attn_factor, long, short)`` for a Phi-3 config with long-rope factors (``long``/``short``: float32
    arrays of ``rope_dims / 2``), None without ``long_factor``; conversion/phi.py
    ``Phi3MiniModel.generate_extra_tensors``: ``scale = max_position_embeddings / original_max_position_embeddings``,
    attention factor ``sqrt(1 + ln(scale) / ln(original))`` for ``su``/``longrope`` (``0.1 ln(scale) + 1`` for
    ``yarn``; 1 when ``scale <= 1``).  Bad factors are ``CONFIG_VALUE_INVALID`` naming the rule."""
    import math

    import numpy as np

    from ..errors import ErrorCode, Exl2Error

    rp = rope_params(cfg)
    long_f, short_f = rp.get("long_factor"), rp.get("short_factor")
    if not long_f:
        return None

    def bad(why: str):
        return Exl2Error(ErrorCode.CONFIG_VALUE_INVALID, f"Phi-3 long-rope: {why}", file=file)

    n_embd, n_head = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    ctx = find_hparam(cfg, ("n_positions", "max_position_embeddings"))
    orig = rp.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    for name, v in (("hidden_size", n_embd), ("num_attention_heads", n_head), ("max_position_embeddings", ctx),
                    ("original_max_position_embeddings", orig)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(f"{name} must be a positive integer, got {v!r}")
    rope_dims = int(rp.get("partial_rotary_factor", 1.0) * n_embd) // n_head
    kind = str(rp.get("rope_type") or "").lower()
    if not isinstance(long_f, list) or not isinstance(short_f, list):
        raise bad("rope_scaling long_factor and short_factor must both be lists")
    if not len(long_f) == len(short_f) == rope_dims // 2 or rope_dims % 2:
        raise bad(f"long_factor and short_factor must have rope_dims / 2 = {rope_dims / 2} entries, got "
                  f"{len(long_f)} and {len(short_f)}")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in long_f + short_f):
        raise bad("long_factor and short_factor must hold finite numbers")
    scale = ctx / orig
    if kind in ("su", "longrope"):
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise bad(f"rope type {kind or None!r} with long/short factors is not one llama.cpp converts "
                  "(su, longrope, yarn)")
    return attn, np.asarray(long_f, dtype=np.float32), np.asarray(short_f, dtype=np.float32)


def phi3_longrope_back(long_f, short_f, cfg: dict) -> None:
    """config.json's long-rope keys from a GGUF's ``rope_factors_long/short`` (float32 values, 1-D): the
    ``rope_scaling`` Phi-3 repositories carry (type ``longrope``; ``original_max_position_embeddings`` comes
    from the metadata, ``_phi3_back``).  Phi-3 in transformers derives the attention factor from the two
    context lengths, so ``rope.scaling.attn_factor`` needs no key."""
    cfg["rope_scaling"] = {"type": "longrope", "rope_type": "longrope",
                           "long_factor": [float(x) for x in long_f], "short_factor": [float(x) for x in short_f]}


def _phi3_hparams(cfg: dict, w) -> None:
    # conversion/phi.py Phi3MiniModel.set_gguf_parameters: its own list (original context length, rope dims
    # from partial_rotary_factor, sliding window 0 when absent); the long-rope factor tensors and
    # rope.scaling.attn_factor come from phi3_rope_factors (gguf_write puts them where llama.cpp does).
    rp = rope_params(cfg)
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    w.add_context_length(find_hparam(cfg, ("n_positions", "max_position_embeddings")))
    w.add_rope_scaling_orig_ctx_len(rp.get("original_max_position_embeddings",
                                           cfg.get("original_max_position_embeddings")))
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)


def _phi3_back(get, cfg: dict) -> None:
    orig = get("rope.scaling.original_context_length")
    if isinstance(orig, int):
        cfg["original_max_position_embeddings"] = orig
    sw = cfg.get("sliding_window")
    cfg["sliding_window"] = sw if sw else None
    rd = get("rope.dimension_count")
    if isinstance(rd, int) and rd and cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rd / cfg["head_dim"]
    cfg.pop("head_dim", None)


def _gemma_back(get, cfg: dict) -> None:
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["tie_word_embeddings"] = True


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    gguf_arch: str
    hf_class: str
    permute_qk: bool
    llama_cpp: str
    norm_offset: float = 0.0
    skip: tuple[str, ...] = ()
    head_dim_keys: bool = True          # generic key_length/value_length when config.json has head_dim
    hparams: Callable[[dict, Any], None] | None = None
    config_back: Callable[[Callable[[str], Any], dict], None] | None = None
    block_extra: str | None = None      # a gguf_map.MOE_TEMPLATES key: expert/router names for GGUF -> HF
    common: bool = True                 # False: ``hparams`` writes the whole hyper-parameter block itself
    tokenizer: Callable[[Any, Any], None] | None = None   # (writer, source dir): family tokenizer keys
    extra: dict = field(default_factory=dict)


_SPECS = [
    ArchSpec("llama", "llama", "LlamaForCausalLM", True, "conversion/llama.py LlamaModel (undo_permute = True)",
             hparams=_llama_hparams, config_back=_llama_back, tokenizer=_llama_tokenizer),
    ArchSpec("mistral", "llama", "MistralForCausalLM", True,
             "conversion/llama.py LlamaModel (registered for MistralForCausalLM)", hparams=_llama_hparams,
             tokenizer=_llama_tokenizer),
    ArchSpec("granite", "granite", "GraniteForCausalLM", True,
             "conversion/granite.py GraniteModel(LlamaModel): head_dim dropped, multipliers as scales",
             head_dim_keys=False, hparams=_granite_hparams, config_back=_granite_back, tokenizer=_llama_tokenizer),
    ArchSpec("gemma", "gemma", "GemmaForCausalLM", False,
             "conversion/gemma.py GemmaModel: norm.weight + 1 in the stored dtype, lm_head skipped, own hparams",
             norm_offset=1.0, skip=("lm_head.weight",), common=False, hparams=_gemma_hparams,
             tokenizer=_gemma_tokenizer, config_back=_gemma_back),
    ArchSpec("gemma2", "gemma2", "Gemma2ForCausalLM", False,
             "conversion/gemma.py Gemma2Model: Gemma's quirks plus softcaps and sliding window",
             norm_offset=1.0, skip=("lm_head.weight",), common=False, hparams=_gemma2_hparams,
             tokenizer=_gemma_tokenizer, config_back=_gemma2_back),
    ArchSpec("gemma3_text", "gemma3", "Gemma3ForCausalLM", False,
             "conversion/gemma.py Gemma3Model: norm_shift 1.0 (q/k norms too), generic block + own defaults",
             norm_offset=1.0, hparams=_gemma3_hparams, tokenizer=_gemma_tokenizer, config_back=_gemma3_back),
    ArchSpec("mixtral", "llama", "MixtralForCausalLM", True,
             "conversion/llama.py LlamaModel: block_sparse_moe experts stacked w1, w2, w3 into [E, N, K]",
             hparams=_llama_hparams, tokenizer=_llama_tokenizer, config_back=_mixtral_back, block_extra="mixtral"),
    ArchSpec("cohere", "command-r", "CohereForCausalLM", False,
             "conversion/command_r.py CommandR2Model: logit_scale, rope scaling NONE, model_max_length context",
             hparams=_cohere_hparams, config_back=_cohere_back),
    ArchSpec("starcoder2", "starcoder2", "Starcoder2ForCausalLM", False,
             "conversion/starcoder.py StarCoder2Model (generic hparams; LayerNorm and biases everywhere)",
             config_back=_starcoder2_back, block_extra="starcoder2"),
    ArchSpec("phi3", "phi3", "Phi3ForCausalLM", False,
             "conversion/phi.py Phi3MiniModel: fused qkv_proj / gate_up_proj kept fused, own hparams, own SPM vocab",
             common=False, hparams=_phi3_hparams, config_back=_phi3_back, block_extra="phi3",
             extra={"vocab": "phi3"}),
    ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", False, "conversion/qwen.py Qwen2Model (generic hparams, NEOX rope)"),
    ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", False, "conversion/qwen.py Qwen3Model(Qwen2Model)"),
    ArchSpec("qwen2_moe", "qwen2moe", "Qwen2MoeForCausalLM", False,
             "conversion/qwen.py Qwen2MoeModel: experts stacked down, gate, up; shared expert and its gate",
             hparams=_qwen_moe_hparams, config_back=_qwen2_moe_back, block_extra="qwen_moe",
             extra={"topk_renormalized": False}),  # src/models/qwen2moe.cpp build_moe_ffn(..., norm_w = false)
    ArchSpec("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM", False,
             "conversion/qwen.py Qwen3MoeModel(Qwen2MoeModel)", hparams=_qwen_moe_hparams, config_back=_qwen3_moe_back,
             block_extra="qwen_moe",
             extra={"topk_renormalized": True}),  # src/models/qwen3moe.cpp build_moe_ffn(..., norm_w = true)
]
SPECS: dict[str, ArchSpec] = {s.model_type: s for s in _SPECS}


def spec_for_model_type(model_type) -> ArchSpec | None:
    return SPECS.get(model_type)


def spec_for_gguf_arch(arch: str, has_experts: bool = False) -> ArchSpec | None:
    """The spec GGUF -> HF uses for a ``general.architecture``: the first model_type mapping onto it (for
    ``llama`` with ``llama.expert_count``: Mixtral)."""
    if arch == "llama" and has_experts:
        return SPECS["mixtral"]
    for s in _SPECS:
        if s.gguf_arch == arch:
            return s
    return None
