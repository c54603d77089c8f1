"""Quality of exl2fmt's GGML block quantizer (``exl2fmt.codec.ggml_quant``) against llama.cpp's own
``llama-quantize`` on the same FP16 weights (bench only: llama.cpp is a peer built outside the repo).

For each type, ``llama-quantize --pure SRC.gguf OUT.gguf TYPE`` quantizes every 2-D tensor (no importance
matrix; a tensor whose rows are no whole number of blocks falls back to another type and is skipped here).
The same FP16 rows go through ``ggml_quant.quantize`` (uniform importance).  Both are decoded by the ``gguf``
package and compared with the FP16 source: RMSE per tensor, and the ratio ours / llama.cpp.

    python bench/ggml_quant_vs_llamacpp.py SRC_F16.gguf --llama-quantize PATH [--types Q4_K Q5_K Q6_K]

Note the objectives differ: without an importance matrix llama.cpp minimises an error weighted by the weights'
own magnitudes (its reference quantizers), exl2fmt here the plain squared error, so RMSE favours exl2fmt; the
weighted column uses weights ``x^2 + mean(x^2)`` per row for a second view.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import gguf

    from exl2fmt.codec.ggml_quant import BLOCK, quantize

    ap = argparse.ArgumentParser()
    ap.add_argument("src", help="an F16 GGUF (e.g. exl2fmt convert FP16_DIR x.gguf --to gguf --gguf-type f16)")
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--types", nargs="+", default=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tensors", type=int, default=1000)
    a = ap.parse_args()
    src = gguf.GGUFReader(a.src)
    f16 = {t.name: t for t in src.tensors if t.tensor_type == gguf.GGMLQuantizationType.F16}
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for qt in a.types:
            out = Path(tmp) / f"{qt}.gguf"
            t0 = time.perf_counter()
            subprocess.run([a.llama_quantize, "--pure", a.src, str(out), qt, str(a.threads)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t_llama = time.perf_counter() - t0
            theirs = gguf.GGUFReader(str(out))
            rows, t_ours = [], 0.0
            for t in theirs.tensors[: a.max_tensors]:
                if t.tensor_type.name != qt or t.name not in f16:
                    continue
                x = np.asarray(f16[t.name].data).astype(np.float32)
                x = x.reshape(-1, x.shape[-1])
                if x.shape[1] % BLOCK[qt]:
                    continue
                t1 = time.perf_counter()
                ours = gguf.quants.dequantize(quantize(x, qt), t.tensor_type).reshape(x.shape)
                t_ours += time.perf_counter() - t1
                ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)
                w = x * x + (x * x).mean(axis=1, keepdims=True)
                r = {"tensor": t.name, "shape": list(x.shape),
                     "rmse_ours": float(np.sqrt(((ours - x) ** 2).mean())),
                     "rmse_llama": float(np.sqrt(((ref - x) ** 2).mean())),
                     "wrmse_ours": float(np.sqrt((w * (ours - x) ** 2).sum() / w.sum())),
                     "wrmse_llama": float(np.sqrt((w * (ref - x) ** 2).sum() / w.sum()))}
                rows.append(r)
                print(json.dumps({"type": qt, **r}))
            if rows:
                ratio = [r["rmse_ours"] / r["rmse_llama"] for r in rows]
                wratio = [r["wrmse_ours"] / r["wrmse_llama"] for r in rows]
                summary[qt] = {"tensors": len(rows), "rmse_ratio_mean": float(np.mean(ratio)),
                               "rmse_ratio_max": float(np.max(ratio)),
                               "wrmse_ratio_mean": float(np.mean(wratio)),
                               "seconds_llama_quantize_whole_file": round(t_llama, 1),
                               "seconds_ours_these_tensors": round(t_ours, 1)}
                print(json.dumps({"type": qt, "summary": summary[qt]}))
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
