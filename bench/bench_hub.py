"""Benchmark: `exl2fmt inspect` / `validate` of a Hub model by range requests, bytes fetched vs model size.

    .venv/bin/python bench/bench_hub.py [--no-results]

Builds the synthetic Llama-70B-shaped EXL2 model of bench/bench_inspect.py (8 sparse shards, ~40 GB logical,
index, config.json; real q_groups) as branch "4.0bpw" of ORG/llama-70b-exl2, serves it with the local Hub
emulation of the tests (tests/hub_server.py: resolve endpoint with a 302 to a CDN origin, tree and refs APIs,
ranges) on 127.0.0.1, and runs, as subprocesses with HF_ENDPOINT set:

* `exl2fmt inspect hf://ORG/llama-70b-exl2@4.0bpw --json` and `exl2fmt validate hf://...@4.0bpw --json`
  (wall clock, median of 3 after a warm-up), against `exl2fmt inspect DIR --json` on the same files on disk;
* the bytes the emulator served (all bodies, counted server-side) against the report's bytes_fetched and the
  model's size, and the number of requests.

Loopback has no latency: on the real Hub each of the ~570 requests costs a round trip (8 in flight), so the
wall time there is dominated by latency; the byte counts are what carries over.  Appends a section to
bench/RESULTS.md unless --no-results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_inspect import build_70b  # noqa: E402
from hub_server import HubEmulator  # noqa: E402

EXE = [sys.executable, "-m", "exl2fmt.cli.app"]


def timed(cmd, env, reps=3):
    subprocess.run(cmd, env=env, capture_output=True)
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        ts.append(time.perf_counter() - t0)
        if r.returncode:
            raise SystemExit(f"{cmd} -> {r.returncode}\n{r.stderr[-2000:]}")
        out = r.stdout
    return statistics.median(ts), json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-results", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="exl2fmt-bench-hub-") as tmp:
        d = Path(tmp) / "ORG/llama-70b-exl2/4.0bpw"
        d.mkdir(parents=True)
        info = build_70b(d)
        (Path(tmp) / "ORG/llama-70b-exl2/main").mkdir()
        (Path(tmp) / "ORG/llama-70b-exl2/main/README.md").write_text("one branch per bitrate")
        size = sum(p.stat().st_size for p in d.iterdir())
        with HubEmulator(tmp) as emu:
            env = dict(os.environ, HF_ENDPOINT=emu.endpoint, HF_HOME=str(Path(tmp) / "hf-home"))
            env.pop("HF_TOKEN", None)
            t_local, rep_local = timed([*EXE, "inspect", str(d), "--json"], env)
            emu.reset()
            t_hub, rep = timed([*EXE, "inspect", "hf://ORG/llama-70b-exl2@4.0bpw", "--json"], env)
            served = emu.total_served / 4  # warm-up + 3 timed runs, identical requests each
            t_val, val = timed([*EXE, "validate", "hf://ORG/llama-70b-exl2@4.0bpw", "--json"], env)
    h = rep["hub"]
    same = ({k: v for k, v in rep["summary"].items()} == rep_local["summary"]
            and [l["plan"] for l in rep["layers"]] == [l["plan"] for l in rep_local["layers"]])
    lines = [
        "## Issue 19: inspect / validate of a Hub model by range requests (2026-12-01)",
        "",
        f"Synthetic Llama-70B-shaped EXL2 (bench/bench_inspect.py: {info['tensors']} tensors, {info['shards']} "
        f"sparse shards, {size / 1e9:.1f} GB) served by the tests' Hub emulation on 127.0.0.1 (resolve -> 302 to a "
        f"CDN origin, tree/refs APIs, ranges); {platform.machine()}, {os.cpu_count()} CPUs shared with other jobs.",
        "",
        "| | wall (median of 3) | bytes fetched | share of the model | requests |",
        "|---|---|---|---|---|",
        f"| `inspect DIR --json` (local disk) | {t_local:.2f} s | - | - | - |",
        f"| `inspect hf://...@4.0bpw --json` | {t_hub:.2f} s | {h['bytes_fetched']:,} | "
        f"{100 * h['bytes_fetched'] / h['model_bytes']:.4f}% | {h['requests']} |",
        f"| `validate hf://...@4.0bpw --json` | {t_val:.2f} s | {val['hub']['bytes_fetched']:,} | "
        f"{100 * val['hub']['bytes_fetched'] / val['hub']['model_bytes']:.4f}% | {val['hub']['requests']} |",
        "",
        f"* Model size (files read): {h['model_bytes']:,} bytes; the emulator served {served:,.0f} bytes per run "
        f"(report: {h['bytes_fetched']:,}, the difference is huggingface_hub's own user-agent registry request to /api/agent-harnesses, a 404 here); "
        f"hub report identical to the local one (summary, every layer's plan): {'yes' if same else 'NO'}.",
        f"* validate result on the Hub copy: {val['result']} ({val['counts']['pass']} passed, "
        f"{val['counts']['warn']} warnings, {val['counts']['fail']} failed).",
        "* What is fetched: the 8 + n header bytes of each shard, config.json, the index, and the 561 EXL2 q_groups "
        "tables (one range each, 8 in flight); no tensor data otherwise.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not a.no_results:
        p = ROOT / "bench" / "RESULTS.md"
        p.write_text(p.read_text().rstrip("\n") + "\n\n" + text)
    return 0 if same and val["result"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
