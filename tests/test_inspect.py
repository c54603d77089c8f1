"""Tests of exl2fmt.inspect and exl2fmt.detect: header-only inspection and format detection.

Oracles: the ``safetensors`` library (independent parser) for byte counts, ``sample_dense_tensors`` (the FP16
model the sample is quantized from) for logical parameter counts, the upstream shape rules of
gptq-gguf-formats A1/A11 written out by hand for GPTQ/AWQ layers, and the ``gguf`` package's writer.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from exl2fmt.codec import oracle
from exl2fmt.container import RawTensor, write_safetensors
from exl2fmt.detect import detect_layers
from exl2fmt.layout import Format
from exl2fmt.errors import ErrorCode, Exl2Error
from exl2fmt.inspect import inspect_model, is_gguf
from exl2fmt.names import block_of, has_control_chars, layer_order_key
from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    write_sample(d)
    return d


def _write(d: Path, tensors: dict, config: dict | None = None, metadata=None, name="model.safetensors") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(d / name, tensors, metadata=metadata)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


# ------------------------------------------------------------------------------------------------ sample


def test_sample_summary_against_independent_oracles(sample_dir):
    rep = inspect_model(sample_dir)
    assert rep["report"] == "inspect" and rep["format"]["name"] == "exl2"
    assert rep["format"]["config_quant_method"] == "exl2"
    s = rep["summary"]
    # logical parameters = element count of the FP16 model the sample was quantized from
    dense = sample_dense_tensors()
    assert s["parameters"] == sum(a.size for a in dense.values())
    # stored bytes = what the reference safetensors parser loads
    ref = load_file(str(sample_dir / "output.safetensors"))
    assert s["stored_bytes"] == sum(a.nbytes for a in ref.values())
    assert s["tensors"] == len(ref)
    assert s["file_bytes"] == os.path.getsize(sample_dir / "output.safetensors")
    assert s["architecture"] == "LlamaForCausalLM" and s["num_hidden_layers"] == 2 and s["blocks"] == 2
    assert s["linear_layers"] == 15 and s["layers_by_format"] == {"exl2": 15}
    # decoder bpw: bytes of every q_* tensor of the decoder layers / sum K * N_pad (ExLlamaV2's convention)
    dec_bits = sum(a.nbytes * 8 for n, a in ref.items() if n.startswith("model.layers.") and ".q_" in n)
    dec_numel = sum(ref[n].shape[0] * ref[n[: -len("q_invperm")] + "q_weight"].shape[1]
                    for n in ref if n.startswith("model.layers.") and n.endswith(".q_invperm"))
    assert s["bpw"]["decoder"] == pytest.approx(dec_bits / dec_numel, abs=1e-6)
    head_bits = sum(a.nbytes * 8 for n, a in ref.items() if n.startswith("lm_head."))
    assert s["bpw"]["head"] == pytest.approx(head_bits / (256 * 1024), abs=1e-6)
    assert s["bpw"]["embeddings"] == pytest.approx(16.0)
    assert s["bpw"]["overall"] == pytest.approx(s["stored_bytes"] * 8 / s["parameters"], abs=1e-6)
    assert rep["producer"]["name"] == "exl2fmt" and rep["producer"]["version"]
    assert rep["issues"] == []


def test_sample_layer_rows(sample_dir):
    rep = inspect_model(sample_dir)
    rows = {r["key"]: r for r in rep["layers"]}
    ref = load_file(str(sample_dir / "output.safetensors"))
    for key, r in rows.items():
        K = ref[key + ".q_invperm"].shape[0]
        n_pad = ref[key + ".q_weight"].shape[1]
        assert (r["in_features"], r["out_features_stored"]) == (K, n_pad)
        assert r["act_order"] is True and r["bias"] is False
        # the plan's bit histogram recomputed from the raw q_groups pairs (bits, qrow)
        qg = ref[key + ".q_groups"].astype(int)
        bits, qrow = qg[0::2], list(qg[1::2]) + [ref[key + ".q_weight"].shape[0]]
        hist: dict[str, int] = {}
        for g, b in enumerate(bits):
            rows_g = (qrow[g + 1] - qrow[g]) * 32 // b
            hist[str(b)] = hist.get(str(b), 0) + rows_g * n_pad
        assert r["bits"] == hist
        assert r["groups"] == len(bits)
        assert r["stored_bytes"] == sum(a.nbytes for n, a in ref.items() if n.startswith(key + "."))
    # lm_head: N = vocab 1000 from config.json, stored padded to 1024
    assert rows["lm_head"]["out_features"] == 1000 and rows["lm_head"]["out_features_stored"] == 1024
    assert rows["lm_head"]["block"] == "head"
    assert rows["model.layers.0.self_attn.o_proj"]["plan"] == "1:4b_32g"  # SAMPLE_PLANS: T((1.0, 4, 32))
    # decoder blocks in order, then the head
    assert [r["key"] for r in rep["layers"]][-1] == "lm_head"
    assert [b["block"] for b in rep["blocks"]] == ["model.layers.0", "model.layers.1", "head"]
    assert sum(b["params"] for b in rep["blocks"]) == sum(r["params"] for r in rep["layers"])


def test_histogram_matches_layers(sample_dir):
    rep = inspect_model(sample_dir)
    dec = [r for r in rep["layers"] if r["block"] not in ("head", None)]
    total = {}
    for r in dec:
        for b, w in r["bits"].items():
            total[int(b)] = total.get(int(b), 0) + w
    h = rep["bits_histogram"]["decoder"]
    assert {e["bits"]: e["weights"] for e in h} == total
    assert sorted(total) == [2, 3, 4, 5, 6, 8]  # the sample uses all six widths
    assert sum(e["fraction"] for e in h) == pytest.approx(1.0, abs=1e-5)
    assert sum(total.values()) == sum(r["in_features"] * r["out_features_stored"] for r in dec)


def test_inspect_reads_only_q_groups(sample_dir, monkeypatch):
    """Header-only: the only tensor data touched is each EXL2 layer's q_groups."""
    from exl2fmt import container

    touched = []

    def spy(orig):
        def read(self, name):
            touched.append(name)
            return orig(self, name)
        return read

    for reader in ("get", "get_bytes"):  # inspect reads q_groups as raw bytes (no numpy needed)
        monkeypatch.setattr(container.SafetensorsFile, reader, spy(getattr(container.SafetensorsFile, reader)))
    rep = inspect_model(sample_dir)
    assert touched and all(n.endswith(".q_groups") for n in touched)
    assert len(touched) == rep["summary"]["linear_layers"]


def test_inspect_does_not_import_numba_torch_triton(sample_dir):
    code = ("import sys, json; from exl2fmt.inspect import inspect_model; inspect_model(sys.argv[1]); "
            "print(json.dumps([m for m in ('numba', 'torch', 'triton') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(sample_dir)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_no_layers_flag_keeps_summary(sample_dir):
    full, short = inspect_model(sample_dir), inspect_model(sample_dir, layers=False)
    assert short["layers"] == [] and short["summary"] == full["summary"] and short["blocks"] == full["blocks"]


def test_invalid_q_groups_reported_not_fatal(tmp_path, sample_dir):
    t = load_file(str(sample_dir / "output.safetensors"))
    qg = t["model.layers.0.self_attn.o_proj.q_groups"].copy()
    qg[0] = 7  # a bit width that does not exist
    t["model.layers.0.self_attn.o_proj.q_groups"] = qg
    d = _write(tmp_path / "m", t, json.loads((sample_dir / "config.json").read_text()))
    rep = inspect_model(d)
    row = next(r for r in rep["layers"] if r["key"] == "model.layers.0.self_attn.o_proj")
    assert row["plan"] is None and "7" in row["error"]
    assert [i["code"] for i in rep["issues"]] == ["GROUPS_BITS"]


# ------------------------------------------------------------------------------------------------ detection


def _gptq_layer(K, N, bits, gs, rng, act_order=False, bias=False):
    """GPTQ tensors built with the NumPy oracle packer (gptq-gguf-formats A1/A2 shapes)."""
    G = K // gs
    codes = rng.integers(0, 1 << bits, size=(K, N)).astype(np.uint8)
    fields = np.full((G, N), (1 << (bits - 1)) - 1, dtype=np.uint8)  # sym v1: z - 1 = 2^(b-1) - 1
    out = {
        "qweight": oracle.gptq_pack_rows(codes, bits),
        "qzeros": oracle.gptq_pack_rows(np.ascontiguousarray(fields.T), bits).T.copy(),
        "scales": (rng.random((G, N)) * 0.01 + 0.001).astype(np.float16),
        "g_idx": (rng.permutation(K) // gs if act_order else np.arange(K) // gs).astype(np.int32),
    }
    if bias:
        out["bias"] = np.zeros(N, dtype=np.float16)
    return out


def _llama_dense_rest(h=64, vocab=96, n_layers=1):
    t = {"model.embed_tokens.weight": np.zeros((vocab, h), np.float16), "model.norm.weight": np.ones(h, np.float16)}
    for i in range(n_layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = np.ones(h, np.float16)
    return t


def test_gptq_detection_and_variant(tmp_path):
    rng = np.random.default_rng(1)
    t = _llama_dense_rest()
    for name, (K, N) in {"self_attn.q_proj": (64, 64), "mlp.down_proj": (128, 64)}.items():
        for slot, a in _gptq_layer(K, N, 4, 32, rng, act_order=True).items():
            t[f"model.layers.0.{name}.{slot}"] = a
    t["lm_head.weight"] = np.zeros((96, 64), np.float16)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 96,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                   "sym": True, "checkpoint_format": "gptq",
                                   "meta": {"quantizer": ["gptqmodel:2.2.0"]}}}
    rep = inspect_model(_write(tmp_path / "g", t, cfg))
    f = rep["format"]
    assert f["name"] == "gptq" and f["label"] == "GPTQ v1 4-bit g32 sym act-order"
    assert f["variant"]["version"] == 1 and f["variant"]["act_order"] is True
    rows = {r["key"]: r for r in rep["layers"]}
    assert rows["model.layers.0.mlp.down_proj"]["plan"] == "1:4b_32g"
    assert (rows["model.layers.0.mlp.down_proj"]["in_features"], rows["model.layers.0.mlp.down_proj"]["out_features"]) == (128, 64)
    assert rows["lm_head"]["format"] == "dense"  # a GPTQ model keeps lm_head dense; the model is still GPTQ
    assert rep["producer"] == {"name": "gptqmodel", "version": "2.2.0", "source": "quantization_config.meta.quantizer"}
    # bpw = stored bits / (K * N)
    r = rows["model.layers.0.mlp.down_proj"]
    assert r["bpw"] == pytest.approx(r["stored_bytes"] * 8 / (128 * 64))
    assert rep["issues"] == []


@pytest.mark.parametrize("qc, label", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
      "checkpoint_format": "gptq_v2"}, "GPTQ v2 4-bit g32 asym no act-order"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "GPTQ v1 4-bit g32 sym? act-order?"),
])
def test_gptq_variants_from_config(tmp_path, qc, label):
    rng = np.random.default_rng(2)
    t = {f"model.layers.0.mlp.up_proj.{s}": a for s, a in _gptq_layer(64, 64, 4, 32, rng).items()}
    rep = inspect_model(_write(tmp_path / "g", t, {"quantization_config": qc}))
    assert rep["format"]["label"] == label


def test_gptq_without_g_idx_is_not_act_order(tmp_path):
    rng = np.random.default_rng(3)
    layer = _gptq_layer(64, 64, 8, 64, rng)
    del layer["g_idx"]
    t = {f"model.layers.0.mlp.up_proj.{s}": a for s, a in layer.items()}
    rep = inspect_model(_write(tmp_path / "g", t))
    assert rep["format"]["variant"]["bits"] == 8 and rep["format"]["variant"]["act_order"] is False
    assert rep["layers"][0]["act_order"] is False and rep["layers"][0]["plan"] == "1:8b_64g"


def test_awq_recognised_by_shapes(tmp_path):
    K, N, gs = 128, 64, 32
    t = {"model.layers.0.mlp.up_proj.qweight": np.zeros((K, N // 8), np.int32),   # packed along N
         "model.layers.0.mlp.up_proj.qzeros": np.zeros((K // gs, N // 8), np.int32),
         "model.layers.0.mlp.up_proj.scales": np.ones((K // gs, N), np.float16)}
    rep = inspect_model(_write(tmp_path / "a", t, {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                                            "group_size": 32, "version": "gemm"}}))
    assert rep["format"]["name"] == "awq" and rep["format"]["label"] == "AWQ 4-bit g32 gemm"
    r = rep["layers"][0]
    assert (r["format"], r["in_features"], r["out_features"], r["plan"]) == ("awq", K, N, "1:4b_32g")
    assert rep["issues"] == []


def test_exl3_layer_row(tmp_path):
    K, N, bits = 64, 128, 3
    t = {"model.layers.0.mlp.up_proj.trellis": np.zeros((K // 16, N // 16, 16 * bits), np.int16),
         "model.layers.0.mlp.up_proj.suh": np.ones(K, np.float16),
         "model.layers.0.mlp.up_proj.svh": np.ones(N, np.float16)}
    rep = inspect_model(_write(tmp_path / "e", t, {"quantization_config": {"quant_method": "exl3", "bits": 3.0}}))
    assert rep["format"]["name"] == "exl3"
    r = rep["layers"][0]
    assert (r["in_features"], r["out_features"], r["plan"], r["codebook"]) == (K, N, "3b trellis 3inst", "3inst")
    assert r["bpw"] == pytest.approx((K * N * 3 + (K + N) * 16) / (K * N))


def test_exl3_named_by_config_only(tmp_path):
    t = {"model.layers.0.mlp.up_proj.packed": np.zeros((4, 4), np.int16)}
    rep = inspect_model(_write(tmp_path / "e", t, {"quantization_config": {"quant_method": "exl3", "bits": 4.0}}))
    assert rep["format"]["name"] == "exl3" and "no trellis" in rep["format"]["label"]
    rep = inspect_model(_write(tmp_path / "u", t))
    assert rep["format"]["name"] == "unknown"


def test_dense_bf16(tmp_path):
    t = {"model.layers.0.mlp.up_proj.weight": RawTensor(dtype="BF16", shape=(32, 16), data=np.zeros((32, 16), np.uint16)),
         "model.layers.0.post_attention_layernorm.weight": RawTensor(dtype="BF16", shape=(16,), data=np.zeros(16, np.uint16))}
    rep = inspect_model(_write(tmp_path / "d", t))
    assert rep["format"]["name"] == "dense" and rep["format"]["label"] == "dense BF16"
    assert rep["layers"][0]["plan"] == "bf16" and rep["layers"][0]["bpw"] == pytest.approx(16.0)
    assert rep["summary"]["parameters"] == 32 * 16 + 16


def test_config_and_tensors_disagree(tmp_path, sample_dir):
    cfg = json.loads((sample_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(sample_dir / "output.safetensors", d / "output.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    rep = inspect_model(d)
    assert rep["format"]["name"] == "exl2"  # tensors decide
    codes = [i["code"] for i in rep["issues"]]
    # the shard is a symlink out of the model directory: a warning naming the target (issue 11)
    assert codes == ["SHARD_OUTSIDE_MODEL", "FORMAT_MISMATCH"]
    assert rep["issues"][0]["severity"] == "warning"
    assert str((sample_dir / "output.safetensors").resolve()) in rep["issues"][0]["message"]
    assert "gptq" in rep["issues"][1]["message"] and rep["issues"][1]["file"].endswith("config.json")


def test_ambiguous_and_mixed_layers(tmp_path):
    rng = np.random.default_rng(4)
    t = {"model.layers.0.mlp.up_proj.weight": np.zeros((64, 64), np.float16)}
    t.update({f"model.layers.0.mlp.up_proj.{s}": a for s, a in _gptq_layer(64, 64, 4, 32, rng).items()})
    t["model.layers.0.mlp.down_proj.trellis"] = np.zeros((8, 8, 48), np.int16)  # 128 x 128: EXL3 pads to 128
    layers = detect_layers({n: _Info(n, a) for n, a in t.items()})
    assert layers["model.layers.0.mlp.up_proj"].format is Format.GPTQ
    assert layers["model.layers.0.mlp.up_proj"].ambiguous == ("dense",)
    rep = inspect_model(_write(tmp_path / "x", t))
    assert rep["format"]["name"] == "mixed"
    assert sorted(i["code"] for i in rep["issues"]) == ["FORMAT_AMBIGUOUS", "FORMAT_AMBIGUOUS"]


class _Info:
    """Minimal TensorInfo stand-in for detect_layers."""

    def __init__(self, name, a):
        self.name, self.shape, self.file = name, tuple(a.shape), "f"
        self.dtype = {np.dtype(np.float16): "F16", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16"}[a.dtype]
        self.nbytes = a.nbytes
        self.bits = a.dtype.itemsize * 8


def test_embeddings_and_norms_are_not_layers():
    t = {"model.embed_tokens.weight": np.zeros((10, 4), np.float16),
         "model.layers.0.input_layernorm.weight": np.zeros((4,), np.float16),
         "model.layers.0.q_norm.weight": np.zeros((4, 4), np.float16),
         "model.layers.0.mlp.up_proj.weight": np.zeros((8, 4), np.float16)}
    assert list(detect_layers({n: _Info(n, a) for n, a in t.items()})) == ["model.layers.0.mlp.up_proj"]


def test_control_characters_in_names_are_reported(tmp_path):
    bad = "model.layers.0.mlp.up\x1b[2J\nproj.weight"
    rep = inspect_model(_write(tmp_path / "c", {bad: np.zeros((4, 4), np.float16)}))
    assert any(i["code"] == "NAME_CONTROL_CHARS" and i["tensor"] == bad for i in rep["issues"])
    assert has_control_chars(bad) and not has_control_chars("model.layers.0.mlp.up_proj.weight")


def test_ordering_and_blocks():
    keys = ["lm_head", "model.layers.10.mlp.up_proj", "model.layers.2.mlp.up_proj", "model.vision.proj"]
    assert sorted(keys, key=layer_order_key) == ["model.layers.2.mlp.up_proj", "model.layers.10.mlp.up_proj",
                                                 "model.vision.proj", "lm_head"]
    assert block_of("model.layers.12.mlp.down_proj") == "model.layers.12"
    assert block_of("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert block_of("lm_head") is None


def test_producer_from_metadata(tmp_path):
    rng = np.random.default_rng(5)
    t = {f"model.layers.0.mlp.up_proj.{s}": a for s, a in _gptq_layer(64, 64, 4, 32, rng).items()}
    rep = inspect_model(_write(tmp_path / "p", t, metadata={"format": "pt", "auto_gptq_version": "0.7.1"}))
    assert rep["producer"] == {"name": "auto_gptq", "version": "0.7.1", "source": "__metadata__.auto_gptq_version"}


# ------------------------------------------------------------------------------------------------ errors


def test_unreadable_inputs(tmp_path):
    with pytest.raises(Exl2Error) as e:
        inspect_model(tmp_path / "missing")
    assert e.value.code is ErrorCode.PATH_NOT_FOUND
    (tmp_path / "x.bin").write_bytes(b"\0" * 64)
    with pytest.raises(Exl2Error) as e:
        inspect_model(tmp_path / "x.bin")
    assert e.value.code is ErrorCode.UNSUPPORTED_INPUT
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(Exl2Error) as e:
        inspect_model(empty)
    assert e.value.code is ErrorCode.NO_SAFETENSORS and "model.gguf" in e.value.message


# ------------------------------------------------------------------------------------------------ GGUF

gguf = pytest.importorskip("gguf")


def _write_gguf(path: Path):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_name("tiny")
    w.add_tensor("token_embd.weight", np.zeros((96, 64), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((128, 64), np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.add_tensor("output.weight", np.zeros((96, 64), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_summary(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_gguf(p)
    assert is_gguf(p)
    rep = inspect_model(p)
    assert rep["input"] == "gguf" and rep["format"]["name"] == "gguf"
    g = rep["gguf"]
    assert g["tensor_count"] == 4 and g["metadata"]["general.architecture"] == "llama"
    assert {e["type"]: e["tensors"] for e in g["types"]} == {"F32": 2, "F16": 2}
    assert rep["summary"]["parameters"] == 96 * 64 + 128 * 64 + 64 + 96 * 64
    assert rep["summary"]["num_hidden_layers"] == 1 and rep["summary"]["architecture"] == "llama"
    up = next(r for r in rep["layers"] if r["key"] == "blk.0.ffn_up.weight")
    assert (up["in_features"], up["out_features"], up["plan"], up["bpw"]) == (64, 128, "F16", 16.0)


def test_gguf_magic_without_suffix(tmp_path):
    p = tmp_path / "weights.bin"
    _write_gguf(p)
    assert inspect_model(p)["format"]["name"] == "gguf"


def _gguf_bytes(kv_payload: bytes, n_kv=1, n_tensors=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv_payload


@pytest.mark.parametrize("blob, what", [
    (b"GGUF" + struct.pack("<I", 9) + b"\0" * 16, "version"),
    # key "a", type ARRAY of UINT8 with 2**62 elements: must fail fast without allocating
    (_gguf_bytes(struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 1 << 62)), "array"),
    # a string claiming 2**40 bytes
    (_gguf_bytes(struct.pack("<Q", 1) + b"a" + struct.pack("<IQ", 8, 1 << 40)), "string"),
    # arrays of arrays of arrays
    (_gguf_bytes(struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1)
                 + struct.pack("<IQ", 9, 1) + b"\0" * 32), "nested"),
    (_gguf_bytes(b"", n_kv=1 << 40), "key/value"),
])
def test_gguf_hostile_headers(tmp_path, blob, what):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob + b"\0" * 8)
    with pytest.raises(Exl2Error) as e:
        inspect_model(p)
    assert e.value.code is ErrorCode.GGUF_INVALID and e.value.file == str(p)


def test_gguf_without_package(tmp_path, monkeypatch):
    p = tmp_path / "tiny.gguf"
    _write_gguf(p)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(Exl2Error) as e:
        inspect_model(p)
    assert e.value.code is ErrorCode.UNSUPPORTED_INPUT and "exl2fmt[gguf]" in e.value.message


def test_sample_config_matches_sample_constants():
    """The inspector's numbers above rely on these sample facts; fail loudly if the sample changes shape."""
    assert SAMPLE_CONFIG["vocab_size"] == 1000 and SAMPLE_CONFIG["hidden_size"] == 256


# ------------------------------------------------------------------------------------------------ config features

_LLAMA = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 8, "num_key_value_heads": 2,
          "vocab_size": 96}
_FEATURE_CASES = [  # (config, key, expected (in, out)) worked out by hand from the config's numbers
    (_LLAMA, "model.layers.0.self_attn.q_proj", (64, 64)),      # head_dim = 64 / 8 = 8
    (_LLAMA, "model.layers.3.self_attn.k_proj", (64, 16)),      # 2 kv heads x 8
    (_LLAMA, "model.layers.3.self_attn.o_proj", (64, 64)),
    (_LLAMA, "model.layers.1.mlp.down_proj", (176, 64)),
    (_LLAMA, "lm_head", (64, 96)),
    (_LLAMA, "model.layers.1.mlp.c_fc", (64, 176)),             # starcoder2 names, only under .mlp.
    (_LLAMA, "model.layers.1.attn.c_fc", (None, None)),
    (_LLAMA, "model.layers.1.block_sparse_moe.experts.2.w2", (176, 64)),
    (_LLAMA, "model.layers.1.mlp.w2", (None, None)),             # w1/w2/w3 only inside experts
    (dict(_LLAMA, head_dim=16), "model.layers.0.self_attn.qkv_proj", (64, 8 * 16 + 2 * 2 * 16)),
    (dict(_LLAMA, moe_intermediate_size=32), "model.layers.0.mlp.experts.7.up_proj", (64, 32)),
    (dict(_LLAMA, moe_intermediate_size=32), "model.layers.0.mlp.gate_up_proj", (64, 352)),
    (dict(_LLAMA, shared_expert_intermediate_size=48), "model.layers.0.mlp.shared_expert.gate_proj", (64, 48)),
    (dict(_LLAMA, moe_intermediate_size=32, n_shared_experts=2), "model.layers.0.mlp.shared_experts.down_proj",
     (64, 64)),
    (dict(_LLAMA, moe_intermediate_size=32), "model.layers.0.mlp.shared_experts.down_proj", (None, 64)),
    (dict(_LLAMA, kv_lora_rank=16), "model.layers.0.self_attn.q_proj", (64, None)),
    ({"text_config": _LLAMA, "model_type": "x"}, "model.layers.0.mlp.up_proj", (64, 176)),
    (None, "lm_head", (None, None)),
    ({"hidden_size": True}, "lm_head", (None, None)),
]


@pytest.mark.parametrize("config,key,want", _FEATURE_CASES)
def test_expected_features_by_hand(config, key, want):
    from exl2fmt.arch import expected_features, features_of

    assert expected_features(config, key) == want
    feats = features_of(config)  # one function for many keys gives the same, whatever was asked before
    for other_config, other_key, _ in _FEATURE_CASES:
        if other_config is config:
            feats(other_key)
    assert feats(key) == want


def test_plan_memo_never_hides_a_broken_layer(tmp_path, sample_dir):
    """Two layers store the same q_groups bytes; in one, q_weight has a row more (the last group no longer packs
    whole rows).  The decoded-plan memo is keyed by the bytes and the q_weight rows, so the second layer still
    gets its error, and a fresh process gives the same report as a warm one."""
    from exl2fmt.formats import exl2 as exl2_format

    t = load_file(str(sample_dir / "output.safetensors"))
    a, b = "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"
    t[b + ".q_groups"] = t[a + ".q_groups"].copy()
    qw = t[a + ".q_weight"]
    t[b + ".q_weight"] = np.concatenate([qw, qw[:1]])
    d = _write(tmp_path / "m", t, json.loads((sample_dir / "config.json").read_text()))
    exl2_format._PLAN_MEMO.clear()
    cold = inspect_model(d)
    warm = inspect_model(d)
    assert cold == warm and len(exl2_format._PLAN_MEMO) > 0
    rows = {r["key"]: r for r in warm["layers"]}
    assert rows[a]["plan"] and rows[a]["error"] is None
    assert rows[b]["plan"] is None and rows[b]["error"] and [i["tensor"] for i in warm["issues"]] == [b + ".q_groups"]
    other = tmp_path / "fresh.json"
    code = ("import json, sys; from exl2fmt.inspect import inspect_model; "
            "open(sys.argv[2], 'w').write(json.dumps(inspect_model(sys.argv[1])))")
    subprocess.run([sys.executable, "-c", code, str(d), str(other)], check=True)
    assert json.loads(other.read_text()) == json.loads(json.dumps(warm))
