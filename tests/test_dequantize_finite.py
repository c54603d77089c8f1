"""``Linear.dequantize_finite`` (the rule every decoding command shares): a decoded weight with a NaN/Inf is
NONFINITE_VALUES naming the layer, with the exact count.  EXL2 skips the scan of its output when its scales prove
no value can overflow (``_decode_is_finite``); these tests check that proof against an independent oracle - the
decoded output widened to float32 and tested with ``isfinite`` - on layers whose scales sit on both sides of the
fp16 overflow edge for every bit width, and that dense and GPTQ layers keep the rule."""

from __future__ import annotations

import numpy as np
import pytest

from exl2fmt.errors import ErrorCode, Exl2Error
from exl2fmt.formats import layer_from_tensors
from exl2fmt.formats.exl2 import exl2_tensors

K_ROWS = {2: 32, 3: 32, 4: 32, 5: 32, 6: 32, 8: 32}


def _exl2(bits: int, qsm: float, N: int = 64, seed: int = 0, all_extreme: bool = False):
    rng = np.random.default_rng(seed)
    br = [(bits, 32), (2, 32)]  # bit widths are non-increasing
    K = 64
    codes = rng.integers(0, 1 << bits, (K, N)).astype(np.uint8)
    codes[32:] = rng.integers(0, 4, (32, N))
    codes[0, :] = 0  # q - 2^(b-1) = -2^(b-1): the largest magnitude the decode reaches
    sc = rng.integers(0, 16, (2, N)).astype(np.uint8)
    sc[0, : N // 2] = 15
    if all_extreme:
        sc[0, :] = 15
    t = exl2_tensors(codes, sc, np.array([qsm, 1.0]), br, np.arange(K))
    return layer_from_tensors("model.layers.0.mlp.down_proj", t)


def _oracle_nonfinite(layer) -> int:
    w = layer.dequantize()  # the codec (deep checks run), no finiteness rule
    return int(np.count_nonzero(~np.isfinite(w.astype(np.float32))))


@pytest.mark.parametrize("bits", sorted(K_ROWS))
def test_exl2_bound_never_skips_a_nonfinite_output(bits):
    # q_scale_max values around the edge 2^(b-1) * fp16(256 * fp16(qsm / 256)) = 65504 .. 65520 and far off it
    edge = 65504.0 / (1 << (bits - 1))
    f16 = np.float16
    with np.errstate(over="ignore"):
        cands = {float(f16(edge * f)) for f in (0.25, 0.9, 0.99, 0.999, 1.0, 1.001, 1.01, 1.1, 4.0)}
    x = f16(edge)
    for _ in range(3):  # the neighbouring fp16 values of the edge
        cands.add(float(x))
        cands.add(float(np.nextafter(x, f16(np.inf))))
        cands.add(float(np.nextafter(x, f16(0))))
        x = np.nextafter(x, f16(np.inf))
    cands |= {0.0, 1.0, 65504.0}
    seen = {True: 0, False: 0}
    for qsm in sorted(c for c in cands if np.isfinite(c)):
        layer = _exl2(bits, qsm)
        bad = _oracle_nonfinite(layer)
        proof = layer._decode_is_finite()
        if proof:
            assert bad == 0, (bits, qsm)
        seen[bad > 0] += 1
        if bad:
            with pytest.raises(Exl2Error) as ei:
                layer.dequantize_finite()
            assert ei.value.code is ErrorCode.NONFINITE_VALUES
            assert ei.value.tensor == "model.layers.0.mlp.down_proj"
            assert f"holds {bad} NaN/Inf of {layer.out_features * layer.in_features}" in ei.value.message
        else:
            w = layer.dequantize_finite()
            assert np.array_equal(w.view(np.uint16), layer.dequantize().view(np.uint16))
    assert seen[True] and seen[False]  # both sides of the edge were exercised


def test_exl2_bound_holds_for_ordinary_layers_and_is_exact_enough():
    # ordinary scales: proved finite (no scan); every extreme code at the edge overflows and is counted
    assert _exl2(4, 0.5)._decode_is_finite()
    assert _exl2(8, 511.0)._decode_is_finite()
    layer = _exl2(8, 1024.0, all_extreme=True)
    assert not layer._decode_is_finite()
    assert _oracle_nonfinite(layer) > 0


def test_dense_and_gptq_keep_the_rule():
    w = np.ones((32, 64), np.float32)
    w[3, 5] = 1e6  # finite in F32, Inf in float16
    layer = layer_from_tensors("L", {"weight": w})
    assert not layer._decode_is_finite()
    with pytest.raises(Exl2Error) as ei:
        layer.dequantize_finite()
    assert ei.value.code is ErrorCode.NONFINITE_VALUES and "holds 1 NaN/Inf" in ei.value.message
    ok = layer_from_tensors("L", {"weight": np.ones((32, 64), np.float16)})
    assert ok._decode_is_finite() and ok.dequantize_finite().dtype == np.float16
    nan16 = np.ones((32, 64), np.float16)
    nan16[0, 0] = np.nan
    with pytest.raises(Exl2Error) as ei:  # the deep checks refuse it before the decode
        layer_from_tensors("L", {"weight": nan16}).dequantize_finite()
    assert ei.value.code is ErrorCode.NONFINITE_VALUES
    from test_layers import gptq_layer_tensors

    g = layer_from_tensors("L", gptq_layer_tensors(bits=4))
    assert not g._decode_is_finite()
    assert np.array_equal(g.dequantize_finite(), g.dequantize())
