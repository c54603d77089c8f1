"""The solver's block gains (``quant.sensitivity``, issue 40): how much each block's error grows on its way to the
model's output.

On Gemma 3 270M the flat sum of measured block errors starved the early attention blocks (whose errors every later
layer amplifies) and overfed the late ones.  ``block_gains`` measures each block's gain by carrying a
round-to-nearest perturbation of the block through every later FP16 layer, all perturbations batched through one
materialized layer at a time.  The oracle here is transformers' own Gemma 3 model run whole, once per block, with
the block's linears replaced by a NumPy round-to-nearest twin: the same gains, computed the slow, obvious way.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS = 4


def _tiny_gemma3(d, seed=0):
    """A seeded random Gemma 3 text model: sliding (window 8) and global layers with their own RoPE bases, the
    four norms per layer, q/k norms, GELU-tanh, scaled embedding; fp16 weights saved in ``d``."""
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, vocab_size=160, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.08) * torch.randn(p.shape, generator=g))
    model.to(torch.float16).save_pretrained(d)
    return d


def _rtn_twin(w, bits=4, group=128):
    """NumPy round-to-nearest: symmetric, one scale per ``group`` input features of a row (float64)."""
    w = np.asarray(w, np.float64)
    out = np.empty_like(w)
    top = 2 ** (bits - 1) - 1
    for a in range(0, w.shape[1], group):
        x = w[:, a:a + group]
        s = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-12) / top
        out[:, a:a + group] = np.clip(np.round(x / s), -top - 1, top) * s
    return out


def _rel(y, r):
    return float(((y - r).norm(dim=-1) / r.norm(dim=-1)).mean())


def _oracle_gains(d, ids):
    """Per block: the relative error of the final norm's output over the relative error of the block's own output
    (the attention block's at the residual stream entering pre_feedforward_layernorm), transformers' whole model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    base = model.model
    mids, outs = [], []

    def capture():
        hooks = []
        for lay in base.layers:
            hooks.append(lay.pre_feedforward_layernorm.register_forward_pre_hook(
                lambda m, a: mids.append(a[0].clone())))
            hooks.append(lay.register_forward_hook(
                lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).clone())))
        return hooks

    def run():
        mids.clear()
        outs.clear()
        hooks = capture()
        with torch.no_grad():
            fin = base(ids, use_cache=False).last_hidden_state
        for h in hooks:
            h.remove()
        return fin, list(mids), list(outs)

    fin_ref, mid_ref, out_ref = run()
    gains = []
    for i, lay in enumerate(base.layers):
        for kind, mod in (("attn", lay.self_attn), ("mlp", lay.mlp)):
            saved = {}
            for n, lin in mod.named_children():
                if isinstance(lin, torch.nn.Linear):
                    saved[n] = lin.weight.data
                    lin.weight.data = torch.from_numpy(_rtn_twin(lin.weight.data.numpy())).float()
            fin, mid, out = run()
            for n, w in saved.items():
                getattr(mod, n).weight.data = w
            own = _rel(mid[i], mid_ref[i]) if kind == "attn" else _rel(out[i], out_ref[i])
            gains.append(_rel(fin, fin_ref) / own)
    mean = math.exp(sum(math.log(g) for g in gains) / len(gains))
    return [g / mean for g in gains]


def test_block_gains_match_the_whole_model_oracle_on_gemma3(tmp_path):
    from exl2fmt.quant.sensitivity import block_gains
    from exl2fmt.runner.model import HFModel

    d = _tiny_gemma3(tmp_path / "g3")
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, 160, (5, 24)))
    spec = HFModel.open(d)
    try:
        # batch_tokens 24: one trajectory row per forward, so the batching of the trajectories is exercised
        got = block_gains(spec, ids, torch.device("cpu"), batch_tokens=24)
    finally:
        spec.close()
    want = _oracle_gains(d, ids[[0, 4]])          # the two gain rows: the first and the last
    keys = [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in ("self_attn", "mlp")]
    assert list(got) == keys
    np.testing.assert_allclose([got[k] for k in keys], want, rtol=2e-3)
    assert max(want) / min(want) > 1.5, want        # the blocks differ: the test can tell gains apart


@pytest.mark.slow  # a whole quantization (~25 s on 2 cores)
def test_gains_are_stored_with_the_measurement_and_steer_the_plan(tmp_path):
    from exl2fmt.quant.measure import plan_from_measurement
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.quant.qparams import GAINS_KEY

    d = _tiny_gemma3(tmp_path / "g3", seed=2)
    cal = tmp_path / "cal.npy"
    np.save(cal, np.random.default_rng(3).integers(3, 160, (4, 32)))
    meas = tmp_path / "m.json"
    rep = quantize_model(d, tmp_path / "q", QuantOptions(target="exl2", bits=4.5, device="cpu", calibration=str(cal),
                                                        rows=4, length=32, save_measurement=str(meas),
                                                        block_gain=True))
    doc = json.loads(meas.read_text())
    keys = [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in ("self_attn", "mlp")]
    assert sorted(doc[GAINS_KEY]) == sorted(keys) and rep.block_gains == doc[GAINS_KEY]
    assert json.loads((tmp_path / "q" / "measurement.json").read_text())[GAINS_KEY] == doc[GAINS_KEY]
    # a block whose error is amplified 1000x more than the others' gets its most accurate option
    doc[GAINS_KEY] = {k: (1000.0 if k == keys[0] else 1.0) for k in keys}
    steep = tmp_path / "steep.json"
    steep.write_text(json.dumps(doc))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({k: v for k, v in doc.items() if k != GAINS_KEY}))
    p_steep = plan_from_measurement(d, steep, 4.5, block_gain=True)
    p_flat = plan_from_measurement(d, flat, 4.5, block_gain=True)
    assert plan_from_measurement(d, steep, 4.5) == p_flat       # off (the default): the stored gains unused
    from exl2fmt.quant.measure import measured_from_file, read_measurement_for
    from exl2fmt.quant.qparams import block_options
    from exl2fmt.runner.model import HFModel

    spec = HFModel.open(d)
    try:
        measured = measured_from_file(spec, read_measurement_for(spec, flat), lambda k: block_options(k, extended=True), flat)
    finally:
        spec.close()
    acc = {j: a for j, _, a in measured[keys[0]]}
    steep_j, flat_j = p_steep["options"][keys[0]], p_flat["options"][keys[0]]
    assert acc[steep_j] == max(acc.values()) and acc[flat_j] < acc[steep_j], (steep_j, flat_j, acc)
