"""Peak memory of the quantizer against the number of decoder layers (issue 14: "peak RSS bounded by one layer").

The same seeded random model (tests/tiny_models.py, ``--arch``, ``--hidden``) is saved with each layer count of
``--layers`` and quantized by the CLI in a child process (``convert --to exl2|gptq``, fixed calibration ids); the
child's peak RSS comes from ``wait4``.  If the engine holds one decoder layer at a time, the peak grows by far less
than one layer's float32 size per added layer (only the embedding-sized and hidden-state buffers, which do not
depend on the layer count, plus the source file's page cache, which is not RSS).  The table gives the peak per layer
count, the growth per added layer, and one layer's float32 size for scale.

    flock /work/heavy.lock nice -n 5 python bench/rss_layers.py [--arch llama] [--hidden 1024] [--layers 2 8]
        [--targets gptq exl2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from arch_quality import run_child  # noqa: E402
from tiny_models import make_tiny, width_dims  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--targets", nargs="+", default=["gptq", "exl2"], choices=["gptq", "exl2"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        cal = d / "cal.npy"
        np.save(cal, np.random.default_rng(0).integers(0, 512, (a.rows, a.length)))
        layer_bytes = None
        for n in a.layers:
            src = make_tiny(a.arch, d / f"src-{n}", num_hidden_layers=n, **width_dims(a.arch, a.hidden))
            if layer_bytes is None:
                from safetensors import safe_open

                with safe_open(str(next(src.glob("*.safetensors"))), "np") as f:
                    layer_bytes = sum(4 * int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()
                                      if k.startswith("model.layers.0."))
            for t in a.targets:
                args = ["convert", src, d / f"out-{t}-{n}", "--to", t, "--bits", "4.0" if t == "exl2" else "4",
                        "--calibration", cal, "--rows", a.rows, "--length", a.length]
                rc, secs, rss, tail = run_child(args)
                if rc != 0:
                    print(tail)
                    return 1
                rows.append((t, n, secs, rss))
                print(f"{t} {n} layers: {secs:.0f} s, peak RSS {rss / 2**20:.0f} MiB", flush=True)
    print(f"\n{a.arch}, hidden {a.hidden}; one decoder layer in float32: {layer_bytes / 2**20:.1f} MiB\n")
    print("| target | layers | s | peak RSS MiB | growth per added layer MiB |")
    print("|---|---|---|---|---|")
    for t in a.targets:
        mine = [r for r in rows if r[0] == t]
        for i, (_, n, secs, rss) in enumerate(mine):
            grow = "" if i == 0 else f"{(rss - mine[0][3]) / (n - mine[0][1]) / 2**20:.1f}"
            print(f"| {t} | {n} | {secs:.0f} | {rss / 2**20:.0f} | {grow} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
