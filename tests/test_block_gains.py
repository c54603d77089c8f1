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


def _oracle_gains(d, ids, perturbed=None):
    """Per block: the relative error of the final norm's output over the relative error of the block's own output
    (the attention block's at the residual stream entering pre_feedforward_layernorm), transformers' whole model.
    ``perturbed(i, key, w)``: layer i's linear ``key`` (``self_attn.q_proj``, ...) perturbed, float32 [N, K];
    default the round-to-nearest twin."""
    if perturbed is None:
        perturbed = lambda i, key, w: torch.from_numpy(_rtn_twin(w.numpy())).float()  # noqa: E731
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
        for kind, child, mod in (("attn", "self_attn", lay.self_attn), ("mlp", "mlp", lay.mlp)):
            saved = {}
            for n, lin in mod.named_children():
                if isinstance(lin, torch.nn.Linear):
                    saved[n] = lin.weight.data
                    lin.weight.data = perturbed(i, f"{child}.{n}", lin.weight.data).float()
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


def test_gain_option_is_the_candidate_nearest_gain_bpw():
    from exl2fmt.quant.sensitivity import GAIN_BPW, gain_option

    rows = [[0, 2.1 * 100, 0.9], [1, 2.6 * 100, 0.95], [2, 3.4 * 100, 0.97], [3, 6.0 * 100, 0.99]]
    assert GAIN_BPW == 3.0 and gain_option(rows, 100) == 1        # 2.6 is 0.4 away, 3.4 is 0.4 away: the first
    assert gain_option(rows[2:], 100) == 2 and gain_option(rows[3:], 100) == 3


def test_gains_from_the_measurements_own_candidates_match_the_whole_model_oracle(tmp_path, monkeypatch):
    """With --block-gains the quantizer perturbs each block by its own measured GPTQ candidate (the option nearest
    GAIN_BPW): the gains it plans with equal transformers' whole model run once per block with those weights
    swapped in; a measurement read from a file without gains falls back to round-to-nearest and says so."""
    from exl2fmt.quant import pipeline
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.quant.sensitivity import GAIN_BPW, perturbed_weight

    d = _tiny_gemma3(tmp_path / "g3", seed=4)
    ids = np.random.default_rng(5).integers(3, 160, (4, 32))
    cal = tmp_path / "cal.npy"
    np.save(cal, ids)
    seen = {}                                   # (layer, linear) -> the perturbation the gains were measured with
    real = pipeline.block_gains

    def spy(spec, ids_t, device, bt, progress=None, perturb=None):
        def keep(i, name, w):
            got = (perturb or (lambda i, n, w: perturbed_weight(w)))(i, name, w)
            seen[(i, spec.key_of[name])] = (w.clone(), got.clone())
            return got
        return real(spec, ids_t, device, bt, progress, perturb=keep)

    monkeypatch.setattr(pipeline, "block_gains", spy)
    meas = tmp_path / "m.json"
    opts = dict(target="exl2", bits=4.0, device="cpu", calibration=str(cal), rows=4, length=32, block_gain=True)
    rep = quantize_model(d, tmp_path / "q", QuantOptions(**opts, save_measurement=str(meas)))
    keys = [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in ("self_attn", "mlp")]
    assert not any("round-to-nearest" in w for w in rep.warnings), rep.warnings
    assert len(seen) == LAYERS * 7
    # the perturbations are GPTQ candidates at about GAIN_BPW, not round-to-nearest 4-bit: a 3-bit-class error
    for (i, key), (w, p) in seen.items():
        rel = float((p - w).norm() / w.norm())
        rtn = float((perturbed_weight(w) - w).norm() / w.norm())
        assert 0.02 < rel < 0.5 and not torch.equal(p, perturbed_weight(w)), (i, key, rel, rtn)
    want = _oracle_gains(d, torch.from_numpy(ids[[0, 3]]), lambda i, key, w: seen[(i, key)][1])
    np.testing.assert_allclose([rep.block_gains[k] for k in keys], want, rtol=2e-3)
    assert GAIN_BPW == 3.0

    # reused measurement without stored gains: no candidates at hand, round-to-nearest, said in the report
    flat = tmp_path / "flat.json"
    doc = json.loads(meas.read_text())
    doc.pop("exl2fmt_block_gains")
    flat.write_text(json.dumps(doc))
    seen.clear()
    rep2 = quantize_model(d, tmp_path / "q2", QuantOptions(**opts, measurement=str(flat)))
    assert any("round-to-nearest" in w for w in rep2.warnings), rep2.warnings
    assert all(torch.equal(p, perturbed_weight(w)) for w, p in seen.values()) and len(seen) == LAYERS * 7


@pytest.mark.parametrize("gains", [
    "not an object", {"model.layers.0.self_attn": "1.0"}, {"model.layers.0.self_attn": True},
    {"model.layers.0.self_attn": -1.0}, {"model.layers.0.self_attn": 0}, {"model.layers.0.self_attn": 1e300},
    {"model.layers.0.self_attn": 1e-300}, {"model.layers.0.self_attn": float("nan")}, {},
])
def test_stored_gains_outside_the_rule_are_refused_with_the_file_named(tmp_path, gains):
    """A measurement.json's gains are read only when every block has a number in [GAIN_MIN, GAIN_MAX]: anything
    else (a string, a bool, zero or negative, an overflowing factor, NaN, a missing block) is MEASUREMENT_INVALID
    naming the file, never a traceback or a plan built on it."""
    from exl2fmt.errors import ErrorCode, Exl2Error
    from exl2fmt.quant.qparams import GAINS_KEY, read_measurement_gains

    p = tmp_path / "measurement.json"
    p.write_text(json.dumps({"measurement": {}, "last_module_idx": 3, GAINS_KEY: gains}))
    with pytest.raises(Exl2Error) as e:
        read_measurement_gains(p, ["model.layers.0.self_attn"])
    assert e.value.code == ErrorCode.MEASUREMENT_INVALID and str(p) in str(e.value), str(e.value)
    p.write_text(json.dumps({"measurement": {}, "last_module_idx": 3}))
    assert read_measurement_gains(p, ["model.layers.0.self_attn"]) is None       # ExLlamaV2's files: none
    p.write_text(json.dumps({"measurement": {}, "last_module_idx": 3, GAINS_KEY: {"model.layers.0.self_attn": 2.5}}))
    assert read_measurement_gains(p, ["model.layers.0.self_attn"]) == {"model.layers.0.self_attn": 2.5}


def test_a_damaged_gain_candidate_is_named_not_a_traceback(tmp_path):
    """The gain candidates live in the job's own work directory; one whose shape is not its layer's (a damaged or
    foreign file) stops the run with CHECKPOINT_INVALID naming the file and the tensor."""
    from exl2fmt.errors import ErrorCode, Exl2Error
    from exl2fmt.quant.common import model_blocks
    from exl2fmt.quant.sensitivity import candidate_perturbation, gain_candidates_path, save_gain_candidates
    from exl2fmt.runner.model import HFModel

    d = _tiny_gemma3(tmp_path / "g3")
    spec = HFModel.open(d)
    try:
        root = tmp_path / "work"
        root.mkdir()
        blocks = list(model_blocks(spec))
        for i, kind in blocks[1:]:
            save_gain_candidates(root, spec.block_key(i, kind), {"x": np.zeros((2, 2), np.float16)})
        assert candidate_perturbation(spec, root) is None            # a block's file missing: none at hand
        i, kind = blocks[0]
        name = spec.linear_names(kind, i)[0]
        save_gain_candidates(root, spec.block_key(i, kind), {name: np.zeros((3, 5), np.float16)})
        perturb = candidate_perturbation(spec, root)
        w = torch.zeros(spec.linear_shape(name))
        with pytest.raises(Exl2Error) as e:
            perturb(i, name, w)
        assert e.value.code == ErrorCode.CHECKPOINT_INVALID
        assert str(gain_candidates_path(root, spec.block_key(i, kind))) in str(e.value), str(e.value)
    finally:
        spec.close()
