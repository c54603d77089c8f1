"""The prose spec (spec/*.md) and spec/layout.json must agree with the code.

The markdown tables of spec/exl2.md, spec/gptq.md and spec/exl3.md are parsed (found by their header rows, see
spec/README.md) and compared with ``exl2fmt.layout``, ``exl2fmt.errors`` and the codecs, so a change on
either side that is not carried over to the other fails here.  Worked examples are recomputed with the slow
NumPy oracle (``exl2fmt.codec.oracle``) *and* the Numba codecs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from exl2fmt.codec import exl2 as codec
from exl2fmt.codec import gptq as gcodec
from exl2fmt.codec import oracle
from exl2fmt.errors import ErrorCode
from exl2fmt.groups import decode_q_groups, encode_q_groups, group_table_from_rows
from exl2fmt.layout import (BIT_WIDTHS, FORMAT_VERSION, LAYOUTS, Format, Tier, exl2_total_bits, layout_document,
                            pad32, plan_rows)

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
EXL2_MD = (SPEC / "exl2.md").read_text(encoding="utf-8")
GPTQ_MD = (SPEC / "gptq.md").read_text(encoding="utf-8")
EXL3_MD = (SPEC / "exl3.md").read_text(encoding="utf-8") if (SPEC / "exl3.md").exists() else ""

REGENERATE = ".venv/bin/python -m exl2fmt.layout > spec/layout.json"


# ------------------------------------------------------------------------------------------------ helpers


def tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table as (header cells, body rows); the |---| separator line is dropped."""
    out, block = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            out.append((block[0], block[2:]))
        block = []
    return out


def find_tables(md: str, pred) -> list[tuple[list[str], list[list[str]]]]:
    return [t for t in tables(md) if pred(t[0])]


def one_table(md: str, pred, what: str):
    found = find_tables(md, pred)
    assert len(found) == 1, f"expected exactly one {what} table, found {len(found)}"
    return found[0]


def col(header: list[str], name: str) -> int:
    for i, h in enumerate(header):
        if h.startswith(name):
            return i
    raise AssertionError(f"no column {name!r} in table header {header}")


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def hex_words(cell: str) -> list[int]:
    return [int(h, 16) for h in re.findall(r"0x([0-9A-Fa-f]{1,8})", cell)]


def fenced_blocks(md: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", md, flags=re.S)


def eval_t(expr: str, t: int) -> int:
    # expressions come from our own spec files: Python arithmetic in `t` only
    return int(eval(expr, {"__builtins__": {}}, {"t": t}))  # noqa: S307


def f16_bits(x) -> int:
    return int(np.asarray(x, dtype=np.float16).view(np.uint16))


def bits_f16(h: int) -> np.float16:
    return np.array([h], dtype=np.uint16).view(np.float16)[0]


# ------------------------------------------------------------------------------------------------ (1) drift


def test_layout_json_is_current():
    want = json.dumps(layout_document(), indent=2) + "\n"
    got = (SPEC / "layout.json").read_text(encoding="utf-8")
    assert got == want, f"spec/layout.json is stale: regenerate it with `{REGENERATE}`"


def test_format_version_stated():
    m = re.search(r"Format version \*\*([0-9.]+)\*\*", EXL2_MD)
    assert m, "spec/exl2.md must state 'Format version **X.Y**' near the top"
    assert m.group(1) == FORMAT_VERSION == json.loads((SPEC / "layout.json").read_text())["format_version"]


# ------------------------------------------------------------------------------------------------ (2) tables


def _slot_rows(md: str, fmt: Format) -> dict[str, tuple[tuple[str, ...], str, str]]:
    header, rows = one_table(md, lambda h: h[0] == f"slot ({fmt.value})", f"slot ({fmt.value})")
    c_dt, c_shape, c_status = col(header, "stored dtype"), col(header, "shape"), col(header, "status")
    out = {}
    for r in rows:
        name = code_spans(r[0])[0]
        assert name not in out, f"slot {name!r} listed twice in the {fmt.value} table"
        shape = code_spans(r[c_shape])
        out[name] = (tuple(code_spans(r[c_dt])), shape[0] if shape else r[c_shape], r[c_status].split()[0])
    return out


@pytest.mark.parametrize("doc,fmt", [("exl3.md" if f is Format.EXL3 else "exl2.md", f) for f in LAYOUTS]
                         + [("gptq.md", Format.GPTQ)], ids=lambda v: getattr(v, "value", v))
def test_slot_tables_match_layout(doc, fmt):
    if doc == "exl3.md":
        # EXL3's slot table lives in its own spec (issue 39), written alongside the decoder
        if not (SPEC / doc).exists():
            pytest.skip("spec/exl3.md is not on this branch yet")
        md = (SPEC / doc).read_text(encoding="utf-8")
    else:
        md = EXL2_MD if doc == "exl2.md" else GPTQ_MD
    want = {s.name: (s.dtypes, s.shape_text, s.status.value) for s in LAYOUTS[fmt]}
    got = _slot_rows(md, fmt)
    assert set(got) == set(want), f"{doc}: slot names differ from exl2fmt.layout.LAYOUTS[{fmt.value}]"
    for name in want:
        assert got[name] == want[name], f"{doc} slot {name!r}: table says {got[name]}, layout says {want[name]}"


def test_recognised_only_layouts_are_named():
    from exl2fmt import layout

    for fmt in getattr(layout, "RECOGNISED_LAYOUTS", {}):
        name = fmt.value
        assert f"`{name}`" in EXL2_MD, f"spec/exl2.md §3.3 does not mention the recognised-only layout {name!r}"


def test_units_table_matches_bit_widths():
    header, rows = one_table(EXL2_MD, lambda h: any(c.startswith("rows per unit") for c in h), "units")
    cols = [col(header, n) for n in ("bits", "rows per unit", "words per unit", "zero point")]
    got = [tuple(int(r[i]) for i in cols) for r in rows]
    want = [(b.bits, b.rows_per_unit, b.words_per_unit, b.zero_point) for b in BIT_WIDTHS.values()]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))


def test_straddle_table_lists_exactly_the_straddling_codes():
    header, rows = one_table(EXL2_MD, lambda h: "low part" in h and "high part" in h, "straddle")
    got = {(int(r[0]), int(r[1])) for r in rows}
    want = {(b, t) for b, w in BIT_WIDTHS.items() for t in range(w.rows_per_unit) if (t * b) % 32 + b > 32}
    assert got == want


# ------------------------------------------------------------------------------------------------ (3) rules


def _rules(md: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for header, rows in find_tables(md, lambda h: h[:3] == ["id", "rule", "ErrorCode"]):
        for r in rows:
            rid = r[0]
            assert re.fullmatch(r"[A-Z]\d+", rid), f"bad rule id {rid!r}"
            assert rid not in out, f"rule id {rid} used twice"
            out[rid] = [c for span in code_spans(r[2]) for c in re.findall(r"[A-Z][A-Z0-9_]+", span)]
    return out


EXL2_CODES = [c for c in ErrorCode if c.name.startswith(("GROUPS_", "PERM_", "SLOT_"))
              or c.name in ("K_MISMATCH", "N_PADDING", "SCALE_MAX_INVALID")]


def test_rule_codes_exist():
    for doc, md in (("exl2.md", EXL2_MD), ("gptq.md", GPTQ_MD), ("exl3.md", EXL3_MD)):
        if not md:
            continue  # spec/exl3.md not on this branch
        rules = _rules(md)
        assert rules, f"{doc} has no rule tables"
        for rid, codes in rules.items():
            for c in codes:
                assert c in ErrorCode.__members__, f"{doc} rule {rid} names unknown ErrorCode {c}"


@pytest.mark.parametrize("code", EXL2_CODES, ids=lambda c: c.name)
def test_every_exl2_code_has_a_rule(code):
    named = {c for codes in _rules(EXL2_MD).values() for c in codes}
    assert code.name in named, f"no rule in spec/exl2.md reports {code.name}"


@pytest.mark.parametrize("code", [c for c in ErrorCode if c.name.startswith("EXL3_")], ids=lambda c: c.name)
def test_every_exl3_code_has_a_rule(code):
    if not EXL3_MD:
        pytest.skip("spec/exl3.md is not on this branch yet")
    named = {c for codes in _rules(EXL3_MD).values() for c in codes}
    assert code.name in named, f"no rule in spec/exl3.md reports {code.name}"


def test_exl3_rule_ids_are_x():
    assert all(rid.startswith("X") for rid in _rules(EXL3_MD)), "spec/exl3.md rule ids are X1, X2, ..."


def test_every_gptq_code_has_a_rule():
    named = {c for codes in _rules(GPTQ_MD).values() for c in codes}
    assert {c.name for c in ErrorCode if c.name.startswith("GPTQ_")} <= named


def test_rule_ids_cited_in_library_exist():
    ids = set(_rules(EXL2_MD)) | set(_rules(EXL3_MD))
    cited = set()
    for py in (ROOT / "exl2fmt").rglob("*.py"):
        for m in re.finditer(r"\brules? ([A-Z])(\d+)(?:\s*[-–]\s*\1(\d+))?", py.read_text(encoding="utf-8")):
            letter, lo, hi = m.group(1), int(m.group(2)), int(m.group(3) or m.group(2))
            cited |= {f"{letter}{i}" for i in range(lo, hi + 1)}
    assert cited, "expected the library to cite spec rules (e.g. groups.py: rules G1-G7)"
    assert cited <= ids, f"rules cited in exl2fmt/ but missing from spec/exl2.md: {sorted(cited - ids)}"


# ------------------------------------------------------------------------------------------------ (4) examples


def _q_weight_examples():
    header, rows = one_table(EXL2_MD, lambda h: any(c.startswith("packed words") for c in h), "q_weight examples")
    return [(int(r[0]), code_spans(r[1])[0], hex_words(r[2])) for r in rows]


def test_q_weight_examples_cover_every_width():
    assert {b for b, _, _ in _q_weight_examples()} == set(BIT_WIDTHS)


@pytest.mark.parametrize("bits,expr,words", _q_weight_examples(),
                         ids=[f"{b}b:{e}" for b, e, _ in _q_weight_examples()])
def test_q_weight_example(bits, expr, words):
    U = BIT_WIDTHS[bits].rows_per_unit
    codes = np.array([[eval_t(expr, t)] for t in range(U)], dtype=np.uint8)
    assert len(words) == BIT_WIDTHS[bits].words_per_unit
    slow = oracle.pack_q_weight(codes, [(bits, U)]).view(np.uint32)[:, 0]
    fast = codec.pack_q_weight(codes, group_table_from_rows([(bits, U)])).view(np.uint32)[:, 0]
    assert [int(x) for x in slow] == words, f"oracle gives {[hex(int(x)) for x in slow]}"
    assert [int(x) for x in fast] == words, f"codec gives {[hex(int(x)) for x in fast]}"
    back = codec.unpack_q_weight(np.array(words, dtype=np.uint32).view(np.int32)[:, None],
                                 group_table_from_rows([(bits, U)]))
    assert np.array_equal(back, codes)


def _q_scale_examples():
    header, rows = one_table(EXL2_MD, lambda h: any("q_scale` word" in c for c in h), "q_scale examples")
    return [([int(x) for x in code_spans(r[0])[0].split(",")], hex_words(r[1])[0]) for r in rows]


@pytest.mark.parametrize("codes,word", _q_scale_examples())
def test_q_scale_example(codes, word):
    c = np.array([codes], dtype=np.uint8)
    assert int(oracle.pack_q_scale(c).view(np.uint32)[0, 0]) == word
    assert int(codec.pack_q_scale(c).view(np.uint32)[0, 0]) == word
    assert codec.unpack_q_scale(np.array([[word]], dtype=np.uint32).view(np.int32))[0].tolist() == codes


def _dequant_examples():
    header, rows = one_table(EXL2_MD, lambda h: any(c.startswith("single rounding") for c in h), "dequant examples")
    out = []
    for r in rows:
        qsm, m, s, w, single = (hex_words(r[col(header, n)])[0] for n in
                                ("`q_scale_max`", "m", "s", "w", "single rounding"))
        out.append((int(r[0]), qsm, int(r[col(header, "c")]), int(r[col(header, "q")]), m, s, w, single))
    return out


@pytest.mark.parametrize("bits,qsm,c,q,m,s,w,single", _dequant_examples())
def test_dequant_rounding_example(bits, qsm, c, q, m, s, w, single):
    z = BIT_WIDTHS[bits].zero_point
    # the stated intermediates, step by step in numpy float16 arithmetic
    m16 = bits_f16(qsm) * np.float16(1 / 256)
    s16 = np.float16((c + 1) ** 2) * m16
    assert (f16_bits(m16), f16_bits(s16)) == (m, s)
    assert f16_bits(np.float16(float(bits_f16(qsm)) * (c + 1) ** 2 / 256 * (q - z))) == single
    # the full value through both decoders: one 32-row group, 32 columns, example in (row 0, column 0)
    codes = np.full((32, 32), z, dtype=np.uint8)
    codes[0, 0] = q
    scodes = np.zeros((1, 32), dtype=np.uint8)
    scodes[0, 0] = c
    q_weight = oracle.pack_q_weight(codes, [(bits, 32)])
    q_scale = oracle.pack_q_scale(scodes)
    q_scale_max = np.array([qsm], dtype=np.uint16).view(np.float16)
    slow = oracle.dequantize_stored(q_weight, q_scale, q_scale_max, [(bits, 32)])
    fast = codec.dequantize_stored(q_weight, q_scale, q_scale_max, group_table_from_rows([(bits, 32)]))
    assert f16_bits(slow[0, 0]) == w and f16_bits(fast[0, 0]) == w
    assert not np.any(fast[1:]) and not np.any(fast[0, 1:])  # q = z_b elsewhere: exactly zero


def _block_with(marker: str) -> dict[str, str]:
    blocks = [b for b in fenced_blocks(EXL2_MD) if re.search(rf"^{re.escape(marker)}\s*=", b, flags=re.M)]
    assert len(blocks) == 1, f"expected one code block containing {marker!r}"
    out = {}
    for line in blocks[0].splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def test_q_groups_example():
    ex = _block_with("q_groups")
    groups = [(int(b), int(r)) for b, r in re.findall(r"\((\d+),\s*(\d+)\)", ex["groups (bits, rows)"])]
    q_groups = _ints(ex["q_groups"])
    assert encode_q_groups(groups).tolist() == q_groups
    assert oracle.encode_q_groups(groups).tolist() == q_groups
    gt = decode_q_groups(np.array(q_groups, dtype=np.int16), int(ex["Q"]))
    assert gt.bits_rows() == groups and gt.Q == int(ex["Q"]) and gt.K == int(ex["K"])


def test_permutation_example():
    ex = _block_with("q_invperm")
    q_perm, q_invperm = np.array(_ints(ex["q_perm"])), np.array(_ints(ex["q_invperm"]))
    stored = re.findall(r"\w+", ex["stored"])
    W, wrong = re.findall(r"\w+", ex["W"]), re.findall(r"\w+", ex["wrong"])
    assert q_invperm.tolist() == np.argsort(q_perm).tolist() == codec.invert_permutation(q_perm).tolist()
    scattered = [None] * len(stored)
    for k, j in enumerate(q_perm):  # W[q_perm[k]] = stored[k]
        scattered[j] = stored[k]
    assert scattered == W == [stored[i] for i in q_invperm]
    assert wrong == [stored[i] for i in q_perm] and wrong != W
    # The same direction through the real decoders: embed the example in a 32-row 8-bit layer whose stored
    # row k holds code k + 1 in every column; original feature j must come out as the letter W says.
    K = 32
    perm = np.concatenate([q_perm, np.arange(len(q_perm), K)])
    invperm = np.argsort(perm).astype(np.int32)
    codes = np.repeat((np.arange(K) + 1 + 128).astype(np.uint8)[:, None], 32, axis=1)
    q_weight = codec.pack_q_weight(codes, group_table_from_rows([(8, K)]))
    q_scale = codec.pack_q_scale(np.full((1, 32), 15, dtype=np.uint8))  # s = q_scale_max = 1
    one = np.array([1.0], dtype=np.float16)
    fast = codec.dequantize(q_weight, q_scale, one, group_table_from_rows([(8, K)]), invperm)  # [N, K]
    slow = oracle.dequantize(q_weight, q_scale, one, [(8, K)], invperm)
    for j, letter in enumerate(W):
        k = stored.index(letter)
        assert fast[0, j] == slow[0, j] == k + 1, f"feature {j} should hold stored row {k}"


def _bpw_rows():
    header, rows = one_table(EXL2_MD, lambda h: "total bits" in h, "bpw")
    out = []
    for r in rows:
        K, N, N_pad = (int(r[col(header, n)]) for n in ("K", "N", "N_pad"))
        tiers = [Tier(float(p), int(b), int(g)) for p, b, g in
                 re.findall(r"([\d.]+)×(\d)b/(\d+)", r[col(header, "plan")])]
        out.append((K, N, N_pad, tiers, r[col(header, "bias")] == "yes", int(r[col(header, "G")]),
                    int(r[col(header, "total bits")]), r[col(header, "bpw")]))
    return out


@pytest.mark.parametrize("K,N,N_pad,tiers,bias,G,total,bpw_text", _bpw_rows())
def test_bpw_example(K, N, N_pad, tiers, bias, G, total, bpw_text):
    assert pad32(N) == N_pad
    assert len(plan_rows(K, tiers)) == G
    assert exl2_total_bits(K, N_pad, tiers, bias) == total
    numel = K * N_pad + (N_pad if bias else 0)
    assert f"{total / numel:.4f}" == bpw_text


def _gptq_examples():
    header, rows = one_table(GPTQ_MD, lambda h: "words (hex)" in h, "GPTQ examples")
    return [(int(r[0]), code_spans(r[1])[0], r[2], code_spans(r[3])[0], hex_words(r[4])) for r in rows]


@pytest.mark.parametrize("bits,tensor,conv,expr,words", _gptq_examples())
def test_gptq_example(bits, tensor, conv, expr, words):
    vals = np.array([eval_t(expr, t) for t in range(32)])
    if tensor == "qweight":
        codes = vals.astype(np.uint8)[:, None]
        fast = gcodec.pack_qweight(codes, bits).view(np.uint32)[:, 0]
        slow = oracle.gptq_pack_rows(codes, bits).view(np.uint32)[:, 0]
        assert np.array_equal(gcodec.unpack_qweight(fast.view(np.int32)[:, None], bits), codes)
    else:
        v2 = conv == "v2"
        fields = gcodec.fields_from_zeros(vals[None, :], bits, v2)
        assert np.array_equal(gcodec.zeros_from_fields(fields, v2)[0], vals)
        fast = gcodec.pack_qzeros(fields, bits).view(np.uint32)[0]
        slow = oracle.gptq_pack_rows(np.ascontiguousarray(fields.T), bits).view(np.uint32)[:, 0]
    assert [int(x) for x in fast] == words
    assert [int(x) for x in slow] == words
