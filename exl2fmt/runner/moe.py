"""Mixture-of-experts blocks for the transformers-driven engine (``model.HFModel``).

transformers 5 keeps a MoE block's experts in memory as two fused 3-D parameters of one module (Mixtral's
``MixtralExperts``, Qwen3-MoE's ``Qwen3MoeExperts``, ...):

* ``gate_up_proj`` float [E, 2 I, H]: expert e's gate rows [0, I) and up rows [I, 2 I) (``act(gate x) * up x``);
* ``down_proj`` float [E, H, I];

called as ``experts(hidden [T, H], top_k_index int [T, k], top_k_weights float [T, k])`` by the block, whose
router (``gate``) computes the routing.  Checkpoints store one 2-D tensor per expert projection; transformers'
conversion mapping merges them on load.  Two naming families exist, and which one a checkpoint uses is read from
its tensor names:

* Mixtral: ``{layer}.block_sparse_moe.experts.{e}.w1|w3|w2`` (gate | up | down) and ``.block_sparse_moe.gate``;
* Qwen-MoE style: ``{layer}.mlp.experts.{e}.gate_proj|up_proj|down_proj`` and ``.mlp.gate``.

The quantizer treats every expert projection as its own linear, named ``experts.{e}.gate_proj`` etc. inside the
block (the suffix is the EXL2 setting name), written under the checkpoint's per-expert key (what ExLlamaV2 and
transformers load).  The router stays 16-bit.

**Hessians per expert.**  ``routed_forward`` replaces the experts module's forward while the engine substitutes or
captures linears: each expert runs on exactly the tokens the model's own router sends it (the router and its
top-k are transformers' code), so the inputs captured for expert e's projections are the routed tokens only.

**Few or no routed tokens** (``pad_expert_hessian``).  An expert that saw n routed tokens, fewer than its K input
features, has a rank-deficient sample second moment, and GPTQ would compensate errors along directions it never
observed.  Its Hessian is padded to K tokens' worth with a prior:  ``H = (S_routed + (K - n) P) / K``.

* gate/up: ``P`` is the second moment of *all* tokens entering the block (every expert's gate/up reads the same
  normed hidden state, the routed tokens are a subset of it; ExLlamaV2 uses this all-token Hessian for every
  expert's w1/w3);
* down: its input (the expert's own intermediate activation) exists only for routed tokens, so ``P`` is the
  identity scaled to the routed part's mean diagonal (1 when there is none).  With zero tokens this is the
  identity Hessian, i.e. round-to-nearest with the scale search, which is also what ExLlamaV2 does for an expert
  without calibration.

An expert with zero tokens therefore gets valid weights: the all-token Hessian for gate/up, RTN for down.

**Bounded Hessian memory** (``hessian_chunks``).  The EXL2 measurement needs every linear's Hessian (and its
factorization) to make the block's candidates.  A MoE block has many: Mixtral-8x7B's eight down projections
alone are 8 x 14336^2 float32 = 6.6 GB, twice that once factorized.  The block's linears are therefore taken
in chunks whose Hessians fit ``LIVE_HESSIAN_BYTES``: one sweep of the block over the calibration rows per chunk
accumulates that chunk's Hessians, its candidates are made and the Hessians freed before the next chunk.  Each
Hessian is the same sum over the same routed tokens in the same order whatever the chunking, so the output is
byte-identical; a model whose block fits the budget (every dense model, small MoE models) takes one sweep, as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ErrorCode, Exl2Error

__all__ = ["ExpertsLayout", "find_experts", "routed_forward", "pad_expert_hessian", "ROLES", "EXL2_FILE_NAMES",
           "hessian_chunks", "hessian_bytes", "LIVE_HESSIAN_BYTES"]

#: EXL2 setting names of an expert's projections, in the order an expert runs them
ROLES = ("gate_proj", "up_proj", "down_proj")
#: the names ExLlamaV2 gives an expert's projections in measurement.json (always Mixtral's, whatever the model)
EXL2_FILE_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
#: checkpoint leaf names of (gate, up, down), per naming family
_LEAF_FAMILIES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
#: checkpoint names of the MoE block besides the module's own (Mixtral's ``block_sparse_moe``)
_CKPT_BLOCKS = ("block_sparse_moe",)


@dataclass(frozen=True)
class ExpertsLayout:
    """Where a decoder layer's fused experts live in the module tree and in the checkpoint.

    ``path``: the experts module inside the layer (``mlp.experts``); ``block``: its parent, the MoE block
    (``mlp``); ``ckpt_block``: the block's name in the checkpoint (``block_sparse_moe`` or ``mlp``);
    ``leaves``: EXL2 role -> checkpoint leaf (``gate_proj`` -> ``w1``); ``num_experts`` E, ``hidden`` H,
    ``inter`` I."""

    path: str
    block: str
    ckpt_block: str
    leaves: Mapping[str, str]
    num_experts: int
    hidden: int
    inter: int

    def name(self, e: int, role: str) -> str:
        """The linear's name inside the block: ``experts.3.gate_proj``."""
        return f"experts.{e}.{role}"

    def ckpt_key(self, e: int, role: str) -> str:
        """Checkpoint key (inside the layer, without ``.weight``) of expert e's projection."""
        return f"{self.ckpt_block}.experts.{e}.{self.leaves[role]}"

    def ckpt_param(self, param: str) -> str:
        """The checkpoint name of a non-expert parameter of the layer (the router: ``mlp.gate.weight`` ->
        ``block_sparse_moe.gate.weight``)."""
        if self.ckpt_block != self.block and param.startswith(self.block + "."):
            return self.ckpt_block + param[len(self.block):]
        return param

    def shape(self, role: str) -> tuple[int, int]:
        """(N out, K in) of one expert's projection."""
        return (self.hidden, self.inter) if role == "down_proj" else (self.inter, self.hidden)

    def fused(self, src, prefix: str, param: str, device) -> torch.Tensor:
        """The fused 3-D parameter ``param`` (``gate_up_proj`` / ``down_proj``) of layer ``prefix``, float32, built
        from the per-expert checkpoint tensors."""
        if param == "down_proj":
            parts = [src.get(f"{prefix}.{self.ckpt_key(e, 'down_proj')}.weight", torch.float32, device)
                     for e in range(self.num_experts)]
        else:
            parts = [torch.cat([src.get(f"{prefix}.{self.ckpt_key(e, r)}.weight", torch.float32, device)
                                for r in ("gate_proj", "up_proj")], dim=0) for e in range(self.num_experts)]
        return torch.stack(parts)


def _unsupported(arch: str, why: str) -> Exl2Error:
    return Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"{arch}: {why}", file="config.json")


def find_experts(arch: str, layer: nn.Module, src, layer_prefix: str) -> ExpertsLayout | None:
    """The fused-experts layout of ``layer`` (None when it has no 3-D parameters).  Raises ``ARCH_UNSUPPORTED``
    for fused parameters this module does not know how to drive (other names, biases, transposed layouts, a
    checkpoint that stores no per-expert tensors), so the caller falls back to weight-only quantization."""
    owners = {n.rpartition(".")[0] for n, p in layer.named_parameters() if p.dim() >= 3}
    if not owners:
        return None
    if len(owners) != 1:
        raise _unsupported(arch, f"more than one module with fused expert parameters ({sorted(owners)})")
    path = owners.pop()
    mod = layer.get_submodule(path)
    params = dict(mod.named_parameters(recurse=False))
    gu, dn = params.get("gate_up_proj"), params.get("down_proj")
    if set(params) != {"gate_up_proj", "down_proj"} or gu is None or dn is None or gu.dim() != 3 or dn.dim() != 3 \
            or getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False):
        raise _unsupported(arch, f"fused experts {path!r} with parameters {sorted(params)} are not the "
                           "gate_up_proj [E, 2I, H] / down_proj [E, H, I] layout the quantizer drives")
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(dn.shape) != (E, H, two_i // 2) or not callable(getattr(mod, "act_fn", None)):
        raise _unsupported(arch, f"fused experts {path!r}: shapes {list(gu.shape)} / {list(dn.shape)}")
    block = path.rpartition(".")[0]
    if not block or path.rpartition(".")[2] != "experts":
        raise _unsupported(arch, f"fused experts at {path!r}: expected <block>.experts")
    for ck in (block,) + _CKPT_BLOCKS:
        for leaves in _LEAF_FAMILIES:
            if src.has(f"{layer_prefix}.{ck}.experts.0.{leaves[0]}.weight"):
                return ExpertsLayout(path=path, block=block, ckpt_block=ck, leaves=dict(zip(ROLES, leaves)),
                                     num_experts=int(E), hidden=int(H), inter=int(two_i // 2))
    raise _unsupported(arch, f"the checkpoint stores no per-expert tensors for {layer_prefix}.{path} (expected "
                       f"{layer_prefix}.{block}.experts.0.gate_proj.weight or the Mixtral names)")


def routed_forward(mod: nn.Module, lay: ExpertsLayout, subs: Mapping[str, Callable] | None,
                   capture: dict | None, routed: list) -> Callable:
    """A replacement for the experts module's forward, numerically the module's own computation, with substitute
    linears ``subs`` (name -> Linear) for any expert projection; ``capture`` (a dict) receives each projection's
    routed input (name -> float [n_e, K]; gate and up share one tensor) and ``capture[lay.path]`` the block's
    input of all tokens; ``routed`` (a list) receives the number of tokens routed to each expert."""
    subs = subs or {}
    E, I = lay.num_experts, lay.inter

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *a, **k):
        out = torch.zeros_like(hidden_states)
        if capture is not None:
            capture[lay.path] = hidden_states
        counts = []
        for e in range(E):
            tok, pos = torch.where(top_k_index == e)
            counts.append(int(tok.numel()))
            x = hidden_states[tok]
            names = [lay.name(e, r) for r in ROLES]
            if capture is not None:
                capture[names[0]] = capture[names[1]] = x
            fg, fu, fd = (subs.get(n) for n in names)
            if fg is None and fu is None:
                gate, up = F.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
            else:
                gate = fg(x) if fg is not None else F.linear(x, mod.gate_up_proj[e, :I])
                up = fu(x) if fu is not None else F.linear(x, mod.gate_up_proj[e, I:])
            mid = mod.act_fn(gate) * up
            if capture is not None:
                capture[names[2]] = mid
            y = fd(mid) if fd is not None else F.linear(mid, mod.down_proj[e])
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        routed.append(counts)
        return out
    return forward


def pad_expert_hessian(acc: Any, prior: Any | None) -> int:
    """Apply the few-tokens rule (module docstring) to ``acc`` (a ``gptq.HessianAccumulator`` holding the routed
    sum ``S`` of ``n`` tokens) in place: when ``n < K``, add ``(K - n)`` tokens' worth of ``prior`` (a
    ``HessianAccumulator`` of all tokens, for gate/up) or of a scaled identity (``prior`` None, for down).
    Returns the number of prior tokens added (0 when the expert saw at least K tokens)."""
    K, n = acc.K, acc.rows
    if n >= K:
        return 0
    pad = K - n
    if prior is not None and prior.rows > 0:
        acc.H.add_(prior.H, alpha=pad / prior.rows)
    else:
        c = float(torch.diagonal(acc.H).mean()) / n if n > 0 else 1.0
        if not c > 0:
            c = 1.0
        acc.H.diagonal().add_(pad * c)
    acc.rows = K
    return pad


#: The most bytes of Hessians (with their factorizations, ``hessian_bytes``) the measurement keeps alive at once.
LIVE_HESSIAN_BYTES = 4 << 30


def hessian_bytes(K: int) -> int:
    """Bytes one K-feature Hessian takes while its candidates are made: the float32 [K, K] matrix and the float32
    [K, K] factor ``gptq.prepare`` keeps beside it."""
    return 8 * int(K) * int(K)


def hessian_chunks(owners: "list[str]", K: Mapping[str, int], budget: int | None = None) -> list[list[str]]:
    """Split ``owners`` (the linears whose Hessians a block needs, in order) into consecutive chunks whose
    ``hessian_bytes`` sum to at most ``budget`` (``LIVE_HESSIAN_BYTES``); a single Hessian above it is a chunk of
    its own.  ``K``: owner -> its input features.  Returns [[owner]], one list when everything fits."""
    budget = LIVE_HESSIAN_BYTES if budget is None else int(budget)
    chunks: list[list[str]] = []
    used = 0
    for ow in owners:
        b = hessian_bytes(K[ow])
        if not chunks or used + b > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(ow)
        used += b
    return chunks or [[]]
