"""fp16 <-> fp32 bit conversions of exl2fmt.codec.f16 against numpy's float16 (IEEE round to nearest even).

NaN: every conversion must give a NaN of the same sign; payload bits may differ from numpy's (the software
path returns the canonical quiet NaN), except for the canonical quiet NaN itself which is exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from exl2fmt.codec import f16 as F


def _run(fn, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint16)
    fn(x, out)
    return out


def sw(x):
    return _run(F.f32_array_to_f16_bits_sw, x)


def selected(x):
    return _run(F.f32_array_to_f16_bits, x)


@njit(cache=False)
def _hw_to_f16(src, out):
    for i in range(src.size):
        out[i] = F.f32_to_f16_bits_hw(src[i])


@njit(cache=False)
def _hw_to_f32(src, out):
    for i in range(src.size):
        out[i] = F.f16_bits_to_f32_hw(src[i])


CONVERTERS = {"sw": sw, "selected": selected}
if F.HW_HALF:
    CONVERTERS["hw"] = lambda x: _run(_hw_to_f16, x)


def ref(x) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def assert_same_f16(got: np.ndarray, x: np.ndarray) -> None:
    """Bit-exact against numpy for non-NaN inputs; NaN -> NaN of the same sign."""
    x = np.asarray(x, np.float32)
    want = ref(x)
    nan = np.isnan(x)
    bad = np.flatnonzero(~nan & (got != want))
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]
    g = got[nan]
    assert ((g & 0x7C00) == 0x7C00).all() and ((g & 0x03FF) != 0).all(), "NaN must stay NaN"
    assert np.array_equal(g >> 15, (x.view(np.uint32)[nan] >> 31).astype(np.uint16)), "NaN keeps its sign"


@pytest.fixture(params=list(CONVERTERS))
def conv(request):
    return CONVERTERS[request.param]


def test_selected_is_hw_where_available():
    assert F.f32_to_f16_bits is (F.f32_to_f16_bits_hw if F.HW_HALF else F.f32_to_f16_bits_sw)
    assert F.f16_bits_to_f32 is (F.f16_bits_to_f32_hw if F.HW_HALF else F.f16_bits_to_f32_sw)


def test_hand_picked_values(conv):
    cases = [  # (float32 bit pattern, fp16 bit pattern), all worked out by hand
        (0x00000000, 0x0000), (0x80000000, 0x8000),                        # +-0
        (0x3F800000, 0x3C00), (0xC0000000, 0xC000),                        # 1.0, -2.0
        (0x477FE000, 0x7BFF),                                              # 65504, largest finite
        (0x477FEFFF, 0x7BFF),                                              # just below 65520: rounds down
        (0x477FF000, 0x7C00),                                              # 65520: tie, even -> 65536 -> inf
        (0x47800000, 0x7C00), (0x7F7FFFFF, 0x7C00), (0xFF7FFFFF, 0xFC00),  # overflow
        (0x7F800000, 0x7C00), (0xFF800000, 0xFC00),                        # +-inf
        (0x7FC00000, 0x7E00), (0xFFC00000, 0xFE00),                        # canonical quiet NaN
        (0x38800000, 0x0400),                                              # 2^-14, smallest normal
        (0x387FC000, 0x03FF),                                              # largest subnormal
        (0x33800000, 0x0001),                                              # 2^-24, smallest subnormal
        (0x33000000, 0x0000),                                              # 2^-25: tie, even -> 0
        (0x33000001, 0x0001),                                              # just above 2^-25 -> 2^-24
        (0x33C00000, 0x0002),                                              # 1.5 * 2^-24: tie -> even (2)
        (0x34200000, 0x0002),                                              # 2.5 * 2^-24: tie -> even (2)
        (0x32800000, 0x0000),                                              # 2^-26 -> 0
        (0x3F801000, 0x3C00),                                              # 1 + 2^-11: tie -> even (1.0)
        (0x3F803000, 0x3C02),                                              # 1 + 3 * 2^-11: tie -> even
        (0x3F801001, 0x3C01),                                              # just above the tie
        (0x387FE000, 0x0400),                                              # largest subnormal + half ulp -> normal
        (0x0000001F, 0x0000), (0x80000001, 0x8000),                        # f32 subnormals -> +-0
    ]
    x = f32([c[0] for c in cases])
    assert conv(x).tolist() == [c[1] for c in cases]
    assert_same_f16(conv(x), x)


def _f16_table():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    return h, h.view(np.float16).astype(np.float32)


def test_every_fp16_value_round_trips(conv):
    h, x = _f16_table()
    got = conv(x)
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], h[finite])
    assert_same_f16(got, x)


def test_ties_and_neighbours(conv):
    """Midpoints between every pair of adjacent finite fp16 magnitudes (exact in float32), and the float32
    values one ulp either side of them: the three rounding decisions of every fp16 interval."""
    mags = np.arange(0x0000, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    nxt = np.append(mags[1:], 65536.0)  # past 65504 the next step is the overflow threshold
    mid = ((mags + nxt) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (mags + nxt) / 2)  # the midpoints are exact
    lo = np.nextafter(mid, np.float32(0))
    hi = np.nextafter(mid, np.float32(np.inf))
    x = np.concatenate([mid, lo, hi])
    x = np.concatenate([x, -x])
    assert_same_f16(conv(x), x)


def test_strided_sweep_of_all_float32_patterns(conv):
    bits = np.arange(0, 2**32, 4093, dtype=np.uint64) + 1234
    x = f32(bits % 2**32)
    assert_same_f16(conv(x), x)


def test_dense_sweep_of_the_rounding_range(conv):
    """|x| in [2^-26, 2^17): every exponent where the result is neither 0 nor inf, stride 97."""
    start, stop = 0x32800000, 0x48000000
    bits = np.arange(start, stop, 97, dtype=np.uint64)
    x = f32(bits)
    x = np.concatenate([x, -x])
    assert_same_f16(conv(x), x)


def test_nan_payloads(conv):
    x = f32([0x7F800001, 0x7FBFFFFF, 0x7FC00001, 0x7FFFFFFF, 0xFF800001, 0xFFC12345, 0x7FA00000])
    assert_same_f16(conv(x), x)


# ---------------------------------------------------------------------------------------------------
# fp16 -> fp32
# ---------------------------------------------------------------------------------------------------


def test_f16_to_f32_sw_exact_on_all_patterns():
    h, want = _f16_table()
    out = np.empty(65536, np.float32)
    F.f16_bits_array_to_f32_sw(h, out)
    got = out.view(np.uint32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan], want.view(np.uint32)[~nan])
    # NaN: sign, all-ones exponent, the 10 payload bits moved up by 13 (hand-written rule)
    hn = h[nan].astype(np.uint32)
    rule = ((hn & 0x8000) << 16) | 0x7F800000 | ((hn & 0x3FF) << 13)
    assert np.array_equal(got[nan], rule)
    assert got[nan].size == 2046  # 2 signs x 1023 non-zero payloads


@pytest.mark.skipif(not F.HW_HALF, reason="no hardware half conversion on this CPU")
def test_f16_to_f32_hw_exact_on_all_patterns():
    h, want = _f16_table()
    out = np.empty(65536, np.float32)
    _hw_to_f32(h, out)
    nan = np.isnan(want)
    assert np.array_equal(out.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(out[nan]).all()
    assert np.array_equal(np.signbit(out[nan]), np.signbit(want[nan]))
