"""The GGML block quantizers (exl2fmt.codec.ggml_quant / ggml_fit): every type's bytes decode, by the ``gguf``
package's own decoder (independent code), to exactly the values our fit intended; the fit equals its slow NumPy
twin (tests/ggml_twin.py); the search beats plain rounding; ragged rows are refused."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

import ggml_twin as twin  # noqa: E402
from exl2fmt.codec.ggml_quant import (BLOCK, IQ4_NL_VALUES, KQUANT_TYPES, LEGACY_TYPES, TYPE_SIZE,  # noqa: E402
                                      fit_integers, fits_row, quantize)

ALL = KQUANT_TYPES + LEGACY_TYPES
_SUB = {"Q2_K": 16, "Q3_K": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}


def _weights(rows=6, cols=512, seed=0) -> np.ndarray:
    """float32 [rows, cols]: trained-weight-like rows (heavy tails), plus the awkward ones: all zero, constant
    positive, constant negative, one large outlier, all positive (a minimum of 0 for the affine types)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(4, (rows + 5, cols)) * 0.02).astype(np.float32)
    x[rows] = 0.0
    x[rows + 1] = 0.013
    x[rows + 2] = -0.007
    x[rows + 3, 5] = 0.9
    x[rows + 4] = np.abs(x[rows + 4]) + 0.01
    return x


def _intended(f: dict, gtype: str) -> np.ndarray:
    """float32 [N, K]: what the fit means each weight to decode to, from its integers and fp16 scales, written
    from the type's formula (not from the packed bytes)."""
    L = f["L"].astype(np.float32)
    N, K = L.shape
    d = np.repeat(f["d"].view(np.float16).astype(np.float32), BLOCK[gtype], axis=1)
    if gtype == "IQ4_NL":
        return d * np.asarray(IQ4_NL_VALUES, np.float32)[f["L"].astype(np.int64)]
    if gtype in LEGACY_TYPES:
        m = np.repeat(f["dmin"].view(np.float16).astype(np.float32), 32, axis=1) if "dmin" in f else 0.0
        return d * L + m
    sub = _SUB[gtype]
    sc = np.repeat(f["sc"].astype(np.float32), sub, axis=1)
    d_sc = (d * sc).astype(np.float32)  # ggml multiplies the fp16 super-scale by the integer scale in float32
    if "mn" in f:
        dm = np.repeat(f["dmin"].view(np.float16).astype(np.float32), 256, axis=1)
        return d_sc * L - (dm * np.repeat(f["mn"].astype(np.float32), sub, axis=1)).astype(np.float32)
    return d_sc * L


@pytest.mark.parametrize("gtype", ALL)
def test_bytes_decode_to_the_intended_values(gtype):
    x = _weights()
    b = quantize(x, gtype)
    assert b.dtype == np.uint8 and b.shape == (x.shape[0], x.shape[1] // BLOCK[gtype] * TYPE_SIZE[gtype])
    back = quants.dequantize(b, gguf.GGMLQuantizationType[gtype]).reshape(x.shape)
    want = _intended(fit_integers(x, gtype), gtype)
    np.testing.assert_allclose(back, want, rtol=2e-7, atol=1e-12)
    # the awkward rows decode sensibly: all-zero -> zero, constant rows within a few fp16 steps of themselves
    assert not back[-5].any()
    assert np.abs(back[-4] - 0.013).max() < 0.013 * 0.03
    assert np.abs(back[-3] + 0.007).max() < 0.007 * 0.03
    assert np.isfinite(back).all()


def _twin_block(x, w, gtype):
    if gtype in ("Q4_K", "Q5_K", "Q2_K"):
        p = {"Q4_K": (32, 15.0, 63.0, 20, -1.0, 0.1), "Q5_K": (32, 31.0, 63.0, 15, -0.5, 0.1),
             "Q2_K": (16, 3.0, 15.0, 15, -0.5, 0.1)}[gtype]
        L, ls, lm, d, dmin = twin.kquant_affine_block(x, w, *p)
        return L, ls, lm, d, dmin
    if gtype in ("Q6_K", "Q3_K"):
        p = {"Q6_K": (16, -32.0, 31.0, -128.0, 127.0, 9, 0.1), "Q3_K": (16, -4.0, 3.0, -32.0, 31.0, 9, 0.1)}[gtype]
        L, ls, d = twin.kquant_sym_block(x, w, *p)
        return L, ls, None, d, None
    if gtype in ("Q4_0", "Q5_0", "Q8_0"):
        lo, hi = {"Q4_0": (-8.0, 7.0), "Q5_0": (-16.0, 15.0), "Q8_0": (-128.0, 127.0)}[gtype]
        L, d = twin.legacy_sym_block(x, w, lo, hi, 9, 0.1)
        return L, None, None, d, None
    if gtype == "IQ4_NL":
        L, d = twin.legacy_nl_block(x, w, IQ4_NL_VALUES, 9, 1.0)
        return L, None, None, d, None
    L, d, m = twin.legacy_affine_block(x, w, {"Q4_1": 15.0, "Q5_1": 31.0}[gtype], 15, -0.5, 0.1)
    return L, None, None, d, m


@pytest.mark.parametrize("gtype", ALL)
@pytest.mark.parametrize("weighted", [False, True])
def test_fit_equals_the_numpy_twin(gtype, weighted):
    x = _weights(rows=2, cols=256, seed=3)
    rng = np.random.default_rng(1)
    w = (rng.random((1, 256)) ** 2 + 0.05).astype(np.float32) if weighted else None
    f = fit_integers(x, gtype, w)
    ww = np.ones(256) if w is None else w[0].astype(np.float64)
    bs = BLOCK[gtype]
    for r in range(x.shape[0]):
        for b in range(256 // bs):
            sl = slice(b * bs, (b + 1) * bs)
            L, ls, lm, d, dmin = _twin_block(x[r, sl].astype(np.float64), ww[sl], gtype)
            assert np.array_equal(f["L"][r, sl], L.astype(np.int8)), (r, b)
            assert float(f["d"][r, b:b + 1].view(np.float16)[0]) == d, (r, b)
            if ls is not None:
                n = len(ls)
                assert np.array_equal(f["sc"][r, b * n:(b + 1) * n], ls.astype(np.int8)), (r, b)
            if lm is not None:
                assert np.array_equal(f["mn"][r, b * n:(b + 1) * n], lm.astype(np.int8)), (r, b)
            if dmin is not None:
                assert float(f["dmin"][r, b:b + 1].view(np.float16)[0]) == dmin, (r, b)


@pytest.mark.parametrize("gtype", [t for t in LEGACY_TYPES if t != "IQ4_NL"])
def test_search_beats_plain_rounding(gtype):
    """Against the gguf package's own round-from-the-extremes quantizer on the same rows."""
    x = _weights(rows=16)[:16]
    qt = gguf.GGMLQuantizationType[gtype]
    ours = quants.dequantize(quantize(x, gtype), qt).reshape(x.shape)
    rtn = quants.dequantize(quants.quantize(x, qt), qt).reshape(x.shape)
    assert ((ours - x) ** 2).sum() < ((rtn - x) ** 2).sum() * 0.97


def test_iq4_nl_beats_q4_0_at_the_same_size():
    x = _weights(rows=16)[:16]
    err = {}
    for t in ("Q4_0", "IQ4_NL"):
        back = quants.dequantize(quantize(x, t), gguf.GGMLQuantizationType[t]).reshape(x.shape)
        err[t] = float(((back - x) ** 2).sum())
    assert TYPE_SIZE["IQ4_NL"] == TYPE_SIZE["Q4_0"] and err["IQ4_NL"] < 0.85 * err["Q4_0"]


def test_error_falls_with_bits_and_importance_is_honoured():
    x = _weights(rows=8)[:8]
    rmse = {}
    for t in KQUANT_TYPES:
        back = quants.dequantize(quantize(x, t), gguf.GGMLQuantizationType[t]).reshape(x.shape)
        rmse[t] = float(np.sqrt(((back - x) ** 2).mean()))
    assert rmse["Q2_K"] > rmse["Q3_K"] > rmse["Q4_K"] > rmse["Q5_K"] > rmse["Q6_K"]
    # a heavy importance on the first 64 columns lowers their error against uniform weights
    w = np.ones((1, x.shape[1]), np.float32)
    w[0, :64] = 100.0
    for t in ("Q4_K", "Q3_K"):
        qt = gguf.GGMLQuantizationType[t]
        plain = quants.dequantize(quantize(x, t), qt).reshape(x.shape)
        heavy = quants.dequantize(quantize(x, t, w), qt).reshape(x.shape)
        assert ((heavy - x)[:, :64] ** 2).sum() < ((plain - x)[:, :64] ** 2).sum()


def test_rows_that_are_not_whole_blocks_are_refused():
    assert fits_row("Q4_K", 1536) and not fits_row("Q4_K", 576) and fits_row("Q4_0", 576)
    with pytest.raises(ValueError, match="whole blocks"):
        quantize(np.zeros((2, 576), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="importance"):
        quantize(np.zeros((2, 256), np.float32), "Q4_K", np.ones((3, 256), np.float32))
