"""Codecs of exl2fmt.codec.exl2 / gptq against golden hex from the references and the NumPy twins.

Golden values come from the project's format references, exl2-format.md (section 2.2 worked examples, 3.1, 3.2)
and gptq-gguf-formats.md (A2, A3); they are literals here, never computed by the code under test.  The
property tests compare the Numba codecs with ``exl2fmt.codec.oracle`` bit for bit (fp16 via ``.view(uint16)``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import (EXL2_TIER_BITS, GPTQ_BITS, bits_rows, f16_bits, f16_positive, hyp_settings, n_pads,
                      random_codes, random_f16, seeds)
from exl2fmt.codec import exl2 as X
from exl2fmt.codec import gptq as Q
from exl2fmt.codec import oracle as O
from exl2fmt.groups import group_table_from_rows


def u32(words) -> np.ndarray:
    return np.asarray(words, dtype=np.uint64).astype(np.uint32)


def words_of(a: np.ndarray) -> list[int]:
    return [int(w) for w in np.asarray(a).view(np.uint32).ravel()]


# ---------------------------------------------------------------------------------------------------
# EXL2 q_weight: golden hex (exl2-format.md 2.2 "Worked examples")
# ---------------------------------------------------------------------------------------------------

EXL2_GOLDEN = [
    (2, [0, 1, 2, 3] * 4, [0xE4E4E4E4]),
    (3, [t % 8 for t in range(32)], [0x88FAC688, 0xC688FAC6, 0xFAC688FA]),
    (4, list(range(8)), [0x76543210]),
    (5, list(range(32)), [0x8A418820, 0xC5A92839, 0xCA307B9A, 0x38BDAB49, 0xFFBBCDEB]),
    (6, list(range(16)), [0x440C2040, 0xA2481C61, 0x3CE34C2C]),
    (8, [1, 2, 3, 4], [0x04030201]),
]


@pytest.mark.parametrize("bits,values,words", EXL2_GOLDEN, ids=[f"{b}bit" for b, _, _ in EXL2_GOLDEN])
def test_q_weight_golden(bits, values, words):
    U = len(values)
    # column 0: the worked example; column 1: all zero; column 2: all 2^b - 1 (every bit of the unit set)
    codes = np.stack([values, [0] * U, [(1 << bits) - 1] * U], axis=1).astype(np.uint8)
    gt = group_table_from_rows([(bits, U)])
    qw = X.pack_q_weight(codes, gt)
    assert qw.dtype == np.int32 and qw.shape == (len(words), 3)
    assert words_of(qw[:, 0]) == words
    assert words_of(qw[:, 1]) == [0] * len(words)
    assert words_of(qw[:, 2]) == [0xFFFFFFFF] * len(words)
    assert words_of(O.pack_q_weight(codes, [(bits, U)])) == words_of(qw)
    # two units in a row: the words repeat, unit after unit
    qw2 = X.pack_q_weight(np.concatenate([codes, codes]), group_table_from_rows([(bits, 2 * U)]))
    assert words_of(qw2[:, 0]) == words * 2
    # and back
    assert np.array_equal(X.unpack_q_weight(qw, gt), codes)
    assert np.array_equal(O.unpack_q_weight(qw, [(bits, U)]), codes)


# Values that straddle two words (exl2-format.md 2.2): a single 2^b - 1 at unit row t, all else zero.
STRADDLE = [
    (3, 10, [0xC0000000, 0x00000001, 0]),
    (3, 21, [0, 0x80000000, 0x00000003]),
    (5, 6, [0xC0000000, 0x00000007, 0, 0, 0]),
    (5, 12, [0, 0xF0000000, 0x00000001, 0, 0]),
    (5, 19, [0, 0, 0x80000000, 0x0000000F, 0]),
    (5, 25, [0, 0, 0, 0xE0000000, 0x00000003]),
    (6, 5, [0xC0000000, 0x0000000F, 0]),
    (6, 10, [0, 0xF0000000, 0x00000003]),
    # and some that do not straddle: 3-bit t=11 at shift 1 of word 1, 6-bit t=15 at shift 26 of word 2
    (3, 11, [0, 0x0000000E, 0]),
    (6, 15, [0, 0, 0xFC000000]),
]


@pytest.mark.parametrize("bits,t,words", STRADDLE)
def test_q_weight_straddling_values(bits, t, words):
    U = {3: 32, 5: 32, 6: 16}[bits]
    codes = np.zeros((U, 1), dtype=np.uint8)
    codes[t, 0] = (1 << bits) - 1
    gt = group_table_from_rows([(bits, U)])
    qw = X.pack_q_weight(codes, gt)
    assert words_of(qw) == words
    assert np.array_equal(X.unpack_q_weight(qw, gt), codes)


def test_q_weight_mixed_groups_layout():
    """Groups land one after another: (8b, 4 rows) then (4b, 8 rows) then (2b, 16 rows) -> words 0, 1, 2."""
    br = [(8, 4), (4, 8), (2, 16)]
    codes = np.array([1, 2, 3, 4] + list(range(8)) + [0, 1, 2, 3] * 4, dtype=np.uint8)[:, None]
    qw = X.pack_q_weight(codes, group_table_from_rows(br))
    assert words_of(qw) == [0x04030201, 0x76543210, 0xE4E4E4E4]


def test_pack_q_weight_rejects_bad_input():
    gt = group_table_from_rows([(4, 8)])
    with pytest.raises(ValueError):
        X.pack_q_weight(np.full((8, 1), 16, np.uint8), gt)  # code out of range for 4 bits
    with pytest.raises(ValueError):
        X.pack_q_weight(np.zeros((16, 1), np.uint8), gt)  # groups cover 8 rows, array has 16
    with pytest.raises(ValueError):
        X.pack_q_weight(np.zeros((4, 1), np.uint8), group_table_from_rows([(4, 4)]))  # not a whole unit
    with pytest.raises(ValueError):
        X.unpack_q_weight(np.zeros((2, 1), np.int32), gt)  # wrong number of packed rows


# ---------------------------------------------------------------------------------------------------
# q_scale (3.1)
# ---------------------------------------------------------------------------------------------------


def test_q_scale_golden():
    c = np.zeros((2, 16), dtype=np.uint8)
    c[0, :8] = range(8)                # row 0, word 0: codes 0..7 -> 0x76543210
    c[0, 8] = 15                       # row 0, word 1: column 8 = nibble 0 -> 0x0000000F
    c[1, 15] = 1                       # row 1, word 1: column 15 = nibble 7 -> 0x10000000
    c[1, :8] = 15                      # row 1, word 0: all 0xF (the padding quirk of 3.1) -> int32 -1
    qs = X.pack_q_scale(c)
    assert qs.dtype == np.int32 and qs.shape == (2, 2)
    assert words_of(qs) == [0x76543210, 0x0000000F, 0xFFFFFFFF, 0x10000000]
    assert int(qs[1, 0]) == -1
    assert np.array_equal(O.pack_q_scale(c), qs)
    assert np.array_equal(X.unpack_q_scale(qs), c)
    assert np.array_equal(O.unpack_q_scale(qs), c)


def test_pack_q_scale_rejects_bad_input():
    with pytest.raises(ValueError):
        X.pack_q_scale(np.full((1, 8), 16, np.uint8))
    with pytest.raises(ValueError):
        X.pack_q_scale(np.zeros((1, 12), np.uint8))


# ---------------------------------------------------------------------------------------------------
# dequantization, hand-computed (3.2, 3.3, 3.6)
# ---------------------------------------------------------------------------------------------------


def _one_group_layer(bits, col0, qsm_bits, c0, K=32):
    """K rows x 32 columns, one group; column 0 holds ``col0`` with scale code c0, other columns zero/code 0."""
    codes = np.full((K, 32), 1 << (bits - 1), dtype=np.uint8)
    codes[:, 0] = col0
    sc = np.zeros((1, 32), np.uint8)
    sc[0, 0] = c0
    gt = group_table_from_rows([(bits, K)])
    qsm = np.array([qsm_bits], np.uint16).view(np.float16)
    return X.pack_q_weight(codes, gt), X.pack_q_scale(sc), qsm, gt


def test_dequant_hand_values():
    # q_scale_max = 2.0, c = 3: s = (3+1)^2 * 2 / 256 = 0.125; 4-bit codes 12, 0, 15, 8 -> 0.5, -1.0, 0.875, 0
    col = np.array([12, 0, 15, 8] * 8)
    qw, qs, qsm, gt = _one_group_layer(4, col, 0x4000, 3)
    w = X.dequantize_stored(qw, qs, qsm, gt)
    assert w.dtype == np.float16 and w.shape == (32, 32)
    assert f16_bits(w[:4, 0]).tolist() == [0x3800, 0xBC00, 0x3B00, 0x0000]
    assert not f16_bits(w[:, 1:]).any()  # q = z everywhere else -> exactly +0


def test_dequant_rounds_scale_max_over_256_to_fp16_first():
    """q_scale_max = 0x1401 (2^-10 * (1 + 2^-10)): m = fp16(qsm / 256) is subnormal and rounds to 2^-18,
    s = 256 * m = 2^-10 exactly, and 8-bit code 255 gives 127 * 2^-10 = 0x2FF0.  Multiplying without the
    intermediate rounding would give 0x2FF2."""
    col = np.array([255, 0, 128, 129] * 8)
    qw, qs, qsm, gt = _one_group_layer(8, col, 0x1401, 15)
    w = X.dequantize_stored(qw, qs, qsm, gt)
    # 255 -> 127 * 2^-10; 0 -> -128 * 2^-10 = -0.125; 128 -> 0; 129 -> 2^-10
    assert f16_bits(w[:4, 0]).tolist() == [0x2FF0, 0xB000, 0x0000, 0x1400]
    assert np.array_equal(f16_bits(O.dequantize_stored(qw, qs, qsm, [(8, 32)])), f16_bits(w))


def test_dequant_permutation_direction():
    """W[q_perm[k]] = stored[k], i.e. W[j] = stored[q_invperm[j]] (3.3)."""
    K = 32
    col = np.arange(K) % 16  # stored row k holds code k mod 16
    qw, qs, qsm, gt = _one_group_layer(4, col, 0x5C00, 15)  # q_scale_max 256 -> s = 256: w = (q - 8) * 256
    inv = np.roll(np.arange(K), 3).astype(np.int32)  # q_invperm[j] = (j - 3) mod K
    W = X.dequantize(qw, qs, qsm, gt, inv)
    assert W.shape == (32, K)
    # input feature j comes from stored row (j - 3) mod 32 -> code ((j - 3) mod 32) mod 16
    expect = np.array([(((j - 3) % 32) % 16 - 8) * 256.0 for j in range(K)], dtype=np.float16)
    assert np.array_equal(f16_bits(W[0]), f16_bits(expect))
    assert float(W[0, 3]) == -2048.0 and float(W[0, 2]) == 7 * 256.0
    # out_features drops padding columns (rows of the nn.Linear weight)
    W5 = X.dequantize(qw, qs, qsm, gt, inv, out_features=5)
    assert W5.shape == (5, K) and np.array_equal(f16_bits(W5), f16_bits(W[:5]))
    assert X.dequantize(qw, qs, qsm, gt, inv, out_features=0).shape == (0, K)


def test_dequantize_rejects_bad_input():
    qw, qs, qsm, gt = _one_group_layer(4, np.zeros(32), 0x3C00, 0)
    ok = np.arange(32, dtype=np.int32)
    for out in (np.empty((32, 32), np.float32), np.empty((31, 32), np.float16), np.empty((32, 64), np.float16)[:, ::2],
                np.zeros((32, 32), np.float16).copy().view(np.float16)[::-1]):
        with pytest.raises(ValueError, match="out must be"):
            X.dequantize(qw, qs, qsm, gt, ok, out=out)
    ro = np.empty((32, 32), np.float16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be"):
        X.dequantize(qw, qs, qsm, gt, ok, out=ro)
    bad = ok.copy()
    bad[1] = 0
    with pytest.raises(ValueError, match="permutation"):
        X.dequantize(qw, qs, qsm, gt, bad)
    with pytest.raises(ValueError):
        X.dequantize(qw, qs, qsm, gt, ok, out_features=33)
    with pytest.raises(ValueError):
        X.dequantize(qw, qs, qsm.astype(np.float32), gt, ok)
    with pytest.raises(ValueError):
        X.dequantize(qw[:, :16], qs[:, :2], qsm, gt, ok)  # N_pad 16 is not a multiple of 32
    with pytest.raises(ValueError):
        X.dequantize_stored(qw, qs[:, :3], qsm, gt)


def test_invert_permutation_and_is_permutation():
    p = np.array([2, 0, 3, 1])
    assert X.invert_permutation(p).tolist() == [1, 3, 0, 2]
    assert X.invert_permutation(p).dtype == np.int32
    assert X.is_permutation(p)
    assert X.is_permutation(np.zeros(0, np.int32))
    for bad in ([0, 0, 1, 2], [0, 1, 2, 4], [-1, 0, 1, 2]):
        assert not X.is_permutation(np.array(bad))
        with pytest.raises(ValueError):
            X.invert_permutation(np.array(bad))


# ---------------------------------------------------------------------------------------------------
# EXL2 properties: Numba == NumPy twin
# ---------------------------------------------------------------------------------------------------


@st.composite
def exl2_layers(draw, max_K=2560, max_cells=81_920):
    """(bits_rows, N_pad, seed) with K * N_pad <= max_cells (the twins loop in Python)."""
    n_pad = draw(n_pads(256))
    br = draw(bits_rows(max_K=max(32, min(max_K, max_cells // n_pad // 32 * 32)), max_group_rows=512))
    return br, n_pad, draw(seeds())


def _layer_arrays(br, n_pad, seed):
    rng = np.random.default_rng(seed)
    K = sum(r for _, r in br)
    G = len(br)
    codes = random_codes(rng, br, n_pad)
    sc = rng.integers(0, 16, size=(G, n_pad)).astype(np.uint8)
    sc[rng.random((G, n_pad)) < 0.1] = 15
    qsm = random_f16(rng, G)
    # mix in the extremes: subnormal / tiny / largest finite scale maxima
    pick = rng.random(G) < 0.3
    qsm[pick] = np.array([0x0001, 0x03FF, 0x0400, 0x1401, 0x7BFF], np.uint16).view(np.float16)[
        rng.integers(0, 5, size=int(pick.sum()))]
    perm = rng.permutation(K).astype(np.int32)
    return codes, sc, qsm, perm


@hyp_settings(50)
@given(exl2_layers())
def test_exl2_pack_unpack_equal_twins(layer):
    br, n_pad, seed = layer
    codes, sc, _, _ = _layer_arrays(br, n_pad, seed)
    gt = group_table_from_rows(br)
    qw = X.pack_q_weight(codes, gt)
    assert qw.dtype == np.int32 and qw.shape == (sum(r * b // 32 for b, r in br), n_pad)
    assert np.array_equal(qw, O.pack_q_weight(codes, br))
    assert np.array_equal(X.unpack_q_weight(qw, gt), codes)
    assert np.array_equal(O.unpack_q_weight(qw, br), codes)
    qs = X.pack_q_scale(sc)
    assert np.array_equal(qs, O.pack_q_scale(sc))
    assert np.array_equal(X.unpack_q_scale(qs), sc)


@hyp_settings(50)
@given(exl2_layers(), st.data())
def test_exl2_dequantize_equals_twin(layer, data):
    br, n_pad, seed = layer
    codes, sc, qsm, inv = _layer_arrays(br, n_pad, seed)
    gt = group_table_from_rows(br)
    qw = X.pack_q_weight(codes, gt)
    qs = X.pack_q_scale(sc)
    with np.errstate(over="ignore", invalid="ignore"):
        ref_stored = O.dequantize_stored(qw, qs, qsm, br)
        n_out = data.draw(st.one_of(st.none(), st.integers(max(0, n_pad - 40), n_pad)), label="out_features")
        ref = O.dequantize(qw, qs, qsm, br, inv, out_features=n_out)
    got_stored = X.dequantize_stored(qw, qs, qsm, gt)
    assert got_stored.dtype == np.float16 and got_stored.shape == ref_stored.shape
    assert np.array_equal(f16_bits(got_stored), f16_bits(ref_stored))
    got = X.dequantize(qw, qs, qsm, gt, inv, out_features=n_out)
    assert got.dtype == np.float16 and got.flags.c_contiguous
    assert got.shape == ((n_pad if n_out is None else n_out), gt.K)
    assert np.array_equal(f16_bits(got), f16_bits(ref))
    # and the permutation relation against the stored matrix directly: W[j] = stored[q_invperm[j]]
    assert np.array_equal(f16_bits(got), f16_bits(got_stored[inv][:, :got.shape[0]].T))
    # into a caller's buffer holding stale values: 32-byte aligned (non-temporal stores on x86) or 16 bytes off
    shift = data.draw(st.sampled_from([0, 8]), label="out offset in fp16 elements")
    raw = np.full(got.size + 64, 7.0, dtype=np.float16)
    start = (-raw.ctypes.data % 64) // 2 + shift
    o = raw[start:start + got.size].reshape(got.shape)
    assert X.dequantize(qw, qs, qsm, gt, inv, out_features=n_out, out=o) is o
    assert np.array_equal(f16_bits(o), f16_bits(ref))
    assert (raw[:start] == 7).all() and (raw[start + got.size:] == 7).all()  # nothing written outside out


@hyp_settings(60)
@given(f16_positive(), st.sampled_from(EXL2_TIER_BITS), seeds())
def test_exl2_every_scale_max_equals_twin(qsm, bits, seed):
    """One 32-row group, every scale code and the extreme codes, q_scale_max anywhere in the fp16 range."""
    rng = np.random.default_rng(seed)
    codes = random_codes(rng, [(bits, 32)], 32, extremes=0.4)
    sc = np.tile(np.arange(16, dtype=np.uint8), 2)[None]  # all 16 scale codes
    gt = group_table_from_rows([(bits, 32)])
    qw, qs, q = X.pack_q_weight(codes, gt), X.pack_q_scale(sc), np.array([qsm], np.float16)
    with np.errstate(over="ignore"):
        ref = O.dequantize_stored(qw, qs, q, [(bits, 32)])
    assert np.array_equal(f16_bits(X.dequantize_stored(qw, qs, q, gt)), f16_bits(ref))


@hyp_settings(40)
@given(st.integers(1, 3000), seeds())
def test_invert_permutation_is_argsort(K, seed):
    p = np.random.default_rng(seed).permutation(K)
    inv = X.invert_permutation(p)
    assert np.array_equal(inv, np.argsort(p))
    assert np.array_equal(X.invert_permutation(inv), p)
    assert X.is_permutation(p)
    if K > 1:
        q = p.copy()
        q[seed % K] = q[(seed + 1) % K]  # one duplicate
        assert not X.is_permutation(q)


# ---------------------------------------------------------------------------------------------------
# GPTQ: golden hex (gptq-gguf-formats.md A2, A3)
# ---------------------------------------------------------------------------------------------------


def test_gptq_qweight_golden():
    c4 = np.array(list(range(16)) * 2, np.uint8)[:, None]
    assert words_of(Q.pack_qweight(c4, 4)) == [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]
    c8 = np.array([1, 2, 3, 4] * 8, np.uint8)[:, None]
    assert words_of(Q.pack_qweight(c8, 8)) == [0x04030201] * 8
    c3 = np.array([k % 8 for k in range(32)], np.uint8)[:, None]
    assert words_of(Q.pack_qweight(c3, 3)) == [0x88FAC688, 0xC688FAC6, 0xFAC688FA]
    for c, b in ((c4, 4), (c8, 8), (c3, 3)):
        assert np.array_equal(Q.unpack_qweight(Q.pack_qweight(c, b), b), c)
        assert np.array_equal(O.gptq_pack_rows(c, b), Q.pack_qweight(c, b))


SYM_ZERO_WORDS = {  # bits: (v1 words, v1 as int32, v2 words), A2 table
    2: ([0x55555555], [1431655765], [0xAAAAAAAA]),
    3: ([0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D], [-613566757, -1227133514, 1840700269],
        [0x24924924, 0x49249249, 0x92492492]),
    4: ([0x77777777], [2004318071], [0x88888888]),
    8: ([0x7F7F7F7F], [2139062143], [0x80808080]),
}


@pytest.mark.parametrize("bits", sorted(SYM_ZERO_WORDS))
def test_gptq_sym_zero_words(bits):
    v1, v1_int, v2 = SYM_ZERO_WORDS[bits]
    N = 32
    z = np.full((2, N), 1 << (bits - 1))           # symmetric: z = 2^(b-1)
    reps = N * bits // 32 // len(v1)
    f1 = Q.fields_from_zeros(z, bits, v2=False)
    f2 = Q.fields_from_zeros(z, bits, v2=True)
    assert (f1 == (1 << (bits - 1)) - 1).all() and (f2 == 1 << (bits - 1)).all()
    qz1 = Q.pack_qzeros(f1, bits)
    qz2 = Q.pack_qzeros(f2, bits)
    assert qz1.dtype == np.int32 and qz1.shape == (2, N * bits // 32)
    assert words_of(qz1[0]) == v1 * reps and words_of(qz1[1]) == v1 * reps
    assert qz1[0].tolist() == v1_int * reps
    assert words_of(qz2[0]) == v2 * reps
    assert np.array_equal(O.gptq_pack_rows(f1.T, bits).T, qz1)
    assert np.array_equal(Q.zeros_from_fields(Q.unpack_qzeros(qz1, bits), v2=False), z)
    assert np.array_equal(Q.zeros_from_fields(Q.unpack_qzeros(qz2, bits), v2=True), z)


def test_gptq_v1_fields_read_per_field_without_mask():
    """A3 'checked example': GPTQModel's whole-word v1 word 0x77772E3F holds fields [F,3,E,2,7,7,7,7].
    exl2fmt reads v1 per field with +1 and no mask (like the exllama/vLLM kernels): z = [16,4,15,3,8,...]."""
    qz = u32([[0x77772E3F, 0x77777777, 0x77777777, 0x77777777]]).view(np.int32)
    f = Q.unpack_qzeros(qz, 4)
    assert f[0, :8].tolist() == [15, 3, 14, 2, 7, 7, 7, 7]
    assert Q.zeros_from_fields(f, v2=False)[0, :8].tolist() == [16, 4, 15, 3, 8, 8, 8, 8]
    assert Q.zeros_from_fields(f, v2=True)[0, :8].tolist() == [15, 3, 14, 2, 7, 7, 7, 7]
    with pytest.raises(ValueError):
        Q.fields_from_zeros(np.zeros((1, 32)), 4, v2=False)  # z = 0 has no v1 encoding
    with pytest.raises(ValueError):
        Q.fields_from_zeros(np.full((1, 32), 16), 4, v2=True)


def test_gptq_worked_dequant_example():
    """A3: 4-bit sym v1, one group, qzeros all 0x77777777 (z = 8), scales 0.01 (fp16 0x211F), column 0 of
    qweight 0x76543210, 0xFEDCBA98 twice so q[k] = k mod 16; W_hf[0, k] = fp16(0.01) * (k mod 16 - 8).
    (The reference uses N = 8; exl2fmt packs qzeros in blocks of 32 columns, so N = 32 here.)"""
    N = 32
    qw = u32(np.tile(np.array([[0x76543210], [0xFEDCBA98], [0x76543210], [0xFEDCBA98]]), (1, N))).view(np.int32)
    qz = u32(np.full((1, 4), 0x77777777)).view(np.int32)
    sc = np.full((1, N), 0.01, np.float16)
    assert int(sc.view(np.uint16)[0, 0]) == 0x211F
    W = Q.dequantize(qw, qz, sc, np.zeros(32, np.int32), 4, v2=False)
    assert W.shape == (N, 32) and W.dtype == np.float16
    # q = 0 -> -8 * 0.010002136 = -0.08001709 exact (0xAD1F); q = 8 -> 0; q = 15 -> 7 * 0.010002136 rounds
    # to 1147 * 2^-14 (0x2C7B)
    assert f16_bits(W[0, [0, 8, 15, 16, 31]]).tolist() == [0xAD1F, 0x0000, 0x2C7B, 0xAD1F, 0x2C7B]
    exact = 0.01 * (np.arange(32) % 16 - 8)
    assert np.abs(W[0].astype(np.float64) - exact).max() < 2e-4  # runs over -0.08 .. 0.07
    assert np.array_equal(f16_bits(W), f16_bits(O.gptq_dequantize(qw, qz, sc, np.zeros(32), 4)))
    # no g_idx and group_size -1 / None: one group
    assert np.array_equal(f16_bits(Q.dequantize(qw, qz, sc, None, 4, group_size=-1)), f16_bits(W))
    assert np.array_equal(f16_bits(Q.dequantize(qw, qz, sc, None, 4)), f16_bits(W))


def test_gptq_rejects_bad_input():
    with pytest.raises(ValueError):
        Q.pack_qweight(np.zeros((32, 1), np.uint8), 5)
    with pytest.raises(ValueError):
        Q.pack_qweight(np.zeros((16, 1), np.uint8), 4)
    with pytest.raises(ValueError):
        Q.pack_qzeros(np.zeros((1, 16), np.uint8), 4)
    qw = Q.pack_qweight(np.zeros((64, 32), np.uint8), 4)
    qz = Q.pack_qzeros(np.full((2, 32), 7), 4)
    sc = np.ones((2, 32), np.float16)
    with pytest.raises(ValueError, match="g_idx"):
        Q.dequantize(qw, qz, sc, np.full(64, 2), 4)
    with pytest.raises(ValueError, match="g_idx"):
        Q.dequantize(qw, qz, sc, np.zeros(63), 4)
    with pytest.raises(ValueError):
        Q.dequantize(qw, qz, sc[:1], None, 4)


# ---------------------------------------------------------------------------------------------------
# GPTQ properties: Numba == NumPy twin
# ---------------------------------------------------------------------------------------------------


@st.composite
def gptq_layers(draw):
    bits = draw(st.sampled_from(GPTQ_BITS))
    N = 32 * draw(st.integers(1, 4))
    gs = draw(st.sampled_from([32, 64, 128, -1]))
    G = draw(st.integers(1, 6)) if gs > 0 else 1
    K = gs * G if gs > 0 else 32 * draw(st.integers(1, 24))
    if gs > 0 and draw(st.booleans()):  # a short last group (K not a multiple of gs)
        K = max(32, K - 32 * draw(st.integers(0, gs // 32 - 1)))
    g_idx_kind = draw(st.sampled_from(["none", "trivial", "act-order"]))
    return bits, K, N, gs, g_idx_kind, draw(st.booleans()), draw(seeds())


@hyp_settings(60)
@given(gptq_layers())
def test_gptq_equals_twins(layer):
    bits, K, N, gs, kind, v2, seed = layer
    rng = np.random.default_rng(seed)
    gsz = gs if gs > 0 else K
    G = -(-K // gsz)
    codes = random_codes(rng, [(bits, K)], N)
    qw = Q.pack_qweight(codes, bits)
    assert qw.shape == (K * bits // 32, N)
    assert np.array_equal(qw, O.gptq_pack_rows(codes, bits))
    assert np.array_equal(Q.unpack_qweight(qw, bits), codes)
    assert np.array_equal(O.gptq_unpack_rows(qw, bits), codes)
    zeros = rng.integers(0 if v2 else 1, (1 << bits) + (0 if v2 else 1), size=(G, N))
    fields = Q.fields_from_zeros(zeros, bits, v2)
    qz = Q.pack_qzeros(fields, bits)
    assert qz.shape == (G, N * bits // 32)
    assert np.array_equal(qz, O.gptq_pack_rows(fields.T, bits).T)
    assert np.array_equal(Q.unpack_qzeros(qz, bits), fields)
    assert np.array_equal(Q.zeros_from_fields(Q.unpack_qzeros(qz, bits), v2), zeros)
    scales = random_f16(rng, G * N, negative=True).reshape(G, N)
    trivial = np.arange(K) // gsz
    if kind == "act-order":
        g_idx = (np.argsort(rng.permutation(K)) // gsz).astype(np.int32)  # g_idx[k] = pos of k in perm // gs
    elif kind == "trivial":
        g_idx = trivial.astype(np.int32)
    else:
        g_idx = None
    with np.errstate(over="ignore", invalid="ignore"):
        ref = O.gptq_dequantize(qw, qz, scales, trivial if g_idx is None else g_idx, bits, v2=v2)
    got = Q.dequantize(qw, qz, scales, g_idx, bits, v2=v2, group_size=gs)
    assert got.shape == (N, K) and got.dtype == np.float16
    assert np.array_equal(f16_bits(got), f16_bits(ref))
    # float32 scales are rounded to fp16 first (same result as fp16 scales)
    got32 = Q.dequantize(qw, qz, scales.astype(np.float32), g_idx, bits, v2=v2, group_size=gs)
    assert np.array_equal(f16_bits(got32), f16_bits(got))
