#!/usr/bin/env python3
"""Generate the hostile EXL3 catalogue of issue 39: ``spec/malformed/hostile3_exl3/`` + ``index.json``.

    python spec/malformed/make_hostile3_exl3.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile3_exl3.py OUT_DIR    # write it somewhere else (the tests compare the bytes)

Deterministic; standard library + NumPy + exl2fmt's safetensors writer.  Every case but the header-only ones is a
model directory of one EXL3 linear (``model.layers.0.mlp.down_proj``: 120 -> 100 features, padded 128 x 128, so
a trellis [8, 8, 16 r]) and a ``config.json`` that names its sizes, with one rule of spec/exl3.md section 9 broken.
The trellis words are a fixed integer hash (any bit pattern is a valid ring, spec/exl3.md section 2.2), the
scales small finite fp16 values: ``ok_layer`` is the unbroken control.

``index.json``: a list of ``{"path", "rule", "description", "runs": [{"args", "code", "exit"}]}``; in ``args``
``{case}`` is the case's path and ``{out}`` a fresh output path; ``code`` (or null) must appear in the output,
``exit`` lists the allowed exit statuses.  Every case runs ``inspect``, ``validate --deep --json``,
``dequantize`` and ``convert --to fp16``.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "hostile3_exl3"

KEY = "model.layers.0.mlp.down_proj"
IN, OUT_F = 120, 100                       # intermediate_size -> hidden_size; both pad to 128
MCG = 0xCBAC1FED - (1 << 32)
MUL1 = 0x83DCD12D - (1 << 32)
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": OUT_F,
          "intermediate_size": IN, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
          "vocab_size": 64, "quantization_config": {"quant_method": "exl3", "version": "0.0.18", "bits": 2,
                                                    "head_bits": 6, "codebook": "mcg"}}


def _words(n: int, seed: int) -> np.ndarray:
    """``n`` int16 words of a fixed multiplicative hash (version-independent, unlike a NumPy generator)."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed * 7919 + 1)
    return ((i * np.uint64(2654435761)) >> np.uint64(9) & np.uint64(0xFFFF)).astype(np.uint16).view(np.int16)


def trellis(tk: int = 8, tn: int = 8, last: int = 32, seed: int = 0) -> np.ndarray:
    return _words(tk * tn * last, seed).reshape(tk, tn, last)


def scales(n: int, seed: int) -> np.ndarray:
    """fp16 signs x scales of magnitude 0.01 .. 0.02."""
    w = _words(n, seed + 100).view(np.uint16).astype(np.float32)
    sign = np.where(w.astype(np.int64) & 1, -1.0, 1.0)
    return (sign * (0.01 + 0.01 * w / 65535.0)).astype(np.float16)


def layer(**change) -> dict:
    """The control layer (rate 2, codebook mcg) with ``change`` applied: slot -> array, or None to drop it."""
    t = {"trellis": trellis(), "suh": scales(128, 1), "svh": scales(128, 2), "mcg": np.array(MCG, np.int32)}
    for s, a in change.items():
        if a is None:
            t.pop(s, None)
        else:
            t[s] = a
    return {f"{KEY}.{s}": a for s, a in t.items()}


def _st(tensors: dict) -> bytes:
    import tempfile

    from exl2fmt.container import write_safetensors

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.safetensors"
        write_safetensors(p, {k: np.ascontiguousarray(a) if a.ndim else a for k, a in tensors.items()})
        return p.read_bytes()


def _header_only(shape: list[int], end: int, data: bytes) -> bytes:
    """A safetensors file whose one tensor, ``<KEY>.trellis`` I16 ``shape``, claims bytes [0, end)."""
    h = json.dumps({f"{KEY}.trellis": {"dtype": "I16", "shape": shape, "data_offsets": [0, end]}},
                   separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _cfg(**kv) -> bytes:
    return json.dumps(dict(CONFIG, **kv), sort_keys=True).encode()


def _nan_svh() -> np.ndarray:
    a = scales(128, 2)
    a[7] = np.nan
    return a


def _runs(code: str | None, *, inspect: tuple[str | None, list[int]] = (None, [0]),
          validate_exit: list[int] = [1], tool_exit: list[int] = [1]) -> list:
    """inspect / validate --deep --json / dequantize / convert --to fp16 with their expectations: ``code`` from
    validate, dequantize and convert (``tool_exit``: 1 for a rule of the format, 3 for FORMAT_UNSUPPORTED)."""
    return [(["inspect", "{case}"], inspect[0], inspect[1]),
            (["validate", "--deep", "--json", "{case}"], code, validate_exit),
            (["dequantize", "{case}", KEY], code, tool_exit),
            (["convert", "{case}", "{out}", "--to", "fp16"], code, tool_exit)]


def generate(out: str | Path = OUT) -> list[dict]:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries: list[dict] = []

    def add(name: str, files: dict[str, bytes], rule: str, description: str, runs: list) -> None:
        (out / name).mkdir()
        for fn, data in files.items():
            (out / name / fn).write_bytes(data)
        entries.append({"path": name, "rule": rule, "description": description,
                        "runs": [{"args": a, "code": c, "exit": e} for a, c, e in runs]})

    def model(name: str, tensors: dict, rule: str, description: str, runs: list, cfg: bytes | None = None) -> None:
        add(name, {"model.safetensors": _st(tensors), "config.json": cfg or _cfg()}, rule, description, runs)

    model("ok_layer", layer(), "-", "the control: one valid EXL3 linear (rate 2, mcg, 120 -> 100 padded to 128)",
          _runs(None, validate_exit=[0], tool_exit=[0]))
    model("trellis_last_dim", layer(trellis=trellis(last=20)), "X3",
          "trellis last dim 20: 16 x 1.25, no rate", _runs("EXL3_RATE", inspect=("EXL3_RATE", [0])))
    model("trellis_2d", layer(trellis=_words(8 * 256, 3).reshape(8, 256)), "X3",
          "a 2-D trellis under a linear's key", _runs("SLOT_SHAPE"))
    model("rate_out_of_range", layer(trellis=trellis(last=144)), "X3",
          "trellis last dim 144: rate 9, outside 1..8", _runs("EXL3_RATE", inspect=("EXL3_RATE", [0])))
    model("half_rate_without_mul1", layer(trellis=trellis(last=40), mcg=None), "X6",
          "rate 2.5 (last dim 40) with no codebook marker (3inst)",
          _runs("EXL3_HALF_RATE", inspect=("EXL3_HALF_RATE", [0])))
    model("half_rate_with_mcg", layer(trellis=trellis(last=56)), "X6", "rate 3.5 with the mcg marker",
          _runs("EXL3_HALF_RATE", inspect=("EXL3_HALF_RATE", [0])))
    model("marker_value", layer(mcg=np.array(12345, np.int32)), "X5", "the mcg marker holds 12345",
          _runs("EXL3_MARKER"))
    model("both_markers", layer(mul1=np.array(MUL1, np.int32)), "X5", "mcg and mul1 markers in one layer",
          _runs("EXL3_MARKER", inspect=("EXL3_MARKER", [0])))
    model("marker_vector", layer(mcg=np.array([MCG], np.int32)), "X5", "the mcg marker as a 1-element vector",
          _runs("SLOT_SHAPE"))
    model("marker_f32", layer(mcg=np.array(1.0, np.float32)), "X5", "an F32 mcg marker", _runs("SLOT_DTYPE"))
    model("suh_length", layer(suh=scales(IN, 1)), "X7", "suh of the unpadded length 120 (in_p is 128)",
          _runs("SLOT_SHAPE"))
    model("svh_length", layer(svh=scales(OUT_F, 2)), "X7", "svh of the unpadded length 100 (out_p is 128)",
          _runs("SLOT_SHAPE"))
    model("su_legacy_length", layer(suh=None, su=_words(16, 4)), "X7",
          "legacy su of 16 words (in_p / 16 is 8)", _runs("SLOT_SHAPE"))
    model("svh_missing", layer(svh=None), "X1", "no svh and no legacy sv", _runs("SLOT_MISSING"))
    model("padding_not_128", layer(trellis=trellis(tk=10), suh=scales(160, 1)), "X4",
          "in_p = 160 (10 tiles): not a multiple of 128", _runs("EXL3_PADDING", inspect=("EXL3_PADDING", [0])))
    model("padding_vs_config", layer(trellis=trellis(tk=16), suh=scales(256, 1)), "X8",
          "in_p = 256 while config.json's intermediate_size 120 pads to 128", _runs("EXL3_PADDING"))
    model("nan_scale_deep", layer(svh=_nan_svh()), "X9",
          "svh[7] is NaN (found by --deep; header-only validation passes)", _runs("NONFINITE_VALUES"))
    model("legacy_scale", layer(scale=np.array(0.5, np.float16)), "X11",
          "a pre-suh per-tensor scale (exllamav3 ignores it)",
          _runs("FORMAT_UNSUPPORTED", inspect=("FORMAT_UNSUPPORTED", [0]), tool_exit=[3]))
    emb = dict(layer(), **{"model.embed_tokens.trellis": _words(64 * 65, 5).reshape(64, 65),
                           "model.embed_tokens.signs": np.ones((1, 256), np.float16)})
    add("quantized_embedding", {"model.safetensors": _st(emb), "config.json": _cfg()}, "X15",
        "a quantized token embedding (exllamav3 --embed_bits, rate 4: trellis [64, 65] and signs [1, 256])",
        [(["inspect", "{case}"], "FORMAT_UNSUPPORTED", [0]),
         (["validate", "--deep", "--json", "{case}"], "FORMAT_UNSUPPORTED", [1]),
         (["dequantize", "{case}", "model.embed_tokens"], "FORMAT_UNSUPPORTED", [3]),
         (["convert", "{case}", "{out}", "--to", "fp16"], "FORMAT_UNSUPPORTED", [3])])
    huge = [1 << 16, 1 << 16, 256]           # 2^40 int16 words: 2 TiB
    add("huge_trellis_truncated", {"model.safetensors": _header_only(huge, 1 << 41, b"\0" * 64),
                                   "config.json": _cfg()}, "X16",
        "a header declaring a trellis of 2^40 elements (2 TiB) over 64 bytes of data",
        _runs("TRUNCATED", inspect=("TRUNCATED", [1])))
    add("huge_trellis_size_mismatch", {"model.safetensors": _header_only(huge, 64, b"\0" * 64),
                                       "config.json": _cfg()}, "X16",
        "a header declaring a trellis of 2^40 elements whose offsets span 64 bytes",
        _runs("SIZE_MISMATCH", inspect=("SIZE_MISMATCH", [1])))
    whole = _st(layer())
    add("truncated_data", {"model.safetensors": whole[: len(whole) - 1000], "config.json": _cfg()}, "X16",
        "the control model's file cut 1000 bytes short (inside the trellis data)",
        _runs("TRUNCATED", inspect=("TRUNCATED", [1])))

    (out / "index.json").write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    lines = [README]
    for en in entries:
        codes = sorted({r["code"] for r in en["runs"] if r["code"]})
        lines.append(f"| `{en['path']}` | {en['rule']} | {', '.join(f'`{c}`' for c in codes) or '-'} | "
                     f"{en['description']} |\n")
    (out / "README.md").write_text("".join(lines), encoding="utf-8")
    return entries


README = """# Hostile catalogue: EXL3 (issue 39)

Generated by `../make_hostile3_exl3.py` (deterministic; edit the generator, not the files). Each case is a model
directory (`model.safetensors` + `config.json`) of one EXL3 linear, `model.layers.0.mlp.down_proj` (120 -> 100
features, padded to 128 x 128), with one rule of `spec/exl3.md` section 9 broken; `ok_layer` is the unbroken
control. `index.json` lists each case: `path`, `rule`, `description` and `runs` (`args` for `exl2fmt` with
`{case}` / `{out}`, the `code` that must appear, the allowed `exit` statuses). `tests/test_hostile3_exl3.py`
runs `inspect`, `validate --deep --json`, `dequantize` and `convert --to fp16` on every case in a fresh process
under `tests/hostile_harness.run_bounded` (wall-clock limit, address-space cap, measured peak RSS, no
traceback). `inspect` reads headers only: it names the rules a header shows (rate, half rate, both markers,
padding, legacy `scale`, quantized embedding, the container's codes) and leaves the rest to `validate`.

## Cases

| case | rule | code | what is wrong |
|---|---|---|---|
"""


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else OUT
    entries = generate(out)
    print(f"wrote {len(entries)} cases to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
