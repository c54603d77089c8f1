"""EXL2 measurement cost against the quantize pass of the same run, and the A/B of fewer scoring rows.

Each arm is one ``quantize_model`` run in its own process (so its peak RSS is its own), which reports the
measurement's and the quantization pass's seconds side by side: the target of issue 18 is measure <= 2 x
quantize.  Every arm saves its measurement; the plans the optimizer picks from each measurement at
``--plan-bits`` (default 2.5, 3, 4, 5, 6 bpw: ``pipeline.plan_from_measurement``, the optimization the
quantizer runs) are compared with the first arm's, block by block.

    python bench/bench_measure.py [--model DIR] [--rows 16] [--length 256] [--arms all,default,4] [--record]
    python bench/bench_measure.py --arms default --trees /old/tree,. --repeat 2     # before/after, interleaved

An arm is ``default`` (the tree's default ``--measure-rows``: every row before 2026-12-03, since then a quarter
of the rows, at least 2048 tokens), ``all`` (every calibration row scores the candidates) or a row count
(``--measure-rows N``), optionally followed by ``/full`` or ``/bracket`` (``--measure-search``; without it the
tree's default: the full grid before 2026-12-04, the bracket since) and by ``@fp32`` or ``@bf16``
(``--measure-precision``; without it the tree's default: fp32 before 2026-12-04, since then bf16 differences
where bf16 products are fast), e.g. ``default/bracket@fp32``.  ``--trees`` runs every arm with each
source tree's exl2fmt (``PYTHONPATH``), one after the other, ``--repeat`` times, so that two versions are timed
side by side under the same load; the table gives each run's full output hashes.  ``--record`` appends the table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"


def _arm(model: str, dst: str, rows: int, length: int, bits: float, measure_rows: int | None, mfile: str,
         search: str | None = None, precision: str | None = None, calibration: str | None = None) -> dict:
    """One quantization in this process: its seconds, peak RSS and output hashes."""
    import resource

    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    extra = {} if search is None else {"measure_search": search}
    if precision is not None:
        extra["measure_precision"] = precision
    o = QuantOptions(target="exl2", bits=bits, rows=rows, length=length, device="cpu", measure_rows=measure_rows,
                     save_measurement=mfile, calibration=calibration, **extra)
    import exl2fmt

    rep = quantize_model(model, dst, o, verify_output=validate_quantized_output)
    sha = {f: hashlib.sha256((Path(dst) / f).read_bytes()).hexdigest()
           for f in ("output.safetensors", "measurement.json")}
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": rep.seconds, "maxrss_mb": ru.ru_maxrss / 1024, "cpu_s": ru.ru_utime + ru.ru_stime,
            "sha": sha, "tree": str(Path(exl2fmt.__file__).resolve().parent.parent), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(FIXTURE))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--bits", type=float, default=4.15)
    ap.add_argument("--arms", default="all,default")
    ap.add_argument("--plan-bits", default="2.5,3,4,5,6")
    ap.add_argument("--calibration", help="token ids (.npy) instead of the built-in text (models without a "
                    "tokenizer)")
    ap.add_argument("--trees", default="", help="comma-separated source trees (default: the imported exl2fmt)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--_arm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._arm:                        # child: one arm, JSON on the last line
        mr, search, precision, dst, mfile = json.loads(a._arm)
        print(json.dumps(_arm(a.model, dst, a.rows, a.length, a.bits, mr, mfile, search, precision,
                              a.calibration)))
        return
    from exl2fmt.quant.measure import plan_from_measurement

    load = os.getloadavg()
    # "default": the tree's own default (``measure_rows`` None; every row before 2026-12-03, a quarter since);
    # "all": every row (trees from 2026-12-03 on); N: that many rows
    arms = []
    for x in a.arms.split(","):
        x, _, precision = x.partition("@")
        rows_, _, search = x.partition("/")
        arms.append((None if rows_ == "default" else rows_ if rows_ == "all" else int(rows_), search or None,
                     precision or None))
    trees = [str(Path(t).resolve()) for t in a.trees.split(",") if t] or [None]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-measure-") as tmp:
        for rep in range(a.repeat):
            for mr, search, precision in arms:
                for ti, tree in enumerate(trees):
                    tag = f"{mr}-{search}-{precision}-{ti}-{rep}"
                    dst, mfile = os.path.join(tmp, f"out-{tag}"), os.path.join(tmp, f"m-{tag}.json")
                    env = dict(os.environ)
                    if tree is not None:
                        env["PYTHONPATH"] = tree
                    p = subprocess.run([sys.executable, __file__, "--model", a.model, "--rows", str(a.rows),
                                        "--length", str(a.length), "--bits", str(a.bits),
                                        *(["--calibration", a.calibration] if a.calibration else []),
                                        "--_arm", json.dumps([mr, search, precision, dst, mfile])], capture_output=True, text=True,
                                       env=env)
                    if p.returncode:
                        sys.exit(p.stderr[-3000:])
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    r["plans"] = {b: plan_from_measurement(a.model, mfile, float(b)) for b in a.plan_bits.split(",")}
                    results.append(((mr, search, precision), r))
                    print(json.dumps({"arm": mr, "search": search, "precision": precision, "tree": r["tree"],
                                      "seconds": r["seconds"],
                                      "cpu_s": r["cpu_s"],
                                      "load": r["load"], "sha": r["sha"]}), flush=True)
    base = results[0][1]["plans"]
    lines = [f"model {a.model}, {a.rows} rows x {a.length} tokens, --bits {a.bits}, load {load[0]:.2f} "
             f"{load[1]:.2f} {load[2]:.2f}", "",
             "| tree | scoring rows / search @ precision | measure s | quantize s | measure / quantize | process CPU s | "
             "load at end | "
             "peak RSS MB | output.safetensors sha256 | measurement.json sha256 | "
             "blocks whose plan differs from the first arm's (at " + ", ".join(base) + " bpw) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mr, search, precision), r in results:
        s = r["seconds"]
        diffs = []
        for b, plan in r["plans"].items():
            d = sum(plan["options"][k] != base[b]["options"][k] for k in base[b]["options"])
            d += sum(plan["overrides"].get(k) != v for k, v in base[b]["overrides"].items())
            d += sum(k not in base[b]["overrides"] for k in plan["overrides"])
            diffs.append(str(d))
        arm = (("default" if mr is None else str(mr)) + (f" / {search}" if search else "")
               + (f" @ {precision}" if precision else ""))
        lines.append(f"| {r['tree']} | {arm} | {s['measure']:.1f} | {s['quantize']:.1f} | "
                     f"{s['measure'] / s['quantize']:.2f} | {r['cpu_s']:.1f} | {r['load']:.2f} | "
                     f"{r['maxrss_mb']:.0f} | {r['sha']['output.safetensors']} | {r['sha']['measurement.json']} | "
                     f"{' / '.join(diffs)} |")
    print("\n".join(lines))
    print(json.dumps([[arm, r["plans"]] for arm, r in results]))
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
