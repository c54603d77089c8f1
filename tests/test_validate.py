"""Tests of exl2fmt.validate: structural, deep and reference checks, --fix-index.

Bad inputs are made from the embedded sample by changing one thing; each test asserts the exact code, that the
failing check names the tensor/file, and that everything else still passes.  Oracles: the NumPy codec twins
(exl2fmt.codec.oracle), numpy float64 arithmetic for the reference metrics, the safetensors library for the index.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from exl2fmt.codec import oracle
from exl2fmt.container import INDEX_NAME, write_safetensors, write_sharded
from exl2fmt.errors import ErrorCode, Exl2Error
from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample
from exl2fmt.validate import (REFERENCE_THRESHOLDS, PassCode, Status, compare_weights, compare_with_oracle,
                              fix_index, reference_threshold, validate_model, weight_stats)


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    write_sample(d)
    return d


@pytest.fixture(scope="module")
def sample_tensors(sample_dir):
    return load_file(str(sample_dir / "output.safetensors"))


@pytest.fixture(scope="module")
def sample_config(sample_dir):
    return json.loads((sample_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """The FP16 model the sample is quantized from, as a model directory."""
    d = tmp_path_factory.mktemp("ref")
    write_safetensors(d / "model.safetensors", sample_dense_tensors())
    (d / "config.json").write_text(json.dumps(SAMPLE_CONFIG))
    return d


def variant(tmp_path: Path, tensors: dict, config: dict, **changes) -> Path:
    """A copy of a model with ``changes`` applied: name -> new array (None deletes)."""
    t = dict(tensors)
    for name, arr in changes.items():
        name = name.replace("__", ".")
        if arr is None:
            t.pop(name)
        else:
            t[name] = arr
    d = tmp_path / "m"
    d.mkdir()
    write_safetensors(d / "output.safetensors", t)
    (d / "config.json").write_text(json.dumps(config))
    return d


def codes_of(rep, status=None):
    return [c.code for c in rep.checks if status is None or c.status is status]


def by_code(rep, code):
    return [c for c in rep.checks if c.code == code]


# ------------------------------------------------------------------------------------------------ sample


def test_sample_structural_passes(sample_dir):
    rep = validate_model(sample_dir)
    assert not rep.failed and rep.exit_code == 0
    assert rep.format == "exl2"
    for code in (PassCode.CONTAINER_OK, PassCode.INDEX_OK, PassCode.NAMES_OK, PassCode.FORMAT_OK,
                 PassCode.CONFIG_OK, PassCode.LAYERS_OK):
        assert code.value in codes_of(rep, Status.PASS), code
    assert by_code(rep, "LAYERS_OK")[0].count == 15
    assert rep.layers == [] and rep.bytes_read == 0  # structural: no data pass


def test_sample_deep_statistics_match_oracle(sample_dir, sample_tensors):
    rep = validate_model(sample_dir, deep=True)
    assert not rep.failed
    assert by_code(rep, "DECODE_OK")[0].count == 15
    assert by_code(rep, "FINITE_OK")[0].count == 6  # embed, 4 layer norms, final norm
    assert len(rep.layers) == 15
    # statistics of one layer against the NumPy oracle's dequantization, in float64
    key = "model.layers.1.mlp.down_proj"
    t = {s: sample_tensors[f"{key}.{s}"] for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    qg = t["q_groups"].astype(int)
    qrow = list(qg[1::2]) + [t["q_weight"].shape[0]]
    bits_rows = [(int(b), (qrow[g + 1] - qrow[g]) * 32 // int(b)) for g, b in enumerate(qg[0::2])]
    w = oracle.dequantize(t["q_weight"], t["q_scale"], t["q_scale_max"], bits_rows, t["q_invperm"]).astype(np.float64)
    res = next(l for l in rep.layers if l.key == key)
    assert res.shape == [256, 704]
    assert res.stats["mean"] == pytest.approx(w.mean(), rel=1e-4, abs=1e-9)
    assert res.stats["std"] == pytest.approx(w.std(), rel=1e-4)
    assert res.stats["absmax"] == np.abs(w).max()
    assert res.stats["nonfinite"] == 0 and res.stats["numel"] == w.size


def test_bits_mismatch_warns_and_strict_fails(sample_dir, sample_config, sample_tensors, tmp_path):
    # measured decoder bpw, computed independently: bytes of the decoder layers' tensors / sum K * N_pad
    dec = [n for n in sample_tensors if n.startswith("model.layers.") and ".q_" in n]
    numel = sum(sample_tensors[n].shape[0] * sample_tensors[n[: -len("q_invperm")] + "q_weight"].shape[1]
                for n in dec if n.endswith(".q_invperm"))
    measured = sum(sample_tensors[n].nbytes * 8 for n in dec) / numel
    cfg = json.loads(json.dumps(sample_config))
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(sample_dir / "output.safetensors", d / "output.safetensors")
    for target, status in ((round(measured, 2), Status.PASS), (measured + 0.04, Status.PASS),
                           (measured - 0.06, Status.WARN), (1.5, Status.WARN)):
        cfg["quantization_config"]["bits"] = target
        (d / "config.json").write_text(json.dumps(cfg))
        rep = validate_model(d)
        [c] = [c for c in rep.checks if c.check == "bits"]
        assert c.status is status, (target, c.message)
        assert c.code == ("BITS_OK" if status is Status.PASS else "BITS_MISMATCH")
        assert f"{measured:.4f}" in c.message and rep.exit_code == 0
    strict = validate_model(d, strict=True)
    [c] = by_code(strict, "BITS_MISMATCH")
    assert c.status is Status.FAIL and c.escalated and strict.exit_code == 1


# ------------------------------------------------------------------------------------------------ bad layers


@pytest.mark.parametrize("slot, mutate, code", [
    ("q_groups", lambda a: _set(a, 0, 7), "GROUPS_BITS"),                       # bits 7
    ("q_groups", lambda a: _set(a, 0, 0), "GROUPS_BITS"),                       # bits 0
    ("q_groups", lambda a: _set(a, a.size - 2, 8), "GROUPS_ORDER"),             # last tier 2b -> 8b: ascending
    ("q_weight", lambda a: a[:10], "GROUPS_QROW"),                              # later groups start past the end
    ("q_weight", lambda a: a[:-1], "GROUPS_ROWS"),                              # last group not whole rows
    ("q_scale", lambda a: a[:, :-1], "SLOT_SHAPE"),
    ("q_scale_max", lambda a: a.astype(np.float32), "SLOT_DTYPE"),
    ("q_invperm", lambda a: a[:-32], "K_MISMATCH"),
    ("q_weight", None, "SLOT_MISSING"),
])
def test_exl2_invariant_failures(tmp_path, sample_tensors, sample_config, slot, mutate, code):
    key = "model.layers.1.mlp.down_proj"  # 3 tiers: 6b, 3b, 2b
    name = f"{key}.{slot}"
    arr = None if mutate is None else np.ascontiguousarray(mutate(sample_tensors[name].copy()))
    d = variant(tmp_path, sample_tensors, sample_config, **{name.replace(".", "__"): arr})
    rep = validate_model(d)
    fails = [c for c in rep.checks if c.status is Status.FAIL and c.check == "layers"]
    assert [c.code for c in fails] == [code]
    assert fails[0].tensor.startswith(key) and fails[0].file.endswith("output.safetensors")
    assert rep.exit_code == 1
    assert by_code(rep, "LAYERS_OK")[0].count == 14  # the other layers still pass
    # any other failure is about the same layer (e.g. a shorter q_invperm also contradicts config.json)
    assert all(c.tensor and c.tensor.startswith(key) for c in rep.checks if c.status is Status.FAIL)


def _set(a, i, v):
    a[i] = v
    return a


@pytest.mark.parametrize("slot, mutate, code", [
    ("q_invperm", lambda a: _set(a, 1, a[0]), "PERM_INVALID"),                  # a duplicate
    ("q_invperm", lambda a: _set(a, 1, a.size), "PERM_INVALID"),                # out of range
    ("q_scale_max", lambda a: _set(a, 0, np.inf), "SCALE_MAX_INVALID"),
    ("q_scale_max", lambda a: _set(a, 0, -1), "SCALE_MAX_INVALID"),
])
def test_deep_only_failures(tmp_path, sample_tensors, sample_config, slot, mutate, code):
    name = f"model.layers.0.self_attn.q_proj.{slot}"
    d = variant(tmp_path, sample_tensors, sample_config, **{name.replace(".", "__"): mutate(sample_tensors[name].copy())})
    assert not validate_model(d).failed  # header-level checks cannot see it
    rep = validate_model(d, deep=True)
    fails = [c for c in rep.checks if c.status is Status.FAIL]
    assert [c.code for c in fails] == [code] and fails[0].tensor == name
    assert by_code(rep, "DECODE_OK")[0].count == 14  # the broken layer is not decoded


def test_zero_scale_max_is_a_warning(tmp_path, sample_tensors, sample_config):
    """ExLlamaV2 writes q_scale_max = 0 for an all-zero group: legal, decodes to zeros; worth a warning."""
    name = "model.layers.0.self_attn.q_proj.q_scale_max"
    d = variant(tmp_path, sample_tensors, sample_config, **{name.replace(".", "__"): _set(sample_tensors[name].copy(), 0, 0)})
    rep = validate_model(d, deep=True)
    [c] = by_code(rep, "SCALE_MAX_INVALID")
    assert c.status is Status.WARN and c.tensor == name and not rep.failed


def test_nan_in_norm_found_by_deep(tmp_path, sample_tensors, sample_config):
    name = "model.layers.1.input_layernorm.weight"
    a = sample_tensors[name].copy()
    a[3] = np.nan
    a[7] = -np.inf
    d = variant(tmp_path, sample_tensors, sample_config, **{name.replace(".", "__"): a})
    assert not validate_model(d).failed
    rep = validate_model(d, deep=True)
    [c] = [c for c in rep.checks if c.status is Status.FAIL]
    assert (c.code, c.tensor, c.check) == ("NONFINITE_VALUES", name, "finite") and c.message.startswith("2 of 256")


# ------------------------------------------------------------------------------------------------ config / names


def test_config_vocab_mismatch(tmp_path, sample_tensors, sample_config):
    cfg = dict(sample_config, vocab_size=1100)  # pads to 1120, stored N_pad is 1024, embedding has 1000 rows
    d = variant(tmp_path, sample_tensors, cfg)
    rep = validate_model(d)
    fails = [c for c in rep.checks if c.status is Status.FAIL]
    assert {c.code for c in fails} == {"CONFIG_MISMATCH"}
    assert {c.tensor for c in fails} == {"lm_head", "model.embed_tokens.weight"}
    assert all(c.file.endswith("config.json") and "vocab_size" in c.message for c in fails)


def test_config_heads_and_layers_mismatch(tmp_path, sample_tensors, sample_config):
    cfg = dict(sample_config, num_key_value_heads=4, num_hidden_layers=3)
    rep = validate_model(variant(tmp_path, sample_tensors, cfg))
    fails = [c for c in rep.checks if c.status is Status.FAIL]
    assert {c.tensor for c in fails} == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj")} | {None}
    assert any("num_hidden_layers = 3" in c.message for c in fails)


def test_config_invalid_and_missing(tmp_path, sample_tensors, sample_config):
    d = variant(tmp_path, sample_tensors, sample_config)
    (d / "config.json").write_text("[1, 2]")
    rep = validate_model(d)
    assert codes_of(rep, Status.FAIL) == ["CONFIG_INVALID"]
    (d / "config.json").unlink()
    rep = validate_model(d)
    assert codes_of(rep, Status.WARN) == ["CONFIG_MISSING"] and not rep.failed


def test_control_characters_in_names(tmp_path, sample_tensors, sample_config):
    bad = "model.layers.0.\x1b[2J\nevil.weight"
    d = variant(tmp_path, sample_tensors, sample_config, **{bad.replace(".", "__"): np.ones(4, np.float16)})
    rep = validate_model(d)
    [c] = by_code(rep, "NAME_CONTROL_CHARS")
    assert c.status is Status.FAIL and c.tensor == bad


def test_format_mismatch(tmp_path, sample_tensors, sample_config):
    cfg = dict(sample_config, quantization_config={"quant_method": "awq", "bits": 4})
    rep = validate_model(variant(tmp_path, sample_tensors, cfg))
    assert codes_of(rep, Status.FAIL) == ["FORMAT_MISMATCH"]


def test_unknown_format_warns(tmp_path):
    d = tmp_path / "u"
    d.mkdir()
    write_safetensors(d / "x.safetensors", {"foo": np.zeros(3, np.float32)})
    rep = validate_model(d / "x.safetensors")
    assert codes_of(rep, Status.WARN) == ["FORMAT_UNKNOWN"] and rep.format == "unknown"


# ------------------------------------------------------------------------------------------------ container / index


def test_truncated_file_is_a_failed_container_check(tmp_path, sample_dir):
    p = tmp_path / "t.safetensors"
    data = (sample_dir / "output.safetensors").read_bytes()
    p.write_bytes(data[:-100])
    rep = validate_model(p)
    assert [(c.check, c.code) for c in rep.checks] == [("container", "TRUNCATED")]
    assert rep.checks[0].file == str(p) and rep.exit_code == 1


def test_unreadable_raises(tmp_path):
    with pytest.raises(Exl2Error) as e:
        validate_model(tmp_path / "nope")
    assert e.value.code is ErrorCode.PATH_NOT_FOUND


def _sharded(tmp_path, sample_tensors, sample_config) -> Path:
    d = tmp_path / "sharded"
    write_sharded(d, sample_tensors, max_shard_bytes=400_000, prefix="model")
    (d / "config.json").write_text(json.dumps(sample_config))
    assert len(list(d.glob("model-*.safetensors"))) > 2
    return d


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


def test_index_problems_and_fix_index_round_trip(tmp_path, sample_tensors, sample_config):
    d = _sharded(tmp_path, sample_tensors, sample_config)
    assert "INDEX_OK" in codes_of(validate_model(d), Status.PASS)
    idx = json.loads((d / INDEX_NAME).read_text())
    wm = idx["weight_map"]
    dropped = sorted(wm)[0]
    del wm[dropped]                                              # an unlisted tensor
    moved = sorted(wm)[5]
    wm[moved] = "model-00099-of-00099.safetensors"               # a shard that does not exist
    idx["metadata"]["total_size"] += 1                           # wrong total
    (d / INDEX_NAME).write_text(json.dumps(idx))
    rep = validate_model(d)
    got = {c.code: c for c in rep.checks if c.status is not Status.PASS}
    assert {"INDEX_UNLISTED_TENSOR", "INDEX_MISSING_SHARD", "INDEX_TOTAL_SIZE"} <= set(got)
    assert got["INDEX_UNLISTED_TENSOR"].tensor == dropped and got["INDEX_MISSING_SHARD"].status is Status.FAIL
    before = _digest(d)

    info = fix_index(d)
    assert info["replaced"] and info["tensors"] == len(sample_tensors) and info["shards"] == len(before)
    assert _digest(d) == before  # tensor files untouched
    rep = validate_model(d)
    # the loader note (HF_NEEDS_IMPORT: quant_method exl2 needs import exl2fmt.hf in transformers) is about the runtime
    assert (not [c for c in rep.checks if c.status is not Status.PASS and c.check != "loader"]
            or [c for c in codes_of(rep, Status.WARN) if c != "HF_NEEDS_IMPORT"] == ["BITS_MISMATCH"])
    assert "INDEX_OK" in codes_of(rep, Status.PASS)
    # the new index against the safetensors library's own view of each shard
    new = json.loads((d / INDEX_NAME).read_text())
    expect, total = {}, 0
    for shard in before:
        with safe_open(str(d / shard), "np") as f:
            for n in f.keys():
                expect[n] = shard
                total += f.get_tensor(n).nbytes
    assert new["weight_map"] == expect and new["metadata"]["total_size"] == total
    assert not list(d.glob(".*.tmp"))  # atomic write left nothing behind


def test_sharded_without_index_warns(tmp_path, sample_tensors, sample_config):
    d = _sharded(tmp_path, sample_tensors, sample_config)
    (d / INDEX_NAME).unlink()
    rep = validate_model(d)
    assert "INDEX_ABSENT" in codes_of(rep, Status.WARN) and not rep.failed
    fix_index(d)
    assert "INDEX_ABSENT" not in codes_of(validate_model(d))


def test_fix_index_refuses(tmp_path, sample_dir, sample_tensors):
    with pytest.raises(Exl2Error) as e:
        fix_index(sample_dir / "output.safetensors")
    assert e.value.code is ErrorCode.USAGE
    d = tmp_path / "dup"
    d.mkdir()
    write_safetensors(d / "a.safetensors", {"x": np.zeros(2, np.float16)})
    write_safetensors(d / "b.safetensors", {"x": np.zeros(2, np.float16)})
    with pytest.raises(Exl2Error) as e:
        fix_index(d)
    assert e.value.code is ErrorCode.DUPLICATE_TENSOR and not (d / INDEX_NAME).exists()


# ------------------------------------------------------------------------------------------------ reference


def test_reference_passes_and_metrics_match_numpy(sample_dir, reference_dir):
    rep = validate_model(sample_dir, reference=reference_dir)
    assert rep.deep and not rep.failed
    assert by_code(rep, "REFERENCE_OK")[0].count == 15
    dense = sample_dense_tensors()
    from exl2fmt import dequantize_layer

    for res in rep.layers:
        w = dequantize_layer(sample_dir, res.key).astype(np.float64)
        r = dense[res.key + ".weight"].astype(np.float64)
        m = res.reference
        assert m["rel_fro"] == pytest.approx(np.linalg.norm(w - r) / np.linalg.norm(r), rel=1e-5)
        assert m["max_abs"] == pytest.approx(np.abs(w - r).max(), rel=1e-6)
        assert m["cosine"] == pytest.approx((w * r).sum() / np.linalg.norm(w) / np.linalg.norm(r), rel=1e-6)
        assert m["rel_fro"] <= m["threshold"]


def test_reference_perturbed_fails(tmp_path, sample_dir):
    dense = sample_dense_tensors()
    bad = "model.layers.0.mlp.up_proj"
    rng = np.random.default_rng(7)
    w = dense[bad + ".weight"].astype(np.float32)
    dense[bad + ".weight"] = (w + rng.standard_normal(w.shape).astype(np.float32) * w.std()).astype(np.float16)
    d = tmp_path / "ref"
    d.mkdir()
    write_safetensors(d / "model.safetensors", dense)
    rep = validate_model(sample_dir, reference=d)
    fails = [c for c in rep.checks if c.status is Status.FAIL]
    assert [(c.code, c.tensor) for c in fails] == [("REFERENCE_MISMATCH", bad)]
    assert by_code(rep, "REFERENCE_OK")[0].count == 14 and rep.exit_code == 1


def test_reference_missing_layer_and_shape(tmp_path, sample_dir):
    dense = sample_dense_tensors()
    del dense["lm_head.weight"]
    dense["model.layers.0.self_attn.q_proj.weight"] = dense["model.layers.0.self_attn.q_proj.weight"][:, :128].copy()
    d = tmp_path / "ref"
    d.mkdir()
    write_safetensors(d / "model.safetensors", dense)
    rep = validate_model(sample_dir, reference=d)
    [w] = [c for c in rep.checks if c.status is Status.WARN and c.check == "reference"]
    assert (w.code, w.tensor) == ("LAYER_NOT_FOUND", "lm_head")
    [f] = [c for c in rep.checks if c.status is Status.FAIL]
    assert (f.code, f.tensor) == ("REFERENCE_MISMATCH", "model.layers.0.self_attn.q_proj")


def test_reference_threshold_rule():
    for b, t in REFERENCE_THRESHOLDS.items():
        assert reference_threshold({b: 1.0}) == pytest.approx(t)
    mixed = reference_threshold({8: 0.05, 4: 0.1, 3: 0.85})
    assert mixed == pytest.approx(math.sqrt(0.05 * 0.02 ** 2 + 0.1 * 0.25 ** 2 + 0.85 * 0.45 ** 2))
    assert reference_threshold({7: 1.0}) == REFERENCE_THRESHOLDS[6]  # missing width -> next lower listed
    # tighter for more bits
    ts = [REFERENCE_THRESHOLDS[b] for b in sorted(REFERENCE_THRESHOLDS)]
    assert ts == sorted(ts, reverse=True)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_weight_stats(dtype):
    a = np.array([[1, -2], [np.nan, 4], [np.inf, -np.inf]], dtype)
    s = weight_stats(a)
    assert s["nonfinite"] == 3 and s["absmax"] == 4 and s["mean"] == pytest.approx(1.0) and s["numel"] == 6
    assert s["std"] == pytest.approx(np.std([1, -2, 4]))
    rng = np.random.default_rng(3)
    big = (rng.standard_normal(300_001) * 0.02 + 0.001).astype(dtype)  # several chunks, odd length
    x = big.astype(np.float64)
    s = weight_stats(big)
    assert s["mean"] == pytest.approx(x.mean(), rel=1e-6) and s["std"] == pytest.approx(x.std(), rel=1e-6)
    assert s["absmax"] == np.abs(x).max() and s["nonfinite"] == 0


def test_numeric_helpers():
    m = compare_weights(np.array([1.0, 0.0], np.float16), np.array([1.0, 1.0], np.float32))
    assert m["rel_fro"] == pytest.approx(1 / math.sqrt(2)) and m["max_abs"] == 1.0
    assert m["cosine"] == pytest.approx(1 / math.sqrt(2))


# ------------------------------------------------------------------------------------------------ GPTQ


def _gptq_model(tmp_path, *, sym=True, v2=False, cfg_bits=4, group_size=32, bad_g_idx=False, field=None):
    rng = np.random.default_rng(11)
    K, N, bits, gs = 128, 64, 4, 32
    G = K // gs
    codes = rng.integers(0, 16, size=(K, N)).astype(np.uint8)
    fields = (rng.integers(0, 15, size=(G, N)) if field is None else np.full((G, N), field)).astype(np.uint8)
    g_idx = (rng.permutation(K) // gs).astype(np.int32)
    if bad_g_idx:
        g_idx[5] = G
    t = {"model.layers.0.mlp.down_proj.qweight": oracle.gptq_pack_rows(codes, bits),
         "model.layers.0.mlp.down_proj.qzeros": oracle.gptq_pack_rows(np.ascontiguousarray(fields.T), bits).T.copy(),
         "model.layers.0.mlp.down_proj.scales": (rng.random((G, N)) * 0.01 + 0.001).astype(np.float16),
         "model.layers.0.mlp.down_proj.g_idx": g_idx}
    d = tmp_path / "gptq"
    d.mkdir()
    write_safetensors(d / "model.safetensors", t)
    qc = {"quant_method": "gptq", "bits": cfg_bits, "group_size": group_size, "sym": sym, "desc_act": True,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    (d / "config.json").write_text(json.dumps({"intermediate_size": K, "hidden_size": N, "quantization_config": qc}))
    return d, (codes, fields, g_idx, t)


def test_gptq_valid_deep_and_decode_matches_oracle(tmp_path):
    d, (codes, fields, g_idx, t) = _gptq_model(tmp_path, v2=True)
    rep = validate_model(d, deep=True)
    assert not rep.failed and by_code(rep, "LAYERS_OK")[0].count == 1
    res = rep.layers[0]
    w = oracle.gptq_dequantize(t["model.layers.0.mlp.down_proj.qweight"], t["model.layers.0.mlp.down_proj.qzeros"],
                               t["model.layers.0.mlp.down_proj.scales"], g_idx, 4, v2=True).astype(np.float64)
    assert res.shape == [64, 128] and res.stats["mean"] == pytest.approx(w.mean(), rel=1e-4, abs=1e-9)


def test_gptq_bits_and_group_size_mismatch(tmp_path):
    d, _ = _gptq_model(tmp_path, cfg_bits=8)
    assert "GPTQ_BITS" in codes_of(validate_model(d), Status.FAIL)
    shutil.rmtree(d)
    d, _ = _gptq_model(tmp_path, group_size=64)
    [c] = [c for c in validate_model(d).checks if c.status is Status.FAIL]
    assert c.code == "SLOT_SHAPE" and "group_size 64" in c.message


def test_gptq_g_idx_range_and_v1_ambiguity(tmp_path):
    d, _ = _gptq_model(tmp_path, bad_g_idx=True)
    assert not validate_model(d).failed
    assert codes_of(validate_model(d, deep=True), Status.FAIL)[0] == "GPTQ_G_IDX"
    shutil.rmtree(d)
    d, _ = _gptq_model(tmp_path, sym=False, field=15)  # v1, every zero field 2**4 - 1
    structural = validate_model(d)
    assert codes_of(structural, Status.WARN) == ["GPTQ_ZEROS_AMBIGUOUS"] and not structural.failed
    deep = validate_model(d, deep=True)
    [c] = by_code(deep, "GPTQ_ZEROS_AMBIGUOUS")
    assert c.status is Status.WARN and c.message.startswith(f"{4 * 64} v1 zero fields")


def test_awq_shapes_checked(tmp_path):
    K, N, gs = 128, 64, 32
    t = {"model.layers.0.mlp.up_proj.qweight": np.zeros((K, N // 8), np.int32),
         "model.layers.0.mlp.up_proj.qzeros": np.zeros((K // gs, N // 8), np.int32),
         "model.layers.0.mlp.up_proj.scales": np.ones((K // gs, N), np.float16)}
    d = tmp_path / "awq"
    d.mkdir()
    write_safetensors(d / "model.safetensors", t)
    rep = validate_model(d / "model.safetensors")
    assert rep.format == "awq" and by_code(rep, "LAYERS_OK")[0].count == 1 and not rep.failed
    t["model.layers.0.mlp.up_proj.qzeros"] = np.zeros((K // gs, N // 4), np.int32)
    write_safetensors(d / "model.safetensors", t)
    rep = validate_model(d / "model.safetensors")
    assert [c.code for c in rep.checks if c.status is Status.FAIL] == ["SLOT_SHAPE"]


# ------------------------------------------------------------------------------------------------ oracle / progress


def test_compare_with_oracle_bit_exact(sample_dir):
    rows = compare_with_oracle(sample_dir)
    assert len(rows) == 15 and all(r["bit_exact"] and r["mismatches"] == 0 for r in rows)


def test_progress_callback_covers_all_bytes(sample_dir):
    calls = []
    rep = validate_model(sample_dir, deep=True, progress=lambda done, total, what: calls.append((done, total)))
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1] == rep.bytes_read
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    # every tensor of the sample is read once: layers (all valid) + the other float tensors
    assert rep.bytes_read == sum(a.nbytes for a in load_file(str(sample_dir / "output.safetensors")).values())


def test_exl3_layers_are_checked(tmp_path):
    """EXL3 is a decoded format (issue 39): a 64-row trellis is not padded to 128 (tests/test_exl3.py has the rest)."""
    d = tmp_path / "e3"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {
        "model.layers.0.mlp.up_proj.trellis": np.zeros((4, 8, 48), np.int16),
        "model.layers.0.mlp.up_proj.suh": np.ones(64, np.float16),
        "model.layers.0.mlp.up_proj.svh": np.ones(128, np.float16)})
    rep = validate_model(d / "model.safetensors", deep=True)
    assert rep.format == "exl3" and rep.failed and codes_of(rep, Status.FAIL) == ["EXL3_PADDING"]
    write_safetensors(d / "model.safetensors", {
        "model.layers.0.mlp.up_proj.trellis": np.zeros((8, 8, 48), np.int16),
        "model.layers.0.mlp.up_proj.suh": np.ones(128, np.float16),
        "model.layers.0.mlp.up_proj.svh": np.ones(128, np.float16)})
    rep = validate_model(d / "model.safetensors", deep=True)
    assert rep.format == "exl3" and not rep.failed and by_code(rep, "DECODE_OK")[0].count == 1
