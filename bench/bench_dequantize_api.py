"""Benchmark: ``exl2fmt.dequantize_layer`` (the public API, with the decode rule every command shares: deep
checks before, NaN/Inf refused after) and ``exl2fmt dequantize`` (the CLI) against ``numpy.copyto`` of the
same output, side by side in one run (issue 41: target <= 1.5x copyto).

    .venv/bin/python bench/bench_dequantize_api.py [--repeats N] [--cli-repeats M] [--quiet-wait S]

Layers (written once into a temporary directory, read back through the page cache): K = 11008 inputs, N = 4096
outputs, each the only layer of its ``.safetensors`` file:

* EXL2: the mixed-tier layer of ``bench/bench_codec.py`` (0.05:8b_32g / 0.1:5b_32g / 0.85:4b_128g, act-order);
* GPTQ: 4-bit, group size 128, act-order ``g_idx``;
* dense: an F16 ``weight``.

Cases, interleaved round by round, best (min) and median of ``--repeats`` after one warm-up; Numba on all cores,
NumPy on one thread:

* ``numpy.copyto`` of an fp16 [4096, 11008] into an existing array (the floor the issue names), and
  ``np.empty`` + ``copyto`` (the floor of a function that returns a new array);
* ``dequantize_layer(file, key)`` per format (opens the file, builds the layer, deep checks, decode, finiteness);
  its output reuses the mapping of the result the previous call dropped (``exl2fmt.codec.outbuf``); for EXL2
  also the same call with that reuse switched off (``outbuf.POOL_SIZE = 0``: a fresh output every time, the
  situation of a caller that still holds the previous result);
* for EXL2 also the rule as it was before (``layer.dequantize()`` then NumPy's float16 ``isfinite`` count), to
  show what the change removed;
* the CLI ``exl2fmt dequantize FILE KEY --json`` per format in fresh processes (best of ``--cli-repeats``),
  beside a fresh process that only imports the CLI (its start-up floor).

Not part of the test suite; nothing is written outside the temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_codec  # noqa: E402
from bench_codec import load_average, time_side_by_side  # noqa: E402

from exl2fmt import dequantize_layer  # noqa: E402
from exl2fmt.codec import exl2 as X  # noqa: E402
from exl2fmt.codec import outbuf  # noqa: E402
from exl2fmt.formats.exl2 import exl2_tensors  # noqa: E402
from exl2fmt.formats.gptq import gptq_layer_tensors  # noqa: E402
from exl2fmt.layout import Tier, plan_rows  # noqa: E402
from exl2fmt.groups import group_table_from_rows  # noqa: E402

K, N = 11008, 4096
KEY = "model.layers.0.mlp.down_proj"


def write_layers(d: Path) -> dict[str, Path]:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    out = {}
    br = plan_rows(K, (Tier(0.05, 8, 32), Tier(0.1, 5, 32), Tier(0.85, 4, 128)))
    g = group_table_from_rows(br)
    codes = np.empty((K, N), np.uint8)
    for b, r0, r in zip(g.bits.tolist(), g.row_start.tolist(), g.rows.tolist()):
        codes[r0:r0 + r] = rng.integers(0, 1 << b, size=(r, N), dtype=np.uint8)
    t = exl2_tensors(codes, rng.integers(0, 16, (g.G, N)).astype(np.uint8),
                     rng.uniform(0.01, 2.0, g.G).astype(np.float16), br, X.invert_permutation(rng.permutation(K)))
    out["exl2"] = d / "exl2.safetensors"
    save_file({f"{KEY}.{k}": v for k, v in t.items()}, str(out["exl2"]))
    gs = 128
    codes4 = rng.integers(0, 16, (K, N), dtype=np.uint8)
    zeros = rng.integers(1, 16, (K // gs, N))
    scales = rng.uniform(0.001, 0.01, (K // gs, N)).astype(np.float16)
    g_idx = (np.argsort(rng.permutation(K)) // gs).astype(np.int32)
    t = gptq_layer_tensors(codes4, scales, zeros, g_idx, 4)
    out["gptq"] = d / "gptq.safetensors"
    save_file({f"{KEY}.{k}": v for k, v in t.items()}, str(out["gptq"]))
    out["dense"] = d / "dense.safetensors"
    save_file({f"{KEY}.weight": rng.standard_normal((N, K)).astype(np.float16)}, str(out["dense"]))
    return out


def cli_best(args: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cli-repeats", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=0.2,
                    help="seconds each run waits for no other runnable process (bench_codec's rule; 0 = never)")
    a = ap.parse_args()
    bench_codec.QUIET_WAIT_S = a.quiet_wait
    with tempfile.TemporaryDirectory(prefix="exl2fmt-bench-deq-") as tmp:
        files = write_layers(Path(tmp))
        src = np.random.default_rng(1).standard_normal((N, K)).astype(np.float16)
        dst = np.empty_like(src)
        from exl2fmt.container import open_model
        from exl2fmt.model import load_layer

        m = open_model(files["exl2"])
        old_layer = load_layer(m, KEY)

        def old_rule():  # the rule before: decode, then NumPy's emulated float16 isfinite
            w = old_layer.dequantize()
            assert not np.count_nonzero(~np.isfinite(w))

        for f in ("exl2", "gptq", "dense"):  # the outputs agree with the layer objects' own decode
            assert dequantize_layer(files[f], KEY).shape == (N, K)
        def fresh_output():  # no reusable output mapping: fresh pages, faulted and zeroed by the kernel
            outbuf.POOL_SIZE = 0
            try:
                dequantize_layer(files["exl2"], KEY)
            finally:
                outbuf.POOL_SIZE = 1

        cases = [("copyto", lambda: np.copyto(dst, src), 1),
                 ("empty+copyto", lambda: np.copyto(np.empty_like(src), src), 1),
                 ("dequantize_layer exl2", lambda: dequantize_layer(files["exl2"], KEY), None),
                 ("dequantize_layer exl2, fresh output (no reuse)", fresh_output, None),
                 ("dequantize_layer gptq", lambda: dequantize_layer(files["gptq"], KEY), None),
                 ("dequantize_layer dense", lambda: dequantize_layer(files["dense"], KEY), None),
                 ("exl2 decode + isfinite (before)", old_rule, None)]
        t0 = time.perf_counter()
        load0 = load_average()
        res = time_side_by_side(cases, a.repeats)
        m.close()
        floor = res["copyto"][1]
        print(f"# dequantize through the API, K={K} N={N}; load {load0} -> {load_average()}; "
              f"{a.repeats} rounds")
        print("| case | min | median | min / copyto min |")
        print("|---|---:|---:|---:|")
        for k, (med, mn) in res.items():
            print(f"| {k} | {mn * 1e3:.1f} ms | {med * 1e3:.1f} ms | {mn / floor:.2f}x |")
        app = ["-m", "exl2fmt.cli.app"]
        start = cli_best(["-c", "import exl2fmt.cli.app"], a.cli_repeats)
        print(f"\n# CLI, fresh processes, best of {a.cli_repeats}")
        print("| command | best |")
        print("|---|---:|")
        print(f"| python -c 'import exl2fmt.cli.app' (start-up floor) | {start * 1e3:.0f} ms |")
        for f in ("exl2", "gptq", "dense"):
            t = cli_best([*app, "dequantize", str(files[f]), KEY, "--json"], a.cli_repeats)
            print(f"| exl2fmt dequantize {f}.safetensors {KEY} --json | {t * 1e3:.0f} ms "
                  f"({(t - start) * 1e3:.0f} ms over start-up) |")
        print(f"\n(wall {time.perf_counter() - t0:.0f} s; median of the copyto floor "
              f"{statistics.median([res['copyto'][0]]) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
