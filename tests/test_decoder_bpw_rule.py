"""One rule for what the decoder bpw counts (``layout.STAYS_16BIT``): inspect, validate and the quantizer's own
check leave 16-bit MoE routers out, and only them.

Oracle: the sample EXL2 model's decoder bpw computed by hand from its tensors (bytes of the EXL2 layers' tensors /
sum K * N_pad), with a 16-bit router added to each decoder block."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from exl2fmt.container import write_safetensors
from exl2fmt.inspect import inspect_model
from exl2fmt.layout import STAYS_16BIT, counts_in_decoder_bpw, stays_16bit
from exl2fmt.sample import write_sample
from exl2fmt.validate import validate_model

E = 8       # experts: the router is float16 [E, hidden]


def test_the_rule_names_routers_only():
    assert stays_16bit("model.layers.3.block_sparse_moe.gate") and stays_16bit("model.layers.0.mlp.gate")
    assert stays_16bit("model.layers.0.mlp.shared_expert_gate") and stays_16bit("mlp.gate")
    for key in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.shared_expert.gate_proj",
                "model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.0.mlp.up_gate", "lm_head"):
        assert not stays_16bit(key), key
    assert not counts_in_decoder_bpw("model.layers.0.mlp.gate", "dense")
    assert counts_in_decoder_bpw("model.layers.0.mlp.gate", "gptq")      # a router some tool quantized counts
    assert all("." in s for s in STAYS_16BIT)


def _with_routers(tmp_path, leaf: str):
    src = tmp_path / "sample"
    write_sample(src)
    t = load_file(str(src / "output.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    dec = [n for n in t if n.startswith("model.layers.") and ".q_" in n]
    bits = sum(t[n].nbytes * 8 for n in dec)
    numel = sum(t[n].shape[0] * t[n[: -len("q_invperm")] + "q_weight"].shape[1] for n in dec if n.endswith(".q_invperm"))
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(0)
    for i in range(L):
        t[f"model.layers.{i}.{leaf}.weight"] = rng.standard_normal((E, H)).astype(np.float16)
    cfg["quantization_config"]["bits"] = round(bits / numel, 4)
    d = tmp_path / leaf.replace(".", "_")
    d.mkdir()
    write_safetensors(d / "output.safetensors", t)
    (d / "config.json").write_text(json.dumps(cfg))
    return d, bits / numel, (bits + L * E * H * 16) / (numel + L * E * H)


def test_inspect_validate_and_quantizer_leave_16bit_routers_out(tmp_path):
    from exl2fmt.quant.compile import stored_decoder_bpw

    d, without, with_routers = _with_routers(tmp_path, "block_sparse_moe.gate")
    rep = inspect_model(d)
    b = rep["summary"]["bpw"]
    assert b["decoder"] == pytest.approx(without, abs=1e-6)
    assert b["decoder_incl_16bit"] == pytest.approx(with_routers, abs=1e-6) and with_routers > without + 0.01
    routers = [r for r in rep["layers"] if r["stays_16bit"]]
    assert len(routers) == 2 and all(r["key"].endswith("block_sparse_moe.gate") and r["format"] == "dense"
                                     for r in routers)
    in_blocks = [r["key"] for r in rep["layers"] if r["block"] not in (None, "head")]    # the routers too
    assert stored_decoder_bpw(d, in_blocks) == b["decoder"]
    v = validate_model(d)
    [c] = [c for c in v.checks if c.check == "bits"]
    assert c.code == "BITS_OK" and f"{without:.4f}" in c.message


def test_a_dense_linear_that_is_no_router_counts(tmp_path):
    d, without, with_extra = _with_routers(tmp_path, "mlp.gate_extra")
    b = inspect_model(d)["summary"]["bpw"]
    assert b["decoder"] == pytest.approx(with_extra, abs=1e-6) and b["decoder_incl_16bit"] is None
    [c] = [c for c in validate_model(d).checks if c.check == "bits"]
    assert f"{with_extra:.4f}" in c.message
