"""GGUF bridge against a real runtime: llama.cpp (llama-cpp-python) runs exl2fmt's GGUF output.

Not part of CI (llama-cpp-python builds llama.cpp from source: ~30 min on 2 cores).  Install it by hand:
``CMAKE_ARGS="-DGGML_NATIVE=off" pip install llama-cpp-python``, then ``python bench/gguf_llamacpp_check.py``.

Models (all tiny, deterministic, built here):

* ``exl2``   the embedded EXL2 sample (Llama, GQA 4/2 heads, head_dim 64, vocab 1000, all six EXL2 widths)
  with a byte-level BPE tokenizer trained here to exactly 1000 tokens (``tokenizers``).
* ``gptq4``  the sample's FP16 weights quantized to GPTQ symmetric 4-bit, groups of 32 (-> exact Q4_0).
* ``qwen2``  the sample's FP16 weights as a Qwen2 model with q/k/v biases (arch qwen2: no Q/K permutation).

For each GGUF written by ``exl2fmt convert SRC out.gguf --to gguf --gguf-type T``, the reference is
transformers (float32 forward) on the FP16 directory that ``exl2fmt convert out.gguf DIR --to fp16`` writes back
from that same GGUF, i.e. on the weights llama.cpp holds (rounded once to fp16), and - independent of our
reader - transformers on the source's own FP16 (``exl2fmt convert SRC DIR --to fp16``), so a wrong Q/K row
order cannot cancel out between writer and reader.  llama.cpp runs with an F32 KV cache.  llama.cpp evaluates fixed
token ids; the script reports max |logit difference| over all positions and the logit scale.  For Q8_0/Q4_0,
llama.cpp's CPU kernels quantize activations to 8 bits, so a larger gap is expected there than for F32/F16.
It also checks that llama.cpp tokenizes a text exactly as the Hugging Face tokenizer does.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def train_tokenizer(d: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(3000)]
    text = [" ".join(rng.choice(words, size=40)) + ". Numbers 123 4567!" for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, tr)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                          "add_bos_token": False, "tokenizer_class":
                                                          "PreTrainedTokenizerFast"}))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()


def build_models(root: Path) -> dict[str, Path]:
    from exl2fmt.container import write_sharded
    from exl2fmt.converters.gptq_quant import gptq_layer_tensors, rtn_quantize
    from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample

    out = {}
    d = root / "exl2"
    write_sample(d)
    train_tokenizer(d, SAMPLE_CONFIG["vocab_size"])
    out["exl2"] = d

    dense = sample_dense_tensors(0)
    g = root / "gptq4"
    g.mkdir()
    t = {}
    for n, a in dense.items():
        if n.endswith("_proj.weight"):
            c, s, z, gi = rtn_quantize(a, 4, 32, sym=True)
            for slot, arr in gptq_layer_tensors(c, s, z, gi, 4).items():
                t[f"{n[:-7]}.{slot}"] = arr
        else:
            t[n] = a
    write_sharded(g, t, 1 << 40, metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    (g / "config.json").write_text(json.dumps(dict(SAMPLE_CONFIG, quantization_config=qc)))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (g / f).write_bytes((d / f).read_bytes())
    out["gptq4"] = g

    q = root / "qwen2"
    q.mkdir()
    rng = np.random.default_rng(5)
    t = dict(dense)
    for li in range(SAMPLE_CONFIG["num_hidden_layers"]):
        for p in ("q_proj", "k_proj", "v_proj"):
            rows = dense[f"model.layers.{li}.self_attn.{p}.weight"].shape[0]
            t[f"model.layers.{li}.self_attn.{p}.bias"] = (rng.standard_normal(rows) * 0.5).astype(np.float16)
    write_sharded(q, t, 1 << 40, metadata={"format": "pt"})
    cfg = {k: v for k, v in SAMPLE_CONFIG.items()}
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    (q / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (q / f).write_bytes((d / f).read_bytes())
    out["qwen2"] = q
    return out


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def llama_logits(gguf_path: Path, ids: list[int]):
    from llama_cpp import Llama

    # F32 KV cache: the default F16 cache adds its own rounding to the comparison
    llm = Llama(model_path=str(gguf_path), n_ctx=128, logits_all=True, n_threads=2, verbose=False, seed=0,
                type_k=0, type_v=0)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    return llm, logits


def main() -> int:
    from exl2fmt.converters import convert

    ids = [1, 17, 250, 999, 3, 512, 77, 640, 5, 901, 33, 128, 700, 2, 64, 400]
    text = "hello world, numbers 123 4567! abc"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = build_models(root)
        cases = [("exl2", "f32"), ("exl2", "f16"), ("exl2", "q8_0"), ("exl2", "q4_0"), ("gptq4", "auto"),
                 ("gptq4", "q8_0"), ("qwen2", "f32"), ("qwen2", "f16")]
        for src, typ in cases:
            g = root / f"{src}-{typ}.gguf"
            t0 = time.perf_counter()
            rep = convert(models[src], g, "gguf", gguf_type=typ)
            t_conv = time.perf_counter() - t0
            back = root / f"{src}-{typ}-fp16"
            convert(g, back, "fp16")
            ref = hf_logits(back, ids)
            direct = root / f"{src}-fp16"      # the source's own FP16, not read back from our GGUF
            if not direct.exists():
                convert(models[src], direct, "fp16")
            ref_src = hf_logits(direct, ids)
            llm, got = llama_logits(g, ids)
            from tokenizers import Tokenizer

            hf_tok = Tokenizer.from_file(str(models[src] / "tokenizer.json")).encode(text).ids
            cpp_tok = llm.tokenize(text.encode(), add_bos=False, special=False)
            detok = llm.detokenize(cpp_tok).decode("utf-8", errors="replace")
            diff = float(np.abs(got - ref).max())
            row = {"source": src, "gguf_type": typ, "layer_type": rep.options.get("layer_type"),
                   "exact_layers": f"{rep.summary()['exact_layers']}/{rep.summary()['layers']}",
                   "worst_layer_rel_error": rep.summary()["worst_rel_error"], "bytes": rep.bytes_written,
                   "convert_s": round(t_conv, 3), "max_abs_logit_diff": round(diff, 5),
                   "max_abs_logit_diff_vs_source": round(float(np.abs(got - ref_src).max()), 5),
                   "max_abs_logit": round(float(np.abs(ref).max()), 3),
                   "argmax_agree": f"{int((got.argmax(-1) == ref.argmax(-1)).sum())}/{len(ids)}",
                   "tokenize_equal": hf_tok == cpp_tok, "detokenize_equal": detok == text}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del llm
    print(json.dumps({"machine": platform.machine(), "python": sys.version.split()[0],
                      "llama_cpp": __import__("llama_cpp").__version__, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
