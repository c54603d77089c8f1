"""Tests of exl2fmt.container: header parser, reader, model directories, writer.

The reference is the safetensors library itself (``safetensors.deserialize`` runs the Rust
``SafeTensors::deserialize``, which validates the whole header and needs no numpy dtype for BF16/F8/F4).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

from exl2fmt import container as C
from exl2fmt.container import parse as P
from exl2fmt.container import reader as R
from exl2fmt.container import (
    MAX_HEADER_BYTES, SAFETENSORS_DTYPES, STRICTER_THAN_REFERENCE, RawTensor, SafetensorsFile, SafetensorsHeader,
    open_model, parse_header, read_header, serialize, write_safetensors, write_sharded,
)
from exl2fmt.errors import ErrorCode, Exl2Error, Severity, escape_name

EXAMPLES = int(os.environ.get("EXL2FMT_HYPOTHESIS_EXAMPLES", "200"))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def mk(header, data: bytes = b"", n: int | None = None) -> bytes:
    """Hand-built file: 8-byte length, header (dict -> compact JSON, str or bytes as is), data."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    hb = header.encode("utf-8") if isinstance(header, str) else header
    return struct.pack("<Q", len(hb) if n is None else n) + hb + data


def ent(dtype="U8", shape=(2,), begin=0, end=2):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def ref_accepts(buf: bytes) -> bool:
    try:
        safetensors.deserialize(buf)
        return True
    except safetensors.SafetensorError:
        return False


def ours(buf: bytes):
    try:
        return parse_header(buf, file_size=len(buf), path="attack.safetensors")
    except Exl2Error as e:
        return e


def expect(buf: bytes, code: ErrorCode, tensor: str | None = None, *, ref_rejects: bool = True) -> Exl2Error:
    """Assert our parser rejects with ``code``, and whether the reference rejects too (``ref_rejects=False``
    only for the documented stricter-than-reference rules)."""
    r = ours(buf)
    assert isinstance(r, Exl2Error), f"accepted, expected {code}"
    assert r.code is code, f"expected {code}, got {r.code}: {r}"
    assert r.file == "attack.safetensors"
    assert "attack.safetensors" in str(r)
    if tensor is not None:
        assert r.tensor == tensor
        assert escape_name(tensor) in str(r)
    if not ref_rejects:
        assert code in STRICTER_THAN_REFERENCE
    assert ref_accepts(buf) is (not ref_rejects)
    return r


def expect_ok(buf: bytes) -> SafetensorsHeader:
    r = ours(buf)
    assert isinstance(r, SafetensorsHeader), str(r)
    assert ref_accepts(buf)
    return r


# ------------------------------------------------------------------------------------------------
# dtype table and module hygiene
# ------------------------------------------------------------------------------------------------

def test_dtype_table_is_exactly_what_the_reference_accepts():
    err = None
    try:
        safetensors.deserialize(mk({"a": ent("NOPE", (0,), 0, 0)}))
    except safetensors.SafetensorError as e:
        err = str(e)
    assert err is not None
    listed = re.findall(r"`([A-Z0-9_]+)`", err.split("expected one of", 1)[1])
    assert listed == list(SAFETENSORS_DTYPES)  # same set, same (alignment) order
    for name, spec in SAFETENSORS_DTYPES.items():
        nbytes = 8 * spec.bits // 8
        buf = mk({"a": ent(name, (8,), 0, nbytes)}, b"\x01" * nbytes)
        out = safetensors.deserialize(buf)
        assert out[0][1]["dtype"] == name and len(out[0][1]["data"]) == nbytes
        expect_ok(buf)
        if spec.numpy is not None:
            assert spec.numpy.itemsize * 8 == spec.bits
            assert spec.numpy == spec.numpy.newbyteorder("<")  # little-endian on every host
    assert SAFETENSORS_DTYPES["BF16"].numpy == np.dtype("<u2")
    assert SAFETENSORS_DTYPES["F4"].numpy is None and SAFETENSORS_DTYPES["F4"].bits == 4
    assert {"F8_E4M3FNUZ", "F8_E5M2FNUZ"} <= set(SAFETENSORS_DTYPES)


def _top_level_imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def test_container_imports_only_numpy_and_stdlib():
    # every module of the package; only the checksum (the streaming writer's and verify's) needs Numba
    files = sorted(Path(C.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "parse.py", "reader.py", "writer.py", "publish.py", "checksums.py"}
    for f in files:
        heavy = _top_level_imports(f) & {"torch", "numba", "rich", "typer", "safetensors"}
        assert heavy == ({"numba"} if f.name == "checksums.py" else set()), (f.name, heavy)
    # and importing the package (what inspect/validate do) loads none of them
    code = ("import sys, exl2fmt.container, exl2fmt.container.publish, exl2fmt.container.partials; "
            "print(sorted(m for m in ('torch', 'numba', 'rich', 'typer', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stricter_rules_are_documented():
    from exl2fmt.container import parse

    doc = parse.__doc__
    for code in STRICTER_THAN_REFERENCE:
        assert code.value in doc
    assert ErrorCode.TOO_MANY_TENSORS.rule


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------

NUMPY_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                np.float16, np.float32, np.float64, np.complex64]


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_numpy_dtype(tmp_path, dtype):
    tensors = {
        "matrix": _sample(dtype, (3, 5), 1),
        "scalar": _sample(dtype, (), 2),
        "empty": _sample(dtype, (0, 4), 3),
        "vector.weight": _sample(dtype, (7,), 4),
        "nd": _sample(dtype, (2, 1, 3, 1, 2, 1, 1, 2), 5),
    }
    meta = {"format": "np", "note": "ünïcode ✓"}
    p = write_safetensors(tmp_path / "t.safetensors", tensors, meta)
    hdr = read_header(p)
    assert hdr.metadata == meta
    assert list(hdr.tensors) == sorted(tensors)  # name order, offsets ascending
    with SafetensorsFile(p) as f:
        assert f.metadata == meta
        for name, arr in tensors.items():
            got = f.get(name)
            assert got.dtype == arr.dtype.newbyteorder("<") or got.dtype == arr.dtype
            assert got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)
            assert not got.flags.writeable
            info = f.info(name)
            assert info.shape == arr.shape and info.nbytes == arr.nbytes and info.numel == arr.size
    # the reference reads the same thing
    with safetensors.safe_open(str(p), framework="numpy") as rf:
        assert rf.metadata() == meta
        for name, arr in tensors.items():
            np.testing.assert_array_equal(rf.get_tensor(name), arr)


def test_raw_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "bf16": RawTensor("BF16", (2, 3), rng.integers(0, 2**16, size=6, dtype=np.uint16)),
        "e4m3": RawTensor("F8_E4M3", (5,), rng.integers(0, 256, size=5, dtype=np.uint8)),
        "e5m2fnuz": RawTensor("F8_E5M2FNUZ", (1, 4), rng.integers(0, 256, size=4, dtype=np.uint8)),
        "f4": RawTensor("F4", (3, 2), rng.integers(0, 256, size=3, dtype=np.uint8)),
        "f6": RawTensor("F6_E2M3", (4,), rng.integers(0, 256, size=3, dtype=np.uint8)),
        "f6_empty": RawTensor("F6_E3M2", (0,), np.zeros(0, np.uint8)),
        "bf16_be": RawTensor("BF16", (2,), np.array([0x1234, 0xABCD], dtype=">u2")),
    }
    p = write_safetensors(tmp_path / "raw.safetensors", tensors)
    ref = {n: d for n, d in safetensors.deserialize(p.read_bytes())}
    with SafetensorsFile(p) as f:
        assert f.get("bf16").dtype == np.dtype("<u2") and f.get("bf16").shape == (2, 3)
        np.testing.assert_array_equal(f.get("bf16").ravel(), tensors["bf16"].data)
        np.testing.assert_array_equal(f.get("bf16_be"), [0x1234, 0xABCD])
        assert f.get("e4m3").dtype == np.uint8
        assert f.get("f4").shape == (3,) and f.get("f4").dtype == np.uint8  # packed bytes
        assert f.get("f6").shape == (3,)
        assert f.get("f6_empty").shape == (0,)
        for name, t in tensors.items():
            assert ref[name]["dtype"] == t.dtype
            assert list(ref[name]["shape"]) == list(t.shape)
            assert bytes(f.get_bytes(name)) == bytes(ref[name]["data"])


def test_byte_identical_to_reference_writer():
    mixed = {"b": np.arange(3, dtype=np.float32), "a": np.ones(2, np.float16), "c": np.array(5, np.int64),
             "z": np.zeros((0, 3), np.uint8), "bool": np.array([True, False]), "cx": np.ones(2, np.complex64)}
    # the reference orders by descending dtype alignment, then name
    assert serialize(mixed, {"k": "v"}, order="safetensors") == st_save(mixed, metadata={"k": "v"})
    assert serialize(mixed, order="safetensors") == st_save(mixed)
    # with one dtype both orders coincide, so the default (name) order is byte-identical too
    same = {"x\n\"é\x7f\u2028": np.zeros(1, np.float32), "b": np.ones((2, 2), np.float32), "a": np.ones(0, np.float32)}
    assert serialize(same) == st_save(same)
    assert serialize(same, {}) == st_save(same, metadata={})
    # mixed dtypes in name order differ from the reference bytes but read identically
    ours_bytes = serialize(mixed)
    ref = {n: (d["dtype"], list(d["shape"]), bytes(d["data"])) for n, d in safetensors.deserialize(ours_bytes)}
    ref2 = {n: (d["dtype"], list(d["shape"]), bytes(d["data"])) for n, d in safetensors.deserialize(st_save(mixed))}
    assert ref == ref2


def test_big_endian_and_strided_inputs_are_written_little_endian(tmp_path):
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2]
    p = write_safetensors(tmp_path / "be.safetensors", {"be": be, "strided": strided})
    with SafetensorsFile(p) as f:
        np.testing.assert_array_equal(f.get("be"), be)
        np.testing.assert_array_equal(f.get("strided"), strided)
    raw = p.read_bytes()
    hdr = read_header(p)
    t = hdr.tensors["be"]
    assert raw[t.abs_begin:t.abs_begin + 8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"


def test_header_is_padded_to_8_with_spaces(tmp_path):
    for k in range(10):
        buf = serialize({"t" * k: np.zeros(k, np.uint8)})
        (n,) = struct.unpack("<Q", buf[:8])
        assert n % 8 == 0
        assert buf[8:8 + n].rstrip(b" ").endswith(b"}")
        assert expect_ok(buf).header_len == n


def test_zero_size_tensors_may_share_the_running_offset():
    buf = mk({"z0": ent("U8", (0,), 0, 0), "a": ent("U8", (2,), 0, 2), "z2": ent("F32", (0, 3), 2, 2)}, b"ab")
    h = expect_ok(buf)
    assert list(h.tensors) == ["z0", "a", "z2"]


def test_read_header_never_reads_data(tmp_path, monkeypatch):
    p = tmp_path / "big.safetensors"
    p.write_bytes(serialize({"w": np.zeros(1 << 16, np.float32)}))
    reads = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __getattr__(self, a):
            return getattr(self.f, a)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr("builtins.open", lambda *a, **k: Spy(real_open(*a, **k)))
    h = read_header(p)
    assert sum(reads) == h.data_start and all(r >= 0 for r in reads)


# ------------------------------------------------------------------------------------------------
# one test per attack / error code
# ------------------------------------------------------------------------------------------------

def test_file_shorter_than_length_prefix():
    for buf in (b"", b"\x00" * 7):
        expect(buf, ErrorCode.HEADER_TOO_SMALL)


def test_header_length_over_the_100mb_cap():
    e = expect(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", ErrorCode.HEADER_TOO_LARGE)
    assert str(MAX_HEADER_BYTES) in e.message
    expect(struct.pack("<Q", 2**64 - 1) + b"{}", ErrorCode.HEADER_TOO_LARGE)


def test_header_length_past_eof():
    e = expect(mk("{}", n=100), ErrorCode.HEADER_PAST_EOF)
    assert "108" in e.message and "10" in e.message
    expect(mk(b"", n=MAX_HEADER_BYTES), ErrorCode.HEADER_PAST_EOF)


def test_header_length_past_eof_on_disk_allocates_nothing(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES) + b"{}")
    with pytest.raises(Exl2Error) as ei:
        read_header(p)
    assert ei.value.code is ErrorCode.HEADER_PAST_EOF and ei.value.file == str(p)


def test_header_not_utf8():
    expect(mk(b'{"\xff":1}'), ErrorCode.HEADER_NOT_UTF8)
    expect(mk(b'{"a\xed\xa0\x80":1}'), ErrorCode.HEADER_NOT_UTF8)  # CESU surrogate bytes


@pytest.mark.parametrize("header", [
    "", "garbage", "[]", "null", '"{}"', "{", '{"a":}', "{} x", "{}\x00", '{"a":NaN}', "\ufeff{}",
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":Infinity}}',
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1e400}}',
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + "9" * 400 + "}}",
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":"\\ud800"}}',
    '{"\\udc00":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + "[" * 126 + "]" * 126 + "}}",
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + "[" * 5000 + "]" * 5000 + "}}",
], ids=lambda h: repr(h[:24]))
def test_header_not_a_json_object(header):
    expect(mk(header), ErrorCode.HEADER_NOT_JSON)


def test_json_edge_cases_the_reference_accepts():
    expect_ok(mk("{}\t\r\n  "))  # trailing JSON whitespace (padding)
    expect_ok(mk('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + "[" * 125 + "]" * 125 + "}}"))
    expect_ok(mk('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":[-0, 1e300, "\\ud83d\\ude00", '
                 + "9" * 300 + ', {"q": null}]}}'))
    expect_ok(mk('{"\\u0061":{"\\u0064type":"U8","shape":[0],"data_offsets":[0,0]}}'))


def test_leading_whitespace_before_brace():
    # the reference skips it; the README says the header MUST begin with '{'
    e = expect(mk(" {}"), ErrorCode.HEADER_NOT_JSON, ref_rejects=False)
    assert "leading whitespace" in e.message


def test_duplicate_tensor_name():
    h = '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    expect(mk(h, b"ab"), ErrorCode.DUPLICATE_KEY, tensor="a", ref_rejects=False)
    # via escapes: the keys are equal after unescaping
    h2 = h.replace('"a"', '"\\u0061"', 1)
    expect(mk(h2, b"ab"), ErrorCode.DUPLICATE_KEY, tensor="a", ref_rejects=False)


def test_duplicate_tensor_name_retypes_the_tensor():
    # the reference keeps the last entry: these bytes load as U8 there, as F16 in a first-wins reader
    h = '{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'
    expect(mk(h, b"abcd"), ErrorCode.DUPLICATE_KEY, tensor="a", ref_rejects=False)
    assert [d["dtype"] for _, d in safetensors.deserialize(mk(h, b"abcd"))] == ["U8"]
    # a duplicate whose surviving entry leaves bytes uncovered is rejected by both
    h = '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    expect(mk(h, b"evil"), ErrorCode.DUPLICATE_KEY, tensor="a", ref_rejects=True)


def test_duplicate_keys_in_nested_objects():
    expect(mk('{"__metadata__":{"x":"1","x":"2"}}'), ErrorCode.DUPLICATE_KEY, ref_rejects=False)
    expect(mk('{"__metadata__":{},"__metadata__":{}}'), ErrorCode.DUPLICATE_KEY, ref_rejects=True)
    e = expect(mk('{"a":{"dtype":"U8","dtype":"U8","shape":[0],"data_offsets":[0,0]}}'), ErrorCode.DUPLICATE_KEY,
               ref_rejects=True)
    assert e.tensor is None and "dtype" in e.message


@pytest.mark.parametrize("meta,ref_rejects", [
    ('{"x":1}', True), ('{"x":null}', True), ('{"x":["a"]}', True), ("[]", True), ('"s"', True), ("1", True),
    ("null", False),
])
def test_metadata_not_str_to_str(meta, ref_rejects):
    expect(mk('{"__metadata__":' + meta + "}"), ErrorCode.METADATA_INVALID, ref_rejects=ref_rejects)


def test_metadata_is_kept():
    h = expect_ok(mk('{"__metadata__":{"format":"pt","é":"✓"}}'))
    assert h.metadata == {"format": "pt", "é": "✓"} and h.has_metadata


@pytest.mark.parametrize("entry,ref_rejects", [
    ("1", True), ('"x"', True), ("null", True), ("{}", True),
    ('{"shape":[0],"data_offsets":[0,0]}', True), ('{"dtype":"U8","data_offsets":[0,0]}', True),
    ('{"dtype":"U8","shape":[0]}', True), ('{"dtype":5,"shape":[0],"data_offsets":[0,0]}', True),
    ('{"dtype":"U8","shape":{"0":0},"data_offsets":[0,0]}', True),
    ('{"dtype":"U8","shape":[0],"data_offsets":{"0":0,"1":0}}', True),
    ('{"dtype":"U8","shape":null,"data_offsets":[0,0]}', True),
    ('["U8",[0],[0,0]]', False),                                   # serde: struct from a sequence
    ('{"dtype":{"U8":null},"shape":[0],"data_offsets":[0,0]}', False),  # serde: enum as a map
])
def test_malformed_tensor_entry(entry, ref_rejects):
    expect(mk('{"w":' + entry + "}"), ErrorCode.TENSOR_ENTRY_INVALID, tensor="w", ref_rejects=ref_rejects)


def test_unknown_dtype():
    for dt in ("X", "bf16", "C128", "F8_E4M3FN", "", "U4"):
        e = expect(mk({"w": ent(dt, (0,), 0, 0)}), ErrorCode.DTYPE_UNKNOWN, tensor="w")
        assert "BF16" in e.message  # says what was expected


@pytest.mark.parametrize("shape", ["[true]", "[1.0]", "[-1]", "[-0]", "[2e0]", '["2"]', "[null]", "[[2]]",
                                   "[18446744073709551616]"])
def test_bad_dimension(shape):
    expect(mk('{"w":{"dtype":"U8","shape":' + shape + ',"data_offsets":[0,2]}}', b"ab"), ErrorCode.SHAPE_INVALID,
           tensor="w")


def test_more_than_eight_dims():
    expect(mk({"w": ent("U8", (1,) * 9, 0, 1)}, b"a"), ErrorCode.SHAPE_INVALID, tensor="w", ref_rejects=False)
    expect_ok(mk({"w": ent("U8", (1,) * 8, 0, 1)}, b"a"))


@pytest.mark.parametrize("offsets", ["[2,0]", "[-1,1]", "[0]", "[0,2,2]", "[true,2]", "[0,2.0]", "[0,-0]",
                                     '["0","2"]', "null", "[0,18446744073709551616]"])
def test_bad_data_offsets(offsets):
    code = ErrorCode.TENSOR_ENTRY_INVALID if offsets == "null" else ErrorCode.OFFSETS_INVALID
    expect(mk('{"w":{"dtype":"U8","shape":[2],"data_offsets":' + offsets + "}}", b"ab"), code, tensor="w")


def test_offsets_at_u64_max():
    expect(mk({"w": ent("U8", (0,), 2**64 - 1, 2**64 - 1)}), ErrorCode.OFFSETS_GAP, tensor="w")


def test_gap_between_tensors():
    e = expect(mk({"a": ent("U8", (2,), 0, 2), "b": ent("U8", (2,), 3, 5)}, b"abXcd"), ErrorCode.OFFSETS_GAP,
               tensor="b")
    assert "2" in e.message and "3" in e.message


def test_first_tensor_not_at_zero():
    expect(mk({"a": ent("U8", (2,), 1, 3)}, b"Xab"), ErrorCode.OFFSETS_GAP, tensor="a")


def test_zero_size_tensor_past_the_running_offset():
    # a zero-size tensor inside another tensor's bytes is rejected (only the running offset is allowed)
    expect(mk({"z": ent("U8", (0,), 1, 1), "a": ent("U8", (2,), 0, 2)}, b"ab"), ErrorCode.OFFSETS_OVERLAP, tensor="z")


def test_overlapping_offsets():
    e = expect(mk({"a": ent("U8", (4,), 0, 4), "b": ent("U8", (2,), 2, 4)}, b"abcd"), ErrorCode.OFFSETS_OVERLAP,
               tensor="b")
    assert "'a'" in e.message
    expect(mk({"a": ent("U8", (2,), 0, 2), "b": ent("U8", (2,), 0, 2)}, b"ab"), ErrorCode.OFFSETS_OVERLAP)


def test_shape_product_overflow():
    expect(mk({"w": ent("U8", (2**32, 2**32), 0, 0)}), ErrorCode.SIZE_OVERFLOW, tensor="w")
    expect(mk({"w": ent("U64", (2**61,), 0, 0)}), ErrorCode.SIZE_OVERFLOW, tensor="w")  # numel*bits
    expect(mk({"w": ent("F4", (2**62,), 0, 0)}), ErrorCode.SIZE_OVERFLOW, tensor="w")
    # the reference's running checked_mul overflows before reaching the 0 dim
    expect(mk({"w": ent("U8", (2**32, 2**32, 0), 0, 0)}), ErrorCode.SIZE_OVERFLOW, tensor="w")
    # a leading 0 keeps every partial product at 0: accepted by both
    expect_ok(mk({"w": ent("U8", (0, 2**64 - 1, 2**64 - 1), 0, 0)}))


def test_sub_byte_tensor_not_ending_on_a_byte():
    expect(mk({"w": ent("F4", (3,), 0, 2)}, b"ab"), ErrorCode.MISALIGNED_SLICE, tensor="w")
    expect(mk({"w": ent("F6_E2M3", (2,), 0, 2)}, b"ab"), ErrorCode.MISALIGNED_SLICE, tensor="w")
    expect_ok(mk({"w": ent("F6_E3M2", (4,), 0, 3)}, b"abc"))


def test_small_shape_with_large_offsets():
    # the exllamav2 stloader attack: a large read into a small tensor
    e = expect(mk({"w": ent("F16", (2,), 0, 4096)}, b"\0" * 4096), ErrorCode.SIZE_MISMATCH, tensor="w")
    assert "4" in e.message and "4096" in e.message
    expect(mk({"w": ent("F32", (4,), 0, 8)}, b"\0" * 8), ErrorCode.SIZE_MISMATCH, tensor="w")


def test_truncated_data():
    buf = serialize({"w": np.arange(100, dtype=np.float32)})
    e = expect(buf[:-1], ErrorCode.TRUNCATED, tensor="w")
    assert str(len(buf)) in e.message and str(len(buf) - 1) in e.message
    expect(mk({"w": ent("U8", (2**40,), 0, 2**40)}, b"abc"), ErrorCode.TRUNCATED)


def test_appended_bytes():
    buf = serialize({"w": np.arange(4, dtype=np.int32)})
    expect(buf + b"polyglot", ErrorCode.TRAILING_BYTES)
    expect(mk("{}", b"x"), ErrorCode.TRAILING_BYTES)


def test_too_many_tensors(monkeypatch):
    monkeypatch.setattr(P, "MAX_TENSORS", 3)
    buf = mk({f"t{i}": ent("U8", (0,), 0, 0) for i in range(4)})
    expect(buf, ErrorCode.TOO_MANY_TENSORS, ref_rejects=False)
    expect_ok(mk({f"t{i}": ent("U8", (0,), 0, 0) for i in range(3)}))


def test_tensor_not_found(tmp_path):
    p = write_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float16)})
    with SafetensorsFile(p) as f:
        for call in (f.get, f.info, f.get_bytes):
            with pytest.raises(Exl2Error) as ei:
                call("nope")
            assert ei.value.code is ErrorCode.TENSOR_NOT_FOUND and ei.value.tensor == "nope"
    with open_model(p) as m:
        with pytest.raises(Exl2Error) as ei:
            m.get("nope")
        assert ei.value.code is ErrorCode.TENSOR_NOT_FOUND


def test_check_order_is_documented_and_predictable():
    # several problems at once: the earliest check in the documented order wins
    assert ours(mk({"__metadata__": 1, "a": 2})).code is ErrorCode.METADATA_INVALID
    assert ours(mk({"a": ent("X", (-1,), 5, 1)})).code is ErrorCode.DTYPE_UNKNOWN
    assert ours(mk({"a": ent("U8", (-1,), 5, 1)})).code is ErrorCode.SHAPE_INVALID
    assert ours(mk({"a": ent("U8", (3,), 5, 1)})).code is ErrorCode.OFFSETS_INVALID
    assert ours(mk({"a": ent("U8", (3,), 5, 6)})).code is ErrorCode.SIZE_MISMATCH
    assert ours(mk({"a": ent("U8", (1,), 5, 6), "b": ent("U8", (3,), 0, 1)})).code is ErrorCode.SIZE_MISMATCH
    assert ours(mk({"a": ent("U8", (1,), 5, 6)}, b"x")).code is ErrorCode.OFFSETS_GAP
    buf = mk('{"a":1,"a":2,"b":}')
    assert ours(buf).code is ErrorCode.HEADER_NOT_JSON  # syntax before duplicates


def test_names_with_control_characters_are_escaped_in_messages():
    buf = mk({"evil\x1b[2J\n": ent("U8", (2,), 0, 3)}, b"abc")
    e = expect(buf, ErrorCode.SIZE_MISMATCH, tensor="evil\x1b[2J\n")
    assert "\x1b" not in str(e) and "\n" not in str(e)


def test_parse_header_accepts_a_prefix_and_bytes_likes():
    buf = serialize({"w": np.zeros(1000, np.float32)})
    h = parse_header(buf, file_size=len(buf), path="p")
    assert parse_header(buf[:h.data_start], file_size=len(buf), path="p") == h
    assert parse_header(bytearray(buf), file_size=len(buf), path="p") == h
    assert parse_header(memoryview(buf), file_size=len(buf), path="p") == h
    with pytest.raises(Exl2Error) as ei:
        parse_header(buf[:h.data_start - 1], file_size=len(buf), path="p")
    assert ei.value.code is ErrorCode.HEADER_PAST_EOF


# ------------------------------------------------------------------------------------------------
# differential fuzzing against the reference
# ------------------------------------------------------------------------------------------------

NAMES = st.text(alphabet=st.characters(codec="utf-8"), max_size=6)


@st.composite
def valid_files(draw):
    names = draw(st.lists(NAMES.filter(lambda s: s != "__metadata__"), max_size=4, unique=True))
    tensors = {}
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    for name in names:
        dt = draw(st.sampled_from(list(SAFETENSORS_DTYPES)))
        bits = SAFETENSORS_DTYPES[dt].bits
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        if math.prod(shape) * bits % 8:
            shape.append(4)
        nbytes = math.prod(shape) * bits // 8
        tensors[name] = RawTensor(dt, tuple(shape), np.frombuffer(rng.bytes(nbytes), np.uint8))
    metadata = draw(st.none() | st.dictionaries(NAMES, NAMES, max_size=3))
    order = draw(st.sampled_from(["name", "safetensors"]))
    return serialize(tensors, metadata, order=order)


JUNK_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | NAMES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3), max_leaves=8)

ODD_INTS = st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 16, 2**32, 2**63, 2**64 - 1, 2**64, True, False, 1.0, None, "1"])


def _split(buf: bytes):
    (n,) = struct.unpack("<Q", buf[:8])
    return buf[8:8 + n], buf[8 + n:]


@st.composite
def corrupted_files(draw):
    buf = draw(valid_files())
    kind = draw(st.sampled_from(["none", "flip", "truncate", "append", "json", "json", "json", "json", "length"]))
    if kind == "none":
        return buf
    if kind == "flip":
        hb, _ = _split(buf)
        hi = 8 + len(hb) if draw(st.booleans()) else len(buf)
        out = bytearray(buf)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, hi - 1))
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    if kind == "truncate":
        return buf[:draw(st.integers(0, len(buf) - 1))]
    if kind == "append":
        return buf + draw(st.binary(min_size=1, max_size=16))
    if kind == "length":
        n = draw(st.integers(0, 2**64 - 1) | st.integers(0, len(buf) + 8))
        return struct.pack("<Q", n) + buf[8:]
    # JSON edits
    hb, data = _split(buf)
    hdr = json.loads(hb)
    names = [k for k in hdr if k != "__metadata__"]
    op = draw(st.sampled_from(["offsets", "shift", "shape", "dtype", "entry_list", "dtype_map", "meta", "unknown",
                               "dup", "lead_ws", "trail_ws", "delete", "swap_offsets", "ndim", "data"]))
    raw_prefix, raw_suffix = "", ""
    if op in ("offsets", "shift", "shape", "dtype", "entry_list", "dtype_map", "unknown", "delete", "ndim",
              "swap_offsets") and not names:
        op = "meta"
    if op == "offsets":
        name = draw(st.sampled_from(names))
        hdr[name]["data_offsets"] = draw(st.lists(ODD_INTS, min_size=1, max_size=3) | st.tuples(ODD_INTS, ODD_INTS))
    elif op == "shift":
        name = draw(st.sampled_from(names))
        d = draw(st.integers(-3, 3))
        which = draw(st.sampled_from([0, 1, 2]))
        b, e = hdr[name]["data_offsets"]
        hdr[name]["data_offsets"] = [b + d if which != 1 else b, e + d if which != 0 else e]
    elif op == "shape":
        name = draw(st.sampled_from(names))
        hdr[name]["shape"] = draw(st.lists(ODD_INTS | st.integers(0, 5), max_size=4))
    elif op == "ndim":
        name = draw(st.sampled_from(names))
        hdr[name]["shape"] = hdr[name]["shape"] + [1] * draw(st.integers(5, 10))
    elif op == "dtype":
        name = draw(st.sampled_from(names))
        hdr[name]["dtype"] = draw(st.sampled_from(list(SAFETENSORS_DTYPES) + ["X", "bf16", "", "F8_E4M3FN", 5, None]))
    elif op == "entry_list":
        name = draw(st.sampled_from(names))
        e = hdr[name]
        hdr[name] = [e["dtype"], e["shape"], e["data_offsets"]]
    elif op == "dtype_map":
        name = draw(st.sampled_from(names))
        hdr[name]["dtype"] = {hdr[name]["dtype"]: None}
    elif op == "meta":
        hdr["__metadata__"] = draw(st.none() | JUNK_JSON | st.dictionaries(NAMES, NAMES, max_size=2))
    elif op == "unknown":
        name = draw(st.sampled_from(names))
        hdr[name][draw(NAMES)] = draw(JUNK_JSON)
    elif op == "delete":
        del hdr[draw(st.sampled_from(names))]
    elif op == "swap_offsets" and len(names) >= 2:
        a, b = draw(st.permutations(names))[:2]
        hdr[a]["data_offsets"], hdr[b]["data_offsets"] = hdr[b]["data_offsets"], hdr[a]["data_offsets"]
    elif op == "lead_ws":
        raw_prefix = draw(st.text(alphabet=" \t\r\n", min_size=1, max_size=3))
    elif op == "trail_ws":
        raw_suffix = draw(st.text(alphabet=" \t\r\n\x00\x0c", min_size=1, max_size=3))
    elif op == "data":
        data = data + b"\x00" if draw(st.booleans()) or not data else data[:-1]
    text = json.dumps(hdr, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    if op == "dup" and names:
        # repeat one entry textually (a second "name": {...}) at the end of the object
        name = draw(st.sampled_from(names))
        text = text[:-1] + "," + json.dumps(name) + ":" + json.dumps(hdr[name]) + "}"
    elif op == "dup":
        text = text[:-1] + ("," if hdr else "") + '"__metadata__":{"k":"v","k":"w"}}'
    text = raw_prefix + text + raw_suffix
    return mk(text, data)


def _stricter_reason_holds(code: ErrorCode, buf: bytes) -> bool:
    """The documented reason for each STRICTER_THAN_REFERENCE rule, recomputed independently."""
    hb, _ = _split(buf)
    text = hb.decode("utf-8")
    if code is ErrorCode.HEADER_NOT_JSON:
        return text[:1] in (" ", "\t", "\r", "\n") and text.lstrip(" \t\r\n").startswith("{")
    dups = []

    def hook(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            dups.append(pairs)
        return dict(pairs)

    doc = json.loads(text, object_pairs_hook=hook)
    if code is ErrorCode.DUPLICATE_KEY:
        return bool(dups)
    entries = [v for k, v in doc.items() if k != "__metadata__"]
    if code is ErrorCode.METADATA_INVALID:
        return "__metadata__" in doc and doc["__metadata__"] is None
    if code is ErrorCode.TENSOR_ENTRY_INVALID:
        return any(isinstance(e, list) or (isinstance(e, dict) and isinstance(e.get("dtype"), dict)) for e in entries)
    if code is ErrorCode.SHAPE_INVALID:
        shapes = [e[1] if isinstance(e, list) else e.get("shape") for e in entries]
        return any(isinstance(s, list) and len(s) > 8 for s in shapes)
    if code is ErrorCode.TOO_MANY_TENSORS:
        return len(entries) > C.MAX_TENSORS
    return False


def _differential(buf: bytes) -> str:
    r = ours(buf)
    try:
        ref = safetensors.deserialize(buf)
    except safetensors.SafetensorError:
        ref = None
    if isinstance(r, SafetensorsHeader):
        assert ref is not None, "we accepted a file the reference rejects"
        got = {n: (t.dtype, list(t.shape), buf[t.abs_begin:t.abs_end]) for n, t in r.tensors.items()}
        want = {n: (d["dtype"], list(d["shape"]), bytes(d["data"])) for n, d in ref}
        assert got == want
        assert r.data_start + sum(t.nbytes for t in r.tensors.values()) == len(buf)
        return "both accept"
    assert isinstance(r, Exl2Error)
    if ref is not None:
        assert r.code in STRICTER_THAN_REFERENCE, f"rejected with {r.code} a file the reference accepts: {r}"
        assert _stricter_reason_holds(r.code, buf), f"{r.code} raised for an undocumented reason: {r}"
        return f"stricter {r.code.value}"
    return "both reject"


@settings(max_examples=max(EXAMPLES // 2, 20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_files())
def test_differential_valid_files_are_accepted_by_both(buf):
    assert _differential(buf) == "both accept"


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(corrupted_files())
def test_differential_corrupted_files(buf):
    _differential(buf)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_arbitrary_bytes_only_raise_exl2error(raw):
    _differential(raw)
    _differential(mk(raw[8:], raw[:8]))


# ------------------------------------------------------------------------------------------------
# the parser's short paths agree with its rule-by-rule checks
# ------------------------------------------------------------------------------------------------
# A well-formed tensor entry is checked in one go (_check_entry) and anything else field by field
# (_check_entry_fields); integers are parsed without the parse_int hook when the text holds no "-0" and no run of
# 21 digits.  Each short path must give what the long one gives, on every input.

def _entry_outcome(fn, name, entry):
    try:
        t = fn(name, entry, "f.safetensors", 88)
    except Exl2Error as e:
        return ("err", e.code, e.message, e.tensor, e.file)
    return ("ok", t, type(t), t.__dict__)


_ODD_VALUES = [True, False, 1.0, None, "2", -0.0, -1, 0, 2**63, 2**64 - 1, 2**64, 2**70, [], {}]


@st.composite
def _entries(draw):
    """A well-formed entry, then 0-2 of its parts replaced by something odd (one of the values above, a dim of
    0 after big ones, a missing or extra field, a tuple or a list where an object belongs, ...)."""
    dtype = draw(st.sampled_from(sorted(P.DTYPE_BITS)))
    shape = draw(st.lists(st.integers(1, 9), max_size=4))
    numel = math.prod(shape)
    begin = draw(st.sampled_from([0, 7, 2**63]))
    size = numel * P.DTYPE_BITS[dtype] // 8
    entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(["dtype", "dim", "dims", "ndim", "begin", "end", "offsets", "drop", "extra",
                                     "whole"]))
        if what == "dtype":
            entry["dtype"] = draw(st.sampled_from(["f16", "", "Q4", None, 16, ["F16"], "I64", "F4", "BOOL"]))
        elif what == "dim" and entry.get("shape"):
            sh = list(entry["shape"]) if isinstance(entry["shape"], list) else [1]
            sh[draw(st.integers(0, len(sh) - 1))] = draw(st.sampled_from(_ODD_VALUES))
            entry["shape"] = sh
        elif what == "dims":  # products that overflow before a zero brings them back down
            entry["shape"] = draw(st.sampled_from([[2**40, 2**40, 0], [2**63, 2, 0], [0, 2**64], [2**32, 2**32],
                                                   [2**31, 2**30], [0], [1, 0, 5]]))
        elif what == "ndim":
            entry["shape"] = [1] * draw(st.integers(8, 10))
        elif what in ("begin", "end"):
            # (a "drop" step before may have removed the field: then a fresh pair is planted)
            off = list(entry["data_offsets"]) if isinstance(entry.get("data_offsets"), list) else [0, 0]
            near = [x + d for x in (off[0], off[-1]) if type(x) is int for d in (-1, 1)]
            off[0 if what == "begin" else -1] = draw(st.sampled_from(_ODD_VALUES + near))
            entry["data_offsets"] = off
        elif what == "offsets":
            entry["data_offsets"] = draw(st.sampled_from([[0], [0, 0, 0], None, (0, 0), [True, True], {}]))
        elif what == "drop":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif what == "extra":
            entry["extra"] = [1, {"a": 2}]
        else:
            entry = draw(st.sampled_from([list(entry.values()), None, "x", 3]))
            break
    return entry


@settings(max_examples=EXAMPLES * 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_entries())
def test_entry_short_path_agrees_with_field_by_field(entry):
    assert _entry_outcome(P._check_entry, "t", entry) == _entry_outcome(P._check_entry_fields, "t", entry)


def test_entry_short_path_is_taken_for_well_formed_entries(monkeypatch):
    """The short path must actually run for ordinary entries (else the agreement above proves nothing)."""
    def no_long_path(*a):
        raise AssertionError("field-by-field path taken")

    monkeypatch.setattr(P, "_check_entry_fields", no_long_path)
    t = P._check_entry("w", ent("F16", (3, 4), 8, 32), "f", 16)
    assert (t.name, t.dtype, t.shape, t.begin, t.end, t.file, t.data_start) == ("w", "F16", (3, 4), 8, 32, "f", 16)
    assert P._check_entry("s", ent("F32", (), 0, 4), "f", 16).shape == ()


def test_fast_tensor_info_is_a_plain_tensor_info():
    import dataclasses

    args = ("model.w", "F16", (3, 4), 8, 32, "x.safetensors", 100)
    fast, slow = P._tensor_info(*args), P.TensorInfo(*args)
    assert type(fast) is P.TensorInfo and fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert dataclasses.astuple(fast) == dataclasses.astuple(slow) and fast.nbytes == 24 and fast.abs_end == 132
    assert not hasattr(P.TensorInfo, "__post_init__")  # _tensor_info skips __init__: nothing else may run there
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.name = "other"


_JSON_NUMBERS = st.one_of(st.integers(-10**25, 10**25), st.sampled_from(["-0", "0", "-0.0", "1e400", "-1e400",
                          "1" * 21, "-" + "9" * 21, "1" * 309, "1" * 400, "12345678901234567890", "-0e5", "0.5"]),
                          st.floats(allow_nan=False, allow_infinity=False))


@st.composite
def _json_texts(draw):
    """A header-like JSON text whose numbers (and name strings) come in every length and sign."""
    parts = []
    for i in range(draw(st.integers(1, 4))):
        nums = draw(st.lists(_JSON_NUMBERS, min_size=1, max_size=4))
        name = draw(st.sampled_from(["t", "layer-0", "x" + "1" * 22, "n9"])) + str(i)
        parts.append(f'"{name}":[{",".join(str(n) for n in nums)}]')
    return "{" + ",".join(parts) + "}"


def _decoded(text):
    try:
        v, dup = P._decode_json(text)
    except P._JsonReject as e:
        return ("reject", str(e))
    except ValueError as e:
        return ("invalid", type(e).__name__)
    return ("ok", json.dumps(v), repr(v), dup)  # repr tells -0.0 from 0 and 1 from 1.0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json_texts())
def test_json_without_int_hook_decodes_like_with_it(text):
    fast = _decoded(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "_LONG_DIGITS", "")  # "" is in every text: the hook always runs
        hooked = _decoded(text)
    assert fast == hooked


def test_int_hook_skipped_only_without_minus_zero_and_long_runs():
    calls = []
    real = json.JSONDecoder

    def spy(**kw):
        calls.append(kw["parse_int"])
        return real(**kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P.json, "JSONDecoder", spy)
        for text in ('{"a":[1,2]}', '{"a":[-0]}', '{"a":[' + "1" * 21 + "]}", '{"a-0":[1]}', '{"a":[' + "1" * 20 + "]}"):
            P._decode_json(text)
    assert [c is None for c in calls] == [True, False, False, False, True]
    assert P._decode_json('{"a":[-0]}')[0] == {"a": [-0.0]} and repr(P._decode_json('{"a":[-0]}')[0]["a"][0]) == "-0.0"


# ------------------------------------------------------------------------------------------------
# model directories
# ------------------------------------------------------------------------------------------------

def _model_tensors(k=6):
    return {f"model.layers.{i}.mlp.weight": np.full((4, 8), i, np.float16) for i in range(k)} | {
        "lm_head.weight": np.arange(64, dtype=np.float32).reshape(8, 8)}


def test_sharded_write_and_read_back(tmp_path):
    tensors = _model_tensors()
    paths = write_sharded(tmp_path, tensors, max_shard_bytes=100, metadata={"format": "pt"})
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{len(paths):05d}.safetensors" for i in range(1, len(paths) + 1)]
    assert len(paths) == 7  # 64 + 64 > 100 -> one per shard; lm_head (256 bytes) alone
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in tensors.values())}
    assert set(index["weight_map"]) == set(tensors)
    with open_model(tmp_path) as m:
        assert m.index_path == tmp_path / "model.safetensors.index.json"
        assert m.index_issues() == []
        assert set(m.names()) == set(tensors) and len(m) == len(tensors)
        assert sorted(m.files) == sorted(paths)
        for name, arr in tensors.items():
            np.testing.assert_array_equal(m.get(name), arr)
            assert m.info(name).file == str(tmp_path / index["weight_map"][name])
        for p in paths:
            assert read_header(p).metadata == {"format": "pt"}
    # each shard is a valid file for the reference too
    for p in paths:
        assert ref_accepts(p.read_bytes())


def test_shards_fill_in_sorted_name_order_and_big_tensors_stand_alone(tmp_path):
    tensors = {"a": np.zeros(10, np.uint8), "b": np.zeros(10, np.uint8), "c": np.zeros(500, np.uint8),
               "d": np.zeros(10, np.uint8)}
    paths = write_sharded(tmp_path, tensors, max_shard_bytes=25)
    assert [list(read_header(p).tensors) for p in paths] == [["a", "b"], ["c"], ["d"]]


def test_single_shard_has_no_index(tmp_path):
    paths = write_sharded(tmp_path, {"w": np.ones(3, np.float32)}, max_shard_bytes=1 << 20, prefix="out")
    assert [p.name for p in paths] == ["out.safetensors"]
    assert not (tmp_path / "out.safetensors.index.json").exists()
    with open_model(tmp_path) as m:
        assert m.index_path is None and m.names() == ["w"]


def test_sharded_refuses_to_overwrite(tmp_path):
    write_sharded(tmp_path, _model_tensors(), max_shard_bytes=100)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exl2Error) as ei:
        write_sharded(tmp_path, {"w": np.ones(3)}, max_shard_bytes=100)
    assert ei.value.code is ErrorCode.OUTPUT_EXISTS
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # overwrite: stale shards and the stale index disappear
    write_sharded(tmp_path, {"w": np.ones(3)}, max_shard_bytes=100, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with open_model(tmp_path) as m:
        assert m.names() == ["w"] and m.index_issues() == []


def test_glob_fallback_without_index(tmp_path):
    write_safetensors(tmp_path / "b.safetensors", {"y": np.ones(2, np.int32)})
    write_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(3, np.int8)})
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "dir.safetensors").mkdir()  # not a file: ignored
    with open_model(tmp_path) as m:
        assert [p.name for p in m.files] == ["a.safetensors", "b.safetensors"]
        assert m.names() == ["x", "y"] and m.index_issues() == []
        np.testing.assert_array_equal(m.get("y"), [1, 1])


def test_glob_duplicate_tensor(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(3, np.int8)})
    write_safetensors(tmp_path / "b.safetensors", {"x": np.ones(3, np.int8)})
    with open_model(tmp_path) as m:
        issues = m.index_issues()
        assert [(i.code, i.severity, i.tensor) for i in issues] == [
            (ErrorCode.DUPLICATE_TENSOR, Severity.ERROR, "x")]
        np.testing.assert_array_equal(m.get("x"), [1, 1, 1])  # the last file wins, as in ExLlamaV2


def _sharded(tmp_path):
    tensors = {"a": np.zeros(4, np.uint8), "b": np.ones(4, np.uint8), "c": np.full(4, 2, np.uint8)}
    write_sharded(tmp_path, tensors, max_shard_bytes=4)
    ip = tmp_path / "model.safetensors.index.json"
    return ip, json.loads(ip.read_text())


def _codes(m):
    return sorted((i.code.value, i.severity.value, i.tensor) for i in m.index_issues())


def test_index_missing_shard(tmp_path):
    ip, idx = _sharded(tmp_path)
    (tmp_path / idx["weight_map"]["b"]).unlink()
    with open_model(tmp_path) as m:
        assert _codes(m) == [("INDEX_MISSING_SHARD", "error", None), ("INDEX_TOTAL_SIZE", "warning", None)]
        assert set(m.names()) == {"a", "c"}


def test_index_missing_tensor(tmp_path):
    ip, idx = _sharded(tmp_path)
    idx["weight_map"]["ghost"] = idx["weight_map"]["a"]
    ip.write_text(json.dumps(idx))
    with open_model(tmp_path) as m:
        assert _codes(m) == [("INDEX_MISSING_TENSOR", "error", "ghost")]


def test_index_unlisted_tensor(tmp_path):
    ip, idx = _sharded(tmp_path)
    shard_c = tmp_path / idx["weight_map"]["c"]
    write_safetensors(shard_c, {"c": np.full(4, 2, np.uint8), "d": np.zeros(2, np.uint8)})
    with open_model(tmp_path) as m:
        assert _codes(m) == [("INDEX_TOTAL_SIZE", "warning", None), ("INDEX_UNLISTED_TENSOR", "error", "d")]
        np.testing.assert_array_equal(m.get("d"), [0, 0])  # still readable
    idx["metadata"]["total_size"] = 14
    ip.write_text(json.dumps(idx))
    with open_model(tmp_path) as m:
        assert _codes(m) == [("INDEX_UNLISTED_TENSOR", "error", "d")]


def test_index_unreferenced_file(tmp_path):
    ip, idx = _sharded(tmp_path)
    write_safetensors(tmp_path / "extra.safetensors", {"zz": np.zeros(1, np.uint8)})
    with open_model(tmp_path) as m:
        issues = m.index_issues()
        assert [(i.code, i.severity) for i in issues] == [(ErrorCode.INDEX_UNLISTED_TENSOR, Severity.WARNING)]
        assert issues[0].file.endswith("extra.safetensors") and "zz" not in m


def test_index_total_size(tmp_path):
    ip, idx = _sharded(tmp_path)
    for bad in (13, "12", 11.0):
        idx["metadata"]["total_size"] = bad
        ip.write_text(json.dumps(idx))
        with open_model(tmp_path) as m:
            assert _codes(m) == [("INDEX_TOTAL_SIZE", "warning", None)]
    idx["metadata"]["total_size"] = 12.0
    ip.write_text(json.dumps(idx))
    with open_model(tmp_path) as m:
        assert m.index_issues() == []
    del idx["metadata"]
    ip.write_text(json.dumps(idx))
    with open_model(tmp_path) as m:
        assert m.index_issues() == []


def test_index_duplicate_tensor(tmp_path):
    ip, idx = _sharded(tmp_path)
    shard_a = tmp_path / idx["weight_map"]["a"]
    shard_b = tmp_path / idx["weight_map"]["b"]
    write_safetensors(shard_b, {"b": np.ones(4, np.uint8), "a": np.full(4, 9, np.uint8)})
    idx["metadata"]["total_size"] = 12
    ip.write_text(json.dumps(idx))
    with open_model(tmp_path) as m:
        assert _codes(m) == [("DUPLICATE_TENSOR", "error", "a")]
        assert m.info("a").file == str(shard_a)  # the index decides
        np.testing.assert_array_equal(m.get("a"), [0, 0, 0, 0])


@pytest.mark.parametrize("doc", [
    "not json", "[]", "{}", '{"weight_map": []}', '{"weight_map": {"a": 1}}', '{"weight_map": {"a": "../x.safetensors"}}',
    '{"weight_map": {"a": "/etc/passwd"}}', '{"weight_map": {"a": "sub/x.safetensors"}}', '{"weight_map": {"a": ".."}}',
    '{"weight_map": {"a": "x\\\\y"}}', '{"weight_map": {"a": ""}}', '{"weight_map": {"a": "x", "a": "x"}}',
    '{"weight_map": {}, "metadata": 5}',
])
def test_index_invalid(tmp_path, doc):
    write_safetensors(tmp_path / "x", {"a": np.zeros(1)})
    (tmp_path / "model.safetensors.index.json").write_text(doc)
    with pytest.raises(Exl2Error) as ei:
        open_model(tmp_path)
    assert ei.value.code is ErrorCode.INDEX_INVALID


def test_open_index_file_directly(tmp_path):
    _sharded(tmp_path)
    with open_model(tmp_path / "model.safetensors.index.json") as m:
        assert set(m.names()) == {"a", "b", "c"}


def test_open_model_input_errors(tmp_path):
    cases = {tmp_path / "missing": ErrorCode.PATH_NOT_FOUND, tmp_path / "empty": ErrorCode.NO_SAFETENSORS,
             tmp_path / "m.bin": ErrorCode.UNSUPPORTED_INPUT, tmp_path / "m.gguf": ErrorCode.UNSUPPORTED_INPUT}
    (tmp_path / "empty").mkdir()
    (tmp_path / "m.bin").write_bytes(b"PK")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for path, code in cases.items():
        with pytest.raises(Exl2Error) as ei:
            open_model(path)
        assert ei.value.code is code, path
    with pytest.raises(Exl2Error) as ei:
        read_header(tmp_path / "empty")
    assert ei.value.code is ErrorCode.IO_ERROR
    with pytest.raises(Exl2Error) as ei:
        read_header(tmp_path / "missing")
    assert ei.value.code is ErrorCode.PATH_NOT_FOUND


def test_bad_shard_is_fatal(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(3, np.int8)})
    (tmp_path / "b.safetensors").write_bytes(serialize({"y": np.zeros(3, np.int8)})[:-1])
    with pytest.raises(Exl2Error) as ei:
        open_model(tmp_path)
    assert ei.value.code is ErrorCode.TRUNCATED and ei.value.file.endswith("b.safetensors")


def test_config_is_parsed_lazily(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(3, np.int8)})
    with open_model(tmp_path) as m:
        assert m.config is None
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "quantization_config": {"bits": 4.0}}')
    with open_model(tmp_path) as m:
        assert m.config == {"hidden_size": 8, "quantization_config": {"bits": 4.0}}
        assert type(m.config) is dict
    for bad in ("[1, 2]", "{oops", "\xff"):
        (tmp_path / "config.json").write_text(bad, encoding="latin-1")
        m = open_model(tmp_path)  # opening succeeds ...
        with pytest.raises(Exl2Error) as ei:
            m.config  # ... the error comes on access
        assert ei.value.code is ErrorCode.CONFIG_INVALID


def test_open_shards_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "MAX_OPEN_SHARDS", 2)
    tensors = {f"t{i}": np.full(8, i, np.int64) for i in range(6)}
    paths = write_sharded(tmp_path, tensors, max_shard_bytes=64)
    assert len(paths) == 6
    with open_model(tmp_path) as m:
        arrays = {n: m.get(n) for n in tensors}
        assert len(m._open) <= 2
        for n, a in arrays.items():  # arrays of evicted shards stay valid
            np.testing.assert_array_equal(a, tensors[n])
    np.testing.assert_array_equal(arrays["t0"], tensors["t0"])


# ------------------------------------------------------------------------------------------------
# writer: atomicity and input errors
# ------------------------------------------------------------------------------------------------

def test_write_is_atomic_on_failure_mid_write(tmp_path, monkeypatch):
    target = tmp_path / "m.safetensors"
    calls = []
    from exl2fmt.container import writer as W

    real = W._write_array

    def failing(f, arr):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        real(f, arr)

    monkeypatch.setattr(W, "_write_array", failing)
    with pytest.raises(RuntimeError):
        write_safetensors(target, {"a": np.zeros(10), "b": np.ones(10), "c": np.ones(3)})
    assert list(tmp_path.iterdir()) == []
    # an existing file survives intact, and an OSError becomes IO_ERROR
    monkeypatch.setattr(W, "_write_array", real)
    write_safetensors(target, {"old": np.zeros(2)})
    before = target.read_bytes()

    def no_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(W.os, "fsync", no_fsync)
    with pytest.raises(Exl2Error) as ei:
        write_safetensors(target, {"new": np.ones(2)})
    assert ei.value.code is ErrorCode.IO_ERROR and "No space" in ei.value.message
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_a_scratch_write_skips_fsync_and_stays_atomic(tmp_path, monkeypatch):
    """durable=False (the quantizer's parked candidates) writes the same bytes with no fsync; the default
    fsyncs the file and its directory."""
    from exl2fmt.container import publish

    synced = []
    real = publish.os.fsync
    monkeypatch.setattr(publish.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    write_safetensors(tmp_path / "d.safetensors", t)
    assert len(synced) >= 1
    synced.clear()
    write_safetensors(tmp_path / "s.safetensors", t, durable=False)
    assert synced == []
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "d.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "s.safetensors"]


def test_written_file_permissions_follow_umask(tmp_path):
    p = write_safetensors(tmp_path / "m.safetensors", {"a": np.zeros(1)})
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("tensors,code", [
    ({"s": np.array(["x"])}, ErrorCode.DTYPE_UNKNOWN),
    ({"o": np.array([object()])}, ErrorCode.DTYPE_UNKNOWN),
    ({"c": np.zeros(2, np.complex128)}, ErrorCode.DTYPE_UNKNOWN),
    ({"l": [1, 2]}, ErrorCode.TENSOR_ENTRY_INVALID),
    ({"__metadata__": np.zeros(1)}, ErrorCode.TENSOR_ENTRY_INVALID),
    ({"\ud800": np.zeros(1)}, ErrorCode.TENSOR_ENTRY_INVALID),
    ({1: np.zeros(1)}, ErrorCode.TENSOR_ENTRY_INVALID),
    ({"r": RawTensor("BF16", (3,), np.zeros(2, np.uint16))}, ErrorCode.SIZE_MISMATCH),
    ({"r": RawTensor("F4", (3,), np.zeros(2, np.uint8))}, ErrorCode.MISALIGNED_SLICE),
    ({"r": RawTensor("bf16", (1,), np.zeros(1, np.uint16))}, ErrorCode.DTYPE_UNKNOWN),
    ({"r": RawTensor("U8", (-1,), np.zeros(1, np.uint8))}, ErrorCode.SHAPE_INVALID),
    ({"r": RawTensor("U8", (1,) * 9, np.zeros(1, np.uint8))}, ErrorCode.SHAPE_INVALID),
    ({"n": np.zeros((1,) * 9)}, ErrorCode.SHAPE_INVALID),
])
def test_writer_rejects_bad_tensors(tmp_path, tensors, code):
    with pytest.raises(Exl2Error) as ei:
        write_safetensors(tmp_path / "x.safetensors", tensors)
    assert ei.value.code is code
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("meta", [{"a": 1}, {1: "a"}, {"a": "\udc00"}, ["a"]])
def test_writer_rejects_bad_metadata(tmp_path, meta):
    with pytest.raises(Exl2Error) as ei:
        write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(1)}, meta)
    assert ei.value.code is ErrorCode.METADATA_INVALID


def test_sharded_writer_argument_errors(tmp_path):
    for kwargs in ({"max_shard_bytes": 0}, {"max_shard_bytes": 10, "prefix": "../x"}, {"max_shard_bytes": True}):
        with pytest.raises(Exl2Error) as ei:
            write_sharded(tmp_path, {"a": np.zeros(1)}, **kwargs)
        assert ei.value.code is ErrorCode.USAGE


def _rss_file_kb() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@pytest.mark.skipif(_rss_file_kb() is None, reason="needs /proc/self/status RssFile (Linux)")
def test_release_drops_a_tensors_pages_and_the_array_still_reads_the_same(tmp_path):
    """A pass that reads each tensor once must not end up holding the whole file resident: after ``release`` the
    tensor's mapped pages leave the process's file-backed RSS, and an array taken before still reads the same
    values (the pages come back from the page cache)."""
    big = np.arange(12 << 20, dtype=np.float32).reshape(-1, 1024)       # 48 MiB
    small = np.full((3, 5), 7, dtype=np.int16)
    write_safetensors(tmp_path / "m.safetensors", {"big": big, "small": small})
    m = open_model(tmp_path)
    try:
        arr = m.get("big")
        before = _rss_file_kb()
        assert float(arr.sum(dtype=np.float64)) == float(big.sum(dtype=np.float64))
        touched = _rss_file_kb()
        m.release("big")
        released = _rss_file_kb()
        assert touched - before > 40 << 10                     # reading it mapped ~48 MiB in
        assert touched - released > 40 << 10                   # and release dropped them again
        assert np.array_equal(arr, big) and np.array_equal(m.get("small"), small)
        m.release("small")                                     # partial pages, a neighbour's too: harmless
        assert np.array_equal(m.get("small"), small)
    finally:
        m.close()


@pytest.mark.parametrize("st_dtype", ["F16", "BF16", "F32", "F64"])
def test_nonfinite_count_from_bits_equals_isfinite(st_dtype):
    """Oracle: numpy's isfinite on the values widened to float64 (BF16 by shifting its bits into a float32);
    the deep validator's ``nonfinite_count`` is the same function.
    Every exponent-all-ones pattern (inf, quiet and signalling NaN with either sign) and the largest finite
    values, at every position of a 37-element tensor read in chunks of 5 (both chunk ends covered)."""
    from exl2fmt.container import dtypes as D
    from exl2fmt.container.dtypes import bf16_bits_to_f32, count_nonfinite

    rng = np.random.default_rng(3)
    if st_dtype == "BF16":
        base = rng.integers(0, 1 << 16, 37, dtype=np.uint16)
        base[(base & 0x7F80) == 0x7F80] = 0x3F80                        # start finite
        specials = [0x7F80, 0xFF80, 0x7FC0, 0xFF81, 0x7F7F, 0xFF7F, 0x0001]
        widen = lambda a: bf16_bits_to_f32(a).astype(np.float64)
    else:
        dt = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[st_dtype]
        base = rng.standard_normal(37).astype(dt)
        fi = np.finfo(dt)
        bits = {"F16": np.uint16, "F32": np.uint32, "F64": np.uint64}[st_dtype]
        qnan_neg = (np.array([-np.nan], dt).view(bits) | bits(1)).view(dt)[0]      # a NaN with a payload
        specials = [dt(np.inf), dt(-np.inf), dt(np.nan), qnan_neg, fi.max, fi.min, fi.smallest_subnormal]
        widen = lambda a: a.astype(np.float64)
    for pos in range(base.size):
        for v in specials:
            a = base.copy()
            a[pos] = v
            a[(pos * 7) % a.size] = v
            with np.errstate(invalid="ignore"):                       # (a signalling NaN widened)
                want = int(np.count_nonzero(~np.isfinite(widen(a))))
            got = D.count_bit_pattern(a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize]),
                                      *D._NONFINITE_BITS[st_dtype][:2], chunk=5)
            assert got == want == count_nonfinite(a, st_dtype), (pos, v)
    # other dtypes by isfinite (integers: none), as the deep validator's count always did
    from exl2fmt.validate.statistics import nonfinite_count

    ints = np.arange(-5, 32, dtype=np.int32)
    assert count_nonfinite(ints, "I32") == nonfinite_count(ints, "I32") == 0
    for dt in ("F16", "BF16", "F32", "F64"):
        a = {"BF16": np.array([0x7F80, 0x3F80, 0xFFC0], np.uint16)}.get(
            dt, np.array([np.inf, 1.0, np.nan], {"F16": np.float16, "F32": np.float32, "F64": np.float64}.get(dt)))
        assert nonfinite_count(a, dt) == count_nonfinite(a, dt) == 2
