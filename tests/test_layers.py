"""Layer objects (exl2fmt.formats): validation codes for every single corruption, dequantize() against the
NumPy twins, plan() and bpw() against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from conftest import bits_rows, f16_bits, hyp_settings, n_pads, random_codes, random_f16, seeds
from exl2fmt.codec import gptq as Q
from exl2fmt.codec import oracle as O
from exl2fmt.errors import ErrorCode, Exl2Error, Severity
from exl2fmt.formats import DenseLinear, Exl2Linear, GptqLinear, layer_from_tensors
from exl2fmt.layout import Format, Tier, pad32
from exl2fmt.formats.exl2 import exl2_tensors, quantize_rtn

# ---------------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------------

BR = [(8, 32), (4, 64), (3, 96)]           # K = 192, Q = 8 + 8 + 9 = 25, G = 3
K0, N0 = 192, 40                           # N_pad = 64


def exl2_layer_tensors(seed=0, br=BR, N=N0, bias=True, q_perm=False):
    """Writer output for a layer with true width N (padding columns hold z_b with scale code 0)."""
    rng = np.random.default_rng(seed)
    K, n_pad, G = sum(r for _, r in br), pad32(N), len(br)
    codes = random_codes(rng, br, n_pad)
    sc = rng.integers(0, 16, (G, n_pad)).astype(np.uint8)
    for g, (b, r) in enumerate(br):
        start = sum(rr for _, rr in br[:g])
        codes[start:start + r, N:] = 1 << (b - 1)
    sc[:, N:] = 0
    perm = rng.permutation(K)
    t = exl2_tensors(codes, sc, random_f16(rng, G, 0x1000, 0x5000), br, np.argsort(perm),
                     bias=random_f16(rng, N, 0x0001, 0x5000, negative=True) if bias else None)
    if q_perm:
        t["q_perm"] = perm.astype(np.int32)
    return t


def gptq_layer_tensors(seed=0, bits=4, K=128, N=64, gs=32, act_order=True, v2=False, bias=True):
    rng = np.random.default_rng(seed)
    G = -(-K // gs)
    codes = random_codes(rng, [(bits, K)], N)
    zeros = rng.integers(0 if v2 else 1, 1 << bits, size=(G, N))  # v1 fields z - 1 < 2^b - 1: no ambiguity
    t = {"qweight": Q.pack_qweight(codes, bits), "qzeros": Q.pack_qzeros(Q.fields_from_zeros(zeros, bits, v2), bits),
         "scales": random_f16(rng, G * N, 0x1000, 0x3000).reshape(G, N)}
    if act_order:
        t["g_idx"] = (np.argsort(rng.permutation(K)) // gs).astype(np.int32)
    else:
        t["g_idx"] = (np.arange(K) // gs).astype(np.int32)
    if bias:
        t["bias"] = random_f16(rng, N, negative=True)
    return t


def codes_of(issues):
    return sorted({i.code for i in issues}, key=lambda c: c.value)


# ---------------------------------------------------------------------------------------------------
# EXL2: valid layers
# ---------------------------------------------------------------------------------------------------


def test_exl2_writer_output_is_valid():
    t = exl2_layer_tensors(q_perm=True)
    layer = layer_from_tensors("model.layers.0.mlp.down_proj", t, out_features=N0)
    assert isinstance(layer, Exl2Linear) and layer.format is Format.EXL2
    assert layer.validate() == [] and layer.validate(deep=True) == []
    assert layer.in_features == K0 and layer.out_features == N0 and layer.n_pad == 64
    assert layer.groups.bits_rows() == BR and layer.has_bias
    assert layer.plan() == "0.167:8b_32g/0.333:4b_64g/0.5:3b_96g"  # 32, 64, 96 of 192 rows
    # q_invperm stored as I16 is allowed too (exl2-format.md 1)
    t16 = dict(t, q_invperm=t["q_invperm"].astype(np.int16))
    assert layer_from_tensors("L", t16).validate(deep=True) == []


def test_exl2_dequantize_equals_oracle_and_drops_padding():
    t = exl2_layer_tensors(seed=3)
    ref = O.dequantize(t["q_weight"], t["q_scale"], t["q_scale_max"], BR, t["q_invperm"])      # [N_pad, K]
    full = layer_from_tensors("L", t).dequantize()                                               # no hint
    assert full.shape == (64, K0) and np.array_equal(f16_bits(full), f16_bits(ref))
    assert not f16_bits(full[N0:]).any()  # padded rows: q = z -> +0
    cut = layer_from_tensors("L", t, out_features=N0).dequantize()
    assert cut.shape == (N0, K0) and np.array_equal(f16_bits(cut), f16_bits(ref[:N0]))
    # a hint that does not pad to N_pad is ignored (N_pad stays)
    assert layer_from_tensors("L", t, out_features=10).dequantize().shape == (64, K0)
    b = layer_from_tensors("L", t, out_features=N0).bias()
    assert b.shape == (N0,) and np.array_equal(f16_bits(b), f16_bits(t["bias"][:N0]))
    codes = layer_from_tensors("L", t).codes()
    assert np.array_equal(codes, O.unpack_q_weight(t["q_weight"], BR))
    assert np.array_equal(layer_from_tensors("L", t).scale_codes(), O.unpack_q_scale(t["q_scale"]))


@hyp_settings(25)
@given(bits_rows(max_K=768, max_group_rows=256), n_pads(128), seeds())
def test_exl2_random_layers_valid_and_exact(br, n_pad, seed):
    rng = np.random.default_rng(seed)
    K, G = sum(r for _, r in br), len(br)
    codes = random_codes(rng, br, n_pad)
    sc = rng.integers(0, 16, (G, n_pad)).astype(np.uint8)
    t = exl2_tensors(codes, sc, random_f16(rng, G), br, rng.permutation(K))
    layer = layer_from_tensors("L", t)
    assert layer.validate(deep=True) == []
    with np.errstate(over="ignore"):
        ref = O.dequantize(t["q_weight"], t["q_scale"], t["q_scale_max"], br, t["q_invperm"])
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(ref))


@pytest.mark.parametrize("K,tiers,desc", [
    (640, [(0.05, 8, 32), (0.95, 4, 128)], "0.05:8b_32g/0.95:4b_128g"),      # 32 + 608 rows (last group 96)
    (1024, [(0.05, 8, 32), (0.95, 4, 128)], "0.062:8b_32g/0.938:4b_128g"),   # 64 + 960 rows
    (256, [(1.0, 4, 32)], "1:4b_32g"),
])
def test_exl2_plan_string(K, tiers, desc):
    w = np.random.default_rng(K).standard_normal((32, K)).astype(np.float32)
    t = quantize_rtn(w, [Tier(*x) for x in tiers])
    layer = layer_from_tensors("L", t)
    assert layer.validate(deep=True) == []
    assert layer.plan() == desc


def test_exl2_bpw_by_hand():
    layer = layer_from_tensors("L", exl2_layer_tensors())
    # q_weight 25*64*32 + q_scale 3*8*32 + q_scale_max 3*16 + q_groups 6*16 + q_invperm 192*32 + bias 64*16
    bits = 51200 + 768 + 48 + 96 + 6144 + 1024
    assert layer.bpw() == bits / (192 * 64 + 64)


# ---------------------------------------------------------------------------------------------------
# EXL2: one corruption at a time
# ---------------------------------------------------------------------------------------------------


def _set(name, value):
    def f(t):
        t[name] = value(t[name]) if callable(value) else value
    return f


def _qg(index, value):
    def f(t):
        qg = t["q_groups"].copy()
        qg[index] = value
        t["q_groups"] = qg
    return f


def _drop(name):
    def f(t):
        del t[name]
    return f


E = ErrorCode
EXL2_SHALLOW = {
    # missing slots
    "missing q_weight": (_drop("q_weight"), [E.SLOT_MISSING]),
    "missing q_scale": (_drop("q_scale"), [E.SLOT_MISSING]),
    "missing q_scale_max": (_drop("q_scale_max"), [E.SLOT_MISSING]),
    "missing q_groups": (_drop("q_groups"), [E.SLOT_MISSING]),
    "missing q_invperm": (_drop("q_invperm"), [E.SLOT_MISSING]),
    # dtypes
    "q_weight I64": (_set("q_weight", lambda a: a.astype(np.int64)), [E.SLOT_DTYPE]),
    "q_scale U32": (_set("q_scale", lambda a: a.view(np.uint32)), [E.SLOT_DTYPE]),
    "q_scale_max F32": (_set("q_scale_max", lambda a: a.astype(np.float32)), [E.SLOT_DTYPE]),
    "q_groups I32": (_set("q_groups", lambda a: a.astype(np.int32)), [E.SLOT_DTYPE]),
    "q_invperm I64": (_set("q_invperm", lambda a: a.astype(np.int64)), [E.SLOT_DTYPE]),
    "bias F32": (_set("bias", lambda a: a.astype(np.float32)), [E.SLOT_DTYPE]),
    # shapes
    "q_weight 3-D": (_set("q_weight", lambda a: a[None]), [E.SLOT_SHAPE]),
    "q_groups 2-D": (_set("q_groups", lambda a: a[None]), [E.SLOT_SHAPE]),
    "q_groups odd": (_set("q_groups", lambda a: a[:-1]), [E.SLOT_SHAPE]),
    "q_scale one group more": (_set("q_scale", lambda a: np.concatenate([a, a[:1]])), [E.SLOT_SHAPE]),
    "q_scale one word more": (_set("q_scale", lambda a: np.concatenate([a, a[:, :1]], 1)), [E.SLOT_SHAPE]),
    "q_scale_max one short": (_set("q_scale_max", lambda a: a[:-1]), [E.SLOT_SHAPE]),
    "bias unpadded": (_set("bias", lambda a: a[:N0]), [E.SLOT_SHAPE]),
    "q_perm one short": (lambda t: t.update(q_perm=np.argsort(t["q_invperm"])[:-1].astype(np.int32)),
                         [E.SLOT_SHAPE]),
    "q_weight one row more": (_set("q_weight", lambda a: np.concatenate([a, a[:1]])), [E.GROUPS_ROWS]),
    "q_weight one 3-bit unit more": (_set("q_weight", lambda a: np.concatenate([a, a[:3]])), [E.K_MISMATCH]),
    # q_groups rules
    "bits 7": (_qg(2, 7), [E.GROUPS_BITS]),
    "bits 0": (_qg(4, 0), [E.GROUPS_BITS]),
    "ascending tiers": (_qg(0, 2), [E.GROUPS_ORDER]),
    "qrow_0 != 0": (_qg(1, 1), [E.GROUPS_QROW]),
    "qrow not monotone": (_qg(3, 20), [E.GROUPS_QROW]),  # [8,0, 4,20, 3,16]
    "rows not multiple of 32": (_qg(3, 10), [E.GROUPS_ROWS]),  # 10 words at 8 bits = 40 rows
    # K, N_pad
    "q_invperm longer than K": (_set("q_invperm", lambda a: np.arange(K0 + 32, dtype=np.int32)), [E.K_MISMATCH]),
    "N_pad 40": (_set("q_weight", lambda a: a[:, :40].copy()), [E.N_PADDING]),
}


@pytest.mark.parametrize("name", list(EXL2_SHALLOW))
def test_exl2_single_corruption(name):
    mutate, expect = EXL2_SHALLOW[name]
    t = exl2_layer_tensors()
    mutate(t)
    layer = layer_from_tensors("model.layers.0.mlp.down_proj", t, fmt=Format.EXL2, file="m.safetensors")
    issues = layer.validate()
    assert codes_of(issues) == expect, [(i.code.value, i.message) for i in issues]
    assert all(i.severity is Severity.ERROR for i in issues)
    assert all(i.file == "m.safetensors" and i.tensor.startswith("model.layers.0.mlp.down_proj") for i in issues)
    assert codes_of(layer.validate(deep=True)) == expect  # deep adds nothing when shallow already fails
    with pytest.raises(Exl2Error) as e:
        layer.dequantize()
    assert e.value.code in expect


def _dup_invperm(t):
    inv = t["q_invperm"].copy()
    inv[5] = inv[6]
    t["q_invperm"] = inv


def _swap_q_perm(t):
    p = t["q_perm"].copy()
    p[[0, 1]] = p[[1, 0]]
    t["q_perm"] = p


def _qsm(value):
    def f(t):
        q = t["q_scale_max"].copy()
        q[1] = value
        t["q_scale_max"] = q
    return f


def _bias_inf(t):
    b = t["bias"].copy()
    b[3] = np.inf
    t["bias"] = b


W_ = Severity.WARNING
EXL2_DEEP = {  # name: (mutation, expected codes, severity)
    "q_invperm duplicate": (_dup_invperm, [E.PERM_INVALID], Severity.ERROR),
    "q_invperm out of range": (_set("q_invperm", lambda a: np.where(a == 0, K0, a).astype(np.int32)),
                               [E.PERM_INVALID], Severity.ERROR),
    "q_perm not argsort(q_invperm)": (_swap_q_perm, [E.PERM_MISMATCH], Severity.ERROR),
    "q_scale_max NaN": (_qsm(np.nan), [E.SCALE_MAX_INVALID], Severity.ERROR),
    "q_scale_max inf": (_qsm(np.inf), [E.SCALE_MAX_INVALID], Severity.ERROR),
    "q_scale_max negative": (_qsm(-1.5), [E.SCALE_MAX_INVALID], Severity.ERROR),
    # ExLlamaV2 writes 0 for an all-zero group: a warning, the group decodes to zeros
    "q_scale_max 0": (_qsm(0.0), [E.SCALE_MAX_INVALID], W_),
    "q_scale_max -0": (_qsm(-0.0), [E.SCALE_MAX_INVALID], W_),
    "bias inf": (_bias_inf, [E.NONFINITE_VALUES], Severity.ERROR),
}


@pytest.mark.parametrize("name", list(EXL2_DEEP))
def test_exl2_single_corruption_deep(name):
    mutate, expect, severity = EXL2_DEEP[name]
    t = exl2_layer_tensors(q_perm=True)
    mutate(t)
    layer = layer_from_tensors("L", t)
    assert layer.validate() == []  # data problems: only the deep pass reads the data
    issues = layer.validate(deep=True)
    assert codes_of(issues) == expect, [(i.code.value, i.message) for i in issues]
    assert all(i.severity is severity for i in issues)
    if expect == [E.PERM_INVALID]:
        with pytest.raises(Exl2Error) as e:
            layer.dequantize()
        assert e.value.code is E.PERM_INVALID


def test_exl2_zero_scale_max_group_decodes_to_zeros():
    t = exl2_layer_tensors()
    _qsm(0.0)(t)
    W = layer_from_tensors("L", t, out_features=N0).dequantize()
    rows = np.argsort(t["q_invperm"])[32:96]  # q_perm of group 1 (stored rows 32..95): their input features
    assert not (f16_bits(W[:, rows]) & 0x7FFF).any()  # +0 or -0
    assert (f16_bits(W[:, np.argsort(t["q_invperm"])[:32]]) & 0x7FFF).any()


def test_exl2_int16_permutation_read_as_uint16():
    """q_invperm stored as I16 is reinterpreted as uint16 (ExLlamaV2), so K up to 65536 works: K = 33024."""
    br = [(2, 16512), (2, 16512)]
    rng = np.random.default_rng(5)
    K = 33024
    t = exl2_tensors(random_codes(rng, br, 32), rng.integers(0, 16, (2, 32)).astype(np.uint8),
                     np.array([0.5, 2.0], np.float16), br, rng.permutation(K))
    t16 = dict(t, q_invperm=t["q_invperm"].astype(np.int16))  # values >= 32768 wrap negative as int16
    assert (t16["q_invperm"] < 0).any()
    l32, l16 = layer_from_tensors("L", t), layer_from_tensors("L", t16)
    assert l16.dtypes["q_invperm"] == "I16"
    assert l16.validate(deep=True) == [] and l32.validate(deep=True) == []
    assert np.array_equal(f16_bits(l16.dequantize()), f16_bits(l32.dequantize()))


# ---------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layer_valid_and_exact(bits, v2, act_order):
    t = gptq_layer_tensors(seed=bits, bits=bits, act_order=act_order, v2=v2)
    layer = layer_from_tensors("L", t, bits=bits, v2=v2, group_size=32)
    assert isinstance(layer, GptqLinear)
    assert layer.validate(deep=True) == []
    assert layer.K == 128 and layer.N == 64 and layer.G == 4 and layer.bits == bits
    assert layer.plan() == "1:%db_32g%s" % (bits, " act-order" if act_order else "")
    assert layer.act_order() is act_order
    ref = O.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, v2=v2)
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(ref))
    # bits inferred from shapes when the config does not say
    assert layer_from_tensors("L", t, v2=v2).bits == bits


def test_gptq_without_g_idx_and_single_group():
    t = gptq_layer_tensors(seed=7, bits=4, K=96, N=32, gs=96, act_order=False)
    del t["g_idx"]
    layer = layer_from_tensors("L", t, group_size=-1)
    assert layer.validate(deep=True) == [] and layer.G == 1 and layer.group_size == 96
    ref = O.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], np.zeros(96, np.int64), 4)
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(ref))
    assert layer.plan() == "1:4b_96g"


def test_gptq_bf16_and_f32_scales():
    t = gptq_layer_tensors(seed=1)
    ref = layer_from_tensors("L", t).dequantize()
    # bf16 scales exactly representable in fp16 (bf16 = top half of the f32 pattern)
    s32 = t["scales"].astype(np.float32)
    bf = (s32.view(np.uint32) >> 16).astype(np.uint16)
    exact = (bf.astype(np.uint32) << 16).view(np.float32)
    t_bf = dict(t, scales=bf)
    dtypes = {"qweight": "I32", "qzeros": "I32", "scales": "BF16", "g_idx": "I32", "bias": "F16"}
    layer = layer_from_tensors("L", t_bf, dtypes)
    assert layer.validate(deep=True) == []
    ref_bf = O.gptq_dequantize(t["qweight"], t["qzeros"], exact.astype(np.float16), t["g_idx"], 4)
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(ref_bf))
    t32 = dict(t, scales=s32)
    assert np.array_equal(f16_bits(layer_from_tensors("L", t32).dequantize()), f16_bits(ref))


def test_gptq_bpw_by_hand():
    layer = layer_from_tensors("L", gptq_layer_tensors(), bits=4)
    # qweight 16*64*32 + qzeros 4*8*32 + scales 4*64*16 + g_idx 128*32 + bias 64*16 = 43008 bits
    assert layer.bpw() == 43008 / (128 * 64 + 64)


def _gidx(value):
    def f(t):
        g = t["g_idx"].copy()
        g[7] = value
        t["g_idx"] = g
    return f


def _scale_nan(t):
    s = t["scales"].copy()
    s[0, 0] = np.nan
    t["scales"] = s


GPTQ_CASES = {
    "missing qweight": (_drop("qweight"), {}, [E.SLOT_MISSING]),
    "missing qzeros": (_drop("qzeros"), {}, [E.SLOT_MISSING]),
    "missing scales": (_drop("scales"), {}, [E.SLOT_MISSING]),
    "scales I32": (_set("scales", lambda a: a.view(np.int16).astype(np.int32)), {}, [E.SLOT_DTYPE]),
    "g_idx I64": (_set("g_idx", lambda a: a.astype(np.int64)), {}, [E.SLOT_DTYPE]),
    "scales one group more": (_set("scales", lambda a: np.concatenate([a, a[:1]])), {}, [E.SLOT_SHAPE]),
    "g_idx one short": (_set("g_idx", lambda a: a[:-1]), {}, [E.SLOT_SHAPE]),
    "bias one more": (_set("bias", lambda a: np.concatenate([a, a[:1]])), {}, [E.SLOT_SHAPE]),
    "qzeros 5-bit shaped": (_set("qzeros", lambda a: np.zeros((4, 10), np.int32)), {}, [E.GPTQ_BITS]),
    "qzeros columns not a ratio": (_set("qzeros", lambda a: np.zeros((4, 7), np.int32)), {}, [E.GPTQ_BITS]),
    "config bits 5": (lambda t: None, {"bits": 5}, [E.GPTQ_BITS]),
    "config bits 3, qweight rows": (lambda t: None, {"bits": 3}, [E.GPTQ_BITS]),
    "g_idx = G": (_gidx(4), {}, [E.GPTQ_G_IDX]),
    "g_idx negative": (_gidx(-1), {}, [E.GPTQ_G_IDX]),
    "scales NaN": (_scale_nan, {}, [E.NONFINITE_VALUES]),
}


@pytest.mark.parametrize("name", list(GPTQ_CASES))
def test_gptq_single_corruption(name):
    mutate, hints, expect = GPTQ_CASES[name]
    t = gptq_layer_tensors()
    mutate(t)
    layer = layer_from_tensors("L", t, fmt=Format.GPTQ, **hints)
    issues = layer.validate(deep=True)
    assert codes_of(issues) == expect, [(i.code.value, i.message) for i in issues]
    if layer.validate() != [] or expect == [E.GPTQ_G_IDX]:
        with pytest.raises(Exl2Error) as e:
            layer.dequantize()
        assert e.value.code in expect


def test_gptq_config_bits_disagree_with_shapes():
    layer = layer_from_tensors("L", gptq_layer_tensors(), bits=8)
    assert codes_of(layer.validate()) == [E.GPTQ_BITS]


def test_gptq_v1_ambiguous_zero_is_a_warning():
    t = gptq_layer_tensors(v2=False)
    f = Q.unpack_qzeros(t["qzeros"], 4)
    f[2, 5] = 15  # v1 field 2^b - 1: tools disagree (z = 16 or 0)
    t["qzeros"] = Q.pack_qzeros(f, 4)
    issues = layer_from_tensors("L", t, v2=False).validate(deep=True)
    assert codes_of(issues) == [E.GPTQ_ZEROS_AMBIGUOUS]
    assert issues[0].severity is Severity.WARNING and "1 v1 zero field" in issues[0].message
    assert layer_from_tensors("L", t, v2=False).validate() == []  # data check: deep only
    assert layer_from_tensors("L", t, v2=True).validate(deep=True) == []  # a v2 field 15 is just z = 15
    # a warning does not block dequantization; the field reads as z = 16
    layer = layer_from_tensors("L", t, v2=False)
    ref = O.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, v2=False)
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(ref))


def test_gptq_group_size_hint_disagreeing_with_G_is_reported():
    t = gptq_layer_tensors(K=128, gs=64, act_order=False)
    del t["g_idx"]
    assert t["qzeros"].shape[0] == 2
    layer = layer_from_tensors("L", t, group_size=32)
    assert any(i.severity is Severity.ERROR for i in layer.validate(deep=True))


def test_gptq_narrow_layer_never_raises_from_validate():
    """gptq-gguf-formats.md A3 uses K=32, N=8, qzeros [[0x77777777]]."""
    qw = np.tile(np.array([[0x76543210], [0xFEDCBA98], [0x76543210], [0xFEDCBA98]], np.uint64), (1, 8))
    t = {"qweight": qw.astype(np.uint32).view(np.int32), "qzeros": np.array([[0x77777777]], np.int32),
         "scales": np.full((1, 8), 0.01, np.float16)}
    layer = layer_from_tensors("L", t)
    assert layer.validate(deep=True) == []  # 4-bit zeros need N to be a multiple of 8 only
    W = layer.dequantize()
    # 0.01 * (k mod 16 - 8) in fp16 for k = 0, 8, 15: -0.08, 0, 0.07
    assert f16_bits(W[0, [0, 8, 15]]).tolist() == [0xAD1F, 0x0000, 0x2C7B]


# ---------------------------------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------------------------------


def test_dense_layers():
    rng = np.random.default_rng(0)
    w = random_f16(rng, 24 * 40, 0x0001, 0x7BFF, negative=True).reshape(24, 40)
    layer = layer_from_tensors("L", {"weight": w, "bias": random_f16(rng, 24)})
    assert isinstance(layer, DenseLinear)
    assert layer.validate(deep=True) == [] and layer.plan() == "f16" and layer.bpw() == 16.0
    assert layer.in_features == 40 and layer.out_features == 24
    assert np.array_equal(f16_bits(layer.dequantize()), f16_bits(w))
    # bf16: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00 -> fp16 0x3C00, 0xC000, 0x3800
    bf = np.array([[0x3F80, 0xC000, 0x3F00]], np.uint16)
    lb = layer_from_tensors("L", {"weight": bf}, {"weight": "BF16"})
    assert lb.validate(deep=True) == [] and lb.plan() == "bf16"
    assert f16_bits(lb.dequantize()).tolist() == [[0x3C00, 0xC000, 0x3800]]
    lf = layer_from_tensors("L", {"weight": np.array([[1.0, 70000.0]], np.float32)})
    with np.errstate(over="ignore"):
        assert f16_bits(lf.dequantize()).tolist() == [[0x3C00, 0x7C00]]  # F32 rounds to fp16 (overflow -> inf)


@pytest.mark.parametrize("tensors,deep,expect", [
    ({"weight": np.zeros((4, 8), np.int32)}, False, [E.SLOT_DTYPE]),
    ({"weight": np.zeros(8, np.float16)}, False, [E.SLOT_SHAPE]),
    ({"weight": np.zeros((4, 8), np.float16), "bias": np.zeros(5, np.float16)}, False, [E.SLOT_SHAPE]),
    ({"weight": np.full((4, 8), np.nan, np.float16)}, True, [E.NONFINITE_VALUES]),
    ({"weight": np.zeros((4, 8), np.float16), "bias": np.array([0, 0, np.inf, 0], np.float16)}, True,
     [E.NONFINITE_VALUES]),
])
def test_dense_corruptions(tensors, deep, expect):
    assert codes_of(layer_from_tensors("L", tensors).validate(deep=deep)) == expect


def test_layer_from_tensors_detection_precedence():
    t = exl2_layer_tensors(bias=False)
    g = gptq_layer_tensors(bias=False)
    both = {**t, **g, "weight": np.zeros((64, K0), np.float16)}
    assert isinstance(layer_from_tensors("L", both), Exl2Linear)  # q_weight first (ExLlamaV2 load_weight)
    del both["q_weight"]
    assert isinstance(layer_from_tensors("L", both), GptqLinear)
    del both["qweight"]
    assert isinstance(layer_from_tensors("L", both), DenseLinear)
    with pytest.raises(Exl2Error) as e:
        layer_from_tensors("L", {"bias": np.zeros(4, np.float16)})
    assert e.value.code is E.LAYER_NOT_FOUND
