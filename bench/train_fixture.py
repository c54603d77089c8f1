"""Train the test fixture model tests/fixtures/tiny-llama/: a small Llama with trained weights.

The quantizer's quality claims (perplexity / KL against FP16 at several bit rates) need a model whose weights
carry structure, not random matrices.  This script trains one on CPU in a few minutes:

* text: the ``train`` part of the shipped corpus (exl2fmt/quant/data, CPython docs; see its README);
* tokenizer: byte-level BPE with a 2048-token vocabulary trained by ``tokenizers`` on that text, special
  tokens ``<s>`` (BOS, id 0) and ``</s>`` (EOS, id 1); ``encode`` with special tokens prepends ``<s>``;
* model: Llama architecture (transformers' LlamaForCausalLM is used to train; the result is plain safetensors),
  hidden 256, 4 layers, 8 query heads and 4 KV heads of dim 32 (GQA), MLP 768, untied LM head, RoPE theta
  10000, max 512 positions.  Every linear's K (256 / 768) is a multiple of 32, as EXL2 needs;
* training: AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1), linear warm-up then cosine decay to 10 %,
  gradient clipping at 1.0, batches of random 256-token windows of the token stream drawn by a seeded
  generator; float32, 2 threads, deterministic for a given torch build;
* evaluation: mean next-token loss on the ``eval`` part (non-overlapping 256-token windows), computed by the
  project's model runner (exl2fmt.runner.model) from the saved float16 files, and the add-one-smoothed
  unigram baseline estimated on the training tokens.

Output: config.json, model.safetensors (float16), tokenizer.json, tokenizer_config.json,
special_tokens_map.json, train_log.json (settings, loss curve, final train / eval loss and perplexity, the
unigram baseline, wall time).

Usage:  nice python bench/train_fixture.py [--out tests/fixtures/tiny-llama] [--steps 800] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 1234
VOCAB = 2048
SEQ = 256
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float16",
}


def train_tokenizer(text_docs: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text_docs, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0), ("</s>", 1)])
    assert tok.token_to_id("<s>") == 0 and tok.token_to_id("</s>") == 1 and tok.get_vocab_size() == VOCAB
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"},
                                                            indent=2) + "\n")
    return tok


def token_stream(tok, docs: list[str]) -> np.ndarray:
    """Documents joined with EOS between them (no BOS inside the stream)."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(1)
    return np.array(ids, dtype=np.int64)


def unigram_ppl(train: np.ndarray, evals: np.ndarray) -> float:
    counts = np.bincount(train, minlength=VOCAB).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[evals].mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "tiny-llama"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    import transformers

    from exl2fmt.container import write_safetensors
    from exl2fmt.runner.model import HFModel
    from exl2fmt.quant.calib import corpus_documents

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    train_docs, eval_docs = corpus_documents("train"), corpus_documents("eval")
    tok = train_tokenizer(train_docs, out)
    train_ids, eval_ids = token_stream(tok, train_docs), token_stream(tok, eval_docs)
    t_tok = time.perf_counter() - t0
    print(f"tokenizer: {t_tok:.1f}s, train {len(train_ids)} tokens, eval {len(eval_ids)} tokens", flush=True)

    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "torch_dtype")})
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    warm = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, args.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(SEED)
    data = torch.from_numpy(train_ids)
    curve = []
    recent: list[float] = []
    model.train()
    t1 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 20 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t1
            curve.append({"step": step, "loss": round(float(np.mean(recent)), 4), "seconds": round(el, 1)})
            print(f"step {step:4d}  loss {np.mean(recent):.4f}  {el:6.1f}s", flush=True)
    t_train = time.perf_counter() - t1

    # save float16 weights with the standard Hugging Face names, and a config both transformers 4 and 5 read
    sd = {k: v.detach().to(torch.float16).numpy() for k, v in model.state_dict().items()}
    write_safetensors(out / "model.safetensors", sd, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")

    # evaluate the saved fp16 model with the project's runner
    eng = HFModel.open(out)
    n_win = len(eval_ids) // SEQ
    windows = torch.from_numpy(eval_ids[: n_win * SEQ].reshape(n_win, SEQ))
    losses = []
    with torch.no_grad():
        for i in range(0, n_win, 8):
            ids = windows[i:i + 8]
            logits = eng.forward(ids)
            losses.append(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                            ids[:, 1:].reshape(-1), reduction="sum").item())
        n_pred = n_win * (SEQ - 1)
        eval_loss = sum(losses) / n_pred
        # train loss of the saved model on as many training windows, same forward (not the running average)
        gen2 = torch.Generator().manual_seed(SEED + 1)
        starts = torch.randint(0, len(data) - SEQ - 1, (n_win,), generator=gen2)
        tr = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        tl = 0.0
        for i in range(0, n_win, 8):
            ids = tr[i:i + 8]
            logits = eng.forward(ids)
            tl += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                                    reduction="sum").item()
        train_loss = tl / n_pred
    eng.close()
    uni = unigram_ppl(train_ids, eval_ids[: n_win * SEQ])

    log = {
        "seed": SEED, "steps": args.steps, "batch": args.batch, "seq_len": SEQ, "threads": args.threads,
        "params": n_params, "train_tokens": int(len(train_ids)), "eval_tokens": int(len(eval_ids)),
        "tokens_seen": args.steps * args.batch * SEQ,
        "optimizer": "AdamW lr 3e-3 betas (0.9, 0.95) wd 0.1 (matrices), warm-up 5 % then cosine to 10 %, clip 1.0",
        "curve": curve,
        "final": {
            "train_loss": round(train_loss, 4), "train_ppl": round(math.exp(train_loss), 2),
            "eval_loss": round(eval_loss, 4), "eval_ppl": round(math.exp(eval_loss), 2),
            "eval_windows": n_win, "unigram_eval_ppl": round(uni, 2),
            "note": "losses of the saved float16 model, computed with exl2fmt.quant.hf_engine",
        },
        "seconds": {"tokenizer": round(t_tok, 1), "train": round(t_train, 1),
                    "total": round(time.perf_counter() - t0, 1)},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log["final"], indent=2))
    print(f"params {n_params}, train {t_train:.0f}s")


if __name__ == "__main__":
    main()
