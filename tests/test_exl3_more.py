"""EXL3 beyond the basics (issue 39): ``validate --reference`` against an FP16 source, ``hf://`` inspection and
validation of an EXL3 branch, and layer names outside the plain decoder (MoE experts, Phi-3's fused projections,
multi-token-prediction and vision linears).

The EXL3 models come from the test-side encoder of ``test_exl3`` (``make_exl3``: random trellis symbols, so a
layer's weight is what the oracle ``exl3_oracle`` decodes, not an approximation of its source).  The reference
errors are therefore large and known: every number ``validate --reference`` reports is recomputed here from the
oracle's weights and the source's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_exl3 import TINY, _cli, _convert_and_compare, _one_layer, make_exl3, oracle_weight

# ------------------------------------------------------------------------------------------------ --reference


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    d = tmp_path_factory.mktemp("x3more") / "llama"
    return d, make_exl3(TINY, d, seed=139)


def _dense(model_dir: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _rel_fro(w: np.ndarray, ref: np.ndarray) -> float:
    w64, r64 = w.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(w64 - r64) / np.linalg.norm(r64))


def _threshold(rate) -> float:
    from exl2fmt.validate import REFERENCE_THRESHOLDS

    keys = sorted(REFERENCE_THRESHOLDS)
    return REFERENCE_THRESHOLDS[max([k for k in keys if k <= rate] or [keys[0]])]


def test_reference_reports_each_layers_error(llama3):
    """Random codes approximate the fixture's weights badly: every layer fails with the error the oracle's weights
    give against the fixture's own, against the threshold of its rate."""
    d, plan = llama3
    code, out = _cli("validate", d, "--reference", TINY, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["deep"] is True and doc["reference"] == str(TINY)
    src = _dense(TINY)
    rows = {r["key"]: r for r in doc["layers"]}
    assert set(rows) == set(plan)
    fails = {c["tensor"]: c for c in doc["checks"] if c["status"] == "FAIL"}
    assert {c["code"] for c in fails.values()} == {"REFERENCE_MISMATCH"} and set(fails) == set(plan)
    for key, (rate, _, K, N) in plan.items():
        ref = src[f"{key}.weight"].astype(np.float32)
        want = _rel_fro(oracle_weight(d, key, K, N), ref)
        m = rows[key]["reference"]
        assert rows[key]["shape"] == [N, K]
        assert m["rel_fro"] == pytest.approx(want, rel=1e-5), key
        assert m["threshold"] == pytest.approx(_threshold(rate)) and m["bits"] == {f"{rate:g}": 1.0}
        assert m["rel_fro"] > 1.0  # random codes: worse than the zero matrix
        assert f"{m['rel_fro']:.4f}" in fails[key]["message"]


def test_reference_passes_a_close_source_and_names_the_one_layer_over(llama3, tmp_path):
    """A source that is the oracle's weights (one layer disturbed past its threshold): every other layer passes."""
    from safetensors.numpy import save_file

    d, plan = llama3
    src = _dense(TINY)
    bad_key = "model.layers.2.mlp.up_proj"
    for key, (rate, _, K, N) in plan.items():
        w = oracle_weight(d, key, K, N).astype(np.float32)
        if key == bad_key:  # a relative error of 1.5 x the threshold
            noise = np.random.default_rng(0).standard_normal(w.shape).astype(np.float32)
            w = w + noise * (1.5 * _threshold(rate) * np.linalg.norm(w) / np.linalg.norm(noise))
        src[f"{key}.weight"] = w.astype(np.float16)
    ref = tmp_path / "ref"
    shutil.copytree(TINY, ref)
    save_file(src, str(ref / "model.safetensors"))
    code, out = _cli("validate", d, "--reference", ref, "--json")
    doc = json.loads(out)
    fails = [c for c in doc["checks"] if c["status"] == "FAIL"]
    assert code == 1 and [(c["code"], c["tensor"]) for c in fails] == [("REFERENCE_MISMATCH", bad_key)]
    ok = [c for c in doc["checks"] if c["code"] == "REFERENCE_OK"]
    assert len(ok) == 1 and ok[0]["count"] == len(plan) - 1
    rows = {r["key"]: r["reference"] for r in doc["layers"]}
    rate, _, K, N = plan[bad_key]
    want = _rel_fro(oracle_weight(d, bad_key, K, N), src[f"{bad_key}.weight"].astype(np.float32))
    assert rows[bad_key]["rel_fro"] == pytest.approx(want, rel=1e-5) and want > _threshold(rate)
    assert all(r["rel_fro"] < 1e-3 for k, r in rows.items() if k != bad_key)


def test_reference_with_other_shapes_fails(tmp_path):
    """An EXL3 down_proj of 300 -> 200 against the fixture's 768 -> 256: not comparable, REFERENCE_MISMATCH."""
    d = _one_layer(tmp_path / "m")
    code, out = _cli("validate", d, "--reference", TINY, "--json")
    doc = json.loads(out)
    fails = [c for c in doc["checks"] if c["status"] == "FAIL"]
    assert code == 1 and [c["code"] for c in fails] == ["REFERENCE_MISMATCH"]
    assert "[256, 768]" in fails[0]["message"] and "[200, 300]" in fails[0]["message"]


# ------------------------------------------------------------------------------------------------ hf://


@pytest.fixture(scope="module")
def hub3(tmp_path_factory, llama3):
    pytest.importorskip("huggingface_hub")
    from safetensors.numpy import save_file

    import exl3_oracle as R

    root = tmp_path_factory.mktemp("hub3")
    d, _ = llama3
    shutil.copytree(d, root / "org/m-exl3/4.0bpw")  # EXL3 publishers: one branch per bitrate
    (root / "org/m-exl3/main").mkdir(parents=True)
    (root / "org/m-exl3/main/README.md").write_text("card")
    bad = root / "org/m-exl3/badmarker"
    shutil.copytree(d, bad)
    t = _dense(bad)
    key = next(n for n, a in t.items() if n.endswith(".mcg"))
    assert t[key] == np.array(R.MCG_MARKER, np.int32)
    t[key] = np.array(12345, np.int32)
    save_file(t, str(bad / "model.safetensors"))
    shutil.copytree(TINY, root / "org/src-fp16/main", ignore=shutil.ignore_patterns("tokenizer*", "*.md"))
    return root, key


@pytest.fixture()
def emu3(hub3, monkeypatch, tmp_path):
    from hub_server import HubEmulator

    with HubEmulator(hub3[0]) as e:
        monkeypatch.setenv("HF_ENDPOINT", e.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("EXL2FMT_HUB_TIMEOUT", "10")
        yield e


def test_inspect_hub_exl3_is_the_local_report(emu3, hub3, llama3):
    from exl2fmt.container import read_header
    from exl2fmt.hub import inspect_hub
    from exl2fmt.inspect import inspect_model

    root, _ = hub3
    local = root / "org/m-exl3/4.0bpw"
    uri = "hf://org/m-exl3@4.0bpw"
    rep = inspect_hub(uri)
    want = inspect_model(local)
    strip = lambda r: json.loads(json.dumps({k: v for k, v in r.items() if k not in ("hub", "path")})  # noqa: E731
                                 .replace(str(local), uri))
    assert strip(rep) == strip(want)
    assert rep["format"]["name"] == "exl3" and rep["format"]["variant"]["head_bits"] == 6
    rows = {r["key"]: r for r in rep["layers"]}
    _, plan = llama3
    for key, (rate, cb, K, N) in plan.items():
        assert (rows[key]["codebook"], rows[key]["plan"]) == (cb, f"{rate:g}b trellis {cb}")
        assert (rows[key]["in_features"], rows[key]["out_features"]) == (K, N) and rows[key]["bpw"] > rate
    # ranged reads only: the header and the 4-byte codebook markers, never a trellis
    h = read_header(local / "model.safetensors")
    markers = [t for t in h.tensors.values() if t.name.endswith((".mcg", ".mul1"))]
    assert markers and emu3.bytes_served["cdn"] == 8 + h.header_len + 4 * len(markers)
    assert all(r["range"] for r in emu3.requests if r["server"] == "cdn")


def test_validate_hub_exl3_matches_local(emu3, hub3):
    from exl2fmt.validate import validate_model
    from exl2fmt.validate.remote import validate_hub

    root, bad_key = hub3
    doc, code = validate_hub("hf://org/m-exl3@4.0bpw")
    want = validate_model(root / "org/m-exl3/4.0bpw").as_dict()
    assert code == 0 == want["exit_code"]
    assert [(c["check"], c["status"], c["code"]) for c in doc["checks"]] == \
        [(c["check"], c["status"], c["code"]) for c in want["checks"]]
    assert any("tensor_storage" in c["message"] for c in doc["checks"])  # quantization_config.json was read
    # the markers are read, not holes: a wrong one fails on the Hub as on disk
    doc, code = validate_hub("hf://org/m-exl3@badmarker")
    fails = [c for c in doc["checks"] if c["status"] == "FAIL"]
    assert code == 1 and [c["code"] for c in fails] == ["EXL3_MARKER"] and "0x00003039" in fails[0]["message"]
    assert fails[0]["tensor"] == bad_key
    r_code, out = _cli("validate", "hf://org/m-exl3@4.0bpw", "--deep")
    assert r_code == 2
    r_code, out = _cli("inspect", "hf://org/m-exl3", "--revision", "4.0bpw", "--json")
    assert r_code == 0 and json.loads(out)["format"]["name"] == "exl3"


def test_reference_on_the_hub_exl3(emu3, llama3, tmp_path):
    d, _ = llama3
    code, out = _cli("validate", d, "--reference", "hf://org/src-fp16", "--json")
    doc = json.loads(out)
    ref = [c for c in doc["checks"] if c["check"] == "reference"]
    assert code == 0 and [c["code"] for c in ref] == ["REFERENCE_OK"] and ref[0]["count"] > 29
    other = _one_layer(tmp_path / "m")
    code, out = _cli("validate", other, "--reference", "hf://org/src-fp16", "--json")
    bad = [c for c in json.loads(out)["checks"] if c["status"] == "FAIL"]
    assert code == 1 and bad and all(c["code"] == "REFERENCE_MISMATCH" for c in bad)
    assert any("model.layers.0.mlp.down_proj" == c.get("tensor") and "200 x 300" in c["message"] for c in bad)


# ------------------------------------------------------------------------------------------------ names

_ROUTER = lambda key: key.endswith((".mlp.gate", ".block_sparse_moe.gate"))  # noqa: E731  exllamav3 keeps them F16


def _extra_linears(src: Path) -> None:
    """Add to a tiny qwen2 (hidden 64, 2 layers) what multimodal / MTP checkpoints hold: a SigLIP vision tower
    (vision_config: hidden 96, intermediate 200, 4 heads), a Qwen3-Next-style ``mtp.*`` module and a DeepSeek-style
    MTP block ``model.layers.2`` (num_nextn_predict_layers = 1) with its ``eh_proj``."""
    from safetensors.numpy import save_file

    t = _dense(src)
    rng = np.random.default_rng(0)
    v = "vision_tower.vision_model.encoder.layers.0"
    extra = {f"{v}.self_attn.q_proj": (96, 96), f"{v}.self_attn.out_proj": (96, 96), f"{v}.mlp.fc1": (200, 96),
             f"{v}.mlp.fc2": (96, 200), "mtp.layers.0.self_attn.q_proj": (64, 64), "mtp.layers.0.mlp.down_proj":
             (64, 128), "mtp.fc": (64, 128), "model.layers.2.eh_proj": (64, 128),
             "model.layers.2.mlp.up_proj": (128, 64)}
    for n, s in extra.items():
        t[f"{n}.weight"] = (0.05 * rng.standard_normal(s)).astype(np.float16)
    save_file(t, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"] = {"hidden_size": 96, "intermediate_size": 200, "num_attention_heads": 4}
    cfg["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_hf import make_tiny

    base = tmp_path_factory.mktemp("x3names")
    out = {}
    for i, arch in enumerate(("mixtral", "qwen3_moe", "phi3", "qwen2")):
        src = make_tiny(arch, base / f"{arch}-fp16", tokenizer=None)
        if arch == "qwen2":
            _extra_linears(src)
        out[arch] = (base / arch, make_exl3(src, base / arch, seed=300 + i, keep_dense=_ROUTER), src)
    return out


_EXPECT = {"mixtral": ".block_sparse_moe.experts.3.w2", "qwen3_moe": ".mlp.experts.3.down_proj",
           "phi3": ".self_attn.qkv_proj", "qwen2": "mtp.fc"}


@pytest.mark.parametrize("arch", sorted(_EXPECT))
def test_named_layers_detect_inspect_validate_convert(named, arch, tmp_path):
    from safetensors.numpy import load_file

    from exl2fmt import inspect_model

    d, plan, src = named[arch]
    assert any(k.endswith(_EXPECT[arch]) for k in plan)
    rep = inspect_model(d)
    assert rep["format"]["name"] == "exl3" and rep["issues"] == []
    rows = {r["key"]: r for r in rep["layers"]}
    assert set(plan) <= set(rows)
    for key, (rate, cb, K, N) in plan.items():  # the true sizes, not the padded ones (in 96 / 200 pad to 128 / 256)
        assert (rows[key]["in_features"], rows[key]["out_features"], rows[key]["codebook"]) == (K, N, cb), key
    code, out = _cli("validate", d, "--deep", "--json")
    doc = json.loads(out)
    # (the loader note, HF_NEEDS_IMPORT, says quant_method exl3 needs import exl2fmt.hf in transformers)
    assert code == 0 and [c for c in doc["checks"] if c["status"] != "PASS" and c["check"] != "loader"] == [], \
        doc["checks"]
    code, text = _cli("convert", d, tmp_path / "fp16", "--to", "fp16")
    assert code == 0, text
    w = load_file(str(tmp_path / "fp16" / "model.safetensors"))
    for key, (_, _, K, N) in plan.items():
        assert np.array_equal(w[f"{key}.weight"].view(np.uint16), oracle_weight(d, key, K, N).view(np.uint16)), key
    routers = [n for n in _dense(src) if _ROUTER(n.rsplit(".", 1)[0])]
    assert all(np.array_equal(w[n], _dense(src)[n]) for n in routers) and (arch not in ("mixtral", "qwen3_moe")
                                                                            or routers)


def test_named_vision_hints_come_from_vision_config():
    from exl2fmt.arch import expected_features

    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
           "num_nextn_predict_layers": 1, "vision_config": {"hidden_size": 1152, "intermediate_size": 4304,
                                                            "num_attention_heads": 16}}
    v = "vision_tower.vision_model.encoder.layers.3"
    assert expected_features(cfg, f"{v}.mlp.fc1") == (1152, 4304)
    assert expected_features(cfg, f"{v}.self_attn.q_proj") == (1152, 1152)
    assert expected_features(cfg, "visual.blocks.0.mlp.down_proj") == (4304, 1152)
    assert expected_features(cfg, "model.layers.2.eh_proj") == (128, 64)
    assert expected_features(cfg, "model.layers.1.eh_proj") == (None, None)
    assert expected_features(cfg, "model.layers.1.self_attn.q_proj") == (64, 64)
    assert expected_features({k: v for k, v in cfg.items() if k != "vision_config"}, f"{v}.mlp.fc1") == (None, None)


def test_phi3_fused_fp16_convert_loads_with_the_oracle_weights(named, tmp_path):
    d, plan, _ = named["phi3"]
    assert {k.split(".")[-1] for k in plan} >= {"qkv_proj", "gate_up_proj"}
    _convert_and_compare(d, plan, tmp_path)


def _qc_edit(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _warnings(d: Path) -> list[dict]:
    code, out = _cli("validate", d, "--json")
    doc = json.loads(out)
    assert code == 0, doc
    return [c for c in doc["checks"] if c["status"] == "WARN" and c["check"] != "loader"]


def test_vision_and_mtp_rates_against_quantization_config(named, tmp_path):
    """X17: every EXL3 vision linear at exactly vision_bits, every MTP linear at least mtp_bits (exllamav3's
    allocation); the good copy passes both checks, each broken config gets one BITS_MISMATCH warning naming it."""
    from exl2fmt.names import is_mtp, is_vision

    d, plan, _ = named["qwen2"]
    assert _warnings(d) == []
    code, out = _cli("validate", d, "--json")
    oks = [c["message"] for c in json.loads(out)["checks"] if c["code"] == "BITS_OK"]
    n_vis = sum(is_vision(k) for k in plan)
    n_mtp = sum(is_mtp(k, 2, 1) for k in plan)
    assert n_vis == 4 and n_mtp >= 3
    assert any(f"vision_bits = 5 matches the {n_vis} linears" in m for m in oks), oks
    assert any("mtp_bits = " in m and f"the {n_mtp} linears" in m for m in oks), oks
    mtp_rates = sorted(r for k, (r, _, _, _) in plan.items() if is_mtp(k, 2, 1))
    cases = {
        "vision-other": (lambda c: c["quantization_config"].update(vision_bits=4), "vision_bits = 4", n_vis),
        "vision-absent": (lambda c: c["quantization_config"].pop("vision_bits"), "has no vision_bits", n_vis),
        "mtp-above": (lambda c: c["quantization_config"].update(mtp_bits=mtp_rates[-1]), "mtp_bits",
                      sum(r < mtp_rates[-1] for r in mtp_rates)),
        "mtp-16": (lambda c: c["quantization_config"].update(mtp_bits=16), "mtp_bits = 16", n_mtp),
    }
    for name, (edit, words, n_bad) in cases.items():
        w = _warnings(_qc_edit(d, tmp_path / name, edit))
        assert len(w) == 1 and w[0]["code"] == "BITS_MISMATCH" and words in w[0]["message"], (name, w)
        assert f"{n_bad} of the" in w[0]["message"], (name, w)


def test_unknown_true_sizes_are_a_warning(named, tmp_path):
    """X18: without vision_config the vision linears' true sizes are unknown; validate says so once (the padded
    sizes are used), naming one of them, and still passes."""
    d, plan, _ = named["qwen2"]
    w = _warnings(_qc_edit(d, tmp_path / "novc", lambda c: c.pop("vision_config")))
    assert [c["code"] for c in w] == ["EXL3_PADDING"], w
    assert "4 EXL3 linears" in w[0]["message"] and "vision_tower" in w[0]["tensor"]
