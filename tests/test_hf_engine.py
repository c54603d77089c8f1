"""The quantizer's transformers-driven engine (exl2fmt.runner.model) against transformers as the oracle.

Per architecture (tests/tiny_models.py): the engine's layer-by-layer forward over the saved shards gives the
logits of transformers' own full model loaded with ``from_pretrained``; the inputs the engine captures for the
linears are exactly what transformers' modules receive; the attention half's output is the residual stream in
front of the MLP's norm; and the calibrated quantizer produces output that validates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import DENSE, OTHER, make_tiny  # noqa: E402

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.runner.weights import WeightSource  # noqa: E402
from exl2fmt.runner.model import HFModel  # noqa: E402
from exl2fmt.converters import validate_quantized_output  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_tiny(arch, tmp_path_factory.mktemp(arch) / "src")
        return made[arch]
    return get


def _engine(d):
    return HFModel(json.loads((d / "config.json").read_text()), WeightSource(d))


def _reference(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _embedded(d, seed: int, rows: int, T: int):
    """The engine of model ``d`` and the embeddings of seeded random ids int64 [rows, T]."""
    eng = _engine(d)
    ids = torch.as_tensor(np.random.default_rng(seed).integers(0, 160, (rows, T)))
    return eng, eng.embed(ids)


@pytest.mark.parametrize("arch", DENSE + OTHER)
def test_layerwise_forward_equals_transformers_full_model(tiny, arch):
    d = tiny(arch)
    ids = torch.as_tensor(np.random.default_rng(1).integers(0, 160, (2, 24)))
    with torch.no_grad():
        want = _reference(d)(ids).logits
    eng = _engine(d)
    eng.check_weights()
    got = eng.forward(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a substitute linear is used where given (here: the dense weight scaled by 0: output changes)
    key = eng.linear_key(1, eng.linear_names("mlp")[-1])
    zero = eng.forward(ids, lambda k: (lambda x: torch.zeros(*x.shape[:-1], eng.hidden_size)) if k == key else None)
    assert not torch.allclose(zero, got)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "cohere", "starcoder2", "phi3"])
def test_captured_inputs_and_half_outputs_are_what_transformers_computes(tiny, arch):
    """Oracle: forward hooks on transformers' full model (layer 1's modules)."""
    d = tiny(arch)
    ids = torch.as_tensor(np.random.default_rng(2).integers(0, 160, (2, 16)))
    ref = _reference(d)
    layer = ref.model.layers[1]
    seen: dict = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("h", (a[0] if a else kw["hidden_states"])),
                                             with_kwargs=True),
             layer.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0] if isinstance(o, tuple) else o))]
    eng = _engine(d)
    for n, path in eng.path_of.items():
        hooks.append(layer.get_submodule(path).register_forward_pre_hook(
            lambda m, a, _n=n: seen.__setitem__(_n, a[0])))
    mid = eng.structure.mid_norm
    if mid is not None:
        hooks.append(layer.get_submodule(mid).register_forward_pre_hook(lambda m, a: seen.__setitem__("mid", a[0])))
    with torch.no_grad():
        ref(ids)
    for hk in hooks:
        hk.remove()
    h0 = eng.embed(ids)
    h1 = eng.runner(0).forward(h0)
    torch.testing.assert_close(h1, seen["h"], rtol=1e-5, atol=1e-6)
    r = eng.runner(1)
    cap: dict = {}
    rec: list = []
    half = r.forward(seen["h"], capture=cap, stop_mid=True, record_attn=rec)
    torch.testing.assert_close(half, seen["mid"] if mid is not None else seen["out"], rtol=1e-5, atol=1e-6)
    out = r.forward(seen["h"], capture=cap, replay_attn=rec[0])     # the MLP half replays the attention result
    torch.testing.assert_close(out, seen["out"], rtol=1e-5, atol=1e-6)
    assert set(cap) == set(eng.path_of)
    for n in eng.path_of:
        torch.testing.assert_close(cap[n], seen[n], rtol=1e-5, atol=1e-6)
    # linears that read one tensor share a Hessian; the groups run in forward order
    groups = eng.groups("attn") + eng.groups("mlp")
    assert [n for g in groups for n in g] == [n for k in ("attn", "mlp") for n in eng.linear_names(k)]
    for g in groups:
        assert all(cap[n] is cap[g[0]] for n in g)
    eng.release()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_a_sweep_stopped_at_a_later_groups_input_gathers_the_same_hessian(tiny, arch):
    """The quantize pass's sweeps for a block's later groups stop once the group's input is captured: the
    Hessian must be the full sweep's, bit for bit; such a sweep returns None and refuses a stop it cannot
    honour (a linear outside the block's dense ones, or one whose Hessian it does not collect)."""
    from exl2fmt.quant.gptq import HessianAccumulator
    from exl2fmt.quant.common import row_batches

    eng, h = _embedded(tiny(arch), 3, 3, 16)
    for kind in ("attn", "mlp"):
        blk = eng.block(0, kind, row_batches(3, 16, 32))
        if kind == "attn":
            blk.sweep(h, None, record=True)
        owner = eng.groups(kind)[-1][0]
        K = blk.weights()[owner][0].shape[1]
        full, stopped = HessianAccumulator(K), HessianAccumulator(K)
        assert blk.sweep(h, None, {owner: full}) is not None
        assert blk.sweep(h, None, {owner: stopped}, stop_at=owner) is None
        assert torch.equal(full.result(), stopped.result())
        with pytest.raises(ValueError):
            blk.sweep(h, None, {owner: HessianAccumulator(K)}, stop_at="no_such_linear")
        with pytest.raises(ValueError):
            blk.sweep(h, None, None, stop_at=owner)
    eng.release()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "cohere", "starcoder2", "phi3"])
def test_a_block_finished_from_its_kept_tail_is_the_full_sweep_bit_for_bit(tiny, arch):
    """The quantize pass makes a block's quantized output from the inputs its last sweep kept for the last linear
    (o_proj, down_proj) instead of running the block again.  Oracle: the full sweep with the same substitute
    linears (the dense ones scaled, standing in for quantized ones): the same output and the same recorded
    attention result (the MLP half replays it), bit for bit, and the same Hessian as a sweep that stops at the
    linear.  A module that changes its last linear's output (here a hook doubling it) cannot be rebuilt: nothing
    is kept and finish() runs the block, honouring the change."""
    from exl2fmt.quant.gptq import HessianAccumulator
    from exl2fmt.quant.common import row_batches
    from exl2fmt.runner.weights import dense_linear

    eng, h = _embedded(tiny(arch), 4, 3, 16)
    for kind in ("attn", "mlp"):
        blk = eng.block(0, kind, row_batches(3, 16, 32))
        W = blk.weights()
        subs = {n: dense_linear(w * (1 + 2 ** -4 * (j + 1)), b) for j, (n, (w, b)) in enumerate(W.items())}
        want = blk.sweep(h, subs, record=True)
        want_rec = blk.runner.attn_cache
        owner = eng.groups(kind)[-1][0]
        K = W[owner][0].shape[1]
        stopped, tailed = HessianAccumulator(K), HessianAccumulator(K)
        blk.sweep(h, subs, {owner: stopped}, stop_at=owner)
        if kind == "mlp":
            blk.runner.attn_cache = want_rec
        assert blk.sweep(h, subs, {owner: tailed}, tail=owner) is None
        assert blk.tail is not None and len(blk.tail.inputs) == len(blk.batches)
        assert torch.equal(stopped.result(), tailed.result())
        got = blk.finish(h, subs)
        assert blk.tail is None
        assert torch.equal(got, want)
        if kind == "attn":
            assert all(torch.equal(a[0] if isinstance(a, tuple) else a, b[0] if isinstance(b, tuple) else b)
                       for a, b in zip(blk.runner.attn_cache, want_rec))
        # a module whose result is not its last linear's output as it came: the full sweep instead
        hk = blk.runner.module(owner).register_forward_hook(lambda m, a, o: o * 2)
        try:
            doubled = blk.sweep(h, subs, record=True)
            assert not torch.equal(doubled, want)
            blk.sweep(h, subs, {owner: HessianAccumulator(K)}, tail=owner)
            assert blk.tail is None
            assert torch.equal(blk.finish(h, subs), doubled)
        finally:
            hk.remove()
        blk.sweep(h, subs, record=True)
        with pytest.raises(ValueError):
            blk.sweep(h, None, {owner: HessianAccumulator(K)}, tail="no_such_linear")
        with pytest.raises(ValueError):
            blk.sweep(h, None, {owner: HessianAccumulator(K)}, tail=owner, stop_at=owner)
    eng.release()


@pytest.mark.parametrize("arch", ["llama", "cohere", "phi3"])
def test_the_mlp_half_runs_without_the_attention_weights_and_a_full_forward_reloads_them(tiny, arch):
    """drop_attention frees the attention module's float32 parameters for the MLP half (which replays the
    recorded attention result): its sweep is bit-identical without them, they are really gone (meta), and a
    forward that runs attention again loads them back and matches the forward before the drop."""
    from exl2fmt.quant.common import row_batches

    eng, h = _embedded(tiny(arch), 5, 2, 16)
    attn = eng.block(0, "attn", row_batches(2, 16, 16))
    attn.sweep(h, None, record=True)
    mlp = eng.block(0, "mlp", row_batches(2, 16, 16))
    want = mlp.sweep(h, None)
    whole = mlp.advance_reference(h)
    child = mlp.runner.layer.get_submodule(eng.structure.attn_child)
    mlp.drop_attention()
    assert mlp.runner.attn_dropped and all(p.is_meta for p in child.parameters())
    assert torch.equal(mlp.sweep(h, None), want)
    assert all(p.is_meta for p in child.parameters())
    assert torch.equal(mlp.advance_reference(h), whole)     # runs attention: reloaded
    assert not mlp.runner.attn_dropped and not any(p.is_meta for p in child.parameters())
    eng.release()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_quantized_linears_original_weight_can_be_freed(tiny, arch):
    """drop_linear frees a linear's float32 weight once every later forward substitutes it (the quantize pass with
    the FP16 trajectory handed over): sweeps with substitutes are bit-identical without it, the parameter is meta,
    and rows of a fused module (phi3's qkv_proj / gate_up_proj) are kept."""
    from exl2fmt.quant.common import row_batches
    from exl2fmt.runner.weights import dense_linear

    eng, h = _embedded(tiny(arch), 6, 2, 16)
    blk = eng.block(0, "attn", row_batches(2, 16, 16))
    W = blk.weights()
    subs = {n: dense_linear(w.clone(), b) for n, (w, b) in W.items()}
    want = blk.sweep(h, subs, record=True)
    dropped = [n for n in blk.names if blk.drop_linear(n)]
    assert dropped == [n for n in blk.names if n not in eng.part_of]
    for n in dropped:
        assert blk.runner.module(n).weight.is_meta
    for n in set(blk.names) - set(dropped):
        assert not blk.runner.module(n).weight.is_meta
    assert torch.equal(blk.sweep(h, subs, record=True), want)
    eng.release()


def test_parallel_block_has_no_mid_point_and_sequential_ones_do(tiny):
    assert _engine(tiny("cohere")).structure.mid_norm is None
    assert _engine(tiny("gemma2")).structure.mid_norm == "pre_feedforward_layernorm"
    assert _engine(tiny("llama")).structure.mid_norm == "post_attention_layernorm"
    assert _engine(tiny("starcoder2")).linear_names("mlp") == ("up_proj", "down_proj")
    assert _engine(tiny("starcoder2")).linear_key(0, "up_proj") == "model.layers.0.mlp.c_fc"


def test_unknown_or_unsupported_architectures_are_arch_unsupported(tiny, tmp_path):
    d = tiny("llama")
    cfg = json.loads((d / "config.json").read_text())
    for mtype in ("no-such-model", "t5"):
        with pytest.raises(Exl2Error) as e:
            HFModel(dict(cfg, model_type=mtype), WeightSource(d))
        assert e.value.code is ErrorCode.ARCH_UNSUPPORTED
    # a missing or misshapen tensor is named before any compute
    eng = HFModel(dict(cfg, intermediate_size=128), WeightSource(d))
    with pytest.raises(Exl2Error) as e:
        eng.check_weights()
    assert e.value.code is ErrorCode.CONFIG_MISMATCH and e.value.tensor.endswith("gate_proj.weight")


@pytest.mark.parametrize("arch", ["cohere"] + [pytest.param(a, marks=pytest.mark.slow)
                                               for a in ("gemma2", "starcoder2", "granite", "phi3")])
def test_calibrated_gptq_on_other_architectures_validates(tiny, tmp_path, arch):
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.validate import validate_model

    d = tiny(arch)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    r = quantize_model(d, tmp_path / "q", QuantOptions(target="gptq", bits=4, group_size=32, calibration=str(ids),
                                                       rows=4, length=32, device="cpu"),
                       verify_output=validate_quantized_output)
    assert not any("weight-only" in w for w in r.warnings), r.warnings
    n_lin = len(_engine(d).source_keys(0)) * 2            # GPTQ keeps fused projections fused
    assert len(r.layers) == n_lin and r.calibration_ppl is not None
    assert r.calibration_ppl < 1.5 * r.calibration_ppl_fp16
    rep = validate_model(tmp_path / "q", deep=True)
    assert not rep.failed, [c for c in rep.as_dict()["checks"] if c["status"] == "FAIL"]


@pytest.mark.parametrize("arch", sorted(__import__("tiny_models").ARCHS))
def test_validate_passes_every_architectures_fp16_model(tiny, arch):
    """A CI gate never fails a valid model: shapes are checked against the right config key per architecture
    (Qwen3-MoE experts against moe_intermediate_size, Phi-3's fused qkv/gate_up, Starcoder2's c_fc/c_proj)."""
    from exl2fmt.validate import validate_model

    rep = validate_model(tiny(arch), deep=True)
    assert not rep.failed and rep.counts().get("warn", 0) == 0, rep.as_dict()


def test_validate_still_catches_a_wrong_expert_width(tiny, tmp_path):
    from exl2fmt.validate import validate_model

    d = tiny("qwen3_moe")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=64)))
    rep = validate_model(bad)
    fails = [c for c in rep.as_dict()["checks"] if c["status"] == "FAIL"]
    assert rep.failed and any("moe_intermediate_size" in json.dumps(c) for c in fails), fails


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["starcoder2", "olmo2", "phi3"])
def test_calibrated_exl2_on_other_architectures_round_trips_its_measurement(tiny, tmp_path, arch):
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.validate import validate_model

    d = tiny(arch)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    m = tmp_path / "m.json"
    opts = dict(target="exl2", bits=4.0, calibration=str(ids), rows=4, length=32, device="cpu")
    r = quantize_model(d, tmp_path / "a", QuantOptions(**opts, save_measurement=str(m)),
                       verify_output=validate_quantized_output)
    assert 3.98 <= r.decoder_bpw <= 4.0 and not any("weight-only" in w for w in r.warnings)
    assert any("ExLlamaV2 may not load" in w for w in r.warnings) == (arch == "olmo2")
    assert not validate_model(tmp_path / "a", deep=True).failed
    quantize_model(d, tmp_path / "b", QuantOptions(**opts, measurement=str(m)), verify_output=validate_quantized_output)
    for f in ("output.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    if arch == "phi3":          # fused projections are written split, as ExLlamaV2 stores them; no fp16 copy left
        from exl2fmt.container import open_model

        m = open_model(tmp_path / "a")
        names = set(m.names())
        m.close()
        assert {"model.layers.0.self_attn.k_proj.q_weight", "model.layers.1.mlp.gate_proj.q_weight"} <= names
        assert not [n for n in names if "qkv_proj" in n or "gate_up_proj" in n]


@pytest.mark.parametrize("arch", ["phi3", "qwen3_moe"])
def test_bf16_scoring_of_fused_and_routed_linears_measures_what_fp32_does(tiny, tmp_path, arch, monkeypatch):
    """Scoring from the reference tape (forced onto these tiny blocks) on fused projections (Phi-3's qkv_proj,
    gate_up_proj: each part is its own taped linear) and on a MoE block, whose routed experts are not taped
    (they see only their tokens) and are scored in fp32 beside the taped linears: every option's error within
    0.3 % of itself of the fp32 measurement's."""
    from conftest import force_delta_scoring

    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    d = tiny(arch)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    made = force_delta_scoring(monkeypatch)
    got = {}
    for p in ("fp32", "bf16"):
        m = tmp_path / f"{p}.json"
        quantize_model(d, tmp_path / p, QuantOptions(target="exl2", bits=6.0, calibration=str(ids), rows=4,
                                                     length=32, device="cpu", measure_precision=p,
                                                     save_measurement=str(m)), verify_output=validate_quantized_output)
        got[p] = json.loads(m.read_text())["measurement"]
    assert made and not [n for n in made if "experts." in n]
    assert {"q_proj", "k_proj", "v_proj", "gate_proj" if arch == "phi3" else "o_proj"} <= set(made)
    rel = [abs(a["accuracy"] - b["accuracy"]) / (1 - a["accuracy"])
           for k in got["fp32"] for a, b in zip(got["fp32"][k], got["bf16"][k], strict=True)]
    assert 0 < max(rel) < 3e-3
