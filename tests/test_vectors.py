"""The golden vectors of spec/vectors: checked-in bytes, decoding through the public API, regeneration.

The expected values in each ``expected.json`` were computed by the NumPy twins (spec/vectors/make_vectors.py);
here they are compared with what the Numba codecs produce through ``exl2fmt.dequantize_layer`` and the layer
objects, so a change to either side shows up.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import exl2fmt
from conftest import f16_bits
from exl2fmt.codec import gptq as Q
from exl2fmt.container import open_model
from exl2fmt.model import load_layer

VECTORS = Path(__file__).resolve().parents[1] / "spec" / "vectors"
EXPECTED_NAMES = ["dense_f16", "exl2_2bit", "exl2_3bit", "exl2_4bit", "exl2_5bit", "exl2_6bit", "exl2_8bit",
                  "exl2_mixed", "gptq_3bit_asym_v2", "gptq_4bit_sym_v1_actorder"]
#: the EXL3 vectors (same generator and SHA256SUMS; decoded and checked in tests/test_exl3_vectors.py)
EXL3_NAMES = [f"exl3_{r:g}bit_{cb}" for r in (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5) for cb in ("3inst", "mcg", "mul1")
              if float(r).is_integer() or cb == "mul1"] + ["exl3_padded_2.5bit_mul1", "exl3_legacy_su_sv_3bit_3inst"]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    old, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep spec/vectors free of __pycache__
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = old
    return mod


def _expected(name: str) -> dict:
    return json.loads((VECTORS / name / "expected.json").read_text(encoding="utf-8"))


def _f16_from_hex(s: str) -> np.ndarray:
    return np.array([int(s[i:i + 4], 16) for i in range(0, len(s), 4)], dtype=np.uint16)


def _f16_rows(rows: list[str]) -> np.ndarray:
    return np.stack([_f16_from_hex(r) for r in rows])


def _u8_rows(rows: list[str]) -> np.ndarray:
    return np.array([[int(r[i:i + 2], 16) for i in range(0, len(r), 2)] for r in rows], dtype=np.uint8)


def _u4_rows(rows: list[str]) -> np.ndarray:
    return np.array([[int(c, 16) for c in r] for r in rows], dtype=np.uint8)


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


#: sub-directories with their own generator and tests (gguf/: llama.cpp's goldens, bench/gguf_goldens.py and
#: tests/test_gguf_arch.py)
OWN_SETS = ("gguf",)


def _ours(p: Path) -> bool:
    return "__pycache__" not in p.parts and p.relative_to(VECTORS).parts[0] not in OWN_SETS


def test_vector_set_is_complete_and_small():
    names = sorted(p.name for p in VECTORS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                   and p.name not in OWN_SETS)
    assert names == sorted(EXPECTED_NAMES + EXL3_NAMES)
    files = [p for p in VECTORS.rglob("*") if p.is_file() and _ours(p) and not p.relative_to(VECTORS).parts[0]
             .startswith("exl3_")]  # the EXL3 set has its own size limit (tests/test_exl3_vectors.py)
    assert sum(p.stat().st_size for p in files) < 200_000


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_hashes_match(name):
    exp = _expected(name)
    assert _sha256(VECTORS / name / exp["file"]) == exp["sha256"]


def test_sha256sums_file():
    lines = (VECTORS / "SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, rel = line.split("  ", 1)
        listed[rel] = digest
    for rel, digest in listed.items():
        assert _sha256(VECTORS / rel) == digest, rel
    generated = {p.relative_to(VECTORS).as_posix() for n in EXPECTED_NAMES + EXL3_NAMES for p in (VECTORS / n).iterdir()
                 if p.is_file()}
    assert set(listed) == generated


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_dequantize_layer_equals_expected(name):
    exp = _expected(name)
    want = _f16_rows(exp["dequant_f16"])
    assert want.shape == (exp["N"], exp["K"])
    for path in (VECTORS / name / exp["file"], VECTORS / name):  # the file, and its directory
        W = exl2fmt.dequantize_layer(path, exp["key"])
        assert W.dtype == np.float16 and W.shape == want.shape
        assert np.array_equal(f16_bits(W), want)


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_layer_contents_equal_expected(name):
    exp = _expected(name)
    with open_model(VECTORS / name) as model:
        layer = load_layer(model, exp["key"])
        assert layer.format.value == exp["format"]
        assert layer.validate(deep=True) == []
        assert (layer.in_features, layer.out_features) == (exp["K"], exp["N"])
        if exp["format"] == "exl2":
            assert layer.groups.bits_rows() == [tuple(g) for g in exp["groups"]]
            assert np.asarray(model.get(f"{exp['key']}.q_groups")).tolist() == exp["q_groups"]
            assert np.asarray(model.get(f"{exp['key']}.q_invperm")).tolist() == exp["q_invperm"]
            assert f16_bits(model.get(f"{exp['key']}.q_scale_max")).tolist() == \
                _f16_from_hex(exp["q_scale_max_f16"]).tolist()
            assert np.array_equal(layer.codes(), _u8_rows(exp["codes"]))
            assert np.array_equal(layer.scale_codes(), _u4_rows(exp["scale_codes"]))
            assert layer.n_pad == exp["N_pad"]
        elif exp["format"] == "gptq":
            assert (layer.bits, layer.v2) == (exp["bits"], exp["v2"])
            qw = np.asarray(model.get(f"{exp['key']}.qweight"))
            qz = np.asarray(model.get(f"{exp['key']}.qzeros"))
            assert np.array_equal(Q.unpack_qweight(qw, exp["bits"]), _u8_rows(exp["codes"]))
            zeros = Q.zeros_from_fields(Q.unpack_qzeros(qz, exp["bits"]), exp["v2"])
            assert np.array_equal(zeros, _u8_rows(exp["zeros"]))
            assert np.array_equal(f16_bits(model.get(f"{exp['key']}.scales")), _f16_rows(exp["scales_f16"]))
            g = exp["g_idx"]
            assert (f"{exp['key']}.g_idx" in model) == (g is not None)
            if g is not None:
                assert np.asarray(model.get(f"{exp['key']}.g_idx")).tolist() == g
                assert layer.act_order()
        if exp.get("bias_f16") is not None:
            assert f16_bits(layer.bias()).tolist() == _f16_from_hex(exp["bias_f16"]).tolist()


def test_exl2_mixed_covers_every_width_and_padding():
    exp = _expected("exl2_mixed")
    assert sorted({b for b, _ in exp["groups"]}) == [2, 3, 4, 5, 6, 8]
    assert exp["N"] == 40 and exp["N_pad"] == 64 and exp["q_invperm"] != list(range(exp["K"]))
    codes = _u8_rows(exp["codes"])
    r0 = 0
    for b, r in exp["groups"]:  # padding columns hold z_b, and the limits 0 and 2^b - 1 occur
        blk = codes[r0:r0 + r]
        assert (blk[:, 40:] == 1 << (b - 1)).all()
        assert blk[:, :40].min() == 0 and blk[:, :40].max() == (1 << b) - 1
        r0 += r


def test_regenerate_identical(tmp_path):
    gen = _load_generator()
    gen.main(tmp_path)
    ours = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    theirs = {p.relative_to(VECTORS).as_posix() for p in VECTORS.rglob("*")
              if p.is_file() and _ours(p) and (p.parent != VECTORS or p.name == "SHA256SUMS")}
    assert ours == theirs
    for rel in sorted(ours):
        assert (tmp_path / rel).read_bytes() == (VECTORS / rel).read_bytes(), rel
