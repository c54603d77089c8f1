"""The quantizer's forward: transformers' own modeling code, driven one decoder layer at a time.

Instead of a forward written by hand per architecture, the engine builds the ``*ForCausalLM`` skeleton that
transformers implements for the model's ``config.json`` (no remote code) with every parameter on the ``meta``
device (buffers such as RoPE frequency tables are real: they are computed from the config), and then:

* **captures the decoder layers' inputs generically**: the base model is run once per batch shape with every
  decoder layer's ``forward`` replaced by a recorder, so the positional and keyword arguments that this
  architecture passes (position embeddings, per-layer attention masks for sliding/full layers, cache flags) are
  exactly what transformers computes; the first layer's hidden state is captured the same way from the real
  embedding path (Gemma's embedding scale, ...);
* **materializes one decoder layer at a time** from the safetensors shards (``WeightSource``: pread, not the map),
  float32 on the compute device, and frees it afterwards: peak memory is one layer + activations + Hessians;
* **discovers the linear layers from the module tree** (every ``nn.Linear`` inside the decoder layer but the
  16-bit ones of ``layout.STAYS_16BIT``), and the structure of the layer by a probe run (which linears share an
  input, in which order they run, and where the residual stream between the attention and the MLP half can be
  observed), once per distinct layer build (Qwen-MoE's ``mlp_only_layers`` mix dense MLP and MoE layers);
* runs the layer with **substitute linears** (candidates, quantized reconstructions) swapped into the modules and
  **captures the inputs** of any linear (for the GPTQ Hessians).

EXL2 measures attention and MLP halves separately (``model.layers.i.self_attn`` and ``.mlp``).  The attention
half's output is the residual stream entering the norm in front of the MLP (observed by a pre-hook on that norm,
and the layer's remaining computation is skipped); the MLP half is the whole layer with the attention module's
result replayed from a cache.  For parallel-residual layers (Cohere: attention and MLP read the same normed
input) the attention half's output is the whole layer's output.

Linear names within a block are EXL2 setting names (``q_proj`` ... ``down_proj``): the module's own name where it
is one of them, else a small per-architecture map (Starcoder2 ``c_fc``/``c_proj`` are ``up_proj``/``down_proj``).
``linear_key(i, name)`` gives the checkpoint key of the module (``model.layers.3.mlp.c_fc``).  Fused projections
(Phi-3 ``qkv_proj``, ``gate_up_proj``) are split into q/k/v and gate/up for EXL2, as ExLlamaV2 stores them
(``split_fused``), and kept fused for GPTQ, the layout transformers and GPTQ loaders expect.

Mixture-of-experts blocks (``moe.py``): the fused 3-D expert parameters are built from the checkpoint's per-expert
tensors, every expert projection is a linear of its own (``experts.3.gate_proj``, checkpoint key
``...block_sparse_moe.experts.3.w1`` for Mixtral), run on the tokens the model's router sends it, and the block's
measurement key is ExLlamaV2's ``block_sparse_moe``.  The router stays 16-bit.  A shared expert (Qwen2-MoE's
``mlp.shared_expert``: a dense MLP fed every token of the block, scaled by its 16-bit ``shared_expert_gate``) is
three more linears of the block, ``shared_expert.gate_proj`` ..., which take the block's gate/up/down setting.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from ..errors import ErrorCode, Exl2Error
from ..layout import stays_16bit
from .hooks import Stop, first, params_on_meta, to_device
from .layer import LayerBlock, LayerRunner
from .moe import EXL2_FILE_NAMES, ROLES, find_experts
from .weights import Linear, WeightSource, dense_linear

__all__ = ["HFModel", "EXL2_ARCHS"]

#: model_type values whose EXL2 output ExLlamaV2 loads (others are calibrated too, with a warning).
EXL2_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "cohere", "granite", "starcoder2", "phi3",
              "mixtral", "qwen3_moe")

# module leaf name -> EXL2 setting name (the option tables name q/k/v/o and gate/up/down)
_ROLE = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
         "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
         "c_fc": "up_proj", "c_proj": "down_proj"}
_ATTN_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj")
_FUSED = ("qkv_proj", "gate_up_proj")      # kept fused (GPTQ output: the layout transformers loads)
_MLP_ROLES = ("gate_proj", "up_proj", "down_proj")


def _cfg_error(msg: str, code: ErrorCode = ErrorCode.ARCH_UNSUPPORTED) -> Exl2Error:
    return Exl2Error(code, msg, file="config.json")


@dataclass
class _Structure:
    """What the probe of layer 0 found."""

    groups: dict            # kind -> [tuple of names sharing one input], in call order
    mid_norm: str | None    # child of the layer whose input is the residual stream between attention and MLP
    attn_child: str         # child module holding the attention linears
    mlp_child: str


class HFModel:
    """A decoder-only causal LM described by ``config`` (a config.json dict), weights from ``src``.

    Raises ``Exl2Error`` ``ARCH_UNSUPPORTED`` when transformers has no such model class (callers fall back to
    weight-only quantization) and ``CONFIG_INVALID`` when transformers rejects the config.
    """

    def __init__(self, config: Mapping[str, Any], src: WeightSource, device: "str | torch.device" = "cpu",
                 split_fused: bool = True):
        try:
            import transformers
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:  # pragma: no cover - the quant extra depends on transformers
            raise _cfg_error("the calibrated quantizer needs transformers (pip install exl2fmt[quant])") from None
        if not isinstance(config, Mapping):
            raise _cfg_error(f"expected a JSON object, found {type(config).__name__}", ErrorCode.CONFIG_INVALID)
        d = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
        mtype = d.pop("model_type", None)
        if not isinstance(mtype, str):
            raise _cfg_error("config.json names no model_type")
        self.src, self.device = src, torch.device(device)
        self.split_fused = bool(split_fused)
        self.config_dict = dict(config)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf_cfg = AutoConfig.for_model(mtype, **d)
        except ValueError as e:
            raise _cfg_error(f"transformers {transformers.__version__} does not know model type {mtype!r} ({e})"
                             ) from None
        except (TypeError, KeyError, AttributeError) as e:
            raise _cfg_error(f"transformers rejects the config: {e}", ErrorCode.CONFIG_INVALID) from None
        if getattr(hf_cfg, "is_encoder_decoder", False):
            raise _cfg_error(f"{mtype} is an encoder-decoder model; the quantizer handles decoder-only models")
        hf_cfg.use_cache = False
        self.hf_config = hf_cfg
        try:
            with params_on_meta(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                             dtype=torch.float32)
                except (ValueError, ImportError):
                    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager",
                                                             dtype=torch.float32)
        except ValueError as e:
            raise _cfg_error(f"transformers has no causal-LM class for {mtype!r} ({e})") from None
        model.eval()
        for name, buf in list(model.named_buffers()):
            if buf.device.type != "meta":
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = buf.to(self.device)
        self.model, self.arch = model, mtype
        self.base = model.base_model
        self.num_layers = int(hf_cfg.num_hidden_layers)
        self.hidden_size = int(hf_cfg.hidden_size)
        self.vocab_size = int(hf_cfg.vocab_size)
        paths = {id(m): n for n, m in model.named_modules()}
        layers = [m for m in self.base.children() if isinstance(m, nn.ModuleList) and len(m) == self.num_layers]
        if len(layers) != 1:
            raise _cfg_error(f"{type(model).__name__}: cannot find the list of {self.num_layers} decoder layers")
        self.layers = layers[0]
        self.layers_path = paths[id(self.layers)]
        self.embed_module = model.get_input_embeddings()
        self.embed_name = paths[id(self.embed_module)] + ".weight"
        self.head_module = model.get_output_embeddings()
        if self.head_module is None or not isinstance(self.head_module, nn.Linear):
            raise _cfg_error(f"{type(model).__name__} has no linear LM head")
        norm = next((getattr(self.base, n) for n in ("norm", "final_layernorm", "ln_f", "final_norm")
                     if isinstance(getattr(self.base, n, None), nn.Module)), None)
        if norm is None:
            raise _cfg_error(f"{type(model).__name__}: cannot find the final norm")
        self.norm_module, self.norm_path = norm, paths[id(norm)]
        self.tied = bool(getattr(hf_cfg, "tie_word_embeddings", False)) or not src.has("lm_head.weight")
        self.head_name = self.embed_name if self.tied else "lm_head.weight"
        self._discover()
        self._kw_cache: dict = {}
        self._runner: LayerRunner | None = None
        self._v_structure: list[_Structure | None] = [None] * len(self._v_first)

    @property
    def structure(self) -> _Structure:
        """What a probe run of layer 0 finds (shared inputs, the norm between the halves); probed on first use,
        so building the model reads no weights (``validate --run`` checks every tensor first)."""
        return self.structure_of(0)

    @classmethod
    def open(cls, model_dir: Any, device: "str | torch.device" = "cpu", split_fused: bool = True) -> "HFModel":
        """The model of a directory (config.json and its safetensors shards); ``close()`` the result.  Raises
        ``CONFIG_MISSING`` without config.json, and what the constructor raises."""
        src = WeightSource(model_dir)
        try:
            if src.config is None:
                raise Exl2Error(ErrorCode.CONFIG_MISSING, "the model runner needs config.json", file=src.where)
            return cls(src.config, src, device, split_fused=split_fused)
        except BaseException:
            src.close()
            raise

    def close(self) -> None:
        """Free the materialized layer and close the weight source."""
        self.release()
        self.src.close()

    # --- names ----------------------------------------------------------------------------------------
    def _discover(self) -> None:
        """The linears of every decoder layer.  Layers may come in a few builds (Qwen-MoE's ``mlp_only_layers``:
        dense MLP layers among the MoE ones): each distinct build (a *variant*, by parameter names and shapes) is
        discovered once; a linear's name means the same module path and shape in every variant that has it."""
        self.path_of: dict[str, str] = {}          # name -> module path inside the layer
        self.kind_of: dict[str, str] = {}
        self.child_of: dict[str, str] = {}
        self.key_of: dict[str, str] = {}           # name -> checkpoint key suffix of the (split) layer
        self.part_of: dict[str, tuple[int, int]] = {}   # name -> output rows [a, b) of a fused module
        self.experts: "ExpertsLayout | None" = None
        self.expert_names: tuple[str, ...] = ()
        self._home: dict[str, int] = {}            # name -> the first layer that has it
        sigs: list = []
        self.variant_of: list[int] = []            # layer -> index of its variant
        for layer in self.layers:
            sig = self._layer_signature(layer)
            if sig not in sigs:
                sigs.append(sig)
            self.variant_of.append(sigs.index(sig))
        self._v_first = [self.variant_of.index(v) for v in range(len(sigs))]
        self._v_names: list[dict] = []             # per variant: kind -> names in run order
        self._v_linears: list[tuple] = []          # per variant: names of the nn.Linear parts
        self._v_moe: list[bool] = []
        for v, first in enumerate(self._v_first):
            linears, moe = self._discover_layer(self.layers[first], first)
            order = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                     "down_proj")
            rank = {r: k for k, r in enumerate(order)}
            names = {k: tuple(sorted((n for n in linears if self.kind_of[n] == k),
                                     key=lambda n: (n.count("."), rank.get(self.role(n), len(order)))))
                     for k in ("attn", "mlp")}
            if moe:
                names["mlp"] += self.expert_names
            if not names["attn"] or not names["mlp"]:
                raise _cfg_error(f"{self.arch}: expected attention and MLP linears in decoder layer {first}")
            self._v_names.append(names)
            self._v_linears.append(tuple(linears))
            self._v_moe.append(moe)
        self.names = self._v_names[0]

    def _discover_layer(self, layer: nn.Module, i: int) -> tuple[list[str], bool]:
        """The linears of one layer (merged into the model's name tables) and whether it has fused experts."""
        c = self.hf_config
        found: list[str] = []
        for path, mod in layer.named_modules():
            if not isinstance(mod, nn.Linear) or stays_16bit(path):
                continue                   # routers, Qwen2-MoE's shared_expert_gate: 16-bit (layout.STAYS_16BIT)
            child = path.split(".")[0]
            parent, _, leaf = path.rpartition(".")
            kind = "attn" if ("attn" in child or "attention" in child) else "mlp"
            parts = self._split(leaf, mod, c) if self.split_fused else None
            if parts is None:
                role = _ROLE.get(leaf) or (leaf if leaf in _FUSED and not self.split_fused else None)
                parts = [(role, None)]
            # a linear nested below the layer's child (Qwen2-MoE's mlp.shared_expert.gate_proj) keeps the path
            # between them in its name: shared_expert.gate_proj (its EXL2 setting name is the last part)
            inner = parent[len(child) + 1:] if parent != child else ""
            for role, rows in parts:
                if role is None or (role in _ROLE.values() and role not in (
                        _ATTN_ROLES if kind == "attn" else _MLP_ROLES)):
                    raise _cfg_error(f"{self.arch}: linear layer {path!r} of the decoder layer has no EXL2 role")
                name = f"{inner}.{role}" if inner else role
                if name in found:
                    raise _cfg_error(f"{self.arch}: two linear layers of decoder layer {i} are both {name!r}")
                key = f"{parent}.{role}" if rows is not None else path
                if name in self.path_of and (self.path_of[name], self.key_of[name], self.part_of.get(name)) != (
                        path, key, rows):
                    raise _cfg_error(f"{self.arch}: {name!r} is {path!r} in decoder layer {i} but "
                                     f"{self.path_of[name]!r} in another")
                self.path_of[name], self.kind_of[name], self.child_of[name] = path, kind, child
                self._home.setdefault(name, i)
                self.key_of[name] = key
                if rows is not None:
                    self.part_of[name] = rows
                found.append(name)
        # fused 3-D expert parameters (transformers 5's MoE blocks): one linear per expert projection
        lay = find_experts(self.arch, layer, self.src, self.layer_prefix(i))
        if lay is None:
            return found, False
        if self.experts is not None and lay != self.experts:
            raise _cfg_error(f"{self.arch}: the MoE blocks of decoder layers differ ({lay} / {self.experts})")
        self.experts = lay
        self.expert_names = tuple(lay.name(e, r) for e in range(lay.num_experts) for r in ROLES)
        for e in range(lay.num_experts):
            for r in ROLES:
                n = lay.name(e, r)
                self.kind_of[n], self.child_of[n] = "mlp", lay.block.split(".")[0]
                self.key_of[n] = lay.ckpt_key(e, r)
        return found, True

    def is_moe(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a mixture-of-experts block."""
        return self._v_moe[self.variant_of[i]]

    def layer_linears(self, i: int) -> tuple[str, ...]:
        """Names of layer ``i``'s ``nn.Linear`` parts (without the expert projections)."""
        return self._v_linears[self.variant_of[i]]

    def layer_expert_names(self, i: int) -> tuple[str, ...]:
        return self.expert_names if self.is_moe(i) else ()

    def build_firsts(self) -> list[int]:
        """The first layer of each build (variant) of the model's layers: those ``structure_of`` probes (a name's
        group without a layer, ``owner(name)``, probes every build)."""
        return list(self._v_first)

    def probe_layer(self, i: int) -> int | None:
        """The layer whose weights ``structure_of(i)`` still has to run (the first layer of ``i``'s build), or None
        once that build is probed."""
        v = self.variant_of[i]
        return None if self._v_structure[v] is not None else self._v_first[v]

    def structure_of(self, i: int) -> "_Structure":
        """The structure of layer ``i``'s build (variant), probed on the variant's first layer on first use."""
        v = self.variant_of[i]
        if self._v_structure[v] is None:
            self._v_structure[v] = self._probe(self._v_first[v])
        return self._v_structure[v]

    @staticmethod
    def _layer_signature(layer: nn.Module) -> tuple:
        return tuple(sorted((n, tuple(p.shape)) for n, p in layer.named_parameters()))

    @staticmethod
    def _split(leaf: str, mod: nn.Linear, c) -> list | None:
        """Phi-3's fused projections as EXL2 stores them, split: ``qkv_proj`` -> q/k/v rows, ``gate_up_proj`` ->
        gate (first half) and up (second half)."""
        if leaf == "qkv_proj":
            heads, kv = int(c.num_attention_heads), int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
            hd = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
            q, k = heads * hd, kv * hd
            if q + 2 * k != mod.out_features:
                return None
            return [("q_proj", (0, q)), ("k_proj", (q, q + k)), ("v_proj", (q + k, q + 2 * k))]
        if leaf == "gate_up_proj" and mod.out_features % 2 == 0:
            half = mod.out_features // 2
            return [("gate_proj", (0, half)), ("up_proj", (half, 2 * half))]
        return None

    def source_keys(self, i: int) -> list[str]:
        """Checkpoint keys (without ``.weight``/``.bias``) of the source modules that layer ``i``'s quantized
        linears replace (the fused module itself when it is written split)."""
        return sorted({f"{self.layer_prefix(i)}.{self.path_of[n]}" for n in self.layer_linears(i)}
                      | {self.linear_key(i, n) for n in self.layer_expert_names(i)})

    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def block_key(self, i: int, kind: str) -> str:
        """The block's key in measurement.json: ``model.layers.3.self_attn`` / ``.mlp``, and for a
        mixture-of-experts block ``.block_sparse_moe`` (ExLlamaV2's key for every MoE architecture)."""
        if kind == "mlp" and self.is_moe(i):
            return f"{self.layer_prefix(i)}.block_sparse_moe"
        return f"{self.layer_prefix(i)}.{'self_attn' if kind == 'attn' else 'mlp'}"

    def measurement_names(self, kind: str, i: int = 0) -> tuple[tuple[str, str], ...]:
        """(name in measurement.json, EXL2 setting name) of layer ``i``'s block's options: the linears' own
        names, and for a MoE block ExLlamaV2's ``w1``/``w3``/``w2`` (one setting for every expert's gate/up/down,
        and for a shared expert's)."""
        if kind == "mlp" and self.is_moe(i):
            return tuple((EXL2_FILE_NAMES[r], r) for r in ROLES)
        return tuple((n, n) for n in self.linear_names(kind, i))

    def role(self, name: str) -> str:
        """The EXL2 setting name of linear ``name`` (``experts.3.gate_proj`` -> ``gate_proj``)."""
        return name.rpartition(".")[2]

    def _ckpt_param(self, param: str) -> str:
        return self.experts.ckpt_param(param) if self.experts is not None else param

    def linear_key(self, i: int, name: str) -> str:
        return f"{self.layer_prefix(i)}.{self.key_of[name]}"

    def linear_names(self, kind: str, i: int = 0) -> tuple[str, ...]:
        """Names of the linears of layer ``i``'s attention (``kind`` "attn") or MLP ("mlp") block."""
        return self._v_names[self.variant_of[i]][kind]

    def linear_shape(self, name: str) -> tuple[int, int]:
        """(N out_features, K in_features) of the linear ``name`` (the same in every layer that has it)."""
        if name in self.expert_names:
            return self.experts.shape(self.role(name))
        m = self.layers[self._home[name]].get_submodule(self.path_of[name])
        a, b = self.part_of.get(name, (0, m.out_features))
        return int(b - a), int(m.in_features)

    def has_bias(self, name: str) -> bool:
        if name in self.expert_names:
            return False
        return self.layers[self._home[name]].get_submodule(self.path_of[name]).bias is not None

    def groups(self, kind: str, i: int = 0) -> list[tuple[str, ...]]:
        """The linears of layer ``i``'s block grouped by shared input, in the order the forward runs them."""
        return self.structure_of(i).groups[kind]

    def owner(self, name: str, i: int | None = None) -> str:
        """The first linear of ``name``'s shared-input group (in layer ``i``; a name's group is the same in
        every layer that has it)."""
        for st in ([self.structure_of(f) for f in self._v_first] if i is None else [self.structure_of(i)]):
            for g in st.groups[self.kind_of[name]]:
                if name in g:
                    return g[0]
        raise KeyError(name)

    # --- weights --------------------------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the model reads, name -> the shape transformers builds from the config: each
        decoder layer's parameters (the fused expert parameters as one tensor per expert), the embeddings, the
        final norm and, unless tied, ``lm_head.weight``."""
        want: dict[str, tuple] = {}
        lay = self.experts
        fused = {f"{lay.path}.gate_up_proj", f"{lay.path}.down_proj"} if lay is not None else set()
        for i, layer in enumerate(self.layers):
            for n, p in layer.named_parameters():
                if n not in fused:
                    want[f"{self.layer_prefix(i)}.{self._ckpt_param(n)}"] = tuple(p.shape)
            for n in self.layer_expert_names(i):  # the fused expert parameters are stored one tensor per expert
                want[f"{self.linear_key(i, n)}.weight"] = self.linear_shape(n)
        for n, p in self.norm_module.named_parameters():
            want[f"{self.norm_path}.{n}"] = tuple(p.shape)
        want[self.embed_name] = tuple(self.embed_module.weight.shape)
        if not self.tied:
            want["lm_head.weight"] = tuple(self.head_module.weight.shape)
        return want

    def check_weights(self) -> None:
        """Every tensor of ``expected_tensors`` exists with its shape (``TENSOR_NOT_FOUND`` / ``CONFIG_MISMATCH``
        naming the tensor)."""
        for name, shape in self.expected_tensors().items():
            if not self.src.has(name):
                raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, f"the {self.arch} model needs this tensor, found none",
                                file=self.src.where, tensor=name)
            found = self.src.shape(name)
            if found != shape:
                raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"config.json implies shape {list(shape)}, found "
                                f"{list(found)}", file=self.src.where, tensor=name)

    def materialize(self, module: nn.Module, prefix: str, device: torch.device) -> list:
        """Load ``module``'s parameters from the checkpoint (float32 on ``device``); returns what ``unmaterialize``
        needs to put the meta parameters back."""
        saved = []
        lay = self.experts if any(module is m for m in self.layers) else None
        for n, p in list(module.named_parameters()):
            owner, _, leaf = n.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            key = None
            if lay is not None and owner == lay.path:
                t = lay.fused(self.src, prefix, leaf, device)
            else:
                key = f"{prefix}.{self._ckpt_param(n) if lay is not None else n}"
                t = self.src.get(key, torch.float32, device)
            saved.append((sub, leaf, sub._parameters[leaf], key))
            sub._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        return saved

    @staticmethod
    def unmaterialize(saved: list) -> None:
        for sub, leaf, meta, _ in saved:
            sub._parameters[leaf] = meta

    # --- inputs of the decoder layers -----------------------------------------------------------------
    def layer_kwargs(self, B: int, T: int, device: torch.device, cache: bool = True) -> list[tuple[tuple, dict]]:
        """Per decoder layer, the extra (args, kwargs) transformers passes it for a [B, T] batch (kept for the
        last two batch shapes unless ``cache`` is False)."""
        key = (B, T, str(device))
        hit = self._kw_cache.get(key)
        if hit is not None:
            return hit
        records: list = []
        n = self.num_layers

        def make(i):
            def stub(*args, **kwargs):
                kwargs.pop("hidden_states", None)
                records.append((tuple(args[1:]), dict(kwargs)))
                if i == n - 1:
                    raise Stop
                return args[0] if args else torch.zeros(B, T, self.hidden_size)
            return stub

        for i, layer in enumerate(self.layers):
            layer.forward = make(i)
        try:
            with torch.no_grad():
                self.base(inputs_embeds=torch.zeros(B, T, self.hidden_size, device=device), use_cache=False)
        except Stop:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
        if len(records) != n:
            raise _cfg_error(f"{self.arch}: the base model called {len(records)} of {n} decoder layers")
        out = [(a, {k: v for k, v in kw.items() if k not in ("past_key_values", "cache", "past_key_value")})
               for a, kw in records]
        out = [( to_device(a, device), to_device(kw, device)) for a, kw in out]
        if not cache:
            return out
        if len(self._kw_cache) >= 2:          # a full batch and the smaller last one
            self._kw_cache.pop(next(iter(self._kw_cache)))
        self._kw_cache[key] = out
        return out

    def embed(self, ids: torch.Tensor, device: "torch.device | str | None" = None) -> torch.Tensor:
        """The first decoder layer's input for token ids int64 [B, T]: float32 [B, T, hidden], computed by the
        model's own embedding path.  Ids outside 0..vocab-1 read row 0 (as ExLlamaV2's quantizer does)."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise Exl2Error(ErrorCode.USAGE, f"expected token ids int [rows, length], found {ids.dtype} "
                            f"{list(ids.shape)}")
        dev = torch.device(device) if device is not None else self.device
        ids = ids.to(dtype=torch.int64)
        ids = torch.where((ids >= 0) & (ids < self.vocab_size), ids, torch.zeros_like(ids))
        # only the rows that occur are widened to float32 (a 128k x 8192 table is 4 GiB in float32)
        uniq, inv = torch.unique(ids, return_inverse=True)
        table = self.src.get(self.embed_name, self.src.stored_dtype(self.embed_name))
        rows = table[uniq].to(device=dev, dtype=torch.float32)
        del table
        emb = self.embed_module
        saved_w, saved_pad = emb._parameters["weight"], emb.padding_idx
        emb._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        emb.padding_idx = None
        got: list = []
        first = self.layers[0]

        def stub(*args, **kwargs):
            got.append(args[0] if args else kwargs["hidden_states"])
            raise Stop

        first.forward = stub
        try:
            with torch.no_grad():
                self.base(input_ids=inv.view_as(ids).to(dev), use_cache=False)
        except Stop:
            pass
        finally:
            del first.forward
            emb._parameters["weight"], emb.padding_idx = saved_w, saved_pad
        return got[0].float()

    # --- layers ---------------------------------------------------------------------------------------
    def runner(self, i: int, device: "torch.device | str | None" = None) -> "LayerRunner":
        """Decoder layer ``i`` with its weights materialized (the previous layer's are freed)."""
        dev = torch.device(device) if device is not None else self.device
        if self._runner is not None and self._runner.i == i and self._runner.device == dev:
            return self._runner
        self.release()
        for first in self._v_first:     # probe each layer build (once) before a layer is materialized for a run
            self.structure_of(first)
        self._runner = LayerRunner(self, i, dev)
        return self._runner

    def release(self) -> None:
        if self._runner is not None:
            self._runner.free()
            self._runner = None

    def block(self, i: int, kind: str, batches: list[slice], device=None) -> "LayerBlock":
        return LayerBlock(self.runner(i, device), kind, batches)

    def _probe(self, i: int = 0) -> _Structure:
        """Run layer ``i`` on a few random tokens and record its structure."""
        r = LayerRunner(self, i, self.device)
        try:
            g = torch.Generator().manual_seed(0)
            T = 4
            h = torch.randn(1, T, self.hidden_size, generator=g).to(self.device)
            args, kw = self.layer_kwargs(1, T, self.device, cache=False)[i]
            calls: list = []          # (name, input tensor) in call order
            child_out: dict = {}
            child_order: list = []
            hooks = []
            for name in self.layer_linears(i):
                mod = r.layer.get_submodule(self.path_of[name])
                def pre(m, a, _n=name):
                    calls.append((_n, a[0]))
                hooks.append(mod.register_forward_pre_hook(pre))
            for cname, child in r.layer.named_children():
                def before(m, a, kw_, _c=cname):
                    child_order.append(("in", _c, a[0] if a else kw_.get("hidden_states")))
                hooks.append(child.register_forward_pre_hook(before, with_kwargs=True))

                def after(m, a, o, _c=cname):
                    child_order.append(("out", _c, None))
                    child_out[_c] = first(o)
                hooks.append(child.register_forward_hook(after))
            try:
                with torch.no_grad():
                    r.layer(h, *args, **kw)
            finally:
                for hk in hooks:
                    hk.remove()
        finally:
            r.free()
        # group by input identity: linears fed the same tensor share one Hessian
        groups = {"attn": [], "mlp": []}
        reps: list = []       # (input tensor, kind, group index)
        for name, x in calls:
            kind = self.kind_of[name]
            if any(name in grp for grp in groups[kind]):
                continue
            for y, kd, gi in reps:
                if y is x and kd == kind:
                    groups[kind][gi] = groups[kind][gi] + (name,)
                    break
            else:
                reps.append((x, kind, len(groups[kind])))
                groups[kind].append((name,))
        if self.is_moe(i):       # each expert's gate and up read its routed tokens; down its own input
            for e in range(self.experts.num_experts):
                g, u, d = (self.experts.name(e, r) for r in ROLES)
                groups["mlp"] += [(g, u), (d,)]
        missing = [n for n in self.layer_linears(i) if not any(n in grp for k in groups for grp in groups[k])]
        if missing:
            raise _cfg_error(f"{self.arch}: the probe forward of decoder layer {i} never ran {missing[0]}")
        attn_child = self.child_of[self.linear_names("attn", i)[0]]
        mlp_child = self.child_of[self.linear_names("mlp", i)[0]]
        # the norm in front of the MLP: the child whose output the MLP receives, run after attention finished
        mlp_in = next((x for ev, c, x in child_order if ev == "in" and c == mlp_child), None)
        attn_done = next((k for k, (ev, c, _) in enumerate(child_order) if ev == "out" and c == attn_child), None)
        mid = None
        for k, (ev, c, _) in enumerate(child_order):
            if ev == "in" and c not in (attn_child, mlp_child) and child_out.get(c) is mlp_in and mlp_in is not None:
                if attn_done is not None and k > attn_done:
                    mid = c
                break
        return _Structure(groups=groups, mid_norm=mid, attn_child=attn_child, mlp_child=mlp_child)

    # --- head -----------------------------------------------------------------------------------------
    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm: h float [..., hidden] -> float [..., hidden] (the head's input)."""
        if not hasattr(self, "_norm_saved"):
            self._norm_saved = self.materialize(self.norm_module, self.norm_path, h.device)
            self._norm_device = h.device
        elif self._norm_device != h.device:
            self.unmaterialize(self._norm_saved)
            self._norm_saved = self.materialize(self.norm_module, self.norm_path, h.device)
            self._norm_device = h.device
        with torch.no_grad():
            return self.norm_module(h)

    def dense_head(self, device) -> Linear:
        b = self.src.get("lm_head.bias", torch.float32, device) if self.src.has("lm_head.bias") else None
        return dense_linear(self.src.get(self.head_name, torch.float32, device), b)

    def head_bias(self, device):
        return self.src.get("lm_head.bias", torch.float32, device) if self.src.has("lm_head.bias") else None

    def postprocess_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The scaling that the causal-LM class applies after its head (Cohere's logit_scale, Granite's
        logits_scaling, Gemma 2/3's final soft-capping)."""
        c = self.hf_config
        if getattr(c, "logit_scale", None) is not None and self.arch.startswith("cohere"):
            logits = logits * c.logit_scale
        if getattr(c, "logits_scaling", None) is not None and self.arch.startswith("granite"):
            logits = logits / c.logits_scaling
        cap = getattr(c, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def logits(self, h: torch.Tensor, head: Linear | None = None) -> torch.Tensor:
        """h float [..., hidden] (the last layer's output) -> logits float32 [..., vocab]."""
        x = self.final_norm(h)
        head = head or self.dense_head(h.device)
        return self.postprocess_logits(head(x)).float()

    def forward(self, ids: torch.Tensor, linears_for_layer: Callable[[str], Linear | None] | None = None,
                device: "torch.device | str | None" = None) -> torch.Tensor:
        """The whole model: ids int64 [B, T] -> logits float32 [B, T, vocab], one layer's weights at a time.
        ``linears_for_layer(key)`` may supply a substitute for any linear by its checkpoint key
        (``model.layers.{i}.self_attn.q_proj``, ..., ``lm_head``)."""
        dev = torch.device(device) if device is not None else self.device
        h = self.embed(ids, dev)
        get = linears_for_layer or (lambda key: None)
        for i in range(self.num_layers):
            r = self.runner(i, dev)
            subs = {n: f for n in (*self.layer_linears(i), *self.layer_expert_names(i))
                    if (f := get(self.linear_key(i, n))) is not None}
            h = r.forward(h, subs)
        self.release()
        return self.logits(h, get("lm_head"))
