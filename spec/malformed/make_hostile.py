#!/usr/bin/env python3
"""Generate the hostile-input catalogue of issue 11, classes 1-4: ``spec/malformed/hostile/`` + ``index.json``.

    python spec/malformed/make_hostile.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile.py OUT_DIR    # write it somewhere else (tests compare the bytes)

Deterministic (no clocks, no OS randomness; arrays from make_malformed's fixed integer hash), standard
library + NumPy + exl2fmt.  GGUF files are hand-built bytes (``gguf_bytes`` below), not written by the
``gguf`` package, so the catalogue does not depend on a writer being right.

Classes (the prefix of every case name):

* ``c1_`` work that must stay linear: indexes with thousands of missing shards / tensors, thousands of bad
  names - output capped ("... and M more").  Cases whose point is size (100k entries, 10**6-element GGUF
  arrays) are not stored: ``big_cases(tmp)`` writes them at test time;
* ``c2_`` counts in GGUF metadata: a huge ``block_count`` / heads / experts, arrays and strings whose
  declared length the file cannot hold, too many keys, nesting too deep;
* ``c3_`` odd numbers in ``config.json`` / ``quantization_config`` (0, negative, 10**30, NaN, Infinity,
  booleans) and layers with zero rows or columns;
* ``c4_`` one rule set: layers that ``validate --deep`` rejects must be refused by ``dequantize`` and
  ``convert`` too, with the same code.

``index.json``: a list of ``{"path", "class", "description", "runs": [{"args", "code", "exit"}]}``; in
``args`` ``{case}`` is the case's path and ``{out}`` a fresh output path; ``code`` (or null) must appear in
the output, ``exit`` is the exit status.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_malformed import dense_base, exl2_base, gptq_base, st_file  # noqa: E402

OUT = HERE / "hostile"

# ---------------------------------------------------------------------------------------------------------
# hand-built GGUF (v3, little endian)
# ---------------------------------------------------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}


def _s(text) -> bytes:
    b = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _val(t: int, v) -> bytes:
    if t == STR:
        return _s(v)
    if t == ARR:
        et, items = v
        if isinstance(items, tuple):  # (declared count, raw element bytes): lengths the file may not hold
            n, raw = items
            return struct.pack("<IQ", et, n) + raw
        return struct.pack("<IQ", et, len(items)) + b"".join(_val(et, x) for x in items)
    return struct.pack("<" + _FMT[t], v)


def gguf_bytes(kvs, tensors=(), *, n_kv: int | None = None, n_tensors: int | None = None, align: int = 32) -> bytes:
    """GGUF v3 bytes.  ``kvs``: (key, type, value); ``tensors``: (name, dims in GGUF order, ggml type, raw)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
    for k, t, v in kvs:
        out += _s(k) + struct.pack("<I", t) + _val(t, v)
    off = 0
    for name, dims, ttype, raw in tensors:
        out += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, off)
        off += len(raw) + (-len(raw) % align)
    out += b"\0" * (-len(out) % align)
    for _, _, _, raw in tensors:
        out += raw + b"\0" * (-len(raw) % align)
    return out


def gguf_llama_kvs(block_count: int = 1, **over) -> list:
    """Plausible llama metadata for a tiny model (width 32, 2 heads); ``over`` replaces values by key suffix."""
    kv = {"general.architecture": (STR, "llama"), "llama.block_count": (U32, block_count),
          "llama.embedding_length": (U32, 32), "llama.feed_forward_length": (U32, 64),
          "llama.attention.head_count": (U32, 2), "llama.attention.head_count_kv": (U32, 2),
          "llama.context_length": (U32, 128), "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5)}
    for k, v in over.items():
        kv["llama." + k.replace("__", ".")] = v
    return [(k, t, v) for k, (t, v) in kv.items()]


def _tiny_gguf_tensors(blocks: int = 1) -> list:
    emb = np.zeros((4, 32), np.float32).tobytes()
    out = [("token_embd.weight", [32, 4], 0, emb), ("output_norm.weight", [32], 0, b"\0" * 128)]
    for b in range(blocks):
        out.append((f"blk.{b}.attn_norm.weight", [32], 0, b"\0" * 128))
    return out


def gguf_long_array(n: int, elem: int = U8) -> bytes:
    """A valid tiny GGUF with one metadata array of ``n`` elements (the scaling benchmark's input)."""
    if elem == STR:
        arr = ("test.strings", ARR, (STR, ["t"] * n))
    else:
        arr = ("test.array", ARR, (elem, (n, b"\0" * (n * struct.calcsize(_FMT[elem])))))
    return gguf_bytes(gguf_llama_kvs() + [arr], _tiny_gguf_tensors())


# ---------------------------------------------------------------------------------------------------------
# safetensors model directories
# ---------------------------------------------------------------------------------------------------------

def tiny_model_tensors() -> dict:
    """One EXL2 (down_proj), one GPTQ (up_proj) and one dense (gate_proj) layer, all valid."""
    out = {}
    for key, slots in (("model.layers.0.mlp.down_proj", exl2_base()), ("model.layers.0.mlp.up_proj", gptq_base()),
                       ("model.layers.0.mlp.gate_proj", dense_base())):
        out.update({f"{key}.{s}": a for s, a in slots.items()})
    return out


def _st(tensors: dict) -> bytes:
    """safetensors bytes of name -> array (exl2fmt's writer, to a temp path)."""
    import tempfile

    from exl2fmt.container import write_safetensors

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.safetensors"
        write_safetensors(p, tensors)
        return p.read_bytes()


def _u8(name: str) -> tuple:
    return (name, "U8", [1], b"\0")


def index_dir(n: int, kind: str) -> dict[str, bytes]:
    """Files of a directory whose index names ``n`` entries that break a rule: ``missing_shards`` (n shards
    that do not exist), ``missing_tensors`` (n tensors the one shard lacks)."""
    wm = {"a": "model-00001.safetensors"}
    for i in range(n):
        wm[f"model.layers.{i}.w"] = (f"model-{i + 2:06d}.safetensors" if kind == "missing_shards"
                                     else "model-00001.safetensors")
    index = json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}, separators=(",", ":")).encode()
    return {"model-00001.safetensors": st_file([_u8("a")]), "model.safetensors.index.json": index}


class Catalogue:
    def __init__(self, out: Path):
        self.out = out
        self.entries: list[dict] = []

    def add(self, name: str, files: dict[str, bytes] | bytes, cls: int, description: str, runs: list) -> None:
        p = self.out / name
        if isinstance(files, bytes):
            p.write_bytes(files)
        else:
            p.mkdir()
            for fn, data in files.items():
                (p / fn).write_bytes(data)
        self.entries.append({"path": name, "class": cls, "description": description,
                             "runs": [{"args": a, "code": c, "exit": e} for a, c, e in runs]})


README = """# Hostile catalogue, issue 11 classes 1-4

Generated by `../make_hostile.py` (deterministic; edit the generator, not the files). `index.json` lists
each case: `path`, `class`, `description` and `runs`, each run an `args` list for `exl2fmt` (`{case}` = the
case's path, `{out}` = a fresh output path), the `code` that must appear in the output (null: none required)
and the `exit` status. `tests/test_hostile.py` runs every run in a fresh process under
`tests/hostile_harness.run_bounded` (10 s, 1 GB, no traceback) and checks the generator reproduces the bytes.

* `c1_*` linear work over an index / header and capped output: human and markdown output print at most 20
  findings per (status, code), then one "... and M more (--json lists all)" line; `--json` keeps every finding
  (it is for machines). The 100k-entry index and the 10^6-element GGUF arrays are written at test time
  (`make_hostile.big_cases`) and timed in `bench/bench_hostile_scaling.py`.
* `c2_*` GGUF counts: `GGUF_INVALID` for lengths the file cannot hold or past a cap, `GGUF_METADATA_INVALID`
  (naming the key) for hyper-parameters out of range or beyond the tensors present (see `spec/gguf.md` 8).
* `c3_*` numbers in `config.json` / `quantization_config` (0, negative, 10^30, NaN, Infinity, `true`, 2.5):
  `CONFIG_VALUE_INVALID` from `validate`, `inspect` and `convert` (`exl2fmt/config_values.py` has the
  ranges); layers with zero rows or columns: `N_PADDING` / `SLOT_SHAPE`.
* `c4_*` one rule set: `dequantize`, `validate --deep` and `convert` refuse the same layers with the same
  code (non-finite or negative `q_scale_max`, invalid `q_invperm` / `q_perm`, GPTQ `g_idx` out of range,
  non-finite scales or dense weights, and a finite layer whose fp16 reconstruction overflows to Inf:
  `NONFINITE_VALUES`).

## Cases

| case | class | what is wrong | commands (code, exit) |
|---|---|---|---|
"""


def _cfg(**kv) -> bytes:
    return json.dumps(kv, sort_keys=True).encode()  # NaN / Infinity written as JSON's extensions, on purpose


def generate(out: str | Path = OUT) -> list[dict]:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Catalogue(out)
    V, VD, I, DQ = ["validate", "{case}"], ["validate", "--deep", "{case}"], ["inspect", "{case}"], "dequantize"

    # --- class 1: linear work, capped output ------------------------------------------------------------
    c.add("c1_index_2000_missing_shards", index_dir(2000, "missing_shards"), 1,
          "the index names 2000 shard files that do not exist (was quadratic: one scan of the index per shard)",
          [(V, "INDEX_MISSING_SHARD", 1), (I, "INDEX_MISSING_SHARD", 0)])
    c.add("c1_index_5000_missing_tensors", index_dir(5000, "missing_tensors"), 1,
          "the index lists 5000 tensors its one shard does not hold: 5000 findings, 20 printed per rule",
          [(V, "and 4980 more", 1), (I, "and 4980 more", 0)])
    names = [(f"bad\\u001b[2J{i:05d}", "U8", [1], b"\0") for i in range(1500)]  # JSON-escaped ESC
    c.add("c1_1500_control_char_names.safetensors", st_file(names), 1,
          "1500 tensor names with an escape sequence: one finding each, output capped",
          [(V, "and 1480 more", 1)])

    # --- class 2: GGUF metadata counts ------------------------------------------------------------------
    conv = ["convert", "{case}", "{out}", "--to", "fp16"]
    t1 = _tiny_gguf_tensors(1)
    c.add("c2_block_count_huge.gguf", gguf_bytes(gguf_llama_kvs(block_count=2**32 - 1), t1), 2,
          "llama.block_count = 2**32-1 in a file with one block (convert would loop over every block name)",
          [(conv, "GGUF_METADATA_INVALID", 1), (I, "GGUF_METADATA_INVALID", 0)])
    c.add("c2_block_count_exceeds_tensors.gguf", gguf_bytes(gguf_llama_kvs(block_count=3000), t1), 2,
          "llama.block_count = 3000 (in range) but the tensors hold one block",
          [(conv, "GGUF_METADATA_INVALID", 1)])
    c.add("c2_head_count_huge.gguf", gguf_bytes(gguf_llama_kvs(attention__head_count=(U32, 10**9)), t1), 2,
          "llama.attention.head_count = 10**9",
          [(conv, "GGUF_METADATA_INVALID", 1), (I, "GGUF_METADATA_INVALID", 0)])
    c.add("c2_expert_count_huge.gguf", gguf_bytes(gguf_llama_kvs(expert_count=(U64, 2**40)), t1), 2,
          "llama.expert_count = 2**40", [(conv, "GGUF_METADATA_INVALID", 1), (I, "GGUF_METADATA_INVALID", 0)])
    c.add("c2_embedding_length_zero.gguf", gguf_bytes(gguf_llama_kvs(embedding_length=(U32, 0)), t1), 2,
          "llama.embedding_length = 0 (hidden // heads would be 0)", [(conv, "GGUF_METADATA_INVALID", 1)])
    c.add("c2_eps_nan.gguf", gguf_bytes(gguf_llama_kvs(attention__layer_norm_rms_epsilon=(F32, float("nan"))), t1),
          2, "llama.attention.layer_norm_rms_epsilon = NaN", [(conv, "GGUF_METADATA_INVALID", 1)])
    c.add("c2_array_count_huge.gguf", gguf_bytes(gguf_llama_kvs() + [("x.a", ARR, (U8, (2**62, b"\0" * 64)))], t1),
          2, "a UINT8 array declaring 2**62 elements in a 600-byte file",
          [(I, "GGUF_INVALID", 1), (conv, "GGUF_INVALID", 1)])
    c.add("c2_string_array_count_huge.gguf",
          gguf_bytes(gguf_llama_kvs() + [("tokenizer.ggml.tokens", ARR, (STR, (2**40, _s("a") * 4)))], t1), 2,
          "tokenizer.ggml.tokens declares 2**40 strings", [(I, "GGUF_INVALID", 1), (conv, "GGUF_INVALID", 1)])
    c.add("c2_string_len_huge.gguf", gguf_bytes(gguf_llama_kvs() + [("x.s", STR, "abc")], t1)
          .replace(_s("abc"), struct.pack("<Q", 2**63) + b"abc"), 2,
          "a string value declaring 2**63 bytes", [(I, "GGUF_INVALID", 1)])
    c.add("c2_kv_count_huge.gguf", gguf_bytes(gguf_llama_kvs(), t1, n_kv=2**20), 2,
          "the header declares 2**20 key/value pairs (cap 65536)", [(I, "GGUF_INVALID", 1)])
    c.add("c2_tensor_count_huge.gguf", gguf_bytes(gguf_llama_kvs(), t1, n_tensors=2**63), 2,
          "the header declares 2**63 tensors", [(I, "GGUF_INVALID", 1)])
    nest = ("x.n", ARR, (ARR, [(ARR, [(U8, [1])])]))
    c.add("c2_arrays_nested_3.gguf", gguf_bytes(gguf_llama_kvs() + [nest], t1), 2,
          "arrays nested three deep (cap 2)", [(I, "GGUF_INVALID", 1)])
    c.add("c2_tensor_dims_overflow.gguf",
          gguf_bytes(gguf_llama_kvs(), [("token_embd.weight", [2**32, 2**32], 0, b"")]), 2,
          "a tensor of 2**32 x 2**32 F32 elements (data far past the end of the file)",
          [(I, "GGUF_INVALID", 1), (conv, "GGUF_INVALID", 1)])

    # --- class 3: odd numbers in configs, empty layers ----------------------------------------------------
    model = _st(tiny_model_tensors())
    gptq = _st({f"model.layers.0.mlp.up_proj.{s}": a for s, a in gptq_base().items()})
    exl2 = _st({f"model.layers.0.mlp.down_proj.{s}": a for s, a in exl2_base().items()})
    qg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    deq_up = [DQ, "{case}", "model.layers.0.mlp.up_proj"]
    to16 = ["convert", "{case}", "{out}", "--to", "fp16"]
    for name, q, desc in (("group_size_0", dict(qg, group_size=0), "quantization_config.group_size = 0"),
                          ("group_size_1e30", dict(qg, group_size=10**30), "quantization_config.group_size = 10**30"),
                          ("group_size_neg7", dict(qg, group_size=-7), "quantization_config.group_size = -7"),
                          ("bits_nan", dict(qg, bits=float("nan")), "quantization_config.bits = NaN"),
                          ("bits_true", dict(qg, bits=True), "quantization_config.bits = true")):
        c.add(f"c3_gptq_{name}", {"model.safetensors": gptq, "config.json": _cfg(quantization_config=q)}, 3, desc,
              [(V, "CONFIG_VALUE_INVALID", 1), (I, "CONFIG_VALUE_INVALID", 0), (to16, "CONFIG_VALUE_INVALID", 1),
               (deq_up, None, 0)])
    qe = {"quant_method": "exl2", "bits": 4.0, "head_bits": 6}
    for name, cfg, desc in (
            ("bits_inf", _cfg(quantization_config=dict(qe, bits=float("inf"))), "quantization_config.bits = Infinity"),
            ("bits_1e308", _cfg(quantization_config=dict(qe, bits=1e308)), "quantization_config.bits = 1e308"),
            ("head_bits_neg", _cfg(quantization_config=dict(qe, head_bits=-1)), "quantization_config.head_bits = -1"),
            ("hidden_size_1e30", _cfg(hidden_size=10**30, quantization_config=qe), "hidden_size = 10**30"),
            ("vocab_size_neg", _cfg(vocab_size=-5, quantization_config=qe), "vocab_size = -5"),
            ("heads_zero", _cfg(num_attention_heads=0, hidden_size=32, quantization_config=qe),
             "num_attention_heads = 0 (hidden // heads)"),
            ("eps_zero", _cfg(rms_norm_eps=0, quantization_config=qe), "rms_norm_eps = 0"),
            ("rope_theta_nan", _cfg(rope_theta=float("nan"), quantization_config=qe), "rope_theta = NaN"),
            ("layers_float", _cfg(num_hidden_layers=2.5, quantization_config=qe), "num_hidden_layers = 2.5")):
        c.add(f"c3_exl2_{name}", {"model.safetensors": exl2, "config.json": cfg}, 3, desc,
              [(V, "CONFIG_VALUE_INVALID", 1), (["inspect", "--json", "{case}"], "CONFIG_VALUE_INVALID", 0),
               (to16, "CONFIG_VALUE_INVALID", 1)])
    e = exl2_base()
    e0 = dict(e, q_weight=np.zeros((e["q_weight"].shape[0], 0), np.int32),
              q_scale=np.zeros((e["q_scale"].shape[0], 0), np.int32))
    c.add("c3_exl2_zero_columns.safetensors", _st({f"model.layers.0.mlp.down_proj.{s}": a for s, a in e0.items()}),
          3, "an EXL2 layer whose q_weight has 0 columns",
          [(V, "N_PADDING", 1), ([DQ, "{case}", "model.layers.0.mlp.down_proj"], "N_PADDING", 1)])
    g = gptq_base()
    g0 = dict(g, qweight=np.zeros((0, 32), np.int32))
    c.add("c3_gptq_zero_rows.safetensors", _st({f"model.layers.0.mlp.up_proj.{s}": a for s, a in g0.items()}), 3,
          "a GPTQ layer whose qweight has 0 rows", [(V, "SLOT_SHAPE", 1), (deq_up, "SLOT_SHAPE", 1)])
    c.add("c3_dense_zero_columns.safetensors",
          _st({"model.layers.0.mlp.gate_proj.weight": np.zeros((32, 0), np.float16)}),
          3, "a dense layer of shape [32, 0]",
          [(V, "SLOT_SHAPE", 1), ([DQ, "{case}", "model.layers.0.mlp.gate_proj"], "SLOT_SHAPE", 1)])

    # --- class 4: one rule set for every command that decodes ---------------------------------------------
    down = [DQ, "{case}", "model.layers.0.mlp.down_proj"]

    def exl2_case(name, slots, code, desc):
        c.add(name, {"model.safetensors": _st({f"model.layers.0.mlp.down_proj.{s}": a for s, a in slots.items()})},
              4, desc, [(down, code, 1), (VD, code, 1), (to16, code, 1)])

    qsm = e["q_scale_max"].copy()
    qsm[1] = np.float16("nan")
    exl2_case("c4_exl2_scale_max_nan", dict(e, q_scale_max=qsm), "SCALE_MAX_INVALID", "q_scale_max[1] = NaN")
    qsm = e["q_scale_max"].copy()
    qsm[0] = np.float16("inf")
    exl2_case("c4_exl2_scale_max_inf", dict(e, q_scale_max=qsm), "SCALE_MAX_INVALID", "q_scale_max[0] = +Inf")
    qsm = e["q_scale_max"].copy()
    qsm[2] = -qsm[2]
    exl2_case("c4_exl2_scale_max_negative", dict(e, q_scale_max=qsm), "SCALE_MAX_INVALID", "q_scale_max[2] < 0")
    inv = np.asarray(e["q_invperm"]).copy()
    inv[5] = inv[6]
    exl2_case("c4_exl2_invperm_duplicate", dict(e, q_invperm=inv), "PERM_INVALID",
              "q_invperm repeats an index (not a permutation)")
    perm = np.argsort(np.asarray(e["q_invperm"]).astype(np.int64)).astype(np.int16)
    perm[[0, 1]] = perm[[1, 0]]
    exl2_case("c4_exl2_perm_mismatch", dict(e, q_perm=perm), "PERM_MISMATCH", "q_perm is not argsort(q_invperm)")
    big = dict(e, q_scale_max=np.full_like(e["q_scale_max"], np.float16(60000)))
    exl2_case("c4_exl2_decodes_to_inf", big, "NONFINITE_VALUES",
              "finite q_scale_max = 60000: the fp16 reconstruction overflows to Inf")
    gs = gptq_base()
    sc = gs["scales"].copy()
    sc[0, 3] = np.float16("nan")
    c.add("c4_gptq_scales_nan", {"model.safetensors": _st({f"model.layers.0.mlp.up_proj.{s}": a for s, a in
                                                          dict(gs, scales=sc).items()})}, 4,
          "a GPTQ scale is NaN", [(deq_up, "NONFINITE_VALUES", 1), (VD, "NONFINITE_VALUES", 1),
                                  (to16, "NONFINITE_VALUES", 1)])
    gi = gs["g_idx"].copy()
    gi[3] = 99
    c.add("c4_gptq_g_idx_out_of_range", {"model.safetensors": _st({f"model.layers.0.mlp.up_proj.{s}": a for s, a in
                                                                  dict(gs, g_idx=gi).items()})}, 4,
          "g_idx names group 99 of 2", [(deq_up, "GPTQ_G_IDX", 1), (VD, "GPTQ_G_IDX", 1), (to16, "GPTQ_G_IDX", 1)])
    w = dense_base()["weight"].copy()
    w[1, 2] = np.float16("inf")
    c.add("c4_dense_weight_inf.safetensors", _st({"model.layers.0.mlp.gate_proj.weight": w}), 4,
          "a dense weight holds +Inf", [([DQ, "{case}", "model.layers.0.mlp.gate_proj"], "NONFINITE_VALUES", 1),
                                        (VD, "NONFINITE_VALUES", 1)])

    (out / "index.json").write_text(json.dumps(c.entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    rows = []
    for e in c.entries:
        runs = "; ".join(f"`{r['args'][0]}{' --deep' if '--deep' in r['args'] else ''}` "
                         f"({r['code'] or '-'}, {r['exit']})" for r in e["runs"])
        rows.append(f"| `{e['path']}` | {e['class']} | {e['description'].replace('|', '/')} | {runs} |")
    (out / "README.md").write_text(README + "\n".join(rows) + "\n", encoding="utf-8")
    return c.entries


def big_cases(tmp: str | Path) -> list[tuple[Path, list, str | None, int]]:
    """Size cases written at test time (not stored): ``[(path, args, code, exit)]``."""
    tmp = Path(tmp)
    out = []
    for n, kind in ((100_000, "missing_tensors"), (20_000, "missing_shards")):
        d = tmp / f"index_{kind}_{n}"
        d.mkdir()
        for fn, data in index_dir(n, kind).items():
            (d / fn).write_bytes(data)
        code = "INDEX_MISSING_TENSOR" if kind == "missing_tensors" else "INDEX_MISSING_SHARD"
        out.append((d, ["validate", str(d)], code, 1))
        out.append((d, ["inspect", str(d)], code, 0))
    for n, elem in ((1_000_000, U8), (1_000_000, STR)):
        p = tmp / f"array_{elem}_{n}.gguf"
        p.write_bytes(gguf_long_array(n, elem))
        out.append((p, ["inspect", str(p)], None, 0))
    return out


def main(argv: list[str]) -> int:
    entries = generate(argv[1] if len(argv) > 1 else OUT)
    print(f"wrote {len(entries)} hostile cases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
