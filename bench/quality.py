"""Quality of the quantizer on a model with trained weights: perplexity and KL divergence vs FP16.

The fixture ``tests/fixtures/tiny-llama`` (a 4.2M-parameter Llama trained by ``bench/train_fixture.py`` on the
shipped corpus) is quantized to EXL2 at several bitrates (one measurement, reused for every bitrate), to GPTQ
4-bit g128 with the same engine, and by round-to-nearest 4-bit g128 (no calibration; per-column best fp16
scale).  Every model is evaluated on held-out text (the corpus's ``eval`` part) against the FP16 model.

    python bench/quality.py [--rows 64] [--length 256] [--record]

``--record`` appends the table to bench/RESULTS.md.  ``tests/test_quality.py`` guards the ordering on a
smaller run.  The helpers here are imported by that test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
EXL2_BITS = (8.0, 6.0, 5.0, 4.15, 4.0, 3.0, 2.5)


def rtn_source(model_dir, bits=4, group_size=128):
    """The dense model with every decoder linear replaced by its round-to-nearest GPTQ reconstruction."""
    from exl2fmt.codec.gptq_fit import reconstruct, rtn_quantize
    from exl2fmt.runner.model import HFModel
    from exl2fmt.runner.weights import WeightSource

    eng = HFModel.open(model_dir)
    src = eng.src
    out = {n: src.get(n, torch.float32) for n in src.names()}
    for i in range(eng.num_layers):
        for n in eng.linear_names("attn") + eng.linear_names("mlp"):
            key = eng.linear_key(i, n)
            w = out[f"{key}.weight"].numpy()
            codes, scales, zeros, g_idx = rtn_quantize(w, bits, group_size)
            wq = np.empty_like(w.T)
            for g in range(scales.shape[0]):
                rows = np.nonzero(g_idx == g)[0]
                wq[rows] = reconstruct(codes[rows], scales[g], zeros[g])
            out[f"{key}.weight"] = torch.from_numpy(np.ascontiguousarray(wq.T))
    eng.close()
    return WeightSource(out)


def run(work: Path, exl2_bits=EXL2_BITS, rows_cal=None, length_cal=None, rows_eval=64, length_eval=256,
        gptq=True, rtn=True, fp16_head=True, upstream_tables=(), log=print, refine_scales=None,
        measure_rows=None, batch_tokens=None) -> dict:
    """Quantize the fixture into ``work`` and evaluate; returns {name: metrics + bpw + seconds}.
    ``measure_rows``: calibration rows that score the EXL2 measurement's candidates (None = every row);
    ``batch_tokens``: ``QuantOptions.batch_tokens`` of every quantization (None = the default for the model)."""
    from exl2fmt.quant.evaluate import compare_many, dequantized_source, eval_ids
    from exl2fmt.runner.model import HFModel
    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.runner.weights import WeightSource

    model = HFModel.open(FIXTURE)
    ref = model.src
    ids = eval_ids(FIXTURE / "tokenizer.json", rows_eval, length_eval)
    meas = work / "measurement.json"
    tests, info = {}, {}
    for i, bits in enumerate(exl2_bits):
        t = time.monotonic()
        opts = QuantOptions(target="exl2", bits=bits, rows=rows_cal, length=length_cal, device="cpu",
                            refine_scales=refine_scales, measure_rows=measure_rows, batch_tokens=batch_tokens,
                            **({"save_measurement": str(meas)} if i == 0 else {"measurement": str(meas)}))
        rep = quantize_model(FIXTURE, work / f"exl2-{bits}", opts, verify_output=validate_quantized_output)
        name = f"EXL2 {bits}"
        deq = dequantized_source(work / f"exl2-{bits}")
        tests[name] = deq
        info[name] = {"bpw": rep.decoder_bpw, "head_bpw": rep.head_bpw, "seconds": time.monotonic() - t}
        if fp16_head:
            # the same decoder with the FP16 head, for a like-for-like comparison with GPTQ / RTN (which keep it)
            mem = {n: deq.get(n) for n in deq.names()}
            mem["lm_head.weight"] = ref.get("lm_head.weight")
            tests[f"{name} fp16 head"] = WeightSource(mem)
            info[f"{name} fp16 head"] = dict(info[name], head_bpw=16.0)
        log(f"{name}: decoder {rep.decoder_bpw:.4f} bpw, {time.monotonic() - t:.1f} s")
    for bits in upstream_tables:
        # the same measurement, but only ExLlamaV2's own candidate rows may be chosen
        rep = quantize_model(FIXTURE, work / f"exl2-up-{bits}", QuantOptions(
            target="exl2", bits=bits, rows=rows_cal, length=length_cal, device="cpu", measurement=str(meas),
            extended=False, refine_scales=refine_scales, batch_tokens=batch_tokens),
                             verify_output=validate_quantized_output)
        deq = dequantized_source(work / f"exl2-up-{bits}")
        mem = {n: deq.get(n) for n in deq.names()}
        mem["lm_head.weight"] = ref.get("lm_head.weight")
        name = f"EXL2 {bits} upstream tables, fp16 head"
        tests[name] = WeightSource(mem)
        info[name] = {"bpw": rep.decoder_bpw, "head_bpw": 16.0, "seconds": 0.0}
    if gptq:
        t = time.monotonic()
        rep = quantize_model(FIXTURE, work / "gptq-4-g128", QuantOptions(target="gptq", bits=4, group_size=128,
                                                                        rows=rows_cal, length=length_cal,
                                                                        device="cpu", batch_tokens=batch_tokens),
                             verify_output=validate_quantized_output)
        tests["GPTQ 4b g128"] = dequantized_source(work / "gptq-4-g128")
        info["GPTQ 4b g128"] = {"bpw": _gptq_bpw(work / "gptq-4-g128"), "head_bpw": 16.0,
                                "seconds": time.monotonic() - t}
    if rtn:
        tests["RTN 4b g128"] = rtn_source(FIXTURE)
        info["RTN 4b g128"] = {"bpw": info.get("GPTQ 4b g128", {}).get("bpw"), "head_bpw": 16.0, "seconds": 0.0}
    res = compare_many(model, tests, ids)
    model.close()
    for k in res:
        res[k].update(info[k])
    return res


GPTQ_ORDERS = ("act", "group", "static", "natural")


def gptq_orders(work: Path, orders=GPTQ_ORDERS, bits=4, group_size=128, sym=True, rows_cal=None, length_cal=None,
                rows_eval=64, length_eval=256, log=print) -> dict:
    """GPTQ of the fixture with each input-feature order of the sweep (``QuantOptions.order``; None = the
    default): act-order (non-monotone g_idx), group-aware and static (monotone g_idx), natural; same
    calibration; KL etc. vs FP16 on held-out text.  Returns {"GPTQ {bits}b g{gs} {order}": metrics + bpw + seconds + monotone (g_idx sorted)}."""
    from exl2fmt.container import open_model
    from exl2fmt.quant.evaluate import compare_many, dequantized_source, eval_ids
    from exl2fmt.runner.model import HFModel
    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    model = HFModel.open(FIXTURE)
    ids = eval_ids(FIXTURE / "tokenizer.json", rows_eval, length_eval)
    tests, info = {}, {}
    for order in orders:
        t = time.monotonic()
        name = f"GPTQ {bits}b g{group_size} {order or 'default'}"
        out = work / f"gptq-{order}"
        quantize_model(FIXTURE, out, QuantOptions(target="gptq", bits=bits, group_size=group_size, sym=sym,
                                                  order=order, rows=rows_cal, length=length_cal, device="cpu"),
                       verify_output=validate_quantized_output)
        m = open_model(out)
        try:
            monotone = all(bool(np.all(np.diff(np.asarray(m.get(n)).astype(np.int64)) >= 0))
                           for n in m.names() if n.endswith(".g_idx"))
        finally:
            m.close()
        tests[name] = dequantized_source(out)
        info[name] = {"bpw": _gptq_bpw(out), "head_bpw": 16.0, "seconds": time.monotonic() - t,
                      "monotone": monotone}
        log(f"{name}: {time.monotonic() - t:.1f} s")
    res = compare_many(model, tests, ids)
    model.close()
    for k in res:
        res[k].update(info[k])
    return res


def _gptq_bpw(path) -> float:
    from exl2fmt.inspect import inspect_model

    return inspect_model(path, layers=False)["summary"]["bpw"]["decoder"]


def table(res: dict) -> list[str]:
    ppl_ref = next(iter(res.values()))["ppl_ref"]
    lines = ["| model | decoder bpw | head bpw | perplexity | KL vs FP16 (nats) | top-1 agreement |",
             "|---|---|---|---|---|---|", f"| FP16 | 16 | 16 | {ppl_ref:.3f} | 0 | 1 |"]
    for name, r in res.items():
        bpw = "-" if r.get("bpw") is None else f"{r['bpw']:.3f}"
        head = "-" if r.get("head_bpw") is None else f"{r['head_bpw']:.2f}"
        lines.append(f"| {name} | {bpw} | {head} | {r['ppl_test']:.3f} | {r['kl_mean']:.2e} | "
                     f"{r['top1_agree']:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64, help="held-out evaluation rows")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--refine-scales", action="store_true", help="EXL2 with exl2fmt's per-column refinement of "
                    "the scale codes (off by default with calibration)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="calibration tokens per forward batch of every "
                    "quantization (default: the quantizer's own for the model; an A/B of the batch split)")
    a = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        res = run(Path(d), rows_eval=a.rows, length_eval=a.length, upstream_tables=(4.0, 3.0, 2.5),
                  refine_scales=a.refine_scales, batch_tokens=a.batch_tokens)
    lines = table(res)
    print("\n".join(lines))
    total = time.monotonic() - t0
    print(f"total {total:.0f} s")
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n### Quality on trained weights ({datetime.date.today()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores, torch {torch.__version__})\n\n"
                    f"Fixture tests/fixtures/tiny-llama (4.2M params, trained on the shipped corpus); calibration: "
                    f"the built-in set (CPU defaults: 32 rows x 512 tokens); evaluation: {a.rows} held-out rows x "
                    f"{a.length} tokens. EXL2 rows share one measurement. GPTQ/RTN keep the fp16 head; EXL2 "
                    f"quantizes it (--head-bits 6); the 'fp16 head' rows put the FP16 head back on the EXL2 decoder "
                    f"for a like-for-like comparison (decoder bpw is what --bits sets); 'upstream tables' rows may only pick "
                    f"ExLlamaV2's own candidate rows (same measurement, same solver). Scale codes: "
                    f"{'searched, then refined per column (--refine-scales)' if a.refine_scales else 'ExLlamaV2 search'}. "
                    f"Batches: {a.batch_tokens or 'the default'} tokens. "
                    f"Whole run {total:.0f} s.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
