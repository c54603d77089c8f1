"""The EXL3 golden vectors of spec/vectors/exl3_* and the worked examples of spec/exl3.md.

Every vector decodes, through the NumPy oracle ``tests/exl3_oracle.py``, to the bits stored in its
``expected.json`` (inner weight by SHA-256 and first tile, trimmed nn.Linear weight bit for bit); when the fast
codec ``exl2fmt.codec.exl3`` is importable, it must give the same bits.  The hex tables of spec/exl3.md §6 and
the size table of §10 are recomputed from the oracle.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from exl2fmt.container import open_model

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "spec" / "vectors"
SPEC = (ROOT / "spec" / "exl3.md").read_text(encoding="utf-8")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exl3_oracle as E  # noqa: E402

RATES = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)
EXL3_NAMES = [f"exl3_{r:g}bit_{cb}" for r in RATES for cb in ("3inst", "mcg", "mul1")
              if float(r).is_integer() or cb == "mul1"] + ["exl3_padded_2.5bit_mul1", "exl3_legacy_su_sv_3bit_3inst"]


def _expected(name: str) -> dict:
    return json.loads((VECTORS / name / "expected.json").read_text(encoding="utf-8"))


def _u16_hex(s: str) -> np.ndarray:
    return np.array([int(s[i:i + 4], 16) for i in range(0, len(s), 4)], dtype=np.uint16)


def _u16_rows(rows: list[str]) -> np.ndarray:
    return np.stack([_u16_hex(r) for r in rows])


def _tensors(name: str) -> tuple[dict, dict]:
    exp = _expected(name)
    with open_model(VECTORS / name / exp["file"]) as model:
        pre = exp["key"] + "."
        t = {n[len(pre):]: np.array(model.get(n)) for n in model.names() if n.startswith(pre)}
    return exp, t


def _inner_sha(w_hat: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(w_hat).view(np.uint16).astype("<u2").tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# the set
# ---------------------------------------------------------------------------------------------------


def test_exl3_set_complete():
    on_disk = sorted(p.name for p in VECTORS.glob("exl3_*") if p.is_dir())
    assert on_disk == sorted(EXL3_NAMES)
    assert len(EXL3_NAMES) == 29
    combos = {(e["rate"], e["codebook"]) for e in map(_expected, EXL3_NAMES)}
    assert len(combos) == 27  # 8 whole rates x 3 codebooks + 3 half rates x mul1
    assert all(cb == "mul1" for r, cb in combos if not float(r).is_integer())


def test_exl3_files_small():
    for name in EXL3_NAMES:
        for p in (VECTORS / name).iterdir():
            assert p.stat().st_size < 150_000, p
    total = sum(p.stat().st_size for n in EXL3_NAMES for p in (VECTORS / n).iterdir())
    assert total < 3_000_000


def test_exl3_sha256sums():
    listed = dict(reversed(line.split("  ", 1)) for line in (VECTORS / "SHA256SUMS").read_text().splitlines())
    mine = {p.relative_to(VECTORS).as_posix() for n in EXL3_NAMES for p in (VECTORS / n).iterdir() if p.is_file()}
    assert mine <= set(listed)
    for rel in sorted(mine):
        assert hashlib.sha256((VECTORS / rel).read_bytes()).hexdigest() == listed[rel], rel


# ---------------------------------------------------------------------------------------------------
# each vector through the oracle
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXL3_NAMES)
def test_exl3_vector_oracle(name):
    exp, t = _tensors(name)
    assert hashlib.sha256((VECTORS / name / exp["file"]).read_bytes()).hexdigest() == exp["sha256"]
    tr = t["trellis"]
    assert tr.dtype == np.int16 and tr.shape == (exp["in_p"] // 16, exp["out_p"] // 16, exp["trellis_last_dim"])
    assert exp["trellis_last_dim"] == 16 * exp["rate"]
    assert exp["in_p"] % 128 == 0 and 0 <= exp["in_p"] - exp["K"] < 128
    assert exp["out_p"] % 128 == 0 and 0 <= exp["out_p"] - exp["N"] < 128
    assert {"mcg", "mul1"} & set(t) == ({exp["codebook"]} - {"3inst"})
    assert ("su" in t) == (exp["signs"] == "su/sv") and ("suh" in t) == (exp["signs"] == "suh/svh")

    # first tile: words, states and values in ring order, and as placed in W_hat
    assert tr[0, 0].view(np.uint16).tolist() == _u16_hex(exp["tile0_words"]).tolist()
    states = E.decode_states(tr, exp["rate"])
    perm = E.tc_perm()
    assert states[:16, :16].reshape(256)[perm].tolist() == _u16_rows(exp["tile0_states"]).reshape(256).tolist()
    w_hat, rate, cb = E.inner_weight(t)
    assert (rate, cb) == (exp["rate"], exp["codebook"])
    vals = w_hat[:16, :16].reshape(256)[perm].view(np.uint16)
    assert vals.tolist() == _u16_rows(exp["tile0_values_f16"]).reshape(256).tolist()
    assert w_hat[:16, :16].view(np.uint16).tolist() == _u16_rows(exp["tile0_inner_f16"]).tolist()
    assert _inner_sha(w_hat) == exp["inner_sha256"]
    # the edge tiles: all-zero and all-one rings
    assert (states[:16, 16:32] == 0).all() and (states[16:32, :16] == 0xFFFF).all()

    W = E.dequantize(t, exp["K"], exp["N"])
    assert W.dtype == np.float16 and W.shape == (exp["N"], exp["K"])
    assert W.view(np.uint16).tolist() == _u16_rows(exp["dequant_f16"]).tolist()
    if exp["bias_f16"] is not None:
        assert t["bias"].view(np.uint16).tolist() == _u16_hex(exp["bias_f16"]).tolist()


def test_exl3_padding_values_do_not_matter():
    """spec/exl3.md §1.5: suh[i >= in] and svh[j >= out] never reach the trimmed weight."""
    exp, t = _tensors("exl3_padded_2.5bit_mul1")
    K, N = exp["K"], exp["N"]
    t2 = dict(t)
    t2["suh"] = t["suh"].copy()
    t2["svh"] = t["svh"].copy()
    t2["suh"][K:] = np.float16(7.0)
    t2["svh"][N:] = np.float16(-3.0)
    assert np.array_equal(E.dequantize(t2, K, N).view(np.uint16), E.dequantize(t, K, N).view(np.uint16))
    # ... but the padded rows of W_hat do: trimming before the Hadamard stage is wrong
    full = E.dequantize(t, exp["in_p"], exp["out_p"])
    assert full.shape == (exp["out_p"], exp["in_p"])
    assert np.array_equal(full[:N, :K].view(np.uint16), E.dequantize(t, K, N).view(np.uint16))


def test_exl3_half_rate_needs_mul1_and_markers_checked():
    _, t = _tensors("exl3_2.5bit_mul1")
    bad = {k: v for k, v in t.items() if k != "mul1"}
    with pytest.raises(ValueError):
        E.inner_weight(bad)
    with pytest.raises(ValueError):
        E.inner_weight({**bad, "mcg": np.array(E.MCG_MARKER, dtype=np.int32)})
    with pytest.raises(ValueError):
        E.inner_weight({**t, "mul1": np.array(0, dtype=np.int32)})


# ---------------------------------------------------------------------------------------------------
# the fast codec (lands from the decoder branch)
# ---------------------------------------------------------------------------------------------------


def _fast():
    try:
        return importlib.import_module("exl2fmt.codec.exl3")
    except ImportError:
        pytest.skip("exl2fmt.codec.exl3 not available")


@pytest.mark.parametrize("name", EXL3_NAMES)
def test_exl3_vector_fast_codec(name):
    C = _fast()
    exp, t = _tensors(name)
    k2 = int(2 * exp["rate"])
    legacy = exp["signs"] == "su/sv"
    w_hat = C.inner_weight(t["trellis"], k2, exp["codebook"])
    assert _inner_sha(w_hat) == exp["inner_sha256"]
    su, sv = (t["su"], t["sv"]) if legacy else (t["suh"], t["svh"])
    W = C.dequantize(t["trellis"], su, sv, k2, exp["codebook"], exp["K"], exp["N"], legacy_signs=legacy)
    assert W.shape == (exp["N"], exp["K"])
    assert np.asarray(W).view(np.uint16).tolist() == _u16_rows(exp["dequant_f16"]).tolist()


# ---------------------------------------------------------------------------------------------------
# spec/exl3.md worked examples
# ---------------------------------------------------------------------------------------------------


def _table(header: list[str]) -> list[list[str]]:
    lines = SPEC.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells == header:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip().strip("`") for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"spec/exl3.md has no table {header}")


def test_spec_ring_example():
    block = SPEC.split("### 6.1", 1)[1].split("### 6.2", 1)[0]
    words = {int(i): int(v, 16) for i, v in re.findall(r"u\[(\d+)\] = 0x([0-9A-Fa-f]{4})", block)}
    assert words == {0: 0x1234, 1: 0xC0DE, 30: 0xBEEF, 31: 0x5A5A}
    u = np.zeros(32, dtype=np.uint16)
    for i, v in words.items():
        u[i] = v
    states = E.decode_states(u.view(np.int16).reshape(1, 1, 32), 2).reshape(256)
    perm = E.tc_perm()
    e = E.window_end(2)
    rows = _table(["t", "e(t)", "state", "row", "col"])
    assert len(rows) >= 10
    for t_, et, st, r, c in rows:
        t_ = int(t_)
        assert int(et) == e[t_]
        assert int(st, 16) == states[perm[t_]], t_
        assert (int(r), int(c)) == divmod(int(perm[t_]), 16)


def test_spec_half_rate_steps():
    rows = _table(["rate", "d(0..7)", "e(0..7)"])
    assert [r[0] for r in rows] == ["1.5", "2.5", "3.5"]
    for rate, d, e in rows:
        assert [int(x) for x in d.split()] == E.step_bits(float(rate))[:8].tolist()
        assert [int(x) for x in e.split()] == E.window_end(float(rate))[:8].tolist()


def test_spec_codebook_examples():
    rows = _table(["state", "codebook", "x", "halves", "value"])
    assert {r[1] for r in rows} == {"3inst", "mcg", "mul1"}
    mult = {"3inst": (89226354, 64248484), "mcg": (0xCBAC1FED, 0), "mul1": (0x83DCD12D, 0)}
    for st, cb, x, halves, value in rows:
        s = int(st, 16)
        m, a = mult[cb]
        xv = (s * m + a) & 0xFFFFFFFF
        assert int(x, 16) == xv, (st, cb)
        if cb == "mul1":
            assert int(halves.split("=")[1]) == sum((xv >> (8 * i)) & 0xFF for i in range(4))
        else:
            assert int(halves.split(":")[0].strip("`"), 16) == (xv & 0x8FFF8FFF) ^ 0x3B603B60
        got = E.codebook_values(np.array([s]), cb).view(np.uint16)[0]
        assert int(value, 16) == got, (st, cb)


def test_spec_size_table():
    rows = _table(["in", "out", "r", "signs", "marker", "bias", "total bits", "bpw"])
    assert len(rows) >= 4
    for i, o, r, signs, marker, bias, total, bpw in rows:
        i, o, r = int(i), int(o), float(r)
        ip, op = -(-i // 128) * 128, -(-o // 128) * 128
        nb = 0 if bias == "no" else int(bias)
        bits = ip * op * r + ((ip + op) if signs == "su/sv" else 16 * (ip + op)) + (0 if marker == "none" else 32) \
            + 16 * nb
        assert int(total) == bits
        assert float(bpw) == pytest.approx(bits / (i * o + nb), abs=5e-5)


def test_spec_constants():
    assert "0xCBAC1FED" in SPEC and "0x83DCD12D" in SPEC and "0x3DB504F3" in SPEC
    assert np.float32(E.HAD_SCALE_F32).view(np.uint32) == 0x3DB504F3
    assert int(np.int32(E.MCG_MARKER)) == -877912083 and int(np.int32(E.MUL1_MARKER)) == -2082680531
    assert "-877912083" in SPEC.replace("−", "-") and "-2082680531" in SPEC.replace("−", "-")
    assert "2212286765" in SPEC and 0x83DCD12D == 2212286765
