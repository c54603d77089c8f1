"""Benchmark for issue 39: decoding a 4096 x 14336 EXL3 layer to fp16 beside the EXL2 decoder on the same shape
(in_features 4096, out_features 14336; output fp16 [14336, 4096], nn.Linear layout).  Target: EXL3 <= 2x EXL2.

    .venv/bin/python bench/bench_exl3.py [--repeats N] [--threads T] [--extra] [--no-reuse]

The last line prints the issue's ratio (EXL3 min / EXL2 min, codec and ``dequantize_layer`` levels, the worst
of them against the target).

Two levels, side by side in one run, cases interleaved round by round after one warm-up (min and median of N):

* the codecs: ``codec.exl2.dequantize`` (the mixed-tier act-order layer of bench_dequantize_api.py:
  0.05:8b_32g / 0.1:5b_32g / 0.85:4b_128g, ~4.3 bpw) and ``codec.exl3.dequantize`` (a random 4-bit trellis,
  K2 = 8, with 3INST and with MCG; random fp16 suh / svh: any bits form a valid ring);
* the user's path: ``exl2fmt.dequantize_layer(file, key)`` on one-layer ``.safetensors`` files of the same layers
  (open, header, deep checks, decode, the finite rule).

``--extra`` adds MUL1 at K = 4 and 3INST at K = 2.  Each decoder's output reuses the mapping of the result its
previous call dropped (``exl2fmt.codec.outbuf``, both decoders alike); ``--no-reuse`` gives every call a fresh
output instead (``outbuf.POOL_SIZE = 0``).  Not part of the test suite; files go to a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exl2fmt import dequantize_layer  # noqa: E402
from exl2fmt.codec import exl2 as X  # noqa: E402
from exl2fmt.codec import exl3 as E3  # noqa: E402
from exl2fmt.codec import outbuf  # noqa: E402
from exl2fmt.formats.exl2 import exl2_tensors  # noqa: E402
from exl2fmt.groups import group_table_from_rows  # noqa: E402
from exl2fmt.layout import EXL3_MARKER_VALUES, Exl2Slot, Exl3Slot, Tier, plan_rows  # noqa: E402

IN, OUT = 4096, 14336
KEY = "model.layers.0.mlp.up_proj"


def exl2_layer():
    rng = np.random.default_rng(0)
    br = plan_rows(IN, (Tier(0.05, 8, 32), Tier(0.1, 5, 32), Tier(0.85, 4, 128)))
    g = group_table_from_rows(br)
    codes = np.empty((IN, OUT), np.uint8)
    for b, r0, r in zip(g.bits.tolist(), g.row_start.tolist(), g.rows.tolist()):
        codes[r0:r0 + r] = rng.integers(0, 1 << b, size=(r, OUT), dtype=np.uint8)
    t = exl2_tensors(codes, rng.integers(0, 16, (g.G, OUT)).astype(np.uint8),
                     rng.uniform(0.01, 2.0, g.G).astype(np.float16), br, X.invert_permutation(rng.permutation(IN)))
    run = lambda: X.dequantize(t[Exl2Slot.Q_WEIGHT], t[Exl2Slot.Q_SCALE], t[Exl2Slot.Q_SCALE_MAX], g,  # noqa: E731
                               t[Exl2Slot.Q_INVPERM], OUT)
    return run, {str(k): v for k, v in t.items()}


def exl3_layer(K2: int, codebook: str, seed: int):
    rng = np.random.default_rng(seed)
    tr = rng.integers(-32768, 32768, size=(IN // 16, OUT // 16, 8 * K2), dtype=np.int16)
    suh = (rng.choice([-1.0, 1.0], IN) * rng.uniform(0.5, 2.0, IN)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], OUT) * rng.uniform(0.001, 0.02, OUT)).astype(np.float16)
    tensors = {str(Exl3Slot.TRELLIS): tr, str(Exl3Slot.SUH): suh, str(Exl3Slot.SVH): svh}
    if codebook != "3inst":
        slot = Exl3Slot.MCG if codebook == "mcg" else Exl3Slot.MUL1
        tensors[str(slot)] = np.array(EXL3_MARKER_VALUES[codebook], dtype=np.int32)
    return (lambda: E3.dequantize(tr, suh, svh, K2, codebook, IN, OUT)), tensors


def write(d: Path, name: str, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    p = d / f"{name}.safetensors"
    save_file({f"{KEY}.{k}": v for k, v in tensors.items()}, str(p))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--extra", action="store_true", help="also time MUL1 K=4 and 3INST K=2")
    ap.add_argument("--no-reuse", action="store_true", help="a fresh output mapping for every call")
    a = ap.parse_args()
    if a.no_reuse:
        outbuf.POOL_SIZE = 0
    numba.set_num_threads(a.threads)
    layers = [("exl2 ~4.3 bpw", exl2_layer()), ("exl3 K=4 3inst", exl3_layer(8, "3inst", 1)),
              ("exl3 K=4 mcg", exl3_layer(8, "mcg", 2))]
    if a.extra:
        layers += [("exl3 K=4 mul1", exl3_layer(8, "mul1", 3)), ("exl3 K=2 3inst", exl3_layer(4, "3inst", 4))]
    with tempfile.TemporaryDirectory(prefix="exl2fmt-bench-exl3-") as tmp:
        cases = []
        for i, (name, (codec_fn, tensors)) in enumerate(layers):
            f = write(Path(tmp), f"l{i}", tensors)
            cases.append((f"codec: {name}", codec_fn))
            cases.append((f"dequantize_layer: {name}", lambda f=f: dequantize_layer(f, KEY)))
        for (name, fn) in cases:  # warm-up (compile / load the cache, page the files in); the API equals the codec
            fn()
        for i in range(0, len(cases), 2):
            assert np.array_equal(cases[i][1]().view(np.uint16), cases[i + 1][1]().view(np.uint16)), cases[i][0]
        samples: dict[str, list[float]] = {k: [] for k, _ in cases}
        load0 = open("/proc/loadavg").read().split()[:3]
        for _ in range(a.repeats):
            for k, fn in cases:
                t = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t)
        load1 = open("/proc/loadavg").read().split()[:3]
    print(f"# {IN} x {OUT} -> fp16 [{OUT}, {IN}]; numba threads {a.threads}; {a.repeats} interleaved rounds; "
          f"output reuse {'off' if a.no_reuse else 'on'}; "
          f"load {' '.join(load0)} -> {' '.join(load1)}")
    print("| case | min | median | M weights/s (min) | min / EXL2 min (same level) |")
    print("|---|---:|---:|---:|---:|")
    ratios = {}
    for k, v in samples.items():
        level = k.split(":")[0]
        base = min(samples[f"{level}: exl2 ~4.3 bpw"])
        mn, med = min(v), statistics.median(v)
        ratios[k] = mn / base
        print(f"| {k} | {mn * 1e3:.1f} ms | {med * 1e3:.1f} ms | {IN * OUT / mn / 1e6:.0f} | {mn / base:.2f}x |")
    codec = [r for k, r in ratios.items() if k.startswith("codec: exl3")]
    api = [r for k, r in ratios.items() if k.startswith("dequantize_layer: exl3")]
    worst = max(codec + api)
    print(f"\nissue 39 ratio, EXL3 min / EXL2 min on {IN} x {OUT}: codec {min(codec):.2f}-{max(codec):.2f}x, "
          f"dequantize_layer {min(api):.2f}-{max(api):.2f}x; worst {worst:.2f}x -> target <= 2.00x "
          f"{'met' if worst <= 2.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
