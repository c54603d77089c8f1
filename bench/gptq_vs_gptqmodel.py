"""exl2fmt's GPTQ against GPTQModel's, side by side on one machine (issue 18).  Not run in CI.

Both tools quantize the same model to GPTQ 4-bit, group size 128, symmetric, with the same calibration token
ids and the same damping (``percdamp`` 0.01: exl2fmt's ``GPTQ_PERCDAMP``, GPTQModel's ``damp_percent``), in two
input orders:

* ``act``   act-order (descending Hessian diagonal; GPTQModel ``desc_act=True``; non-monotone ``g_idx``);
* ``group`` group-aware act-order (whole groups ranked, act-order inside; GPTQModel ``act_group_aware=True``,
            its default; exl2fmt ``--order group``).

Each arm is one child process (exl2fmt: the ``exl2fmt convert --to gptq`` CLI; GPTQModel: this script's
``--worker`` mode in the scratch venv, ``GPTQModel.load`` + ``quantize`` + ``save``), timed by the parent with
``os.wait4``: CPU time (user + sys of the whole process, imports included), wall time and peak RSS.  Every
output is then dequantized by the same reader (``exl2fmt convert --to fp16``) and run in transformers (float32)
on held-out ids of the shipped corpus's ``eval`` part; the KL divergence to the FP16 model (run the same way)
is the quality.

Models: ``fixture`` (``tests/fixtures/tiny-llama``, trained) and ``1b`` (TinyLlama-1.1B shapes: hidden 2048,
intermediate 5632, 32 heads / 4 KV heads, vocab 32000; seeded random fp16 weights written with
``save_pretrained``; ``--layers`` of its 22 decoder layers, the fixture's tokenizer copied beside it).

Setup of the scratch venv S (once, outside the repository; nothing of it is committed):

    S=/work/scratch/h16
    python3 -m venv $S/V                 # sees the project venv's packages (torch 2.13 CPU, transformers 5.x):
    echo $PWD/.venv/lib/python3.11/site-packages > $S/V/lib/python3.11/site-packages/_base.pth
    $S/V/bin/pip install --no-deps gptqmodel==7.7.0 pypcre logbar tokenicer device-smi defuser pillow

(GPTQModel 7.7 declares torch >= 2.14; with --no-deps it runs on torch 2.13's CPU build; the six extra packages
are what it imports at start-up.)  GPTQModel runs on the CPU with ``GPTQMODEL_CPU_WORKERS=2`` (this machine's
two cores) and ``CUDA_VISIBLE_DEVICES=''``.

Run (heavy: one arm per lock, as the machine is shared):

    python bench/gptq_vs_gptqmodel.py --model fixture --tool exl2fmt --order act      # one arm, appends to --json
    python bench/gptq_vs_gptqmodel.py --model fixture --report                        # KL of every output + table

``--tool`` / ``--order`` may be repeated (default: both tools, both orders).  Results go to ``--json``
(default ``$WORK/results.json``, merged across calls); ``--report`` prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
PERCDAMP = 0.01
BITS, GROUP = 4, 128
ORDERS = ("act", "group")
TOOLS = ("exl2fmt", "gptqmodel")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: calibration rows x length and held-out rows x length per model
SIZES = {"fixture": {"cal": (32, 512), "eval": (32, 256)}, "1b": {"cal": (8, 512), "eval": (8, 256)}}


# ------------------------------------------------------------------------------------------------ models, ids


def make_1b(dst: Path, layers: int, seed: int = 0) -> Path:
    """TinyLlama-1.1B-shaped Llama with ``layers`` decoder layers, seeded random fp16 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dst / "config.json").exists():
        return dst
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        shutil.copy(FIXTURE / f, tmp / f)
    tmp.rename(dst)
    return dst


def model_dir(work: Path, name: str, layers: int) -> Path:
    return FIXTURE if name == "fixture" else make_1b(work / f"llama-1b-{layers}L", layers)


def token_ids(work: Path, name: str, mdir: Path) -> tuple[Path, Path]:
    """calibration ids (exl2fmt's built-in set, seed 0) and held-out ids, int64 .npy files in ``work``."""
    import numpy as np

    from exl2fmt.quant.calib import load_calibration
    from exl2fmt.quant.evaluate import eval_ids

    cal, ev = work / f"{name}-cal.npy", work / f"{name}-eval.npy"
    if not cal.exists():
        r, n = SIZES[name]["cal"]
        np.save(cal, load_calibration(None, FIXTURE / "tokenizer.json", r, n, 0, vocab_size=2048).numpy())
    if not ev.exists():
        r, n = SIZES[name]["eval"]
        np.save(ev, eval_ids(FIXTURE / "tokenizer.json", r, n).numpy())
    return cal, ev


# ------------------------------------------------------------------------------------------------ the arms


def timed(cmd: list[str], env: dict | None = None, log: Path | None = None, cwd: Path | None = None) -> dict:
    """Run ``cmd`` as a child (in ``cwd``); its CPU (user + sys), wall seconds and peak RSS (MiB) from
    ``os.wait4``."""
    t = time.monotonic()
    with open(log or os.devnull, "w") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{tail}")
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "wall_s": wall,
            "peak_rss_mib": ru.ru_maxrss / 1024}


def run_exl2fmt(mdir: Path, cal: Path, out: Path, order: str, log: Path) -> dict:
    rows, length = (int(x) for x in __import__("numpy").load(cal).shape)
    exe = Path(sys.executable).with_name("exl2fmt")
    cmd = [str(exe), "convert", str(mdir), str(out), "--to", "gptq", "--bits", str(BITS), "--group-size", str(GROUP),
           "--order", order, "--calibration", str(cal), "--rows", str(rows), "--length", str(length),
           "--device", "cpu", "--force"]
    return timed(cmd, log=log)


def run_gptqmodel(python: str, mdir: Path, cal: Path, out: Path, order: str, log: Path) -> dict:
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = [python, str(Path(__file__).resolve()), "--worker", *(str(Path(x).resolve()) for x in (mdir, cal, out)),
           order]
    shutil.rmtree(out, ignore_errors=True)
    # in the work directory: GPTQModel writes a logs/ folder into its current directory
    return timed(cmd, env=env, log=log, cwd=Path(log).resolve().parent)


def gptqmodel_worker(mdir: str, cal: str, out: str, order: str) -> None:
    """(in the scratch venv) GPTQModel.load + quantize + save, on the CPU."""
    import numpy as np
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    os.chdir(Path(out).parent)          # GPTQModel writes a logs/ folder into the working directory
    ids = np.load(cal)
    qc = QuantizeConfig(bits=BITS, group_size=GROUP, sym=True, damp_percent=PERCDAMP,
                        desc_act=order == "act", act_group_aware=order == "group")
    model = GPTQModel.load(mdir, qc, device="cpu")
    data = [{"input_ids": torch.from_numpy(r).long()[None], "attention_mask": torch.ones((1, r.size), dtype=torch.long)}
            for r in ids]
    model.quantize(data, batch_size=1, calibration_sort=None)
    model.save(out)


# ------------------------------------------------------------------------------------------------ quality


def kl_vs_fp16(mdir: Path, outs: dict[str, Path], ev: Path, work: Path) -> dict[str, dict]:
    """Mean KL(FP16 || quantized) per token, float32 transformers forward, each output dequantized by
    ``exl2fmt convert --to fp16`` (one reader for both tools' files)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(np.load(ev))
    exe = Path(sys.executable).with_name("exl2fmt")

    def logp(path: Path) -> torch.Tensor:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.eval()
        with torch.inference_mode():
            out = torch.cat([m(ids[i:i + 4]).logits.log_softmax(-1) for i in range(0, ids.shape[0], 4)])
        del m
        return out

    ref = logp(mdir)
    res = {}
    for name, q in outs.items():
        deq = work / f"deq-{name}"
        subprocess.run([str(exe), "convert", str(q), str(deq), "--to", "fp16", "--force"], check=True,
                       stdout=subprocess.DEVNULL)
        lq = logp(deq)
        kl = (ref.exp() * (ref - lq)).sum(-1)
        res[name] = {"kl": float(kl.mean()), "top1": float((ref.argmax(-1) == lq.argmax(-1)).float().mean())}
        shutil.rmtree(deq)
    return res


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=tuple(SIZES), default="fixture")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers of the 1b model (default 22)")
    ap.add_argument("--tool", action="append", choices=TOOLS)
    ap.add_argument("--order", action="append", choices=ORDERS)
    ap.add_argument("--scratch", default="/work/scratch/h16", help="holds the GPTQModel venv V (see the docstring)")
    ap.add_argument("--work", default=None, help="models, ids, outputs (default: a folder in the temp dir)")
    ap.add_argument("--json", default=None, help="results file (default WORK/results.json)")
    ap.add_argument("--label", default="", help="tag of this run in the results (e.g. 'before')")
    ap.add_argument("--report", action="store_true", help="KL of every output in the results, then the table")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        gptqmodel_worker(*a.worker)
        return
    work = Path(a.work or Path(tempfile.gettempdir()) / "gptq_vs_gptqmodel")
    work.mkdir(parents=True, exist_ok=True)
    jpath = Path(a.json or work / "results.json")
    results = json.loads(jpath.read_text()) if jpath.exists() else {}
    tag = a.model if a.model == "fixture" else f"1b-{a.layers}L"
    mdir = model_dir(work, a.model, a.layers)
    cal, ev = token_ids(work, a.model, mdir)
    if a.report:
        outs = {k: Path(v["out"]) for k, v in results.items() if v["model"] == tag and Path(v["out"]).exists()}
        for k, v in kl_vs_fp16(mdir, outs, ev, work).items():
            results[k].update(v)
        jpath.write_text(json.dumps(results, indent=1))
        print(table(results, tag))
        return
    python = str(Path(a.scratch) / "V" / "bin" / "python")
    for tool in a.tool or TOOLS:
        for order in a.order or ORDERS:
            key = f"{tag} {tool} {order}{' ' + a.label if a.label else ''}"
            out = work / key.replace(" ", "-")
            log = work / (key.replace(" ", "-") + ".log")
            r = (run_exl2fmt(mdir, cal, out, order, log) if tool == "exl2fmt"
                 else run_gptqmodel(python, mdir, cal, out, order, log))
            r.update(model=tag, tool=tool, order=order, label=a.label, out=str(out),
                     load=os.getloadavg()[0], when=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
            results[key] = r
            jpath.write_text(json.dumps(results, indent=1))
            print(f"{key}: CPU {r['cpu_s']:.1f} s, wall {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB "
                  f"(load {r['load']:.2f})", flush=True)


def table(results: dict, tag: str) -> str:
    rows = ["| model | tool | order | label | CPU s (user+sys) | wall s | peak RSS MiB | KL vs FP16 | top-1 | load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in results.items():
        if r["model"] != tag:
            continue
        kl = f"{r['kl']:.4e}" if "kl" in r else "-"
        t1 = f"{r['top1']:.4f}" if "top1" in r else "-"
        rows.append(f"| {tag} | {r['tool']} | {r['order']} | {r['label']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                    f"{r['peak_rss_mib']:.0f} | {kl} | {t1} | {r['load']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
