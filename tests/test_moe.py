"""Mixture-of-experts blocks in the quantizer's transformers-driven engine (exl2fmt.runner.moe, exl2fmt.runner.model).

Oracles: transformers' own full model (``from_pretrained``, which merges the per-expert checkpoint tensors with
its conversion mapping), forward hooks on its experts module (the routing its router computed), and NumPy for
the few-tokens Hessian rule.  End-to-end conversions are slow and run with ``-m slow`` (bench/arch_quality.py
has the KL comparison against round-to-nearest).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import MOE, MOE_EXTRA, make_tiny  # noqa: E402

from exl2fmt.runner.weights import WeightSource  # noqa: E402
from exl2fmt.runner.model import HFModel  # noqa: E402
from exl2fmt.converters import validate_quantized_output  # noqa: E402

#: (checkpoint block, gate leaf, up leaf, down leaf) as the two families store experts
CKPT = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict = {}

    def get(arch, starved=None):
        if (arch, starved) not in made:
            base, kw = MOE_EXTRA.get(arch, (arch, {}))
            made[arch, starved] = make_tiny(base, tmp_path_factory.mktemp(arch) / "src", starved_expert=starved, **kw)
        return made[arch, starved]
    return get


def _engine(d):
    return HFModel(json.loads((d / "config.json").read_text()), WeightSource(d))


def _reference(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _engine_equals_transformers(d):
    """(ids int64 [2, 24], transformers' logits on them, transformers' model, the engine) of ``d``, after checking that the engine's layer-by-layer logits equal
    the full model's on fixed ids."""
    ids = torch.as_tensor(np.random.default_rng(1).integers(0, 160, (2, 24)))
    ref = _reference(d)
    with torch.no_grad():
        want = ref(ids).logits
    eng = _engine(d)
    eng.check_weights()
    torch.testing.assert_close(eng.forward(ids), want, rtol=1e-5, atol=1e-5)
    return ids, want, ref, eng


@pytest.mark.parametrize("arch", MOE)
def test_moe_layerwise_forward_equals_transformers_and_names_follow_the_checkpoint(tiny, arch):
    d = tiny(arch)
    ids, want, ref, eng = _engine_equals_transformers(d)
    blk, g, u, dn = CKPT[arch]
    E = ref.config.num_local_experts if arch == "mixtral" else ref.config.num_experts
    assert eng.linear_names("mlp") == tuple(f"experts.{e}.{r}" for e in range(E)
                                            for r in ("gate_proj", "up_proj", "down_proj"))
    assert eng.linear_key(1, "experts.2.gate_proj") == f"model.layers.1.{blk}.experts.2.{g}"
    assert eng.linear_key(1, "experts.2.up_proj") == f"model.layers.1.{blk}.experts.2.{u}"
    assert eng.linear_key(1, "experts.2.down_proj") == f"model.layers.1.{blk}.experts.2.{dn}"
    assert eng.block_key(1, "mlp") == "model.layers.1.block_sparse_moe"      # ExLlamaV2's key, any MoE model
    assert not any(k.endswith(".gate") for k in eng.source_keys(0))           # the router is not quantized
    # the fused parameters the engine builds from per-expert tensors are what transformers' loader builds
    r = eng.runner(1)
    mine = dict(r.layer.named_parameters())
    for n, p in ref.model.layers[1].named_parameters():
        torch.testing.assert_close(mine[n], p, rtol=0, atol=0)
    # one expert's linear substituted changes the output; a substitute equal to the dense weight does not
    w = {n: wb[0] for n, wb in r.weights().items()}
    key = eng.linear_key(1, "experts.1.down_proj")
    same = eng.forward(ids, lambda k: (lambda x: x @ w["experts.1.down_proj"].T) if k == key else None)
    torch.testing.assert_close(same, want, rtol=1e-5, atol=1e-5)
    zero = eng.forward(ids, lambda k: (lambda x: torch.zeros(*x.shape[:-1], eng.hidden_size)) if k == key else None)
    assert not torch.allclose(zero, want, atol=1e-4)


@pytest.mark.parametrize("arch", MOE)
def test_expert_inputs_are_exactly_the_tokens_the_router_sends(tiny, arch):
    """Oracle: a hook on transformers' experts module of layer 1 (its input and the router's top-k)."""
    d = tiny(arch)
    ids = torch.as_tensor(np.random.default_rng(2).integers(0, 160, (2, 16)))
    ref = _reference(d)
    layer = ref.model.layers[1]
    seen: dict = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("h", a[0] if a else kw["hidden_states"]),
                                             with_kwargs=True),
             layer.mlp.experts.register_forward_pre_hook(lambda m, a: seen.__setitem__("moe", a))]
    with torch.no_grad():
        ref(ids)
    for hk in hooks:
        hk.remove()
    x_all, top_idx, _ = seen["moe"]
    ex = layer.mlp.experts
    eng = _engine(d)
    r = eng.runner(1)
    rec: list = []
    r.forward(seen["h"], stop_mid=True, record_attn=rec)
    cap: dict = {}
    r.forward(seen["h"], capture=cap, replay_attn=rec[0])
    E, I = ex.num_experts, ex.intermediate_dim
    assert r.routed == [[int((top_idx == e).sum()) for e in range(E)]]
    for e in range(E):
        tok = torch.where(top_idx == e)[0]
        x = x_all[tok]
        torch.testing.assert_close(cap[f"experts.{e}.gate_proj"], x, rtol=1e-5, atol=1e-6)
        assert cap[f"experts.{e}.up_proj"] is cap[f"experts.{e}.gate_proj"]     # one Hessian for gate and up
        with torch.no_grad():
            mid = ex.act_fn(x @ ex.gate_up_proj[e, :I].T) * (x @ ex.gate_up_proj[e, I:].T)
        torch.testing.assert_close(cap[f"experts.{e}.down_proj"], mid, rtol=1e-5, atol=1e-6)
    assert eng.groups("mlp")[:2] == [("experts.0.gate_proj", "experts.0.up_proj"), ("experts.0.down_proj",)]
    eng.release()


@pytest.mark.parametrize("name", sorted(MOE_EXTRA))
def test_shared_experts_and_dense_layers_of_moe_models_are_driven(tiny, name):
    """Qwen2-MoE's shared expert (a dense MLP of all tokens behind a 16-bit sigmoid gate) and the dense MLP layers
    of ``mlp_only_layers`` are linears of the engine: logits equal transformers' full model, the shared expert's
    linears read every token of the block, and the gates/routers are not quantized."""
    d = tiny(name)
    cfg = json.loads((d / "config.json").read_text())
    ids, want, ref, eng = _engine_equals_transformers(d)
    dense = set(cfg.get("mlp_only_layers") or ())
    for i in range(eng.num_layers):
        mlp = eng.linear_names("mlp", i)
        assert eng.is_moe(i) is (i not in dense)
        if i in dense:
            assert mlp == ("gate_proj", "up_proj", "down_proj")
            assert eng.block_key(i, "mlp") == f"model.layers.{i}.mlp"
        else:
            assert eng.block_key(i, "mlp") == f"model.layers.{i}.block_sparse_moe"
            shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
            assert mlp[:3] == shared if cfg["model_type"] == "qwen2_moe" else not any("shared" in n for n in mlp)
        keys = eng.source_keys(i)
        assert not any(k.endswith((".gate", "shared_expert_gate")) for k in keys)
        assert (f"model.layers.{i}.mlp.shared_expert.down_proj" in keys) is (
            cfg["model_type"] == "qwen2_moe" and i not in dense)
    # a substitute for a dense layer's down_proj / the shared expert's changes the output
    i = min(dense) if dense else 0
    n = "down_proj" if dense else "shared_expert.down_proj"
    key = eng.linear_key(i, n)
    zero = eng.forward(ids, lambda k: (lambda x: torch.zeros(*x.shape[:-1], eng.hidden_size)) if k == key else None)
    assert not torch.allclose(zero, want, atol=1e-4)
    if cfg["model_type"] == "qwen2_moe" and not dense:        # the shared expert reads all tokens of the block
        r = eng.runner(1)
        cap: dict = {}
        h = torch.randn(2, 8, eng.hidden_size, generator=torch.Generator().manual_seed(0))
        rec: list = []
        r.forward(h, stop_mid=True, record_attn=rec)
        r.forward(h, capture=cap, replay_attn=rec[0])
        assert cap["shared_expert.gate_proj"].shape[:-1] == (16,) and cap["experts.0.gate_proj"].shape[0] < 16
        assert eng.groups("mlp", 1)[:2] == [("shared_expert.gate_proj", "shared_expert.up_proj"),
                                            ("shared_expert.down_proj",)]
    eng.release()


def test_few_token_hessians_are_padded_to_k_tokens_with_the_prior():
    from exl2fmt.quant.gptq import HessianAccumulator
    from exl2fmt.runner.moe import pad_expert_hessian

    rng = np.random.default_rng(0)
    K = 8
    all_x = rng.standard_normal((40, K)).astype(np.float32)
    prior = HessianAccumulator(K)
    prior.add(torch.from_numpy(all_x))
    p_mean = all_x.T.astype(np.float64) @ all_x / 40
    # enough tokens: untouched
    acc = HessianAccumulator(K)
    acc.add(torch.from_numpy(all_x[:K]))
    before = acc.H.clone()
    assert pad_expert_hessian(acc, prior) == 0 and torch.equal(acc.H, before) and acc.rows == K
    # 3 routed tokens, gate/up: (S + 5 * mean all-token second moment) / 8
    x = all_x[:3]
    acc = HessianAccumulator(K)
    acc.add(torch.from_numpy(x))
    assert pad_expert_hessian(acc, prior) == K - 3
    np.testing.assert_allclose(acc.take().numpy(), (x.T.astype(np.float64) @ x + 5 * p_mean) / K, rtol=1e-5,
                               atol=1e-6)
    # 3 routed tokens, down: (S + 5 c I) / 8 with c the routed mean diagonal
    acc = HessianAccumulator(K)
    acc.add(torch.from_numpy(x))
    pad_expert_hessian(acc, None)
    S = x.T.astype(np.float64) @ x
    np.testing.assert_allclose(acc.take().numpy(), (S + 5 * np.trace(S) / (3 * K) * np.eye(K)) / K, rtol=1e-5,
                               atol=1e-6)
    # no routed tokens: the all-token Hessian (gate/up) and the identity (down): finite and positive definite
    acc = HessianAccumulator(K)
    acc.add(torch.zeros(0, K))
    pad_expert_hessian(acc, prior)
    np.testing.assert_allclose(acc.take().numpy(), p_mean, rtol=1e-5, atol=1e-6)
    acc = HessianAccumulator(K)
    pad_expert_hessian(acc, None)
    assert torch.equal(acc.take(), torch.eye(K))


def test_moe_measurement_rows_are_exllamav2s_and_read_back(tiny, tmp_path):
    """measurement.json groups a MoE block as ExLlamaV2 does: key ``...block_sparse_moe``, one setting each for
    w1/w3/w2 (every expert's gate/up/down) and total_bits summed over all experts; our reader takes it, and a
    file measured on other expert shapes is refused."""
    from exl2fmt.errors import ErrorCode, Exl2Error
    from exl2fmt.quant.common import file_option, model_blocks
    from exl2fmt.quant.measure import write_measurement_file
    from exl2fmt.quant.qparams import QParams, block_options, read_measurement

    eng = _engine(tiny("mixtral"))
    opts = {k: block_options(k, extended=True) for k in ("attn", "mlp")}
    measured = {eng.block_key(i, k): [[j, 0, 0.5 + 0.01 * j] for j in range(len(opts[k]))]
                for i, k in model_blocks(eng)}
    path = tmp_path / "measurement.json"
    write_measurement_file(path, eng, measured, lambda k: opts[k])
    doc = json.loads(path.read_text())
    assert sorted(doc["measurement"]) == ["model.layers.0.block_sparse_moe", "model.layers.0.self_attn",
                                          "model.layers.1.block_sparse_moe", "model.layers.1.self_attn"]
    row = doc["measurement"]["model.layers.0.block_sparse_moe"][0]
    assert set(row) == {"accuracy", "total_bits", "w1", "w3", "w2"}
    opt = next(o for o in opts["mlp"] if file_option(eng, "mlp", o).layers == tuple(
        (n, QParams.from_json(row[n])) for n in ("w1", "w3", "w2")))
    want = sum(opt.get(r).total_bits(K, N) for e in range(4) for r, (N, K) in
               (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96))))
    assert row["total_bits"] == want
    names = {eng.block_key(i, k): tuple(f for f, _ in eng.measurement_names(k)) for i, k in model_blocks(eng)}
    moe_shapes = {"w1": [(64, 96, False)] * 4, "w3": [(64, 96, False)] * 4, "w2": [(96, 64, False)] * 4}
    attn_shapes = {n: (*eng.linear_shape(n)[::-1], False) for n in eng.linear_names("attn")}
    got = read_measurement(path, names, shapes={**attn_shapes, **moe_shapes}, num_layers=2)
    assert [acc for _, _, acc in got["model.layers.1.block_sparse_moe"]] == \
        [r["accuracy"] for r in doc["measurement"]["model.layers.1.block_sparse_moe"]]
    with pytest.raises(Exl2Error) as e:      # measured on 8 experts, read for 4 (or other widths)
        read_measurement(path, names, shapes={**attn_shapes, **{k: v * 2 for k, v in moe_shapes.items()}},
                         num_layers=2)
    assert e.value.code is ErrorCode.MEASUREMENT_MODEL_MISMATCH


def _ids(tmp_path, rows=4, length=32):
    p = tmp_path / "ids.npy"
    np.save(p, np.random.default_rng(0).integers(0, 160, (rows, length)))
    return str(p)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE)
def test_calibrated_gptq_moe_with_a_starved_expert_validates(tiny, tmp_path, arch):
    from exl2fmt.container import open_model
    from exl2fmt.formats import layer_from_tensors
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.validate import validate_model

    d = tiny(arch, starved=3)
    r = quantize_model(d, tmp_path / "q", QuantOptions(target="gptq", bits=4, group_size=32,
                                                       calibration=_ids(tmp_path), rows=4, length=32, device="cpu"),
                       verify_output=validate_quantized_output)
    assert not any("weight-only" in w for w in r.warnings), r.warnings
    moe = [b for b in r.blocks if b["block"].endswith("block_sparse_moe")]
    assert len(moe) == 2 and all(len(b["expert_tokens"]) == 4 and b["expert_tokens"][3] == 0 for b in moe)
    assert all(sum(b["expert_tokens"]) == 4 * 32 * 2 for b in moe)          # top-2 of every calibration token
    assert any("expert(s)" in w and "3" in w for w in r.warnings)
    assert any("experts:" in line for line in r.summary_lines())
    assert r.calibration_ppl < 1.5 * r.calibration_ppl_fp16
    assert not validate_model(tmp_path / "q", deep=True).failed
    blk, g, u, dn = CKPT[arch]
    m = open_model(tmp_path / "q")
    src = WeightSource(d)
    try:
        names = set(m.names())
        assert f"model.layers.0.{blk}.gate.weight" in names                   # the router, 16-bit
        for leaf in (g, u, dn):                # the starved expert's weights are valid and near the source's
            key = f"model.layers.1.{blk}.experts.3.{leaf}"
            w = src.get(f"{key}.weight", torch.float32).numpy()
            tensors = {n[len(key) + 1:]: np.array(m.get(n)) for n in names if n.startswith(key + ".")}
            w_hat = layer_from_tensors(key, tensors, out_features=w.shape[0]).dequantize().astype(np.float32)
            assert np.isfinite(w_hat).all() and np.linalg.norm(w_hat - w) / np.linalg.norm(w) < 0.15
    finally:
        m.close()


@pytest.mark.slow
def test_calibrated_exl2_mixtral_meets_the_budget_and_reuses_its_measurement(tiny, tmp_path):
    from exl2fmt.inspect import inspect_model
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.validate import validate_model

    d = tiny("mixtral")
    m = tmp_path / "m.json"
    opts = dict(target="exl2", bits=4.0, calibration=_ids(tmp_path, 2), rows=2, length=32, device="cpu")
    r = quantize_model(d, tmp_path / "a", QuantOptions(**opts, save_measurement=str(m)),
                       verify_output=validate_quantized_output)
    assert 3.98 <= r.decoder_bpw <= 4.0 and not any("ExLlamaV2 may not load" in w for w in r.warnings)
    assert r.decoder_bpw == inspect_model(tmp_path / "a")["summary"]["bpw"]["decoder"]    # 16-bit routers left out
    assert not validate_model(tmp_path / "a", deep=True).failed
    assert "model.layers.1.block_sparse_moe" in json.loads((tmp_path / "a" / "measurement.json").read_text())[
        "measurement"]
    quantize_model(d, tmp_path / "b", QuantOptions(**opts, measurement=str(m)), verify_output=validate_quantized_output)
    for f in ("output.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_calibrated_gptq_of_a_moe_model_with_a_shared_expert_and_a_dense_layer(tiny, tmp_path):
    """Qwen2-MoE with ``mlp_only_layers``: every linear calibrated (GPTQ, not the weight-only fallback), the
    shared expert and the dense layer quantized, the 16-bit gates left alone, the output validates."""
    from exl2fmt.container import open_model
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.validate import validate_model

    d = tiny("qwen2_moe_mlp_only")
    r = quantize_model(d, tmp_path / "q", QuantOptions(target="gptq", bits=4, group_size=32,
                                                       calibration=_ids(tmp_path, 4, 16), rows=4, length=16,
                                                       device="cpu"), verify_output=validate_quantized_output)
    assert not any("weight-only" in w for w in r.warnings), r.warnings
    assert [b["block"] for b in r.blocks if "mlp" in b["block"] or "moe" in b["block"]] == [
        "model.layers.0.mlp", "model.layers.1.block_sparse_moe", "model.layers.2.block_sparse_moe"]
    assert not validate_model(tmp_path / "q", deep=True).failed
    m = open_model(tmp_path / "q")
    try:
        names = set(m.names())
    finally:
        m.close()
    for key in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_expert.down_proj",
                "model.layers.2.mlp.experts.3.up_proj"):
        assert f"{key}.qweight" in names and f"{key}.weight" not in names, key
    for key in ("model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"):
        assert f"{key}.weight" in names and f"{key}.qweight" not in names, key


def test_hessian_chunks_fit_the_budget_and_keep_the_order():
    from exl2fmt.runner.moe import hessian_bytes, hessian_chunks

    owners = ["a", "b", "c", "d", "e"]
    K = {"a": 64, "b": 96, "c": 64, "d": 300, "e": 64}
    assert hessian_chunks(owners, K, budget=10 ** 9) == [owners]            # everything fits: one sweep
    budget = hessian_bytes(96) + hessian_bytes(64)
    chunks = hessian_chunks(owners, K, budget=budget)
    assert [o for c in chunks for o in c] == owners
    assert chunks == [["a", "b"], ["c"], ["d"], ["e"]]                     # d alone exceeds it: its own chunk
    assert all(sum(hessian_bytes(K[o]) for o in c) <= budget for c in chunks if len(c) > 1)


@pytest.mark.slow
def test_exl2_measurement_in_hessian_chunks_is_byte_identical_and_bounded(tiny, tmp_path, monkeypatch):
    """The EXL2 measurement of the tiny Mixtral with a Hessian budget of two down projections: at most that many
    bytes of Hessians are alive at any time (counted at every ``gptq.prepare``: the accumulators still holding
    their sums plus every factor still referenced), against more in one sweep, and the output is byte-identical."""
    import weakref

    from exl2fmt.quant import gptq
    from exl2fmt.runner import moe
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    d = tiny("mixtral")
    opts = dict(target="exl2", bits=4.0, calibration=_ids(tmp_path, 2), rows=2, length=32, device="cpu")
    orig, orig_acc = gptq.prepare, gptq.HessianAccumulator
    peak = {}

    def run(name, budget):
        factors: weakref.WeakSet = weakref.WeakSet()
        sums: weakref.WeakSet = weakref.WeakSet()
        peak[name] = 0

        class Counted(orig_acc):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                sums.add(self)

        def counting(*a, **k):
            p = orig(*a, **k)
            factors.add(p.U)
            held = sum(moe.hessian_bytes(u.shape[0]) for u in factors)
            held += sum(moe.hessian_bytes(acc.K) for acc in sums if acc.H is not None)
            peak[name] = max(peak[name], held)
            return p
        monkeypatch.setattr(gptq, "prepare", counting)
        monkeypatch.setattr(gptq, "HessianAccumulator", Counted)
        monkeypatch.setattr(moe, "LIVE_HESSIAN_BYTES", budget)
        quantize_model(d, tmp_path / name, QuantOptions(**opts), verify_output=validate_quantized_output)
        return (tmp_path / name / "output.safetensors").read_bytes()

    budget = 2 * moe.hessian_bytes(96)            # expert width 96: two down projections' Hessians
    whole = run("whole", moe.LIVE_HESSIAN_BYTES)
    chunked = run("chunked", budget)
    assert chunked == whole
    assert peak["chunked"] <= budget < peak["whole"]
