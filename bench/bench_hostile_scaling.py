"""Benchmark (issue 11): do inspect / validate stay linear in the size of a hostile input?

    flock /work/heavy.lock nice -n 5 .venv/bin/python bench/bench_hostile_scaling.py [--no-results] [--quick]

Inputs (written to a temp directory by ``spec/malformed/make_hostile.py``'s helpers):

* ``index, valid``: one shard holding n one-byte tensors, an index listing all of them (n = 1k, 10k, 100k);
* ``index, missing shards``: an index naming n shard files that do not exist (the case that was quadratic);
* ``index, missing tensors``: an index listing n tensors its one shard lacks (n findings);
* ``header, n 1x1 F16 layers``: one safetensors file of n tiny dense layers (inspect, validate, --deep);
* ``gguf, u8 array`` / ``gguf, string array``: a tiny GGUF with one metadata array of n elements
  (n = 10**3 .. 10**6).

Each is timed in-process (the library entry points ``inspect_model`` / ``validate_model``, no interpreter
start-up; best of 3, 1 for the largest), and the ``gguf`` package's ``GGUFReader`` is timed side by side on the
GGUF inputs it can finish (the reader exl2fmt used before: one object per array element) as the floor to beat.
The slope of log(time) against log(n) is fitted per series over the sizes >= 10k (below that the fixed cost
of a call dominates): 1.0 is linear, 2.0 quadratic.  Appends "## Issue 11: hostile-input scaling
(2026-12-01)" to bench/RESULTS.md (replacing an earlier section of that name).
"""

from __future__ import annotations

import argparse
import gc
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "spec" / "malformed"))

import make_hostile as mh  # noqa: E402
from make_malformed import st_file  # noqa: E402

TITLE = "## Issue 11: hostile-input scaling (2026-12-01)"


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _valid_index(d: Path, n: int) -> None:
    import json

    d.mkdir()
    names = [f"model.layers.{i}.w" for i in range(n)]
    (d / "model-00001.safetensors").write_bytes(st_file([(nm, "U8", [1], b"\0") for nm in names]))
    wm = {nm: "model-00001.safetensors" for nm in names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": n}, "weight_map": wm}))


def _index(d: Path, n: int, kind: str) -> None:
    d.mkdir()
    for fn, data in mh.index_dir(n, kind).items():
        (d / fn).write_bytes(data)


def slope(ns, ts) -> float | None:
    pts = [(n, t) for n, t in zip(ns, ts) if n >= 10_000 and t is not None and t > 0]
    if len(pts) < 2:
        return None
    x = np.log([p[0] for p in pts])
    y = np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--quick", action="store_true", help="sizes up to 10k / 10**5 only")
    args = ap.parse_args(argv)

    from exl2fmt.inspect import inspect_model
    from exl2fmt.validate import validate_model

    idx_sizes = [1_000, 10_000, 100_000] if not args.quick else [1_000, 10_000]
    arr_sizes = [1_000, 10_000, 100_000, 1_000_000] if not args.quick else [1_000, 10_000, 100_000]
    rows = []  # (series, command, n, seconds)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in idx_sizes:
            reps = 1 if n >= 100_000 else 3
            for label, make in (("index, valid", lambda d, n=n: _valid_index(d, n)),
                                ("index, missing shards", lambda d, n=n: _index(d, n, "missing_shards")),
                                ("index, missing tensors", lambda d, n=n: _index(d, n, "missing_tensors"))):
                d = tmp / f"{re.sub(r'[^a-z]+', '_', label)}_{n}"
                make(d)
                rows.append((label, "inspect", n, _best(lambda: inspect_model(d), reps)))
                rows.append((label, "validate", n, _best(lambda: validate_model(d), reps)))
                print(rows[-2], rows[-1], flush=True)
            # a header of n tiny 2-D layers: per-layer work must not carry a large fixed cost
            p = tmp / f"layers_{n}.safetensors"
            p.write_bytes(st_file([(f"model.layers.{i // 7}.mlp.p{i % 7}_proj.weight", "F16", [1, 1], b"\0\0")
                                   for i in range(n)]))
            rows.append(("header, n 1x1 F16 layers", "inspect", n, _best(lambda: inspect_model(p), reps)))
            rows.append(("header, n 1x1 F16 layers", "validate", n, _best(lambda: validate_model(p), reps)))
            if n <= 10_000:
                rows.append(("header, n 1x1 F16 layers", "validate --deep", n,
                             _best(lambda: validate_model(p, deep=True), reps)))
            print(rows[-1], flush=True)
        import gguf

        for n in arr_sizes:
            reps = 1 if n >= 1_000_000 else 3
            for label, elem in (("gguf, u8 array", mh.U8), ("gguf, string array", mh.STR)):
                p = tmp / f"a{elem}_{n}.gguf"
                p.write_bytes(mh.gguf_long_array(n, elem))
                rows.append((label, "inspect", n, _best(lambda: inspect_model(p), reps)))
                print(rows[-1], flush=True)
                if n <= 10_000:  # GGUFReader: 0.2 ms per element here; 10**5 would take ~20 s, 10**6 minutes
                    rows.append((label, "gguf.GGUFReader (floor, before)", n,
                                 _best(lambda: gguf.GGUFReader(str(p)), 1)))
                    print(rows[-1], flush=True)

    series: dict[tuple[str, str], dict[int, float]] = {}
    for label, cmd, n, t in rows:
        series.setdefault((label, cmd), {})[n] = t
    sizes = sorted({n for _, _, n, _ in rows})
    lines = [TITLE, "",
             f"`bench/bench_hostile_scaling.py` on {platform.machine()} ({platform.python_version()}), shared "
             "2-core machine, in-process library calls, seconds (best of 3; 1 run at the largest size).",
             "Slope = fitted exponent of time ~ n^k over n >= 10k (1 = linear, 2 = quadratic).", "",
             "| input | command | " + " | ".join(f"n = {n:,}" for n in sizes) + " | slope |",
             "|---|---|" + "---:|" * (len(sizes) + 1)]
    for (label, cmd), d in series.items():
        k = slope(sorted(d), [d[n] for n in sorted(d)])
        lines.append(f"| {label} | {cmd} | " + " | ".join(f"{d[n]:.3f}" if n in d else "-" for n in sizes)
                     + f" | {'-' if k is None else f'{k:.2f}'} |")
    lines += ["", "Before this issue: the missing-shard index was quadratic (a scan of the whole index per missing "
              "shard: 5k missing shards took 4.8 s through the CLI), and `inspect` of a GGUF went "
              "through `gguf.GGUFReader`, whose cost per array element is in the floor rows above (10**6 elements: "
              "193 s measured once on this machine).  The CLI's human output now prints at most 20 findings per rule "
              "(100k findings: 47.6 s -> 5.4 s for `exl2fmt validate`, most of it interpreter start-up and the "
              "index itself).  `validate --deep` on many tiny layers paid a 65536-bin histogram per layer (2000 1x1 "
              "layers: 115 s); small weights are now reduced directly (1.9 s).  Numeric GGUF arrays cost O(1) at open "
              "(slope ~0: only their length is read); string "
              "arrays are walked once (each length precedes its string), linearly.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_results:
        res = ROOT / "bench" / "RESULTS.md"
        old = res.read_text(encoding="utf-8")
        if TITLE in old:
            a = old.index(TITLE)
            b = old.find("\n## ", a + len(TITLE))
            old = old[:a] + (old[b + 1:] if b != -1 else "")
        res.write_text(old.rstrip("\n") + "\n\n" + text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
