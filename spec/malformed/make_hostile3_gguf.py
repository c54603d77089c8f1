#!/usr/bin/env python3
"""Generate the GGUF -> HF hostile catalogue of issue 41 (classes 7, 13, 14): ``spec/malformed/hostile3_gguf/``.

    python spec/malformed/make_hostile3_gguf.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile3_gguf.py OUT_DIR    # write it somewhere else (tests compare the bytes)

Files are written by the ``gguf`` package's own ``GGUFWriter`` (the writer llama.cpp's converter uses), so every
case is a well-formed GGUF whose *content* is hostile: the bounded reader accepts it and the converter has to
apply the rules itself.  Deterministic: values from ``sin``, no clocks or randomness.

* ``t_*`` tokenizer metadata of the wrong type, or a vocabulary the ``tokenizers`` library cannot load
  (token_type shorter than the tokens, malformed / out-of-vocabulary merges, duplicate tokens):
  ``GGUF_METADATA_INVALID`` naming the key, before anything is written;
* ``w_*`` weights: non-finite block scales (Q8_0, Q4_0), an infinite F16 value, a finite value past the F16
  range: ``NONFINITE_VALUES`` naming the tensor (``--to bf16`` converts the last one);
* ``e_*`` experts: a stacked expert tensor or router whose expert dimension disagrees with ``expert_count``,
  an ``expert_used_count`` above the expert count, expert tensors without a count: ``GGUF_METADATA_INVALID``
  (the 300 000-expert tensor is written at test time: ``big_expert_case``);
* ``x_*`` command line: GGUF -> GGUF is a usage error naming the route; a missing ``.gguf`` source is
  ``PATH_NOT_FOUND`` about a GGUF file;
* ``ok_*`` the valid base model (a 1-block llama with a byte-level BPE vocabulary whose ``pre`` is ``smollm``,
  padding / unknown ids, flags and a chat template): converts, and keeps its tokenizer metadata through
  GGUF -> HF -> GGUF (``tests/test_hostile3_gguf.py``).

``index.json``: ``{"path", "class", "description", "runs": [{"args", "code", "exit"}]}`` as in the other
catalogues (``{case}`` = the case's path, ``{out}`` = a fresh output path).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "hostile3_gguf"

W, FF, HEADS = 32, 64, 2
#: a byte-level BPE vocabulary: ids 0-2 control tokens, then pieces whose merges are all in the vocabulary
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "d", "\u0120", "ab", "abc", "\u0120a",
          "\u0120ab", "cd", "0", "1", "2"]
TYPES = [3, 3, 3] + [1] * (len(TOKENS) - 3)
MERGES = ["a b", "ab c", "\u0120 a", "\u0120a b", "c d"]
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _vals(n: int, scale: float = 0.05, phase: float = 0.0) -> np.ndarray:
    return (np.sin(np.arange(n, dtype=np.float64) * 0.37 + phase) * scale).astype(np.float32)


def base_kvs(arch: str = "llama") -> dict:
    """key -> (value, GGUFValueType name, array element type name or None) of the valid base model."""
    a = arch
    return {
        f"{a}.block_count": (1, "UINT32", None), f"{a}.context_length": (128, "UINT32", None),
        f"{a}.embedding_length": (W, "UINT32", None), f"{a}.feed_forward_length": (FF, "UINT32", None),
        f"{a}.attention.head_count": (HEADS, "UINT32", None), f"{a}.attention.head_count_kv": (HEADS, "UINT32", None),
        f"{a}.rope.freq_base": (10000.0, "FLOAT32", None),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32", None),
        "tokenizer.ggml.model": ("gpt2", "STRING", None), "tokenizer.ggml.pre": ("smollm", "STRING", None),
        "tokenizer.ggml.tokens": (TOKENS, "ARRAY", "STRING"), "tokenizer.ggml.token_type": (TYPES, "ARRAY", "INT32"),
        "tokenizer.ggml.merges": (MERGES, "ARRAY", "STRING"),
        "tokenizer.ggml.bos_token_id": (1, "UINT32", None), "tokenizer.ggml.eos_token_id": (2, "UINT32", None),
        "tokenizer.ggml.unknown_token_id": (0, "UINT32", None), "tokenizer.ggml.padding_token_id": (2, "UINT32", None),
        "tokenizer.ggml.add_bos_token": (False, "BOOL", None), "tokenizer.chat_template": (CHAT, "STRING", None),
    }


def base_tensors(vocab: int = len(TOKENS), experts: int = 0) -> list[tuple[str, np.ndarray, str]]:
    """(GGUF name, data in numpy order, ggml type name) of the base model: F32 norms, F16 weights."""
    def f16(shape, phase):
        return _vals(int(np.prod(shape)), phase=phase).reshape(shape).astype(np.float16)

    out = [("token_embd.weight", f16((vocab, W), 0.1), "F16"), ("output_norm.weight", np.ones(W, np.float32), "F32"),
           ("blk.0.attn_norm.weight", np.ones(W, np.float32), "F32"),
           ("blk.0.ffn_norm.weight", np.ones(W, np.float32), "F32")]
    for i, n in enumerate(("attn_q", "attn_k", "attn_v", "attn_output")):
        out.append((f"blk.0.{n}.weight", f16((W, W), 1.0 + i), "F16"))
    if experts:
        out.append(("blk.0.ffn_gate_inp.weight", _vals(experts * W, phase=7.0).reshape(experts, W), "F32"))
        for i, n in enumerate(("ffn_gate_exps", "ffn_up_exps")):
            out.append((f"blk.0.{n}.weight", f16((experts, FF, W), 5.0 + i), "F16"))
        out.append(("blk.0.ffn_down_exps.weight", f16((experts, W, FF), 9.0), "F16"))
    else:
        out += [("blk.0.ffn_gate.weight", f16((FF, W), 5.0), "F16"), ("blk.0.ffn_up.weight", f16((FF, W), 6.0), "F16"),
                ("blk.0.ffn_down.weight", f16((W, FF), 9.0), "F16")]
    return out


def write_gguf(path: Path, kvs: dict, tensors: list, arch: str = "llama") -> None:
    """A GGUF written by ``gguf.GGUFWriter``: ``kvs`` as ``base_kvs`` returns them (None values are left out),
    ``tensors`` as ``base_tensors`` (quantized types as raw uint8 byte rows)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kvs.items():
        if v is None:
            continue
        val, vt, sub = v
        w.add_key_value(k, val, gguf.GGUFValueType[vt], None if sub is None else gguf.GGUFValueType[sub])
    for name, data, gt in tensors:
        qt = gguf.GGMLQuantizationType[gt]
        if gt in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quant(values: np.ndarray, gt: str) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[gt])


def _with_tensor(name: str, data: np.ndarray, gt: str, **kw) -> list:
    return [(n, data, gt) if n == name else (n, d, t) for n, d, t in base_tensors(**kw)]


def _kv(**changes) -> dict:
    kv = base_kvs()
    for k, v in changes.items():
        kv[k.replace("__", ".")] = v
    return kv


def tokenizer_defects() -> dict[str, tuple[dict, str]]:
    """name -> (key changes for ``base_kvs``, what is wrong): the tokenizer cases, also applied at test time to
    the goldens of other architectures."""
    n = len(TOKENS)
    return {
        "t_tokens_scalar": ({"tokenizer.ggml.tokens": ("abc", "STRING", None)}, "tokenizer.ggml.tokens is one string"),
        "t_merges_ints": ({"tokenizer.ggml.merges": ([1, 2, 3], "ARRAY", "INT32")}, "merges are integers"),
        "t_pre_array": ({"tokenizer.ggml.pre": (["smollm"], "ARRAY", "STRING")}, "pre is an array"),
        "t_token_type_floats": ({"tokenizer.ggml.token_type": ([1.0] * n, "ARRAY", "FLOAT32")},
                                "token_type holds floats"),
        "t_token_type_short": ({"tokenizer.ggml.token_type": (TYPES[:-3], "ARRAY", "INT32")},
                               "token_type is 3 entries shorter than the tokens"),
        "t_token_type_99": ({"tokenizer.ggml.token_type": (TYPES[:-1] + [99], "ARRAY", "INT32")},
                            "a token type of 99"),
        "t_scores_strings": ({"tokenizer.ggml.scores": (["x"] * n, "ARRAY", "STRING")}, "scores are strings"),
        "t_scores_long": ({"tokenizer.ggml.scores": ([0.0] * (n + 1), "ARRAY", "FLOAT32")},
                          "one more score than tokens"),
        "t_merge_no_space": ({"tokenizer.ggml.merges": (MERGES + ["abcd"], "ARRAY", "STRING")},
                             "a merge without a space"),
        "t_merge_oov": ({"tokenizer.ggml.merges": (MERGES + ["d a"], "ARRAY", "STRING")},
                        "a merge whose result 'da' is not a token"),
        "t_tokens_duplicate": ({"tokenizer.ggml.tokens": (TOKENS[:-1] + ["a"], "ARRAY", "STRING")},
                               "the last token repeats 'a'"),
        "t_bos_id_string": ({"tokenizer.ggml.bos_token_id": ("1", "STRING", None)}, "the BOS id is a string"),
        "t_add_bos_int": ({"tokenizer.ggml.add_bos_token": (1, "INT32", None)}, "add_bos_token is an integer"),
        "t_chat_template_array": ({"tokenizer.chat_template": (["x"], "ARRAY", "STRING")},
                                  "the chat template is an array"),
        "t_model_int": ({"tokenizer.ggml.model": (2, "UINT32", None)}, "tokenizer.ggml.model is an integer"),
    }


class Catalogue:
    def __init__(self, out: Path):
        self.out = out
        self.entries: list[dict] = []

    def add(self, name: str, kvs: dict, tensors: list, cls: int, description: str, runs: list) -> None:
        write_gguf(self.out / name, kvs, tensors)
        self.entries.append({"path": name, "class": cls, "description": description,
                             "runs": [{"args": a, "code": c, "exit": e} for a, c, e in runs]})


FP16 = ["convert", "{case}", "{out}", "--to", "fp16"]


def big_expert_case(path: Path, experts: int = 300_000) -> None:
    """A Mixtral-style GGUF whose stacked expert tensors claim ``experts`` experts of one 32-wide row each (Q4_0,
    18 bytes an expert) while ``expert_count`` says 4: before the check, 300k output tensors (80 s, 1.2 GB)."""
    kv = base_kvs()
    kv["llama.expert_count"] = (4, "UINT32", None)
    kv["llama.expert_used_count"] = (2, "UINT32", None)
    kv["llama.feed_forward_length"] = (1, "UINT32", None)
    t = [x for x in base_tensors() if "ffn_" not in x[0] or "norm" in x[0]]
    # every expert holds the same constant blocks: quantize one expert and repeat its bytes (quantizing all
    # 300k x 32 x 32 values took over a minute)
    one = np.tile(_quant(np.full((1, 1, W), 0.25, np.float32), "Q4_0"), (experts, 1, 1))
    t.append(("blk.0.ffn_gate_inp.weight", np.zeros((4, W), np.float32), "F32"))
    t += [("blk.0.ffn_gate_exps.weight", one, "Q4_0"), ("blk.0.ffn_up_exps.weight", one, "Q4_0")]
    down = np.tile(_quant(np.full((1, W, 32), 0.25, np.float32), "Q4_0"), (experts, 1, 1))
    t.append(("blk.0.ffn_down_exps.weight", down, "Q4_0"))
    write_gguf(path, kv, t)


def generate(out: str | Path = OUT) -> list[dict]:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Catalogue(out)
    c.add("ok_base.gguf", base_kvs(), base_tensors(), 13,
          "the valid base model (pre smollm, pad / unk ids, add_bos false, chat template): converts; the test "
          "round-trips its tokenizer metadata", [(FP16, None, 0)])
    for name, (changes, what) in tokenizer_defects().items():
        c.add(f"{name}.gguf", _kv(**changes), base_tensors(), 7, f"{what}: refused before anything is written",
              [(FP16, "GGUF_METADATA_INVALID", 1)])

    # weights: non-finite decodes, and a finite value F16 cannot hold
    q8 = _quant(_vals(W * W).reshape(W, W), "Q8_0")
    q8[3, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # row 3's block scale d = NaN
    c.add("w_q8_0_scale_nan.gguf", base_kvs(), _with_tensor("blk.0.attn_q.weight", q8, "Q8_0"), 7,
          "a Q8_0 block scale is NaN", [(FP16, "NONFINITE_VALUES", 1), (FP16[:-1] + ["bf16"], "NONFINITE_VALUES", 1)])
    q4 = _quant(_vals(FF * W).reshape(FF, W), "Q4_0")
    q4[10, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    c.add("w_q4_0_scale_inf.gguf", base_kvs(), _with_tensor("blk.0.ffn_up.weight", q4, "Q4_0"), 7,
          "a Q4_0 block scale is +Inf", [(FP16, "NONFINITE_VALUES", 1)])
    f = _vals(W * W, phase=2.0).reshape(W, W).astype(np.float16)
    f[5, 7] = -np.inf
    c.add("w_f16_inf.gguf", base_kvs(), _with_tensor("blk.0.attn_v.weight", f, "F16"), 7,
          "an F16 weight is -Inf", [(FP16, "NONFINITE_VALUES", 1)])
    big = np.ones(W, np.float32)
    big[4] = 1e6
    c.add("w_f32_past_f16.gguf", base_kvs(), _with_tensor("output_norm.weight", big, "F32"), 7,
          "a finite F32 norm value of 1e6, past the F16 range: refused for fp16 (it would be Inf), converts to bf16",
          [(FP16, "NONFINITE_VALUES", 1), (FP16[:-1] + ["bf16"], None, 0)])

    # experts
    def moe(count, used=2, **over):
        kv = base_kvs()
        kv["llama.expert_count"] = None if count is None else (count, "UINT32", None)
        kv["llama.expert_used_count"] = None if used is None else (used, "UINT32", None)
        kv.update(over)
        return kv

    c.add("ok_moe.gguf", moe(4), base_tensors(experts=4), 7, "a valid 4-expert Mixtral-style model: converts",
          [(FP16, None, 0)])
    c.add("e_count_lies_8.gguf", moe(8), base_tensors(experts=4), 7,
          "expert_count 8, the tensors hold 4 experts (would be written into config.json)",
          [(FP16, "GGUF_METADATA_INVALID", 1)])
    c.add("e_count_lies_2.gguf", moe(2, used=1), base_tensors(experts=4), 7,
          "expert_count 2, the tensors hold 4 experts", [(FP16, "GGUF_METADATA_INVALID", 1)])
    c.add("e_used_99.gguf", moe(4, used=99), base_tensors(experts=4), 7,
          "expert_used_count 99 of 4 experts", [(FP16, "GGUF_METADATA_INVALID", 1)])
    c.add("e_used_0.gguf", moe(4, used=0), base_tensors(experts=4), 7,
          "expert_used_count 0", [(FP16, "GGUF_METADATA_INVALID", 1)])
    c.add("e_count_missing.gguf", moe(None, used=None), base_tensors(experts=4), 7,
          "stacked expert tensors but no expert_count", [(FP16, "GGUF_METADATA_INVALID", 1)])
    t = [(n, (d[:3] if n == "blk.0.ffn_gate_inp.weight" else d), g) for n, d, g in base_tensors(experts=4)]
    c.add("e_router_rows_3.gguf", moe(4), t, 7, "the router has 3 rows for 4 experts",
          [(FP16, "GGUF_METADATA_INVALID", 1)])

    # command line (class 14)
    c.add("x_gguf_to_gguf.gguf", base_kvs(), base_tensors(), 14,
          "GGUF -> GGUF: a usage error naming the route (llama-quantize, or through --to fp16)",
          [(["convert", "{case}", "{out}.gguf", "--to", "gguf"], "USAGE", 2),
           (["convert", "{case}", "{out}.gguf"], "USAGE", 2),
           (["convert", "{case}.missing.gguf", "{out}", "--to", "fp16"], "PATH_NOT_FOUND", 3)])

    c.entries.sort(key=lambda e: e["path"])
    (out / "index.json").write_text(json.dumps(c.entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    rows = "\n".join(f"| `{e['path']}` | {e['class']} | {e['description']} | "
                     + "; ".join(f"`{' '.join(r['args'][:1] + r['args'][3:])}` {r['code'] or 'ok'} ({r['exit']})"
                                 for r in e["runs"]) + " |" for e in c.entries)
    (out / "README.md").write_text(README + rows + "\n", encoding="utf-8")
    return c.entries


README = """# Hostile catalogue, issue 41 classes 7, 13 and 14 (GGUF -> HF)

Generated by `../make_hostile3_gguf.py` with the `gguf` package's `GGUFWriter` (deterministic; edit the
generator, not the files). `index.json` lists each case as the other catalogues do; `tests/test_hostile3_gguf.py`
runs every run in a fresh process under `tests/hostile_harness.run_bounded` (10 s, 1 GB, no traceback),
checks that a refused run leaves no output, applies the tokenizer defects to llama.cpp-written goldens of other
architectures (`spec/vectors/gguf/`), writes the 300 000-expert case at test time, and round-trips the base
model's tokenizer metadata (GGUF -> HF -> GGUF).

## Cases

| case | class | what is wrong | commands (code, exit) |
|---|---|---|---|
"""


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else OUT
    entries = generate(out)
    print(f"wrote {len(entries)} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
