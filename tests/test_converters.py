"""Converters: EXL2 -> FP16/BF16, GPTQ -> FP16/BF16, EXL2 -> GPTQ, GPTQ -> EXL2 (issue 4).

Oracles: ``exl2fmt.dequantize_layer`` (the core decoder, itself tested bit for bit against the NumPy twins),
``exl2fmt.codec.oracle.gptq_dequantize`` (an independent NumPy GPTQ decode), a bf16 rounding written here from
the two neighbouring bf16 values, and - in the ``peers`` extra - AutoGPTQ's own torch decode and transformers'
``AutoModelForCausalLM`` against a NumPy Llama forward.  Models are the embedded sample (all six EXL2 widths,
padded vocab) and sample-shaped variants built here with ``writer.quantize_rtn`` / GPTQ round-to-nearest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exl2fmt import ErrorCode, Exl2Error, dequantize_layer
from exl2fmt.codec import oracle
from exl2fmt.container import open_model, write_sharded
from exl2fmt.converters import convert, get, registered
from exl2fmt.sample import SAMPLE_CONFIG, T, sample_dense_tensors, write_sample
from exl2fmt.formats.exl2 import quantize_rtn

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")

#: A sample-shaped EXL2 model whose tiers are all <= 4 bits (every one embeds exactly in 4-bit GPTQ), with
#: groups of 32, 64 and 128 rows and mixed tiers.
LOW_BIT_PLANS = {
    "self_attn.q_proj": T((0.1, 4, 128), (0.9, 3, 128)),
    "self_attn.k_proj": T((1.0, 4, 64)),
    "self_attn.v_proj": T((0.25, 3, 64), (0.75, 2, 64)),
    "self_attn.o_proj": T((1.0, 4, 32)),
    "mlp.gate_proj": T((0.1, 4, 128), (0.9, 3, 128)),
    "mlp.up_proj": T((0.25, 4, 32), (0.75, 2, 32)),
    "mlp.down_proj": T((0.1, 4, 128), (0.9, 3, 128)),
}


# ------------------------------------------------------------------------------------------------ fixtures


def build_exl2(d: Path, plans=LOW_BIT_PLANS, head=T((1.0, 4, 128)), head_bias: bool = False, seed: int = 0) -> Path:
    dense = sample_dense_tensors(seed)
    rng = np.random.default_rng(seed + 7)
    out = {n: a for n, a in dense.items() if not n.endswith("_proj.weight") and n != "lm_head.weight"}
    for li in range(SAMPLE_CONFIG["num_hidden_layers"]):
        p = f"model.layers.{li}."
        for name, tiers in plans.items():
            w = dense[p + name + ".weight"]
            for s, a in quantize_rtn(w, list(tiers), rng.permutation(w.shape[1])).items():
                out[f"{p}{name}.{s}"] = a
    bias = (rng.standard_normal(SAMPLE_CONFIG["vocab_size"]) * 0.1).astype(np.float16) if head_bias else None
    for s, a in quantize_rtn(dense["lm_head.weight"], list(head), rng.permutation(256), bias=bias).items():
        out[f"lm_head.{s}"] = a
    d.mkdir(parents=True)
    write_sharded(d, out, 1 << 40, metadata={"format": "pt"}, prefix="output")
    cfg = dict(SAMPLE_CONFIG, quantization_config={"quant_method": "exl2", "bits": 3.5, "head_bits": 4})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def build_gptq(d: Path, bits=4, gs=128, sym=True, v2=False, act=False, g_idx=True, seed=0) -> Path:
    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors

    dense = sample_dense_tensors(seed)
    rng = np.random.default_rng(seed + 3)
    out = {}
    for n, a in dense.items():
        if n.endswith("_proj.weight"):
            key = n[: -len(".weight")]
            c, s, z, g = rtn_quantize(a, bits, gs, sym=sym, perm=rng.permutation(a.shape[1]) if act else None)
            for slot, arr in gptq_layer_tensors(c, s, z, g, bits, v2=v2).items():
                if slot == "g_idx" and not g_idx:
                    continue
                out[f"{key}.{slot}"] = arr
        else:
            out[n] = a
    d.mkdir(parents=True)
    write_sharded(d, out, 1 << 40, metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": act,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    (d / "config.json").write_text(json.dumps(dict(SAMPLE_CONFIG, quantization_config=qc)))
    return d


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("conv") / "sample-exl2"
    write_sample(d)
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "generation_config.json").write_text('{"bos_token_id": 1}')
    (d / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')  # stale index of other weights
    (d / "sub").mkdir()
    (d / "sub" / "notes.txt").write_text("kept")
    return d


@pytest.fixture(scope="module")
def lowbit(tmp_path_factory) -> Path:
    return build_exl2(tmp_path_factory.mktemp("conv") / "lowbit-exl2")


@pytest.fixture(scope="module")
def sample_fp16(sample, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "sample-fp16"
    return out, convert(sample, out, "fp16")


def tree_hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def bits16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def bf16_reference(w16: np.ndarray) -> np.ndarray:
    """bf16 bits of fp16 values: the nearer of the two neighbouring bf16 values, ties to the even one."""
    x = w16.astype(np.float64).ravel()
    u = w16.astype(np.float32).ravel().view(np.uint32)
    lo_bits = (u >> 16).astype(np.uint32)
    hi_bits = lo_bits + 1
    lo = (lo_bits << 16).view(np.float32).astype(np.float64)
    hi = (hi_bits << 16).view(np.float32).astype(np.float64)
    neg = x < 0  # for negative values the bit patterns grow away from zero just the same: compare magnitudes
    dlo, dhi = np.abs(np.abs(x) - np.abs(lo)), np.abs(np.abs(hi) - np.abs(x))
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (lo_bits % 2 == 1))
    del neg
    return np.where(pick_hi, hi_bits, lo_bits).astype(np.uint16).reshape(w16.shape)


# ------------------------------------------------------------------------------------------------ registry


def test_slot_constants_come_from_the_layout_table():
    from exl2fmt.converters import slots

    assert (slots.Q_WEIGHT, slots.Q_SCALE, slots.Q_SCALE_MAX, slots.Q_GROUPS, slots.Q_INVPERM) == (
        "q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
    assert (slots.QWEIGHT, slots.QZEROS, slots.SCALES, slots.G_IDX) == ("qweight", "qzeros", "scales", "g_idx")
    assert (slots.WEIGHT, slots.BIAS) == ("weight", "bias")


def test_registry_lists_pairs_and_rejects_unknown_ones(tmp_path):
    pairs = registered()
    for p in [("exl2", "fp16"), ("exl2", "bf16"), ("gptq", "fp16"), ("gptq", "bf16"), ("exl2", "gptq"),
              ("gptq", "exl2")]:
        assert p in pairs
    with pytest.raises(Exl2Error) as e:
        get("awq", "fp16")
    assert e.value.code is ErrorCode.USAGE and "exl2->fp16" in e.value.message and "gptq->exl2" in e.value.message
    # a dense model goes to the quantizer, which needs calibration: without tokenizer.json or a token-id file
    # it stops with a clear error before writing anything
    d = tmp_path / "dense"
    d.mkdir()
    write_sharded(d, sample_dense_tensors(), 1 << 40)
    (d / "config.json").write_text(json.dumps(SAMPLE_CONFIG))
    with pytest.raises(Exl2Error) as e:
        convert(d, tmp_path / "out", "exl2")
    assert e.value.code is ErrorCode.CALIBRATION_INVALID and "tokenizer.json" in e.value.message
    assert not (tmp_path / "out").exists()
    with pytest.raises(Exl2Error) as e:
        convert(d, tmp_path / "out", "int4")
    assert e.value.code is ErrorCode.USAGE
    # dense -> bf16 -> fp16: a cast and its exact inverse (bf16 values of this size are all fp16 values)
    r1 = convert(d, tmp_path / "bf16", "bf16")
    r2 = convert(tmp_path / "bf16", tmp_path / "fp16", "fp16")
    assert r1.source_format == r2.source_format == "dense" and not r1.exact and r2.exact and not r1.layers
    w = sample_dense_tensors()["model.layers.0.mlp.up_proj.weight"]
    got = open_model(tmp_path / "fp16").get("model.layers.0.mlp.up_proj.weight")
    assert np.array_equal(bits16(got), bits16(bf16_reference(w).astype(np.uint32).__lshift__(16).view(np.float32)
                                              .astype(np.float16)))


# ------------------------------------------------------------------------------------------------ EXL2 -> dense


def test_exl2_to_fp16_equals_the_core_dequantization_bit_for_bit(sample, sample_fp16):
    out, rep = sample_fp16
    assert rep.source_format == "exl2" and rep.verified and rep.exact
    m = open_model(out)
    src = open_model(sample)
    keys = [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS] + ["lm_head"]
    assert sorted(l.key for l in rep.layers) == sorted(keys)
    for key in keys:
        got = m.get(f"{key}.weight")
        want = dequantize_layer(sample, key)
        assert m.info(f"{key}.weight").dtype == "F16" and got.shape == want.shape
        assert np.array_equal(bits16(got), bits16(want)), key
        assert not any(n.startswith(key + ".q_") for n in m.names())
    assert m.info("lm_head.weight").shape == (1000, 256)            # vocab padding (1024) removed
    # independent check of the same thing: the NumPy oracle from the raw EXL2 tensors
    g = {s: src.get(f"lm_head.{s}") for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    from exl2fmt.groups import decode_q_groups

    br = decode_q_groups(g["q_groups"], g["q_weight"].shape[0]).bits_rows()
    want = oracle.dequantize(g["q_weight"], g["q_scale"], g["q_scale_max"], br, g["q_invperm"], out_features=1000)
    assert np.array_equal(bits16(m.get("lm_head.weight")), bits16(want))
    # plain tensors kept bit for bit (F16 source, F16 target)
    for n in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert m.info(n).dtype == "F16" and np.array_equal(bits16(m.get(n)), bits16(src.get(n)))
    assert set(m.names()) == {f"{k}.weight" for k in keys} | {n for n in src.names() if ".q_" not in n}


def test_exl2_to_fp16_directory_is_a_plain_hf_model(sample, sample_fp16):
    out, rep = sample_fp16
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float16"
    assert cfg["vocab_size"] == 1000 and cfg["hidden_size"] == 256
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out / "generation_config.json").exists() and (out / "sub" / "notes.txt").read_text() == "kept"
    assert not (out / "pytorch_model.bin.index.json").exists()       # a stale index is never copied
    assert not (out / "output.safetensors").exists() and (out / "model.safetensors").exists()
    hdr = open_model(out).headers[str(out / "model.safetensors")]
    assert hdr.metadata == {"format": "pt"}
    from exl2fmt.validate import validate_model

    v = validate_model(out, deep=True)
    assert not v.failed, [c.as_dict() for c in v.checks if c.status.value != "PASS"]
    assert rep.validation["result"] == "PASS"
    assert not [p for p in out.parent.iterdir() if ".exl2fmt-" in p.name]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_split_phi3_exl2_is_fused_back_so_transformers_loads_it(tmp_path, target):
    """EXL2 stores Phi-3's qkv_proj / gate_up_proj split (ExLlamaV2's convention); transformers' Phi-3 builds them
    fused.  The dense output fuses them back: the fused weight is the parts' own reconstructions (the core's
    dequantize, independently of the converter) stacked q, k, v / gate, up, and transformers loads every weight
    (no missing or unexpected keys) and computes with exactly those weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import exl2_rtn_copy, make_tiny

    src = make_tiny("phi3", tmp_path / "fp16")
    keys = exl2_rtn_copy(src, tmp_path / "exl2")
    assert "model.layers.0.self_attn.q_proj" in keys and "model.layers.0.mlp.up_proj" in keys
    rep = convert(tmp_path / "exl2", tmp_path / "out", target, verify="full")
    assert rep.verified and rep.validation["result"] == "PASS"
    m = open_model(tmp_path / "out")
    names = set(m.names())
    leaves = {n.split(".")[-2] for n in names if n.endswith(".weight")}
    assert {"qkv_proj", "gate_up_proj"} <= leaves and not leaves & {"q_proj", "k_proj", "v_proj", "gate_proj",
                                                                    "up_proj"}, leaves
    enc = (lambda a: bf16_reference(a)) if target == "bf16" else (lambda a: a)
    for i in range(json.loads((src / "config.json").read_text())["num_hidden_layers"]):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            base = f"model.layers.{i}.{fused.split('.')[0]}."
            want = np.concatenate([dequantize_layer(tmp_path / "exl2", base + p) for p in parts])
            got = m.get(f"model.layers.{i}.{fused}.weight")
            assert got.shape == want.shape and np.array_equal(got, enc(want)), (i, fused)
    m.close()
    dtype = torch.bfloat16 if target == "bf16" else torch.float16
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=dtype,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    bits = hf.model.layers[1].self_attn.qkv_proj.weight.detach().view(torch.int16).numpy().view(np.uint16)
    q = dequantize_layer(tmp_path / "exl2", "model.layers.1.self_attn.q_proj")
    assert np.array_equal(bits[:q.shape[0]], np.asarray(enc(q)).view(np.uint16))


def test_exl2_to_bf16_is_the_fp16_reconstruction_rounded_once(sample, tmp_path):
    rep = convert(sample, tmp_path / "bf16", "bf16", verify="full")
    assert rep.verified and all(l.exact for l in rep.layers) and not rep.exact  # embeddings/norms are rounded
    m = open_model(tmp_path / "bf16")
    for key in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj", "lm_head"):
        assert m.info(f"{key}.weight").dtype == "BF16"
        w = dequantize_layer(sample, key)
        assert np.array_equal(m.get(f"{key}.weight"), bf16_reference(w)), key
    emb = open_model(sample).get("model.embed_tokens.weight")
    assert m.info("model.embed_tokens.weight").dtype == "BF16"
    assert np.array_equal(m.get("model.embed_tokens.weight"), bf16_reference(emb))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert any(t.source_dtype == "F16" and t.target_dtype == "BF16" and not t.exact for t in rep.tensors)


def test_exl2_bias_is_unpadded_and_kept(tmp_path):
    src = build_exl2(tmp_path / "biased", head_bias=True)
    rep = convert(src, tmp_path / "fp16", "fp16", verify="full")
    m = open_model(tmp_path / "fp16")
    want = open_model(src).get("lm_head.bias")
    assert want.shape == (1024,) and m.info("lm_head.bias").shape == (1000,)
    assert np.array_equal(bits16(m.get("lm_head.bias")), bits16(want[:1000]))
    assert rep.verified


def test_sharding_writes_hf_names_and_a_correct_index(sample, tmp_path):
    rep = convert(sample, tmp_path / "sharded", "fp16", shard_size="600kB")
    out = tmp_path / "sharded"
    n = len([s for s in rep.shards if s.endswith(".safetensors")])
    assert n > 2 and rep.shards[:n] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    m = open_model(out)
    assert not m.index_issues()
    assert idx["metadata"]["total_size"] == sum(t.nbytes for t in m.tensors.values())
    assert set(idx["weight_map"]) == set(m.names())
    for name, shard in idx["weight_map"].items():
        assert Path(m.info(name).file).name == shard
        assert m.info(name).nbytes <= 600_000 or len(open_model(out / shard).names()) == 1
    one = open_model(tmp_path / "sharded")
    assert np.array_equal(bits16(one.get("lm_head.weight")), bits16(dequantize_layer(sample, "lm_head")))


# ------------------------------------------------------------------------------------------------ GPTQ -> dense


GPTQ_CASES = [
    # (bits, group size, sym, v2 zeros, act-order)
    (2, -1, True, False, False),
    (3, 64, False, True, True),
    (4, 128, True, False, True),
    (4, 32, False, False, False),
    (8, 32, False, True, False),
    (8, 128, True, False, True),
]


@pytest.mark.parametrize("bits,gs,sym,v2,act", GPTQ_CASES)
def test_gptq_to_fp16_matches_an_independent_numpy_decode(tmp_path, bits, gs, sym, v2, act):
    src = build_gptq(tmp_path / "gptq", bits, gs, sym, v2, act)
    rep = convert(src, tmp_path / "fp16", "fp16")
    assert rep.source_format == "gptq" and rep.verified and rep.exact and len(rep.layers) == 14
    s, m = open_model(src), open_model(tmp_path / "fp16")
    for l in rep.layers:
        k = l.key
        want = oracle.gptq_dequantize(s.get(k + ".qweight"), s.get(k + ".qzeros"), s.get(k + ".scales"),
                                      s.get(k + ".g_idx"), bits, v2)
        assert np.array_equal(bits16(m.get(k + ".weight")), bits16(want)), k
    assert np.array_equal(bits16(m.get("lm_head.weight")), bits16(s.get("lm_head.weight")))  # dense head kept
    assert "quantization_config" not in json.loads((tmp_path / "fp16" / "config.json").read_text())


def test_gptq_without_g_idx_and_to_bf16(tmp_path):
    src = build_gptq(tmp_path / "gptq", 4, 64, True, False, False, g_idx=False)
    rep = convert(src, tmp_path / "bf16", "bf16", verify="full")
    s, m = open_model(src), open_model(tmp_path / "bf16")
    k = "model.layers.1.mlp.down_proj"
    assert k + ".g_idx" not in s
    want = oracle.gptq_dequantize(s.get(k + ".qweight"), s.get(k + ".qzeros"), s.get(k + ".scales"),
                                  np.arange(704) // 64, 4)
    assert np.array_equal(m.get(k + ".weight"), bf16_reference(want)) and rep.verified


# ------------------------------------------------------------------------------------------------ EXL2 -> GPTQ


@pytest.fixture(scope="module")
def lowbit_gptq(lowbit, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "lowbit-gptq"
    return out, convert(lowbit, out, "gptq", bits=4)   # the 4-bit path; the default is sized (issue 40)


def test_exl2_low_bit_to_gptq4_is_exact_and_round_trips_to_the_same_fp16(lowbit, lowbit_gptq, tmp_path):
    out, rep = lowbit_gptq
    assert rep.exact and rep.verified and all(l.verified for l in rep.layers)
    assert {l.target_format for l in rep.layers} == {"gptq", "dense"}              # lm_head stays dense
    fp16_via_gptq = tmp_path / "via-gptq"
    r2 = convert(out, fp16_via_gptq, "fp16")
    assert r2.source_format == "gptq" and r2.exact
    direct = tmp_path / "direct"
    convert(lowbit, direct, "fp16")
    a, b = open_model(fp16_via_gptq), open_model(direct)
    assert set(a.names()) == set(b.names())
    for n in b.names():
        assert np.array_equal(a.get(n).view(np.uint8), b.get(n).view(np.uint8)), n


def test_exl2_to_gptq_default_is_sized_and_flags_keep_the_old_path(sample, lowbit, lowbit_gptq, tmp_path):
    """Issue 40: without --bits/--group-size the GPTQ output lands at or just above the EXL2's size (the bits of
    the cheapest 2/3/4/8-bit x 128/64/32-row choice whose bits reach the source's; the widest group that splits
    every EXL2 group, so that groups of at most those bits are carried over exactly), every layer's error
    finite; --bits 4 stays the previous default, byte for byte."""
    from exl2fmt.converters.exl2_to_gptq import gptq_stored_bits, sized_bits_group

    assert sized_bits_group([(4096, 4096)], int(4.0 * 4096 * 4096)) == (4, 128)    # an EXL2 4.0 at real size
    assert sized_bits_group([(4096, 4096)], int(3.2 * 4096 * 4096)) == (3, 64)
    assert sized_bits_group([(4096, 4096)], int(5.0 * 4096 * 4096)) == (8, 128)    # no 5/6-bit GPTQ: above
    assert sized_bits_group([(64, 64)], 10 ** 9) == (8, 32)
    assert gptq_stored_bits(128, 64, 4, 128) == 128 * 64 * 4 + 64 * 20 + 128 * 32

    def size(d):
        return sum(f.stat().st_size for f in d.glob("*.safetensors"))

    sized = {}
    for src in (sample, lowbit):
        out = tmp_path / f"{src.name}-sized"
        rep = convert(src, out, "gptq")
        sz = sized[src] = rep.options["sized"]
        assert rep.verified and sz["gptq_bpw"] >= sz["source_bpw"]
        # the decoder layers at or just above the source's bpw (tiny K: g_idx and fp16 scales weigh more); the
        # file also holds the lm_head as dense fp16 (EXL2 -> GPTQ's rule for layers outside the blocks)
        assert sz["gptq_bpw"] <= 1.2 * sz["source_bpw"], sz
        assert size(out) <= 1.35 * size(src)
        assert all(np.isfinite(l.rel_error) and l.rel_error < 0.5 for l in rep.layers), [l.rel_error for l in rep.layers]
        assert rep.quantization_config["bits"] == sz["bits"] and rep.quantization_config["group_size"] == sz["group_size"]
        assert any("needs activation order" in w for w in rep.warnings) == rep.quantization_config["desc_act"]
        assert rep.summary()["mean_rel_error"] is not None
    old = tmp_path / "lowbit-4"
    convert(lowbit, old, "gptq", bits=4)
    # the sized default's group is the one --bits alone picks (the widest splitting every EXL2 group)
    assert sized[lowbit]["group_size"] == json.loads((old / "config.json").read_text())["quantization_config"][
        "group_size"]
    ref = lowbit_gptq[0]
    assert {p.name: p.read_bytes() for p in old.glob("*.safetensors")} == {
        p.name: p.read_bytes() for p in ref.glob("*.safetensors")}


def test_exl2_to_gptq_layout_and_config(lowbit, lowbit_gptq):
    out, rep = lowbit_gptq
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["sym"] is True
    assert qc["checkpoint_format"] == "gptq" and qc["desc_act"] is True
    assert qc["group_size"] == 32                   # o_proj and up_proj have 32-row EXL2 groups
    side = json.loads((out / "quantize_config.json").read_text())
    assert {k: side[k] for k in ("bits", "group_size", "desc_act", "sym")} == {k: qc[k] for k in
                                                                                ("bits", "group_size", "desc_act", "sym")}
    m, s = open_model(out), open_model(lowbit)
    k = "model.layers.0.mlp.down_proj"
    assert m.info(k + ".qweight").shape == (704 * 4 // 32, 256) and m.info(k + ".scales").shape == (704 // 32, 256)
    assert np.all(m.get(k + ".qzeros") == 2004318071)       # sym 4-bit v1 fingerprint 0x77777777
    # act-order: qweight rows in original order, g_idx[j] = stored row of j // group size
    inv = s.get(k + ".q_invperm")
    assert np.array_equal(m.get(k + ".g_idx"), inv // 32)
    assert np.bincount(m.get(k + ".g_idx")).tolist() == [32] * 22
    assert "lm_head.weight" in m and "lm_head.qweight" not in m
    assert rep.compatibility["exllama_v1_v2"]["compatible"]
    assert not rep.compatibility["vllm_gptq_marlin"]["compatible"]   # K = 704 is not a multiple of 128


def test_exl2_to_gptq8_of_the_full_sample_is_exact(sample, sample_fp16, tmp_path):
    rep = convert(sample, tmp_path / "gptq8", "gptq", bits=8)
    assert rep.exact and rep.quantization_config["bits"] == 8
    assert "exllama" in " ".join(rep.compatibility["exllama_v1_v2"]["reasons"])
    r2 = convert(tmp_path / "gptq8", tmp_path / "fp16", "fp16")
    a, b = open_model(tmp_path / "fp16"), open_model(sample_fp16[0])
    for l in r2.layers:
        assert np.array_equal(bits16(a.get(l.key + ".weight")), bits16(b.get(l.key + ".weight"))), l.key


def test_exl2_to_gptq_requantizes_wide_groups_and_reports_the_error(sample, tmp_path):
    rep = convert(sample, tmp_path / "gptq4", "gptq", bits=4, group_size=128)
    by = {l.key: l for l in rep.layers}
    assert by["model.layers.0.self_attn.q_proj"].exact       # 4b_128g/3b_128g embeds in 128-row groups
    wide = by["model.layers.1.self_attn.k_proj"]             # 1:8b_128g cannot fit 4 bits
    assert not wide.exact and wide.rows_requantized == 256 and 0.02 < wide.rel_error < 0.25
    straddle = by["model.layers.0.self_attn.o_proj"]          # 4b_32g groups inside 128-row GPTQ groups
    assert not straddle.exact and "straddle" in straddle.notes[0]
    # the reported errors are what the written model decodes to
    m = open_model(tmp_path / "gptq4")
    for l in (wide, straddle):
        got = dequantize_layer(tmp_path / "gptq4", l.key).astype(np.float32)
        ref = dequantize_layer(sample, l.key).astype(np.float32)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert abs(rel - l.rel_error) < 1e-5 and l.verified
    assert m.info("lm_head.weight").dtype == "F16"


# ------------------------------------------------------------------------------------------------ GPTQ -> EXL2


def test_gptq_to_exl2_error_is_bounded(tmp_path):
    src = build_gptq(tmp_path / "gptq", 4, 128, True, False, True)
    r4 = convert(src, tmp_path / "exl2-4", "exl2")
    r6 = convert(src, tmp_path / "exl2-6", "exl2", bits=6)
    assert r4.verified and r6.verified
    for l4, l6 in zip(r4.layers, r6.layers):
        assert l4.target_plan == "1:4b_128g" and l6.target_plan == "1:6b_128g"
        assert l4.rel_error < 0.08 and l6.rel_error < 0.03, (l4.key, l4.rel_error, l6.rel_error)
        for path, l in ((tmp_path / "exl2-4", l4), (tmp_path / "exl2-6", l6)):
            got = dequantize_layer(path, l.key).astype(np.float32)
            ref = dequantize_layer(src, l.key).astype(np.float32)
            assert abs(np.linalg.norm(got - ref) / np.linalg.norm(ref) - l.rel_error) < 1e-5
    from exl2fmt.validate import validate_model

    v = validate_model(tmp_path / "exl2-4", deep=True)
    assert not v.failed and v.format == "exl2"
    s, m = open_model(src), open_model(tmp_path / "exl2-4")
    k = "model.layers.0.mlp.up_proj"
    # act-order g_idx -> stored order sorted by g_idx: q_invperm = argsort(argsort(g_idx, stable))
    assert np.array_equal(m.get(k + ".q_invperm"), np.argsort(np.argsort(s.get(k + ".g_idx"), kind="stable")))
    assert json.loads((tmp_path / "exl2-4" / "config.json").read_text())["quantization_config"]["quant_method"] == "exl2"


def test_gptq_from_exl2_goes_back_to_exl2_exactly(lowbit_gptq, tmp_path):
    rep = convert(lowbit_gptq[0], tmp_path / "back", "exl2")
    assert rep.exact and rep.verified


def test_asymmetric_gptq_to_exl2_is_requantized(tmp_path):
    src = build_gptq(tmp_path / "gptq", 3, 64, False, True, False)
    rep = convert(src, tmp_path / "exl2", "exl2", bits=4)
    assert rep.verified and all(not l.exact and l.rel_error < 0.1 for l in rep.layers)


# ------------------------------------------------------------------------------------------------ safety


def test_source_is_never_modified(sample, lowbit, tmp_path):
    before = {d: tree_hashes(d) for d in (sample, lowbit)}
    convert(sample, tmp_path / "a", "bf16")
    convert(lowbit, tmp_path / "b", "gptq")
    convert(tmp_path / "b", tmp_path / "c", "exl2")
    convert(sample, tmp_path / "a", "fp16", force=True)
    assert {d: tree_hashes(d) for d in (sample, lowbit)} == before


def test_existing_destination_needs_force(sample, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "marker").write_text("old")
    with pytest.raises(Exl2Error) as e:
        convert(sample, dst, "fp16")
    assert e.value.code is ErrorCode.OUTPUT_EXISTS and (dst / "marker").exists()
    # --force replaces only a model directory (issue 12): not yet, this one holds no model
    with pytest.raises(Exl2Error) as e:
        convert(sample, dst, "fp16", force=True)
    assert e.value.code is ErrorCode.OUTPUT_EXISTS and "model directory" in e.value.message
    assert (dst / "marker").exists()
    (dst / "config.json").write_text("{}")
    (dst / "model.safetensors").write_bytes(b"old")
    rep = convert(sample, dst, "fp16", force=True)
    assert rep.verified and not (dst / "marker").exists() and (dst / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if ".exl2fmt-" in p.name]


def test_destination_inside_or_equal_to_source_is_refused(sample, tmp_path):
    for dst in (sample, sample / "converted", sample.parent):
        with pytest.raises(Exl2Error) as e:
            convert(sample, dst, "fp16", force=True)
        assert e.value.code is ErrorCode.USAGE
    assert (sample / "output.safetensors").exists() and not (sample / "converted").exists()
    # a single-file source: a sibling directory is fine, the file's own directory is not
    f = sample / "output.safetensors"
    with pytest.raises(Exl2Error) as e:
        convert(f, sample, "fp16", force=True)
    assert e.value.code is ErrorCode.USAGE
    rep = convert(f, tmp_path / "from-file", "fp16")
    # the config.json next to the file is used (vocab unpadding) and rewritten; other files are not copied
    assert rep.verified and (tmp_path / "from-file" / "config.json").exists()
    assert not (tmp_path / "from-file" / "tokenizer.json").exists()
    assert open_model(tmp_path / "from-file").info("lm_head.weight").shape == (1000, 256)


def test_an_interrupted_conversion_leaves_no_destination(sample, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    monkeypatch.setenv("EXL2FMT_TEST_FAIL_AFTER", "5")  # the test seam (not in convert's signature)
    with pytest.raises(RuntimeError, match="injected"):
        convert(sample, dst, "fp16")
    monkeypatch.delenv("EXL2FMT_TEST_FAIL_AFTER")
    assert not dst.exists() and list(tmp_path.iterdir()) == []

    def stop(done, total, what):
        if done > total // 4:  # half way through writing (total counts writing and verifying)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(sample, dst, "fp16", progress=stop)
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    # an existing destination survives a failed --force run untouched (a model directory: --force replaces
    # only those)
    dst.mkdir()
    (dst / "marker").write_text("old")
    (dst / "config.json").write_text("{}")
    (dst / "model.safetensors").write_bytes(b"old")
    monkeypatch.setenv("EXL2FMT_TEST_FAIL_AFTER", "3")
    with pytest.raises(RuntimeError):
        convert(sample, dst, "gptq", force=True)
    assert (dst / "marker").read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_a_killed_conversion_leaves_no_destination(sample, tmp_path):
    """A process that dies mid-way (no cleanup at all) leaves only the hidden working directory."""
    dst = tmp_path / "out"
    code = ("import os, sys\nfrom exl2fmt.converters import convert\n"
            "def die(done, total, what):\n    if done > total // 4: os._exit(9)\n"
            "convert(sys.argv[1], sys.argv[2], 'fp16', progress=die)\n")
    r = subprocess.run([sys.executable, "-c", code, str(sample), str(dst)], capture_output=True, timeout=300)
    assert r.returncode == 9, r.stderr.decode()[-2000:]
    assert not dst.exists()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out.exl2fmt-partial-")


def test_checksum_matches_a_python_fletcher64():
    from exl2fmt.container.checksums import Checksum, checksum

    x = np.random.default_rng(5).integers(0, 256, size=8 * 1000 + 5, dtype=np.uint8)
    a = b = 0
    for v in np.frombuffer(x.tobytes() + b"\0" * 3, dtype="<u8").tolist():
        a = (a + v) % 2**64
        b = (b + a) % 2**64
    c = Checksum().update(x[:13]).update(x[13:4000]).update(x[4000:])
    assert c.digest() == checksum(x) == (a, b, x.size)
    y = x.copy()
    y[[100, 108]] = y[[108, 100]]  # two bytes swapped between words: a is unchanged, b is not
    assert checksum(y)[0] == a and checksum(y)[1] != b


def test_verify_catches_bytes_that_differ_from_what_was_produced(sample, tmp_path, monkeypatch):
    import exl2fmt.container.checksums as checksums

    real = checksums.checksum

    def lying(data):
        a, b, n = real(data)
        return (a ^ 1, b, n) if n == 1000 * 256 * 2 else (a, b, n)   # lm_head and embed_tokens

    monkeypatch.setattr(checksums, "checksum", lying)
    with pytest.raises(Exl2Error) as e:
        convert(sample, tmp_path / "o", "fp16")
    assert e.value.code is ErrorCode.REFERENCE_MISMATCH
    assert e.value.tensor in ("model.embed_tokens.weight", "lm_head.weight")
    assert list(tmp_path.iterdir()) == []


def test_full_verify_catches_a_wrong_repack(lowbit, tmp_path, monkeypatch):
    import exl2fmt.converters.exl2_to_gptq as e2g

    real = e2g.exl2_layer_to_gptq

    def off_by_one(layer, *a, **k):
        codes, scales, zeros, g_idx, st = real(layer, *a, **k)
        if layer.key.endswith("layers.1.mlp.up_proj"):
            codes = codes.copy()
            codes[5, 7] ^= 1
        return codes, scales, zeros, g_idx, st

    monkeypatch.setattr(e2g, "exl2_layer_to_gptq", off_by_one)
    with pytest.raises(Exl2Error) as e:
        convert(lowbit, tmp_path / "g", "gptq")
    assert e.value.code is ErrorCode.REFERENCE_MISMATCH and e.value.tensor == "model.layers.1.mlp.up_proj"
    assert list(tmp_path.iterdir()) == []


def test_tied_exl2_head_is_written_and_untied(tmp_path):
    src = build_exl2(tmp_path / "tied")
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    rep = convert(src, tmp_path / "fp16", "fp16")
    out_cfg = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert out_cfg["tie_word_embeddings"] is False and any("tie_word_embeddings" in c for c in rep.config_changes)
    assert np.array_equal(bits16(open_model(tmp_path / "fp16").get("lm_head.weight")),
                          bits16(dequantize_layer(src, "lm_head")))


def test_progress_reports_bytes(sample, tmp_path):
    calls = []
    rep = convert(sample, tmp_path / "o", "fp16", progress=lambda d, t, w: calls.append((d, t, w)))
    # one monotonic count: bytes written, then bytes verified, out of 2 x the output bytes
    assert all(c[1] == 2 * rep.bytes_written for c in calls)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and calls[-1][0] == calls[-1][1]
    writes = [c for c in calls if not c[2].startswith("verify")]
    assert writes[-1][0] == rep.bytes_written and calls[-1][2].startswith("verify")


# ------------------------------------------------------------------------------------------------ CLI


def _app():
    import typer

    from exl2fmt.cli.convert import convert_command

    app = typer.Typer()
    app.command("convert")(convert_command)

    @app.command()
    def _noop() -> None:  # a second command so that typer keeps the sub-command name
        pass

    return app


def test_registering_the_cli_command_imports_nothing_heavy():
    code = ("import sys, exl2fmt.cli.convert\n"
            "heavy = [m for m in ('numba', 'numpy', 'torch', 'triton') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_cli_convert(sample, tmp_path):
    from typer.testing import CliRunner

    app = _app()
    r = CliRunner().invoke(app, ["convert", "--help"])
    assert r.exit_code == 0 and "--to" in r.output and "Examples" in r.output
    r = CliRunner().invoke(app, ["convert", str(sample), str(tmp_path / "o"), "--to", "FP16"])
    assert r.exit_code == 0, r.output
    assert "exl2 -> fp16: 15 linear layers (15 exact, 0 lossy)" in r.output
    r = CliRunner().invoke(app, ["convert", str(sample), str(tmp_path / "o"), "--to", "fp16"])
    assert r.exit_code == 2 and "OUTPUT_EXISTS" in r.output
    r = CliRunner().invoke(app, ["convert", str(sample), str(tmp_path / "g"), "--to", "gptq", "--json"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["report"] == "convert" and doc["target"] == "gptq" and doc["verified"] is True
    assert doc["summary"]["layers"] == 15 and "vllm_gptq_marlin" in doc["compatibility"]
    # --status-lines: JSON progress lines on stderr, the report alone on stdout
    r = CliRunner().invoke(app, ["convert", str(sample), str(tmp_path / "s"), "--to", "fp16", "--json",
                                 "--status-lines"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["target"] == "fp16"
    status = [json.loads(line) for line in r.stderr.splitlines()]
    # the original keys, plus the overall fraction, the phase and a settled ETA (issue 12)
    assert status and all(set(d) == {"status", "done", "total", "what", "elapsed_s", "phase", "fraction", "eta_s"}
                          for d in status)
    assert status[-1]["fraction"] == 1.0
    assert status[-1]["done"] == status[-1]["total"] > 0 and status[-1]["status"] == "convert -> fp16"
    assert [d["elapsed_s"] for d in status] == sorted(d["elapsed_s"] for d in status)
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "o"), str(tmp_path / "x"), "--to", "exl2"])
    assert r.exit_code == 1 and "CALIBRATION_INVALID" in r.output
    # --work-dir is where the quantizer keeps its state (in its own marked .DST.exl2fmt-work there): a leftover
    # job needs --resume
    from exl2fmt.quant.workdir import make_work_dir

    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    (tmp_path / "wd").mkdir()
    make_work_dir(tmp_path / "wd" / ".q.exl2fmt-work", tmp_path / "q")
    (tmp_path / "wd" / ".q.exl2fmt-work" / "job.json").write_text("{}")
    r = CliRunner().invoke(app, ["convert", str(fixture), str(tmp_path / "q"), "--to", "exl2", "--rows", "2",
                                 "--length", "32", "--work-dir", str(tmp_path / "wd")])
    assert r.exit_code == 2 and "OUTPUT_EXISTS" in r.output and "wd" in r.output and "--resume" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "missing"), str(tmp_path / "y"), "--to", "fp16"])
    assert r.exit_code == 3


# ------------------------------------------------------------------------------------------------ peers


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def _autogptq_quantlinear():
    """AutoGPTQ's own QuantLinear (``qlinear_cuda``), loaded from the installed package by file path: the
    package's ``__init__`` imports modeling code that current transformers no longer provides, but the layer
    module needs only torch, numpy and transformers.  Without the CUDA extension it decodes in plain torch."""
    spec = importlib.util.find_spec("auto_gptq")
    path = Path(spec.submodule_search_locations[0]) / "nn_modules" / "qlinear" / "qlinear_cuda.py"
    s = importlib.util.spec_from_file_location("_exl2fmt_peer_autogptq_qlinear_cuda", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod.QuantLinear


@pytest.mark.skipif(not (_have("torch") and _have("auto_gptq") and _have("transformers")),
                    reason="peer check needs the 'peers' extra (torch, transformers, auto-gptq)")
@pytest.mark.parametrize("bits", [4, 3, 8])
def test_peer_autogptq_decodes_exl2fmt_gptq_identically(sample, lowbit, tmp_path, bits):
    import torch

    QuantLinear = _autogptq_quantlinear()
    src = lowbit if bits == 4 else sample
    rep = convert(src, tmp_path / "gptq", "gptq", bits=bits, group_size=64 if bits == 3 else None)
    m = open_model(tmp_path / "gptq")
    checked = 0
    for l in rep.layers:
        if l.target_format != "gptq":
            continue
        N, K = l.shape
        gs = rep.quantization_config["group_size"]
        ql = QuantLinear(bits=bits, group_size=gs, infeatures=K, outfeatures=N, bias=False)
        sd = {s: torch.from_numpy(np.array(m.get(f"{l.key}.{s}"))) for s in ("qweight", "qzeros", "scales", "g_idx")}
        ql.load_state_dict(sd, strict=True)
        with torch.no_grad():  # the peer's torch path: x @ (scales[g_idx] * (w - zeros[g_idx])), x = identity
            peer = ql(torch.eye(K, dtype=torch.float16)).numpy()      # [K, N] = W^T
        ours = dequantize_layer(tmp_path / "gptq", l.key)            # [N, K]
        assert np.array_equal(peer.T, ours), l.key
        if l.exact:
            assert np.array_equal(bits16(ours), bits16(dequantize_layer(src, l.key)))
        checked += 1
    assert checked == 14


def _numpy_llama_logits(weights: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """A float32 NumPy Llama forward (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU)."""
    h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    W = {k: v.astype(np.float32) for k, v in weights.items()}

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    T_ = ids.shape[0]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.arange(T_, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [heads, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    x = W["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T_, T_), -np.inf, dtype=np.float32), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, W[p + "input_layernorm.weight"])
        q = (a @ W[p + "self_attn.q_proj.weight"].T).reshape(T_, nh, hd).transpose(1, 0, 2)
        k = (a @ W[p + "self_attn.k_proj.weight"].T).reshape(T_, nkv, hd).transpose(1, 0, 2)
        v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(T_, nkv, hd).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        rep_ = nh // nkv
        k, v = np.repeat(k, rep_, 0), np.repeat(v, rep_, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T_, nh * hd)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        a = rms(x, W[p + "post_attention_layernorm.weight"])
        g = a @ W[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (a @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


@pytest.mark.skipif(not (_have("torch") and _have("transformers")),
                    reason="peer check needs the 'peers' extra (torch, transformers)")
def test_peer_transformers_loads_the_fp16_output(sample, sample_fp16):
    import torch
    from transformers import AutoModelForCausalLM

    out, rep = sample_fp16
    try:
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    model.eval()
    sd = model.state_dict()
    src = open_model(sample)
    weights = {}
    for key in [l.key for l in rep.layers]:
        w = dequantize_layer(sample, key)                         # the core's reconstruction of SRC
        assert np.array_equal(sd[f"{key}.weight"].numpy(), w.astype(np.float32)), key
        weights[f"{key}.weight"] = w
    for n in src.names():
        if ".q_" not in n:
            weights[n] = src.get(n)
            assert np.array_equal(sd[n].numpy(), src.get(n).astype(np.float32)), n
    ids = np.array([1, 17, 256, 999, 3, 500, 42, 7], dtype=np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    ref = _numpy_llama_logits(weights, SAMPLE_CONFIG, ids)
    assert logits.shape == (8, 1000)
    np.testing.assert_allclose(logits, ref, rtol=2e-4, atol=2e-4 * float(np.abs(ref).max()))
