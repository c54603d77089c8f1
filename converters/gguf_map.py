"""What the GGUF bridge needs to know about the Llama family: architectures, names, the Q/K row order.

Supported Hugging Face models (``config.json`` ``model_type``) and the GGUF architecture each becomes:

============  ===========  =====================================================================
model_type    GGUF arch    Q/K rows
============  ===========  =====================================================================
``llama``     ``llama``    permuted: rotate-half pairs (i, i + d/2) -> adjacent pairs (2i, 2i + 1)
``mistral``   ``llama``    permuted (llama.cpp's converter registers Mistral under its llama model)
``qwen2``     ``qwen2``    kept (ggml NEOX rope = the Hugging Face rotate-half layout)
``qwen3``     ``qwen3``    kept
============  ===========  =====================================================================

GGUF tensor names come from the ``gguf`` package's own table (``gguf.get_tensor_name_map``).  That table is
many-to-one (it knows the names of dozens of model families), so the reverse direction uses the Hugging Face
templates below, each pushed forward through the same table: a GGUF name is only ever produced or accepted
when the package maps a Llama-family name onto it.

Arrays: a 2-D weight is ``[rows, cols]`` = ``[out_features, in_features]`` (``nn.Linear`` orientation), which
is also the numpy order of GGUF data (GGUF's ``ne`` lists the dims fastest-first, i.e. reversed).  Rows of
block-quantized data are byte rows ``uint8 [rows, cols / block * type_size]``; the permutation only moves
whole rows, so it acts on those byte rows exactly as on the float rows.
"""

from __future__ import annotations

import numpy as np

from ..errors import ErrorCode, Exl2Error
from .gguf_arch import SPECS

__all__ = ["ARCHS", "arch_of", "hf_templates", "gguf_name_map", "hf_name_map", "permute_qk", "unpermute_qk",
           "qk_heads", "HF_ARCHITECTURES"]

#: model_type -> (GGUF arch name, permute Q/K rows); the full per-architecture table is ``gguf_arch.SPECS``
ARCHS = {mt: (s.gguf_arch, s.permute_qk) for mt, s in SPECS.items()}
#: GGUF arch -> (Hugging Face class, model_type) written by GGUF -> HF
HF_ARCHITECTURES = {s.gguf_arch: (s.hf_class, s.model_type) for s in reversed(list(SPECS.values()))}

_GLOBAL = ("model.embed_tokens.weight", "model.norm.weight", "model.norm.bias", "lm_head.weight")
_BLOCK = ("input_layernorm.weight", "post_attention_layernorm.weight",
          "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
          "self_attn.q_norm.weight", "self_attn.k_norm.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
          "input_layernorm.bias", "post_attention_layernorm.bias")
#: per-architecture block templates (``ArchSpec.block_extra`` names one of these): the stacked experts (one
#: GGUF tensor ``[E, N, K]`` for the Hugging Face tensors ``...experts.<e>.<proj>.weight``) and routers, and
#: family-specific MLP names
MOE_TEMPLATES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.w1.weight",
                "block_sparse_moe.experts.w2.weight", "block_sparse_moe.experts.w3.weight"),
    "qwen_moe": ("mlp.gate.weight", "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
                 "mlp.experts.down_proj.weight", "mlp.shared_expert.gate_proj.weight",
                 "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
                 "mlp.shared_expert_gate.weight"),
    # not experts, but a family's own MLP names (they map onto the same GGUF names as up/down_proj)
    "starcoder2": ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"),
    "phi3": ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"),
}
#: Tensors that are derived at load time and carry nothing: dropped on the way to GGUF.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def arch_of(config: dict | None, *, file: str | None = None) -> tuple[str, bool]:
    """(GGUF arch name, whether Q/K rows are permuted) for a Hugging Face ``config.json``."""
    if not isinstance(config, dict):
        raise Exl2Error(ErrorCode.CONFIG_MISSING, "converting to GGUF needs config.json (architecture and "
                        "hyper-parameters)", file=file)
    mt = config.get("model_type")
    if mt not in ARCHS:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"model_type {mt!r} is not supported by the GGUF bridge; "
                        f"supported: {', '.join(ARCHS)}", file=file)
    return ARCHS[mt]


def _gguf_arch(arch: str):
    import gguf

    for k, v in gguf.MODEL_ARCH_NAMES.items():
        if v == arch:
            return k
    raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"GGUF architecture {arch!r} is unknown to the gguf package")


def hf_templates(n_blocks: int, extra: str | None = None) -> list[str]:
    """Every Hugging Face tensor name the bridge maps, for ``n_blocks`` decoder layers (``extra``: a key of
    ``MOE_TEMPLATES``)."""
    block = _BLOCK + MOE_TEMPLATES.get(extra or "", ())
    return list(_GLOBAL) + [f"model.layers.{i}.{t}" for i in range(n_blocks) for t in block]


def gguf_name_map(arch: str, n_blocks: int):
    """``hf_name -> gguf_name`` via the gguf package's table (None for names it does not map)."""
    import gguf

    tmap = gguf.get_tensor_name_map(_gguf_arch(arch), n_blocks)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_gguf_arch(arch)]}

    def name(hf: str) -> str | None:
        g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is None:
            return None
        base = g.rsplit(".", 1)[0]
        templ = base
        if base.startswith("blk."):
            parts = base.split(".")
            templ = ".".join([parts[0], "{bid}"] + parts[2:])
        return g if templ in allowed else None

    return name


def hf_name_map(arch: str, n_blocks: int, extra: str | None = None) -> dict[str, str]:
    """``gguf_name -> hf_name`` for the supported tensors of ``arch`` (the templates pushed forward)."""
    fwd = gguf_name_map(arch, n_blocks)
    out: dict[str, str] = {}
    for hf in hf_templates(n_blocks, extra):
        g = fwd(hf)
        if g is not None:
            out[g] = hf
    return out


def qk_heads(hf_name: str, n_head: int, n_kv: int) -> int | None:
    """Heads to permute over for a Q or K tensor (weight or bias), None for every other tensor."""
    if ".q_proj." in hf_name + ".":
        return n_head
    if ".k_proj." in hf_name + ".":
        return n_kv
    return None


def _rows_check(a: np.ndarray, heads: int, name: str) -> None:
    if heads <= 0 or a.shape[0] % (2 * heads):
        raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"{a.shape[0]} rows cannot be split into {heads} heads of an "
                        "even size for the rope row order", tensor=name)


def permute_qk(a: np.ndarray, heads: int, name: str = "") -> np.ndarray:
    """Hugging Face row order -> GGUF ``llama`` row order.  ``a``: any dtype, shape ``[R, ...]`` (rows first);
    within each head of ``d = R / heads`` rows, row ``t*d/2 + i`` moves to ``2*i + t``."""
    _rows_check(a, heads, name)
    d = a.shape[0] // heads
    return np.ascontiguousarray(a.reshape(heads, 2, d // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))


def unpermute_qk(a: np.ndarray, heads: int, name: str = "") -> np.ndarray:
    """The inverse of ``permute_qk`` (GGUF ``llama`` row order -> Hugging Face)."""
    _rows_check(a, heads, name)
    d = a.shape[0] // heads
    return np.ascontiguousarray(a.reshape(heads, d // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))
