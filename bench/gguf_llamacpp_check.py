"""GGUF bridge against a real runtime: llama.cpp (through llama-cpp-python) runs exl2fmt's GGUF files.

Not part of CI: llama-cpp-python builds llama.cpp from source (a few minutes to ~35 min on 2 cores).  Either
``CMAKE_ARGS="-DGGML_NATIVE=off" pip install llama-cpp-python``, or build only ``libllama`` with cmake from the
sdist's ``vendor/llama.cpp`` and point ``LLAMA_CPP_LIB_PATH`` at its ``bin/`` (with the sdist on ``PYTHONPATH``)::

    python bench/gguf_llamacpp_check.py [--arch llama,qwen2] [--sources dense,gptq,exl2] [--no-llama] [--json F]

**Models.**  Per architecture of the GGUF bridge (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
gemma, gemma2, gemma3 text, phi3, cohere, granite, starcoder2): the tiny seeded model of the goldens
(``tests/tiny_hf.make_tiny``, the tokenizer kind of ``bench/gguf_goldens.ARCHS``), with its Q and K projections
(or, for architectures with Q/K norms, those norms) sharpened so that attention is far from uniform: at the
tiny models' weight scale every attention row is nearly flat and a wrong rope or Q/K row order would barely
move the logits.  Three sources per architecture:

* ``dense``  the FP16 model itself            -> GGUF ``f16`` and ``q8_0``;
* ``gptq``   RTN GPTQ, symmetric 4 bit, groups of 32 (routers stay dense) -> GGUF ``auto`` (exact Q4_0 repack)
  and ``q8_0``;
* ``exl2``   that GPTQ model converted to EXL2 (``exl2fmt convert --to exl2``) -> GGUF ``f16`` and ``q8_0``.

plus the embedded EXL2 sample (``sample-exl2``: Llama, all six EXL2 widths, a byte-level BPE trained here) ->
``f32``/``f16``/``q8_0``/``q4_0`` and its GPTQ 4-bit twin (``sample-gptq``) -> ``auto``/``q8_0``.

**Oracles.**  llama.cpp evaluates fixed token ids in one batch (F32 KV cache, no flash attention) and returns
every position's logits ``z``.  References, all transformers' float32 forward (eager attention, eager experts):

* ``emul``: the model exl2fmt reads back from the same GGUF (``--to fp16``: config, layout), with every matrix
  replaced by the file's tensor dequantized in float32 by the ``gguf`` package itself (its own name table) - the
  exact weights llama.cpp computes with - and every weight matmul's input converted the way ggml's CPU backend
  converts it for that weight type (``vec_dot_type``: fp16 for F16, Q8_0 for Q8_0 and Q4_0, none for F32).
  Q8_0 activation quantization is so sensitive to its input that even the fp16 rounding of our read-back
  decorrelates an emulation from llama.cpp, hence the file's float32 weights.
* ``held``: transformers on our fp16 read-back as is (no emulation);
* ``src``:  transformers on the source's own FP16 (the dense model, or ``exl2fmt convert SRC DIR --to fp16`` of
  a quantized one), independent of our GGUF reader and writer.

``dz_X = max |z_llama - z_X| / max |z_X|`` over all positions and the whole vocabulary; ``held/src`` is the
same between the two transformers references (the weight rounding of a lossy type, read through our reader).

**Pass rule** (per row, all of):

* llama.cpp loads the file and ``dz_emul <= TOL_EMUL[type]`` (1e-4 F32, 2e-3 F16/BF16, 1e-2 Q8_0/Q4_0): llama.cpp
  computes what transformers computes on the file's weights, given its activation formats;
* every matrix of the file, dequantized by ``gguf``, equals our read-back after rounding to fp16 (``reader``);
* where the conversion report claims every layer and tensor exact, transformers on our read-back gives the
  source's logits to ``TOL_EXACT`` (1e-6; for Gemma, of the source with its norms as the format holds them,
  fp16(w + 1) - 1, as llama.cpp stores them), i.e. the file holds the source's weights.

Together: llama.cpp runs the source's model, up to its own activation rounding, which ``dz_src`` shows (a few
1e-4 for F16, a few 1e-2 for Q8_0 activations; MoE rows more where a rounding flips an expert choice).

``sensitivity`` (reported): ``dz`` of the ``src`` model against the same model with every Q and K projection's
rows in llama.cpp's interleaved rope order (``gguf_map.permute_qk``) - what a Q/K row-order bug of the writer
would do.  A row is *meaningful* when ``sensitivity >= 10 * TOL_EMUL``; the table marks weaker rows.

Expected gaps against ``emul``: F32: summation order only (~1e-6).  F16: fp16 rounding decisions that summation
order flips (~1e-4).  Q8_0/Q4_0: the same for Q8_0 rounding decisions (0 where the dot products are exact
integers in both; ~1e-3 where a repacked kernel sums in another order).  softmax/exp/rsqrt/GELU implementations:
~1e-6.

**Tokenizers.**  For each vocabulary kind (byte-level BPE with the Qwen2 and the Llama 3 split regex; the
SentencePiece vocabularies of the Llama 2, Mistral-with-EOS, Gemma and Phi-3 layouts; the goldens' default
SentencePiece model) llama.cpp's tokenizer (``vocab_only``) must give transformers' ids on the source directory
for a set of texts (ASCII, double/leading spaces, tabs/newlines, accents, CJK and emoji through byte fallback,
special-token strings in text), with and without the special tokens (BOS/EOS as the source adds them); for the
SentencePiece vocabularies also sentencepiece's own ids on the source ``tokenizer.model``; where transformers
and llama.cpp disagree, sentencepiece settles it (transformers' Metaspace layout treats leading and repeated
spaces differently from sentencepiece by design; the row lists those texts).  Where llama.cpp's own converter
wrote a file of the same tiny model and vocabulary (``spec/vectors/gguf/``), llama.cpp must tokenize ours and
that one identically; a disagreement with transformers that llama.cpp's own file shows too is llama.cpp's
tokenizer against transformers' (reported, not a failure of ours).  For the default
``spm`` models, whose ``tokenizer.json`` transformers 5 builds without protobuf holds only the three special
tokens, sentencepiece is the only oracle.  Detokenization is reported, not required (llama.cpp drops the
SentencePiece dummy-prefix space, as sentencepiece does).

Exit status: 0 when every row and every tokenizer case passes, 1 otherwise (2: llama-cpp-python missing).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

#: every architecture of the GGUF bridge, with the tokenizer kind of its golden (bench/gguf_goldens.ARCHS)
ARCH_ORDER = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
              "gemma3_text", "phi3", "cohere", "granite", "starcoder2")
#: (source, GGUF type) per architecture
CASES = (("dense", "f16"), ("dense", "q8_0"), ("gptq", "auto"), ("gptq", "q8_0"), ("exl2", "f16"),
         ("exl2", "q8_0"))
SAMPLE_CASES = (("sample-exl2", "f32"), ("sample-exl2", "f16"), ("sample-exl2", "q8_0"), ("sample-exl2", "q4_0"),
                ("sample-gptq", "auto"), ("sample-gptq", "q8_0"))
#: relative tolerance of llama.cpp against the emulation (the file's exact weights, llama.cpp's activation
#: formats), per GGUF type of the 2-D block weights: F16/BF16 rows differ by summation order (fp16 rounding
#: decisions flip now and then); Q8_0/Q4_0 rows by a few Q8_0 rounding decisions that such last-bit differences
#: flip (each moves one activation by 1/127 of its block's largest value)
TOL_EMUL = {"F32": 1e-4, "F16": 2e-3, "BF16": 2e-3, "Q8_0": 1e-2, "Q4_0": 1e-2}
#: where the converter reports every layer and tensor exact, transformers on our read-back must give the source's
#: logits (Gemma: of the source with its norms as the format holds them, fp16(w + 1) - 1: ``move_norms``)
TOL_EXACT = 1e-6
#: how much the Q/K projections (or their per-head norms) are scaled up (see the module docstring)
SHARPEN = 4.0
QK_NORM_SHARPEN = 2.0
#: token ids fed to every model (all < the tiny vocabularies' 320)
IDS = [1, 17, 250, 99, 3, 212, 77, 140, 5, 301, 33, 128, 200, 2, 64, 19, 300, 45, 7, 260, 88, 150, 11, 299]
SAMPLE_IDS = [1, 17, 250, 999, 3, 512, 77, 640, 5, 901, 33, 128, 700, 2, 64, 400]

TOK_TEXTS = ["Hello world, the quick brown fox.", "  two  spaces\nand a newline 0123 ",
             "Caf\u00e9 na\u00efve d\u00e9j\u00e0 \u6771\u4eac \U0001f600 \u00df", " leading", "\n\nnew\tline",
             "a</s>b<s> c <bos><eos>", "<start_of_turn>user\nhi<end_of_turn>", "x  ", "router gate expert 42",
             "<|im_start|>user\nhello<|im_end|>"]
#: llama.cpp's own converter's file of the same tiny model and vocabulary (spec/vectors/gguf/), per tokenizer case
#: (sp-llama2-eos: the same vocabulary with add_eos_token, so only the ids without special tokens compare)
TOK_GOLDENS = {"bpe-qwen2": "qwen2-f16.gguf", "sp-llama2": "llama-sp-q8_0.gguf", "sp-gemma": "gemma3_text-sp-q8_0.gguf",
               "spm-default": "llama-f16.gguf", "sp-llama2-eos": "llama-sp-q8_0.gguf"}
#: (case name, architecture, tiny_hf tokenizer style, whether transformers' tokenizer of the source is an oracle)
TOK_CASES = (("bpe-qwen2", "qwen2", "bpe", True), ("bpe-llama3", "llama", "llama3", True),
             ("sp-llama2", "llama", "sp-llama2", True), ("sp-llama2-eos", "mistral", "sp-llama2-eos", True),
             ("sp-gemma", "gemma3_text", "sp-gemma", True), ("sp-phi3", "phi3", "sp-phi3", True),
             ("spm-default", "llama", "spm", False))


# ------------------------------------------------------------------------------------------------ models


def sharpen(d: Path, arch: str) -> None:
    """Scale Q/K so that attention rows are peaked (see the module docstring); rewrites model.safetensors."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    gemma = arch.startswith("gemma")
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nq, nk = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    has_qk_norm = any(n.endswith(("q_norm.weight", "k_norm.weight")) for n in t)
    # Granite scales attention scores by attention_multiplier instead of head_dim ** -0.5: sharpen Q and K so the
    # scores reach the same scale as the other architectures'
    sharp = SHARPEN * float(np.sqrt(hd ** -0.5 / cfg["attention_multiplier"])) if cfg.get("attention_multiplier") \
        else SHARPEN
    for n, a in list(t.items()):
        x = a.astype(np.float32)
        if has_qk_norm and n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            # gemma stores w with an implicit +1: scale the effective weight 1 + w
            x = (1.0 + x) * QK_NORM_SHARPEN - 1.0 if gemma else x * QK_NORM_SHARPEN
        elif not has_qk_norm and n.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            x = x * sharp
        elif not has_qk_norm and n.endswith("qkv_proj.weight"):
            x = x.copy()
            x[: nq + nk] *= sharp
        else:
            continue
        t[n] = x.astype(a.dtype)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def _is_router(name: str) -> bool:
    return name.endswith((".gate.weight", "shared_expert_gate.weight"))


def make_gptq(dense: Path, dst: Path, bits: int = 4, group: int = 32) -> Path:
    """RTN GPTQ (symmetric, ``group`` rows per scale) of every 2-D linear weight inside the decoder layers;
    embeddings, lm_head, norms, biases, MoE routers and widths that are not a multiple of 32 stay as they are."""
    from safetensors.numpy import load_file, save_file

    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors

    shutil.copytree(dense, dst)
    t = load_file(str(dense / "model.safetensors"))
    out = {}
    for n, a in t.items():
        # GPTQ packs 8 zeros per int32 and our packer wants 32-column blocks: an odd width (Qwen2-MoE's tiny shared
        # expert, 48) stays FP16, as quantizers leave such layers
        if ".layers." in n and n.endswith(".weight") and a.ndim == 2 and not _is_router(n) \
                and a.shape[1] % group == 0 and a.shape[0] % 32 == 0:
            c, s, z, g = rtn_quantize(a.astype(np.float16), bits, group, sym=True)
            for slot, arr in gptq_layer_tensors(c, s, z, g, bits).items():
                out[f"{n[:-len('.weight')]}.{slot}"] = arr
        else:
            out[n] = a
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True,
                                  "desc_act": False}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file() and not (dst / f).is_file():
            shutil.copy(src / f, dst / f)


def model_dir_name(arch: str) -> str:
    """``tiny-<arch>`` as the goldens' (general.name is derived from it), except Phi-3: llama.cpp's vocabulary
    loader sets token attributes by model *name*, and for a name containing "phi3" requires the published Phi-3
    special tokens (``<|endoftext|>``, ...), which the tiny vocabularies do not have (it throws
    ``unordered_map::at``; llama.cpp's own converter's file of the same model, spec/vectors/gguf/phi3-f16.gguf,
    fails the same way)."""
    return "tiny-p3" if arch == "phi3" else f"tiny-{arch}"


def arch_sources(root: Path, arch: str, sources: list[str], log) -> dict[str, Path | str]:
    """Source directories of ``arch`` (each named ``tiny-<arch>``, as the goldens'); a source the bridge
    refuses is a string (the error)."""
    from gguf_goldens import ARCHS as TOKENIZERS
    from tiny_hf import make_tiny

    from exl2fmt.converters import convert

    out: dict[str, Path | str] = {}
    dense = make_tiny(arch, root / arch / "dense" / model_dir_name(arch), tokenizer=TOKENIZERS[arch])
    sharpen(dense, arch)
    out["dense"] = dense
    if "gptq" in sources or "exl2" in sources:
        try:
            out["gptq"] = make_gptq(dense, root / arch / "gptq" / model_dir_name(arch))
        except Exception as e:  # noqa: BLE001 - reported in the table
            out["gptq"] = f"{type(e).__name__}: {e}"
    if "exl2" in sources:
        if isinstance(out["gptq"], Path):
            e2 = root / arch / "exl2" / model_dir_name(arch)
            try:
                convert(out["gptq"], e2, "exl2")
                _copy_tokenizer(dense, e2)
                out["exl2"] = e2
            except Exception as e:  # noqa: BLE001
                out["exl2"] = f"{type(e).__name__}: {e}"
        else:
            out["exl2"] = "no GPTQ source"
    log(f"{arch}: sources " + ", ".join(f"{k}={'ok' if isinstance(v, Path) else v}" for k, v in out.items()))
    return {k: v for k, v in out.items() if k in sources}


def sample_sources(root: Path) -> dict[str, Path]:
    """The embedded EXL2 sample with a 1000-token byte-level BPE trained here, and its GPTQ 4-bit twin."""
    from exl2fmt.container import write_sharded
    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors
    from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample

    d = root / "sample" / "exl2"
    write_sample(d)
    _train_sample_tokenizer(d, SAMPLE_CONFIG["vocab_size"])
    g = root / "sample" / "gptq"
    g.mkdir(parents=True)
    t = {}
    for n, a in sample_dense_tensors(0).items():
        if n.endswith("_proj.weight"):
            c, s, z, gi = rtn_quantize(a, 4, 32, sym=True)
            for slot, arr in gptq_layer_tensors(c, s, z, gi, 4).items():
                t[f"{n[:-7]}.{slot}"] = arr
        else:
            t[n] = a
    write_sharded(g, t, 1 << 40, metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    (g / "config.json").write_text(json.dumps(dict(SAMPLE_CONFIG, quantization_config=qc)))
    _copy_tokenizer(d, g)
    return {"sample-exl2": d, "sample-gptq": g}


def _train_sample_tokenizer(d: Path, vocab: int) -> None:
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


# ------------------------------------------------------------------------------------------------ runtimes


def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """float32 [len(ids), vocab]"""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


#: the activation format ggml's CPU backend converts a matmul's input to for each weight type (``vec_dot_type``)
VEC_DOT = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q8_0"}


def _quantize_activation(x, kind: str):
    """``x`` (float32 tensor, last dim = the dot product's length) as ggml's CPU backend hands it to the dot
    product of a ``kind`` weight: fp16/bf16 rounding, or Q8_0 (blocks of 32: ``d = amax / 127``, ``q =
    round-half-even(x * 127 / amax)`` as the AVX2 path rounds, stored ``fp16(d)``)."""
    import torch

    if kind == "F16":
        return x.to(torch.float16).to(torch.float32)
    if kind == "BF16":
        return x.to(torch.bfloat16).to(torch.float32)
    if kind == "Q8_0":
        k = x.shape[-1]
        if k % 32:
            return x
        b = x.reshape(*x.shape[:-1], k // 32, 32)
        amax = b.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(b * inv)
        d = (amax / 127.0).to(torch.float16).to(torch.float32)
        return (q * d).reshape(x.shape)
    return x


def load_llama_cpp_weights(model, gguf_path: Path) -> tuple[list[tuple[int, int, str]], dict]:
    """Put into ``model`` (transformers, float32, read back from the same GGUF by exl2fmt) the exact float32
    values llama.cpp computes with: every matrix parameter is replaced by its GGUF tensor dequantized with the
    ``gguf`` package's own ``quants.dequantize`` (names from the ``gguf`` package's table, not exl2fmt's; Q/K
    rows un-permuted where the file holds llama.cpp's interleaved order; transformers' fused expert
    ``gate_up_proj`` = the stacked gate and up experts).  Our reader's fp16 read-back rounds Q8_0's ``d * q``
    once more, and Q8_0 activation quantization is so sensitive to its input that such a rounding alone
    decorrelates an emulation from llama.cpp.

    Returns ``(spans, check)``: spans = (first byte address, end address, ggml type) of every replaced
    parameter (``emulated_logits`` picks each matmul's activation format from it); check = how many parameters
    were replaced, how many of them equal exl2fmt's read-back after rounding to fp16 (an independent check of
    our GGUF reader), which needed un-permuting, and which had no GGUF tensor."""
    import gguf
    import torch

    from exl2fmt.converters.gguf_map import unpermute_qk

    r = gguf.GGUFReader(str(gguf_path))
    tens = {t.name: t for t in r.tensors}
    arch = bytes(r.get_field("general.architecture").parts[-1]).decode()
    aid = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    cfg = model.config
    tmap = gguf.get_tensor_name_map(aid, cfg.num_hidden_layers)

    def deq(name: str) -> np.ndarray:
        t = tens[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    spans, check = [], {"replaced": 0, "equal_to_read_back": 0, "unpermuted": [], "missing": []}
    for pn, p in model.named_parameters():
        if p.ndim < 2:
            continue
        if pn == "lm_head.weight" or pn.endswith(".lm_head.weight"):
            names = ["output.weight" if "output.weight" in tens else "token_embd.weight"]
        elif ".experts." in pn:
            li = int(pn.split(".layers.")[1].split(".")[0])
            names = ([f"blk.{li}.ffn_down_exps.weight"] if pn.endswith("down_proj") else
                     [f"blk.{li}.ffn_gate_exps.weight", f"blk.{li}.ffn_up_exps.weight"])
        else:
            names = [tmap.get_name(pn, try_suffixes=(".weight", ".bias"))]
        if not all(n in tens for n in names):
            check["missing"].append(pn)
            continue
        a = np.concatenate([deq(n) for n in names], axis=-2) if len(names) > 1 else deq(names[0])
        held = p.detach().numpy()
        if a.shape != held.shape:
            check["missing"].append(f"{pn} (shape {a.shape} vs {held.shape})")
            continue

        def same(x):
            return np.array_equal(x.astype(np.float16), held.astype(np.float16))

        if not same(a) and (".q_proj." in pn or ".k_proj." in pn):
            heads = cfg.num_attention_heads if ".q_proj." in pn else cfg.num_key_value_heads
            u = unpermute_qk(a, heads)
            if same(u):
                a = u
                check["unpermuted"].append(pn)
        check["replaced"] += 1
        check["equal_to_read_back"] += int(same(a))
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.array(a, dtype=np.float32)))
        kind = tens[names[0]].tensor_type.name
        lo = p.data_ptr()
        spans.append((lo, lo + p.numel() * p.element_size(), kind))
    return spans, check


def emulated_logits(model, ids: list[int], spans: list[tuple[int, int, str]]) -> np.ndarray:
    """transformers' float32 forward with each weight matmul's input converted as llama.cpp's CPU backend does
    (``VEC_DOT`` of the weight's GGUF type; weights and everything else untouched).  Patches
    ``torch.nn.functional.linear`` (nn.Linear and transformers' eager expert loops both call it) for the call."""
    import torch

    orig = torch.nn.functional.linear

    def linear(x, w, b=None):
        a = w.data_ptr()
        kind = next((t for lo, hi, t in spans if lo <= a < hi), "F32")
        return orig(_quantize_activation(x, VEC_DOT.get(kind, "F32")), w, b)

    def gelu_table(x):  # ggml's GGML_GELU_FP16: the tanh GELU looked up per fp16 input, an fp16 result
        y = torch.nn.functional.gelu(x.to(torch.float16).to(torch.float32), approximate="tanh")
        y = y.to(torch.float16).to(torch.float32)
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))

    gelus = [m for m in model.modules() if type(m).__name__ in ("GELUTanh", "PytorchGELUTanh")]
    saved = [m.act for m in gelus]
    torch.nn.functional.linear = linear
    for m in gelus:
        m.act = gelu_table
    try:
        return hf_logits(model, ids)
    finally:
        torch.nn.functional.linear = orig
        for m, a in zip(gelus, saved):
            m.act = a


def move_norms(model):
    """``model`` itself, or (architectures whose GGUF norms carry an offset: Gemma's +1) a copy whose norm weights
    are what the format holds: ``fp16(fp16(w + 1) - 1)``, as llama.cpp adds the offset in the source dtype."""
    import copy

    import torch

    from exl2fmt.converters.gguf_arch import SPECS

    off = SPECS[model.config.model_type].norm_offset
    if not off:
        return model
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                v = p.detach().numpy().astype(np.float16).astype(np.float32)
                moved = ((v + off).astype(np.float16).astype(np.float32) - off).astype(np.float16)
                p.copy_(torch.from_numpy(moved.astype(np.float32)))
    return m


def qk_permuted_logits(model, ids: list[int]) -> np.ndarray:
    """The logits of ``model`` with every Q and K projection's rows (weights and biases; Phi-3: the Q and K
    parts of qkv_proj) in llama.cpp's interleaved rope order: the effect of a Q/K row-order bug."""
    import copy

    import torch

    from exl2fmt.converters.gguf_map import permute_qk

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            a = p.detach().numpy()
            if ".q_proj." in n:
                p.copy_(torch.from_numpy(permute_qk(a, nh)))
            elif ".k_proj." in n:
                p.copy_(torch.from_numpy(permute_qk(a, nkv)))
            elif n.endswith("qkv_proj.weight"):
                b = a.copy()
                b[: nh * hd] = permute_qk(a[: nh * hd], nh)
                b[nh * hd: (nh + nkv) * hd] = permute_qk(a[nh * hd: (nh + nkv) * hd], nkv)
                p.copy_(torch.from_numpy(b))
    return hf_logits(m, ids)


def llama_logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits of every position, float32 [len(ids), vocab]: F32 KV cache (the default F16 cache
    adds its own rounding), no flash attention, one batch."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2,
                verbose=False, seed=0, type_k=0, type_v=0, flash_attn=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def weight_type(gguf_path: Path) -> str:
    """The ggml type of the 2-D block weights (the most common one among ``blk.*`` tensors of rank >= 2)."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        if t.name.startswith("blk.") and len(t.shape) >= 2 and "gate_inp" not in t.name:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return max(counts, key=counts.get) if counts else "?"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# ------------------------------------------------------------------------------------------------ checks


def logit_rows(root: Path, archs: list[str], sources: list[str], use_llama: bool, sample: bool, log) -> list[dict]:
    from exl2fmt.converters import convert

    rows = []
    groups: list[tuple[str, dict, tuple, list[int]]] = []
    for arch in archs:
        srcs = arch_sources(root, arch, sources, log)
        groups.append((arch, srcs, tuple(c for c in CASES if c[0] in sources), IDS))
    if sample:
        groups.append(("sample", sample_sources(root), SAMPLE_CASES, SAMPLE_IDS))
    for arch, srcs, cases, ids in groups:
        src_ref: dict[str, tuple[np.ndarray, float]] = {}
        for src, typ in cases:
            row = {"arch": arch, "source": src, "gguf_type": typ}
            s = srcs.get(src)
            if not isinstance(s, Path):
                row.update(status="refused", reason=str(s))
                rows.append(row)
                log(json.dumps(row))
                continue
            tag = f"{arch}-{src}-{typ}"
            g = root / "gguf" / f"{tag}.gguf"
            g.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            try:
                rep = convert(s, g, "gguf", gguf_type=typ)
            except Exception as e:  # noqa: BLE001 - a refusal of the bridge is a table row
                row.update(status="refused", reason=f"{type(e).__name__}: {e}")
                rows.append(row)
                log(json.dumps(row))
                continue
            summ = rep.summary()
            claimed_exact = all(x.exact for x in rep.layers) and all(x.exact for x in rep.tensors)
            row.update(convert_s=round(time.perf_counter() - t0, 2), weights=weight_type(g),
                       exact_layers=f"{summ['exact_layers']}/{summ['layers']}", bytes=rep.bytes_written)
            if src not in src_ref:
                if src == "dense":
                    fp = s
                else:
                    fp = root / arch / f"{src}-fp16" / model_dir_name(arch)
                    convert(s, fp, "fp16")
                m = hf_model(fp)
                z = hf_logits(m, ids)
                sens_src = rel(qk_permuted_logits(m, ids), z)
                src_ref[src] = (z, sens_src, hf_logits(move_norms(m), ids))
                del m
            z_src, sens, z_src_fmt = src_ref[src]
            back = root / "back" / tag
            convert(g, back, "fp16")
            m_held = hf_model(back)
            z_held = hf_logits(m_held, ids)
            spans, wcheck = load_llama_cpp_weights(m_held, g)
            z_emul = emulated_logits(m_held, ids, spans)
            del m_held
            row["reader_check"] = f"{wcheck['equal_to_read_back']}/{wcheck['replaced']}"
            if wcheck["missing"]:
                row["reader_missing"] = wcheck["missing"]
            row.update(logit_scale=round(float(np.abs(z_src).max()), 4), sensitivity=round(sens, 4),
                       dz_held_vs_src=round(rel(z_held, z_src), 7), dz_emul_vs_held=round(rel(z_emul, z_held), 6),
                       dz_held_vs_src_fmt=round(rel(z_held, z_src_fmt), 7))
            if use_llama:
                try:
                    z = llama_logits(g, ids)
                except Exception as e:  # noqa: BLE001 - llama.cpp refusing our file is a finding
                    row.update(status="FAIL", reason=f"llama.cpp: {type(e).__name__}: {e}")
                    rows.append(row)
                    log(json.dumps(row))
                    continue
                if z.shape != z_src.shape:
                    row.update(status="FAIL", reason=f"llama.cpp logits {z.shape} vs {z_src.shape}")
                else:
                    wt = row["weights"]
                    te = TOL_EMUL.get(wt, 1e-2)
                    de, dh, ds = rel(z, z_emul), rel(z, z_held), rel(z, z_src)
                    problems = []
                    if de > te:
                        problems.append(f"dz_emul {de:.2e} > {te:.0e}")
                    if wcheck["equal_to_read_back"] != wcheck["replaced"] or wcheck["missing"]:
                        problems.append("gguf's dequantize differs from our read-back")
                    if claimed_exact and row["dz_held_vs_src_fmt"] > TOL_EXACT:
                        problems.append(f"claimed exact but read-back gives {row['dz_held_vs_src_fmt']:.2e} off "
                                        "the source")
                    row.update(dz_emul=round(de, 7), dz_held=round(dh, 6), dz_src=round(ds, 6), tol_emul=te,
                               claimed_exact=claimed_exact,
                               argmax_agree=f"{int((z.argmax(-1) == z_src.argmax(-1)).sum())}/{len(ids)}",
                               status="FAIL" if problems else "pass", meaningful=sens >= 10 * te)
                    if problems:
                        row["reason"] = "; ".join(problems)
            else:
                row["status"] = "transformers-only"
            rows.append(row)
            log(json.dumps(row))
    return rows


def tokenizer_rows(root: Path, use_llama: bool, log) -> list[dict]:
    import sentencepiece
    from tiny_hf import make_tiny
    from transformers import AutoTokenizer

    from exl2fmt.converters import convert

    rows = []
    for name, arch, style, hf_oracle in TOK_CASES:
        d = make_tiny(arch, root / "tok" / name / model_dir_name(arch), tokenizer=style)
        g = root / "tok" / f"{name}.gguf"
        convert(d, g, "gguf", gguf_type="f16")
        hf = AutoTokenizer.from_pretrained(str(d)) if hf_oracle else None
        sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model")) \
            if (d / "tokenizer.model").is_file() else None
        row = {"case": name, "arch": arch, "texts": len(TOK_TEXTS)}
        if not use_llama:
            row["status"] = "transformers-only"
            rows.append(row)
            log(json.dumps(row))
            continue
        from llama_cpp import Llama

        llm = Llama(model_path=str(g), vocab_only=True, verbose=False)
        gold_p = ROOT / "spec" / "vectors" / "gguf" / TOK_GOLDENS.get(name, "-")
        gold = Llama(model_path=str(gold_p), vocab_only=True, verbose=False) if gold_p.is_file() else None
        bad, bad_sp, settled, detok_diff, gold_diff = [], [], [], 0, 0
        for t in TOK_TEXTS:
            # special=True: special-token strings in the text become their ids, as transformers splits them
            plain = llm.tokenize(t.encode(), add_bos=False, special=True)
            full = llm.tokenize(t.encode(), add_bos=True, special=True)
            if hf is not None:
                want_plain = hf(t, add_special_tokens=False)["input_ids"]
                want_full = hf(t)["input_ids"]
                if plain != want_plain or full != want_full:
                    # sentencepiece itself (the vocabulary's reference implementation) settles a disagreement:
                    # transformers' Metaspace layout splits leading / repeated spaces differently by design
                    if sp is not None and plain == sp.encode(t):
                        settled.append(t)
                    else:
                        bad.append({"text": t, "llama.cpp": [plain, full], "transformers": [want_plain, want_full]})
            # sentencepiece: texts without special-token strings or a leading space (there transformers'
            # Metaspace layout and sentencepiece differ by design: tests/test_gguf_arch.py)
            if sp is not None and "<" not in t and not t.startswith(" "):
                if plain != sp.encode(t):
                    bad_sp.append({"text": t, "llama.cpp": plain, "sentencepiece": sp.encode(t)})
            if gold is not None and (gold.tokenize(t.encode(), add_bos=False, special=True) != plain
                                     or (name != "sp-llama2-eos"
                                         and gold.tokenize(t.encode(), add_bos=True, special=True) != full)):
                gold_diff += 1
            if llm.detokenize(plain).decode("utf-8", errors="replace") != t:
                detok_diff += 1
        llm.close()
        if gold is not None:
            gold.close()
        row.update(transformers_mismatches=len(bad) if hf is not None else None,
                   transformers_differs_where_sentencepiece_agrees_with_llama_cpp=settled,
                   sentencepiece_mismatches=len(bad_sp) if sp is not None else None,
                   llama_cpp_converter_file=gold_p.name if gold is not None else None,
                   differs_from_llama_cpp_converter_file=gold_diff if gold is not None else None,
                   detokenize_differs=detok_diff)
        # a disagreement with transformers that llama.cpp's own converter's file shows too is llama.cpp's
        # tokenizer against transformers', not our file: reported as such, not a failure of ours
        ours = bool(bad_sp) or gold_diff > 0 or (bad and gold is None)
        row["status"] = "FAIL" if ours else ("llama.cpp != transformers (same with llama.cpp's own file)" if bad
                                             else "pass")
        if bad or bad_sp:
            row["first_mismatch"] = (bad or bad_sp)[0]
        rows.append(row)
        log(json.dumps(row, ensure_ascii=False))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(ARCH_ORDER), help="comma list of architectures (default: all)")
    ap.add_argument("--sources", default="dense,gptq,exl2", help="comma list of dense, gptq, exl2")
    ap.add_argument("--no-sample", action="store_true", help="skip the embedded EXL2 sample rows")
    ap.add_argument("--no-tokenizers", action="store_true", help="skip the tokenizer check")
    ap.add_argument("--no-llama", action="store_true", help="transformers side only (checks this script)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    use_llama = not a.no_llama
    if use_llama:
        try:
            import llama_cpp
        except ImportError as e:
            print(f"llama-cpp-python is not importable ({e}); --no-llama runs the transformers side", file=sys.stderr)
            return 2
    archs = [x for x in a.arch.split(",") if x]
    unknown = [x for x in archs if x not in ARCH_ORDER]
    if unknown:
        ap.error(f"unknown architecture(s) {unknown}; known: {', '.join(ARCH_ORDER)}")
    sources = [x for x in a.sources.split(",") if x]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="exl2fmt-llamacpp-") as tmp:
        root = Path(tmp)
        rows = logit_rows(root, archs, sources, use_llama, not a.no_sample, log)
        toks = [] if a.no_tokenizers else tokenizer_rows(root, use_llama, log)
    res = {"machine": platform.machine(), "python": sys.version.split()[0],
           "llama_cpp": llama_cpp.__version__ if use_llama else None, "tol_emul": TOL_EMUL, "tol_exact": TOL_EXACT,
           "wall_s": round(time.perf_counter() - t0, 1), "logits": rows, "tokenizers": toks}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    print(f"{'arch':12} {'source':12} {'type':5} {'weights':7} {'exact':7} {'reader':7} {'dz_emul':>9} {'dz_held':>9} "
          f"{'dz_src':>9} {'held/src':>9} {'sens':>6} {'argmax':>6}  status")
    nan = float("nan")
    for r in rows:
        print(f"{r['arch']:12} {r['source']:12} {r['gguf_type']:5} {r.get('weights', '-'):7} "
              f"{r.get('exact_layers', '-'):7} {r.get('reader_check', '-'):7} {r.get('dz_emul', nan):9.2e} "
              f"{r.get('dz_held', nan):9.2e} {r.get('dz_src', nan):9.2e} {r.get('dz_held_vs_src', nan):9.2e} "
              f"{r.get('sensitivity', nan):6.3f} {r.get('argmax_agree', '-'):>6}  {r['status']}"
              f"{'' if r.get('meaningful', True) else ' (weak)'}{'  ' + r['reason'][:160] if r.get('reason') else ''}")
    for r in toks:
        print(f"tokenizer {r['case']:14} {r['status']}  transformers mismatches {r.get('transformers_mismatches')}"
              f", sentencepiece mismatches {r.get('sentencepiece_mismatches')}, detokenize differs "
              f"{r.get('detokenize_differs')}/{r['texts']}; transformers differs where sentencepiece agrees with "
              f"llama.cpp: {r.get('transformers_differs_where_sentencepiece_agrees_with_llama_cpp')}; ids differ from "
              f"llama.cpp's converter's file {r.get('llama_cpp_converter_file')}: "
              f"{r.get('differs_from_llama_cpp_converter_file')}")
    ok = all(r["status"] != "FAIL" and r["status"] != "refused" for r in rows + toks)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
