"""One evaluator for every quantized model in the real-model comparison (``bench/real_quality.py``).

Every tool's output is first dequantized to a dense FP16 Hugging Face directory (by the tool that reads the
format), then this module runs it and the FP16 reference in transformers' own modeling code in float32, on the
same held-out token windows, and reports:

* ``kl``    mean over predicted positions of KL(p_fp16 || p_test), nats
* ``ppl``   exp(mean next-token negative log-likelihood) of the test model
* ``top1``  fraction of positions where both models' most likely next token agree

Two kinds of held-out text, neither of which any tool calibrates on:

* ``docs``   the shipped corpus's ``eval`` part (Python library documentation prose; the calibration set is its
             disjoint ``calib`` part)
* ``legal``  English legal prose: the license texts Debian ships in /usr/share/common-licenses (a different register
             and vocabulary from the calibration text)

    python bench/real_eval.py REF_FP16_DIR TEST_FP16_DIR [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

LEGAL = ("Apache-2.0", "GPL-3", "MPL-2.0", "GFDL-1.3")


def held_out_text(kind: str) -> str:
    if kind == "docs":
        from exl2fmt.quant.calib import corpus_text

        return corpus_text("eval")
    if kind == "legal":
        root = Path("/usr/share/common-licenses")
        return "\n\n".join((root / n).read_text(encoding="utf-8", errors="replace") for n in LEGAL)
    raise ValueError(kind)


def eval_windows(tokenizer_dir, kind: str, tokens: int, length: int) -> torch.Tensor:
    """int64 [rows, length]: consecutive windows of the tokenized text (the first ``tokens`` tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = tok.encode(held_out_text(kind), add_special_tokens=False).ids
    rows = max(1, min(len(ids), tokens) // length)
    if len(ids) < rows * length:
        raise SystemExit(f"{kind}: only {len(ids)} tokens")
    return torch.tensor(np.asarray(ids[: rows * length], dtype=np.int64).reshape(rows, length))


def load_fp32(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    m.eval()
    return m


@torch.no_grad()
def logprobs(model, ids: torch.Tensor, batch: int = 2) -> torch.Tensor:
    """float32 [rows, length - 1, vocab]: log-softmax of the next-token logits."""
    out = []
    for a in range(0, ids.shape[0], batch):
        logits = model(ids[a:a + batch]).logits[:, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


@torch.no_grad()
def compare(ref_lp: torch.Tensor, test_lp: torch.Tensor, ids: torch.Tensor) -> dict:
    tgt = ids[:, 1:]
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1).mean().item()
    nll = -test_lp.gather(-1, tgt.unsqueeze(-1)).mean().item()
    top1 = (ref_lp.argmax(-1) == test_lp.argmax(-1)).float().mean().item()
    return {"kl": kl, "ppl": math.exp(nll), "top1": top1}


class Evaluator:
    """Holds the FP16 reference's log-probabilities on each held-out set; ``evaluate(dir)`` compares one model."""

    def __init__(self, ref_dir, tokens: int = 4096, length: int = 512, kinds=("docs", "legal")):
        self.ids = {k: eval_windows(ref_dir, k, tokens, length) for k in kinds}
        ref = load_fp32(ref_dir)
        self.ref_lp = {k: logprobs(ref, ids) for k, ids in self.ids.items()}
        self.ref_ppl = {k: compare(self.ref_lp[k], self.ref_lp[k], self.ids[k])["ppl"] for k in kinds}
        del ref

    def evaluate(self, model_dir) -> dict:
        m = load_fp32(model_dir)
        res = {k: compare(self.ref_lp[k], logprobs(m, ids), ids) for k, ids in self.ids.items()}
        del m
        return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("test", nargs="+")
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    torch.set_num_threads(2)
    ev = Evaluator(a.ref, a.tokens)
    print(json.dumps({"fp16_ppl": ev.ref_ppl}))
    for t in a.test:
        print(json.dumps({"model": t, **ev.evaluate(t)}))


if __name__ == "__main__":
    main()
