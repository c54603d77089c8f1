"""Packed mixture-of-experts: transformers 5's stacked experts replaced by one packed linear per expert projection.

transformers 5 holds a MoE block's experts as one module with two 3-D parameters (``gate_up_proj`` float
[E, 2 I, H], ``down_proj`` float [E, H, I]; Mixtral, Qwen2/3-MoE, OLMoE ...), called by the block as
``experts(hidden [T, H], top_k_index int [T, k], top_k_weights float [T, k]) -> [T, H]``.  Quantized checkpoints
store one linear per expert projection (``{layer}.mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, or
Mixtral's ``{layer}.block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``), and transformers' loader would merge
their ``.weight`` tensors into the 3-D parameters.  A packed model cannot be merged (each expert has its own
groups, permutation, scales), so ``install_packed_experts`` swaps the stacked module for ``PackedExperts``: a list
of experts, each holding its three packed linears under the checkpoint's own leaf names, so that the module path
of a stored tensor is its checkpoint key (Mixtral: after transformers' own ``block_sparse_moe`` -> ``mlp``
rename, which it applies to every key).  The forward is the stacked module's computation, expert by expert:
``y += w_tk * down(act(gate(x_t)) * up(x_t))`` over the tokens routed to each expert.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from ..errors import ErrorCode, Exl2Error

__all__ = ["PackedExperts", "install_packed_experts", "stacked_experts", "LEAF_FAMILIES", "CKPT_BLOCK_ALIASES"]

#: checkpoint leaf names of an expert's (gate, up, down) projections, per naming family
LEAF_FAMILIES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: other names a checkpoint gives the MoE block of a layer (Mixtral's ``block_sparse_moe`` for transformers' ``mlp``)
CKPT_BLOCK_ALIASES = ("block_sparse_moe",)


class _Expert(nn.Module):
    """One expert: its gate / up / down packed linears, registered under the checkpoint's leaf names."""

    def __init__(self, leaves: tuple[str, str, str], parts: tuple[nn.Module, nn.Module, nn.Module]):
        super().__init__()
        self._roles = leaves
        for leaf, mod in zip(leaves, parts):
            self.add_module(leaf, mod)

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        gate, up, down = (getattr(self, leaf) for leaf in self._roles)
        return down(act(gate(x)) * up(x))


class PackedExperts(nn.Module):
    """Drop-in for a stacked experts module: child ``"e"`` (``self[e]``) is expert e (``.gate_proj`` ... or
    ``.w1`` ...), ``act_fn`` the stacked module's activation.

    forward(hidden_states float [T, H], top_k_index int64 [T, k], top_k_weights float [T, k]) -> float [T, H]
    (the dtype of ``hidden_states``)."""

    def __init__(self, experts: list[_Expert], act_fn: Any):
        super().__init__()
        for e, ex in enumerate(experts):
            self.add_module(str(e), ex)
        self.num_experts = len(experts)
        self.act_fn = act_fn

    def __getitem__(self, e: int) -> _Expert:
        return self._modules[str(int(e))]

    def __len__(self) -> int:
        return self.num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        hit = torch.unique(top_k_index[(top_k_index >= 0) & (top_k_index < self.num_experts)]).tolist()
        for e in hit:
            tok, pos = torch.where(top_k_index == e)
            y = self[e](hidden_states[tok], self.act_fn) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """path -> module of every stacked experts module of ``model`` (a module named ``experts`` whose own
    parameters include a 3-D ``gate_up_proj`` and ``down_proj``)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, PackedExperts) or name.rpartition(".")[2] != "experts":
            continue
        own = dict(mod.named_parameters(recurse=False))
        if own.get("gate_up_proj") is not None and own["gate_up_proj"].dim() == 3:
            out[name] = mod
    return out


def _unsupported(path: str, why: str) -> Exl2Error:
    return Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"packed experts at {path}: {why}", tensor=path)


def _experts_of(path: str, linears: dict[str, nn.Module]) -> dict[tuple[int, str], str]:
    """(expert, leaf) -> stored key of the linears of the stacked module at ``path`` (``{layer}.{block}.experts``),
    under the block's own name or a checkpoint alias."""
    block = path.rpartition(".")[0]
    layer = block.rpartition(".")[0]
    names = [block] + [f"{layer}.{a}" if layer else a for a in CKPT_BLOCK_ALIASES]
    pat = re.compile(r"^(?:%s)\.experts\.(\d+)\.(\w+)$" % "|".join(map(re.escape, names)))
    found = {}
    for key in linears:
        m = pat.match(key)
        if m:
            found[(int(m.group(1)), m.group(2))] = key
    return found


def install_packed_experts(model: nn.Module, linears: dict[str, nn.Module]) -> set[str]:
    """Replace every stacked experts module of ``model`` whose experts ``linears`` (stored key -> packed linear)
    holds by a ``PackedExperts`` over them; returns the keys used.  Raises ``ARCH_UNSUPPORTED`` when a stacked
    module's stored experts are incomplete (an expert or a projection missing, or leaf names of no known family)
    or the module is of a layout this forward does not compute (biases, transposed weights)."""
    used: set[str] = set()
    for path, mod in stacked_experts(model).items():
        found = _experts_of(path, linears)
        if not found:
            continue
        E = int(mod.gate_up_proj.shape[0])
        if getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False) or \
                not callable(getattr(mod, "act_fn", None)):
            raise _unsupported(path, f"{type(mod).__name__} (biases, transposed weights or no act_fn) is not the "
                               "gate_up_proj [E, 2I, H] / down_proj [E, H, I] layout the packed experts compute")
        leaves = next((f for f in LEAF_FAMILIES if {leaf for _, leaf in found} == set(f)), None)
        if leaves is None:
            raise _unsupported(path, f"stored projections {sorted({leaf for _, leaf in found})} are none of the "
                               f"known families {[list(f) for f in LEAF_FAMILIES]}")
        missing = [(e, leaf) for e in range(E) for leaf in leaves if (e, leaf) not in found]
        extra = sorted(e for e, _ in found if e >= E)
        if missing or extra:
            first = missing[0] if missing else (extra[0], leaves[0])
            raise _unsupported(path, f"{len(missing)} expert projections not stored as packed linears, "
                               f"{len(extra)} beyond the {E} experts (first: expert {first[0]} {first[1]})")
        experts = [_Expert(leaves, tuple(linears[found[(e, leaf)]] for leaf in leaves)) for e in range(E)]
        owner, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, PackedExperts(experts, mod.act_fn))
        used.update(found.values())
    return used


def _aliases(name: str) -> list[str]:
    """``name`` and its checkpoint spellings (``.mlp.`` -> ``.block_sparse_moe.``)."""
    return [name] + [name.replace(".mlp.", f".{a}.", 1) for a in CKPT_BLOCK_ALIASES if ".mlp." in name]


def stored_param(name: str, stored: "set[str]", get) -> torch.Tensor | None:
    """The tensor of the model parameter ``name`` from the files (``stored``: their tensor names; ``get(name)``
    reads one as a torch tensor in the model dtype): by its own name or a checkpoint alias (Mixtral's router
    ``block_sparse_moe.gate.weight``), or, for a stacked experts parameter left dense (``{path}.gate_up_proj``
    [E, 2I, H] / ``{path}.down_proj`` [E, H, I]), stacked from the per-expert tensors; None when not stored."""
    for n in _aliases(name):
        if n in stored:
            return get(n)
    path, _, leaf = name.rpartition(".")
    if path.rpartition(".")[2] != "experts" or leaf not in ("gate_up_proj", "down_proj"):
        return None
    for p in _aliases(path):
        for gate, up, down in LEAF_FAMILIES:
            if f"{p}.0.{gate}.weight" not in stored:
                continue
            parts, e = [], 0
            while f"{p}.{e}.{gate}.weight" in stored:
                parts.append(get(f"{p}.{e}.{down}.weight") if leaf == "down_proj" else
                             torch.cat([get(f"{p}.{e}.{gate}.weight"), get(f"{p}.{e}.{up}.weight")], dim=0))
                e += 1
            return torch.stack(parts)
    return None
