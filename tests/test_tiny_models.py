"""The width rule of the tiny test models (``tiny_models.width_dims``) that bench/arch_quality.py's ``--hidden``
uses: at 128 it must give exactly the dims the recorded 2026-12-02 tables were measured with, and at a wider
width every architecture must build a model whose linears have the shapes the rule promises (head_dim x heads =
hidden, where several architectures derive head_dim and would otherwise silently disagree)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import ARCHS, DENSE, MOE, make_config, width_dims  # noqa: E402

#: the dims bench/arch_quality.py used for every table before it had --hidden (written out, not computed)
RECORDED_128 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, vocab_size=512)


def test_width_128_is_the_recorded_tables_dims():
    for arch in DENSE:
        assert width_dims(arch, 128) == RECORDED_128
    assert width_dims("mixtral", 128) == dict(RECORDED_128, intermediate_size=128)
    assert width_dims("qwen3_moe", 128) == dict(RECORDED_128, moe_intermediate_size=128)


@pytest.mark.parametrize("hidden", [0, 64, 200, -128])
def test_width_must_tile_128_row_groups(hidden):
    with pytest.raises(ValueError, match="multiple of 128"):
        width_dims("llama", hidden)


def _linear_shapes(model) -> dict[str, tuple[int, int]]:
    """Suffix of every decoder linear of layer 0 (and fused 3-D experts: per expert) -> (out, in)."""
    import torch

    out = {}
    for name, mod in model.model.layers[0].named_modules():
        if isinstance(mod, torch.nn.Linear):
            out[name] = tuple(mod.weight.shape)
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 3:
                out[f"{name}.{pname}"] = tuple(p.shape[1:])
    return out


@pytest.mark.parametrize("arch", list(DENSE + MOE) + ["qwen2_moe"])
def test_width_512_builds_every_architecture_with_the_promised_shapes(arch):
    import torch
    import transformers

    d = width_dims(arch, 512)
    assert d["num_attention_heads"] * d["head_dim"] == 512 and d["head_dim"] == 64
    cfg = make_config(arch, **d)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    sh = _linear_shapes(m)
    q, kv = 8 * 64, 4 * 64
    if arch == "phi3":
        assert sh["self_attn.qkv_proj"] == (q + 2 * kv, 512)
        assert sh["mlp.gate_up_proj"] == (2 * 1024, 512) and sh["mlp.down_proj"] == (512, 1024)
    else:
        assert (sh["self_attn.q_proj"], sh["self_attn.k_proj"], sh["self_attn.v_proj"], sh["self_attn.o_proj"]) \
            == ((q, 512), (kv, 512), (kv, 512), (512, q))
    if arch in DENSE and arch != "phi3":
        mlp = {k: v for k, v in sh.items() if k.startswith("mlp.")}
        wide = 1024
        assert sorted(mlp.values()) == sorted([(wide, 512)] * (len(mlp) - 1) + [(512, wide)])
    if arch in MOE or arch == "qwen2_moe":
        experts = {k: v for k, v in sh.items() if ".experts." in k or k.endswith("experts.gate_up_proj")
                   or k.endswith("experts.down_proj")}
        assert experts, sh
        # fused experts: gate_up [2I, H] per expert, down [H, I] per expert, with I = hidden
        assert set(experts.values()) == {(2 * 512, 512), (512, 512)}, experts
    # every input width tiles 128-row groups
    assert all(k_in % 128 == 0 for _, k_in in sh.values()), sh
    assert arch in ARCHS
