#!/usr/bin/env python3
"""Generate the JSON side-input catalogue of issue 41 (class 6): ``spec/malformed/hostile3_json/`` + ``index.json``.

    python spec/malformed/make_hostile3_json.py            # (re)write the catalogue next to this script
    python spec/malformed/make_hostile3_json.py OUT_DIR    # write it somewhere else (the tests compare the bytes)

Small payloads only; each is used as every JSON side input it applies to (``index.json`` ``uses``): ``config``
(a model's config.json: inspect / validate), ``index`` (model.safetensors.index.json: inspect / validate),
``measurement`` (convert --measurement), ``calibration`` (convert --calibration, as .json / .jsonl / .npy),
``tokenizer`` (the source's tokenizer.json for text calibration) and ``job`` (a work directory's job.json under
convert --resume).  The big and runtime-only cases - a 99 MB ``{}``-heavy file under the byte caps, ``/dev/zero``,
a FIFO, a directory - are made by ``tests/test_hostile3_json.py`` at test time.

Deterministic; needs only the standard library.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_NAME = "hostile3_json"

JSON_USES = ["config", "index", "measurement", "calibration", "tokenizer", "job"]
DEEP = 20_000  # far past Python's recursion limit (1000) and the loader's depth caps (<= 64)


def _npy(header: dict, data: bytes = b"", version: int = 1) -> bytes:
    """A .npy file with a hand-written header (numpy's layout: magic, version, header length, dict literal)."""
    text = "{" + ", ".join(f"'{k}': {v}" for k, v in header.items()) + ", }"
    size_fmt = "<H" if version == 1 else "<I"
    pre = 6 + 2 + struct.calcsize(size_fmt)
    pad = (64 - (pre + len(text) + 1) % 64) % 64
    body = (text + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack(size_fmt, len(body)) + body + data


def cases() -> list[dict]:
    """[{name, file, bytes, uses, why}] - ``uses`` are the inputs the payload is fed to."""
    c: list[dict] = []

    def add(name: str, data: bytes, uses: list[str], why: str, ext: str = ".json") -> None:
        c.append({"name": name, "file": name + ext, "bytes": data, "uses": uses, "why": why})

    add("deep_array", b"[" * DEEP + b"]" * DEEP, JSON_USES, f"arrays nested {DEEP} deep (RecursionError)")
    add("deep_object", b'{"a":' * DEEP + b"1" + b"}" * DEEP, JSON_USES, f"objects nested {DEEP} deep")
    add("deep_in_place", b'{"measurement": ' + b"[" * 200 + b"]" * 200 + b', "weight_map": {}, "model": '
        + b"[" * 200 + b"]" * 200 + b"}", JSON_USES, "200 levels under an expected key (past the 64 cap, under "
        "Python's recursion limit: a consumer that recursed would be next)")
    add("bigint_5000", b'{"vocab_size": 1' + b"0" * 5000 + b', "measurement": 1' + b"0" * 5000 + b"}", JSON_USES,
        "5000-digit integers (ValueError of the int-conversion limit)")
    add("float_1e400", b'{"vocab_size": 1e400, "measurement": {"x": 1e400}, "weight_map": {"a": 1e400}}',
        JSON_USES, "1e400 (inf after float(); OverflowError in int())")
    add("nan", b'{"hidden_size": NaN, "measurement": {}, "weight_map": {}}', JSON_USES,
        "NaN is not JSON (Python accepts it)")
    add("lone_surrogate", b'{"architectures": ["\\ud800"], "measurement": {}, "weight_map": {"\\udfff": "x"}}',
        JSON_USES, "an unpaired UTF-16 surrogate escape (no UTF-8 writer can emit it)")
    add("not_utf8", b'{"architectures": ["\xff\xfe"]}', JSON_USES, "bytes that are not UTF-8")
    add("truncated", b'{"measurement": {"a": [1, 2', JSON_USES, "JSON cut short")
    add("empty", b"", JSON_USES, "an empty file")
    add("top_array", b"[]", JSON_USES, "an array where an object is expected")
    add("top_string", b'"model"', JSON_USES, "a string where an object (or a list of ids) is expected")
    # kind-specific wrong types
    add("measurement_block_string", b'{"measurement": {"model.layers.0.self_attn": "x", "model.layers.0.mlp": 7}}',
        ["measurement"], "a block measured as a string / a number instead of a list of options")
    add("measurement_layer_5000_digits", b'{"measurement": {"model.layers.1' + b"0" * 5000 + b'.mlp": []}}',
        ["measurement"], "a block key with a 5000-digit layer number (int() raised)")
    add("measurement_qparams_wrong", json.dumps({"measurement": {"model.layers.0.self_attn": [
        {"accuracy": 0.9, "total_bits": 10, "q_proj": {"bits": "four", "bits_prop": [1], "group_size": {}}}]}}
        ).encode(), ["measurement"], "a QParams dict whose bits are a string")
    add("ids_row_not_list", b"[[1, 2, 3], 5, [4]]", ["calibration"], "token-id rows mixing lists and numbers")
    add("ids_not_ints", b'[[1, 2, "3"]]', ["calibration"], "a token id that is a string")
    add("ids_huge", b"[" + b", ".join([b"1" + b"0" * 40] * 4) + b"]", ["calibration"],
        "token ids of 41 digits (beyond int64)")
    add("job_wrong_types", json.dumps({"measured": [], "quantized": {}, "snapshot": "x", "strategy": 3}).encode(),
        ["job"], "job.json fields of the wrong type")
    # .jsonl calibration lines
    add("jsonl_deep_line", b'{"text": "ok"}\n' + b"[" * DEEP + b"]" * DEEP + b"\n", ["calibration"],
        "a .jsonl line nested 20000 deep", ".jsonl")
    add("jsonl_bigint_line", b'{"text": "ok"}\n{"text": 1' + b"0" * 5000 + b"}\n", ["calibration"],
        "a .jsonl line with a 5000-digit number", ".jsonl")
    add("jsonl_array_line", b'{"text": "ok"}\n["text"]\n', ["calibration"], "a .jsonl line that is an array",
        ".jsonl")
    # .npy calibration ids: the header is checked against the file size before anything is built
    add("npy_10m_empty_rows", _npy({"descr": "'<i8'", "fortran_order": "False", "shape": "(10000000, 0)"}),
        ["calibration"], "a 128-byte .npy declaring 10^7 empty rows", ".npy")
    add("npy_shape_past_eof", _npy({"descr": "'<i8'", "fortran_order": "False", "shape": "(10000000, 10000000)"}),
        ["calibration"], "a .npy declaring 10^14 int64 with no data", ".npy")
    add("npy_object", _npy({"descr": "'|O'", "fortran_order": "False", "shape": "(2,)"}, b"\x80\x04N."),
        ["calibration"], "a .npy of Python objects (a pickle)", ".npy")
    add("npy_header_bigint", _npy({"descr": "'<i8'", "fortran_order": "False", "shape": "(1" + "0" * 5000 + ",)"}),
        ["calibration"], "a .npy header with a 5000-digit dimension", ".npy")
    add("npy_3d", _npy({"descr": "'<i8'", "fortran_order": "False", "shape": "(1, 1, 1)"}, b"\0" * 8),
        ["calibration"], "a 3-D id array", ".npy")
    add("npy_negative_dim", _npy({"descr": "'<i8'", "fortran_order": "False", "shape": "(-1, 4)"}),
        ["calibration"], "a negative dimension", ".npy")
    return c


def write(out: Path) -> None:
    """The case files and index.json (a README.md already there is kept)."""
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for case in cases():
        (out / case["file"]).write_bytes(case["bytes"])
        index.append({k: case[k] for k in ("name", "file", "uses", "why")})
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / OUT_NAME
    write(target)
    print(f"wrote {len(cases())} cases to {target}")
