"""Issue 41, class 8: ``validate`` on mixture-of-experts configs that transformers cannot load.

Tiny Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints (``tiny_hf.make_tiny``: 2 MoE blocks of 4 experts, top-2;
Qwen2-MoE with a shared expert) get a config.json whose expert count says 0, 3, 5 or 4096 (the tensors say 4), a
second expert-count key that disagrees (transformers maps ``num_experts`` onto ``num_local_experts``, so either may
win), ``num_experts_per_tok`` 0 or 99, or a shared-expert width of 0 while the tensors hold one.  Each runs as
``exl2fmt validate --json`` in a fresh process under ``hostile_harness.run_bounded``: exit 1, a FAIL of the
``config`` check with the stated code whose message names the key and the rule, file config.json; the unmodified
models PASS.

Independent oracle: transformers itself.  For every mutated config small enough to build, the model is loaded
with ``from_pretrained`` and run on three tokens: a case FAILs in validate exactly when transformers reports
missing / unexpected / mismatched weights or raises (a router with more rows than experts, top-k beyond the
experts); the unmodified models load cleanly and run.  Top-k 0 is the one case transformers runs: no token
reaches an expert then (doubling every expert weight leaves the logits unchanged), so validate fails it by rule.

The rules on cases no tiny HF model can hold (a block missing an expert in the middle, stacked 3-D expert
tensors, DeepSeek's ``n_shared_experts``, a router with no expert tensors) are checked on ``moe_issues`` directly.
Catalogue: spec/malformed/hostile3_moe/README.md (built at test time).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hostile_harness import run_bounded

from exl2fmt.validate.config_checks import moe_issues

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_hf import make_tiny

    root = tmp_path_factory.mktemp("moe")
    return {a: make_tiny(a, root / a, tokenizer=None) for a in ARCHS}


def _count_key(cfg: dict) -> str:
    return next(k for k in ("num_local_experts", "num_experts") if k in cfg)


#: (case id, how to change the config, expected code or None for PASS, words the message must hold)
def _cases(arch: str, cfg: dict):
    k = _count_key(cfg)
    alias = "num_experts" if k == "num_local_experts" else "num_local_experts"
    out = [("as-made", {}, None, ()),
           ("experts-0", {k: 0}, "CONFIG_VALUE_INVALID", (k, "at least 1")),
           ("experts-3", {k: 3}, "CONFIG_MISMATCH", (k, "= 3", "hold 4 experts")),
           ("experts-5", {k: 5}, "CONFIG_MISMATCH", (k, "= 5", "hold 4 experts")),
           ("experts-4096", {k: 4096}, "CONFIG_MISMATCH", (k, "= 4096", "hold 4 experts")),
           # transformers 5 lets Mixtral's alias num_experts override num_local_experts, Qwen3-MoE's not (a warning
           # there: another version may read it); Qwen2-MoE's config has no num_local_experts: ignored by both
           ("alias-disagrees", {alias: 8}, "CONFIG_MISMATCH" if arch == "mixtral" else None,
            (alias, "= 8", "hold 4 experts") if arch == "mixtral" else ()),
           ("topk-0", {"num_experts_per_tok": 0}, "CONFIG_VALUE_INVALID", ("num_experts_per_tok", "at least 1")),
           ("topk-99", {"num_experts_per_tok": 99}, "CONFIG_VALUE_INVALID",
            ("num_experts_per_tok = 99", f"{k} = 4", "top-k <= experts")),
           ("topk-4", {"num_experts_per_tok": 4}, None, ())]
    if arch == "qwen2_moe":
        out.append(("shared-0", {"shared_expert_intermediate_size": 0}, "CONFIG_MISMATCH",
                    ("shared_expert_intermediate_size = 0", "shared_expert tensors")))
    return out


def _variant(src: Path, dst: Path, change: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _transformers_runs(d: Path) -> bool:
    """Whether transformers loads ``d`` with every weight in place and runs it on three tokens."""
    import torch
    import transformers

    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                         output_loading_info=True)
        if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
            return False
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    except Exception:  # noqa: BLE001 - any refusal of transformers is the oracle's "cannot load"
        return False
    return True


def _experts_unused(d: Path) -> bool:
    """Whether the model's logits stay the same when every expert weight is doubled (no token reaches one)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        a = model(ids).logits.clone()
        n = 0
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(2.0)
                n += 1
        b = model(ids).logits
    return n > 0 and torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_config_cases_through_the_cli(tiny, tmp_path, arch):
    src = tiny[arch]
    cfg = json.loads((src / "config.json").read_text())
    for case, change, code, words in _cases(arch, cfg):
        d = _variant(src, tmp_path / case, change)
        r = run_bounded("validate", d, "--json", timeout=60)
        r.check_bounds() if r.wall_s < 10 else None
        assert not r.timed_out and not r.traceback, (case, r.stderr[-3000:])
        doc = json.loads(r.stdout)
        fails = [c for c in doc["checks"] if c["status"] == "FAIL"]
        if code is None:
            assert r.rc == 0 and not fails, (case, fails)
            warns = [c for c in doc["checks"] if c["status"] == "WARN"]
            if case == "alias-disagrees" and arch == "qwen3_moe":
                assert any(c["code"] == "CONFIG_MISMATCH" and "num_experts = 8 disagrees with num_local_experts = 4"
                           in c["message"] for c in warns), warns
            continue
        assert r.rc == 1, (case, r.stdout[-2000:])
        hits = [c for c in fails if c["code"] == code and c["check"] == "config"
                and all(w in c["message"] for w in words)]
        assert hits, (case, fails)
        assert all(Path(c["file"]).name == "config.json" for c in hits), hits


@pytest.mark.parametrize("arch", ARCHS)
def test_validate_fails_exactly_when_transformers_cannot_run_the_model(tiny, tmp_path, arch):
    from exl2fmt.validate import validate_model

    src = tiny[arch]
    cfg = json.loads((src / "config.json").read_text())
    for case, change, code, _ in _cases(arch, cfg):
        if case == "experts-4096":        # 4096 experts would be built in full: validate-only (above)
            continue
        d = _variant(src, tmp_path / case, change)
        passed = validate_model(d).counts()["fail"] == 0
        assert passed == (code is None), (arch, case)
        if case == "topk-0":    # transformers loads and runs it, but no token reaches an expert: dead weights
            assert _experts_unused(d), arch
            continue
        assert passed == _transformers_runs(d), (arch, case, passed)


# ------------------------------------------------------------------------------------------------ unit rules


def _t(*shape):
    return SimpleNamespace(shape=shape)


def _moe(blocks=2, experts=4, *, skip=(), prefix="model.layers.{}.mlp", leaves=("gate_proj", "up_proj", "down_proj"),
         router=True, shared=None):
    t = {}
    for b in range(blocks):
        p = prefix.format(b)
        for e in range(experts):
            if (b, e) in skip:
                continue
            for leaf in leaves:
                t[f"{p}.experts.{e}.{leaf}.weight"] = _t(8, 8)
        if router:
            t[f"{p}.gate.weight"] = _t(experts, 8)
        if shared:
            t[f"{p}.{shared}.gate_proj.weight"] = _t(8, 8)
    return t


def _codes(issues):
    return [(i.code.value, i.message) for i in issues]


def test_a_missing_expert_in_the_middle_is_named():
    issues, _ = moe_issues({"num_experts": 4, "num_experts_per_tok": 2}, _moe(skip={(1, 2)}), "config.json")
    got = _codes(issues)
    assert any(c == "CONFIG_MISMATCH" and "model.layers.1.mlp lacks the tensors of expert(s) 2" in m for c, m in got)


def test_stacked_expert_tensors_count_their_first_dimension():
    t = {f"model.layers.{b}.mlp.experts.gate_up_proj": _t(4, 16, 8) for b in range(2)}
    t.update({f"model.layers.{b}.mlp.experts.down_proj": _t(4, 8, 8) for b in range(2)})
    assert moe_issues({"num_experts": 4, "num_experts_per_tok": 2}, t, "config.json")[0] == []
    got = _codes(moe_issues({"num_experts": 6, "num_experts_per_tok": 2}, t, "config.json")[0])
    assert got and got[0][0] == "CONFIG_MISMATCH" and "hold 4 experts" in got[0][1]


def test_deepseek_shared_experts_follow_n_shared_experts():
    cfg = {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}
    assert moe_issues(cfg, _moe(shared="shared_experts"), "config.json")[0] == []
    got = _codes(moe_issues(cfg, _moe(), "config.json")[0])
    assert got == [("CONFIG_MISMATCH", got[0][1])] and "n_shared_experts = 1" in got[0][1]
    got = _codes(moe_issues({**cfg, "n_shared_experts": 0}, _moe(shared="shared_experts"), "config.json")[0])
    assert len(got) == 1 and "says there is no shared expert" in got[0][1]
    # Mixtral carrying an unused n_shared_experts key is not asked for shared experts
    mix = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2}
    assert moe_issues(mix, _moe(prefix="model.layers.{}.block_sparse_moe", leaves=("w1", "w2", "w3")),
                      "config.json")[0] == []


def test_a_router_without_expert_tensors_and_a_missing_count_key():
    t = {f"model.layers.{b}.mlp.gate.weight": _t(4, 8) for b in range(2)}
    got = _codes(moe_issues({"num_experts": 4}, t, "config.json")[0])
    assert len(got) == 1 and "no tensor is an expert's" in got[0][1]
    got = _codes(moe_issues({"num_experts_per_tok": 2}, _moe(), "config.json")[0])
    assert len(got) == 1 and "has none of num_local_experts, num_experts, n_routed_experts" in got[0][1]
    # a dense model whose config carries MoE keys is not a MoE model
    assert moe_issues({"num_experts": 0, "num_experts_per_tok": 0}, {"model.layers.0.mlp.up_proj.weight": _t(8, 8)},
                      "config.json")[0] == []


def test_work_is_bounded_by_the_tensor_count_not_by_an_index():
    """An expert index of 10**9 (a name in the file) costs no more than any other name."""
    import time

    t = _moe()
    t["model.layers.0.mlp.experts.999999999.up_proj.weight"] = _t(8, 8)
    t0 = time.perf_counter()
    got = _codes(moe_issues({"num_experts": 4, "num_experts_per_tok": 2}, t, "config.json")[0])
    assert time.perf_counter() - t0 < 1.0
    assert any("hold 1000000000 experts" in m for _, m in got) and any("lacks the tensors of expert(s) 4" in m
                                                                         for _, m in got)
