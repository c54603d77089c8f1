"""Issue 36: the distributed EXL2 measurement gives the one-process run's bytes, and how it scales.

Runs ``exl2fmt convert SRC DST --to exl2 --bits 4.0`` (the script installed beside this interpreter) on the
trained fixture (tests/fixtures/tiny-llama, 4 layers) and on a tiny Mixtral (4 layers, 4 experts, made here
with tests/tiny_models.py), each

- without ``--workers`` (the one-process run), with ``--workers 1``, ``2`` and ``3`` (a local Ray cluster),
- with ``--ray-address 127.0.0.1:PORT`` on a second cluster started here with ``ray start --head`` (stopped after),
- with ``--workers 2`` while one worker is killed (SIGKILL) in the middle of the measurement,

and prints the sha256 of every output file per run and whether all runs of a model agree.  ``--scaling``: the
measurement's seconds (the report's ``seconds.measure``) with every process single-threaded
(OMP/MKL/NUMBA_NUM_THREADS=1): one-process, ``--workers 1``, ``--workers 2``, interleaved, ``--repeat`` times, on
the fixture and on a bigger synthetic llama (``--big HIDDENxLAYERS``, default 512x8), then a table of the ratios.

    python bench/distributed_identity.py --out /tmp/dist.json [--scaling --repeat 2] [--only fixture|moe|big]
    python bench/distributed_identity.py --out /tmp/scal.json --scaling --no-identity --repeat 3   # the ratios

``--quantize``: the distributed quantize pass (the experts of a MoE block, q/k/v and gate/up on the workers):
byte identity of exl2 and gptq on the tiny Mixtral for one process, --workers 1, 2, 3 and --workers 2, 3
--no-shared-fs; with ``--scaling`` the quantize pass's seconds, single-threaded, one process / --workers 1 / 2
interleaved on a bigger Mixtral (``--moe-big HIDDENxEXPERTSxLAYERS``, default 512x8x4; EXL2 from a saved
measurement, so the run is the quantize pass alone):

    python bench/distributed_identity.py --quantize --out /tmp/q.json                                 # identity
    python bench/distributed_identity.py --quantize --scaling --no-identity --repeat 3 --out /tmp/qs.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"


def sha_tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def make_moe(where: Path) -> tuple[Path, list[str]]:
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny

    d = make_tiny("mixtral", where / "tiny-mixtral", num_hidden_layers=4)
    ids = where / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (8, 64)))
    return d, ["--calibration", str(ids), "--rows", "8", "--length", "64"]


def workers_of(pid: int) -> list[int]:
    """The Ray worker processes serving the run whose driver is ``pid`` (Ray daemonizes its processes, so they
    are not the driver's descendants; exl2fmt starts them with EXL2FMT_DRIVER=HOST:PID in their environment)."""
    import socket

    mark = f"EXL2FMT_DRIVER={socket.gethostname()}:{pid}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if mark in (p / "environ").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def convert(src: Path, dst: Path, args: list[str], env: dict | None = None, kill_after: float | None = None,
            to: tuple[str, ...] = ("--to", "exl2", "--bits", "4.0")) -> dict:
    """One run; returns {"hashes", "seconds", "warnings", "killed"}.  ``kill_after``: once a worker has run a
    measure_layer task for that many seconds, SIGKILL it (a process this run started)."""
    cmd = [str(BIN / "exl2fmt"), "convert", str(src), str(dst), *to, "--seed", "0",
           "--device", "cpu", "--force", "--json", *args]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
                         text=True)
    killed = None
    if kill_after is not None:
        seen: dict[int, float] = {}
        while p.poll() is None and killed is None:
            for c in workers_of(p.pid):
                if "measure_layer" in cmdline(c):     # ray::MeasureWorker.measure_layer, while it runs one
                    seen.setdefault(c, time.monotonic())
                    if time.monotonic() - seen[c] >= kill_after:
                        os.kill(c, signal.SIGKILL)
                        killed = c
                        break
            time.sleep(0.2)
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    rep = json.loads(out)
    r = rep.get("result", rep)
    return {"hashes": sha_tree(dst), "seconds": r.get("seconds", {}), "warnings": r.get("warnings", []),
            "killed": killed, "wall": time.monotonic() - t0}


def start_head(port: int, cpus: int) -> subprocess.Popen:
    """A second Ray cluster on this machine (``ray start --head --block``, held by this process: stopped by its
    pid, which takes its GCS, raylet and workers down with it)."""
    import socket

    # (Ray's CLI as a module: a venv that sees the packages through a .pth file has no `ray` script of its own)
    p = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                          "--port", str(port), "--num-cpus", str(cpus), "--include-dashboard", "false",
                          "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         # workers at normal priority, as spec/quantizer.md advises (the 2026-12-07 figures were
                         # taken without it: Ray's default +15 niceness)
                         env={**os.environ, "RAY_worker_niceness": "0"})
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(3.0)                  # the raylet registers after the GCS port opens
            return p
        except OSError:
            time.sleep(0.1)
    p.terminate()
    raise SystemExit("ray start --head did not open its port")


def stop_head(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def identity(name: str, src: Path, args: list[str], tmp: Path, port: int) -> dict:
    runs = {}
    runs["one-process"] = convert(src, tmp / f"{name}-plain", args)
    print(f"{name:8s} one-process: measure {runs['one-process']['seconds'].get('measure', 0):6.1f} s", flush=True)
    for n in (1, 2, 3):
        runs[f"--workers {n}"] = convert(src, tmp / f"{name}-w{n}", [*args, "--workers", str(n)])
    head = start_head(port, 2)
    try:
        runs[f"--ray-address 127.0.0.1:{port}"] = convert(src, tmp / f"{name}-addr", [*args, "--ray-address",
                                                                                       f"127.0.0.1:{port}"])
    finally:
        stop_head(head)
    runs["--workers 2, one worker killed"] = convert(src, tmp / f"{name}-kill", [*args, "--workers", "2"],
                                                     kill_after=3.0)
    ref = runs["one-process"]["hashes"]
    for label, r in runs.items():
        same = r["hashes"] == ref
        print(f"{name:8s} {label:36s} {'identical' if same else 'DIFFERENT'} measure "
              f"{r['seconds'].get('measure', 0):6.1f} s  killed={r['killed']} {[w for w in r['warnings'] if 'lost' in w]}",
              flush=True)
    return runs


def make_big(where: Path, hidden: int, layers: int) -> tuple[Path, list[str]]:
    """A seeded random llama whose layers cost more than the fixture's: hidden ``hidden``, intermediate 3x,
    ``layers`` layers, 8 heads (4 KV), vocabulary 2048; calibration 8 x 128 random ids."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny

    d = make_tiny("llama", where / f"llama-{hidden}", hidden_size=hidden, intermediate_size=3 * hidden,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                  vocab_size=2048)
    ids = where / "ids-big.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 2048, (8, 128)))
    return d, ["--calibration", str(ids), "--rows", "8", "--length", "128"]


SCALING_RUNS = (("one-process", []), ("--workers 1", ["--workers", "1"]), ("--workers 2", ["--workers", "2"]))


def scaling(name: str, src: Path, args: list[str], tmp: Path, repeat: int) -> dict:
    """One process, --workers 1, --workers 2, every process single-threaded, interleaved, ``repeat`` rounds:
    the report's ``seconds`` (the measurement phase, its parts, the whole conversion) and the wall time."""
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    runs: dict[str, list[dict]] = {label: [] for label, _ in SCALING_RUNS}
    hashes = {}
    for _ in range(repeat):
        for label, extra in SCALING_RUNS:
            r = convert(src, tmp / f"{name}-s", [*args, *extra], env=one)
            runs[label].append({**r["seconds"], "wall": r["wall"], "load": os.getloadavg()[0]})
            hashes.setdefault(label, r["hashes"])
            print(f"{name} single-threaded {label:12s} measure {r['seconds']['measure']:6.1f} s  total "
                  f"{r['seconds']['total']:6.1f} s  load {os.getloadavg()[0]:.1f}", flush=True)
    same = all(h == hashes["one-process"] for h in hashes.values())
    return {"runs": runs, "identical": same}


def print_scaling(res: dict) -> None:
    """The ratio table: per model the minimum over the rounds of the measurement phase and of the conversion,
    2 workers against 1 and against one process, and the workers' time split (from the best --workers run)."""
    print("\n| model | run | measure (min) | total (min) | measure: --workers 1 / this | measure: one process / "
          "this | rounds | load |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for key, v in res.items():
        if not key.endswith("/scaling"):
            continue
        name = key.split("/")[0]
        m = {label: min(r["measure"] for r in rs) for label, rs in v["runs"].items()}
        for label, rs in v["runs"].items():
            loads = [r["load"] for r in rs]
            print(f"| {name} | {label} | {m[label]:.1f} s | {min(r['total'] for r in rs):.1f} s | "
                  f"{m['--workers 1'] / m[label]:.2f}x | {m['one-process'] / m[label]:.2f}x | {len(rs)} | "
                  f"{min(loads):.1f}-{max(loads):.1f} |")
        print(f"| {name} | outputs identical across the three | {v['identical']} | | | | | |")
    for key, v in res.items():
        if key.endswith("/scaling"):
            for label in ("--workers 1", "--workers 2"):
                best = min(v["runs"][label], key=lambda r: r["measure"])
                parts = {k.split("/", 1)[1]: round(x, 1) for k, x in best.items() if k.startswith("measure/")}
                print(f"{key.split('/')[0]} {label} (best round), measurement's parts in s: {parts}")


# ------------------------------------------------------------------------------------------------ the quantize pass

TARGETS = {"exl2": ("--to", "exl2", "--bits", "5.0"), "gptq": ("--to", "gptq", "--bits", "4")}


def make_moe_big(where: Path, spec: str) -> tuple[Path, list[str]]:
    """A seeded random Mixtral ``HIDDENxEXPERTSxLAYERS`` (experts ``HIDDEN`` wide, top 2, 8 heads, vocabulary
    2048); calibration 8 x 128 random ids."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny, width_dims

    hidden, experts, layers = (int(x) for x in spec.split("x"))
    d = make_tiny("mixtral", where / f"mixtral-{spec}", **{**width_dims("mixtral", hidden, 2048),
                  "num_hidden_layers": layers, "num_local_experts": experts, "num_experts_per_tok": 2})
    ids = where / "ids-moe-big.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 2048, (8, 128)))
    return d, ["--calibration", str(ids), "--rows", "8", "--length", "128"]


QUANT_RUNS = (("one-process", []), ("--workers 1", ["--workers", "1"]), ("--workers 2", ["--workers", "2"]),
              ("--workers 3", ["--workers", "3"]), ("--workers 2 --no-shared-fs", ["--workers", "2", "--no-shared-fs"]),
              ("--workers 3 --no-shared-fs", ["--workers", "3", "--no-shared-fs"]))


def identity_quant(name: str, src: Path, args: list[str], tmp: Path) -> dict:
    """EXL2 (measurement and quantize pass) and GPTQ, one process against every ``QUANT_RUNS`` row."""
    out = {}
    for target, to in TARGETS.items():
        runs = {label: convert(src, tmp / f"{name}-{target}", [*args, *extra], to=to) for label, extra in QUANT_RUNS}
        ref = runs["one-process"]["hashes"]
        for label, r in runs.items():
            print(f"{name} {target} {label:28s} {'identical' if r['hashes'] == ref else 'DIFFERENT'}  quantize "
                  f"{r['seconds'].get('quantize', 0):6.1f} s  total {r['seconds'].get('total', 0):6.1f} s", flush=True)
        out[target] = {label: {"identical": r["hashes"] == ref, "seconds": r["seconds"]} for label, r in runs.items()}
    return out


def scaling_quant(name: str, src: Path, args: list[str], tmp: Path, repeat: int, targets: list[str]) -> dict:
    """The quantize pass (the report's ``seconds.quantize``: for EXL2 from a saved measurement, so the run is
    the quantize pass alone) with every process single-threaded: one process, --workers 1, --workers 2,
    interleaved, ``repeat`` rounds."""
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    res = {}
    for target in targets:
        extra = list(args)
        if target == "exl2":
            m = tmp / f"{name}-measurement.json"
            if not m.exists():
                convert(src, tmp / f"{name}-m", [*args, "--save-measurement", str(m)], env=one, to=TARGETS[target])
            extra += ["--measurement", str(m)]
        runs: dict[str, list] = {label: [] for label, _ in SCALING_RUNS}
        hashes = {}
        for _ in range(repeat):
            for label, w in SCALING_RUNS:
                r = convert(src, tmp / f"{name}-q", [*extra, *w], env=one, to=TARGETS[target])
                runs[label].append({**r["seconds"], "wall": r["wall"], "load": os.getloadavg()[0]})
                hashes.setdefault(label, r["hashes"])
                print(f"{name} {target} single-threaded {label:12s} quantize {r['seconds']['quantize']:6.1f} s  "
                      f"total {r['seconds']['total']:6.1f} s  load {os.getloadavg()[0]:.1f}", flush=True)
        res[target] = {"runs": runs, "identical": all(h == hashes["one-process"] for h in hashes.values())}
    return res


def print_scaling_quant(name: str, res: dict) -> None:
    print("\n| model | target | run | quantize (min) | --workers 1 / this | one process / this | rounds | load |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for target, v in res.items():
        m = {label: min(r["quantize"] for r in rs) for label, rs in v["runs"].items()}
        for label, rs in v["runs"].items():
            loads = [r["load"] for r in rs]
            print(f"| {name} | {target} | {label} | {m[label]:.1f} s | {m['--workers 1'] / m[label]:.2f}x | "
                  f"{m['one-process'] / m[label]:.2f}x | {len(rs)} | {min(loads):.1f}-{max(loads):.1f} |")
        print(f"| {name} | {target} | outputs identical across the three | {v['identical']} | | | | |")
        best = min(v["runs"]["--workers 2"], key=lambda r: r["quantize"])
        print(f"{name} {target} --workers 2 (best round), the pass's parts in s: "
              f"{ {k: round(x, 1) for k, x in best.items() if k.startswith('quantize/')} }")


def quantize_main(a) -> None:
    """``--quantize``: identity of the distributed quantize pass on the tiny MoE model (exl2 and gptq, N = 1, 2,
    3, with and without --no-shared-fs), then its scaling on ``--moe-big`` (``--no-identity``: scaling only)."""
    res: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="exl2fmt-distq-") as t:
        tmp = Path(t)
        if not a.no_identity:
            res["moe/identity"] = identity_quant("moe", *make_moe(tmp), tmp)
        if a.scaling:
            src, args = make_moe_big(tmp, a.moe_big)
            res["moe-big/scaling"] = scaling_quant(f"mixtral-{a.moe_big}", src, args, tmp, a.repeat,
                                                   a.targets.split(","))
            print_scaling_quant(f"mixtral-{a.moe_big}", res["moe-big/scaling"])
    res["load_after"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("fixture", "moe", "big"))
    ap.add_argument("--big", default="512x8", help="the synthetic llama for --only big / --scaling: HIDDENxLAYERS")
    ap.add_argument("--scaling", action="store_true")
    ap.add_argument("--no-identity", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--port", type=int, default=6399)
    ap.add_argument("--quantize", action="store_true", help="the distributed quantize pass (quantize_main)")
    ap.add_argument("--moe-big", default="512x8x4", help="--quantize --scaling: the Mixtral HIDDENxEXPERTSxLAYERS")
    ap.add_argument("--targets", default="gptq,exl2", help="--quantize --scaling: which targets to time")
    a = ap.parse_args()
    if a.quantize:
        quantize_main(a)
        return
    res: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="exl2fmt-dist-") as t:
        tmp = Path(t)
        makers = {"fixture": lambda: (FIXTURE, ["--rows", "8", "--length", "128"]), "moe": lambda: make_moe(tmp),
                  "big": lambda: make_big(tmp, *(int(x) for x in a.big.split("x")))}
        made: dict = {}

        def model(name):
            if name not in made:
                made[name] = makers[name]()
            return made[name]
        # identity on the fixture and the MoE model, the scaling on the fixture and the bigger llama (--only: one)
        for name in ([a.only] if a.only else ["fixture", "moe"]) if not a.no_identity else []:
            res[f"{name}/identity"] = identity(name, *model(name), tmp, a.port)
        for name in ([a.only] if a.only else ["fixture", "big"]) if a.scaling else []:
            res[f"{name}/scaling"] = scaling(name, *model(name), tmp, a.repeat)
    res["load_after"] = os.getloadavg()
    if a.scaling:
        print_scaling(res)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
