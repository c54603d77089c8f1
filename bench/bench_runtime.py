"""Issue 35: speed of the packed CPU runtime against the FP16 model in plain transformers, side by side.

One process loads the packed EXL2 and GPTQ models the user's way (``exl2fmt.load_model``, float32 activations) and
the FP16 baseline the plain way (``AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32)``), then
in ``--rounds`` rounds, the order rotating each round, runs every model through the loop of ``exl2fmt generate``
(``runtime.generate.Generation``, greedy, batch 1, EOS ignored):

* decode: the same short prompt, ``--new`` new tokens; tokens/s of the decode steps (prefill excluded);
* prefill: a ``--prefill`` token prompt, one forward (logits of the last position only, as generate does).

It reports the best (min time) of the rounds, the ratios packed / FP16, and, once, max |logit diff| of each packed
model against its own ``convert --to fp16`` directory run in transformers float32 (on a 64-token text: the
1e-3 x logit-scale tolerance of the issue, how many positions' top-1 agree, and whether 32 greedy tokens are
the same).  Thread counts and the machine
load (``os.getloadavg``) before and after go into the report.

    python bench/bench_runtime.py                      # SmolLM2-135M runs of the bench cache
    python bench/bench_runtime.py --rounds 5 --json out.json
    python bench/bench_runtime.py --exl2 DIR --exl2-fp16 DIR --gptq DIR --gptq-fp16 DIR --fp16 DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

RUNS = Path.home() / ".cache" / "exl2fmt-bench" / "smollm2-runs"
PROMPT = "The history of the printing press"
TEXT = ("The printing press is a mechanical device for applying pressure to an inked surface resting upon a print "
        "medium, such as paper or cloth, thereby transferring the ink. It marked a dramatic improvement on earlier "
        "printing methods in which the cloth, paper or other medium was brushed or rubbed repeatedly to achieve the "
        "transfer of ink, and accelerated the process. Typically used for texts, the invention and global spread of "
        "the printing press was one of the most influential events of the second millennium. ")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exl2", type=Path, default=RUNS / "exl2-4.0")
    ap.add_argument("--exl2-fp16", type=Path, default=RUNS / "exl2-4.0-fp16")
    ap.add_argument("--gptq", type=Path, default=RUNS / "gptq-4")
    ap.add_argument("--gptq-fp16", type=Path, default=RUNS / "gptq-4-fp16")
    ap.add_argument("--fp16", type=Path, default=None, help="the FP16 speed baseline (default: --exl2-fp16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens of the decode run")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def _logit_check(packed, ref, tok, ids, short) -> dict:
    """Logits of ``packed`` against ``ref`` (its FP16 conversion) on ``ids``, and their greedy tokens from
    ``short`` (32 new tokens)."""
    import torch

    with torch.inference_mode():
        a = packed(torch.tensor([ids])).logits[0].float()
        b = ref(torch.tensor([ids])).logits[0].float()
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    same = _decode(packed, tok, short, 32)[1] == _decode(ref, tok, short, 32)[1]
    return {"max_abs_diff": diff, "logit_scale": scale, "diff_over_scale": diff / scale,
            "top1_agree": f"{int((a.argmax(-1) == b.argmax(-1)).sum())}/{len(ids)}",
            "within_1e-3": diff <= 1e-3 * scale, "greedy_32_tokens_equal": same}


def _decode(model, tok, ids, new) -> tuple[float, list[int]]:
    from exl2fmt.runtime.generate import Generation, GenerationOptions

    g = Generation(model, tok, ids, GenerationOptions(max_new_tokens=new, ignore_eos=True))
    for _ in g:
        pass
    s = g.summary()
    return s["timings"]["decode_s"] / max(s["timings"]["decode_steps"], 1), s["token_ids"]


def _prefill(model, tok, ids) -> float:
    from exl2fmt.runtime.generate import Generation, GenerationOptions

    g = Generation(model, tok, ids, GenerationOptions(max_new_tokens=1, ignore_eos=True))
    for _ in g:
        pass
    return g.timings.prefill_s


def main(argv=None) -> int:
    a = _args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    import exl2fmt
    from exl2fmt.runtime import linear

    fp16_dir = a.fp16 or a.exl2_fp16
    tok = exl2fmt.load_tokenizer(fp16_dir)
    short = tok(PROMPT)["input_ids"]
    long_ids = tok(TEXT * (a.prefill // 60 + 2))["input_ids"][: a.prefill]
    check_ids = tok(TEXT)["input_ids"][:64]
    load0 = os.getloadavg()

    def plain(d):
        return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()

    models, logits, how = {}, {}, {}
    for name, d, ref in (("exl2", a.exl2, a.exl2_fp16), ("gptq", a.gptq, a.gptq_fp16)):
        if not d.exists():
            print(f"skip {name}: {d} not found", file=sys.stderr)
            continue
        try:
            models[name] = exl2fmt.load_model(d, device="cpu", dtype=torch.float32)
            how[name] = "exl2fmt.load_model"
        except NotImplementedError:   # load_model left a tied head on meta (fixed on branch rtc, not yet in main)
            import exl2fmt.hf  # noqa: F401

            models[name] = plain(d)
            how[name] = "import exl2fmt.hf; AutoModelForCausalLM.from_pretrained"
        r = plain(ref)
        logits[name] = _logit_check(models[name], r, tok, check_ids, short)
        del r
        gc.collect()
    models["fp16"] = plain(fp16_dir)
    for m in models.values():    # warm-up: kernels loaded from Numba's cache, first-call allocations
        _decode(m, tok, short, 4)
        _prefill(m, tok, long_ids[:64])

    names = list(models)
    dec = {n: [] for n in names}
    pre = {n: [] for n in names}
    tokens = {}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            s, ids = _decode(models[n], tok, short, a.new)
            dec[n].append(s)
            tokens[n] = ids
            pre[n].append(_prefill(models[n], tok, long_ids))
            print(f"round {r} {n:5s} decode {1 / s:7.2f} tok/s  prefill {len(long_ids) / pre[n][-1]:7.1f} tok/s",
                  file=sys.stderr)

    rep = {
        "bench": "runtime", "loaded_by": {**how, "fp16": "AutoModelForCausalLM.from_pretrained"},
        "dirs": {"exl2": str(a.exl2), "gptq": str(a.gptq), "fp16": str(fp16_dir)},
        "threads": {"torch": torch.get_num_threads(), "packed_gemv": linear.gemv_threads()},
        "loadavg": {"before": load0, "after": os.getloadavg()}, "rounds": a.rounds,
        "decode": {"prompt_tokens": len(short), "new_tokens": a.new,
                   "tok_s_best": {n: 1 / min(v) for n, v in dec.items()},
                   "tok_s_median": {n: 1 / sorted(v)[len(v) // 2] for n, v in dec.items()}},
        "prefill": {"prompt_tokens": len(long_ids),
                    "tok_s_best": {n: len(long_ids) / min(v) for n, v in pre.items()},
                    "tok_s_median": {n: len(long_ids) / sorted(v)[len(v) // 2] for n, v in pre.items()}},
        "logits_vs_fp16_conversion": logits,
        "exl2_tokens_equal_fp16_baseline": tokens.get("exl2") == tokens["fp16"] if fp16_dir == a.exl2_fp16 else None,
    }
    for k in ("decode", "prefill"):
        best = rep[k]["tok_s_best"]
        rep[k]["ratio_to_fp16"] = {n: best[n] / best["fp16"] for n in names if n != "fp16"}
    text = json.dumps(rep, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
