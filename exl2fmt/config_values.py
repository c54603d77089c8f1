"""Number sanity of ``config.json`` and ``quantization_config``: every number exl2fmt reads from them is checked
here before any arithmetic uses it.

``config_value_issues(config, qc, file)`` returns one ``CONFIG_VALUE_INVALID`` issue (severity error) per known
key whose value is not a plain number in its range: a JSON ``true`` where a count belongs, a float where an
integer belongs, NaN / Infinity (Python's JSON reader accepts those literals), zero or negative sizes, and
integers past sane model limits (llama.cpp caps its own hyper-parameters the same way; a 10**30 hidden size
would otherwise reach NumPy as an ``OverflowError``).  ``null`` means "absent" and is accepted; unknown keys
are ignored.  ``sane_int`` / ``finite_number`` are the guards readers use so that a value the check rejects is
treated as unknown, never computed with.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ErrorCode, Issue, Severity

__all__ = ["INT_LIMITS", "FLOAT_LIMITS", "QC_LIMITS", "config_value_issues", "sane_int", "finite_number"]

#: integer hyper-parameters: key -> (lowest, highest) accepted value
INT_LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 20), "n_embd": (1, 1 << 20), "d_model": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22), "n_inner": (1, 1 << 22), "ffn_dim": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "num_attention_heads": (1, 1 << 16), "n_head": (1, 1 << 16), "num_key_value_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "num_hidden_layers": (1, 1 << 16), "n_layer": (1, 1 << 16),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, (1 << 31) - 1),
    "num_experts": (0, 1 << 16), "num_local_experts": (0, 1 << 16), "n_routed_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1 << 16),
}
#: float hyper-parameters: key -> (exclusive lower bound, inclusive upper bound); must be finite
FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0), "layer_norm_eps": (0.0, 1.0), "layer_norm_epsilon": (0.0, 1.0),
    "rope_theta": (0.0, 1e30),
}
#: quantization_config numbers: key -> (kind, lowest, highest); group_size also accepts -1 (one group)
QC_LIMITS: dict[str, tuple[str, float, float]] = {
    "bits": ("number", 0.0, 64.0),       # EXL2: average bpw (float); GPTQ/AWQ: integer bits
    "head_bits": ("int", 1, 16),
    "group_size": ("int", 1, (1 << 31) - 1),
    "q_group_size": ("int", 1, (1 << 31) - 1),
    "w_bit": ("int", 1, 64),
    "damp_percent": ("number", 0.0, 1.0),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sane_int(v: Any, lo: int = 1, hi: int = (1 << 31) - 1) -> int | None:
    """``v`` when it is a plain integer in [lo, hi], else None (unknown)."""
    return v if _is_int(v) and lo <= v <= hi else None


def finite_number(v: Any) -> float | int | None:
    """``v`` when it is a finite int or float (not bool), else None."""
    if _is_int(v):
        return v if abs(v) < 1 << 63 else None
    if isinstance(v, float) and math.isfinite(v):
        return v
    return None


def _show(v: Any) -> str:
    if _is_int(v) and abs(v) >= 10 ** 20:
        return f"an integer of {len(str(abs(v)))} digits"
    s = repr(v)
    return s if len(s) <= 40 else s[:40] + "..."


def _int_problem(v: Any, lo: int, hi: int) -> str | None:
    if not _is_int(v):
        return f"expected an integer in {lo}..{hi}, found {_show(v)}"
    if not lo <= v <= hi:
        return f"expected an integer in {lo}..{hi}, found {_show(v)}"
    return None


def config_value_issues(config: Any, qc: Any = None, file: str | None = None) -> list[Issue]:
    """CONFIG_VALUE_INVALID issues for the numbers of ``config`` (top level and ``text_config``) and of the
    quantization config ``qc`` (``config["quantization_config"]`` when None).  Linear in the number of keys."""
    issues: list[Issue] = []
    if not isinstance(config, dict):
        config = {}

    def add(key: str, msg: str) -> None:
        issues.append(Issue(ErrorCode.CONFIG_VALUE_INVALID, f"{key}: {msg}", file=file, severity=Severity.ERROR))

    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append(("text_config.", config["text_config"]))
    for prefix, cfg in scopes:
        for key, (lo, hi) in INT_LIMITS.items():
            v = cfg.get(key)
            if v is None:
                continue
            p = _int_problem(v, lo, hi)
            if p:
                add(prefix + key, p)
        for key, (lo, hi) in FLOAT_LIMITS.items():
            v = cfg.get(key)
            if v is None:
                continue
            x = finite_number(v)
            if x is None or not lo < x <= hi:
                add(prefix + key, f"expected a finite number in ({lo:g}, {hi:g}], found {_show(v)}")
    if qc is None:
        qc = config.get("quantization_config")
    if isinstance(qc, dict):
        for key, (kind, lo, hi) in QC_LIMITS.items():
            v = qc.get(key)
            if v is None:
                continue
            name = f"quantization_config.{key}"
            if kind == "int":
                if key in ("group_size", "q_group_size") and v == -1 and _is_int(v):
                    continue
                p = _int_problem(v, int(lo), int(hi))
                if p and key in ("group_size", "q_group_size"):
                    p = p.replace("expected an integer", "expected -1 or an integer")
                if p:
                    add(name, p)
            else:
                x = finite_number(v)
                if x is None or not lo < x <= hi and not (key == "damp_percent" and x == 0):
                    add(name, f"expected a finite number in ({lo:g}, {hi:g}], found {_show(v)}")
    return issues
