"""The layout table, group plans and bits-per-weight accounting (exl2-format.md 1, 2.2, 3.7, 5.5; GPTQ A1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import bits_rows, hyp_settings, n_pads, random_codes, random_f16, seeds
from exl2fmt.container import SAFETENSORS_DTYPES
from exl2fmt.formats import layer_from_tensors
from exl2fmt.layout import (BIT_WIDTHS, DETECTION_ORDER, EXL2_BITS, GPTQ_BITS, LAYOUTS, DenseGeometry,
                            Exl2Geometry, Format, GptqGeometry, SlotStatus, Tier, bpw, exl2_total_bits, layout_document,
                            marker_slot, pad32, plan_desc, plan_rows, scale_ratio, slot, stored_bits)
from exl2fmt.formats.exl2 import exl2_tensors

REPO = Path(__file__).resolve().parents[1]


def T(*parts) -> list[Tier]:
    return [Tier(p, b, g) for p, b, g in parts]


# ---------------------------------------------------------------------------------------------------
# 5.5 worked examples (literal numbers from the reference)
# ---------------------------------------------------------------------------------------------------


def test_bpw_example_q_proj():
    tiers = T((0.1, 4, 128), (0.9, 3, 128))
    groups = plan_rows(4096, tiers)
    assert groups == [(4, 128)] * 4 + [(3, 128)] * 28  # g = (4, 28): 512 rows at 4b, 3584 at 3b
    bits = exl2_total_bits(4096, 4096, tiers)
    assert bits == 53_085_696
    assert round(bits / (4096 * 4096), 4) == 3.1642


def test_bpw_example_uniform_4bit_32g():
    bits = exl2_total_bits(4096, 4096, T((1.0, 4, 32)))
    assert len(plan_rows(4096, T((1.0, 4, 32)))) == 128
    assert round(bits / (4096 * 4096), 4) == 4.1332


def test_bpw_example_down_proj():
    tiers = T((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128))
    groups = plan_rows(11008, tiers)
    counts = [sum(1 for b, _ in groups if b == w) for w in (8, 4, 3)]
    assert counts == [18, 9, 73]
    assert groups[-1] == (3, 64) and all(r == 128 for b, r in groups[27:-1])
    bits = exl2_total_bits(11008, 4096, tiers)
    # by hand: q_weight 576*4096*8 + 1152*4096*4 + 9280*4096*3; G = 100 groups; perm 32 * 11008
    assert bits == 151_781_376 + 16 * 100 + 32 * 100 + 4 * 100 * 4096 + 32 * 11008 == 153_776_832
    assert round(bits / (11008 * 4096), 4) == 3.4105


def test_bpw_bias_counts_in_bits_and_numel():
    tiers = T((1.0, 4, 32))
    assert exl2_total_bits(4096, 4096, tiers, has_bias=True) == exl2_total_bits(4096, 4096, tiers) + 16 * 4096


# ---------------------------------------------------------------------------------------------------
# 3.7 group counting
# ---------------------------------------------------------------------------------------------------


def test_group_count_uses_ceil_not_round():
    # K * p / gs = 4096 * 0.05 / 32 = 6.4 -> 7 groups (round() would give 6); the 4-bit tier then gets
    # ceil(min(3891.2, 3872) / 128) = ceil(30.25) = 31 groups, the last clipped to 32 rows
    g = plan_rows(4096, T((0.05, 8, 32), (0.95, 4, 128)))
    assert g == [(8, 32)] * 7 + [(4, 128)] * 30 + [(4, 32)]


def test_early_tier_covering_K_leaves_later_tiers_empty():
    assert plan_rows(256, T((1.0, 4, 128), (0.5, 3, 32))) == [(4, 128), (4, 128)]


def test_last_group_clipped():
    assert plan_rows(640, T((0.05, 8, 32), (0.95, 4, 128))) == [(8, 32)] + [(4, 128)] * 4 + [(4, 96)]


def test_plan_rows_rejects():
    with pytest.raises(ValueError):
        plan_rows(256, T((0.5, 4, 32)))  # covers 128 of 256 rows
    with pytest.raises(ValueError):
        plan_rows(256, T((1.0, 7, 32)))
    with pytest.raises(ValueError):
        plan_rows(256, T((1.0, 4, 0)))


#: Distinct settings of the upstream preset tables (5.3), as (p, bits, gs) tuples.
PRESETS = [
    ((0.05, 3, 64), (0.95, 2, 64)), ((0.1, 3, 64), (0.9, 2, 64)), ((0.25, 3, 64), (0.75, 2, 64)),
    ((0.1, 4, 128), (0.9, 3, 128)), ((0.1, 4, 64), (0.9, 3, 64)), ((1.0, 4, 128),), ((1.0, 4, 64),),
    ((1.0, 4, 32),), ((0.1, 5, 128), (0.9, 4, 128)), ((0.1, 5, 32), (0.9, 4, 32)), ((1.0, 5, 64),),
    ((0.1, 6, 128), (0.9, 5, 128)), ((1.0, 6, 32),), ((1.0, 8, 32),), ((1.0, 8, 128),),
    ((0.05, 6, 32), (0.2, 3, 64), (0.75, 2, 64)), ((0.05, 5, 32), (0.95, 3, 32)),
    ((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128)), ((0.05, 8, 32), (0.95, 4, 128)),
    ((0.05, 8, 32), (0.1, 6, 128), (0.85, 5, 128)), ((0.15, 8, 128), (0.85, 6, 128)),
    ((0.3, 4, 32), (0.7, 2, 32)), ((0.15, 6, 32), (0.85, 4, 32)), ((0.1, 8, 128), (0.9, 6, 128)),
]


@hyp_settings(60)
@given(st.sampled_from(PRESETS), st.integers(1, 512).map(lambda m: 32 * m), n_pads(8192), st.booleans())
def test_plan_rows_and_total_bits_follow_5_5(preset, K, n_pad, has_bias):
    tiers = T(*preset)
    groups = plan_rows(K, tiers)
    assert sum(r for _, r in groups) == K
    assert all(r % 32 == 0 and r > 0 for _, r in groups)
    # every group has its tier's size except the very last one of the layer
    gs_of = {b: g for _, b, g in preset}
    assert all(r == gs_of[b] for b, r in groups[:-1])
    assert groups[-1][1] <= gs_of[groups[-1][0]]
    bits_seq = [b for b, _ in groups]
    assert bits_seq == sorted(bits_seq, reverse=True)
    # total_bits, term by term as 5.5 writes it
    G = len(groups)
    rho = sum(r * b for b, r in groups)
    expect = rho * n_pad + 16 * G + 32 * G + 4 * G * n_pad + 32 * K + (16 * n_pad if has_bias else 0)
    assert exl2_total_bits(K, n_pad, tiers, has_bias=has_bias) == expect


# ---------------------------------------------------------------------------------------------------
# plan_desc
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,preset,desc", [
    (640, ((0.05, 8, 32), (0.95, 4, 128)), "0.05:8b_32g/0.95:4b_128g"),        # 32 / 640, 608 / 640
    (1024, ((0.05, 8, 32), (0.95, 4, 128)), "0.062:8b_32g/0.938:4b_128g"),     # 64 / 1024 = 0.0625
    (4096, ((0.1, 4, 128), (0.9, 3, 128)), "0.125:4b_128g/0.875:3b_128g"),     # 512 / 4096
    (11008, ((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128)),
     "0.052:8b_32g/0.105:4b_128g/0.843:3b_128g"),                              # 576, 1152, 9280 of 11008
    (4096, ((1.0, 4, 32),), "1:4b_32g"),
])
def test_plan_desc(K, preset, desc):
    assert plan_desc(plan_rows(K, T(*preset))) == desc


def test_plan_desc_group_size_is_most_common():
    assert plan_desc([(4, 64), (4, 64), (4, 128)]) == "1:4b_64g"
    assert plan_desc([(4, 64), (4, 128)]) == "1:4b_128g"  # tie -> the larger
    assert plan_desc([]) == ""


# ---------------------------------------------------------------------------------------------------
# The layout table
# ---------------------------------------------------------------------------------------------------


def test_bit_width_table_matches_2_2():
    table = {b: (w.rows_per_unit, w.words_per_unit) for b, w in BIT_WIDTHS.items()}
    assert table == {2: (16, 1), 3: (32, 3), 4: (8, 1), 5: (32, 5), 6: (16, 3), 8: (4, 1)}
    assert {b: w.zero_point for b, w in BIT_WIDTHS.items()} == {2: 2, 3: 4, 4: 8, 5: 16, 6: 32, 8: 128}
    for b, w in BIT_WIDTHS.items():
        assert w.rows_per_unit * b == 32 * w.words_per_unit      # a unit is whole words
        assert w.rows_per_unit == 32 // math.gcd(32, b)          # the smallest such unit
        assert w.max_code == 2**b - 1
    assert EXL2_BITS == (8, 6, 5, 4, 3, 2) and GPTQ_BITS == (2, 3, 4, 8)


def test_every_format_has_one_distinct_required_marker():
    assert {f: marker_slot(f) for f in LAYOUTS} == {Format.EXL2: "q_weight", Format.GPTQ: "qweight",
                                                   Format.DENSE: "weight", Format.EXL3: "trellis"}
    assert DETECTION_ORDER == (Format.EXL2, Format.GPTQ, Format.EXL3, Format.DENSE)
    markers = [marker_slot(f) for f in LAYOUTS]
    assert len(set(markers)) == len(markers)
    for f in LAYOUTS:
        other_markers = set(markers) - {marker_slot(f)}
        assert not other_markers & {s.name for s in LAYOUTS[f]}, "a slot name that is another format's marker"


@pytest.mark.parametrize("fmt", list(LAYOUTS))
def test_slot_table_self_consistent(fmt):
    slots = LAYOUTS[fmt]
    names = [s.name for s in slots]
    assert len(set(names)) == len(names)
    assert slot(fmt, marker_slot(fmt)).status is SlotStatus.REQUIRED
    for s in slots:
        assert s.dtypes and all(d in SAFETENSORS_DTYPES for d in s.dtypes), s
        assert s.write_dtype == s.dtypes[0]
        assert s.shape_text.startswith("(") and s.description
    with pytest.raises(KeyError):
        slot(fmt, "no_such_slot")


def test_recognised_layouts_use_valid_dtypes():
    from exl2fmt import layout

    for name, slots in getattr(layout, "RECOGNISED_LAYOUTS", {}).items():
        names = [s.name for s in slots]
        assert len(set(names)) == len(names), name
        assert slots[0].status is SlotStatus.REQUIRED, name
        for s in slots:
            assert s.dtypes and all(d in SAFETENSORS_DTYPES for d in s.dtypes), (name, s)


def test_slot_statuses():
    req = {f: {s.name for s in LAYOUTS[f] if s.status is SlotStatus.REQUIRED} for f in LAYOUTS}
    assert req[Format.EXL2] == {"q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"}
    assert req[Format.GPTQ] == {"qweight", "qzeros", "scales"}
    assert req[Format.DENSE] == {"weight"}
    derived = [s.name for f in LAYOUTS for s in LAYOUTS[f] if s.status is SlotStatus.DERIVED]
    assert derived == ["q_group_map"]
    # exl2-format.md 1: dtypes as written
    w = {s.name: s.dtypes for s in LAYOUTS[Format.EXL2]}
    assert w["q_weight"] == ("I32",) and w["q_scale"] == ("I32",) and w["q_scale_max"] == ("F16",)
    assert w["q_groups"] == ("I16",) and w["q_invperm"][0] == "I32" and "I16" in w["q_invperm"]
    assert w["bias"] == ("F16",)


def test_exl2_shapes_of_3_5_example():
    g = Exl2Geometry(K=256, N_pad=64, G=4, Q=33)
    shapes = {s.name: s.shape(g) for s in LAYOUTS[Format.EXL2]}
    assert shapes == {"q_weight": (33, 64), "q_scale": (4, 8), "q_scale_max": (4,), "q_groups": (8,),
                      "q_invperm": (256,), "q_perm": (256,), "bias": (64,), "q_group_map": (512,)}


def test_gptq_shapes_of_a1_examples():
    q = GptqGeometry(K=4096, N=4096, bits=4, G=32)
    assert {s.name: s.shape(q) for s in LAYOUTS[Format.GPTQ]} == {
        "qweight": (512, 4096), "qzeros": (32, 512), "scales": (32, 4096), "g_idx": (4096,), "bias": (4096,)}
    d = GptqGeometry(K=11008, N=4096, bits=4, G=86)
    assert slot(Format.GPTQ, "qweight").shape(d) == (1376, 4096)
    assert slot(Format.GPTQ, "qzeros").shape(d) == (86, 512)
    k = GptqGeometry(K=4096, N=1024, bits=4, G=32)
    assert slot(Format.GPTQ, "qzeros").shape(k) == (32, 128)
    assert slot(Format.DENSE, "weight").shape(DenseGeometry(K=3, N=5)) == (5, 3)


def test_gptq_and_dense_bpw_by_hand():
    q = GptqGeometry(K=4096, N=4096, bits=4, G=32)
    present = {"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"}
    # 4096*4096*4 + 32*512*32 + 32*4096*16 + 4096*32 = 69,861,376 bits
    assert stored_bits(Format.GPTQ, q, present) == 69_861_376
    assert bpw(Format.GPTQ, q, present) == 69_861_376 / 4096**2
    d = DenseGeometry(K=100, N=30)
    assert bpw(Format.DENSE, d, {"weight": "F16"}) == 16.0
    assert bpw(Format.DENSE, d, {"weight": "F32", "bias": "F32"}) == 32.0
    assert bpw(Format.DENSE, d, {"weight": "BF16", "bias": "F16"}) == 16.0


def test_derived_slot_never_counted():
    g = Exl2Geometry(K=256, N_pad=64, G=4, Q=33)
    base = {"q_weight": "I32", "q_scale": "I32", "q_scale_max": "F16", "q_groups": "I16", "q_invperm": "I32"}
    assert stored_bits(Format.EXL2, g, {**base, "q_group_map": "I16"}) == stored_bits(Format.EXL2, g, base)
    assert stored_bits(Format.EXL2, g, {**base, "q_invperm": "I16"}) == stored_bits(Format.EXL2, g, base) - 16 * 256


def test_pad32_and_scale_ratio():
    assert [pad32(n) for n in (1, 31, 32, 33, 40, 64, 1000)] == [32, 32, 32, 64, 64, 64, 1024]
    assert scale_ratio(0) == 1 / 256 and scale_ratio(15) == 1.0 and scale_ratio(3) == 16 / 256


def test_layout_document():
    """The document against two oracles that are not built from ``LAYOUTS``: the slot names and order written
    out by hand from the references (exl2-format.md sections 1 and 3, gptq-gguf-formats.md A1), and the checked-in
    spec/layout.json (a change to the table must regenerate the spec in the same commit)."""
    doc = layout_document()
    text = json.dumps(doc)
    assert json.loads(text) == doc
    assert [b["bits"] for b in doc["bit_widths"]] == [2, 3, 4, 5, 6, 8]
    assert {k: [s["name"] for s in v] for k, v in doc["layouts"].items()} == {
        "exl2": ["q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm", "bias", "q_group_map"],
        "gptq": ["qweight", "qzeros", "scales", "g_idx", "bias"],
        "dense": ["weight", "bias"],
        "exl3": ["trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias", "scale"],   # spec/exl3.md 1
    }
    assert json.loads((REPO / "spec" / "layout.json").read_text()) == doc
    assert set(doc["recognised_only"]) == {"awq"}  # keyed by the plain format strings


# ---------------------------------------------------------------------------------------------------
# The accounting property: bpw(layout) * numel == bits of the arrays the writer produces
# ---------------------------------------------------------------------------------------------------

_BITS = {np.dtype(np.int32): 32, np.dtype(np.int16): 16, np.dtype(np.float16): 16}
_ST = {np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.float16): "F16"}


@hyp_settings(40)
@given(bits_rows(max_K=2048, max_group_rows=512), n_pads(512), st.booleans(), seeds())
def test_written_bits_equal_bpw_accounting(br, n_pad, with_bias, seed):
    rng = np.random.default_rng(seed)
    K, G = sum(r for _, r in br), len(br)
    codes = random_codes(rng, br, n_pad)
    sc = rng.integers(0, 16, (G, n_pad)).astype(np.uint8)
    bias = random_f16(rng, n_pad - rng.integers(0, 32)) if with_bias else None
    t = exl2_tensors(codes, sc, random_f16(rng, G), br, rng.permutation(K), bias=bias)
    written = sum(a.size * _BITS[a.dtype] for a in t.values())
    numel = K * n_pad + (n_pad if with_bias else 0)
    geom = Exl2Geometry(K=K, N_pad=n_pad, G=G, Q=sum(r * b for b, r in br) // 32)
    present = {name: _ST[a.dtype] for name, a in t.items()}
    assert stored_bits(Format.EXL2, geom, present) == written
    assert bpw(Format.EXL2, geom, present) == written / numel
    layer = layer_from_tensors("L", t)
    assert layer.validate() == []
    assert layer.bpw() == written / numel
    assert layer.stored_bytes() * 8 == written
    # every array has exactly the layout table's shape and write dtype
    for s in LAYOUTS[Format.EXL2]:
        if s.name in t:
            assert t[s.name].shape == s.shape(geom)
            assert present[s.name] == s.write_dtype


def test_exl3_layout():
    """EXL3 (spec/exl3.md section 1): padded dims, trellis last dim 16 * rate (24 / 40 / 56 at the half rates),
    the marker values (the uint32 multipliers viewed as int32)."""
    from exl2fmt.layout import (EXL3_HALF_RATES, EXL3_MARKER_VALUES, EXL3_RATE_OF_LAST_DIM, EXL3_RATES,
                                Exl3Geometry, pad128)

    assert sorted(EXL3_RATE_OF_LAST_DIM) == [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert {d: r for d, r in EXL3_RATE_OF_LAST_DIM.items() if r in EXL3_HALF_RATES} == {24: 1.5, 40: 2.5, 56: 3.5}
    assert len(EXL3_RATES) == 11
    assert EXL3_MARKER_VALUES == {"mcg": -877912083, "mul1": -2082680531}
    assert [pad128(n) for n in (1, 128, 129, 4096, 11008)] == [128, 128, 256, 4096, 11008]
    g = Exl3Geometry(K=300, N=1000, K_p=384, N_p=1024, bits=2.5)
    assert {s.name: s.shape(g) for s in LAYOUTS[Format.EXL3]} == {
        "trellis": (24, 64, 40), "suh": (384,), "svh": (1024,), "su": (24,), "sv": (64,), "mcg": (), "mul1": (),
        "bias": (1024,), "scale": ()}
    # bpw: every stored bit over the true K x N (padding, suh / svh and the marker count as overhead)
    present = {"trellis": "I16", "suh": "F16", "svh": "F16", "mul1": "I32"}
    want = (24 * 64 * 40 * 16 + 384 * 16 + 1024 * 16 + 32) / (300 * 1000)
    assert bpw(Format.EXL3, g, present) == want
