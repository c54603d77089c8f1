"""The quantizer's end-to-end time and peak RSS, two source trees side by side (issue 14: the transformers runner
against the hand-written forward it replaced).

Runs ``exl2fmt convert tests/fixtures/tiny-llama OUT --to gptq --bits 4 --rows 8 --length 128`` (or ``--args``;
``--source 1b`` quantizes a random model of TinyLlama-1.1B's shapes instead, ``--layers N`` of its decoder layers,
calibrated on fixed random token ids) as a fresh CLI process per run, alternating the trees (old, new, new, old, ...) so drifting machine load hits both alike; each
pair of runs (one per tree) takes the heavy-job lock (``--lock``) for itself only.  Wall time is the child's, measured around the
process; peak RSS is the child's own ``ru_maxrss`` from ``wait4``.  The outputs of the two trees are compared
byte for byte (the engine change must not change them).

    python bench/engine_ab.py --old /work/scratch/old-tree [--runs 3] [--lock /work/heavy.lock] [--new-args "--order act"]
    python bench/engine_ab.py --old TREE --source 1b --layers 4 --runs 1 --args "--to exl2 --bits 4.0 --rows 16 --length 256"

The phase seconds each run reports (``convert --json``: measure, quantize, ...) are printed beside the wall time.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
ARGS = ["--to", "gptq", "--bits", "4", "--rows", "8", "--length", "128"]


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def importable(tree: Path) -> Path:
    """``tree`` on PYTHONPATH imports its own ``exl2fmt.converters`` / ``exl2fmt.kernels`` only if they sit inside
    ``exl2fmt/`` (pyproject maps them from top-level folders; the editable install of this checkout would
    otherwise supply them): links them there in the other tree when missing."""
    for sub in ("converters", "kernels"):
        link = tree / "exl2fmt" / sub
        if tree != ROOT and not link.exists() and (tree / sub).is_dir():
            link.symlink_to(Path("..") / sub)
    return tree


def _phase_seconds(stdout: str) -> dict:
    """The ``seconds`` of a ``convert --json`` report (empty when the output is not such a report)."""
    try:
        rep = json.loads(stdout)
    except ValueError:
        return {}
    found = rep.get("seconds") if isinstance(rep, dict) else None
    if found is None and isinstance(rep, dict):
        found = next((v["seconds"] for v in rep.values() if isinstance(v, dict) and "seconds" in v), None)
    return {k: round(float(v), 1) for k, v in (found or {}).items()}


def one_run(tree: Path, src: Path, args: list[str], extra: list[str] = ()) -> dict:
    exe = str(Path(sys.executable).with_name("exl2fmt"))
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
        out = Path(tmp) / "out"
        load = os.getloadavg()[0]
        with open(Path(tmp) / "stdout", "w+b") as so, open(Path(tmp) / "stderr", "w+b") as se:
            t0 = time.perf_counter()
            p = subprocess.Popen(["nice", "-n", "5", exe, "convert", str(src), str(out), *args, *extra, "--json"],
                                 env=env, stdout=so, stderr=se, cwd=tmp)
            _, status, ru = os.wait4(p.pid, 0)      # the child's own peak RSS
            wall = time.perf_counter() - t0
            so.seek(0)
            se.seek(0)
            stdout, err = so.read().decode(errors="replace"), se.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{tree}: convert failed:\n{err[-2000:]}")
        return {"wall_s": round(wall, 2), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "load1": round(load, 2),
                "digest": _digest(out), "phases": _phase_seconds(stdout)}


def make_source(kind: str, layers: int | None, tmp: Path, args: list[str]) -> tuple[Path, list[str]]:
    """The model to quantize and the arguments that go with it (the 1B-shaped model gets fixed random ids)."""
    if kind == "fixture":
        return FIXTURE, args
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_quant_e2e import make_1b

    make_1b(tmp / "1b", layers)
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else 16
    length = int(args[args.index("--length") + 1]) if "--length" in args else 256
    ids = tmp / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 32000, (rows, length)))
    return tmp / "1b", [*args, "--calibration", str(ids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="the other source tree (a git worktree)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lock", default=None, help="flock this file around each run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--new-args", default="", help="extra CLI arguments for the new tree only, e.g. '--order act' "
                    "to give it the old tree's GPTQ default order (the default became static after c440f9c)")
    ap.add_argument("--source", choices=("fixture", "1b"), default="fixture",
                    help="the trained fixture, or a random model of TinyLlama-1.1B's shapes")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the 1B-shaped model (default 22)")
    ap.add_argument("--args", default=" ".join(ARGS), help=f"convert's arguments for both trees (default {' '.join(ARGS)!r})")
    a = ap.parse_args()
    shutil.which("nice") or sys.exit("needs nice")
    trees = {"old": importable(a.old.resolve()), "new": ROOT}
    tmpdir = tempfile.TemporaryDirectory(prefix="engine-ab-src-", dir=os.environ.get("BENCH_TMP"))
    src, args = make_source(a.source, a.layers, Path(tmpdir.name), a.args.split())
    rows = []
    for r in range(a.runs):
        fd = os.open(a.lock, os.O_RDWR | os.O_CREAT) if a.lock else None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            for arm in (("old", "new") if r % 2 == 0 else ("new", "old")):
                res = one_run(trees[arm], src, args, a.new_args.split() if arm == "new" else [])
                rows.append({"arm": arm, **res})
                print(f"  {arm}: {res['wall_s']:7.2f} s  {res['peak_rss_mib']:7.1f} MiB  load {res['load1']}  "
                      f"{res['digest']}  {res['phases']}", flush=True)
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    med = {arm: {k: statistics.median(x[k] for x in rows if x["arm"] == arm) for k in ("wall_s", "peak_rss_mib")}
           for arm in trees}
    same = len({x["digest"] for x in rows}) == 1
    summary = {"runs": rows, "median": med, "wall_ratio_new_over_old": round(med["new"]["wall_s"] /
               med["old"]["wall_s"], 3), "rss_ratio_new_over_old": round(med["new"]["peak_rss_mib"] /
               med["old"]["peak_rss_mib"], 3), "outputs_identical": same}
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        for arm in trees:
            print(f"{arm}: median {med[arm]['wall_s']:.2f} s, {med[arm]['peak_rss_mib']:.1f} MiB")
        print(f"new/old wall {summary['wall_ratio_new_over_old']}, RSS {summary['rss_ratio_new_over_old']}; "
              f"outputs identical: {same}")


if __name__ == "__main__":
    main()
