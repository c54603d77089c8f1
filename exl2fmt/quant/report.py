"""What a quantization reports: ``QuantReport`` (per layer ``LayerResult``, per block results, the decoder and
head bpw, the calibration perplexities, timings, warnings) and the facts it is made of: a layer's plan and bpw
(``plan_of``, ``bpw_of``), the perplexity rise that passes without a warning (``ppl_rise_bound``)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from ..formats import layer_from_tensors
from ..layout import plan_desc

__all__ = ["LayerResult", "QuantReport", "ppl_rise_bound", "PPL_RISE_AT_4BPW", "plan_of", "bpw_of", "ppl_warning",
           "padded_expert_warnings"]

#: The report warns when the quantized model's calibration perplexity exceeds the FP16 model's by more than
#: ``ppl_rise_bound(bpw)``: this fraction at 4 bits per weight, halved with each further bit (quantization noise
#: power falls 4x a bit; the rise of a log-perplexity roughly with its amplitude), never more than doubling.
PPL_RISE_AT_4BPW = 0.15


def ppl_rise_bound(bpw: float) -> float:
    """The largest relative rise of the calibration perplexity (quantized / FP16 - 1) that a quantization at ``bpw``
    average bits per weight passes without a warning: 0.15 at 4.0, 0.30 at 3.0, 0.075 at 5.0, capped at 1.0 (2x)."""
    return min(1.0, PPL_RISE_AT_4BPW * 2.0 ** (4.0 - float(bpw)))


@dataclass
class LayerResult:
    key: str
    plan: str
    bpw: float
    error: float          # proxy error: relative output error of the layer on its calibration inputs
    # relative weight error ||W_q - W_src||_F / ||W_src||_F against a quantized source's decoded weights (set when
    # a quantized model is re-quantized: EXL2 -> GPTQ --order static); None otherwise
    weight_error: float | None = None


@dataclass
class QuantReport:
    source: str
    destination: str
    target: str
    options: dict
    layers: list[LayerResult] = field(default_factory=list)
    blocks: list[dict] = field(default_factory=list)      # per block: key, option index, measured accuracy, rfn
    # per block key: the factor the solver put on its measured error (``sensitivity.block_gains``); None: none
    block_gains: dict | None = None
    decoder_bpw: float | None = None
    head_bpw: float | None = None
    calibration_ppl: float | None = None          # next-token perplexity on the calibration rows, quantized
    calibration_ppl_fp16: float | None = None     # ... and of the source model
    seconds: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)     # from the source directory (modelcard.MODEL_FILES)
    files_left_out: list[str] = field(default_factory=list)   # the source's other files, not copied
    # a GPTQ output: which runtimes and kernels load it (``converters.exl2_to_gptq.gptq_compatibility``)
    compatibility: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        return d

    def summary_lines(self) -> list[str]:
        out = [f"{self.source} -> {self.destination} ({self.target})"]
        if self.decoder_bpw is not None:
            tgt = self.options.get("bits")
            if self.head_bpw is not None:
                out.append(f"decoder linears: {self.decoder_bpw:.4f} bpw (target {tgt}); head {self.head_bpw:.3f} bpw")
            elif self.target == "exl2" and self.options.get("head_bits") is None:
                out.append(f"decoder linears: {self.decoder_bpw:.4f} bpw (target {tgt}); head: tied to the embedding "
                           "(fp16; --head-bits N writes a quantized one)")
            else:
                out.append(f"decoder linears: {self.decoder_bpw:.4f} bpw")
        if self.calibration_ppl is not None:
            ref = "" if self.calibration_ppl_fp16 is None else f" (FP16 {self.calibration_ppl_fp16:.3f})"
            out.append(f"calibration perplexity of the quantized model: {self.calibration_ppl:.3f}{ref}")
        moe = [b["expert_tokens"] for b in self.blocks if b.get("expert_tokens") is not None]
        if moe:
            flat = sorted(n for t in moe for n in t)
            padded = sum(len(b.get("expert_hessian_padded") or ()) for b in self.blocks)
            out.append(f"experts: {len(flat)} in {len(moe)} MoE blocks saw {flat[0]}-{flat[-1]} calibration tokens "
                       f"each (median {flat[len(flat) // 2]}); {padded} expert Hessians padded for too few tokens")
        werr = [(l.weight_error, l.key) for l in self.layers if l.weight_error is not None]
        if werr:
            worst = max(werr)
            out.append(f"weight error against the source's decode: mean {sum(e for e, _ in werr) / len(werr):.4f}, "
                       f"max {worst[0]:.4f} ({worst[1]})")
        out.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return out


def plan_of(r) -> str:
    """The plan of one quantized layer (an EXL2 or GPTQ result of ``gptq``) as the report and manifest name it."""
    if hasattr(r, "bits_rows"):
        return plan_desc(r.bits_rows)
    gs = int(np.bincount(r.g_idx).max())
    return f"gptq {r.bits}b g{gs}"


def bpw_of(tensors: dict[str, np.ndarray], out_features: int) -> float:
    """Bits per weight of one packed layer (slot -> array), by the layout table's accounting."""
    return layer_from_tensors("layer", tensors, out_features=out_features).bpw()


def padded_expert_warnings(blocks: list[dict]) -> list[str]:
    """One warning per MoE block whose experts saw fewer calibration tokens than some projection's input
    features (the block results' ``expert_hessian_padded``), naming the experts and their token counts."""
    out = []
    for b in blocks:
        few = sorted({int(m.group(1)) for k in b.get("expert_hessian_padded") or ()
                      if (m := re.search(r"\.experts\.(\d+)\.", k))})
        if few:
            out.append(f"{b['block']}: expert(s) {', '.join(map(str, few))} saw fewer calibration tokens "
                       "than some projection's input features (" + ", ".join(
                           str(b["expert_tokens"][e]) for e in few) + " tokens); those Hessians were "
                       "padded with the all-token Hessian (gate/up) or the identity (down)")
    return out


def ppl_warning(a: float, q: float, bpw: float, quantized_head: bool = True) -> str | None:
    """The warning when the quantized calibration perplexity ``q`` is not finite or rose above the FP16 one ``a``
    by more than ``ppl_rise_bound(bpw)``; None otherwise.  ``quantized_head``: the output has a quantized head
    (so more --head-bits is worth suggesting); False when the FP16 embedding serves as the head."""
    bound = ppl_rise_bound(bpw)
    if math.isfinite(q) and q <= (1.0 + bound) * a:
        return None
    rise = f" (+{100 * (q / a - 1):.0f} %" if math.isfinite(q) else " ("
    return (f"the calibration perplexity rose from {a:.3f} (FP16) to {q:.3f} (quantized){rise}, "
            f"more than the +{100 * bound:.0f} % expected at {bpw:.2f} bpw): the quantization "
            f"lost more than it should; try more --bits{' or --head-bits' if quantized_head else ''}, or "
            "calibration text closer "
            "to the model's use")
