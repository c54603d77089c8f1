"""EXL2 -> GPTQ by re-quantization (``convert SRC DST --to gptq --order static``; the driver is
``routes._requantize_exl2``): for runtimes that refuse the exact re-pack's activation order (vLLM, everywhere).

The exact re-pack (``exl2_to_gptq``) keeps EXL2's input permutation as a non-monotone ``g_idx``, so its GPTQ needs
``desc_act``.  Given ``--order`` (static, group or natural) the route instead

1. decodes SRC to a staging FP16 directory next to DST (``convert --to fp16``: ExLlamaV2's reconstruction bit for
   bit, verified like any conversion; a marked working directory, removed at the end or by a later run);
2. runs the calibrated quantizer on it (``exl2fmt.quant``: sequential GPTQ with Hessians from the calibration set,
   through the model's tokenizer, or ``--calibration`` ids), so the GPTQ groups are consecutive input rows and
   ``desc_act`` is false;
3. measures every quantized layer's relative weight error against the EXL2 decode, ``||W_gptq - W_exl2||_F /
   ||W_exl2||_F`` (``LayerResult.weight_error``); the report states which vLLM builds load the result
   (``written_compatibility``, as for every GPTQ the quantizer writes).

Re-quantizing is lossy twice over (EXL2's rounding, then GPTQ's): the report says how much per layer.  ``--order
act`` is refused here: the exact re-pack already is the act-order GPTQ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import Exl2Error

__all__ = ["wants_requantize", "finish_report", "weight_errors", "gptq_shapes", "written_compatibility",
           "REPACK_HINT"]

#: said where a quantizer option is given to EXL2 -> GPTQ without ``--order`` (a re-pack calibrates nothing)
REPACK_HINT = "to re-quantize an EXL2 model into a GPTQ without activation order (which vLLM needs), add --order static"


def wants_requantize(quant: dict | None) -> bool:
    """True when ``convert``'s quantizer options ask EXL2 -> GPTQ to re-quantize (``order`` given)."""
    return (quant or {}).get("order") is not None


def finish_report(rep, src, o, errs: dict[str, float], stale: list[str]) -> None:
    """Complete the quantizer's report ``rep`` of a re-quantized EXL2 model ``src`` (options ``o``):
    the per-layer weight errors ``errs``, the source and what was done."""
    for l in rep.layers:
        l.weight_error = errs.get(l.key)
    rep.source = str(src)
    rep.options = {**rep.options, "source_format": "exl2", "requantized": "EXL2 decoded to FP16 (exact), then "
                   f"calibrated GPTQ in {o.order} order"}
    rep.warnings.extend(stale)
    rep.warnings.append(f"re-quantized: the EXL2 weights were decoded and quantized again as GPTQ {o.bits}-bit "
                        f"(order {o.order}, desc_act false); weight_error is each layer's relative error against "
                        "the EXL2 decode (the exact re-pack without --order has none, but needs desc_act)")


def written_compatibility(dst: Path) -> dict:
    """``gptq_compatibility`` of the GPTQ model written in ``dst``, from its ``config.json`` quantization_config
    (bits, group size, sym, desc_act) and its GPTQ layers' shapes."""
    import json

    from .exl2_to_gptq import gptq_compatibility

    qc = json.loads((dst / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    return gptq_compatibility(int(qc["bits"]), int(qc["group_size"]), bool(qc["sym"]), bool(qc["desc_act"]),
                              gptq_shapes(dst))


def gptq_shapes(dst: Path) -> list[tuple[int, int]]:
    """(N, K) of every GPTQ layer in the written model ``dst``."""
    from ..container import open_model
    from ..detect import detect_model
    from ..layout import Format

    m = open_model(dst)
    try:
        det = detect_model(m.tensors, m.config, root=m.root)
        return [(i.out_features, i.in_features) for i in det.layers.values() if i.format is Format.GPTQ]
    finally:
        m.close()


def weight_errors(ref_dir: Path, got_dir: Path, keys: list[str]) -> dict[str, float]:
    """Relative weight error of each layer ``key`` of ``got_dir`` against ``ref_dir``: ``||W_got - W_ref||_F /
    ||W_ref||_F`` over the decoded fp16 weights (float16 [N, K] each, accumulated in float64); a layer missing
    from either side is left out."""
    from ..container import open_model
    from ..model import load_layer

    out: dict[str, float] = {}
    a, b = open_model(ref_dir), open_model(got_dir)
    try:
        for k in keys:
            try:
                w_ref = load_layer(a, k).dequantize_finite()
                w_got = load_layer(b, k).dequantize_finite()
            except Exl2Error:
                continue
            if w_ref.shape != w_got.shape:
                continue
            ref = w_ref.astype(np.float64)
            num = float(np.linalg.norm(w_got.astype(np.float64) - ref))
            den = float(np.linalg.norm(ref))
            out[k] = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    finally:
        a.close()
        b.close()
    return out
