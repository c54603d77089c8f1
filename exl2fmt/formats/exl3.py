"""EXL3 (ExLlamaV3 trellis codes): recognised and named, never decoded - only its inspect row lives here."""

from __future__ import annotations

from ..errors import Issue

__all__ = ["inspect_facts"]


def inspect_facts(model, info, config, issues: list[Issue]) -> dict:
    """The EXL3 part of an ``inspect`` layer row (headers only); ``info`` is a ``detect.LayerInfo``."""
    K, N = info.in_features, info.out_features
    out = {"K": K, "N": N, "G": info.groups, "plan": None, "hist": {}, "act": None, "bpw": None, "error": None}
    if info.bits:
        out["plan"] = f"{info.bits}b trellis"
        if K and N:
            out["hist"][info.bits] = K * N
    return out
