"""Calibrated quantization per architecture (issue 14): EXL2 4.0 bpw and GPTQ 4-bit g128 through the
transformers-driven engine, against round-to-nearest 4-bit g128 of the same weights.

For every architecture of ``tests/tiny_models.py`` that the engine calibrates, a seeded random fp16 model (2 layers,
hidden 128) is quantized by the CLI (``exl2fmt convert SRC --to exl2 --bits 4.0`` and ``--to gptq --bits 4``) in
a child process (its peak RSS from ``wait4``); the output must pass ``validate --deep``; it is dequantized back to
fp16 by ``convert --to fp16``, loaded in transformers, and its KL divergence to the FP16 model on held-out token
ids is compared with that of RTN 4-bit g128 (no calibration, best fp16 scale per column) applied to every
decoder linear, symmetric (our default GPTQ's convention) and asymmetric.  Decoder bpw is ``inspect``'s
(``bpw.decoder``: 16-bit MoE routers left out, ``layout.STAYS_16BIT``).

    flock /work/heavy.lock nice -n 5 python bench/arch_quality.py [--arch llama gemma2 ...] [--json-out F] [--record]
    python bench/arch_quality.py --table F         # the markdown table of the JSON lines in F
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import DENSE, MOE, make_tiny  # noqa: E402

DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512)
#: MoE: 4 experts of width 128 (Qwen3-MoE: moe_intermediate_size), top-2 routing
MOE_DIMS = {"mixtral": dict(DIMS, intermediate_size=128),
            "qwen3_moe": dict(DIMS, moe_intermediate_size=128)}
CLI = [sys.executable, "-m", "exl2fmt.cli.app"]


def run_child(args) -> tuple[int, float, int, str]:
    """Like ``cli`` but with the child's own peak RSS (ru_maxrss of a fork that execs the CLI)."""
    t = time.monotonic()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: exec the CLI with stdout/stderr into the pipe
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.execv(sys.executable, [*CLI, *map(str, args)])
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status, ru = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - t, ru.ru_maxrss * 1024, \
        b"".join(chunks).decode(errors="replace")[-2000:]


def load_dense(d: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def kl(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    """Mean over tokens of KL(P_ref || P_test), float64."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(test_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def rtn_model(d: Path, bits: int = 4, group_size: int = 128, sym: bool = False):
    """The FP16 model at ``d`` with every decoder linear (and every expert of the fused 3-D MoE parameters)
    replaced by its round-to-nearest reconstruction: ``bits``-bit codes in groups of ``group_size`` input rows,
    the best fp16 scale per column from a grid search (``converters.gptq_quant.fit_group``), symmetric (the
    convention of our default GPTQ output) or asymmetric (a zero point per group and column).  Routers and
    other modules that stay 16-bit by convention are left alone (``layout.stays_16bit``)."""
    from exl2fmt.converters.gptq_quant import reconstruct, rtn_quantize
    from exl2fmt.layout import stays_16bit

    def rtn(w: np.ndarray) -> np.ndarray:          # w float32 [N, K] -> its RTN reconstruction
        codes, scales, zeros, g_idx = rtn_quantize(w, bits, min(group_size, w.shape[1]), sym=sym)
        wq = np.empty_like(w.T)
        for g in range(scales.shape[0]):
            rows = np.nonzero(g_idx == g)[0]
            wq[rows] = reconstruct(codes[rows], scales[g], zeros[g])
        return np.ascontiguousarray(wq.T)

    m = load_dense(d)
    with torch.no_grad():
        for name, mod in m.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear) and not stays_16bit(name):
                mod.weight.copy_(torch.from_numpy(rtn(mod.weight.numpy())))
            for pname, p in mod.named_parameters(recurse=False):
                if p.dim() == 3:            # fused MoE experts [E, N, K]: each expert's projection on its own
                    # (gate_up_proj's gate and up rows are independent rows of the same groups along K)
                    p.copy_(torch.stack([torch.from_numpy(rtn(p[e].numpy())) for e in range(p.shape[0])]))
    return m


def one(arch: str, work: Path, rows: int, length: int, targets=("exl2", "gptq")) -> dict:
    src = make_tiny(arch, work / arch / "src", **MOE_DIMS.get(arch, DIMS))
    rng = np.random.default_rng(0)
    cal = work / arch / "cal.npy"
    np.save(cal, rng.integers(0, DIMS["vocab_size"], (rows, length)))
    held = torch.as_tensor(np.random.default_rng(1).integers(0, DIMS["vocab_size"], (8, length)))
    ref = load_dense(src)
    with torch.no_grad():
        ref_logits = ref(held).logits
    row = {"arch": arch}
    for tgt, bits in [t for t in (("exl2", "4.0"), ("gptq", "4")) if t[0] in targets]:
        q = work / arch / tgt
        rc, secs, rss, tail = run_child(["convert", src, q, "--to", tgt, "--bits", bits, "--calibration", cal,
                                         "--rows", rows, "--length", length, "--json"])
        if rc != 0:
            row[tgt] = {"error": tail}
            continue
        man = json.loads((q / "exl2fmt-manifest.json").read_text())
        weight_only = bool(man.get("weight_only"))
        cal_ppl = man.get("calibration_perplexity")
        val = subprocess.run([*CLI, "validate", str(q), "--deep", "--json"], capture_output=True, text=True)
        vdoc = json.loads(val.stdout) if val.stdout.strip().startswith("{") else {}
        from exl2fmt.inspect import inspect_model

        ins = inspect_model(q, layers=False)["summary"]["bpw"]
        bpw, bpw_incl = ins["decoder"], ins.get("decoder_incl_16bit")   # routers left out (layout.STAYS_16BIT)
        fp = work / arch / f"{tgt}-fp16"
        rc2, _, _, tail2 = run_child(["convert", q, fp, "--to", "fp16"])
        if rc2 != 0:
            row[tgt] = {"error": tail2}
            continue
        with torch.no_grad():
            k = kl(ref_logits, load_dense(fp)(held).logits)
        row[tgt] = {"bpw": bpw, "bpw_incl_16bit": bpw_incl, "validate": "PASS" if val.returncode == 0 else f"FAIL {vdoc.get('counts')}",
                    "kl": k, "seconds": secs, "peak_rss_mb": rss / 2**20, "calibrated": not weight_only,
                    "calibration_ppl": cal_ppl, "expert_tokens": [b.get("expert_tokens") for b in man.get("blocks") or []
                                                                  if b.get("expert_tokens")]}
    with torch.no_grad():
        row["rtn_kl_asym"] = kl(ref_logits, rtn_model(src, sym=False)(held).logits)
        row["rtn_kl_sym"] = kl(ref_logits, rtn_model(src, sym=True)(held).logits)
    row["rows"], row["length"] = rows, length
    return row


HEADER = ["| arch | EXL2 4.0: decoder bpw | validate --deep | KL | s | peak RSS MB | GPTQ 4 g128 sym: KL | validate --deep | "
          "s | peak RSS MB | RTN 4 g128 sym KL | RTN 4 g128 asym KL |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def table_row(r: dict) -> str:
    cells = [r["arch"]]
    for tgt in ("exl2", "gptq"):
        x = r.get(tgt, {"error": "not run"})
        if "error" in x:
            cells += ["ERROR " + x["error"].strip().splitlines()[-1][:60]] + [""] * (4 if tgt == "exl2" else 3)
            continue
        flag = "" if x["calibrated"] else " (weight-only)"
        if tgt == "exl2":
            b = f"{x['bpw']:.4f}" + (f" ({x['bpw_incl_16bit']:.4f} with routers)" if x.get("bpw_incl_16bit") else "")
            cells += [b + flag, x["validate"], f"{x['kl']:.5f}", f"{x['seconds']:.0f}", f"{x['peak_rss_mb']:.0f}"]
        else:
            cells += [f"{x['kl']:.5f}{flag}", x["validate"], f"{x['seconds']:.0f}", f"{x['peak_rss_mb']:.0f}"]
    cells += [f"{r['rtn_kl_sym']:.5f}", f"{r['rtn_kl_asym']:.5f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="*", default=list(DENSE + MOE))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--targets", nargs="*", default=["exl2", "gptq"], choices=["exl2", "gptq"])
    ap.add_argument("--json-out", help="append one JSON line per architecture to this file")
    ap.add_argument("--table", help="print the markdown table of the JSON lines in this file and exit")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    if a.table:
        rows = [json.loads(line) for line in Path(a.table).read_text().splitlines() if line.strip()]
        print("\n".join(HEADER + [table_row(r) for r in rows]))
        return
    lines = list(HEADER)
    with tempfile.TemporaryDirectory(prefix="arch-quality-") as t:
        for arch in a.arch:
            r = one(arch, Path(t), a.rows, a.length, tuple(a.targets))
            if a.json_out:
                with open(a.json_out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(r) + "\n")
            lines.append(table_row(r))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n{text}\n")


if __name__ == "__main__":
    main()
