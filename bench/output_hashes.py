"""sha256 of every output exl2fmt writes, for proving a refactor byte-identical (issue 13).

Runs, through the ``exl2fmt`` script installed beside the interpreter that runs this script:

- ``sample`` (the demo's model) and ``demo`` (its stdout with timings removed),
- the quantizer on the trained fixture: FP16 -> EXL2 (4.0 bpw) and FP16 -> GPTQ (4-bit g32),
  with a small fixed calibration set so the run takes a couple of minutes on 2 cores,
- every converter direction from those outputs: EXL2 -> fp16/bf16/gptq/gguf, GPTQ -> fp16/exl2/gguf,
  dense -> gguf, GGUF -> fp16/exl2/gptq,
- an EXL3 model made from the trained fixture by the tests' encoder (``tests/test_exl3.py``'s ``make_exl3``,
  seeded: all 11 rates and the three codebooks) and its conversions EXL3 -> fp16/bf16/gguf (issue 39's decoder),
- ``dequantize`` of one layer of each format to .npy,

and writes one JSON object ``{"<output>/<file>": "<sha256>"}``.  Compare two runs with ``--compare``::

    python bench/output_hashes.py --out /tmp/h-before.json
    # ... refactor ...
    python bench/output_hashes.py --out /tmp/h-after.json --compare /tmp/h-before.json

Files whose content records the wall clock or the machine (none today) would be listed in ``VOLATILE``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
VOLATILE: frozenset[str] = frozenset()

QUANT = ["--rows", "8", "--length", "128", "--seed", "0", "--device", "cpu"]

#: (name, src, extra args); src names an earlier output or "fixture".
STEPS: list[tuple[str, str, list[str]]] = [
    ("fix-exl2", "fixture", ["--to", "exl2", "--bits", "4.0", *QUANT]),
    ("fix-gptq", "fixture", ["--to", "gptq", "--bits", "4", "--group-size", "32", *QUANT]),
    ("exl2-fp16", "fix-exl2", ["--to", "fp16"]),
    ("exl2-bf16", "fix-exl2", ["--to", "bf16"]),
    ("exl2-gptq", "fix-exl2", ["--to", "gptq", "--bits", "4"]),
    ("exl2.gguf", "fix-exl2", ["--to", "gguf"]),
    ("gptq-fp16", "fix-gptq", ["--to", "fp16"]),
    ("gptq-exl2", "fix-gptq", ["--to", "exl2"]),
    ("gptq.gguf", "fix-gptq", ["--to", "gguf"]),
    ("dense.gguf", "fixture", ["--to", "gguf"]),
    ("gguf-fp16", "gptq.gguf", ["--to", "fp16"]),
    ("gguf-exl2", "gptq.gguf", ["--to", "exl2", "--bits", "4.0", *QUANT]),
    ("gguf-gptq", "gptq.gguf", ["--to", "gptq", *QUANT]),
    ("sample-fp16", "sample", ["--to", "fp16", "--shard-size", "200KB"]),
    ("exl3-fp16", "fix-exl3", ["--to", "fp16"]),
    ("exl3-bf16", "fix-exl3", ["--to", "bf16"]),
    ("exl3.gguf", "fix-exl3", ["--to", "gguf"]),
]

DEQUANT = [("sample", "model.layers.0.mlp.down_proj"), ("fix-exl2", "model.layers.1.self_attn.q_proj"),
           ("fix-gptq", "model.layers.2.mlp.up_proj"), ("fixture", "model.layers.3.self_attn.o_proj"),
           ("fix-exl3", "model.layers.1.mlp.down_proj")]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, label: str, out: dict[str, str]) -> None:
    if root.is_file():
        out[label] = sha256(root)
        return
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[f"{label}/{p.relative_to(root).as_posix()}"] = sha256(p)


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "exl2fmt"), *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    print(f"  {time.perf_counter() - t0:6.1f}s rc={r.returncode} exl2fmt {' '.join(args)}", file=sys.stderr)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def make_exl3_fixture(dst: Path) -> Path:
    """The EXL3 copy of the trained fixture that tests/test_exl3.py decodes (its test-side encoder, seed 39)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_exl3 import make_exl3

    t0 = time.perf_counter()
    make_exl3(FIXTURE, dst, seed=39)
    print(f"  {time.perf_counter() - t0:6.1f}s tests/test_exl3.py make_exl3 (fixture -> EXL3, seed 39)", file=sys.stderr)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the hashes")
    ap.add_argument("--compare", help="an earlier --out to compare with (exit 1 on any difference)")
    ap.add_argument("--keep", help="keep the outputs in this directory")
    ap.add_argument("--exl3-only", action="store_true",
                    help="only the EXL3 model, its conversions and its dequantize (a minute, not the quantizer's half hour)")
    a = ap.parse_args()

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="exl2fmt-hashes-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = {"fixture": FIXTURE}
    hashes: dict[str, str] = {}

    if not a.exl3_only:
        cli("sample", str(work / "sample"))
        paths["sample"] = work / "sample"
        demo = cli("demo").stdout
        hashes["demo/stdout"] = hashlib.sha256(re.sub(r"\d+(\.\d+)?\s*(ms|s)\b", "T", re.sub(r"exl2fmt-demo-\w+", "D", demo)).encode()).hexdigest()

    paths["fix-exl3"] = make_exl3_fixture(work / "fix-exl3")
    for name, src, extra in STEPS:
        if a.exl3_only and src != "fix-exl3":
            continue
        dst = work / name
        cli("convert", str(paths[src]), str(dst), *extra)
        paths[name] = dst
    for src, key in DEQUANT:
        if a.exl3_only and src != "fix-exl3":
            continue
        npy = work / f"deq-{src}.npy"
        cli("dequantize", str(paths[src]), key, "-o", str(npy))
        paths[npy.name] = npy

    for label, p in paths.items():
        if label != "fixture":
            hash_tree(p, label, hashes)
    hashes = {k: v for k, v in sorted(hashes.items()) if k not in VOLATILE}
    Path(a.out).write_text(json.dumps(hashes, indent=1) + "\n")
    print(f"{len(hashes)} files hashed -> {a.out}")

    if a.compare:
        old = json.loads(Path(a.compare).read_text())
        diff = sorted(k for k in old.keys() | hashes.keys() if old.get(k) != hashes.get(k))
        for k in diff:
            print(f"DIFFERENT {k}: {old.get(k, '-')[:12]} -> {hashes.get(k, '-')[:12]}")
        print(f"{len(diff)} of {len(old.keys() | hashes.keys())} differ")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
