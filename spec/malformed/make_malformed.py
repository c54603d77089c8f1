#!/usr/bin/env python3
"""Generate the malformed-input catalogue: ``spec/malformed/*`` and ``spec/malformed/index.json``.

    python spec/malformed/make_malformed.py            # (re)write the catalogue next to this script
    python spec/malformed/make_malformed.py OUT_DIR    # write it somewhere else (tests compare the bytes)

Deterministic and idempotent: the same bytes on every run and every machine (no clocks, no random seeds
from the OS; the few "random" arrays come from a fixed integer hash below, not from NumPy's generators,
whose streams may change between NumPy releases).  Uses only the standard library, NumPy and exl2fmt.

Three kinds of samples:

* **container samples** (``*.safetensors`` whose header breaks a rule, and a ``.bin`` file): hand-built
  bytes - ``struct.pack("<Q", n)`` and JSON text written out literally below - so that the catalogue does
  not depend on exl2fmt's own writer being right;
* **layer samples** (``exl2_*``, ``gptq_*``, ``dense_*``): a valid layer built with ``exl2fmt.formats.exl2`` /
  ``exl2fmt.codec`` with exactly one thing corrupted, written with ``exl2fmt.container.write_safetensors``
  (the container is valid; the layer validators must find the problem);
* **model directories** (``dir_*``): shards hand-built like the container samples, plus an index and/or
  ``config.json`` that break a model-level rule.

``index.json`` lists every sample (see README.md for the fields).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------------------
# deterministic pseudo-random integers (a splitmix64-style hash of the index; NumPy-version independent)
# ---------------------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _hash_u64(n: int, seed: int) -> np.ndarray:
    """uint64 [n]: a fixed integer hash of (seed, i).  Pure wrapping uint64 arithmetic."""
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & _M64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _ints(n: int, lo: int, hi: int, seed: int) -> np.ndarray:
    """int64 [n] in [lo, hi] (inclusive)."""
    return (lo + (_hash_u64(n, seed) % np.uint64(hi - lo + 1)).astype(np.int64)).astype(np.int64)


def _perm(n: int, seed: int) -> np.ndarray:
    """A permutation of 0..n-1 (int64 [n])."""
    return np.argsort(_hash_u64(n, seed), kind="stable").astype(np.int64)


# ---------------------------------------------------------------------------------------------------------
# hand-built safetensors bytes
# ---------------------------------------------------------------------------------------------------------


def st_bytes(header: str | bytes, data: bytes = b"", declared: int | None = None) -> bytes:
    """u64 LE header length (``declared`` or the real one) + header bytes + data bytes."""
    hb = header.encode("utf-8") if isinstance(header, str) else header
    return struct.pack("<Q", len(hb) if declared is None else declared) + hb + data


def st_file(tensors: list[tuple[str, str, list[int], bytes]]) -> bytes:
    """A *valid* file from (name, dtype, shape, raw bytes), header text assembled by hand, offsets in order."""
    parts, off = [], 0
    for name, dtype, shape, raw in tensors:
        parts.append(f'"{name}":{{"dtype":"{dtype}","shape":[{",".join(str(d) for d in shape)}],'
                     f'"data_offsets":[{off},{off + len(raw)}]}}')
        off += len(raw)
    return st_bytes("{" + ",".join(parts) + "}", b"".join(t[3] for t in tensors))


def f16_bytes(values) -> bytes:
    return np.asarray(values, dtype="<f2").tobytes()


U8x4 = b"\x01\x02\x03\x04"  # 4 bytes of U8 data, used by many container samples
TENSOR_A = '"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}'


# ---------------------------------------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------------------------------------


class Catalogue:
    def __init__(self, out: Path):
        self.out = out
        self.entries: list[dict] = []

    def _entry(self, path: str, code: str, description: str, *, exit: int = 1, layer: str | None = None,
               **extra) -> None:
        e = {"path": path, "code": code, "exit": exit, "layer": layer, "description": description}
        e.update(extra)
        self.entries.append(e)

    def file(self, name: str, data: bytes, code: str, description: str, **kw) -> None:
        (self.out / name).write_bytes(data)
        self._entry(name, code, description, **kw)

    def tensors(self, name: str, tensors: dict, code: str, description: str, **kw) -> None:
        from exl2fmt.container import write_safetensors

        write_safetensors(self.out / name, tensors)
        self._entry(name, code, description, **kw)

    def directory(self, name: str, files: dict[str, bytes], code: str, description: str, **kw) -> None:
        d = self.out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        for fn, data in files.items():
            (d / fn).write_bytes(data)
        self._entry(name, code, description, **kw)


def container_samples(c: Catalogue) -> None:
    c.file("header_too_small.safetensors", b"\x10\x00\x00\x00\x00", "HEADER_TOO_SMALL",
           "5-byte file: shorter than the 8-byte header length")
    c.file("empty_file.safetensors", b"", "HEADER_TOO_SMALL", "0-byte file")
    c.file("header_past_eof.safetensors", st_bytes('{"a":', declared=1000), "HEADER_PAST_EOF",
           "declared header length 1000 but the file has 13 bytes")
    c.file("header_too_large.safetensors", st_bytes("{}", declared=1 << 40), "HEADER_TOO_LARGE",
           "declared header length 2**40 (cap 100 MB) in a 10-byte file: must fail before allocating")
    c.file("header_just_over_cap.safetensors", st_bytes("{}", declared=100_000_001), "HEADER_TOO_LARGE",
           "declared header length 100_000_001, one byte over the 100_000_000 cap")
    c.file("header_not_utf8.safetensors", st_bytes(b'{"\xff\xfe":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'),
           "HEADER_NOT_UTF8", "tensor name bytes FF FE are not UTF-8")
    c.file("header_not_json.safetensors", st_bytes('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}', U8x4),
           "HEADER_NOT_JSON", "header object is missing its closing brace")
    c.file("header_json_array.safetensors", st_bytes("[" + TENSOR_A.replace('"a":', "") + "]", U8x4),
           "HEADER_NOT_JSON", "header is a JSON array, not an object")
    c.file("header_leading_space.safetensors", st_bytes(" {" + TENSOR_A + "}", U8x4), "HEADER_NOT_JSON",
           "header starts with a space before '{' (the reference accepts it; the spec says it MUST begin with '{')")
    c.file("header_empty.safetensors", st_bytes(""), "HEADER_NOT_JSON", "header length 0: no JSON at all")
    c.file("header_nan.safetensors", st_bytes('{"__metadata__":{"x":"y"},"a":{"dtype":"U8","shape":[NaN],'
                                              '"data_offsets":[0,4]}}', U8x4),
           "HEADER_NOT_JSON", "bare NaN literal inside the header (not JSON)")
    c.file("header_too_deep.safetensors", st_bytes('{"x":' + "[" * 200 + "]" * 200 + "}"), "HEADER_NOT_JSON",
           "arrays nested 201 levels deep (the reference's serde_json stops at 127)")
    c.file("duplicate_tensor_key.safetensors",
           st_bytes('{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},' + TENSOR_A + "}", U8x4),
           "DUPLICATE_KEY", "tensor 'a' appears twice (F16 then U8): readers keeping the first or last entry disagree",
           tensor="a")
    c.file("duplicate_metadata_key.safetensors",
           st_bytes('{"__metadata__":{"format":"pt","format":"np"},' + TENSOR_A + "}", U8x4),
           "DUPLICATE_KEY", "__metadata__ repeats its key 'format'")
    c.file("metadata_value_not_string.safetensors",
           st_bytes('{"__metadata__":{"format":"pt","bits":4},' + TENSOR_A + "}", U8x4),
           "METADATA_INVALID", "__metadata__ value 4 is a number, not a string")
    c.file("entry_missing_data_offsets.safetensors", st_bytes('{"a":{"dtype":"U8","shape":[4]}}', U8x4),
           "TENSOR_ENTRY_INVALID", "tensor entry without data_offsets", tensor="a")
    c.file("entry_not_object.safetensors", st_bytes('{"a":"U8"}'), "TENSOR_ENTRY_INVALID",
           "tensor entry is a string, not an object", tensor="a")
    c.file("shape_bool.safetensors", st_bytes('{"a":{"dtype":"U8","shape":[true,4],"data_offsets":[0,4]}}', U8x4),
           "SHAPE_INVALID", "shape [true, 4]: a JSON boolean is not an integer dim", tensor="a")
    c.file("shape_negative.safetensors", st_bytes('{"a":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}}', U8x4),
           "SHAPE_INVALID", "shape [-4]: negative dim", tensor="a")
    c.file("shape_float.safetensors", st_bytes('{"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}}', U8x4),
           "SHAPE_INVALID", "shape [4.0]: a float is not an integer dim", tensor="a")
    c.file("shape_9_dims.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,4],"data_offsets":[0,4]}}', U8x4),
           "SHAPE_INVALID", "9 dims (cap 8)", tensor="a")
    c.file("dtype_unknown.safetensors", st_bytes('{"a":{"dtype":"Q4_K","shape":[4],"data_offsets":[0,4]}}', U8x4),
           "DTYPE_UNKNOWN", "dtype 'Q4_K' is not a safetensors dtype", tensor="a")
    c.file("offsets_begin_after_end.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}', U8x4),
           "OFFSETS_INVALID", "data_offsets [4, 0]: begin > end", tensor="a")
    c.file("offsets_past_u64.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[4],"data_offsets":[18446744073709551616,18446744073709551620]}}',
                    U8x4),
           "OFFSETS_INVALID", "data_offsets beyond 2**64", tensor="a")
    c.file("offsets_overlap.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                    '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', U8x4 + b"\x05\x06"),
           "OFFSETS_OVERLAP", "tensor b [2, 6) overlaps tensor a [0, 4)", tensor="b")
    c.file("offsets_gap.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                    '"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}}', U8x4 + b"\x00\x00\x07\x08"),
           "OFFSETS_GAP", "a 2-byte hole between tensor a [0, 4) and tensor b [6, 8)", tensor="b")
    c.file("offsets_not_from_zero.safetensors",
           st_bytes('{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}', b"\x00" * 4 + U8x4),
           "OFFSETS_GAP", "the only tensor starts at offset 4: data must start at 0", tensor="a")
    c.file("size_mismatch.safetensors", st_bytes('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', U8x4),
           "SIZE_MISMATCH", "F32 x [2] needs 8 bytes, data_offsets give 4", tensor="a")
    c.file("size_overflow.safetensors",
           st_bytes('{"a":{"dtype":"F16","shape":[4294967296,4294967296],"data_offsets":[0,0]}}'),
           "SIZE_OVERFLOW", "shape [2**32, 2**32]: the element count reaches 2**64 (must not wrap to 0)",
           tensor="a")
    c.file("size_overflow_bytes.safetensors",
           st_bytes('{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}}'),
           "SIZE_OVERFLOW", "2**62 F64 elements: numel fits in u64 but numel x 8 bytes does not", tensor="a")
    c.file("misaligned_f4.safetensors", st_bytes('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}', b"\x12"),
           "MISALIGNED_SLICE", "3 F4 values = 12 bits: not a whole number of bytes", tensor="a")
    c.file("truncated.safetensors",
           st_bytes('{"a":{"dtype":"F16","shape":[4,4],"data_offsets":[0,32]}}', f16_bytes(np.arange(10))),
           "TRUNCATED", "F16 [4, 4] needs 32 data bytes; the file stops after 20 (an interrupted download)")
    c.file("trailing_bytes.safetensors", st_bytes("{" + TENSOR_A + "}", U8x4 + b"JUNK"), "TRAILING_BYTES",
           "4 bytes follow the last tensor's data")
    c.file("name_control_chars.safetensors",
           st_bytes('{"model.layers.0.mlp.down_proj\\u001b[2J\\u001b]0;pwned\\u0007\\n[PASS] all good.weight":'
                    '{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}}', f16_bytes([1, 2, 3, 4])),
           "NAME_CONTROL_CHARS",
           "tensor name holds ESC sequences (clear screen, set title), BEL and a newline forging a [PASS] line",
           layer="model.layers.0.mlp.down_proj\x1b[2J\x1b]0;pwned\x07\n[PASS] all good", checked_by="cli")
    # a PyTorch pickle checkpoint (never unpickled: a pickle can run code); the bytes of `{}` pickled
    c.file("pytorch_model.bin", b"\x80\x02}q\x00.", "UNSUPPORTED_INPUT",
           "a .bin (pickle) checkpoint: not a safetensors file; never unpickled", exit=3)


# ---------------------------------------------------------------------------------------------------------
# layer samples
# ---------------------------------------------------------------------------------------------------------

KEY = "model.layers.0.mlp.down_proj"
#: valid base EXL2 layer: K = 128 stored rows in 4 groups (8, 4, 4, 2 bits), N = N_pad = 32
BASE_GROUPS = [(8, 32), (4, 32), (4, 32), (2, 32)]
BASE_K = 128
BASE_N = 32


def exl2_base(bits_rows=BASE_GROUPS, n_pad: int = BASE_N, seed: int = 1, bias: bool = False) -> dict[str, np.ndarray]:
    """Slot name -> array of a valid EXL2 layer (exl2fmt.formats.exl2.exl2_tensors from fixed codes)."""
    from exl2fmt.formats.exl2 import exl2_tensors

    K = sum(r for _, r in bits_rows)
    codes = np.concatenate([_ints(r * n_pad, 0, (1 << b) - 1, seed + 10 * g).reshape(r, n_pad)
                            for g, (b, r) in enumerate(bits_rows)]).astype(np.uint8)
    G = len(bits_rows)
    scale_codes = _ints(G * n_pad, 0, 15, seed + 1000).reshape(G, n_pad).astype(np.uint8)
    qsm = (0.01 + 0.005 * np.arange(G)).astype(np.float16)
    invperm = _perm(K, seed + 2000)
    b = (0.01 * (_ints(n_pad, -50, 50, seed + 3000))).astype(np.float16) if bias else None
    return exl2_tensors(codes, scale_codes, qsm, bits_rows, invperm, b)


def layer_file(slots: dict[str, np.ndarray], key: str = KEY) -> dict[str, np.ndarray]:
    return {f"{key}.{s}": a for s, a in slots.items()}


def gptq_base(bits: int = 4, K: int = 64, N: int = 32, group: int = 32, seed: int = 5) -> dict[str, np.ndarray]:
    """Slot name -> array of a valid symmetric GPTQ v1 layer (exl2fmt.codec.gptq packers)."""
    from exl2fmt.codec.gptq import pack_qweight, pack_qzeros

    G = K // group
    codes = _ints(K * N, 0, (1 << bits) - 1, seed).reshape(K, N).astype(np.uint8)
    fields = np.full((G, N), (1 << (bits - 1)) - 1, dtype=np.uint8)  # v1 stores z - 1, z = 2**(bits-1)
    scales = (0.001 * _ints(G * N, 1, 50, seed + 1)).reshape(G, N).astype(np.float16)
    return {"qweight": pack_qweight(codes, bits), "qzeros": pack_qzeros(fields, bits), "scales": scales,
            "g_idx": (np.arange(K) // group).astype(np.int32)}


def dense_base(N: int = 32, K: int = 64, seed: int = 9) -> dict[str, np.ndarray]:
    return {"weight": (0.01 * _ints(N * K, -100, 100, seed)).reshape(N, K).astype(np.float16)}


def with_slot(slots: dict, name: str, value) -> dict:
    out = dict(slots)
    if value is None:
        out.pop(name)
    else:
        out[name] = value
    return out


def qgroups(*pairs: int) -> np.ndarray:
    return np.array(pairs, dtype=np.int16)


def layer_samples(c: Catalogue) -> None:
    base = exl2_base()
    L = dict(layer=KEY)

    def exl2(name, slots, code, desc, **kw):
        c.tensors(name, layer_file(slots), code, desc, **L, **kw)

    # base q_groups: [8, 0, 4, 8, 4, 12, 2, 16], q_weight [18, 32]
    exl2("exl2_missing_q_groups.safetensors", with_slot(base, "q_groups", None), "SLOT_MISSING",
         "EXL2 layer without q_groups")
    exl2("exl2_q_weight_i16.safetensors", with_slot(base, "q_weight", base["q_weight"].astype(np.int16)),
         "SLOT_DTYPE", "q_weight stored as I16 (must be I32)")
    exl2("exl2_q_scale_shape.safetensors", with_slot(base, "q_scale", base["q_scale"][:-1]), "SLOT_SHAPE",
         "q_scale has 3 rows for 4 groups (shape [G-1, N_pad/8])")
    exl2("exl2_q_scale_max_f32.safetensors", with_slot(base, "q_scale_max", base["q_scale_max"].astype(np.float32)),
         "SLOT_DTYPE", "q_scale_max stored as F32 (must be F16)")
    exl2("exl2_q_groups_odd_length.safetensors", with_slot(base, "q_groups", base["q_groups"][:-1]), "SLOT_SHAPE",
         "q_groups has 7 entries: not (bits, qrow) pairs")
    exl2("exl2_q_invperm_length.safetensors", with_slot(base, "q_invperm", base["q_invperm"][:-32]), "K_MISMATCH",
         "groups hold 128 rows but q_invperm has 96 entries")
    exl2("exl2_bits_7.safetensors", with_slot(base, "q_groups", qgroups(8, 0, 7, 8, 4, 12, 2, 16)), "GROUPS_BITS",
         "group 1 claims 7 bits")
    exl2("exl2_bits_0.safetensors", with_slot(base, "q_groups", qgroups(0, 0, 4, 8, 4, 12, 2, 16)), "GROUPS_BITS",
         "group 0 claims 0 bits (a division by zero for a naive decoder)")
    asc = exl2_base([(8, 32), (4, 64)], seed=2)  # q_groups [8, 0, 4, 8], Q = 16
    exl2("exl2_tiers_ascending.safetensors", with_slot(asc, "q_groups", qgroups(4, 0, 8, 8)), "GROUPS_ORDER",
         "tiers ascend: a 4-bit group before an 8-bit group")
    exl2("exl2_qrow_not_zero.safetensors", with_slot(base, "q_groups", qgroups(8, 1, 4, 8, 4, 12, 2, 16)),
         "GROUPS_QROW", "group 0 starts at q_weight row 1, not 0")
    exl2("exl2_qrow_not_monotone.safetensors", with_slot(base, "q_groups", qgroups(8, 0, 4, 8, 4, 6, 2, 16)),
         "GROUPS_QROW", "group 2 starts at q_weight row 6, before group 1 (row 8)")
    exl2("exl2_qrow_past_end.safetensors", with_slot(base, "q_groups", qgroups(8, 0, 4, 8, 4, 12, 2, 20)),
         "GROUPS_QROW", "the last group starts at q_weight row 20 of 18")
    exl2("exl2_group_rows_not_32.safetensors", with_slot(base, "q_groups", qgroups(8, 0, 4, 8, 4, 10, 2, 16)),
         "GROUPS_ROWS", "group 1 spans 2 packed rows = 16 input rows at 4 bits (not a multiple of 32)")
    wide = exl2_base(n_pad=64, seed=3)
    narrow = dict(wide, q_weight=np.ascontiguousarray(wide["q_weight"][:, :40]))
    exl2("exl2_n_pad_not_32.safetensors", narrow, "N_PADDING", "q_weight has 40 columns: N_pad must be a multiple of 32")
    dup = base["q_invperm"].copy()
    dup[1] = dup[0]
    exl2("exl2_invperm_duplicate.safetensors", with_slot(base, "q_invperm", dup), "PERM_INVALID",
         "q_invperm repeats a row (entries 0 and 1 equal): not a permutation", deep=True)
    oor = base["q_invperm"].copy()
    oor[5] = BASE_K
    exl2("exl2_invperm_out_of_range.safetensors", with_slot(base, "q_invperm", oor), "PERM_INVALID",
         "q_invperm holds 128 for K = 128 (out of range)", deep=True)
    perm = np.argsort(base["q_invperm"], kind="stable").astype(np.int32)
    perm[[0, 1]] = perm[[1, 0]]
    exl2("exl2_perm_mismatch.safetensors", dict(base, q_perm=perm), "PERM_MISMATCH",
         "q_perm present and not argsort(q_invperm) (two entries swapped)", deep=True)
    nan = base["q_scale_max"].copy()
    nan[2] = np.float16("nan")
    exl2("exl2_scale_max_nan.safetensors", with_slot(base, "q_scale_max", nan), "SCALE_MAX_INVALID",
         "q_scale_max[2] is NaN", deep=True)
    zero = base["q_scale_max"].copy()
    zero[0] = 0
    exl2("exl2_scale_max_zero.safetensors", with_slot(base, "q_scale_max", zero), "SCALE_MAX_INVALID",
         "q_scale_max[0] is 0: the group decodes to zeros (ExLlamaV2 writes this for an all-zero group; a warning)",
         deep=True, severity="warning", strict=True, exit_without_strict=0)
    neg = base["q_scale_max"].copy()
    neg[1] = -neg[1]
    exl2("exl2_scale_max_negative.safetensors", with_slot(base, "q_scale_max", neg), "SCALE_MAX_INVALID",
         "q_scale_max[1] is negative", deep=True)
    biased = exl2_base(bias=True, seed=4)
    b = biased["bias"].copy()
    b[3] = np.float16("inf")
    exl2("exl2_bias_inf.safetensors", with_slot(biased, "bias", b), "NONFINITE_VALUES", "bias[3] is +Inf",
         deep=True)
    # GROUPS_LIMIT: rows come from q_weight rows, so a group of > 32767 rows needs >= 2048 packed rows at 2 bits
    # (32768 rows x N_pad 32: 256 KiB of zeros).  No smaller input reaches the limit with an I16 q_groups.
    big = {"q_weight": np.zeros((2048, 32), dtype=np.int32), "q_scale": np.zeros((1, 4), dtype=np.int32),
           "q_scale_max": np.ones(1, dtype=np.float16), "q_groups": qgroups(2, 0),
           "q_invperm": np.arange(32, dtype=np.int32)}
    exl2("exl2_groups_limit.safetensors", big, "GROUPS_LIMIT",
         "one 2-bit group of 2048 packed rows = 32768 input rows (limit 32767)",
         oversize_reason="the smallest input that reaches the limit: 2048 x 32 int32 q_weight (256 KiB of zeros)")

    g = gptq_base()
    bad = g["g_idx"].copy()
    bad[7] = 2  # G = 2
    c.tensors("gptq_g_idx_out_of_range.safetensors", layer_file(with_slot(g, "g_idx", bad)), "GPTQ_G_IDX",
              "g_idx[7] = 2 with G = 2 groups", deep=True, **L)
    g5 = {"qweight": _ints(10 * 32, 0, 2**31 - 1, 7).reshape(10, 32).astype(np.int32),
          "qzeros": np.zeros((2, 5), dtype=np.int32), "scales": g["scales"], "g_idx": g["g_idx"]}
    c.tensors("gptq_bits_5.safetensors", layer_file(g5), "GPTQ_BITS",
              "qzeros [2, 5] for N = 32 implies 5 bits (GPTQ has 2, 3, 4, 8)", **L)
    d = dense_base()
    w = d["weight"].copy()
    w[4, 7] = np.float16("nan")
    c.tensors("dense_weight_nan.safetensors", layer_file({"weight": w}), "NONFINITE_VALUES",
              "dense F16 weight holds a NaN at [4, 7]", deep=True, **L)


# ---------------------------------------------------------------------------------------------------------
# model directories
# ---------------------------------------------------------------------------------------------------------


def _u8(name: str, n: int, fill: int) -> tuple[str, str, list[int], bytes]:
    return (name, "U8", [n], bytes([fill]) * n)


def _index(weight_map: dict[str, str], total: int | None) -> bytes:
    doc: dict = {}
    if total is not None:
        doc["metadata"] = {"total_size": total}
    doc["weight_map"] = weight_map
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def directory_samples(c: Catalogue) -> None:
    a4, b4 = _u8("a.weight", 4, 1), _u8("b.weight", 4, 2)
    c.directory("dir_index_missing_shard", {
        S1: st_file([a4]), "model.safetensors.index.json": _index({"a.weight": S1, "b.weight": S2}, None)},
        "INDEX_MISSING_SHARD", "index maps b.weight to model-00002-of-00002.safetensors, which does not exist")
    c.directory("dir_index_missing_tensor", {
        S1: st_file([a4]), S2: st_file([_u8("c.weight", 4, 3)]),
        "model.safetensors.index.json": _index({"a.weight": S1, "b.weight": S1, "c.weight": S2}, None)},
        "INDEX_MISSING_TENSOR", "index maps b.weight to shard 1, which does not hold it")
    c.directory("dir_index_unlisted_tensor", {
        S1: st_file([a4, b4]), S2: st_file([_u8("c.weight", 4, 3)]),
        "model.safetensors.index.json": _index({"a.weight": S1, "c.weight": S2}, 12)},
        "INDEX_UNLISTED_TENSOR", "shard 1 holds b.weight, which the index does not list (loaders that read "
        "the weight_map never see it)")
    c.directory("dir_index_total_size", {
        S1: st_file([a4]), S2: st_file([b4]),
        "model.safetensors.index.json": _index({"a.weight": S1, "b.weight": S2}, 9)},
        "INDEX_TOTAL_SIZE", "metadata.total_size says 9 bytes; the tensors hold 8 (a warning)",
        severity="warning", strict=True, exit_without_strict=0)
    c.directory("dir_index_not_json", {
        S1: st_file([a4]), "model.safetensors.index.json": b'{"weight_map": {"a.weight": "' + S1.encode() + b'",\n'},
        "INDEX_INVALID", "model.safetensors.index.json is cut off (not JSON)")
    c.directory("dir_index_path_traversal", {
        S1: st_file([a4]),
        "model.safetensors.index.json": _index({"a.weight": S1, "b.weight": "../x.safetensors"}, None)},
        "INDEX_INVALID", "index maps b.weight to '../x.safetensors', outside the model directory")
    c.directory("dir_index_weight_map_list", {
        S1: st_file([a4]), "model.safetensors.index.json": b'{"weight_map": [["a.weight", "' + S1.encode() + b'"]]}\n'},
        "INDEX_INVALID", "weight_map is a list, not an object")
    c.directory("dir_duplicate_tensor", {
        "part-a.safetensors": st_file([a4]), "part-b.safetensors": st_file([_u8("a.weight", 4, 9), b4])},
        "DUPLICATE_TENSOR", "no index; a.weight is in part-a.safetensors and part-b.safetensors with different data")
    c.directory("dir_truncated_shard", {
        S1: st_file([a4]), S2: st_file([_u8("b.weight", 64, 2)])[:-16],
        "model.safetensors.index.json": _index({"a.weight": S1, "b.weight": S2}, 68)},
        "TRUNCATED", "shard 2 is 16 bytes short (an interrupted download)")
    emb = ("model.embed_tokens.weight", "F16", [64, 32], f16_bytes(0.01 * _ints(64 * 32, -100, 100, 11)))
    head = ("lm_head.weight", "F16", [64, 32], f16_bytes(0.01 * _ints(64 * 32, -100, 100, 12)))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "vocab_size": 100,
           "tie_word_embeddings": False, "torch_dtype": "float16"}
    c.directory("dir_config_vocab_mismatch", {
        "model.safetensors": st_file([emb, head]),
        "config.json": (json.dumps(cfg, indent=2) + "\n").encode("utf-8")},
        "CONFIG_MISMATCH", "config.json says vocab_size 100; lm_head.weight and embed_tokens have 64 rows",
        checked_by="cli")
    c.directory("dir_config_not_json", {
        "model.safetensors": st_file([a4]), "config.json": b'{"hidden_size": 32,, "vocab_size": 100}\n'},
        "CONFIG_INVALID", "config.json is not JSON (a doubled comma)")
    c.directory("dir_no_safetensors", {
        "README.txt": b"This model directory deliberately holds no .safetensors file.\n"},
        "NO_SAFETENSORS", "a directory with no .safetensors file (git cannot store an empty one; this holds a README)",
        exit=3)
    c.directory("dir_only_bin", {"pytorch_model.bin": b"\x80\x02}q\x00."}, "NO_SAFETENSORS",
                "a directory holding only a pickle pytorch_model.bin", exit=3)


# ---------------------------------------------------------------------------------------------------------


def generate(out: str | os.PathLike = HERE) -> list[dict]:
    """Write every sample and index.json into ``out``; return the index entries."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = Catalogue(out)
    container_samples(c)
    layer_samples(c)
    directory_samples(c)
    paths = [e["path"] for e in c.entries]
    if len(set(paths)) != len(paths):
        raise SystemExit("make_malformed: duplicate sample path")
    text = json.dumps(c.entries, indent=1, ensure_ascii=True) + "\n"
    (out / "index.json").write_text(text, encoding="ascii", newline="\n")
    (out / "README.md").write_text(readme(c.entries), encoding="utf-8", newline="\n")
    return c.entries


def _md(text: str) -> str:
    from exl2fmt.errors import escape_name

    return escape_name(text).replace("|", "\\|").replace("*", "\\*")


def readme(entries: list[dict]) -> str:
    """spec/malformed/README.md: the prose below plus one table row per sample (generated: do not edit)."""
    from exl2fmt.errors import ErrorCode

    rows = []
    for e in entries:
        how = []
        if e.get("deep"):
            how.append("`--deep`")
        if e.get("strict"):
            how.append("`--strict` (warning)")
        if e.get("checked_by") == "cli":
            how.append("CLI only")
        rows.append(f"| `{e['path']}` | `{e['code']}` | {e['exit']} | {', '.join(how) or '-'} | "
                    f"{_md(e['description'])} | {_md(ErrorCode(e['code']).rule)} |")
    return README_HEAD + "\n".join(rows) + "\n" + README_TAIL


README_HEAD = """\
# Malformed-input catalogue

Crafted bad inputs for `exl2fmt` (this file is generated by `make_malformed.py`; edit the generator, not
this file).  Each sample breaks one rule and must give one stable error code, exit status 1 (read, breaks a
rule) or 3 (cannot be read as a model at all), a one-line message naming the file (and the tensor or layer),
no traceback, and bounded time and memory - an absurd header never makes a reader allocate by its numbers.

Regenerate (deterministic and idempotent; byte-identical output on every run and machine):

    .venv/bin/python spec/malformed/make_malformed.py          # rewrites spec/malformed/ in place
    .venv/bin/python spec/malformed/make_malformed.py OUT_DIR  # or writes a copy elsewhere

`tests/test_malformed.py` regenerates into a temp dir and fails if any byte differs from the checked-in
files, runs every sample through the library (`open_model`, `index_issues()`, `config`, `load_layer(...)
.validate(deep=...)`) and checks code, file, tensor, one-line message, < 2 s and < 50 MB traced memory.

How the samples are made: container samples are hand-built bytes (`struct.pack` + literal JSON text), so
they do not depend on exl2fmt's writer; layer samples start from a valid layer built with
`exl2fmt.formats.exl2.exl2_tensors` / `exl2fmt.codec.gptq` (checked valid by the tests) with exactly one thing
corrupted, written with `exl2fmt.container.write_safetensors`; model directories combine hand-built shards
with a broken index or `config.json`.

## `index.json`

A JSON list; one object per sample:

| field | meaning |
|---|---|
| `path` | file or directory, relative to `spec/malformed/` |
| `code` | the `ErrorCode` value expected (`exl2fmt.errors`) |
| `exit` | exit status of `exl2fmt validate PATH` (with `--deep` when `deep`, `--strict` when `strict`) |
| `layer` | the layer key whose tensors are broken (null for container and directory samples) |
| `description` | one line: what is wrong |
| `tensor` | (optional) the tensor the container error must name |
| `deep` | (optional) true: found only by `--deep` (reads tensor data); header-only validation passes |
| `severity` | (optional) `"warning"`: reported as a warning, a failure only with `--strict` |
| `strict` | (optional) true: fails only with `--strict`; `exit_without_strict` gives the status without it |
| `checked_by` | (optional) `"cli"`: the check lives in the model-level validator (`exl2fmt/validate/`), not in a library function the library test calls |
| `oversize_reason` | (optional) why the sample is over the 64 KiB size budget |

## Samples

| sample | code | exit | needs | what is wrong | rule |
|---|---|---|---|---|---|
"""

README_TAIL = """
Not in the catalogue: `TOO_MANY_TENSORS` (needs a header of over a million entries, tens of MB) and
`IO_ERROR` / `PATH_NOT_FOUND` (properties of the file system, not of a file's bytes); the container tests
cover them.

## Hostile catalogues

Each has its own README (what every case breaks and the code it must give), generator or test-time builder,
and test file; every case runs through the bounded harness (`tests/hostile_harness.py`: a fresh CLI process,
a wall-clock limit, an address-space cap, a measured peak RSS, no traceback), and
`tests/test_hostile3_ci.py` fails if any catalogued case is run by no non-slow test.

| folder | what it holds | tests |
|---|---|---|
| `hostile/` | huge counts, odd numbers, 100k-entry indexes, config and GGUF metadata values (round 2) | `test_hostile.py` |
| `hostile_io/` | control/bidi characters in names, FIFOs, devices, dangling links, full disks, signals | `test_hostile_io.py` |
| `hostile3_userdata/` | `--work-dir`, `--save-measurement`, `dequantize -o`, `sample --force` pointed at the user's files; interrupts of GGUF quantization (built at test time) | `test_hostile3_userdata.py` |
| `hostile3_sidefiles/` | side files linked out of SRC (a secret file, `/proc/self/environ`), FIFOs, sparse multi-GB cards; quantization artefacts carried into dense outputs | `test_hostile3_sidefiles.py` |
| `hostile3_ci/` | GitHub Actions workflow commands (`::` / `##[`) in every file-derived string; layers with 0 rows or columns | `test_hostile3_ci.py` |
| `hostile3_hub/` | Hub servers that trickle headers, list hostile names, serve huge headers or bad GGUF preambles | `test_hostile3_hub.py` |
| `hostile3_json/` | JSON side inputs: deep nesting, huge numbers, NaN, FIFOs, `/dev/zero`, 99 MB documents, `.npy` headers declaring 10^7 rows, wrong types | `test_hostile3_json.py` |
| `hostile3_gguf/` | GGUF -> HF: tokenizer metadata of the wrong type or unloadable, non-finite weights, lying expert counts | `test_hostile3_gguf.py` |
| `hostile3_moe/` | MoE configs whose expert counts or top-k disagree with the tensors (built at test time) | `test_hostile3_moe.py` |
| `hostile3_exl3/` | EXL3 layers breaking each rule of `spec/exl3.md` §9: trellis last dim and rate, half rate without `mul1`, markers, `suh`/`svh` lengths, padding vs config.json, NaN scales, 2^40-element headers, truncated data, legacy `scale`, quantized embeddings | `test_hostile3_exl3.py` |
"""


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE
    entries = generate(out)
    print(f"wrote {len(entries)} samples and index.json to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
