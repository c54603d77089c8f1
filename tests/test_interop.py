"""Files that the peers' own code reads as their own (issue 16): ExLlamaV2's ``measurement.json``, the
``quantization_config`` keys of EXL2 and GPTQ models, GPTQ's group-aware input order.

Oracles: the cost of every candidate setting recomputed from ``layout.exl2_total_bits`` (the accounting the
inspector uses); dominance checked by brute force over the input rows; ExLlamaV2 0.3.2's module list (embedding,
two modules per decoder layer, norm, head) for ``last_module_idx``; AutoGPTQ's own ``BaseQuantizeConfig`` fields
read from its source (when installed); for the group-aware GPTQ order, the natural-order GPTQ of the layer with
its input features permuted beforehand (the same algorithm through the other code path).  The peers themselves
(ExLlamaV2's optimizer, GPTQModel's loader) run in ``bench/peers.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.layout import Tier, exl2_total_bits, pad32  # noqa: E402
from exl2fmt.quant import qparams as QP  # noqa: E402
from exl2fmt.quant.gptq import group_aware_order, prepare, quantize_gptq  # noqa: E402
from exl2fmt.converters import validate_quantized_output  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("interop") / "src"
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(d, safe_serialization=True)
    ids = d.parent / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(0, 256, (4, 32)))
    return d, ids


def _opts(ids, **kw):
    from exl2fmt.quant.options import QuantOptions

    base = dict(target="exl2", bits=5.0, calibration=str(ids), rows=4, length=32, device="cpu")
    base.update(kw)
    return QuantOptions(**base)


@pytest.fixture(scope="module")
def exl2_out(tiny, tmp_path_factory):
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    out = tmp_path_factory.mktemp("exl2") / "q"
    saved = out.parent / "saved.json"
    quantize_model(src, out, _opts(ids, save_measurement=str(saved)), verify_output=validate_quantized_output)
    return out, saved


# ------------------------------------------------------------------------------------------------ measurement.json


def _cost(qp: QP.QParams, K: int, N: int) -> int:
    return exl2_total_bits(K, pad32(N), [Tier(p, b, g) for p, b, g in qp.tiers])


def test_pareto_rows_are_ascending_and_drop_exactly_the_dominated_rows():
    rng = random.Random(0)
    opts = QP.block_options("mlp", extended=True)
    for trial in range(200):
        rows = [(opts[rng.randrange(len(opts))], rng.randrange(1, 30), rng.choice([0.5, 0.6, 0.7, 0.8, 0.9]))
                for _ in range(rng.randrange(1, 12))]
        kept = QP.pareto_rows(rows)
        costs, accs = [c for _, c, _ in kept], [a for _, _, a in kept]
        assert costs == sorted(set(costs)) and accs == sorted(set(accs)), trial      # strictly ascending both

        def beaten(r):
            return any(o[1] <= r[1] and o[2] >= r[2] and (o[1] < r[1] or o[2] > r[2]) for o in rows)

        assert not any(beaten(r) for r in kept), trial
        assert sorted((c, a) for _, c, a in kept) == sorted({(r[1], r[2]) for r in rows if not beaten(r)}), trial


def test_written_measurement_has_exllamav2s_order_counts_and_costs(tiny, exl2_out):
    from exl2fmt.runner.model import HFModel

    src, _ = tiny
    out, saved = exl2_out
    spec = HFModel.open(src)
    spec.close()
    doc = json.loads((out / "measurement.json").read_text())     # always written next to the model
    assert json.loads(saved.read_text()) == doc                   # --save-measurement writes the same file
    L = spec.num_layers
    assert doc["last_module_idx"] == 1 + 2 * L + 2 - 1            # embedding, attn+mlp per layer, norm, head
    assert sorted(doc["measurement"]) == sorted(f"model.layers.{i}.{k}" for i in range(L)
                                                for k in ("self_attn", "mlp"))
    for key, rows in doc["measurement"].items():
        kind = "attn" if key.endswith("self_attn") else "mlp"
        cands = QP.block_options(kind, extended=True)
        bits = [r["total_bits"] for r in rows]
        acc = [r["accuracy"] for r in rows]
        assert bits == sorted(set(bits)) and acc == sorted(set(acc)), key     # every step up buys accuracy
        assert len(rows) >= 4
        for r in rows:
            names = QP.ATTN_LAYERS if kind == "attn" else QP.MLP_LAYERS
            opt = QP.Option(tuple((n, QP.QParams.from_json(r[n])) for n in names))
            assert opt in cands
            assert r["total_bits"] == sum(_cost(opt.get(n), spec.linear_shape(n)[1], spec.linear_shape(n)[0])
                                          for n in names)


def test_a_measurement_in_any_option_order_gives_the_same_model(tiny, exl2_out, tmp_path):
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    out, _ = exl2_out
    doc = json.loads((out / "measurement.json").read_text())
    rng = random.Random(3)
    for rows in doc["measurement"].values():
        rng.shuffle(rows)                       # ExLlamaV2 writes its table's order, which is not by cost
    doc["measurement"]["model.norm.norm"] = None        # and null entries for the modules it does not measure
    p = tmp_path / "shuffled.json"
    p.write_text(json.dumps(doc))
    quantize_model(src, tmp_path / "b", _opts(ids, measurement=str(p)), verify_output=validate_quantized_output)
    for f in ("output.safetensors", "measurement.json"):
        assert (tmp_path / "b" / f).read_bytes() == (out / f).read_bytes(), f


def test_a_measurement_of_another_model_is_refused_up_front(tiny, exl2_out, tmp_path):
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    out, _ = exl2_out
    doc = json.loads((out / "measurement.json").read_text())
    more = json.loads(json.dumps(doc))
    more["measurement"]["model.layers.2.self_attn"] = more["measurement"]["model.layers.0.self_attn"]
    wider = json.loads(json.dumps(doc))
    for r in wider["measurement"]["model.layers.1.mlp"]:
        r["total_bits"] = int(r["total_bits"] * 1.3)            # an MLP 30% wider
    for bad, what in ((more, "3 decoder layers"), (wider, "other layer shapes")):
        p = tmp_path / "m.json"
        p.write_text(json.dumps(bad))
        with pytest.raises(Exl2Error) as e:
            quantize_model(src, tmp_path / "x", _opts(ids, measurement=str(p)), verify_output=validate_quantized_output)
        assert e.value.code is ErrorCode.MEASUREMENT_MODEL_MISMATCH and what in e.value.message
        assert e.value.code.category.value == "usage"
        assert not (tmp_path / "x").exists()


def test_exl2_quantization_config_keeps_exllamav2s_keys(exl2_out):
    from exl2fmt.arch import EXLLAMAV2_VERSION
    from exl2fmt.inspect import inspect_model

    out, _ = exl2_out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # ExLlamaV2 0.3.2 (conversion/compile.py) writes exactly these, "version" being its own version number
    assert qc["quant_method"] == "exl2" and qc["version"] == EXLLAMAV2_VERSION == "0.3.2"
    assert qc["bits"] == 5.0 and qc["head_bits"] == 6
    assert set(qc["calibration"]) == {"rows", "length", "dataset"}
    assert qc["producer"]["name"] == "exl2fmt"
    prod = inspect_model(out, layers=False)["producer"]
    assert prod["name"] == "exl2fmt" and prod["source"] == "quantization_config.producer"


# ------------------------------------------------------------------------------------------------ GPTQ


def _autogptq_fields() -> set[str] | None:
    """The fields of AutoGPTQ's BaseQuantizeConfig, read from its source (importing it needs transformers 4)."""
    spec = importlib.util.find_spec("auto_gptq")
    if spec is None or not spec.submodule_search_locations:
        return None
    src = Path(next(iter(spec.submodule_search_locations))) / "modeling" / "_base.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "BaseQuantizeConfig")
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}


@pytest.mark.parametrize("kw", [dict(), dict(sym=False, order="group"), dict(order="act")])
def test_gptq_config_fields_as_gptqmodel_writes_them(tiny, tmp_path, kw):
    from exl2fmt.container import open_model
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    quantize_model(src, tmp_path / "g", _opts(ids, target="gptq", bits=4, group_size=32, **kw),
                   verify_output=validate_quantized_output)
    qc = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    sym, act = kw.get("sym", True), kw.get("order") == "act"
    order = kw.get("order", "static")
    assert {k: qc[k] for k in ("bits", "group_size", "desc_act", "sym", "lm_head", "method", "quant_method",
                               "format", "checkpoint_format", "pack_dtype")} == {
        "bits": 4, "group_size": 32, "desc_act": act, "sym": sym, "lm_head": False, "method": "gptq",
        "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32"}
    meta = qc["meta"]
    assert meta["damp_percent"] == 0.01 and meta["static_groups"] is False and meta["true_sequential"] is True
    assert meta["act_group_aware"] is (order == "group") and meta["exl2fmt_order"] == order
    assert meta["quantizer"][0].startswith("exl2fmt:")
    # GPTQModel loads an asymmetric v1 model only when meta.quantizer names gptqmodel >= 0.9.0
    gm = [q.split(":")[1] for q in meta["quantizer"] if q.split(":")[0] == "gptqmodel"]
    assert gm and tuple(int(x) for x in gm[0].split(".")) >= (0, 9, 0)
    side = json.loads((tmp_path / "g" / "quantize_config.json").read_text())
    known = _autogptq_fields()
    if known is not None:     # AutoGPTQ reads this file first and warns about keys it does not know
        assert set(side) - known == (set() if sym else {"meta"}), set(side) - known
    assert {k: side[k] for k in ("bits", "group_size", "desc_act", "sym")} == {k: qc[k] for k in
                                                                                ("bits", "group_size", "desc_act", "sym")}
    assert sym or side["meta"]["quantizer"] == meta["quantizer"]
    m = open_model(tmp_path / "g")
    try:
        g = np.asarray(m.get("model.layers.0.mlp.down_proj.g_idx"))
        K = g.shape[0]
        if act:
            assert not np.all(np.diff(g) >= 0) and np.bincount(g).tolist() == [32] * (K // 32)
            assert K == 128
        else:                 # static, group-aware: the g_idx of no reordering at all
            assert np.array_equal(g, np.arange(K) // 32)
    finally:
        m.close()


def test_group_aware_order_ranks_groups_by_their_top_feature():
    d = torch.tensor([1.0, 5, 2, 3, 9, 0, 4, 4, 1, 7])
    assert group_aware_order(d, 3).tolist() == [4, 3, 5, 9, 1, 2, 0, 6, 7, 8]
    rng = np.random.default_rng(0)
    for K, gs in ((256, 32), (512, 128), (128, 128)):
        d = rng.random(K)
        p = group_aware_order(torch.from_numpy(d), gs).numpy()
        assert sorted(p.tolist()) == list(range(K))
        chunks = [p[a:a + gs] for a in range(0, K, gs)]
        for c in chunks:                                   # each processed run is one whole feature group,
            assert len(set(c // gs)) == 1 and np.all(np.diff(d[c]) <= 0)      # important features first
        tops = [d[c].max() for c in chunks]
        assert tops == sorted(tops, reverse=True)          # the group with the most important feature first


@pytest.mark.parametrize("sym", [True, False])
def test_group_aware_gptq_is_natural_gptq_of_the_permuted_layer(sym):
    """Group-aware GPTQ of W == natural-order GPTQ of W with its input features permuted by the same order,
    codes moved back and each group's scales filed under the feature group it covers."""
    rng = np.random.default_rng(5)
    K, N, gs = 256, 64, 64
    X = rng.standard_normal((1024, K)).astype(np.float32) * rng.gamma(0.5, 2.0, K).astype(np.float32)
    H = torch.from_numpy(X.T @ X / 1024)
    W = torch.from_numpy(rng.standard_normal((N, K)).astype(np.float32))
    prep = prepare(H, percdamp=0.01, act_order=True, within_groups=gs)
    perm = prep.perm
    assert prep.within_groups == gs and not torch.equal(perm, torch.arange(K))
    r = quantize_gptq(W, prep, 4, gs, sym=sym)
    ref_prep = prepare(H[perm][:, perm], percdamp=0.01, act_order=False)
    ref = quantize_gptq(W[:, perm], ref_prep, 4, gs, sym=sym)
    p = perm.numpy()
    assert np.array_equal(r.codes[p], ref.codes)
    assert np.array_equal(r.g_idx, np.arange(K) // gs)
    gid = p[::gs] // gs                          # processing group j covers feature group gid[j]
    assert np.array_equal(r.scales[gid], ref.scales) and np.array_equal(r.zeros[gid], ref.zeros)
    assert torch.equal(r.weight_hat[:, perm], ref.weight_hat)
    with pytest.raises(Exl2Error) as e:
        quantize_gptq(W, prep, 4, 32)
    assert e.value.code is ErrorCode.USAGE


def test_order_options():
    from exl2fmt.quant.options import QuantOptions

    def order(**kw):
        return QuantOptions(device="cpu", **kw).resolved().order

    assert order(target="exl2") == "act" and order(target="gptq") == "static"
    assert order(target="gptq", act_order=True) == "act" and order(target="gptq", act_order=False) == "natural"
    assert order(target="exl2", act_order=False) == "natural"
    for bad in (dict(target="exl2", order="group"), dict(target="exl2", order="static"),
                dict(target="gptq", order="act", act_order=False),
                dict(target="gptq", order="sideways")):
        with pytest.raises(Exl2Error) as e:
            order(**bad)
        assert e.value.code is ErrorCode.USAGE


def _textbook_fixed_groups(W, H, gs, bits, sym, damp):
    """GPTQ as first published (float64, explicit inverse-Hessian downdates, no Cholesky, no lazy blocks), rows
    in full act-order, groups of ``gs`` consecutive input features, each group fitted (best fp16 scale,
    ``fit_group``) on the current values of its rows when its first row comes up."""
    from exl2fmt.codec.gptq_fit import fit_group

    K = W.shape[1]
    perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    Wt = W.double().T.clone()[perm]
    Hinv = torch.linalg.inv(H.double()[perm][:, perm] + damp * torch.eye(K, dtype=torch.float64))
    Q = torch.empty_like(Wt)
    fitted = {}
    maxq = (1 << bits) - 1
    for c in range(K):
        g = int(perm[c]) // gs
        if g not in fitted:
            rows = [j for j in range(K) if int(perm[j]) // gs == g]
            _, s, z = fit_group(Wt[rows].float().numpy(), bits, sym)
            fitted[g] = (torch.from_numpy(s.astype(np.float64)), torch.from_numpy(z.astype(np.float64)))
        s, z = fitted[g]
        q = torch.clamp(torch.round(Wt[c] / torch.where(s > 0, s, 1)) + z, 0, maxq)
        Q[c] = ((q - z) * s).half().double()
        e = (Wt[c] - Q[c]) / Hinv[c, c]
        Wt[c + 1:] -= Hinv[c, c + 1:, None] * e[None, :]
        Hinv = Hinv - torch.outer(Hinv[:, c], Hinv[c, :]) / Hinv[c, c]
    out = torch.empty_like(Q)
    out[perm] = Q
    return out.T.float()


@pytest.mark.parametrize("sym", [True, False])
def test_static_order_matches_the_textbook_algorithm_and_keeps_g_idx_monotone(sym):
    from exl2fmt.quant.gptq import proxy_error

    rng = np.random.default_rng(7)
    K, N, gs = 320, 64, 64                       # 320 rows: the sweep's blocks of 128 cut through groups
    X = rng.standard_normal((1024, K)).astype(np.float32) * rng.gamma(0.5, 2.0, K).astype(np.float32)
    H = torch.from_numpy(X.T @ X / 1024)
    W = torch.from_numpy(rng.standard_normal((N, K)).astype(np.float32))
    prep = prepare(H, percdamp=0.01, act_order=True, fixed_groups=gs)
    assert prep.fixed_groups == gs and torch.equal(prep.perm, torch.argsort(torch.diag(H), descending=True,
                                                                             stable=True))
    r = quantize_gptq(W, prep, 4, gs, sym=sym)
    assert np.array_equal(r.g_idx, np.arange(K) // gs)
    ref = _textbook_fixed_groups(W, H, gs, 4, sym, prep.damp)
    same = float((r.weight_hat == ref).float().mean())
    assert same > 0.98, same                     # float32 vs float64 flips only rounding ties
    e_ours, e_ref = proxy_error(W, r.weight_hat, H), proxy_error(W, ref, H)
    assert abs(e_ours - e_ref) < 0.02 * e_ref
    # the codes and group scales it stores decode to that reconstruction
    deq = (r.codes.astype(np.float32) - r.zeros[r.g_idx]) * r.scales[r.g_idx].astype(np.float32)
    assert np.array_equal(deq.astype(np.float16).T, r.weight_hat.numpy().astype(np.float16))
