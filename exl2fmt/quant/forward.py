"""A torch forward pass for the Llama family, one decoder block at a time.

Supported ``model_type`` values: ``llama``, ``mistral``, ``qwen2`` (bias on q/k/v) and ``qwen3`` (RMSNorm over
each head of q and k, no q/k/v bias).  All four share one decoder block::

    h = h + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))      n1 = rmsnorm(h) * input_layernorm
    h = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                      n2 = rmsnorm(h) * post_attention_layernorm

with causal grouped-query attention (``num_kv_heads`` divides ``num_heads``), rotate-half RoPE (the Hugging Face
checkpoint layout), optional sliding-window attention (Mistral; Qwen2/3 with ``use_sliding_window``) and an
optional q/k RMSNorm per head (Qwen3).  The quantizer needs three things from it:

* the output of each block with the original weights (the reference the candidates are measured against),
* the output of each block with substitute linear layers (quantized candidates) -- every linear is a
  ``Linear`` callable that the caller may replace,
* the input of every linear layer (``capture``), from which the GPTQ Hessians are accumulated.

Weights are read from a ``WeightSource`` on demand, so a full ``forward`` holds one block's weights at a time.
Everything is computed in float32 unless the caller moves ``h`` to another dtype or device; the weights follow
``h`` (dtype and device).

This module does not import transformers; ``tests/test_forward.py`` compares it with transformers as a peer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..container import ModelFiles, bf16_bits_to_f32, open_model
from ..errors import ErrorCode, Exl2Error

__all__ = [
    "ModelSpec", "Linear", "dense_linear", "WeightSource", "rope", "rms_norm", "embed", "attention_block",
    "mlp_block", "final_logits", "forward", "check_weights", "SUPPORTED_ARCHS",
]

Linear = Callable[[torch.Tensor], torch.Tensor]
"""A linear layer as a function: x float [..., K] -> y float [..., N] (same dtype and device as x)."""

# model_type -> the architectures[] name Hugging Face writes for it
SUPPORTED_ARCHS: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_ARCH_BY_CLASS = {v: k for k, v in SUPPORTED_ARCHS.items()}
_ROPE_TYPES = ("default", "linear", "llama3")


# ------------------------------------------------------------------------------------------------------
# model description
# ------------------------------------------------------------------------------------------------------

def _cfg_error(msg: str, code: ErrorCode = ErrorCode.CONFIG_INVALID) -> Exl2Error:
    return Exl2Error(code, msg, file="config.json")


def _pos_int(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    v = config.get(key, default)
    if v is None:
        raise _cfg_error(f"expected a positive integer '{key}', found none")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _cfg_error(f"expected a positive integer '{key}', found {v!r}")
    return v


def _pos_float(config: Mapping[str, Any], key: str, default: float) -> float:
    v = config.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _cfg_error(f"expected a positive number '{key}', found {v!r}")
    return float(v)


def _rope_params(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either the transformers-4 keys (``rope_theta`` +
    ``rope_scaling``) or the transformers-5 ``rope_parameters`` dict."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise _cfg_error(f"expected 'rope_parameters' to be an object, found {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise _cfg_error(f"expected 'rope_scaling' to be an object or null, found {scaling!r}")
    merged: dict = {}
    if params:
        merged.update(params)
    if scaling:
        merged.update(scaling)
    theta = _pos_float({"rope_theta": merged.get("rope_theta", config.get("rope_theta"))}, "rope_theta", 10000.0)
    rtype = merged.get("rope_type", merged.get("type", "default"))
    if rtype is None:
        rtype = "default"
    if rtype not in _ROPE_TYPES:
        raise _cfg_error(f"RoPE scaling type {rtype!r} is not supported by the calibration forward "
                         f"(supported: {', '.join(_ROPE_TYPES)})", ErrorCode.ARCH_UNSUPPORTED)
    if rtype == "default":
        return theta, None
    if merged.get("factor") is None:
        raise _cfg_error(f"RoPE scaling {rtype!r} needs a 'factor'")
    out: dict = {"rope_type": rtype, "factor": _pos_float(merged, "factor", 1.0)}
    if rtype == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise _cfg_error(f"RoPE scaling 'llama3' needs '{key}'")
        out["low_freq_factor"] = _pos_float(merged, "low_freq_factor", 1.0)
        out["high_freq_factor"] = _pos_float(merged, "high_freq_factor", 4.0)
        out["original_max_position_embeddings"] = _pos_int(merged, "original_max_position_embeddings")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise _cfg_error("RoPE scaling 'llama3' needs high_freq_factor > low_freq_factor")
    return theta, out


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder, read from its config.json (``from_config``)."""

    arch: str                      # model_type: llama | mistral | qwen2 | qwen3
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)   # None, or {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False         # q/k/v carry a bias (qwen2; llama/qwen3 with attention_bias)
    o_bias: bool = False           # o_proj carries a bias (llama/qwen3 with attention_bias)
    mlp_bias: bool = False         # gate/up/down carry a bias (llama with mlp_bias)
    qk_norm: bool = False          # RMSNorm over head_dim on q and k before RoPE (qwen3)
    max_position_embeddings: int = 4096
    layer_windows: tuple = ()      # per layer: sliding-window size in tokens, or None for full causal attention

    attn_linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp_linears = ("gate_proj", "up_proj", "down_proj")

    # --- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelSpec":
        """Read a Hugging Face config.json dict.

        Raises ``Exl2Error``: ``ARCH_UNSUPPORTED`` for a model type, activation or RoPE scaling the forward does
        not implement (callers fall back to weight-only quantization), ``CONFIG_INVALID`` for missing or
        malformed fields.
        """
        if not isinstance(config, Mapping):
            raise _cfg_error(f"expected a JSON object, found {type(config).__name__}")
        mtype = config.get("model_type")
        archs = config.get("architectures") or []
        if not isinstance(archs, list):
            archs = []
        if mtype is None:
            known = [_ARCH_BY_CLASS[a] for a in archs if isinstance(a, str) and a in _ARCH_BY_CLASS]
            mtype = known[0] if known else None
        if mtype not in SUPPORTED_ARCHS:
            found = mtype if mtype is not None else (archs[0] if archs else "none")
            raise _cfg_error(f"model type {found!r} has no calibration forward (supported: "
                             f"{', '.join(SUPPORTED_ARCHS)})", ErrorCode.ARCH_UNSUPPORTED)
        act = config.get("hidden_act", config.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise _cfg_error(f"activation {act!r} is not supported (the forward implements SiLU-gated MLPs)",
                             ErrorCode.ARCH_UNSUPPORTED)

        hidden = _pos_int(config, "hidden_size")
        heads = _pos_int(config, "num_attention_heads")
        kv_heads = _pos_int(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise _cfg_error(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise _cfg_error(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) and "
                                 "no head_dim is given")
            head_dim = hidden // heads
        else:
            head_dim = _pos_int(config, "head_dim")
        if head_dim % 2:
            raise _cfg_error(f"head_dim must be even for RoPE, found {head_dim}")
        if config.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
            raise _cfg_error("partial_rotary_factor != 1 is not supported", ErrorCode.ARCH_UNSUPPORTED)
        layers = _pos_int(config, "num_hidden_layers")
        theta, scaling = _rope_params(config)

        attn_bias = bool(config.get("attention_bias", False))
        qkv_bias = True if mtype == "qwen2" else attn_bias
        o_bias = False if mtype == "qwen2" else attn_bias
        mlp_bias = bool(config.get("mlp_bias", False))

        # sliding windows: mistral applies its window to every layer; qwen2/3 only with use_sliding_window, to
        # the layers marked "sliding_attention" in layer_types (else those from max_window_layers on)
        window = config.get("sliding_window")
        windows: list = [None] * layers
        if window is not None:
            window = _pos_int(config, "sliding_window")
            if mtype == "mistral":
                windows = [window] * layers
            elif mtype in ("qwen2", "qwen3") and config.get("use_sliding_window", False):
                types = config.get("layer_types")
                if isinstance(types, list) and len(types) == layers:
                    windows = [window if t == "sliding_attention" else None for t in types]
                else:
                    first = config.get("max_window_layers", layers)
                    windows = [window if i >= first else None for i in range(layers)]
            elif mtype == "llama":
                windows = [None] * layers
        return cls(
            arch=mtype, hidden_size=hidden, intermediate_size=_pos_int(config, "intermediate_size"),
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            vocab_size=_pos_int(config, "vocab_size"),
            rms_norm_eps=_pos_float(config, "rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=(mtype == "qwen3"),
            max_position_embeddings=_pos_int(config, "max_position_embeddings", 4096),
            layer_windows=tuple(windows),
        )

    # --- names ----------------------------------------------------------------------------------------
    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}"

    def linear_key(self, i: int, name: str) -> str:
        """Full layer key of a linear in block ``i``: ``model.layers.{i}.self_attn.q_proj`` etc."""
        if name in self.attn_linears:
            return f"{self.layer_prefix(i)}.self_attn.{name}"
        if name in self.mlp_linears:
            return f"{self.layer_prefix(i)}.mlp.{name}"
        raise KeyError(name)

    def linear_shape(self, name: str) -> tuple[int, int]:
        """(N out_features, K in_features) of a decoder linear."""
        h, d = self.hidden_size, self.head_dim
        return {
            "q_proj": (self.num_heads * d, h), "k_proj": (self.num_kv_heads * d, h),
            "v_proj": (self.num_kv_heads * d, h), "o_proj": (h, self.num_heads * d),
            "gate_proj": (self.intermediate_size, h), "up_proj": (self.intermediate_size, h),
            "down_proj": (h, self.intermediate_size),
        }[name]

    def has_bias(self, name: str) -> bool:
        if name in ("q_proj", "k_proj", "v_proj"):
            return self.qkv_bias
        if name == "o_proj":
            return self.o_bias
        return self.mlp_bias

    def expected_tensors(self, src: "WeightSource | None" = None) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads, name -> shape.  ``lm_head.weight`` is listed unless the embeddings
        are tied (or, given ``src``, the head is absent from it)."""
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            out[f"{p}.input_layernorm.weight"] = (self.hidden_size,)
            out[f"{p}.post_attention_layernorm.weight"] = (self.hidden_size,)
            if self.qk_norm:
                out[f"{p}.self_attn.q_norm.weight"] = (self.head_dim,)
                out[f"{p}.self_attn.k_norm.weight"] = (self.head_dim,)
            for name in self.attn_linears + self.mlp_linears:
                key = self.linear_key(i, name)
                n, k = self.linear_shape(name)
                out[f"{key}.weight"] = (n, k)
                if self.has_bias(name):
                    out[f"{key}.bias"] = (n,)
        out["model.norm.weight"] = (self.hidden_size,)
        if not _tied(self, src):
            out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return out


def _tied(spec: ModelSpec, src: "WeightSource | None") -> bool:
    if src is None:
        return spec.tie_word_embeddings
    return spec.tie_word_embeddings or not src.has("lm_head.weight")


# ------------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------------

class WeightSource:
    """Float tensors of a model by name, read lazily.

    ``model`` is a ``ModelFiles`` (``exl2fmt.container.open_model``), a model directory / safetensors path, or a
    mapping name -> torch.Tensor / np.ndarray (in-memory weights, e.g. a perturbed copy in a test).  Stored
    F16, BF16 and F32 tensors are supported; nothing is cached, so memory holds only what callers keep.
    """

    def __init__(self, model: "ModelFiles | str | os.PathLike | Mapping[str, Any]"):
        self._files: ModelFiles | None = None
        self._reader = None
        self._mem: dict[str, torch.Tensor] | None = None
        self._owned = False
        if isinstance(model, ModelFiles):
            self._files = model
        elif isinstance(model, (str, os.PathLike)):
            self._files = open_model(model)
            self._owned = True
        elif isinstance(model, Mapping):
            self._mem = {str(k): (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)))
                         for k, v in model.items()}
        else:
            raise TypeError(f"WeightSource needs ModelFiles, a path or a mapping, got {type(model).__name__}")

    @property
    def files(self) -> ModelFiles | None:
        return self._files

    @property
    def config(self) -> dict | None:
        return None if self._files is None else self._files.config

    @property
    def where(self) -> str:
        return "<memory>" if self._files is None else str(self._files.root)

    def names(self) -> list[str]:
        return list(self._mem) if self._mem is not None else self._files.names()

    def has(self, name: str) -> bool:
        return name in self._mem if self._mem is not None else name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mem is not None:
            if name not in self._mem:
                raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none",
                                file=self.where, tensor=name)
            return tuple(self._mem[name].shape)
        return tuple(self._files.info(name).shape)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The torch dtype that holds ``name`` exactly as stored: float16, bfloat16 or float32."""
        if self._mem is not None:
            t = self._mem.get(name)
            return t.dtype if t is not None and t.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(self._files.info(name).dtype, torch.float32)

    def get(self, name: str, dtype: torch.dtype = torch.float32, device: "torch.device | str | None" = None
            ) -> torch.Tensor:
        """The tensor ``name`` as a new torch tensor of ``dtype`` (default float32) on ``device`` (default CPU).

        Raises ``TENSOR_NOT_FOUND`` if absent and ``SLOT_DTYPE`` if it is not F16/BF16/F32.
        """
        if self._mem is not None:
            if name not in self._mem:
                raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none",
                                file=self.where, tensor=name)
            t = self._mem[name]
            if not t.is_floating_point():
                raise Exl2Error(ErrorCode.SLOT_DTYPE, f"expected a float tensor, found {t.dtype}",
                                file=self.where, tensor=name)
            return t.to(device=device or "cpu", dtype=dtype, copy=True)
        info = self._files.info(name)
        if info.dtype not in ("F16", "F32", "BF16"):
            raise Exl2Error(ErrorCode.SLOT_DTYPE, f"expected an F16, BF16 or F32 weight, found {info.dtype}",
                            file=info.file, tensor=name)
        arr = self.read_stored(name)
        if info.dtype == "BF16":
            # the container hands BF16 back as its uint16 bit patterns: widen to the top half of an fp32
            t = torch.from_numpy(bf16_bits_to_f32(arr))
        else:
            t = torch.from_numpy(arr)
        return t.to(device=device or "cpu", dtype=dtype)

    def read_stored(self, name: str) -> np.ndarray:
        """The tensor exactly as stored (numpy dtype of its safetensors dtype; BF16 as uint16 bits), in a private
        array read with pread rather than through the memory map: the map's pages would stay in the resident
        set, so a pass over every block would end up holding the whole model.  File-backed sources only."""
        if self._reader is None:
            from ..container import SourceReader

            self._reader = SourceReader(self._files)
        return self._reader.read(name)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close_files()
            self._reader = None
        if self._owned and self._files is not None:
            self._files.close()

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightSource({self.where!r})"


def check_weights(spec: ModelSpec, src: WeightSource) -> None:
    """Check that every tensor the forward reads exists with the shape the config implies.

    Raises ``TENSOR_NOT_FOUND`` or ``CONFIG_MISMATCH`` naming the tensor (so a bad model fails before any
    compute instead of deep inside a matmul).
    """
    for name, shape in spec.expected_tensors(src).items():
        if not src.has(name):
            raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, f"the {spec.arch} forward needs this tensor, found none",
                            file=src.where, tensor=name)
        found = src.shape(name)
        if found != shape:
            raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"config.json implies shape {list(shape)}, found "
                            f"{list(found)}", file=src.where, tensor=name)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A ``Linear`` from an ``nn.Linear``-style weight float [N, K] (row n = output feature n) and bias float [N].

    x [..., K] -> x @ weight.T + bias, computed in the weight's dtype on its device.
    """
    def apply(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias)
    apply.weight = weight  # type: ignore[attr-defined]
    apply.bias = bias  # type: ignore[attr-defined]
    return apply


def _load_linear(spec: ModelSpec, src: WeightSource, key: str, ref: torch.Tensor) -> Linear:
    w = src.get(f"{key}.weight", dtype=ref.dtype, device=ref.device)
    b = src.get(f"{key}.bias", dtype=ref.dtype, device=ref.device) if src.has(f"{key}.bias") else None
    return dense_linear(w, b)


# ------------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32: x / sqrt(mean(x^2) + eps) * weight (Llama's order)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _inv_freq(spec: ModelSpec, device: "torch.device | str | None") -> torch.Tensor:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    sc = spec.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band in between interpolated
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    ctx = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > ctx / lo, inv / factor, inv)
    t = (ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - t) * scaled / factor + t * scaled
    middle = (wavelen >= ctx / hi) & (wavelen <= ctx / lo)
    return torch.where(middle, smoothed, scaled)


def rope(spec: ModelSpec, seq_len: int, device: "torch.device | str | None" = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each float32 [seq_len, head_dim], for positions 0..seq_len-1 in the rotate-half layout
    (frequency j at columns j and j + head_dim/2)."""
    inv = _inv_freq(spec, device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(pos, inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


_rope_tables = rope   # attention_block's ``rope`` argument shadows the function


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, D]; cos/sin [T, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def embed(spec: ModelSpec, src: WeightSource, ids: torch.Tensor, device: "torch.device | str | None" = None,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Token embeddings: ids int64 [B, T] -> h float32 [B, T, hidden].  Ids outside 0..vocab-1 read row 0 (as
    ExLlamaV2's quantizer does with ids beyond the native vocabulary)."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise Exl2Error(ErrorCode.USAGE, f"expected token ids int [rows, length], found {ids.dtype} "
                        f"{list(ids.shape)}")
    dev = device if device is not None else ids.device
    ids = ids.to(device=dev, dtype=torch.int64)
    ids = torch.where((ids >= 0) & (ids < spec.vocab_size), ids, torch.zeros_like(ids))
    # the table stays in its stored 16-bit dtype (a 128k x 8192 table is 4 GiB in float32); only the looked-up
    # rows are widened, which is exact
    name = "model.embed_tokens.weight"
    table = src.get(name, dtype=src.stored_dtype(name), device=dev)
    return F.embedding(ids, table).to(dtype)


def _causal_mask(seq_len: int, window: int | None, device: Any) -> torch.Tensor | None:
    if window is None or window >= seq_len:
        return None
    i = torch.arange(seq_len, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)   # bool [T, T]: True where key j is visible to query i


def attention_block(spec: ModelSpec, i: int, h: torch.Tensor, src: WeightSource,
                    linears: Mapping[str, Linear] | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    capture: dict | None = None) -> torch.Tensor:
    """Attention half of decoder block ``i``: h float [B, T, hidden] -> h + o_proj(attention(norm(h))).

    ``linears`` maps ``q_proj``/``k_proj``/``v_proj``/``o_proj`` to substitute ``Linear``s; missing ones are dense
    from ``src``.  ``rope`` is ``rope(spec, T)`` (computed if omitted).  ``capture``, if given, receives the inputs
    of the linears, float [B, T, K]: ``q_proj`` (the normed hidden state; ``k_proj`` and ``v_proj`` are the same
    tensor object) and ``o_proj`` (the attention output, heads concatenated).
    """
    linears = linears or {}
    p = spec.layer_prefix(i)
    B, T, _ = h.shape
    dev, dt = h.device, h.dtype
    lin = {n: linears.get(n) or _load_linear(spec, src, spec.linear_key(i, n), h) for n in spec.attn_linears}

    x = rms_norm(h, src.get(f"{p}.input_layernorm.weight", dt, dev), spec.rms_norm_eps)
    if capture is not None:
        capture["q_proj"] = capture["k_proj"] = capture["v_proj"] = x
    q = lin["q_proj"](x).view(B, T, spec.num_heads, spec.head_dim)
    k = lin["k_proj"](x).view(B, T, spec.num_kv_heads, spec.head_dim)
    v = lin["v_proj"](x).view(B, T, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, src.get(f"{p}.self_attn.q_norm.weight", dt, dev), spec.rms_norm_eps)
        k = rms_norm(k, src.get(f"{p}.self_attn.k_norm.weight", dt, dev), spec.rms_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, heads, T, D]
    cos, sin = rope if rope is not None else _rope_tables(spec, T, dev)
    cos, sin = cos[:T].to(dev), sin[:T].to(dev)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    window = spec.layer_windows[i] if i < len(spec.layer_windows) else None
    mask = _causal_mask(T, window, dev)
    gqa = spec.num_heads != spec.num_kv_heads
    if mask is None:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    a = a.transpose(1, 2).reshape(B, T, spec.num_heads * spec.head_dim)
    if capture is not None:
        capture["o_proj"] = a
    return h + lin["o_proj"](a)


def mlp_block(spec: ModelSpec, i: int, h: torch.Tensor, src: WeightSource,
              linears: Mapping[str, Linear] | None = None, capture: dict | None = None) -> torch.Tensor:
    """MLP half of decoder block ``i``: h float [B, T, hidden] -> h + down(silu(gate(n)) * up(n)), n = norm(h).

    ``linears``: substitutes for ``gate_proj``/``up_proj``/``down_proj``.  ``capture`` receives float [B, T, K]
    inputs: ``gate_proj`` (= ``up_proj``, the same object; the normed hidden state) and ``down_proj``
    (silu(gate) * up).
    """
    linears = linears or {}
    p = spec.layer_prefix(i)
    dev, dt = h.device, h.dtype
    lin = {n: linears.get(n) or _load_linear(spec, src, spec.linear_key(i, n), h) for n in spec.mlp_linears}
    x = rms_norm(h, src.get(f"{p}.post_attention_layernorm.weight", dt, dev), spec.rms_norm_eps)
    if capture is not None:
        capture["gate_proj"] = capture["up_proj"] = x
    m = F.silu(lin["gate_proj"](x)) * lin["up_proj"](x)
    if capture is not None:
        capture["down_proj"] = m
    return h + lin["down_proj"](m)


def final_logits(spec: ModelSpec, h: torch.Tensor, src: WeightSource, head: Linear | None = None) -> torch.Tensor:
    """Final RMSNorm and LM head: h float [B, T, hidden] -> logits float32 [B, T, vocab].

    ``head`` replaces the dense head (``lm_head.weight``, or the embedding table when the embeddings are tied or
    the model has no ``lm_head.weight``)."""
    x = rms_norm(h, src.get("model.norm.weight", h.dtype, h.device), spec.rms_norm_eps)
    if head is None:
        name = "model.embed_tokens.weight" if _tied(spec, src) else "lm_head.weight"
        w = src.get(name, h.dtype, h.device)
        b = src.get("lm_head.bias", h.dtype, h.device) if src.has("lm_head.bias") else None
        head = dense_linear(w, b)
    return head(x).float()


def forward(spec: ModelSpec, src: WeightSource, ids: torch.Tensor,
            linears_for_layer: Callable[[str], Linear | None] | None = None,
            device: "torch.device | str | None" = None) -> torch.Tensor:
    """The whole model: ids int64 [B, T] -> logits float32 [B, T, vocab], one block's weights in memory at a time.

    ``linears_for_layer(key)`` may supply a substitute for any linear by its full key
    (``model.layers.{i}.self_attn.q_proj``, ..., ``model.layers.{i}.mlp.down_proj``, ``lm_head``); returning
    None keeps the dense weight from ``src``.  Computed in float32 on ``device`` (default: CPU, or ids' device).
    """
    ids = torch.as_tensor(ids)
    dev = torch.device(device) if device is not None else ids.device
    h = embed(spec, src, ids, device=dev)
    cs = rope(spec, h.shape[1], dev)
    get = linears_for_layer or (lambda key: None)
    for i in range(spec.num_layers):
        attn = {n: f for n in spec.attn_linears if (f := get(spec.linear_key(i, n))) is not None}
        h = attention_block(spec, i, h, src, attn, rope=cs)
        mlp = {n: f for n in spec.mlp_linears if (f := get(spec.linear_key(i, n))) is not None}
        h = mlp_block(spec, i, h, src, mlp)
    return final_logits(spec, h, src, head=get("lm_head"))


def load_spec(model_dir: "str | os.PathLike") -> tuple[ModelSpec, WeightSource]:
    """Open a model directory: its ``ModelSpec`` (from config.json) and a ``WeightSource`` over its tensors."""
    src = WeightSource(Path(model_dir))
    cfg = src.config
    if cfg is None:
        raise Exl2Error(ErrorCode.CONFIG_MISSING, "the calibration forward needs config.json",
                        file=str(Path(model_dir)))
    return ModelSpec.from_config(cfg), src
