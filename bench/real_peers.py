"""Peer quantizers on the real models of ``bench/real_quality.py`` (issue 40): the same FP16 start, the same
calibration ids, the same evaluator.  Not run in CI; nothing of the peers is committed.

Every peer quantizes exl2fmt's own GGUF -> FP16 decode (``<runs>/fp16``, made by ``real_quality.py``) with the
token ids exl2fmt's default calibration uses on the CPU (the built-in set through the model's tokenizer, 32 rows
x 512 tokens, seed 0; written once to ``<runs>/cal.npy``).  Each peer runs as one child process of its own
scratch venv's Python, in this file's ``--worker`` mode, timed by the parent with ``os.wait4`` (wall, CPU user +
sys, peak RSS of that process, imports included).  Its output is dequantized to a dense FP16 directory by the
reader of its format (exl2fmt ``convert --to fp16`` for GPTQ-format files; compressed-tensors itself for
llm-compressor's files, which exl2fmt does not read) and scored by ``bench/real_eval.py`` against the FP16
model.  Each row is merged into ``<runs>/peers.json`` as soon as it is scored (an interrupted run keeps the rows
it finished; ``--drop-decode`` then deletes that row's FP16 decode); a peer whose child process fails gets its
row too, with the command and the tail of its log (``error``, ``log_tail``), and the run goes on to the next
peer.  ``real_quality.py`` prints them with its own rows.

Peers (``--peer NAME[:BITS]``, repeatable):

* ``gptqmodel``        GPTQModel 7.7, GPTQ g128 sym, damp 0.01, its default group-aware act-order
* ``gptqmodel-act``    the same with ``desc_act=True``
* ``llmc-gptq``        llm-compressor 0.14 ``GPTQModifier`` scheme W{BITS}A16 (sym, g``--group-size``, its default static
                       act-order, dampening 0.01), lm_head left FP16
* ``llmc-awq``         llm-compressor 0.14 ``AWQModifier`` scheme W4A16_ASYM (g``--group-size``, asymmetric: its examples'
                       scheme), lm_head left FP16
* ``autoround``        AutoRound 0.16 W{BITS}A16 g128 sym (``--iters``, default its 200; or
                       ``--autoround-recipe light``, its own published light preset: 50 iters, lr 5e-3), on the
                       same 32 x 512 calibration ids (its presets name 128 x 2048), exported as ``auto_gptq``
                       (read by exl2fmt)
* ``exl2fmt-gptq``     exl2fmt's own GPTQ {BITS}-bit g128 (``convert --to gptq``) into ``<runs>/gptq-BITS``, the
                       directory ``real_quality.py --gptq-bits`` uses, so either script reuses the other's run
* ``llamacpp:TYPE``    llama.cpp's ``llama-quantize`` to TYPE (Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, ...) with an
                       importance matrix from ``llama-imatrix`` on the same calibration text (below); the binaries
                       from ``--llama-bin``, the F16 GGUF from llama.cpp's own ``convert_hf_to_gguf.py``
                       (``--llama-src``: the llama.cpp source tree, run with this Python)

llama.cpp takes text, not ids: its calibration file ``<runs>/cal.txt`` is the text rows of ``cal.npy`` decoded by
the model's tokenizer (the built-in set's one row of random ids has no text and is left out), and
``llama-imatrix -c 512 --chunks <text rows>`` reads it back as the same number of 512-token chunks (its own
tokenization of the decoded text; it puts BOS first in each chunk where the model adds one).  A llama.cpp row's
time is the ``llama-imatrix`` run plus its own ``llama-quantize`` run (the F16 GGUF conversion is timed apart, in
``<runs>/llamacpp-f16.run.json``); its peak RSS is the larger of the two.  Its GGUF is decoded to FP16
by exl2fmt (``convert --to fp16``, K-quants and IQ types through the ``gguf`` package).

``--tied-head 4.25,8.0`` scores exl2fmt's EXL2 files of those bitrates without their separate quantized head (the
FP16 embedding as head, as ExLlamaV2 runs a tied-embedding model's file that has no ``lm_head``), with the file
bytes they would have.  ``--exl2-nohead 5.0`` quantizes the FP16 model to EXL2 at that bitrate
with the exl2fmt this Python imports, reusing ``<runs>/measurement.json`` (only the quantize pass runs), and
checks that the file has no separate head: run it with an exl2fmt whose default writes none for a tied model
(``PYTHONPATH=<a checkout of that change>``); its row carries the same label as ``--tied-head``'s.
``--cal-rows N`` takes every k-th calibration row (said in the row's label).

Setup (once, outside the repository)::

    # GPTQModel: the venv bench/gptq_vs_gptqmodel.py describes
    S=/work/scratch/peers; python3 -m venv $S/V
    echo /work/main/.venv/lib/python3.11/site-packages > $S/V/lib/python3.11/site-packages/_base.pth
    $S/V/bin/pip install --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.20.0 auto-round==0.16.1 \\
        loguru nvidia-ml-py py-cpuinfo

Run (heavy; one at a time on a shared machine)::

    nice -n 19 python bench/real_peers.py --model smollm2 --peer llmc-gptq:4 --python $S/V/bin/python
    nice -n 19 python bench/real_peers.py --model smollm2 --peer gptqmodel:3 --python /work/scratch/h16/V/bin/python
    B=/work/scratch/peers/llamacpp; nice -n 19 python bench/real_peers.py --model smollm2 --peer llamacpp:Q4_K_M \
        --llama-bin $B/build/bin --llama-src $B/llama_cpp_python-0.3.36/vendor/llama.cpp

``bpw`` is the decoder linears' stored bits per weight as exl2fmt's ``inspect`` counts them (for
compressed-tensors files: the packed weights, scales, zero points and g_idx of those layers, counted the same
way); ``file_bytes`` is every safetensors byte of the output (head and embeddings included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXL2FMT = [sys.executable, "-m", "exl2fmt.cli.app"]
CAL_ROWS, CAL_LENGTH = 32, 512


# ------------------------------------------------------------------------------------------------ workers (peer venv)


def _cal_tensor(cal: str):
    import numpy as np
    import torch

    return torch.from_numpy(np.load(cal)).long()


def worker_gptqmodel(src: str, cal: str, out: str, bits: int, order: str) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    os.chdir(Path(out).parent)          # GPTQModel writes a logs/ folder into the working directory
    qc = QuantizeConfig(bits=bits, group_size=128, sym=True, damp_percent=0.01,
                        desc_act=order == "act", act_group_aware=order == "group")
    model = GPTQModel.load(src, qc, device="cpu")
    ids = _cal_tensor(cal)
    data = [{"input_ids": r[None], "attention_mask": torch.ones((1, r.numel()), dtype=torch.long)} for r in ids]
    model.quantize(data, batch_size=1, calibration_sort=None)
    model.save(out)


def worker_llmc(src: str, cal: str, out: str, bits: int, method: str, group: int) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if method == "awq" and not torch.accelerator.is_available():
        # llm-compressor 0.14's AWQ pins each cached batch (``IntermediatesCache.pin_memory``, for non-blocking
        # host-to-device copies) unconditionally, and torch refuses to pin with no accelerator ("Cannot access
        # accelerator device when none is available"); on the CPU there is no copy to speed up, so skip the pinning
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    ids = _cal_tensor(cal)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    # float32 on the CPU (torch's fp16 CPU matmuls are many times slower); stored as fp16 at the end
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    # the presets W{bits}A16 (sym) and W4A16_ASYM, with the group size as a parameter: compressed-tensors refuses
    # a group size that does not divide a layer's columns (SmolLM2's 576), so 64 is the nearest it takes there
    weights = QuantizationArgs(num_bits=bits, type="int", strategy="group", group_size=group,
                               symmetric=method == "gptq")
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"])
    else:
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = AWQModifier(config_groups=groups, ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=ids.shape[0])
    model.to(torch.float16)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)


def worker_autoround(src: str, cal: str, out: str, bits: int, iters: int, lr: str = "none") -> None:
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = _cal_tensor(cal)
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    batches = [ids[a:a + 8] for a in range(0, ids.shape[0], 8)]
    extra = {} if lr == "none" else {"lr": float(lr)}          # None: AutoRound's own default, 1 / iters
    ar = AutoRound(model, tok, bits=bits, group_size=128, sym=True, iters=iters, nsamples=ids.shape[0],
                   seqlen=ids.shape[1], batch_size=8, dataset=batches, device_map="cpu", **extra)
    ar.quantize_and_save(out, format="auto_gptq")
    subs = [p for p in Path(out).iterdir() if p.is_dir()]      # it writes into OUT/<model>-w4g128/
    if len(subs) == 1 and not (Path(out) / "config.json").exists():
        for f in subs[0].iterdir():
            f.rename(Path(out) / f.name)
        subs[0].rmdir()


def worker_decompress(src: str, out: str) -> None:
    """A compressed-tensors checkpoint -> dense FP16 safetensors, by compressed-tensors' own decompression."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import CompressedTensorsConfig

        qc = CompressedTensorsConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float16, quantization_config=qc)
    except ImportError:
        model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float16)
    dense = {}
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if pname in ("weight", "bias"):
                dense[f"{name}.{pname}"] = p.detach().to(torch.float16)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    base = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float16)
    missing, unexpected = base.load_state_dict(dense, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise SystemExit(f"decompress: missing {missing[:5]}, unexpected {unexpected[:5]}")
    base.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


# ------------------------------------------------------------------------------------------------ parent


class PeerFailed(Exception):
    """A peer's child process exited non-zero: the command and the tail of its log (the row records both)."""

    def __init__(self, what: str, tail: str):
        super().__init__(what)
        self.tail = tail


# A child's own figures, taken by a small Python between this process and the child: Linux keeps the larger of a
# process's peak RSS before and after ``exec`` (``ru_maxrss``), so a child forked from this process once it holds
# the evaluator (several GB for Gemma's 262k-word log-probabilities) would report this process's peak as its own.
# The launcher is started small, so the child it forks starts from its few MB; it reports the child's ``wait4``.
_LAUNCH = ("import json, os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[2:])\n"
           "_, status, ru = os.wait4(p.pid, 0)\n"
           "rc = os.waitstatus_to_exitcode(status)\n"
           "open(sys.argv[1], 'w').write(json.dumps([rc, ru.ru_utime + ru.ru_stime, ru.ru_maxrss]))\n"
           "sys.exit(0 if rc == 0 else 1)\n")


def run_child(cmd: list[str], log: Path, env: dict, cwd: Path) -> dict:
    """Run one child process; its wall, CPU user+sys and peak RSS (its own ``wait4``, through ``_LAUNCH``) and the
    1-minute load average at its start and end (the machine is shared: figures are only comparable at like load)."""
    load0 = os.getloadavg()[0]
    stats = log.with_name(log.name + ".wait4.json")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", _LAUNCH, str(stats), *cmd], stdout=f, stderr=subprocess.STDOUT,
                       env=env, cwd=cwd)
    seconds = time.perf_counter() - t0
    rc, cpu, maxrss = json.loads(stats.read_text()) if stats.exists() else (-1, 0.0, 0)
    stats.unlink(missing_ok=True)
    if rc != 0:
        raise PeerFailed(f"failed ({rc}): {' '.join(cmd)}", log.read_text(errors="replace")[-3000:])
    return {"seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "peak_rss_mb": round(maxrss / 1024),
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def calibration_ids(runs: Path) -> Path:
    import numpy as np

    from exl2fmt.quant.calib import load_calibration

    cal = runs / "cal.npy"
    if not cal.exists():
        np.save(cal, load_calibration(None, runs / "fp16" / "tokenizer.json", CAL_ROWS, CAL_LENGTH, 0).numpy())
    return cal


def safetensors_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def compressed_bpw(q: Path, fp16: Path) -> float:
    """Decoder-linear bits per weight of a compressed-tensors checkpoint: bytes of every tensor of the quantized
    decoder linears (packed weight, scale, zero point, g_idx, shape) x 8 / their FP16 weight count."""
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, tuple[int, int]]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), "np") as s:
                for n in s.keys():
                    sl = s.get_slice(n)
                    shape = sl.get_shape()
                    count = 1
                    for x in shape:
                        count *= x
                    out[n] = (count, count * {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1,
                                              "U8": 1}[sl.get_dtype()])
        return out

    ref = tensors(fp16)
    mods = {n[: -len(".weight")] for n in ref if n.startswith("model.layers.") and n.endswith(".weight")
            and "proj" in n}
    q_t = tensors(q)
    stored = sum(b for n, (_, b) in q_t.items() if n.rsplit(".", 1)[0] in mods)
    weights = sum(ref[m + ".weight"][0] for m in mods)
    return round(stored * 8 / weights, 6)


def is_gptq(q: Path) -> bool:
    """A GPTQ-format output (exl2fmt reads it): quantize_config.json, or config.json's quant_method gptq."""
    if (q / "quantize_config.json").exists():
        return True
    qc = json.loads((q / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "gptq"


def tied_head_row(runs: Path, bits: str) -> dict:
    """exl2fmt's EXL2 file at ``bits`` without its separate quantized head: ExLlamaV2 0.3.2 loads ``lm_head`` from
    ``model.embed_tokens`` (its ``alt_key``) when a tied-embedding model's file has no ``lm_head.*`` tensors, so the
    model computes with the FP16 embedding as its head.  Built from the EXL2 file's exl2fmt decode with
    ``lm_head.weight`` dropped and ``tie_word_embeddings`` set; file bytes = the EXL2 file's less its head tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    q, src, d = runs / f"exl2-{bits}", runs / f"exl2-{bits}-fp16", runs / f"exl2-{bits}-tied-fp16"
    if not d.exists():
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            save_file({k: f.get_tensor(k) for k in f.keys() if not k.startswith("lm_head.")},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in src.iterdir():
            if f.suffix == ".json" and f.name != "config.json":
                shutil.copy(f, tmp / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["tie_word_embeddings"] = True
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        tmp.rename(d)
    head = 0
    for f in q.glob("*.safetensors"):
        with safe_open(str(f), "np") as s:
            head += sum(s.get_tensor(k).nbytes for k in s.keys() if k.startswith("lm_head."))
    from exl2fmt import inspect_model

    prev = {r["row"]: r for r in json.loads((runs / "results.json").read_text())["rows"]}.get(f"exl2fmt EXL2 {bits}", {})
    return {"row": f"exl2fmt EXL2 {bits}, no separate head (FP16 tied embedding)",
            "bpw": inspect_model(str(q))["summary"]["bpw"]["decoder"], "file_bytes": safetensors_bytes(q) - head,
            **{k: prev[k] for k in ("seconds", "peak_rss_mb") if k in prev}, "dir": str(d), "quant_dir": str(q)}


def calibration_text(runs: Path, cal: Path) -> tuple[Path, int]:
    """``<runs>/cal.txt``: the text rows of ``cal`` (int64 [rows, 512], the built-in set) decoded as one stream by
    the model's tokenizer, and the number of text rows (the built-in set ends with its random-id rows)."""
    import numpy as np
    from tokenizers import Tokenizer

    from exl2fmt.quant.calib import default_random_rows

    ids = np.load(cal)
    n_text = ids.shape[0] - default_random_rows(ids.shape[0])
    out = runs / "cal.txt"
    if not out.exists():
        tok = Tokenizer.from_file(str(runs / "fp16" / "tokenizer.json"))
        out.write_text(tok.decode(ids[:n_text].reshape(-1).tolist(), skip_special_tokens=False), encoding="utf-8")
    return out, n_text


def llamacpp_file(runs: Path, qtype: str, a, env: dict) -> tuple[Path, dict]:
    """The llama.cpp GGUF of ``qtype`` (made once: F16 GGUF, imatrix, quantize) and its time/peak RSS."""
    f16, imat = runs / "llamacpp-f16.gguf", runs / "llamacpp-imatrix.gguf"
    q = runs / f"llamacpp-{qtype}.gguf"
    if q.exists():
        return q, json.loads((runs / f"llamacpp-{qtype}.run.json").read_text())
    if not a.llama_bin:
        raise SystemExit("--llama-bin (llama.cpp's build/bin) is needed to make a llama.cpp file")
    binp = Path(a.llama_bin)
    if not f16.exists():
        if not a.llama_src:
            raise SystemExit("--llama-src (llama.cpp's source tree, for convert_hf_to_gguf.py) is needed")
        tmp = f16.with_suffix(".tmp")
        how = run_child([sys.executable, str(Path(a.llama_src) / "convert_hf_to_gguf.py"), str(runs / "fp16"),
                         "--outtype", "f16", "--outfile", str(tmp)], runs / "llamacpp-f16.log", env, runs)
        tmp.rename(f16)
        (runs / "llamacpp-f16.run.json").write_text(json.dumps(how))
    if not imat.exists():
        text, n_text = calibration_text(runs, calibration_ids(runs))
        tmp = imat.with_name("llamacpp-imatrix.tmp.gguf")
        how = run_child([str(binp / "llama-imatrix"), "-m", str(f16), "-f", str(text), "-c", str(CAL_LENGTH),
                         "--chunks", str(n_text), "-t", "2", "--no-ppl", "-o", str(tmp)],
                        runs / "llamacpp-imatrix.log", env, runs)
        tmp.rename(imat)
        (runs / "llamacpp-imatrix.run.json").write_text(json.dumps(how))
    tmp = q.with_name(q.stem + ".tmp.gguf")
    how = run_child([str(binp / "llama-quantize"), "--imatrix", str(imat), str(f16), str(tmp), qtype, "2"],
                    runs / f"llamacpp-{qtype}.log", env, runs)
    tmp.rename(q)
    im = json.loads((runs / "llamacpp-imatrix.run.json").read_text())
    how = {"seconds": round(im["seconds"] + how["seconds"], 1), "cpu_s": round(im["cpu_s"] + how["cpu_s"], 1),
           "peak_rss_mb": max(im["peak_rss_mb"], how["peak_rss_mb"]), "quantize_s": how["seconds"],
           "imatrix_s": im["seconds"]}
    (runs / f"llamacpp-{qtype}.run.json").write_text(json.dumps(how))
    return q, how


def nohead_exl2_row(runs: Path, bits: str, env: dict) -> dict:
    """exl2fmt EXL2 at ``bits`` written with no separate head (an exl2fmt whose tied-model default is that), from the
    saved measurement; refused if the file has a head after all."""
    from exl2fmt import inspect_model

    q, d = runs / f"exl2-{bits}-nohead", runs / f"exl2-{bits}-nohead-fp16"
    if not q.exists():
        how = run_child(EXL2FMT + ["convert", str(runs / "fp16"), str(q), "--to", "exl2", "--bits", bits,
                                   "--measurement", str(runs / "measurement.json")], runs / f"exl2-{bits}-nohead.log",
                        env, runs)          # not ROOT: ``-m`` puts the working directory first on sys.path
        (runs / f"exl2-{bits}-nohead.run.json").write_text(json.dumps(how))
    summary = inspect_model(str(q))["summary"]
    if summary["bpw"]["head"] is not None:
        raise SystemExit(f"{q} has a separate head ({summary['bpw']['head']} bpw): run with an exl2fmt that "
                         "writes none for a tied model")
    if not d.exists():
        run_child(EXL2FMT + ["convert", str(q), str(d), "--to", "fp16"], runs / f"exl2-{bits}-nohead-deq.log", env,
                  ROOT)
    how = json.loads((runs / f"exl2-{bits}-nohead.run.json").read_text())
    return {"row": f"exl2fmt EXL2 {bits}, no separate head (FP16 tied embedding)", "bpw": summary["bpw"]["decoder"],
            "file_bytes": safetensors_bytes(q), **how, "dir": str(d), "quant_dir": str(q), "written_without_head": True}


def peer_spec(name: str, bits: int, a) -> tuple[str, str, list[str]]:
    """(output tag, row label, worker arguments) of one ``--peer NAME:BITS``."""
    tag = f"{name}-{bits}"
    if name.startswith("gptqmodel"):
        act = name == "gptqmodel-act"
        return tag, f"GPTQModel 7.7 {bits}-bit g128" + (" desc_act" if act else ""), [
            "gptqmodel", "act" if act else "group"]
    if name in ("llmc-gptq", "llmc-awq"):
        kind = "GPTQ" if name == "llmc-gptq" else "AWQ asym"
        return f"{tag}-g{a.group_size}", f"llm-compressor 0.14 {kind} W{bits}A16 g{a.group_size}", [
            "llmc", name[5:], str(a.group_size)]
    if name == "autoround":
        iters, lr = AUTOROUND_RECIPES[a.autoround_recipe] if a.autoround_recipe else (a.iters, None)
        if not a.autoround_recipe:
            what = f"{iters} iters"
        elif iters == 0:
            what = f"its {a.autoround_recipe} recipe: 0 iters, no sign-gradient rounding; 32 x 512 calibration"
        else:
            what = f"its {a.autoround_recipe} recipe: {iters} iters, lr {lr:g}; 32 x 512 calibration"
        return f"{tag}-i{iters}" + (f"-{a.autoround_recipe}" if a.autoround_recipe else ""), (
            f"AutoRound 0.16 {bits}-bit g128 ({what})"), ["autoround", str(iters), str(lr).lower()]
    raise SystemExit(f"unknown peer {name}")


def peer_row(runs: Path, spec: str, a, cal: Path, env: dict) -> tuple[str, dict]:
    """Quantize (once) and dequantize one ``--peer`` (PeerFailed from a child that fails); its label and row."""
    name, _, bits = spec.partition(":")
    fp16 = runs / "fp16"
    from exl2fmt import inspect_model

    if name == "llamacpp":
        q, how = llamacpp_file(runs, bits, a, env)
        d = runs / f"llamacpp-{bits}-fp16"
        if not d.exists():
            run_child(EXL2FMT + ["convert", str(q), str(d), "--to", "fp16"], runs / f"llamacpp-{bits}-deq.log",
                      env, ROOT)
        return f"llama.cpp {bits} imatrix", {"bpw": inspect_model(str(q))["summary"]["bpw"]["decoder"],
                                              "file_bytes": q.stat().st_size, **how, "dir": str(d),
                                              "quant_dir": str(q)}
    bits = int(bits or 4)
    if name == "exl2fmt-gptq":
        # the directory and side file bench/real_quality.py uses for its own GPTQ row, so that it reuses both
        q, label = runs / f"gptq-{bits}", f"exl2fmt GPTQ {bits}-bit g128"
        side = runs / f"gptq-{bits}.run.json"
        if not q.exists():
            how = run_child(EXL2FMT + ["convert", str(fp16), str(q), "--to", "gptq", "--bits", str(bits),
                                       "--group-size", "128"], runs / f"gptq-{bits}.log", env, runs)
            side.write_text(json.dumps(how))
    else:
        tag, label, args = peer_spec(name, bits, a)
        if a.cal_rows:
            tag += f"-c{a.cal_rows}"
            label += f" ({a.cal_rows} of {CAL_ROWS} calibration rows)"
        q, side = runs / f"peer-{tag}", runs / f"peer-{tag}.run.json"
        if not q.exists():
            if not a.python:
                raise SystemExit("--python (the peer venv) is needed to run a peer")
            tmp = q.with_name(q.name + ".tmp")                 # a killed run leaves no half-written output
            shutil.rmtree(tmp, ignore_errors=True)
            cmd = [a.python, str(Path(__file__).resolve()), "--worker", args[0], str(fp16), str(cal), str(tmp),
                   str(bits), *args[1:]]
            how = run_child(cmd, runs / f"peer-{q.name[5:]}.log", env, runs)
            tmp.rename(q)
            side.write_text(json.dumps(how))
    how = json.loads(side.read_text())
    d = runs / f"{q.name}-fp16"
    if not d.exists():
        if is_gptq(q):                                   # GPTQ format: exl2fmt reads it
            run_child(EXL2FMT + ["convert", str(q), str(d), "--to", "fp16"], runs / f"{q.name}-deq.log", env, ROOT)
        else:                                            # compressed-tensors: the peer's own decompression
            run_child([a.python, str(Path(__file__).resolve()), "--worker", "decompress", str(q), str(d)],
                      runs / f"{q.name}-deq.log", env, runs)
    bpw = inspect_model(str(q))["summary"]["bpw"]["decoder"] if is_gptq(q) else compressed_bpw(q, fp16)
    return label, {"bpw": bpw, "file_bytes": safetensors_bytes(q), **how, "dir": str(d), "quant_dir": str(q)}


def failed_label(spec: str, a) -> str:
    name, _, bits = spec.partition(":")
    if name == "llamacpp":
        return f"llama.cpp {bits} imatrix"
    if name == "exl2fmt-gptq":
        return f"exl2fmt GPTQ {bits or 4}-bit g128"
    return peer_spec(name, int(bits or 4), a)[1]


def save_row(store: Path, label: str, row: dict) -> None:
    """Merge one row into ``peers.json`` at once (an interrupted run keeps the rows it finished; another run may
    have added rows meanwhile, so the file is read again just before it is replaced)."""
    cur = json.loads(store.read_text()) if store.exists() else {}
    cur[label] = {"row": label, **row}
    tmp = store.with_name(store.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cur, indent=1))
    tmp.replace(store)


# auto_round.cli.main.RECIPES: "light" = iters 50, lr 5e-3; "opt_rtn" = iters 0 (its optimized round-to-nearest:
# a scale search on the calibration activations, no sign-gradient descent).  Both name 128 x 2048 samples; here the
# same 32 x 512 ids every peer gets.
AUTOROUND_RECIPES = {"light": (50, 5e-3), "opt_rtn": (0, None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/exl2fmt-bench"))
    ap.add_argument("--peer", action="append", default=[], help="NAME[:BITS], repeatable")
    ap.add_argument("--python", required=False, help="the peer venv's python")
    ap.add_argument("--group-size", type=int, default=128, help="llm-compressor's group size (64 where 128 does "
                    "not divide every layer's columns)")
    ap.add_argument("--iters", type=int, default=200, help="AutoRound iterations per block")
    ap.add_argument("--autoround-recipe", choices=sorted(AUTOROUND_RECIPES), default=None,
                    help="AutoRound's own published preset (light: 50 iters, lr 5e-3; opt_rtn: 0 iters) instead of "
                    "--iters")
    ap.add_argument("--cal-rows", type=int, default=None, help="use every k-th calibration row, N rows in all "
                    "(only where the full 32 x 512 does not fit the time; said in the row's label)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per text (as real_quality.py)")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--drop-decode", action="store_true", help="delete a row's dense FP16 decode once its score "
                    "is saved (disk)")
    ap.add_argument("--tied-head", default="", help="EXL2 bitrates (e.g. 4.0,4.25) to score without their separate "
                    "head, as ExLlamaV2 runs a tied-embedding model's file that has none")
    ap.add_argument("--exl2-nohead", default="", help="EXL2 bitrates to quantize with no separate head (needs an "
                    "exl2fmt that writes none for a tied model) from the saved measurement")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's build/bin (llama-imatrix, llama-quantize)")
    ap.add_argument("--llama-src", default=None, help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        kind, *rest = a.worker
        {"gptqmodel": lambda s, c, o, b, x: worker_gptqmodel(s, c, o, int(b), x),
         "llmc": lambda s, c, o, b, x, g: worker_llmc(s, c, o, int(b), x, int(g)),
         "autoround": lambda s, c, o, b, x, lr="none": worker_autoround(s, c, o, int(b), int(x), lr),
         "decompress": lambda s, o: worker_decompress(s, o)}[kind](*rest)
        return
    runs = Path(a.cache) / f"{a.model}-runs"
    fp16 = runs / "fp16"
    if not fp16.exists():
        raise SystemExit(f"{fp16} missing: run bench/real_quality.py --model {a.model} first")
    cal = calibration_ids(runs)
    if a.cal_rows:
        import numpy as np

        full = np.load(cal)
        sub = runs / f"cal-{a.cal_rows}.npy"
        np.save(sub, full[:: max(1, full.shape[0] // a.cal_rows)][: a.cal_rows])
        cal = sub
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPTQMODEL_CPU_WORKERS="2", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="2")
    store = runs / "peers.json"
    evaluator = []

    def score(label: str, row: dict) -> None:
        """Score one row (the evaluator made once, on first use), save it at once, drop its decode if asked."""
        if not a.no_eval:
            if not evaluator:
                sys.path.insert(0, str(ROOT / "bench"))
                import torch
                from real_eval import Evaluator

                torch.set_num_threads(2)
                evaluator.append(Evaluator(fp16, a.tokens))
            row["eval"] = evaluator[0].evaluate(row["dir"])
            row["tokens"] = a.tokens
        save_row(store, label, row)
        print(json.dumps({"row": label, **row}), flush=True)
        if a.drop_decode and "eval" in row and Path(row["dir"]).name.endswith("-fp16"):
            shutil.rmtree(row["dir"], ignore_errors=True)

    for spec in a.peer:
        try:
            label, row = peer_row(runs, spec, a, cal, env)
        except PeerFailed as e:                          # the row stays, with the exact error, not a silent gap
            label = failed_label(spec, a)
            save_row(store, label, {"error": str(e), "log_tail": e.tail})
            print(f"{label}: {e}\n{e.tail}", file=sys.stderr, flush=True)
            continue
        score(label, row)
    for bits in [b for b in a.exl2_nohead.split(",") if b]:
        r = nohead_exl2_row(runs, bits, env)
        score(r.pop("row"), r)
    for bits in [b for b in a.tied_head.split(",") if b]:
        r = tied_head_row(runs, bits)
        score(r.pop("row"), r)


if __name__ == "__main__":
    main()
