"""The peers' own code on exl2fmt's outputs (issue 16): ExLlamaV2's optimizer on our ``measurement.json``,
GPTQModel's loader and kernels and transformers' GPTQ integration on our GPTQ models.  Not run in CI.

Setup (once, in a scratch directory S outside the repository; nothing of it is committed):

    S=/work/scratch/h16
    pip download --no-deps exllamav2==0.3.2 -d $S            # the wheel; this script unzips what it needs
    python3 -m venv $S/V         # a venv that sees the project venv's packages (torch 2.13 CPU, transformers):
    echo $PWD/.venv/lib/python3.11/site-packages > $S/V/lib/python3.11/site-packages/_base.pth
    $S/V/bin/pip install --no-deps gptqmodel==7.7.0 pypcre logbar tokenicer device-smi defuser pillow optimum==2.3.0
    flock /work/heavy.lock nice -n 5 .venv/bin/python bench/peers.py --scratch $S [--model M] [--record]

``--model`` picks the source: the trained fixture (default), or ``mixtral`` / ``qwen3_moe``, a tiny seeded random
MoE model (tests/tiny_models.py, hidden 128, 4 experts of width 128, top-2, calibrated and evaluated on random ids):
ExLlamaV2's optimizer then reads the MoE measurement (its ``block_sparse_moe`` blocks, with the experts' numel),
and the peers load MoE GPTQ checkpoints (one tensor set per expert).

(GPTQModel 7.7 declares torch >= 2.14; installed --no-deps it runs on torch 2.13's CPU build; the six extra
packages are the ones it imports at start-up.)

What runs:

1. **ExLlamaV2's optimizer** (``exllamav2/conversion/optimize.py`` of the 0.3.2 wheel, imported from S).  Its
   ``sim_anneal`` is host C++ in ``exllamav2_ext/ext_quant.cpp``; only that function is compiled (with
   ``torch.utils.cpp_extension``, on the CPU, into S) and handed to ``optimize`` as ``exllamav2.ext``; the
   rest of the wheel is not imported.  ``optimize(job, save_fn, model)`` gets the measurement and a stand-in
   model carrying what it reads: the Llama key map (ExLlamaV2's own ``ExLlamaV2ArchParams``), the module list
   (embedding, attention and MLP per layer, norm, head) and the linear shapes of the fixture.  The fixture
   ``tests/fixtures/tiny-llama`` is measured once by exl2fmt, and the optimizer runs on three files: exl2fmt's
   ``measurement.json`` as written now (ascending cost, dominated rows dropped), the same measurement cut to
   upstream's 19/17 rows in upstream's table order (what ExLlamaV2 writes), and the old layout (upstream's
   rows, then exl2fmt's extra rows appended).  Plans are scored by what ExLlamaV2 prints: max(err) and
   sum(log err) over the blocks, plus sum(err^2); each (file, bpw) runs ``--repeats`` times (the annealing is
   seeded from ``std::random_device``) and the best run counts.
2. **GPTQModel 7.x** (in ``$S/V``, ``BACKEND.TORCH``, fp16, ``GPTQMODEL_CPU_WORKERS=2``) loads exl2fmt's GPTQ
   outputs of the fixture (4-bit g128; sym and asym; act-order and group-aware) and computes logits on
   held-out text; they must match exl2fmt's forward over its own dequantized weights within fp16 rounding,
   i.e. within twice the gap between the FP16 model run in fp16 by transformers and the same model in fp32.
3. **transformers' GPTQ integration** (``AutoModelForCausalLM.from_pretrained`` on the same directories, in
   ``$S/V`` so it finds GPTQModel): loaded or not, and the same logit check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
TARGETS = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
#: --model choices besides the fixture: tiny seeded random MoE models (tests/tiny_models.py, hidden 128, 4 experts)
TINY = ("mixtral", "qwen3_moe")
EXLLAMAV2_WHEEL = "exllamav2-0.3.2-py3-none-any.whl"


# ------------------------------------------------------------------------------------------------ ExLlamaV2


def _unzip_exllamav2(scratch: Path) -> Path:
    """The wheel's ``exllamav2`` package unzipped into ``scratch/exl2`` (once); returns that directory."""
    dest = scratch / "exl2"
    if not (dest / "exllamav2" / "conversion" / "optimize.py").exists():
        wheel = scratch / EXLLAMAV2_WHEEL
        if not wheel.exists():
            sys.exit(f"{wheel} is missing: pip download --no-deps exllamav2==0.3.2 -d {scratch}")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest)
    return dest


def build_sim_anneal(scratch: Path):
    """Compile ExLlamaV2's ``sim_anneal`` (host C++, cut out of ext_quant.cpp) into ``scratch/sim_anneal``."""
    from torch.utils import cpp_extension

    src = (_unzip_exllamav2(scratch) / "exllamav2" / "exllamav2_ext" / "ext_quant.cpp").read_text()
    m = re.search(r"^std::tuple<[^\n]*>\s*sim_anneal\s*\(.*?^\}", src, re.S | re.M)
    if m is None:
        sys.exit("sim_anneal not found in ext_quant.cpp")
    build = scratch / "sim_anneal"
    build.mkdir(exist_ok=True)
    cpp = build / "sim_anneal.cpp"
    text = ("#include <torch/extension.h>\n#include <cmath>\n#include <cstdint>\n#include <random>\n"
            "#include <tuple>\n#include <vector>\n#include <algorithm>\n\n" + m.group(0) +
            "\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"sim_anneal\", &sim_anneal); }\n")
    if not cpp.exists() or cpp.read_text() != text:
        cpp.write_text(text)
    return cpp_extension.load("exl2_sim_anneal", [str(cpp)], build_directory=str(build), extra_cflags=["-O2"],
                              verbose=False)


def import_optimize(scratch: Path, ext):
    """``exllamav2.conversion.optimize.optimize`` from the unzipped wheel, with ``exllamav2.ext`` standing for
    the compiled ``sim_anneal`` (the package's ``__init__`` and its CUDA extension are never imported)."""
    pkg_dir = _unzip_exllamav2(scratch) / "exllamav2"
    for name in [n for n in sys.modules if n == "exllamav2" or n.startswith("exllamav2.")]:
        del sys.modules[name]
    pkg = types.ModuleType("exllamav2")
    pkg.__path__ = [str(pkg_dir)]
    sys.modules["exllamav2"] = pkg
    stub = types.ModuleType("exllamav2.ext")
    stub.exllamav2_ext = ext
    stub.none_tensor = torch.empty((1, 1), device="meta")
    sys.modules["exllamav2.ext"] = stub
    from exllamav2.architecture import ExLlamaV2ArchParams
    from exllamav2.conversion.optimize import optimize

    return optimize, ExLlamaV2ArchParams


class _Linear:
    def __init__(self, key, k, n):
        self.key, self.k, self.n = key, k, n

    def matrix_shape(self):
        return self.k, self.n          # ExLlamaV2: (in_features, out_features)

    def numel(self):
        return self.k * self.n


class _Module:
    def __init__(self, key, linears=()):
        self.key, self.linears = key, list(linears)

    def numel(self):
        return sum(lin.numel() for lin in self.linears)


def source(model: str, work: Path, rows: int, length: int, eval_rows: int, eval_len: int):
    """(model directory, calibration file or None for the built-in set, held-out ids int64 [eval_rows, eval_len]).

    ``fixture``: the trained fixture, held-out text from the shipped corpus.  A name of ``TINY``: a tiny seeded
    random model made with transformers' config class (hidden 128, 4 experts of width 128, top-2), calibrated and
    evaluated on seeded random ids."""
    if model == "fixture":
        from exl2fmt.quant.evaluate import eval_ids

        return FIXTURE, None, eval_ids(FIXTURE / "tokenizer.json", eval_rows, eval_len)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny, width_dims

    vocab = 512
    src = make_tiny(model, work / model / "src", **width_dims(model, 128, vocab))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        # GPTQModel's loader wants a tokenizer; the fixture's (ids below 512 are valid for both) is carried along
        shutil.copy(FIXTURE / f, src / f)
    cal = work / model / "cal.npy"
    np.save(cal, np.random.default_rng(0).integers(0, vocab, (rows, length)))
    held = torch.as_tensor(np.random.default_rng(1).integers(0, vocab, (eval_rows, eval_len)))
    return src, str(cal), held


def standin_model(config: dict, ArchParams):
    """What ``optimize`` reads of an ExLlamaV2 model: config (arch key map, layer count, expert count) and module
    list.  A MoE block is one module holding every expert's three linears (the router is not counted, as in
    ExLlamaV2's ``ExLlamaV2MoEMLP.numel``); ``modules_dict`` holds expert 0's keys, which ``optimize`` reads."""
    arch = ArchParams(config["architectures"][0], config)
    km = arch.lm.keys
    moe = bool(getattr(arch.lm, "is_moe", False))
    experts = (config.get("num_local_experts") or config.get("num_experts")) if moe else None
    inter = config.get("moe_intermediate_size") or config["intermediate_size"] if moe else config["intermediate_size"]
    h, L = config["hidden_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"attn_q": (h, q), "attn_k": (h, kv), "attn_v": (h, kv), "attn_o": (q, h), "mlp_gate": (h, inter),
              "mlp_up": (h, inter), "mlp_down": (inter, h)}
    modules, mdict = [_Module("model.embed_tokens")], {}
    for i in range(L):
        key = f"model.layers.{i}"
        for part in (("attn_q", "attn_k", "attn_v", "attn_o"), ("mlp_gate", "mlp_up", "mlp_down")):
            keys = [(p, key + km[p]) for p in part]
            if moe and part[0] == "mlp_gate":
                keys = [(p, k.replace("*", str(e))) for e in range(experts) for p, k in keys]
            lins = [_Linear(k, *shapes[p]) for p, k in keys]
            for lin in lins:
                mdict[lin.key] = lin
            modules.append(_Module(key, lins))
    modules += [_Module("model.norm"), _Module("lm_head")]
    cfg = types.SimpleNamespace(arch=arch, num_experts=experts, num_hidden_layers=L)
    return types.SimpleNamespace(config=cfg, modules=modules, modules_dict=mdict), sum(
        m.numel() for m in modules[1:1 + 2 * L])


def run_optimizer(optimize, model, measurement: dict, bits: float) -> dict:
    """One ExLlamaV2 optimization; returns its plan's scores."""
    import contextlib
    import io

    job = {"bits": bits, "measurement": measurement, "status_output": False}
    with contextlib.redirect_stdout(io.StringIO()):
        optimize(job, lambda: None, model)
    errs = [1.0 - p["accuracy"] for p in job["strategy"].values()]
    total = sum(int(p["total_bits"]) for p in job["strategy"].values())
    return {"max_err": max(errs), "sum_log_err": sum(math.log(e) for e in errs),
            "sum_err2": sum(e * e for e in errs), "total_bits": total}


def measure_model(src: Path, calibration: str | None, work: Path, rows: int, length: int):
    """exl2fmt's measurement of ``src``: (the file as written, the rows before writing {key: [(option,
    bits, accuracy)]} in exl2fmt's table order, upstream's rows first)."""
    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant import measure as M
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    seen = {}
    orig = M.write_measurement          # qparams.write_measurement, as the measurement module calls it

    def spy(path, measured, last):
        seen.update({k: list(v) for k, v in measured.items()})
        return orig(path, measured, last)

    M.write_measurement = spy
    try:
        quantize_model(src, work / "exl2-4.0", QuantOptions(target="exl2", bits=4.0, rows=rows, length=length,
                                                            device="cpu", calibration=calibration),
                       verify_output=validate_quantized_output)
    finally:
        M.write_measurement = orig
    return json.loads((work / "exl2-4.0" / "measurement.json").read_text()), seen


def _doc(rows_by_key: dict, last: int) -> dict:
    out = {}
    for key, rows in rows_by_key.items():
        out[key] = []
        for opt, bits, acc in rows:
            d = {"accuracy": float(acc), "total_bits": int(bits)}
            d.update({n: qp.to_json() for n, qp in opt.layers})
            out[key].append(d)
    return {"measurement": out, "last_module_idx": last}


def optimizer_check(scratch: Path, work: Path, src: Path, calibration: str | None, repeats: int, rows: int,
                    length: int, log) -> dict:
    from exl2fmt.quant import qparams as QP

    ext = build_sim_anneal(scratch)
    optimize, ArchParams = import_optimize(scratch, ext)
    config = json.loads((src / "config.json").read_text())
    model, numel = standin_model(config, ArchParams)
    ours, raw = measure_model(src, calibration, work, rows, length)
    last = ours["last_module_idx"]
    def settings(opt):
        # an option's settings in order, whatever the linears are called (a MoE block's w1/w3/w2 are gate/up/down)
        return tuple(qp for _, qp in opt.layers)

    up_attn = {settings(o) for o in QP.ATTN_OPTIONS}
    up_mlp = {settings(o) for o in QP.MLP_OPTIONS}
    upstream = {k: [r for r in v if settings(r[0]) in (up_attn if k.endswith("self_attn") else up_mlp)]
                for k, v in raw.items()}
    empty = [k for k, v in upstream.items() if not v]
    if empty:      # sim_anneal reads past an empty slot: never hand it one
        sys.exit(f"no upstream row recognised in {empty[:3]}")
    files = {"exl2fmt now": ours, "upstream rows": _doc(upstream, last), "old layout": _doc(raw, last)}
    res = {"numel": numel, "rows_per_block": {n: sorted({len(v) for v in d["measurement"].values()})
                                              for n, d in files.items()}, "targets": {}}
    for bits in TARGETS:
        res["targets"][bits] = {}
        for name, doc in files.items():
            t = time.monotonic()
            runs = [run_optimizer(optimize, model, doc["measurement"], bits) for _ in range(repeats)]
            best = min(runs, key=lambda r: (r["max_err"], r["sum_err2"]))
            best["bpw"] = best["total_bits"] / numel
            best["runs_max_err"] = [r["max_err"] for r in runs]
            res["targets"][bits][name] = best
            log(f"ExLlamaV2 optimizer {bits} bpw, {name}: max err {best['max_err']:.5f}, "
                f"{best['bpw']:.4f} bpw ({time.monotonic() - t:.0f} s)")
    return res


# ------------------------------------------------------------------------------------------------ GPTQ peers

_PEER_SCRIPT = r'''
import json, sys, traceback, os
import numpy as np, torch
out = {}
ids = torch.from_numpy(np.load(sys.argv[2]))
renames = json.loads(sys.argv[4])          # [checkpoint name part, peer module name part] pairs of renamed copies


def weights(net, path, source):
    # every quantized linear the peer built, dequantized by the peer's own kernel code, against exl2fmt's
    # reference decoder on the checkpoint it was written as (``source``: the copy's original)
    from exl2fmt.model import dequantize_layer
    worst, n, n_exp = 0.0, 0, 0
    for name, mod in net.named_modules():
        if not hasattr(mod, "dequantize_weight"):
            continue
        w = mod.dequantize_weight().float().numpy()
        if w.shape == (mod.in_features, mod.out_features):
            w = w.T
        key = name
        if path != source:
            for ck, pk in renames:
                key = key.replace(pk, ck)
        ref = dequantize_layer(source, key).astype(np.float32)
        worst = max(worst, float(np.abs(ref - w).max()))
        n += 1
        n_exp += ".experts." in name
    return {"weights_max_abs_diff": worst, "quant_linears": n, "quant_experts": n_exp}


for name, (path, source) in json.loads(sys.argv[1]).items():
    for peer in ("gptqmodel", "transformers"):
        key = f"{name}|{peer}"
        try:
            if peer == "gptqmodel":
                from gptqmodel import BACKEND, GPTQModel
                m = GPTQModel.load(path, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
                kernel = sorted({type(x).__name__ for x in m.model.modules() if "QuantLinear" in type(x).__name__
                                 or "Linear" in type(x).__name__ and hasattr(x, "qweight")})
                net = m.model
            else:
                from transformers import AutoModelForCausalLM
                net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, device_map="cpu")
                kernel = sorted({type(x).__name__ for x in net.modules() if hasattr(x, "qweight")})
            w = weights(net, path, source)
            with torch.no_grad():
                logits = net(input_ids=ids).logits.float().numpy()
            np.save(os.path.join(sys.argv[3], key.replace("|", "__") + ".npy"), logits)
            out[key] = {"loaded": True, "kernel": kernel, **w}
        except BaseException as e:
            out[key] = {"loaded": False, "error": f"{type(e).__name__}: {e}"[:600],
                        "trace": traceback.format_exc()[-1500:]}
print("PEER_RESULT " + json.dumps(out))
'''


#: Mixtral's checkpoint names (what transformers 5 itself saves, ExLlamaV2 and vLLM read, and exl2fmt writes) ->
#: the module names transformers 5 / GPTQModel 7.7's defused experts have in memory
MIXTRAL_RENAMES = [(".block_sparse_moe.", ".mlp."), (".w1", ".gate_proj"), (".w3", ".up_proj"), (".w2", ".down_proj")]


def _renamed_copy(d: Path, renames) -> Path:
    """A copy of checkpoint ``d`` with its tensors renamed by ``renames`` (bytes unchanged)."""
    from safetensors.numpy import load_file, save_file

    out = d.with_name(d.name + "-renamed")
    shutil.copytree(d, out)
    for f in out.glob("*.safetensors"):
        t = load_file(str(f))
        new = {}
        for k, v in t.items():
            for a, b in renames:
                k = k.replace(a, b)
            new[k] = v
        save_file(new, str(f), metadata={"format": "pt"})
    return out


def gptq_check(scratch: Path, work: Path, src: Path, calibration: str | None, ids: torch.Tensor, rows: int,
               length: int, log) -> dict:
    from exl2fmt.quant.evaluate import dequantized_source
    from exl2fmt.runner.model import HFModel
    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    np.save(work / "ids.npy", ids.numpy())
    variants = {f"{'sym' if sym else 'asym'} {order}": dict(sym=sym, order=order)
                for sym in (True, False) for order in ("act", "group", "static")}
    paths, ours = {}, {}
    config = json.loads((src / "config.json").read_text())
    renames = MIXTRAL_RENAMES if config.get("model_type") == "mixtral" else []
    for name, kw in variants.items():
        p = work / f"gptq-{name.replace(' ', '-')}"
        quantize_model(src, p, QuantOptions(target="gptq", bits=4, group_size=128, rows=rows, length=length,
                                            device="cpu", calibration=calibration, **kw),
                       verify_output=validate_quantized_output)
        paths[name] = (str(p), str(p))
        if renames:
            # the same checkpoint under transformers 5's in-memory MoE names (what GPTQModel 7.7 looks for)
            paths[name + " (renamed)"] = (str(_renamed_copy(p, renames)), str(p))
        with torch.no_grad():
            ours[name] = HFModel(config, dequantized_source(p)).forward(ids).float().numpy()
        if renames:
            ours[name + " (renamed)"] = ours[name]
    # fp16 rounding: the dense model in fp16 vs fp32 (transformers, the same ids)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        l16 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)(input_ids=ids).logits.float().numpy()
        l32 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(input_ids=ids).logits.numpy()
    noise = float(np.abs(l16 - l32).max())
    py = scratch / "V" / "bin" / "python"
    outdir = work / "peer-logits"
    outdir.mkdir()
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    t = time.monotonic()
    cp = subprocess.run([str(py), "-c", _PEER_SCRIPT, json.dumps(paths), str(work / "ids.npy"), str(outdir),
                         json.dumps(renames)],
                        capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in cp.stdout.splitlines() if x.startswith("PEER_RESULT ")), None)
    if line is None:
        raise SystemExit(f"peer script failed (rc {cp.returncode}):\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}")
    peer = json.loads(line[len("PEER_RESULT "):])
    log(f"peer subprocess {time.monotonic() - t:.0f} s")
    res = {"fp16_noise": noise, "results": {}, "warnings": [w for w in cp.stderr.splitlines()
                                                           if "warn" in w.lower()][:20]}
    for key, r in peer.items():
        name, which = key.split("|")
        if r["loaded"]:
            theirs = np.load(outdir / (key.replace("|", "__") + ".npy"))
            diff = float(np.abs(theirs - ours[name]).max())
            r.update(max_abs_diff=diff, within=diff <= 2 * noise,
                     top1_agree=float((theirs.argmax(-1) == ours[name].argmax(-1)).mean()))
        res["results"][key] = r
        log(f"{key}: " + (f"max |logit diff| {r['max_abs_diff']:.4f} (fp16 noise {noise:.4f}), "
                          f"kernel {r['kernel']}" if r["loaded"] else r["error"][:300]))
    return res


# ------------------------------------------------------------------------------------------------ report


def report(opt: dict | None, gq: dict | None, args) -> list[str]:
    lines = []
    if opt:
        lines += [f"ExLlamaV2 0.3.2's optimizer (its `optimize()` and compiled `sim_anneal`) on exl2fmt's "
                  f"measurement of {args.model} ({args.rows} x {args.length} calibration); rows per block: "
                  + ", ".join(f"{k} {v}" for k, v in opt["rows_per_block"].items())
                  + f"; best of {args.repeats} runs per cell; max(err) / sum(err^2) / achieved bpw:", "",
                  "| target bpw | exl2fmt now | upstream rows (ExLlamaV2's own table) | old layout (extras appended) "
                  "| now <= upstream |", "|---|---|---|---|---|"]
        for bits, cells in opt["targets"].items():
            def c(n):
                r = cells[n]
                return f"{r['max_err']:.5f} / {r['sum_err2']:.3e} / {r['bpw']:.4f}"
            ok = cells["exl2fmt now"]["max_err"] <= cells["upstream rows"]["max_err"]
            lines.append(f"| {bits} | {c('exl2fmt now')} | {c('upstream rows')} | {c('old layout')} | "
                         f"{'yes' if ok else 'NO'} |")
        lines.append("")
    if gq:
        lines += [f"GPTQ 4-bit g128 outputs of {args.model}; logits on {args.eval_rows} x {args.eval_len} held-out "
                  f"tokens vs exl2fmt's forward over its own dequantized weights (fp32); fp16 rounding bound = "
                  f"2 x max |FP16-in-fp16 - FP16-in-fp32 logits| = {2 * gq['fp16_noise']:.4f}:", "",
                  "| output | peer | loads | kernel | quantized linears (experts) the peer built | max abs weight diff "
                  "vs exl2fmt's decoder | max abs logit diff | within fp16 rounding | top-1 agree |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, r in gq["results"].items():
            name, peer = key.split("|")
            if r["loaded"]:
                lines.append(f"| {name} | {peer} | yes | {', '.join(r['kernel'])} | {r['quant_linears']} "
                             f"({r['quant_experts']}) | {r['weights_max_abs_diff']:.3g} | {r['max_abs_diff']:.4f} | "
                             f"{'yes' if r['within'] else 'NO'} | {r['top1_agree']:.4f} |")
            else:
                lines.append(f"| {name} | {peer} | NO: {r['error'][:160].replace('|', '/').replace(chr(10), ' ')} | | | | | | |")
        lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", type=Path, default=Path("/work/scratch/h16"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16, help="calibration rows")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--eval-rows", type=int, default=4)
    ap.add_argument("--eval-len", type=int, default=128)
    ap.add_argument("--model", choices=("fixture",) + TINY, default="fixture",
                    help="the trained fixture, or a tiny random MoE model (hidden 128)")
    ap.add_argument("--skip-optimizer", action="store_true")
    ap.add_argument("--skip-gptq", action="store_true")
    ap.add_argument("--record", action="store_true", help="append the tables to bench/RESULTS.md")
    a = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=a.scratch) as d:
        src, cal, ids = source(a.model, Path(d), a.rows, a.length, a.eval_rows, a.eval_len)
        opt = None if a.skip_optimizer else optimizer_check(a.scratch, Path(d), src, cal, a.repeats, a.rows,
                                                            a.length, print)
        gq = None if a.skip_gptq else gptq_check(a.scratch, Path(d), src, cal, ids, a.rows, a.length, print)
    lines = report(opt, gq, a)
    print("\n".join(lines))
    (a.scratch / f"peers-result-{a.model}.json").write_text(json.dumps({"optimizer": opt, "gptq": gq}, indent=1, default=str))
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n### Peers on exl2fmt's outputs (issue 16, {datetime.date.today()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores, torch {torch.__version__}; `bench/peers.py`, "
                    f"{time.monotonic() - t0:.0f} s)\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
