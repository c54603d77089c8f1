"""q_groups encode / decode and the group rules G1-G7 (exl2-format.md 3.4, 3.5, 3.8)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from conftest import bits_rows, hyp_settings
from exl2fmt.codec import oracle as O
from exl2fmt.errors import ErrorCode, Exl2Error
from exl2fmt.groups import GroupTable, decode_q_groups, encode_q_groups, group_table_from_rows

# 3.5 example: groups (8b, 32 rows), (4b, 64), (4b, 64), (3b, 96) -> q_groups [8,0, 4,8, 4,16, 3,24], Q = 33
EXAMPLE_BR = [(8, 32), (4, 64), (4, 64), (3, 96)]
EXAMPLE_QG = [8, 0, 4, 8, 4, 16, 3, 24]


def test_spec_example_encode():
    qg = encode_q_groups(EXAMPLE_BR)
    assert qg.dtype == np.int16 and qg.tolist() == EXAMPLE_QG
    assert O.encode_q_groups(EXAMPLE_BR).tolist() == EXAMPLE_QG


def test_spec_example_decode():
    gt = decode_q_groups(np.array(EXAMPLE_QG, np.int16), 33)
    assert gt.G == 4 and gt.K == 256 and gt.Q == 33
    assert gt.bits.tolist() == [8, 4, 4, 3]
    assert gt.qrow.tolist() == [0, 8, 16, 24]
    assert gt.qrows.tolist() == [8, 8, 8, 9]
    assert gt.rows.tolist() == [32, 64, 64, 96]
    assert gt.row_start.tolist() == [0, 32, 96, 160]
    assert gt.bits_rows() == EXAMPLE_BR
    assert gt.rows_per_bits() == {8: 32, 4: 128, 3: 96}


def test_last_group_rows_come_from_q_weight_rows():
    """Rule 20 of 3.7: the last group's size is (Q - qrow_last) * 32 / bits; extra q_weight rows change K."""
    assert decode_q_groups(np.array(EXAMPLE_QG, np.int16), 36).rows.tolist() == [32, 64, 64, 128]
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array(EXAMPLE_QG, np.int16), 34)  # 10 rows at 3 bits = 106.67 input rows
    assert e.value.code is ErrorCode.GROUPS_ROWS


def _fields_equal(a: GroupTable, b: GroupTable) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("bits", "qrow", "qrows", "row_start", "rows"))


@hyp_settings(60)
@given(bits_rows(max_K=8192, max_group_rows=1024, max_groups_per_tier=6))
def test_encode_decode_roundtrip(br):
    qg = encode_q_groups(br)
    assert np.array_equal(qg, O.encode_q_groups(br))
    Q = sum(r * b // 32 for b, r in br)
    gt = decode_q_groups(qg, Q)
    assert gt.bits_rows() == br
    assert _fields_equal(gt, group_table_from_rows(br))
    assert gt.K == sum(r for _, r in br) and gt.Q == Q and gt.G == len(br)
    # row_start / qrow are running sums
    assert gt.row_start.tolist() == np.concatenate([[0], np.cumsum([r for _, r in br])[:-1]]).tolist()


def test_encode_rejects():
    with pytest.raises(ValueError):
        encode_q_groups([(7, 32)])
    with pytest.raises(ValueError):
        encode_q_groups([(3, 16)])  # 48 bits: not whole int32 words
    with pytest.raises(ValueError):
        encode_q_groups([(8, 32)] * 4097 + [(8, 32)])  # qrow 32776 > 32767


# --- each broken rule gives its code ---------------------------------------------------------------

BROKEN = [
    # (q_groups, q_weight rows, expected code)
    ([7, 0], 7, ErrorCode.GROUPS_BITS),                     # bits 7
    ([0, 0], 1, ErrorCode.GROUPS_BITS),                     # bits 0
    ([4, 0, 1, 4], 5, ErrorCode.GROUPS_BITS),               # bits 1 in the second group
    ([4, 0, 8, 4], 12, ErrorCode.GROUPS_ORDER),             # ascending tiers 4 -> 8
    ([8, 0, 4, 8, 8, 12], 20, ErrorCode.GROUPS_ORDER),      # 8 after 4 (width not contiguous)
    ([4, 4], 8, ErrorCode.GROUPS_QROW),                     # qrow_0 != 0
    ([4, 0, 4, 8, 4, 4], 12, ErrorCode.GROUPS_QROW),        # not monotone
    ([4, 0, 4, 0], 8, ErrorCode.GROUPS_QROW),               # repeated qrow (empty group)
    ([4, 0, 4, 8], 8, ErrorCode.GROUPS_QROW),               # last group starts at the end of q_weight
    ([4, 0, 4, 20], 16, ErrorCode.GROUPS_QROW),             # last group starts past the end
    ([4, 0, 4, 2], 4, ErrorCode.GROUPS_ROWS),               # two 16-row 4-bit groups
    ([2, 0], 1, ErrorCode.GROUPS_ROWS),                     # 16 rows at 2 bits
    ([3, 0], 1, ErrorCode.GROUPS_ROWS),                     # 1 word at 3 bits = 10.67 rows
    ([5, 0, 5, 4], 9, ErrorCode.GROUPS_ROWS),               # 4 words at 5 bits = 25.6 rows
    ([], 0, ErrorCode.SLOT_SHAPE),                          # empty
    ([4, 0, 4], 8, ErrorCode.SLOT_SHAPE),                   # odd length
]


@pytest.mark.parametrize("qg,q_rows,code", BROKEN)
def test_decode_broken_rule(qg, q_rows, code):
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array(qg, np.int16), q_rows, tensor="L.q_groups", file="f.safetensors")
    assert e.value.code is code
    assert e.value.tensor == "L.q_groups" and e.value.file == "f.safetensors"


def test_unit_multiple_relaxation():
    """pack_columns alone accepts 16-row 2/4/6-bit groups; only require_multiple_of_32=False allows them."""
    gt = decode_q_groups(np.array([4, 0, 4, 2], np.int16), 4, require_multiple_of_32=False)
    assert gt.rows.tolist() == [16, 16]
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array([3, 0], np.int16), 1, require_multiple_of_32=False)
    assert e.value.code is ErrorCode.GROUPS_ROWS


def test_limits():
    # qrow above the int16 range (possible when q_groups is handed over as a wider integer array)
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array([8, 0, 8, 40000], np.int64), 40008)
    assert e.value.code is ErrorCode.GROUPS_LIMIT
    # a negative qrow (an int16 that wrapped): caught as a qrow error
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array([8, 0, 8, -5], np.int16), 16)
    assert e.value.code in (ErrorCode.GROUPS_QROW, ErrorCode.GROUPS_LIMIT)
    # one group of 32768 rows (> 32767)
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array([8, 0], np.int16), 32768 * 8 // 32)
    assert e.value.code is ErrorCode.GROUPS_LIMIT
    # K = 65536 is allowed (uint16 permutations), 65568 is not
    ok = decode_q_groups(np.array([2, 0, 2, 1024, 2, 2048, 2, 3072], np.int16), 4096)
    assert ok.K == 65536
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(np.array([2, 0, 2, 1024, 2, 2048, 2, 3072, 2, 4096], np.int16), 4098)
    assert e.value.code is ErrorCode.GROUPS_LIMIT
    # more than 32767 groups
    G = 32768
    qg = np.empty(2 * G, np.int64)
    qg[0::2] = 2
    qg[1::2] = np.arange(G)
    with pytest.raises(Exl2Error) as e:
        decode_q_groups(qg, G)
    assert e.value.code is ErrorCode.GROUPS_LIMIT


# ------------------------------------------------------------------------------------------------ whole-list path
# q_groups_plan takes a whole-list path for vectors that pass every rule and falls back to the rule-by-rule checks
# otherwise: the two must agree on every input, valid or not (same plan, or the same code and message).

from hypothesis import strategies as st  # noqa: E402

from exl2fmt.groups import _q_groups_plan_checked, q_groups_plan  # noqa: E402


def _outcome(fn, vals, rows, mult32):
    try:
        return ("ok", fn(list(vals), rows, tensor="t", file="f", require_multiple_of_32=mult32))
    except Exl2Error as e:
        return ("err", e.code, e.message, e.tensor, e.file)


@st.composite
def _q_groups_variants(draw):
    """A valid (q_groups, q_weight rows) pair, then maybe one or two entries or the row count nudged."""
    br = draw(bits_rows(max_K=2048))
    qg = encode_q_groups(br).tolist()
    rows = sum(r * b for b, r in br) // 32
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(["entry", "bits", "swap", "rows", "drop", "append"]))
        if what == "bits" and len(qg) >= 2:  # another valid width: breaks the order or the packing, or neither
            qg[2 * draw(st.integers(0, len(qg) // 2 - 1))] = draw(st.sampled_from([2, 3, 4, 5, 6, 8]))
        elif what == "swap" and len(qg) >= 4:  # two groups trade widths (same packed rows: only the order breaks)
            i, j = (2 * g for g in draw(st.lists(st.integers(0, len(qg) // 2 - 1), min_size=2, max_size=2,
                                                 unique=True)))
            qg[i], qg[j] = qg[j], qg[i]
        elif what == "entry":
            i = draw(st.integers(0, len(qg) - 1))
            qg[i] = draw(st.sampled_from([qg[i] + 1, qg[i] - 1, 0, -1, 1, 7, 2, 8, 32767, 32768, qg[i] * 2]))
        elif what == "rows":
            rows = draw(st.sampled_from([rows + 1, rows - 1, 0, rows * 2, 2 ** 40]))
        elif what == "drop" and len(qg) > 1:
            qg.pop(draw(st.integers(0, len(qg) - 1)))
        else:
            qg.append(draw(st.integers(-3, 40)))
    return qg, rows


@hyp_settings(400)
@given(_q_groups_variants(), st.booleans())
def test_whole_list_path_agrees_with_rule_by_rule(case, mult32):
    vals, rows = case
    assert _outcome(q_groups_plan, vals, rows, mult32) == _outcome(_q_groups_plan_checked, vals, rows, mult32)


def test_whole_list_path_edge_cases():
    """Inputs at each limit, both paths (empty, odd length, too many groups, K above MAX_K, rows above int16)."""
    from exl2fmt.layout import MAX_INT16, MAX_K

    cases = [([], 0), ([4], 1), ([4, 0, 4], 8), ([4, 0] * (MAX_INT16 + 1), 4), ([8, 0], MAX_K // 4 + 8),
             ([8, 0], MAX_K // 4), ([2, 0], MAX_INT16 + 1), ([2, 0], 2 * (MAX_INT16 + 1) // 32 * 2),
             ([4, 0, 4, MAX_INT16], MAX_INT16 + 4), ([True, 0], 1), ([4, 0, 4, 4], 4)]
    for vals, rows in cases:
        for mult32 in (True, False):
            assert _outcome(q_groups_plan, vals, rows, mult32) == _outcome(_q_groups_plan_checked, vals, rows, mult32)
