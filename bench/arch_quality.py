"""Calibrated quantization per architecture (issue 14): EXL2 4.0 bpw and GPTQ 4-bit g128 through the
transformers-driven engine, against round-to-nearest 4-bit g128 of the same weights.

For every architecture of ``tests/tiny_models.py`` that the engine calibrates, a seeded random fp16 model (2 layers,
hidden 128, or ``--hidden H``: ``tiny_models.width_dims``) is quantized by the CLI (``exl2fmt convert SRC --to exl2
--bits 4.0`` and ``--to gptq --bits 4``) in a child process (its peak RSS from ``wait4``); the output must pass
``validate --deep``; it is dequantized back to fp16 by ``convert --to fp16``, loaded in transformers, and its KL
divergence to the FP16 model on held-out token ids is compared with that of RTN 4-bit g128 (no calibration, best
fp16 scale per column) applied to every decoder linear, symmetric (our default GPTQ's convention) and
asymmetric.  Decoder bpw is ``inspect``'s (``bpw.decoder``: 16-bit MoE routers left out, ``layout.STAYS_16BIT``).

Calibration is ``--rows`` x ``--length`` random ids; the default rows scale with the width (16 at hidden 128, 64
at 512) so that the calibration holds 4 tokens per input feature of the widest linear (the MLP's down
projection, K = 2 x hidden) at the default length of 64, as at 128; fewer tokens than K leave that Hessian
rank-deficient.  Beside the table, a second one says what EXL2's bits are made of (code bits per weight and the
overhead: q_invperm, 4-bit scale codes, q_scale_max + q_groups), the KL with the EXL2 output's head swapped for
the FP16 head (the EXL2 output always quantizes the head, ``--head-bits`` 6; RTN and GPTQ keep it FP16), and the
decoder's group plans.  ``--exl2-bits`` changes the EXL2 target (default 4.0) for side measurements.

    flock /work/heavy.lock nice -n 5 python bench/arch_quality.py [--arch llama gemma2 ...] [--hidden 512]
        [--json-out F] [--record]
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

from tiny_models import DENSE, MOE, make_tiny, width_dims  # noqa: E402

VOCAB = 512
HELD_ROWS = 8
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
    the best fp16 scale per column from a grid search (``codec.gptq_fit.fit_group``), symmetric (the
    convention of our default GPTQ output) or asymmetric (a zero point per group and column).  Routers and
    other modules that stay 16-bit by convention are left alone (``layout.stays_16bit``)."""
    from exl2fmt.codec.gptq_fit import reconstruct, rtn_quantize
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


def exl2_bits_parts(q: Path) -> dict:
    """What the EXL2 decoder linears' stored bits are made of, per weight (K x N_pad, as ``bpw.decoder`` counts):
    ``codes`` (q_weight), and the overhead ``invperm`` (q_invperm), ``scales`` (q_scale, 4-bit codes per group and
    column), ``groups`` (q_scale_max + q_groups) and ``bias``.  From the safetensors headers; 16-bit routers and
    the head are left out, as in ``bpw.decoder``."""
    from exl2fmt.container import open_model
    from exl2fmt.layout import stays_16bit

    m = open_model(q)
    try:
        parts = dict(codes=0, invperm=0, scales=0, groups=0, bias=0)
        numel = 0
        slot_part = {"q_weight": "codes", "q_invperm": "invperm", "q_scale": "scales", "q_scale_max": "groups",
                     "q_groups": "groups", "bias": "bias"}
        keys = {n.rsplit(".", 1)[0] for n in m.tensors if n.endswith(".q_weight") and n.startswith("model.layers.")}
        for key in keys:
            if stays_16bit(key):
                continue
            for slot, part in slot_part.items():
                t = m.tensors.get(f"{key}.{slot}")
                if t is not None:
                    parts[part] += t.nbytes * 8
            K = m.tensors[f"{key}.q_invperm"].numel
            numel += K * m.tensors[f"{key}.q_weight"].shape[1]
    finally:
        m.close()
    out = {k: v / numel for k, v in parts.items()}
    out["overhead"] = sum(v for k, v in out.items() if k != "codes")
    return out


def one(arch: str, work: Path, rows: int, length: int, targets=("exl2", "gptq"), hidden: int = 128,
        exl2_bits: str = "4.0") -> dict:
    src = make_tiny(arch, work / arch / "src", **width_dims(arch, hidden, VOCAB))
    rng = np.random.default_rng(0)
    cal = work / arch / "cal.npy"
    np.save(cal, rng.integers(0, VOCAB, (rows, length)))
    held = torch.as_tensor(np.random.default_rng(1).integers(0, VOCAB, (HELD_ROWS, length)))
    ref = load_dense(src)
    with torch.no_grad():
        ref_logits = ref(held).logits
    row = {"arch": arch, "hidden": hidden, "exl2_target": float(exl2_bits)}
    for tgt, bits in [t for t in (("exl2", exl2_bits), ("gptq", "4")) if t[0] in targets]:
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
        qm = load_dense(fp)
        extra = {}
        with torch.no_grad():
            k = kl(ref_logits, qm(held).logits)
            if tgt == "exl2":
                # the same output with the FP16 model's head (the tied embedding where the source ties them): what
                # the decoder's quantization alone costs, the part RTN and GPTQ are compared on
                qm.get_output_embeddings().weight.copy_(ref.get_output_embeddings().weight)
                extra = {"kl_fp16_head": kl(ref_logits, qm(held).logits), "bits_parts": exl2_bits_parts(q),
                         "plans": {n: v.get("plan") for n, v in (man.get("layers") or {}).items()}}
        del qm
        row[tgt] = {**extra, "bpw": bpw, "bpw_incl_16bit": bpw_incl, "validate": "PASS" if val.returncode == 0 else f"FAIL {vdoc.get('counts')}",
                    "kl": k, "seconds": secs, "peak_rss_mb": rss / 2**20, "calibrated": not weight_only,
                    "calibration_ppl": cal_ppl, "expert_tokens": [b.get("expert_tokens") for b in man.get("blocks") or []
                                                                  if b.get("expert_tokens")]}
    with torch.no_grad():
        row["rtn_kl_asym"] = kl(ref_logits, rtn_model(src, sym=False)(held).logits)
        row["rtn_kl_sym"] = kl(ref_logits, rtn_model(src, sym=True)(held).logits)
    row["rows"], row["length"], row["held_out"] = rows, length, [HELD_ROWS, length]
    return row


HEADER = ["| arch | EXL2 4.0: decoder bpw | validate --deep | KL | s | peak RSS MB | GPTQ 4 g128 sym: KL | validate --deep | "
          "s | peak RSS MB | RTN 4 g128 sym KL | RTN 4 g128 asym KL |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def table_row(r: dict) -> str:
    cells = [r["arch"]]
    for tgt in ("exl2", "gptq"):
        x = r.get(tgt)
        if x is None:                              # left out by --targets
            cells += ["not run"] + [""] * (4 if tgt == "exl2" else 3)
            continue
        if "error" in x:
            cells += ["ERROR " + x["error"].strip().splitlines()[-1][:60]] + [""] * (4 if tgt == "exl2" else 3)
            continue
        flag = "" if x["calibrated"] else " (weight-only)"
        if tgt == "exl2":
            b = f"{x['bpw']:.4f}" + (f" ({x['bpw_incl_16bit']:.4f} with routers)" if x.get("bpw_incl_16bit") else "")
            if r.get("exl2_target", 4.0) != 4.0:
                b += f" (target {r['exl2_target']:g}, not 4.0)"
            cells += [b + flag, x["validate"], f"{x['kl']:.5f}", f"{x['seconds']:.0f}", f"{x['peak_rss_mb']:.0f}"]
        else:
            cells += [f"{x['kl']:.5f}{flag}", x["validate"], f"{x['seconds']:.0f}", f"{x['peak_rss_mb']:.0f}"]
    cells += [f"{r['rtn_kl_sym']:.5f}", f"{r['rtn_kl_asym']:.5f}"]
    return "| " + " | ".join(cells) + " |"


DIAG_HEADER = ["| arch | EXL2 decoder bpw | code bits/w | overhead | q_invperm | scale codes | "
               "q_scale_max + q_groups | EXL2 KL | EXL2 KL, FP16 head | RTN sym KL | RTN asym KL |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]


def diag_row(r: dict) -> str | None:
    x = r.get("exl2")
    if not x or "error" in x or "bits_parts" not in x:
        return None
    p = x["bits_parts"]
    return (f"| {r['arch']} | {x['bpw']:.4f} | {p['codes']:.4f} | {p['overhead']:.4f} | {p['invperm']:.4f} | "
            f"{p['scales']:.4f} | {p['groups']:.4f} | {x['kl']:.5f} | {x['kl_fp16_head']:.5f} | "
            f"{r['rtn_kl_sym']:.5f} | {r['rtn_kl_asym']:.5f} |")


def tables(rows: list[dict]) -> str:
    diag = [d for d in map(diag_row, rows) if d]
    return "\n".join(HEADER + [table_row(r) for r in rows] + ([""] + DIAG_HEADER + diag if diag else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="*", default=list(DENSE + MOE))
    ap.add_argument("--hidden", type=int, default=128, help="model width, a multiple of 128 (tiny_models.width_dims)")
    ap.add_argument("--rows", type=int, default=None, help="calibration rows (default 16 x hidden / 128)")
    ap.add_argument("--exl2-bits", default="4.0", help="EXL2 target bpw (default 4.0, the issue's)")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--targets", nargs="*", default=["exl2", "gptq"], choices=["exl2", "gptq"])
    ap.add_argument("--json-out", help="append one JSON line per architecture to this file")
    ap.add_argument("--table", help="print the markdown table of the JSON lines in this file and exit")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    if a.table:
        rows = [json.loads(line) for line in Path(a.table).read_text().splitlines() if line.strip()]
        print(tables(rows))
        return
    try:
        width_dims("llama", a.hidden)
    except ValueError as e:
        ap.error(str(e))
    rows_n = a.rows if a.rows is not None else 16 * a.hidden // 128
    done = []
    with tempfile.TemporaryDirectory(prefix="arch-quality-") as t:
        for arch in a.arch:
            r = one(arch, Path(t), rows_n, a.length, tuple(a.targets), a.hidden, a.exl2_bits)
            if a.json_out:
                with open(a.json_out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(r) + "\n")
            done.append(r)
            print(table_row(r), flush=True)
    text = tables(done)
    print(text)
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n{text}\n")


if __name__ == "__main__":
    main()
