"""Issue 35, runtime coverage: for every architecture of the quantizer's test set (tests/tiny_models.py) and for EXL3,
the packed model's logits against the same model converted with ``convert --to fp16`` and run by transformers in
float32, and the packed decoder's bytes against FP16's; then one layer's batch-1 cost per packed format.

    .venv/bin/python bench/runtime_coverage.py [--calibrated] [--archs llama,phi3] [--repeats N]

* models: each architecture (and OLMoE) made EXL2 by round-to-nearest (tests/test_runtime_coverage.py
  ``_rtn_exl2``: every linear incl. MoE experts and the untied head) or, with ``--calibrated``, by the calibrated
  quantizer (EXL2 4.0 bpw, 5.0 for Qwen-MoE, 4 x 32 calibration tokens); EXL3 qwen2 / mixtral by the test-side
  encoder (tests/test_exl3.py);
* per model: max |logit diff| / logit scale over 20 prompt tokens, top-1 agreement, packed decoder bytes / FP16;
* per layer (4096 x 4096, M = 1): ``nn.Linear`` fp32, ``Exl2PackedLinear`` 4-bit g32, ``Exl3PackedLinear`` 4-bit
  MCG, interleaved, min of N (EXL3 decodes the whole trellis per call: its cost is ``convert --to fp16``'s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

IDS = [[0, 5, 17, 100, 42, 99, 150, 7, 8, 9, 10, 11, 12, 13, 40, 41, 42, 3, 2, 159]]


def _compare(packed_dir: Path, fp16_dir: Path) -> tuple[float, bool, float, int]:
    import transformers

    import exl2fmt
    from exl2fmt.runtime import packed_modules, weight_bytes

    m = exl2fmt.load_model(packed_dir, device="cpu", dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(fp16_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = m(torch.tensor(IDS)).logits, ref(torch.tensor(IDS)).logits
    rel = float((a - b).abs().max()) / float(b.abs().max())
    ratio = weight_bytes(m.model.layers) / weight_bytes(ref.half().model.layers)
    return rel, bool(torch.equal(a.argmax(-1), b.argmax(-1))), ratio, len(packed_modules(m))


def _olmoe(dst: Path) -> None:
    """A seeded tiny OLMoE (hidden 64, 2 layers, 4 experts of 32, top 2) saved in fp16."""
    import transformers

    cfg = transformers.OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=160, num_experts=4, num_experts_per_tok=2,
                                   max_position_embeddings=256, eos_token_id=2, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_((1.0 if "norm" in n else 0.0) + 0.05 * torch.randn(p.shape))
    m.to(torch.float16).save_pretrained(dst)


def _models(root: Path, archs: list[str], calibrated: bool):
    from test_runtime_coverage import _rtn_exl2
    from tiny_models import make_tiny

    from exl2fmt import convert

    ids = root / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    for arch in archs:
        d = root / arch
        src = make_tiny(arch, d / "src")
        if calibrated:
            from exl2fmt.quant.options import QuantOptions
            from exl2fmt.quant.pipeline import quantize_model

            bits = 5.0 if arch.endswith("_moe") else 4.0   # 32-wide Qwen-MoE experts cannot reach 4.0
            quantize_model(src, d / "q", QuantOptions(target="exl2", bits=bits, calibration=str(ids), rows=4,
                                                      length=32, device="cpu"))
        else:
            _rtn_exl2(src, d / "q")
        convert(d / "q", d / "fp16", "fp16")
        yield f"{arch} EXL2 {'calibrated' if calibrated else 'RTN'}", d / "q", d / "fp16"
    if not calibrated:   # OLMoE (stacked experts like Qwen2-MoE's, not in the quantizer's test set): RTN only
        d = root / "olmoe"
        _olmoe(d / "src")
        _rtn_exl2(d / "src", d / "q")
        convert(d / "q", d / "fp16", "fp16")
        yield "olmoe EXL2 RTN", d / "q", d / "fp16"
    from test_exl3 import make_exl3
    from tiny_hf import make_tiny as make_tiny_hf

    for i, arch in enumerate(("qwen2", "mixtral")):
        d = root / f"x3-{arch}"
        src = make_tiny_hf(arch, d / "src", tokenizer=None)
        make_exl3(src, d / "q", seed=70 + i, keep_dense=lambda k: k.endswith((".gate", ".shared_expert_gate")))
        convert(d / "q", d / "fp16", "fp16")
        yield f"{arch} EXL3 (all 11 rates, 3 codebooks)", d / "q", d / "fp16"


def _layer_speed(repeats: int) -> list[tuple[str, float]]:
    from test_exl3 import encode_linear

    from exl2fmt.formats import layer_from_tensors
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.layout import Tier
    from exl2fmt.runtime import Exl2PackedLinear
    from exl2fmt.runtime.exl3 import Exl3PackedLinear

    rng = np.random.default_rng(0)
    K = N = 4096
    w = (0.02 * rng.standard_normal((N, K))).astype(np.float32)
    dense = torch.nn.Linear(K, N, bias=False)
    dense.weight.data = torch.from_numpy(w)
    e2 = Exl2PackedLinear.from_layer(layer_from_tensors("a", quantize_rtn(w, [Tier(1.0, 4, 32)]), out_features=N))
    e3 = Exl3PackedLinear.from_layer(layer_from_tensors("b", encode_linear(rng, w, 4, "mcg"), in_features=K,
                                                        out_features=N))
    cases = [("nn.Linear fp32", dense), ("EXL2 packed 4-bit g32", e2), ("EXL3 packed 4-bit mcg", e3)]
    x = torch.randn(1, K)
    best = {n: float("inf") for n, _ in cases}
    with torch.no_grad():
        for _ in range(repeats + 1):          # the first round warms up (Numba compile, caches)
            for name, mod in cases:
                t = time.perf_counter()
                mod(x)
                best[name] = min(best[name], time.perf_counter() - t)
    return [(n, best[n]) for n, _ in cases]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrated", action="store_true")
    ap.add_argument("--archs", default=None, help="comma-separated model types (default: all of tiny_models.ARCHS)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from tiny_models import ARCHS

    archs = a.archs.split(",") if a.archs else sorted(ARCHS)
    print("| model | packed linears | max abs logit diff / scale | top-1 equal | decoder bytes / FP16 |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, q, f in _models(Path(tmp), archs, a.calibrated):
            rel, top1, ratio, n = _compare(q, f)
            print(f"| {name} | {n} | {rel:.2e} | {'yes' if top1 else 'NO'} | {ratio:.2f} |", flush=True)
    print("\n| one 4096 x 4096 layer, M = 1 | min ms |\n|---|---|")
    for name, s in _layer_speed(a.repeats):
        print(f"| {name} | {1e3 * s:.2f} |")


if __name__ == "__main__":
    main()
