"""exl2fmt.quant.evaluate: perplexity / KL / top-1 agreement of a test model against its reference, and the
held-out evaluation ids; plus a sanity check that the trained fixture model has learnt its text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exl2fmt.quant import evaluate as ev  # noqa: E402
from exl2fmt.runner.model import HFModel  # noqa: E402
from exl2fmt.runner.weights import WeightSource, dense_linear  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-llama"
CFG = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=97, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tiny():
    shapes = HFModel(CFG, WeightSource({})).expected_tensors()      # an empty source: tied head, no lm_head
    shapes["lm_head.weight"] = (CFG["vocab_size"], CFG["hidden_size"])
    g = torch.Generator().manual_seed(0)
    w = {k: (torch.rand(s, generator=g) + 0.5 if len(s) == 1 else torch.randn(s, generator=g) * 0.2)
         for k, s in sorted(shapes.items())}
    ids = torch.randint(0, CFG["vocab_size"], (5, 16), generator=torch.Generator().manual_seed(1))
    return HFModel(CFG, WeightSource(w)), w, ids


def test_reference_against_itself(tiny):
    ref, w, ids = tiny
    r = ev.perplexity_kl(ref, WeightSource(dict(w)), ids, batch_rows=2)
    assert r["kl_mean"] == 0.0 and r["top1_agree"] == 1.0 and r["max_logit_diff"] == 0.0
    assert r["ppl_test"] == r["ppl_ref"] and r["tokens"] == 5 * 15


def test_perturbed_copy_against_independent_formulas(tiny):
    ref_model, w, ids = tiny
    V = CFG["vocab_size"]
    key = "model.layers.1.mlp.down_proj.weight"
    noisy = dict(w)
    noisy[key] = w[key] + 0.05 * torch.randn(w[key].shape, generator=torch.Generator().manual_seed(2))
    r = ev.perplexity_kl(ref_model, WeightSource(noisy), ids, batch_rows=2)

    # the same numbers from the full logits at once, through different torch functions
    ref = ref_model.forward(ids)[:, :-1].reshape(-1, V).double()
    test = HFModel(CFG, WeightSource(noisy)).forward(ids)[:, :-1].reshape(-1, V).double()
    tgt = ids[:, 1:].reshape(-1)
    assert math.isclose(r["ppl_ref"], math.exp(torch.nn.functional.cross_entropy(ref, tgt).item()), rel_tol=1e-9)
    assert math.isclose(r["ppl_test"], math.exp(torch.nn.functional.cross_entropy(test, tgt).item()), rel_tol=1e-9)
    kl = torch.nn.functional.kl_div(test.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert r["kl_mean"] > 0 and math.isclose(r["kl_mean"], kl, rel_tol=1e-6)
    assert r["top1_agree"] == (ref.argmax(-1) == test.argmax(-1)).double().mean().item()
    assert math.isclose(r["max_logit_diff"], (ref - test).abs().max().item(), rel_tol=1e-6)

    # the same perturbation given as a substitute linear of the reference gives the same result
    sub = dense_linear(noisy[key])
    r2 = ev.perplexity_kl(ref_model, lambda k: sub if k == "model.layers.1.mlp.down_proj" else None, ids)
    for m in ("ppl_ref", "ppl_test", "kl_mean", "top1_agree", "max_logit_diff"):
        assert math.isclose(r[m], r2[m], rel_tol=1e-9, abs_tol=1e-12), m

    # a larger perturbation is worse (KL grows), several tests share one reference run
    worse = dict(noisy)
    worse[key] = w[key] + 0.5 * (noisy[key] - w[key]) * 10
    many = ev.compare_many(ref_model, {"small": WeightSource(noisy), "large": WeightSource(worse)}, ids)
    assert many["small"]["kl_mean"] == pytest.approx(r["kl_mean"], rel=1e-9)
    assert many["large"]["kl_mean"] > many["small"]["kl_mean"]


@pytest.mark.skipif(not (FIXTURE / "model.safetensors").exists(), reason="fixture model not built")
def test_fixture_learnt_its_text():
    """The trained fixture predicts held-out text far better than a unigram model of the training text (the
    baseline a model that learnt nothing but token frequencies would reach)."""
    from exl2fmt.quant.calib import corpus_documents, load_tokenizer, tokenize_stream

    ids = ev.eval_ids(FIXTURE / "tokenizer.json", 8, 256)
    assert ids.shape == (8, 256) and torch.equal(ids, ev.eval_ids(FIXTURE, 8, 256))
    eng = HFModel.open(FIXTURE)
    with torch.no_grad():
        logits = eng.forward(ids)
    eng.close()
    V = eng.vocab_size
    tgt = ids[:, 1:].reshape(-1)
    ppl = math.exp(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tgt).item())

    train = tokenize_stream(load_tokenizer(FIXTURE), corpus_documents("train"))
    counts = np.bincount(np.asarray(train), minlength=V) + 1.0
    unigram_ppl = math.exp(-np.log(counts / counts.sum())[tgt.numpy()].mean())
    assert ppl < 0.5 * unigram_ppl, (ppl, unigram_ppl)
    log = json.loads((FIXTURE / "train_log.json").read_text())
    assert log["final"]["eval_ppl"] < 0.5 * log["final"]["unigram_eval_ppl"]


def test_eval_ids_errors(tmp_path):
    from exl2fmt.errors import ErrorCode, Exl2Error

    with pytest.raises(Exl2Error) as ei:
        ev.eval_ids(tmp_path, 2, 8)
    assert ei.value.code is ErrorCode.PATH_NOT_FOUND
    if (FIXTURE / "tokenizer.json").exists():
        with pytest.raises(Exl2Error) as ei:
            ev.eval_ids(FIXTURE / "tokenizer.json", 10_000, 1024)
        assert ei.value.code is ErrorCode.CALIBRATION_INVALID and "are needed" in ei.value.message
