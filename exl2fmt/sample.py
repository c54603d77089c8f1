"""The embedded sample: a tiny Llama-shaped EXL2 model generated deterministically.

``write_sample(directory)`` produces the same bytes on every machine (fixed seeds, NumPy's PCG64 generator,
round-to-nearest quantization with ExLlamaV2's scale search).  Two decoder layers whose linears use upstream
preset plans chosen so that all six bit widths, mixed tiers, groups of 32/64/128 rows, shared act-order
permutations (q/k/v, gate/up) and a padded ``lm_head`` (vocab 1000 -> N_pad 1024) all occur.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .layout import Tier

__all__ = ["SAMPLE_CONFIG", "SAMPLE_PLANS", "sample_tensors", "write_sample"]

SAMPLE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def T(*parts) -> tuple[Tier, ...]:
    return tuple(Tier(p, b, g) for p, b, g in parts)


#: Per-layer plans (upstream preset rows; see spec/exl2.md).  Index = decoder layer.
SAMPLE_PLANS = [
    {
        "self_attn.q_proj": T((0.1, 4, 128), (0.9, 3, 128)),
        "self_attn.k_proj": T((0.1, 4, 128), (0.9, 3, 128)),
        "self_attn.v_proj": T((0.25, 3, 64), (0.75, 2, 64)),
        "self_attn.o_proj": T((1.0, 4, 32)),
        "mlp.gate_proj": T((0.1, 5, 128), (0.9, 4, 128)),
        "mlp.up_proj": T((0.25, 6, 32), (0.75, 5, 32)),
        "mlp.down_proj": T((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128)),
    },
    {
        "self_attn.q_proj": T((1.0, 6, 128)),
        "self_attn.k_proj": T((1.0, 8, 128)),
        "self_attn.v_proj": T((1.0, 5, 64)),
        "self_attn.o_proj": T((0.1, 6, 32), (0.9, 5, 32)),
        "mlp.gate_proj": T((0.05, 3, 64), (0.95, 2, 64)),
        "mlp.up_proj": T((0.1, 8, 128), (0.9, 6, 128)),
        "mlp.down_proj": T((0.05, 6, 32), (0.2, 3, 64), (0.75, 2, 64)),
    },
]
HEAD_PLAN = T((0.15, 8, 128), (0.85, 6, 128))


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def sample_dense_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The FP16 model the sample is quantized from (nn.Linear orientation)."""
    cfg = SAMPLE_CONFIG
    rng = np.random.Generator(np.random.PCG64(seed))
    out: dict[str, np.ndarray] = {}
    h = cfg["hidden_size"]
    out["model.embed_tokens.weight"] = (rng.standard_normal((cfg["vocab_size"], h)) * 0.02).astype(np.float16)
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        out[p + "input_layernorm.weight"] = (1 + 0.05 * rng.standard_normal(h)).astype(np.float16)
        out[p + "post_attention_layernorm.weight"] = (1 + 0.05 * rng.standard_normal(h)).astype(np.float16)
        for name, (n, k) in _shapes(cfg).items():
            # heavy-tailed rows/columns, like trained weights, so act-order and mixed tiers matter
            w = rng.standard_normal((n, k)) / np.sqrt(k)
            w *= np.exp(0.5 * rng.standard_normal(k))[None, :]
            out[p + name + ".weight"] = w.astype(np.float16)
    out["model.norm.weight"] = (1 + 0.05 * rng.standard_normal(h)).astype(np.float16)
    out["lm_head.weight"] = (rng.standard_normal((cfg["vocab_size"], h)) * 0.05).astype(np.float16)
    return out


def sample_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of the EXL2 sample model, by name."""
    from .formats.exl2 import quantize_rtn

    cfg = SAMPLE_CONFIG
    dense = sample_dense_tensors(seed)
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    out: dict[str, np.ndarray] = {}
    for name, arr in dense.items():
        if not name.endswith("_proj.weight") and name != "lm_head.weight":
            out[name] = arr
    for li, plans in enumerate(SAMPLE_PLANS):
        p = f"model.layers.{li}."
        # ExLlamaV2 shares one Hessian (hence one permutation) between q/k/v and between gate/up.
        perm_attn = rng.permutation(cfg["hidden_size"])
        perm_mlp = rng.permutation(cfg["hidden_size"])
        for name, tiers in plans.items():
            perm = {"self_attn.q_proj": perm_attn, "self_attn.k_proj": perm_attn, "self_attn.v_proj": perm_attn,
                    "mlp.gate_proj": perm_mlp, "mlp.up_proj": perm_mlp}.get(name)
            if perm is None:
                perm = rng.permutation(dense[p + name + ".weight"].shape[1])
            for slot, arr in quantize_rtn(dense[p + name + ".weight"], list(tiers), perm).items():
                out[f"{p}{name}.{slot}"] = arr
    perm = rng.permutation(cfg["hidden_size"])
    for slot, arr in quantize_rtn(dense["lm_head.weight"], list(HEAD_PLAN), perm).items():
        out[f"lm_head.{slot}"] = arr
    return out


def decoder_bpw() -> float:
    """Average bits per weight of the sample's decoder linears, overhead included (ExLlamaV2's accounting)."""
    from .layout import exl2_total_bits, pad32

    bits = numel = 0
    for plans in SAMPLE_PLANS:
        for name, (n, k) in _shapes(SAMPLE_CONFIG).items():
            bits += exl2_total_bits(k, pad32(n), plans[name])
            numel += k * pad32(n)
    return bits / numel


def sample_config() -> dict:
    from . import __version__
    from .arch import exl2_quantization_config

    cfg = dict(SAMPLE_CONFIG)
    # the sample's plans are fixed, so record what they measure rather than a rounder target
    cfg["quantization_config"] = exl2_quantization_config(
        round(decoder_bpw(), 2), 6, {"rows": 0, "length": 0, "dataset": "(none: round-to-nearest sample)"},
        __version__)
    return cfg


def _is_sample(d: Path) -> bool:
    """True when ``d`` holds a sample this module wrote: a regular config.json and an output.safetensors whose
    header metadata names ``exl2fmt sample`` as its producer (headers only; anything unreadable is no sample)."""
    from .container.reader import read_header
    from .errors import Exl2Error

    cfg, out = d / "config.json", d / "output.safetensors"
    if cfg.is_symlink() or not cfg.is_file() or out.is_symlink() or not out.is_file():
        return False
    try:
        return read_header(out).metadata.get("producer") == "exl2fmt sample"
    except Exl2Error:
        return False


def write_sample(directory: str | os.PathLike, *, overwrite: bool = False, seed: int = 0) -> Path:
    """Write the sample model (``config.json`` + ``output.safetensors``) into ``directory``."""
    from .container import write_sharded
    from .errors import ErrorCode, Exl2Error

    d = Path(directory)
    if os.path.lexists(d) and not d.is_dir():
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "the sample is a directory, and this path exists as a file: choose "
                        "another directory", file=str(d))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create the directory: {e.strerror or e}", file=str(d)) from None
    cfg_path = d / "config.json"
    if cfg_path.exists() and not overwrite:
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "a model is already there (config.json exists); pass --force to "
                        "replace it", file=str(d))
    if overwrite and (os.path.lexists(cfg_path) or os.path.lexists(d / "output.safetensors")) and not _is_sample(d):
        # --force replaces the sample's own two files, never a config.json of another model (issue 41)
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "the directory holds a config.json or output.safetensors that "
                        "is not the sample's (an output.safetensors written by exl2fmt sample, next to its "
                        "config.json); --force replaces only a sample: choose another directory", file=str(d))
    write_sharded(d, sample_tensors(seed), max_shard_bytes=1 << 40, prefix="output", overwrite=overwrite,
                  metadata={"format": "pt", "producer": "exl2fmt sample"})
    from .container.publish import atomic_write

    text = (json.dumps(sample_config(), indent=2) + "\n").encode("utf-8")
    atomic_write(cfg_path, lambda f: f.write(text))     # a fresh temp name: never through a planted link
    return d
