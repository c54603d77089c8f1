#!/usr/bin/env python3
"""Generate the terminal-safety catalogue of issue 11 (class 5): ``spec/malformed/hostile_io/`` + ``index.json``.

    python spec/malformed/make_hostile_io.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile_io.py OUT_DIR    # write it somewhere else (the tests compare the bytes)

Every sample is a *well-formed* file or model directory whose strings - tensor names, shard file names, index
keys, ``config.json`` values, ``__metadata__`` values, GGUF metadata strings and tensor names - carry
characters that a terminal acts on or that change what a reader sees: Unicode bidi embeddings, overrides and
isolates (U+202A-U+202E, U+2066-U+2069, the "Trojan Source" characters), zero-width and other format
characters (category Cf: U+200B, U+200D, U+FEFF, U+2060, U+00AD, the tag characters U+E0001...), line and
paragraph separators (U+2028, U+2029) and NEL (U+0085), and rich console markup (``[bold red]...[/]``,
``[link=...]``).  ``tests/test_hostile_io.py`` runs each sample's commands (``{path}`` is the sample, ``{out}`` a fresh
destination) through the CLI (bounded: 10 s,
1 GB, no traceback) and asserts the exit code, the expected code in the output, that none of the sample's
``forbidden`` characters reaches human output (stdout or stderr, markdown included) raw, that ``literal``
strings (markup) print literally, and that ``--json`` keeps every ``names`` entry exact.

The runtime-only cases of classes 6 and 7 (FIFOs, device nodes, symlinks, permission denied, a full disk,
signals) cannot live in a repository; the tests make them in a temporary directory.

Deterministic: containers are hand-built bytes (``struct`` + literal JSON), GGUF files come from the ``gguf``
package's writer with fixed inputs.  Needs only the standard library, NumPy and (for the GGUF samples) gguf.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT_NAME = "hostile_io"

# the characters, by family (each must be escaped in human output)
BIDI = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]
FORMAT = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\U000e0001", "\U000e0041"]
SEPARATORS = ["\u2028", "\u2029", "\u0085"]
C0 = ["\x1b", "\x07", "\r", "\n"]
MARKUP = "[bold red]FAKE PASS[/] [link=https://example.invalid]x[/link]"


def _json(obj) -> bytes:
    """Compact JSON with every non-ASCII character as a \\u escape (what most writers emit)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode()


def st_file(tensors: list[tuple[str, str, list[int], bytes]], metadata: dict | None = None,
            raw_header: bytes | None = None) -> bytes:
    """A safetensors file from (name, dtype, shape, data) entries; ``raw_header`` overrides the JSON text."""
    hdr: dict = {}
    if metadata is not None:
        hdr["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape, data in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    text = raw_header if raw_header is not None else _json(hdr)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def f16(n: int, seed: int) -> bytes:
    """n finite float16 values in [-1, 1) from a fixed integer sequence (NumPy-version independent)."""
    i = np.arange(n, dtype=np.int64)
    v = ((i * 7919 + seed * 104729) % 2001 - 1000) / 1000.0
    return v.astype("<f2").tobytes()


def dense(name: str, n: int = 8, k: int = 16, seed: int = 1) -> tuple[str, str, list[int], bytes]:
    return (name, "F16", [n, k], f16(n * k, seed))


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 2, "vocab_size": 8, "torch_dtype": "float16"}


class Catalogue:
    def __init__(self, out: Path):
        self.out = out
        self.entries: list[dict] = []

    def add(self, path: str, description: str, commands: list[dict], forbidden: list[str], names: list[str] = (),
            literal: list[str] = ()) -> None:
        self.entries.append({"path": path, "description": description, "commands": commands,
                             "forbidden": sorted(set(forbidden)), "names": list(names), "literal": list(literal)})

    def file(self, rel: str, data: bytes) -> None:
        p = self.out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def cmd(args: list[str], exit: int, code: str | None = None, json_: bool = False, literal: bool = False,
        slow: bool = False) -> dict:
    """One CLI run (``{path}`` and ``{out}`` are substituted); ``literal``: this command prints the sample's
    ``literal`` strings (markup) and they must appear as they are; ``slow``: a variant run only with
    ``-m slow`` (the default suite keeps one human, one machine and every convert run per sample)."""
    return {"args": args, "exit": exit, "code": code, "json": json_, "literal": literal, "slow": slow}


def layer_key(name: str) -> str:
    return name[:-len(".weight")] if name.endswith(".weight") else name


def safetensors_samples(c: Catalogue) -> None:
    # --- tensor names ------------------------------------------------------------------------------------
    bidi_name = "model.layers.0.mlp.\u202eup_proj\u202c\u2066x\u2069.weight"
    c.file("name_bidi.safetensors", st_file([dense(bidi_name)]))
    c.add("name_bidi.safetensors", "a layer name with a right-to-left override and an isolate (Trojan Source)",
          [cmd(["inspect", "{path}"], 0, "NAME_CONTROL_CHARS"),
           cmd(["inspect", "{path}", "--markdown"], 0, "NAME_CONTROL_CHARS", slow=True),
           cmd(["validate", "{path}"], 1, "NAME_CONTROL_CHARS"),
           cmd(["validate", "{path}", "--markdown"], 1, "NAME_CONTROL_CHARS", slow=True),
           cmd(["inspect", "{path}", "--json"], 0, "NAME_CONTROL_CHARS", json_=True, slow=True),
           cmd(["validate", "{path}", "--json"], 1, "NAME_CONTROL_CHARS", json_=True),
           cmd(["dequantize", "{path}", layer_key(bidi_name)], 0, slow=True),
           cmd(["convert", "{path}", "{out}", "--to", "bf16"], 1, "NAME_CONTROL_CHARS")],
          BIDI[2:5] + BIDI[5:6] + BIDI[8:9], names=[bidi_name])

    zw_name = "model.layers.0.self_attn.q\u200b_proj\u200d\u2060\ufeff\u00ad\U000e0001\U000e0041.weight"
    c.file("name_zero_width.safetensors", st_file([dense(zw_name, seed=2)]))
    c.add("name_zero_width.safetensors", "a layer name with zero-width space/joiner, word joiner, BOM, soft "
          "hyphen and tag characters (invisible: two names that look equal are not)",
          [cmd(["inspect", "{path}"], 0, "NAME_CONTROL_CHARS"),
           cmd(["validate", "{path}"], 1, "NAME_CONTROL_CHARS", slow=True),
           cmd(["validate", "{path}", "--json"], 1, "NAME_CONTROL_CHARS", json_=True)],
          FORMAT, names=[zw_name])

    sep_name = "model.layers.0.mlp.down_proj\u2028PASS  CONTAINER_OK\u2029\u0085.weight"
    c.file("name_separators.safetensors", st_file([dense(sep_name, seed=3)]))
    c.add("name_separators.safetensors", "a layer name with a line separator, a paragraph separator and NEL "
          "that would forge an extra PASS line",
          [cmd(["inspect", "{path}"], 0, "NAME_CONTROL_CHARS", slow=True),
           cmd(["validate", "{path}"], 1, "NAME_CONTROL_CHARS", slow=True),
           cmd(["validate", "{path}", "--markdown"], 1, "NAME_CONTROL_CHARS"),
           cmd(["validate", "{path}", "--json"], 1, "NAME_CONTROL_CHARS", json_=True)],
          SEPARATORS, names=[sep_name])

    markup_name = f"model.layers.0.mlp.gate_proj{MARKUP}.weight"
    c.file("name_rich_markup.safetensors", st_file([dense(markup_name, seed=4)]))
    c.add("name_rich_markup.safetensors", "a (printable) layer name holding rich console markup: it must print "
          "literally, never as bold text or a hyperlink",
          [cmd(["inspect", "{path}"], 0, literal=True), cmd(["validate", "{path}"], 0),
           cmd(["inspect", "{path}", "--json"], 0, json_=True),
           cmd(["convert", "{path}", "{out}", "--to", "bf16"], 0, literal=True)],
          [], names=[layer_key(markup_name)], literal=["[bold red]FAKE PASS[/]", "[link=https://example.invalid]"])

    # --- __metadata__ values ------------------------------------------------------------------------------
    meta = {"format": "pt", "producer": "exl2fmt\u202e", "quantized_by": f"x\u2028y\u200b{MARKUP}"}
    c.file("metadata_bidi.safetensors", st_file([dense("model.layers.0.mlp.up_proj.weight", seed=5)], meta))
    c.add("metadata_bidi.safetensors", "__metadata__ values with an override, a line separator, a zero-width "
          "space and markup",
          [cmd(["inspect", "{path}"], 0), cmd(["inspect", "{path}", "--markdown"], 0),
           cmd(["validate", "{path}"], 0, slow=True)],
          ["\u202e", "\u2028", "\u200b"], literal=[])

    # --- a header error whose message quotes the hostile key --------------------------------------------------
    k = "model.layers.0.\u202emlp\u2028.up_proj.weight"
    entry = _json({"dtype": "F16", "shape": [2], "data_offsets": [0, 4]})
    raw = b"{" + _json(k) + b":" + entry + b"," + _json(k) + b":" + entry + b"}"
    c.file("duplicate_key_bidi.safetensors", st_file([], raw_header=raw) + b"\0" * 4)
    c.add("duplicate_key_bidi.safetensors", "a header repeating a tensor key that holds an override and a line "
          "separator: the error message quotes the key",
          [cmd(["inspect", "{path}"], 1, "DUPLICATE_KEY", slow=True), cmd(["validate", "{path}"], 1, "DUPLICATE_KEY", slow=True),
           cmd(["convert", "{path}", "{out}", "--to", "fp16"], 1, "DUPLICATE_KEY"),
           cmd(["validate", "{path}", "--json"], 1, "DUPLICATE_KEY", json_=True)],
          ["\u202e", "\u2028"])


def directory_samples(c: Catalogue) -> None:
    # --- index keys and shard names ---------------------------------------------------------------------------
    d = "dir_index_hostile_keys"
    good = dense("model.layers.0.mlp.up_proj.weight", seed=6)
    c.file(f"{d}/model-00001-of-00001.safetensors", st_file([good]))
    ghost = "model.layers.0.mlp.\u202edown_proj\u2069\u200b.weight"
    shard = "model-\u202e00002\u2028-of-00002.safetensors"
    wm = {good[0]: "model-00001-of-00001.safetensors", ghost: "model-00001-of-00001.safetensors",
          "model.layers.0.mlp.gate_proj.weight": shard}
    c.file(f"{d}/model.safetensors.index.json", json.dumps({"metadata": {"total_size": 256}, "weight_map": wm},
                                                           indent=1, sort_keys=True).encode() + b"\n")
    c.file(f"{d}/config.json", _json(LLAMA_CONFIG))
    c.add(d, "an index naming a tensor (override, isolate, zero-width space) that no shard holds and a shard file "
          "(override, line separator) that does not exist",
          [cmd(["inspect", "{path}"], 0, "INDEX_MISSING_TENSOR", slow=True),
           cmd(["validate", "{path}"], 1, "INDEX_MISSING_SHARD"),
           cmd(["validate", "{path}", "--markdown"], 1, "INDEX_MISSING_TENSOR", slow=True),
           cmd(["validate", "{path}", "--json"], 1, "INDEX_MISSING_TENSOR", json_=True)],
          ["\u202e", "\u2069", "\u200b", "\u2028"], names=[ghost])

    d = "dir_shard_name_hostile"
    fname = "model\u202e\u200b.safetensors"
    c.file(f"{d}/{fname}", st_file([dense("model.layers.0.mlp.up_proj.weight", seed=7)]))
    c.file(f"{d}/config.json", _json(LLAMA_CONFIG))
    c.add(d, "a shard whose file name holds an override and a zero-width space (file names are printed too)",
          [cmd(["inspect", "{path}"], 0), cmd(["validate", "{path}"], 0, slow=True),
           cmd(["inspect", "{path}", "--json"], 0, json_=True)],
          ["\u202e", "\u200b"], names=[fname])

    # --- config.json values -----------------------------------------------------------------------------------
    d = "dir_config_hostile"
    cfg = dict(LLAMA_CONFIG, architectures=[f"Llama\u202eForCausalLM\u2028{MARKUP}"], model_type="lla\u2066ma\u2069",
               quantization_config={"quant_method": "gptq\u200b\u2029", "bits": 4})
    c.file(f"{d}/model.safetensors", st_file([dense("model.layers.0.mlp.up_proj.weight", seed=8)]))
    c.file(f"{d}/config.json", _json(cfg))
    c.add(d, "config.json whose architecture, model_type and quant_method hold overrides, isolates, separators, "
          "a zero-width space and markup (printed in the summary and in FORMAT_MISMATCH)",
          [cmd(["inspect", "{path}"], 0, "FORMAT_MISMATCH", literal=True),
           cmd(["inspect", "{path}", "--markdown"], 0, "FORMAT_MISMATCH"),
           cmd(["validate", "{path}"], 1, "FORMAT_MISMATCH", slow=True)],
          ["\u202e", "\u2028", "\u2066", "\u2069", "\u200b", "\u2029"], literal=["[bold red]FAKE PASS[/]"])


def gguf_samples(c: Catalogue) -> None:
    try:
        import gguf
    except ImportError:  # the GGUF samples need the optional gguf package
        return
    name = "blk.0.ffn_up\u202e\u2028\u200b.weight"
    path = c.out / "gguf_hostile_strings.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny\u202e\u2066{MARKUP}\u2069")
    w.add_string("general.description", "line\u2028break\u2029para\u0085nel\x1b[2J")
    w.add_string("general.author\u200b", "x")
    w.add_tensor(name, np.zeros((4, 8), np.float32))
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c.add("gguf_hostile_strings.gguf", "a GGUF whose general.name, a string value, a key and a tensor name hold "
          "overrides, isolates, separators, NEL, an ESC sequence, a zero-width space and markup",
          [cmd(["inspect", "{path}"], 0), cmd(["inspect", "{path}", "--markdown"], 0, slow=True),
           cmd(["inspect", "{path}", "--json"], 0, json_=True)],
          ["\u202e", "\u2066", "\u2069", "\u2028", "\u2029", "\u0085", "\x1b", "\u200b"], names=[name])


def generate(out: str | Path = HERE / OUT_NAME) -> list[dict]:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Catalogue(out)
    safetensors_samples(c)
    directory_samples(c)
    gguf_samples(c)
    (out / "index.json").write_text(json.dumps(c.entries, indent=1, ensure_ascii=True) + "\n", encoding="ascii")
    (out / "README.md").write_text(readme(c.entries), encoding="utf-8")
    return c.entries


def readme(entries: list[dict]) -> str:
    rows = "\n".join(f"| `{e['path'].encode('ascii', 'backslashreplace').decode()}` | "
                     f"{', '.join(sorted({f'U+{ord(ch):04X}' for ch in e['forbidden']}) or ['-'])} | "
                     f"{len(e['commands'])} | {e['description']} |" for e in entries)
    return f"""# Terminal-safety catalogue (issue 11, class 5)

Generated by `../make_hostile_io.py` (edit the generator, not this file); run by `tests/test_hostile_io.py`.
Well-formed samples whose strings carry bidi controls, zero-width / format characters, separators or rich
markup.  `index.json` lists, per sample: `path`; `commands` (each `args` with `{{path}}` / `{{out}}` filled in,
the expected `exit` status, the `code` that must appear, `json` for machine output, `literal` when the markup
must print as text); `forbidden` (characters that must never reach human output raw); `names` (strings
`--json` must keep exact); `literal`.

| sample | characters that must be escaped | runs | what |
|---|---|---|---|
{{rows}}
""".replace("{rows}", rows)


def main(argv: list[str]) -> int:
    entries = generate(argv[1] if len(argv) > 1 else HERE / OUT_NAME)
    print(f"wrote {len(entries)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
