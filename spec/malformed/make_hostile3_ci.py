#!/usr/bin/env python3
"""Generate the hostile catalogue of issue 41, classes 4 and 9: ``spec/malformed/hostile3_ci/`` + ``index.json``.

    python spec/malformed/make_hostile3_ci.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile3_ci.py OUT_DIR    # write it somewhere else (tests compare the bytes)

Deterministic, standard library + NumPy + exl2fmt (GGUF bytes hand-built by ``make_hostile.gguf_bytes``).

* ``ci_*`` (class 4, CI output injection): tensor names, shard names, index entries, config.json values,
  safetensors ``__metadata__`` strings, GGUF strings and values quoted by error messages that carry GitHub Actions
  workflow commands: ``::error title=...::``, ``::add-mask::``, ``::stop-commands::``, ``::warning::`` (also after
  leading spaces), and the legacy ``##[error]``, ``##[add-mask]``, ``##[group]`` forms, which the runner honours
  anywhere in a line.  Every payload carries a marker word ``pwnedN`` so that a test can see that the text did
  reach the output (escaped), not merely that it was left out.  Shard names holding ``:`` are not stored (a
  Windows checkout cannot hold them): ``runtime_cases(tmp)`` writes them at test time.
* ``zero_*`` (class 9, "a fixed defect came back"): layers with 0 rows or 0 columns in every format (EXL2, GPTQ,
  dense, GGUF).  ``inspect`` divided by zero in the bits-per-weight formula of the 0-column EXL2 layer.

``index.json``: a list of ``{"path", "class", "description", "markers", "runs": [{"args", "code", "exit"}]}``; in
``args`` ``{case}`` is the case's path and ``{out}`` a fresh output path; ``code`` (or null) must appear in the
output, ``exit`` is the exit status (a list: any of them).  ``markers``: marker words of which at least one must
appear in the human output of each run of a ``ci_`` case.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_hostile import F32, STR, U32, _st, gguf_bytes, gguf_llama_kvs  # noqa: E402
from make_malformed import dense_base, exl2_base, gptq_base, st_bytes, st_file  # noqa: E402

OUT = HERE / "hostile3_ci"

#: the payloads (each with its marker word)
P = {
    "error": "::error title=pwned1::",
    "mask": "::add-mask::pwned2",
    "stop": "::stop-commands::pwned3",
    "legacy": "##[error]pwned4",
    "legacy_mask": "##[add-mask]pwned5",
    "indent": "  ::warning::pwned6",
    "group": "##[group]pwned7",
}

EXL2_KEY = P["error"] + "model.layers.0.mlp.down_proj"
GPTQ_KEY = P["legacy"] + ".model.layers.0.mlp.up_proj"
DENSE_KEYS = (P["mask"] + ".model.layers.1.mlp.gate_proj", P["stop"] + ".model.layers.2.mlp.up_proj",
              P["legacy_mask"] + ".model.layers.10.self_attn.q_proj", P["indent"] + ".model.layers.3.mlp.down_proj")


def _payload_model() -> dict:
    out = {f"{EXL2_KEY}.{s}": a for s, a in exl2_base().items()}
    out.update({f"{GPTQ_KEY}.{s}": a for s, a in gptq_base().items()})
    for k in DENSE_KEYS:
        out[f"{k}.weight"] = dense_base()["weight"]
    out[P["group"] + ".model.embed_tokens.weight"] = np.zeros((8, 64), np.float16)
    return out


def _payload_st() -> bytes:
    import tempfile

    from exl2fmt.container import write_safetensors

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.safetensors"
        write_safetensors(p, _payload_model(), metadata={"format": "pt", "producer": "##[error]pwned8 ::error::x",
                                                           P["mask"]: P["legacy_mask"]})
        return p.read_bytes()


def _dense_model(keys=("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")) -> dict:
    return {f"{k}.weight": dense_base()["weight"] for k in keys}


def _cfg(**kv) -> bytes:
    return json.dumps(kv, sort_keys=True).encode()


class Catalogue:
    def __init__(self, out: Path):
        self.out = out
        self.entries: list[dict] = []

    def add(self, name: str, files: dict[str, bytes] | bytes, cls: int, description: str, runs: list,
            markers: list[str] = ()) -> None:
        p = self.out / name
        if isinstance(files, bytes):
            p.write_bytes(files)
        else:
            p.mkdir()
            for fn, data in files.items():
                (p / fn).write_bytes(data)
        self.entries.append({"path": name, "class": cls, "description": description, "markers": list(markers),
                             "runs": [{"args": a, "code": c, "exit": e if isinstance(e, list) else [e]}
                                      for a, c, e in runs]})


def _gguf_payloads() -> bytes:
    kvs = gguf_llama_kvs(2) + [("general.name", STR, P["error"] + "name " + P["legacy"]),
                               ("##[error]pwned9.key", STR, P["mask"])]
    t = [("token_embd.weight", [32, 4], 0, np.zeros((4, 32), np.float32).tobytes()),
         ("output_norm.weight", [32], 0, b"\0" * 128)]
    for name in (P["error"] + "blk.0.attn_q.weight", P["legacy"] + "blk.1.attn_q.weight",
                 "blk.10.attn_q.weight", P["indent"] + "blk.0.ffn_up.weight"):
        t.append((name, [32, 32], 0, np.zeros((32, 32), np.float32).tobytes()))
    return gguf_bytes(kvs, t)


def _gguf_zero() -> bytes:
    t = [("token_embd.weight", [32, 4], 0, np.zeros((4, 32), np.float32).tobytes()),
         ("output_norm.weight", [32], 0, b"\0" * 128),
         ("blk.0.attn_q.weight", [32, 0], 0, b""), ("blk.0.attn_k.weight", [0, 32], 0, b"")]
    return gguf_bytes(gguf_llama_kvs(1), t)


CI_RUNS = "ci"   # marker for the test: every command and output format, see tests/test_hostile3_ci.py


def generate(out: str | Path = OUT) -> list[dict]:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Catalogue(out)
    I, IJ, V, VD = ["inspect", "{case}"], ["inspect", "--json", "{case}"], ["validate", "{case}"], \
        ["validate", "--deep", "{case}"]
    to16 = ["convert", "{case}", "{out}", "--to", "fp16"]
    markers = [f"pwned{i}" for i in range(1, 10)]

    # --- class 4: workflow commands in file-derived strings -----------------------------------------------
    c.add("ci_names.safetensors", _payload_st(), 4,
          "layer keys (EXL2, GPTQ, dense), an embedding and __metadata__ keys and values that start with or hold "
          "workflow commands", [(I, None, 0), (V, None, [0, 1])], markers)
    dense_payload = {f"{k}.weight": dense_base()["weight"] for k in DENSE_KEYS}
    c.add("ci_dense_names", {"model.safetensors": _st(dense_payload),
                             "config.json": _cfg(architectures=["LlamaForCausalLM"], model_type="llama")}, 4,
          "a dense model whose layer keys start with workflow commands (convert reports list them)",
          [(I, None, 0), (to16, None, [0, 1])], markers)
    c.add("ci_config_values", {"model.safetensors": _st(_dense_model()), "config.json": _cfg(
        architectures=[P["error"] + "Arch " + P["legacy"]], model_type=P["mask"] + " " + P["group"],
        num_hidden_layers=P["legacy_mask"], hidden_size=P["indent"],
        quantization_config={"quant_method": P["legacy"] + P["error"], "bits": P["stop"]})}, 4,
          "config.json values (architectures, model_type, numbers as strings, quant_method) holding workflow "
          "commands; validate and inspect quote them", [(I, None, [0, 1]), (V, None, 1)], markers)
    idx = {"metadata": {"total_size": 1}, "weight_map": {
        "model.layers.0.mlp.gate_proj.weight": "model-00001-of-00001.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00001-of-00001.safetensors",
        P["mask"] + ".weight": "model-00001-of-00001.safetensors",
        "model.layers.1.mlp.up_proj.weight": "##[error]pwned4-missing.safetensors",
        "model.layers.2.mlp.up_proj.weight": P["error"] + "missing.safetensors"}}
    c.add("ci_index_entries", {"model-00001-of-00001.safetensors": _st(_dense_model()),
                               "model.safetensors.index.json": json.dumps(idx, sort_keys=True).encode()}, 4,
          "an index naming missing shards and tensors whose names hold workflow commands",
          [(I, "INDEX_INVALID", 1), (V, "INDEX_INVALID", 1)], markers)
    sh = {"##[error]pwned4-of-00002.safetensors": _st(_dense_model(("model.layers.0.mlp.gate_proj",))),
          "##[add-mask]pwned5-of-00002.safetensors": _st(_dense_model(("model.layers.0.mlp.up_proj",)))}
    shidx = {"metadata": {"total_size": 4096}, "weight_map": {
        "model.layers.0.mlp.gate_proj.weight": "##[error]pwned4-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.weight": "##[add-mask]pwned5-of-00002.safetensors",
        "model.layers.5.mlp.up_proj.weight": "##[add-mask]pwned5-of-00002.safetensors"}}
    c.add("ci_shard_names", dict(sh, **{"config.json": _cfg(architectures=["LlamaForCausalLM"]),
                                        "model.safetensors.index.json": json.dumps(shidx, sort_keys=True).encode()}),
          4, "shard files named with legacy workflow commands; the index lists a tensor one of them lacks",
          [(I, "INDEX_MISSING_TENSOR", 0), (V, "INDEX_MISSING_TENSOR", 1)], markers)
    # a fatal error whose message quotes the file's strings: the dtype and the tensor name
    c.add("ci_fatal_dtype.safetensors",
          st_file([("##[error]pwned4.weight", "##[add-mask]pwned5", [1], b"\0")]), 4,
          "a fatal header error (unknown dtype) whose message quotes a dtype and a tensor name holding "
          "workflow commands", [(I, "DTYPE_UNKNOWN", 1), (V, "DTYPE_UNKNOWN", 1)], markers)
    c.add("ci_fatal_shape.safetensors",
          st_bytes('{"%sw":{"dtype":"F16","shape":["##[error]pwned4"],"data_offsets":[0,2]}}' % P["error"],
                   b"\0\0"), 4,
          "a fatal header error (a shape entry is a string holding a workflow command)",
          [(I, "SHAPE_INVALID", 1), (V, "SHAPE_INVALID", 1)], markers)
    c.add("ci_gguf_strings.gguf", _gguf_payloads(), 4,
          "a GGUF whose general.name, a metadata key and value, and tensor names hold workflow commands",
          [(I, None, 0)], markers)

    # --- class 9: layers of no weights in every format -------------------------------------------------------
    e = exl2_base()
    zero = {
        "zero_exl2_columns.safetensors": ({f"model.layers.0.mlp.down_proj.{s}": a for s, a in dict(
            e, q_weight=np.zeros((e["q_weight"].shape[0], 0), np.int32),
            q_scale=np.zeros((e["q_scale"].shape[0], 0), np.int32)).items()},
            "an EXL2 layer whose q_weight has 0 columns (inspect: ZeroDivisionError in the bpw formula, twice)",
            "model.layers.0.mlp.down_proj", "N_PADDING"),
        "zero_exl2_rows.safetensors": ({f"model.layers.0.mlp.down_proj.{s}": a for s, a in dict(
            e, q_weight=np.zeros((0, e["q_weight"].shape[1]), np.int32), q_invperm=np.zeros(0, np.int16),
            q_perm=np.zeros(0, np.int16), q_groups=np.zeros(0, np.int16),
            q_scale=np.zeros((0, e["q_scale"].shape[1]), np.int32), q_scale_max=np.zeros(0, np.float16)).items()},
            "an EXL2 layer with 0 input rows (empty q_invperm, q_groups, q_weight)", "model.layers.0.mlp.down_proj",
            None),
        "zero_gptq_columns.safetensors": ({f"model.layers.0.mlp.up_proj.{s}": a for s, a in dict(
            gptq_base(), qweight=np.zeros((8, 0), np.int32), qzeros=np.zeros((2, 0), np.int32),
            scales=np.zeros((2, 0), np.float16)).items()},
            "a GPTQ layer with 0 output columns", "model.layers.0.mlp.up_proj", "SLOT_SHAPE"),
        "zero_gptq_rows.safetensors": ({f"model.layers.0.mlp.up_proj.{s}": a for s, a in dict(
            gptq_base(), qweight=np.zeros((0, 32), np.int32), g_idx=np.zeros(0, np.int32)).items()},
            "a GPTQ layer with 0 input rows", "model.layers.0.mlp.up_proj", "SLOT_SHAPE"),
        "zero_dense_rows.safetensors": ({"model.layers.0.mlp.gate_proj.weight": np.zeros((0, 64), np.float16)},
                                        "a dense layer of shape [0, 64]", "model.layers.0.mlp.gate_proj",
                                        "SLOT_SHAPE"),
        "zero_dense_columns.safetensors": ({"model.layers.0.mlp.gate_proj.weight": np.zeros((32, 0), np.float16)},
                                           "a dense layer of shape [32, 0]", "model.layers.0.mlp.gate_proj",
                                           "SLOT_SHAPE"),
    }
    for name, (tensors, desc, key, code) in zero.items():
        c.add(name, _st(tensors), 9, desc,
              [(I, "SLOT_SHAPE", 0), (IJ, "SLOT_SHAPE", 0), (["inspect", "--markdown", "{case}"], "SLOT_SHAPE", 0),
               (V, code, 1), (VD, code, 1), (["dequantize", "{case}", key], code, [1, 3]), (to16, code, [1, 3])])
    c.add("zero_gguf_dims.gguf", _gguf_zero(), 9, "GGUF 2-D tensors with a 0 dimension",
          [(I, "SLOT_SHAPE", 0), (IJ, "SLOT_SHAPE", 0), (to16, "SLOT_SHAPE", 1)])

    (out / "index.json").write_text(json.dumps(c.entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    lines = [README]
    for en in c.entries:
        lines.append(f"| `{en['path'].replace('|', '/')}` | {en['class']} | {en['description']} |\n")
    (out / "README.md").write_text("".join(lines), encoding="utf-8")
    return c.entries


def runtime_cases(tmp: str | Path) -> list[Path]:
    """Cases a Windows checkout could not hold (``:`` in file names), written under ``tmp`` at test time: shard
    files and an index named with ``::`` workflow commands.  Returns the case directories."""
    tmp = Path(tmp)
    d = tmp / "ci_shard_names_colon"
    d.mkdir(parents=True)
    names = {P["error"] + "a.safetensors": ("model.layers.0.mlp.gate_proj",),
             P["mask"] + ".safetensors": ("model.layers.0.mlp.up_proj",)}
    wm = {}
    for fn, keys in names.items():
        (d / fn).write_bytes(_st(_dense_model(keys)))
        wm.update({f"{k}.weight": fn for k in keys})
    wm["model.layers.1.mlp.up_proj.weight"] = P["stop"] + ".safetensors"   # missing shard
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    return [d]


README = """# Hostile catalogue, issue 41 classes 4 and 9 (CI output injection, empty layers)

Generated by `../make_hostile3_ci.py` (deterministic; edit the generator, not the files). `index.json` lists each
case: `path`, `class`, `description`, `markers` and `runs` (`args` for `exl2fmt` with `{case}` / `{out}`, the
`code` that must appear, the allowed `exit` statuses). `tests/test_hostile3_ci.py` runs them in fresh processes
under `tests/hostile_harness.run_bounded`.

* `ci_*` (class 4): file-derived strings holding GitHub Actions workflow commands (`::error title=...::`,
  `::add-mask::`, `::stop-commands::`, indented `::warning::`, and the legacy `##[error]`, `##[add-mask]`,
  `##[group]` that the runner honours anywhere in a line, on stdout and stderr). Every `ci_` case goes through
  every command and output format (inspect human / markdown / json / --no-layers, validate human / markdown /
  github / junit / json / --deep, dequantize, convert and its errors, the pre-commit hook, and `hf://` listings
  through the test hub), and the test parses stdout and stderr with the runner's own rules: no line may start,
  after its leading whitespace, with `::`, and no line may hold `##[`, except the workflow commands
  `validate --format github` writes itself, whose properties and messages must be escaped as GitHub specifies.
  exl2fmt writes a leading `::` of a file-derived string as `\\u003a\\u003a` and every `##[` as `\\u0023#[`
  (`exl2fmt.errors.escape_name`); `--json` keeps strings exact (a `##[` is written `\\u0023#[`: the same JSON
  value).
* `zero_*` (class 9): layers with 0 rows or 0 columns in EXL2, GPTQ, dense and GGUF: inspect lists them with a
  `SLOT_SHAPE` finding and no bits per weight (it crashed with `INTERNAL ZeroDivisionError`); validate,
  dequantize and convert refuse them with their code.

## Cases

| case | class | what is in it |
|---|---|---|
"""


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else OUT
    entries = generate(out)
    print(f"wrote {len(entries)} cases to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
