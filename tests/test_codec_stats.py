"""The fused decode-to-statistics kernel (exl2fmt.codec.exl2_stats) against statistics of the full weight.

Oracle: ``exl2fmt.codec.oracle.dequantize`` (NumPy float16 arithmetic) reduced with float64 NumPy.  The fused
kernel never builds the weight, so these tests are what ties its numbers to the real dequantized values.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bits_rows, hyp_settings, n_pads, seeds
from hypothesis import given
from hypothesis import strategies as st

from exl2fmt.codec import oracle
from exl2fmt.codec.exl2_stats import layer_stats
from exl2fmt.groups import group_table_from_rows
from exl2fmt.formats.exl2 import exl2_tensors


def _layer(plan, n_pad, seed, qsm_hi=0.2):
    rng = np.random.default_rng(seed)
    K = sum(r for _, r in plan)
    codes = np.concatenate([rng.integers(0, 1 << b, (r, n_pad)) for b, r in plan]).astype(np.uint8)
    sc = rng.integers(0, 16, (len(plan), n_pad)).astype(np.uint8)
    qsm = (rng.random(len(plan)) * qsm_hi).astype(np.float16)
    return exl2_tensors(codes, sc, qsm, plan, rng.permutation(K).astype(np.int32))


def _reference(t, plan, n_out):
    with np.errstate(over="ignore"):  # fp16 overflow to inf is what the overflow test asks for
        w = oracle.dequantize(t["q_weight"], t["q_scale"], t["q_scale_max"], plan, t["q_invperm"], n_out)
    x = w.astype(np.float64).ravel()
    fin = np.isfinite(x)
    return {"mean": x[fin].mean() if fin.any() else 0.0, "std": x[fin].std() if fin.any() else 0.0,
            "absmax": np.abs(x[fin]).max() if fin.any() else 0.0, "nonfinite": int((~fin).sum()), "numel": x.size}


@given(plan=bits_rows(max_K=256, max_group_rows=128), n_pad=n_pads(96), seed=seeds(), data=st.data())
@hyp_settings(30)
def test_stats_equal_statistics_of_the_dequantized_weight(plan, n_pad, seed, data):
    n_out = data.draw(st.integers(max(1, n_pad - 31), n_pad))  # padding columns must be left out
    t = _layer(plan, n_pad, seed)
    got = layer_stats(t["q_weight"], t["q_scale"], t["q_scale_max"], group_table_from_rows(plan), n_out)
    ref = _reference(t, plan, n_out)
    assert got["numel"] == ref["numel"] and got["nonfinite"] == ref["nonfinite"] == 0
    assert got["absmax"] == ref["absmax"]  # a max of exact fp16 values is exact
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-5, abs=1e-7 * max(ref["absmax"], 1e-30))
    assert got["std"] == pytest.approx(ref["std"], rel=1e-5)


def test_overflowing_values_are_counted_not_summed():
    # q_scale_max near the fp16 maximum: 8-bit codes far from the zero point overflow fp16 to +-inf
    plan = [(8, 32)]
    t = _layer(plan, 32, 7)
    t["q_scale_max"] = np.array([60000.0], np.float16)
    got = layer_stats(t["q_weight"], t["q_scale"], t["q_scale_max"], group_table_from_rows(plan))
    ref = _reference(t, plan, 32)
    assert ref["nonfinite"] > 0
    assert got["nonfinite"] == ref["nonfinite"]
    assert got["absmax"] == ref["absmax"]
    assert np.isfinite(got["mean"]) and got["mean"] == pytest.approx(ref["mean"], rel=1e-5)


def test_layer_object_stats_match_dequantize(tmp_path):
    from exl2fmt.container import open_model
    from exl2fmt.model import find_layers, load_layer
    from exl2fmt.sample import write_sample

    write_sample(tmp_path)
    with open_model(tmp_path) as m:
        for key in find_layers(m.names()):
            layer = load_layer(m, key)
            w = layer.dequantize().astype(np.float64)
            s = layer.stats()
            assert s["numel"] == w.size and s["absmax"] == np.abs(w).max()
            assert s["mean"] == pytest.approx(w.mean(), rel=1e-5, abs=1e-9)
            assert s["std"] == pytest.approx(w.std(), rel=1e-5)
