"""The GGUF bridge (issue 7): EXL2 / GPTQ / dense -> GGUF and GGUF -> FP16.

Oracles: the Q/K row order written out here from its index formula (gptq-gguf-formats B7), a float32
``s * (q - z)`` GPTQ decode computed here from the oracle unpacker, ``gguf.quants.dequantize`` (the package's own
block decoder) for what the file holds, transformers' GGUF loader as a peer reader of names, row order and
config, and the existing EXL2/GPTQ -> FP16 converter (itself checked bit for bit against the core decoders).
The llama.cpp runtime check lives in bench/gguf_llamacpp_check.py (building llama.cpp is too slow for CI); the
last test here runs it on a tiny model only when llama-cpp-python happens to be installed.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from exl2fmt import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.codec import oracle  # noqa: E402
from exl2fmt.container import open_model, write_sharded  # noqa: E402
from exl2fmt.converters import convert  # noqa: E402
from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample  # noqa: E402

CFG = SAMPLE_CONFIG
N_HEAD, N_KV, HEAD_DIM = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]


# ------------------------------------------------------------------------------------------------ fixtures


def hf_to_gguf_rows(R: int, heads: int) -> np.ndarray:
    """Independent oracle (B7): ``src[r]`` = the Hugging Face row that GGUF row ``r`` holds."""
    d = R // heads
    src = np.empty(R, dtype=np.int64)
    for h in range(heads):
        for i in range(d // 2):
            for t in (0, 1):
                src[h * d + 2 * i + t] = h * d + t * (d // 2) + i
    return src


def build_dense(d: Path, model_type="llama", bias=False, bf16=False, qk_scale=1.0) -> Path:
    t = dict(sample_dense_tensors(3))
    for n in t:
        if n.endswith(("q_proj.weight", "k_proj.weight")):  # sharper attention makes the rope pairing matter
            t[n] = (t[n].astype(np.float32) * qk_scale).astype(np.float16)
    rng = np.random.default_rng(11)
    if bias:
        for li in range(CFG["num_hidden_layers"]):
            for p in ("q_proj", "k_proj", "v_proj"):
                rows = t[f"model.layers.{li}.self_attn.{p}.weight"].shape[0]
                t[f"model.layers.{li}.self_attn.{p}.bias"] = (rng.standard_normal(rows) * 0.3).astype(np.float16)
    if bf16:
        from exl2fmt.container import f16_to_bf16_bits

        from exl2fmt.container import RawTensor

        t = {k: RawTensor("BF16", v.shape, f16_to_bf16_bits(v)) for k, v in t.items()}
    d.mkdir(parents=True)
    write_sharded(d, t, 1 << 40, metadata={"format": "pt"})
    cfg = dict(CFG, model_type=model_type, torch_dtype="bfloat16" if bf16 else "float16",
               architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def build_gptq(d: Path, bits: int, gs: int = 32, seed: int = 0) -> Path:
    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors

    out = {}
    for n, a in sample_dense_tensors(seed).items():
        if n.endswith("_proj.weight"):
            c, s, z, g = rtn_quantize(a, bits, gs, sym=True)
            for slot, arr in gptq_layer_tensors(c, s, z, g, bits).items():
                out[f"{n[:-7]}.{slot}"] = arr
        else:
            out[n] = a
    d.mkdir(parents=True)
    write_sharded(d, out, 1 << 40, metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": True, "desc_act": False}
    (d / "config.json").write_text(json.dumps(dict(CFG, quantization_config=qc)))
    return d


def train_tokenizer(d: Path, vocab: int = 400) -> None:
    tk = pytest.importorskip("tokenizers")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(500)]
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tr = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(rng.choice(words, size=30)) for _ in range(200)], tr)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                          "add_bos_token": True}))


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return build_dense(tmp_path_factory.mktemp("gguf") / "dense")


@pytest.fixture(scope="module")
def dense_gguf(dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "dense-f16.gguf"
    return out, convert(dense, out, "gguf", gguf_type="f16")


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gguf") / "sample-exl2"
    write_sample(d)
    return d


def bits16(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def reader_tensors(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {t.name: t for t in r.tensors}, r


# ------------------------------------------------------------------------------------------------ round trips


def test_fp16_to_gguf_f16_to_fp16_is_bit_exact(dense, dense_gguf, tmp_path):
    g, rep = dense_gguf
    assert rep.verified and rep.exact and rep.source_format == "dense"
    back = tmp_path / "back"
    rep2 = convert(g, back, "fp16")
    assert rep2.verified and rep2.exact
    a, b = open_model(dense), open_model(back)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert b.info(n).dtype == "F16"
        assert np.array_equal(bits16(a.get(n)), bits16(b.get(n))), n
    cfg = json.loads((back / "config.json").read_text())
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "rope_theta"):
        assert cfg[k] == CFG[k], k
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert cfg["rms_norm_eps"] == pytest.approx(CFG["rms_norm_eps"], rel=1e-6)


def test_gguf_layout_names_types_and_metadata(dense_gguf):
    g, _ = dense_gguf
    ts, r = reader_tensors(g)
    assert set(ts) >= {"token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_q.weight",
                       "blk.1.ffn_down.weight", "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight"}
    assert ts["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert ts["blk.0.ffn_up.weight"].tensor_type.name == "F16"
    assert [int(x) for x in ts["blk.0.ffn_down.weight"].shape] == [CFG["intermediate_size"], CFG["hidden_size"]]
    f = {k: r.get_field(k).contents() for k in ("general.architecture", "llama.block_count",
                                                "llama.attention.head_count_kv", "llama.rope.dimension_count",
                                                "llama.context_length", "general.file_type")}
    assert f == {"general.architecture": "llama", "llama.block_count": 2, "llama.attention.head_count_kv": N_KV,
                 "llama.rope.dimension_count": HEAD_DIM, "llama.context_length": CFG["max_position_embeddings"],
                 "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16)}


def test_exl2_to_gguf_to_fp16_equals_exl2_to_fp16(sample, tmp_path):
    rep = convert(sample, tmp_path / "s.gguf", "gguf", gguf_type="f16")   # F16 holds EXL2 exactly
    assert rep.options["layer_type"] == "F16" and rep.exact and len(rep.layers) == 15
    convert(tmp_path / "s.gguf", tmp_path / "via", "fp16")
    convert(sample, tmp_path / "direct", "fp16")
    a, b = open_model(tmp_path / "via"), open_model(tmp_path / "direct")
    assert sorted(a.names()) == sorted(b.names())
    for n in b.names():
        assert np.array_equal(bits16(a.get(n)), bits16(b.get(n))), n


def test_bf16_model_stays_bf16_and_round_trips(tmp_path):
    src = build_dense(tmp_path / "bf", bf16=True)
    rep = convert(src, tmp_path / "bf.gguf", "gguf")
    assert rep.options["layer_type"] == "BF16" and rep.exact
    ts, _ = reader_tensors(tmp_path / "bf.gguf")
    assert ts["blk.0.attn_v.weight"].tensor_type.name == "BF16"
    convert(tmp_path / "bf.gguf", tmp_path / "back", "bf16")
    a, b = open_model(src), open_model(tmp_path / "back")
    for n in a.names():
        assert np.array_equal(bits16(a.get(n)), bits16(b.get(n))), n


# ------------------------------------------------------------------------------------------------ Q/K order


def test_permutation_matches_the_index_oracle_and_inverts():
    from exl2fmt.converters.gguf_map import permute_qk, unpermute_qk

    rng = np.random.default_rng(1)
    for R, heads in ((16, 2), (256, 4), (128, 2), (96, 3)):
        a = rng.standard_normal((R, 5)).astype(np.float32)
        p = permute_qk(a, heads)
        assert np.array_equal(p, a[hf_to_gguf_rows(R, heads)])
        assert np.array_equal(unpermute_qk(p, heads), a)
    # the worked example of the reference: H = 2, d = 8
    assert hf_to_gguf_rows(16, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    with pytest.raises(Exl2Error):
        permute_qk(np.zeros((10, 2)), 4)


def test_llama_q_k_rows_are_permuted_and_qwen2_rows_are_not(dense, dense_gguf, tmp_path):
    g, _ = dense_gguf
    ts, _ = reader_tensors(g)
    m = open_model(dense)
    for i in range(CFG["num_hidden_layers"]):
        for proj, gname, heads in (("q_proj", "attn_q", N_HEAD), ("k_proj", "attn_k", N_KV), ("v_proj", "attn_v", None)):
            hf = np.asarray(m.get(f"model.layers.{i}.self_attn.{proj}.weight"))
            got = np.asarray(ts[f"blk.{i}.{gname}.weight"].data)
            want = hf if heads is None else hf[hf_to_gguf_rows(hf.shape[0], heads)]
            assert np.array_equal(bits16(got), bits16(want)), (i, proj)
    q = build_dense(tmp_path / "qwen", model_type="qwen2", bias=True)
    rep = convert(q, tmp_path / "q.gguf", "gguf", gguf_type="f32")
    assert rep.exact
    ts, r = reader_tensors(tmp_path / "q.gguf")
    assert r.get_field("general.architecture").contents() == "qwen2"
    mq = open_model(q)
    for proj, gname in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
        hf = np.asarray(mq.get(f"model.layers.0.self_attn.{proj}.weight")).astype(np.float32)
        assert np.array_equal(np.asarray(ts[f"blk.0.{gname}.weight"].data), hf)
        b = np.asarray(mq.get(f"model.layers.0.self_attn.{proj}.bias")).astype(np.float32)
        assert ts[f"blk.0.{gname}.bias"].tensor_type.name == "F32"
        assert np.array_equal(np.asarray(ts[f"blk.0.{gname}.bias"].data), b)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="peer check needs transformers")
def test_transformers_reads_our_gguf_as_the_source_model(dense, dense_gguf):
    """transformers' own GGUF loader (its own name table and reverse permutation) gets the source weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    g, _ = dense_gguf
    d = g.parent / "peer"
    d.mkdir(exist_ok=True)
    shutil.copy(g, d / "m.gguf")
    sd = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf").state_dict()
    m = open_model(dense)
    for n in m.names():
        got = sd[n].float().numpy().astype(np.float16)
        assert np.array_equal(bits16(got), bits16(m.get(n))), n


# ------------------------------------------------------------------------------------------------ exact repacks


def _gptq_f32(model, key, bits):
    """float32 s * (q - z) from the oracle unpacker (sym: z = 2^(bits-1)), nn.Linear orientation."""
    q = oracle.gptq_unpack_rows(np.asarray(model.get(key + ".qweight")), bits).astype(np.float32)   # [K, N]
    s = np.asarray(model.get(key + ".scales")).astype(np.float32)                                 # [G, N]
    g = np.asarray(model.get(key + ".g_idx")).astype(np.int64)
    return ((q - (1 << (bits - 1))) * s[g]).T


@pytest.fixture(scope="module")
def gptq_src(tmp_path_factory):
    """``gptq_src(bits)``: the GPTQ sym gs32 sample model, built once per bit width (read-only for the tests)."""
    cache: dict[int, Path] = {}

    def get(bits: int) -> Path:
        if bits not in cache:
            cache[bits] = build_gptq(tmp_path_factory.mktemp("gptq") / "g", bits)
        return cache[bits]

    return get


@pytest.mark.parametrize("bits, qtype", [(4, "Q4_0"), (8, "Q8_0"), (4, "Q8_0")])
def test_gptq_sym_gs32_repacks_exactly(gptq_src, tmp_path, bits, qtype):
    from exl2fmt.model import dequantize_layer

    src = gptq_src(bits)
    rep = convert(src, tmp_path / "g.gguf", "gguf", gguf_type=qtype.lower() if bits == 4 and qtype == "Q8_0" else "auto")
    assert rep.options["layer_type"] == qtype and rep.verified
    assert all(l.exact for l in rep.layers) and len(rep.layers) == 14
    ts, _ = reader_tensors(tmp_path / "g.gguf")
    m = open_model(src)
    for i in range(CFG["num_hidden_layers"]):
        for hf, gname, heads in (("self_attn.q_proj", "attn_q", N_HEAD), ("self_attn.k_proj", "attn_k", N_KV),
                                 ("mlp.down_proj", "ffn_down", None)):
            key = f"model.layers.{i}.{hf}"
            t = ts[f"blk.{i}.{gname}.weight"]
            assert t.tensor_type.name == qtype
            got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            want = _gptq_f32(m, key, bits)
            if heads:
                want = want[hf_to_gguf_rows(want.shape[0], heads)]
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), key
            ref16 = dequantize_layer(src, key)
            if heads:
                ref16 = ref16[hf_to_gguf_rows(ref16.shape[0], heads)]
            assert np.array_equal(bits16(got.astype(np.float16)), bits16(ref16)), key


def test_lossy_requantization_is_reported(sample, tmp_path):
    rep = convert(sample, tmp_path / "q4.gguf", "gguf", gguf_type="q4_0")
    assert rep.verified and rep.lossy_layers
    ts, _ = reader_tensors(tmp_path / "q4.gguf")
    from exl2fmt.model import dequantize_layer

    for l in rep.layers:
        assert not l.exact and 0 < l.rel_error < 0.3
    l = next(x for x in rep.layers if x.key == "model.layers.0.mlp.up_proj")
    got = gguf.quants.dequantize(np.asarray(ts["blk.0.ffn_up.weight"].data), gguf.GGMLQuantizationType.Q4_0)
    ref = dequantize_layer(sample, l.key).astype(np.float32)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel == pytest.approx(l.rel_error, rel=1e-4)


def test_sized_type_ladder_follows_the_layer_bpw_and_the_block_rule():
    from exl2fmt.converters.gguf_blocks import SIZED_K_LADDER, SIZED_LADDER, sized_type, to_gtype, type_bpw

    assert [type_bpw(t) for t in SIZED_LADDER] == [4.5, 5.0, 5.5, 6.0, 8.5, 16.0]
    rng = np.random.default_rng(0)
    for t in SIZED_LADDER[:-1]:  # every type of the ladder decodes (gguf package) what to_gtype writes
        x = rng.standard_normal((2, 64)).astype(np.float32)
        q = to_gtype(x, t, searched=True)
        assert np.isfinite(gguf.quants.dequantize(q, gguf.GGMLQuantizationType[t])).all()
    assert sized_type(2.3, 64) == "IQ4_NL" and sized_type(4.5, 64) == "IQ4_NL" and sized_type(4.51, 64) == "Q4_1"
    assert sized_type(5.3, 64) == "Q5_0" and sized_type(6.0, 64) == "Q5_1" and sized_type(6.2, 64) == "Q8_0"
    assert sized_type(8.6, 64) == "F16" and sized_type(3.0, 48) == "F16"   # 48 is no multiple of the block
    # rows of whole 256-weight super-blocks take the K-quant ladder (our quantizer: codec.ggml_quant)
    assert [type_bpw(t) for t in SIZED_K_LADDER] == [2.625, 3.4375, 4.5, 5.5, 6.5625, 8.5, 16.0]
    assert sized_type(2.3, 512) == "Q2_K" and sized_type(2.7, 512) == "Q3_K" and sized_type(4.2, 256) == "Q4_K"
    assert sized_type(4.6, 768) == "Q5_K" and sized_type(6.0, 256) == "Q6_K" and sized_type(6.6, 256) == "Q8_0"
    assert sized_type(4.2, 576) == "IQ4_NL" and sized_type(9.0, 256) == "F16"    # 576 = 2.25 super-blocks


def test_exl2_auto_lands_near_the_source_size_with_every_error_finite(sample, tmp_path):
    """Issue 40: --gguf-type auto on an EXL2 source writes each layer near its own bpw (never below it), the
    file near the EXL2's size instead of F16's; every layer's error is finite, and the GGUF decodes back."""
    from exl2fmt.container import open_model
    from exl2fmt.converters.gguf_blocks import type_bpw

    rep = convert(sample, tmp_path / "a.gguf", "gguf")
    assert rep.verified and rep.options["gguf_type"] == "auto"
    assert set(rep.options["layer_types"]) >= {"IQ4_NL", "Q8_0", "Q4_K", "Q5_K"}
    m = open_model(sample)
    src_bytes = sum(int(m.info(n).nbytes) for n in m.tensors)
    gguf_bytes = (tmp_path / "a.gguf").stat().st_size
    f16 = convert(sample, tmp_path / "f.gguf", "gguf", gguf_type="f16")
    assert f16.exact
    # the sample is tiny (its tokenizer-less metadata and F16 embeddings weigh a lot): 1.14x here, F16 2.5x
    assert gguf_bytes <= 1.25 * src_bytes < (tmp_path / "f.gguf").stat().st_size
    det_bpw = {k: v for k, v in ((l.key, l) for l in rep.layers)}
    for l in rep.layers:
        # a 2-3 bit source layer re-rounded to Q2_K/Q3_K (2.6/3.4 bpw) loses about what its own rounding did
        assert np.isfinite(l.rel_error) and 0 < l.rel_error < (0.3 if l.target_plan in ("Q2_K", "Q3_K") else 0.15), \
            l.key
        # rows of 256 weights (hidden 256) take the K-quants; down_proj's rows of 704 the 32-weight types
        ladder = ("IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0") if l.shape[1] == 704 else \
            ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
        assert l.target_plan in ladder, l.key
    assert det_bpw["lm_head"].target_plan == "Q8_0"                       # 8b/6b rows: 6.x bpw
    assert det_bpw["model.layers.0.self_attn.o_proj"].target_plan == "Q4_K"   # 1:4b_32g, permuted inputs
    assert det_bpw["model.layers.0.mlp.down_proj"].target_plan == "IQ4_NL"    # rows of 704
    assert any("rows of 704 weights (not a multiple of 256" in w for w in rep.warnings)
    s = rep.summary()
    assert 0 < s["mean_rel_error"] <= s["worst_rel_error"] and "mean over the 15 layers" in rep.summary_lines()[1]
    ts, r = reader_tensors(tmp_path / "a.gguf")
    # the file type names the type holding the most weights: the 1000 x 256 lm_head's Q8_0
    assert r.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert type_bpw(ts["blk.1.attn_v.weight"].tensor_type.name) >= 5.0          # 1:5b_64g
    convert(tmp_path / "a.gguf", tmp_path / "back", "fp16")                     # loads back through our reader
    assert open_model(tmp_path / "back").config["num_hidden_layers"] == 2


def test_exl2_auto_searched_blocks_beat_plain_rounding_and_keep_exact_repacks(tmp_path):
    """Issue 40: under auto, (1) an EXL2 layer whose 32-row blocks each lie in one <= 4-bit group (identity
    permutation) is stored as exact Q4_0 rather than a lossy K-quant of the same size; (2) every other layer
    is closer to its source than the gguf package's plain rounding of the same type (``--gguf-type`` of that
    type is the plain path) would be."""
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.sample import SAMPLE_PLANS, T, sample_config, sample_dense_tensors, sample_tensors

    t = sample_tensors()
    dense_w = sample_dense_tensors()["model.layers.1.self_attn.o_proj.weight"]
    key = "model.layers.1.self_attn.o_proj"
    for slot, arr in quantize_rtn(dense_w, list(T((1.0, 4, 32))), np.arange(dense_w.shape[1])).items():
        t[f"{key}.{slot}"] = arr
    src = tmp_path / "src"
    write_sharded(src, t, max_shard_bytes=1 << 40, prefix="output")
    (src / "config.json").write_text(json.dumps(sample_config()))
    rep = convert(src, tmp_path / "a.gguf", "gguf")
    by = {l.key: l for l in rep.layers}
    assert by[key].target_plan == "Q4_0" and by[key].exact
    assert SAMPLE_PLANS[1]["self_attn.o_proj"] != T((1.0, 4, 32))  # the swap is what made it exact
    from exl2fmt.converters.gguf_blocks import to_gtype
    from exl2fmt.model import dequantize_layer

    ts, _ = reader_tensors(tmp_path / "a.gguf")
    for l in rep.layers:
        if l.exact or l.target_plan not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # gguf has no IQ4_NL quantizer
            continue
        ref = dequantize_layer(src, l.key).astype(np.float32)
        plain = gguf.quants.dequantize(to_gtype(ref, l.target_plan), gguf.GGMLQuantizationType[l.target_plan])
        rel_plain = np.linalg.norm(plain.reshape(ref.shape) - ref) / np.linalg.norm(ref)
        assert l.rel_error < rel_plain * 0.98, (l.key, l.rel_error, rel_plain)


def test_explicit_k_quant_and_llama_cpp_row_fallback(dense, tmp_path):
    """--gguf-type q4_k on a dense source: rows of 256 weights become Q4_K (our quantizer, decoded by the gguf
    package near the source), down_proj's rows of 704 Q5_0 as llama.cpp's quantizer would, with a warning."""
    rep = convert(dense, tmp_path / "k.gguf", "gguf", gguf_type="q4_k")
    assert rep.verified
    ts, r = reader_tensors(tmp_path / "k.gguf")
    assert ts["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    assert ts["blk.0.ffn_down.weight"].tensor_type.name == "Q5_0"
    assert any("row length 704 is not a multiple of 256" in w and "Q5_0" in w for w in rep.warnings)
    assert r.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    src = open_model(dense)
    w = src.get("model.layers.0.mlp.gate_proj.weight").astype(np.float32)
    got = gguf.quants.dequantize(np.asarray(ts["blk.0.ffn_gate.weight"].data), gguf.GGMLQuantizationType.Q4_K)
    rel = np.linalg.norm(got.reshape(w.shape) - w) / np.linalg.norm(w)
    assert 0 < rel < 0.12


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_metadata_and_rebuild(tmp_path):
    src = build_dense(tmp_path / "tok")
    train_tokenizer(src, 400)
    rep = convert(src, tmp_path / "t.gguf", "gguf")
    tok = rep.options["tokenizer"]
    assert tok["model"] == "gpt2" and tok["pre"] == "gpt-2" and tok["tokens"] == 400 and tok["padded"] == 600
    _, r = reader_tensors(tmp_path / "t.gguf")
    toks = r.get_field("tokenizer.ggml.tokens").contents()
    types = r.get_field("tokenizer.ggml.token_type").contents()
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(toks) == CFG["vocab_size"] and all(toks[i] == t for t, i in vocab.items())
    assert types[1] == int(gguf.TokenType.CONTROL) and types[999] == int(gguf.TokenType.UNUSED)
    assert r.get_field("tokenizer.ggml.bos_token_id").contents() == 1
    assert r.get_field("tokenizer.ggml.add_bos_token").contents() is True
    assert len(r.get_field("tokenizer.ggml.merges").contents()) == tok["merges"] > 0
    back = tmp_path / "back"
    convert(tmp_path / "t.gguf", back, "fp16")
    from tokenizers import Tokenizer

    a, b = Tokenizer.from_file(str(src / "tokenizer.json")), Tokenizer.from_file(str(back / "tokenizer.json"))
    text = "abc deef  ghij, 123 jjab!\n hi"
    # the GGUF says add_bos_token = true (from tokenizer_config.json), so the rebuilt post-processor adds BOS
    # (this source's own tokenizer.json has no post-processor; tests/test_gguf_arch.py checks sources that do)
    assert [1] + a.encode(text).ids == b.encode(text).ids
    assert a.encode(text, add_special_tokens=False).ids == b.encode(text, add_special_tokens=False).ids
    assert json.loads((back / "tokenizer_config.json").read_text())["bos_token"] == "<s>"


def test_no_tokenizer_is_a_warning_not_a_failure(dense_gguf):
    g, rep = dense_gguf
    assert rep.options["tokenizer"]["model"] == "none"
    assert any("no tokenizer.json" in w for w in rep.warnings)


# ------------------------------------------------------------------------------------------------ safety


def test_existing_output_needs_force_and_source_is_untouched(dense, tmp_path):
    import hashlib

    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dense.iterdir()}
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    with pytest.raises(Exl2Error) as e:
        convert(dense, out, "gguf")
    assert e.value.code is ErrorCode.OUTPUT_EXISTS and out.read_bytes() == b"old"
    with pytest.raises(Exl2Error) as e:           # --force replaces only a GGUF file (issue 12)
        convert(dense, out, "gguf", force=True)
    assert e.value.code is ErrorCode.OUTPUT_EXISTS and out.read_bytes() == b"old"
    out.write_bytes(b"GGUF old")
    convert(dense, out, "gguf", force=True)
    assert out.read_bytes()[:4] == b"GGUF"
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dense.iterdir()} == before
    with pytest.raises(Exl2Error) as e:
        convert(dense, dense / "x.gguf", "gguf")
    assert e.value.code is ErrorCode.USAGE


def test_interrupted_write_leaves_nothing(dense, tmp_path, monkeypatch):
    monkeypatch.setenv("EXL2FMT_TEST_FAIL_AFTER", "3")  # the test seam (not in convert's signature)
    with pytest.raises(RuntimeError):
        convert(dense, tmp_path / "o.gguf", "gguf")
    assert list(tmp_path.iterdir()) == []


def test_gguf_to_exl2_goes_through_fp16_and_the_quantizer(tmp_path_factory, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_hf import make_tiny

    from exl2fmt.model import dequantize_layer
    from exl2fmt.validate import validate_model

    # the smallest llama (hidden 64, 2 layers) and upstream's candidate tables only (extended=False): this test is
    # about the GGUF -> FP16 -> quantizer path; the quantizer's search is tested on its own (about 2.5x cheaper
    # than the 256-wide sample model with the extended tables)
    g = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    convert(make_tiny("llama", g.parent / "tiny-llama", tokenizer=None), g, "gguf", gguf_type="f16")
    # no tokenizer in this GGUF: the built-in (text) calibration cannot run, and the error says what to pass
    with pytest.raises(Exl2Error) as e:
        convert(g, tmp_path / "x", "exl2")
    assert e.value.code is ErrorCode.CALIBRATION_INVALID and "--calibration" in e.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # the temporary FP16 directory is gone
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 320, (4, 32)))
    rep = convert(g, tmp_path / "x", "exl2", bits=6.0, quant={"calibration": str(ids), "rows": 4, "length": 32,
                                                            "extended": False})
    assert 5.98 <= rep.decoder_bpw <= 6.0
    assert not validate_model(tmp_path / "x", deep=True).failed
    fp16 = tmp_path / "back"
    convert(g, fp16, "fp16")
    for key in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = dequantize_layer(tmp_path / "x", key).astype(np.float32)
        ref = dequantize_layer(fp16, key).astype(np.float32)
        assert np.linalg.norm(w - ref) / np.linalg.norm(ref) < 0.15, key   # unrelated weights: ~1.4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "ids.npy", "x"]


def test_unsupported_architecture(tmp_path):
    src = build_dense(tmp_path / "d")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_neox")))
    with pytest.raises(Exl2Error) as e:
        convert(src, tmp_path / "o.gguf", "gguf")
    assert e.value.code is ErrorCode.FORMAT_UNSUPPORTED and "gpt_neox" in e.value.message


def _patched(blob: bytes, offset: int, data: bytes) -> bytes:
    return blob[:offset] + data + blob[offset + len(data):]


def _hostile_variants(good: bytes) -> dict[str, bytes]:
    """Malformed files derived from a valid one by editing known header fields."""
    r = gguf.GGUFReader(np.frombuffer(good, dtype=np.uint8).copy()) if False else None  # noqa: F841
    out = {"truncated data": good[: len(good) - 100], "truncated header": good[:60],
           "bad magic": b"GGUX" + good[4:], "tensor count 2^40": _patched(good, 8, struct.pack("<Q", 1 << 40)),
           "kv count 2^40": _patched(good, 16, struct.pack("<Q", 1 << 40))}
    # the first key's length field: a huge string
    out["huge key string"] = _patched(good, 24, struct.pack("<Q", 1 << 50))
    return out


def _with_kv(path: Path, extra) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(1)
    extra(w)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 64), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_malformed_gguf_through_the_converter(dense_gguf, tmp_path):
    g, _ = dense_gguf
    good = g.read_bytes()
    cases = _hostile_variants(good)
    # general.alignment not a power of two: rewrite the UINT32 value in place
    p = tmp_path / "a.gguf"
    _with_kv(p, lambda w: w.add_uint32("general.alignment", 32))
    blob = p.read_bytes()
    i = blob.index(b"general.alignment") + len(b"general.alignment") + 4
    cases["alignment 24"] = _patched(blob, i, struct.pack("<I", 24))
    cases["alignment as string"] = _patched(blob, i - 4, struct.pack("<I", 8))
    # an unknown tensor type and a misaligned tensor offset: edit the last tensor info (type u32, offset u64)
    p2 = tmp_path / "b.gguf"
    _with_kv(p2, lambda w: None)
    blob = p2.read_bytes()
    j = blob.index(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight") + 4 + 16
    cases["unknown type"] = _patched(blob, j, struct.pack("<I", 250))
    cases["misaligned offset"] = _patched(blob, j + 4, struct.pack("<Q", 3))
    cases["dim 2^62"] = _patched(blob, j - 16, struct.pack("<QQ", 1 << 62, 1 << 62))
    # a string array claiming 2^40 elements
    p3 = tmp_path / "c.gguf"
    _with_kv(p3, lambda w: w.add_array("tokenizer.ggml.tokens", ["a", "b"]))
    blob = p3.read_bytes()
    k = blob.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    cases["array of 2^40 strings"] = _patched(blob, k, struct.pack("<Q", 1 << 40))
    for what, blob in cases.items():
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(blob)
        t0 = time.perf_counter()
        with pytest.raises(Exl2Error) as e:
            convert(bad, tmp_path / "out", "fp16")
        assert time.perf_counter() - t0 < 5, what
        assert e.value.code is ErrorCode.GGUF_INVALID, (what, e.value.code, e.value.message)
        assert e.value.file == str(bad), what
        assert not (tmp_path / "out").exists()


def test_cli_convert_to_gguf_and_back(dense, tmp_path):
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    r = CliRunner().invoke(app, ["convert", str(dense), str(tmp_path / "m.gguf"), "--to", "gguf", "--gguf-type",
                                 "q8_0", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["target"] == "gguf" and doc["verified"] is True and doc["options"]["layer_type"] == "Q8_0"
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "m.gguf"), "--json"])
    assert r.exit_code == 0, r.output
    ins = json.loads(r.stdout)
    assert {e["type"] for e in ins["gguf"]["types"]} == {"Q8_0", "F32"}
    assert ins["summary"]["bpw"]["decoder"] == pytest.approx(8.5)
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "back"), "--to", "fp16"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "x"), "--to", "exl2"])
    assert r.exit_code == 1 and "CALIBRATION_INVALID" in r.output


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_runs_our_gguf(tmp_path):
    """Only where llama-cpp-python is installed (not in the test extra): logits vs transformers.  Q/K weights
    are scaled up so that attention is sharp and a wrong rope row order shows (with the plain random sample,
    near-uniform attention hides it)."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    src = build_dense(tmp_path / "d", qk_scale=6.0)
    g = tmp_path / "d.gguf"
    convert(src, g, "gguf", gguf_type="f32")
    ids = [1, 5, 99, 500, 999, 3, 42, 7, 300, 12, 801, 64]
    # the reference is the source model itself (F32 GGUF holds its fp16 weights exactly), not our GGUF read back
    m = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0].numpy()
    llm = Llama(model_path=str(g), n_ctx=32, logits_all=True, n_threads=2, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    print("llama.cpp vs transformers", np.abs(got - ref).max(), np.abs(ref).max())
    assert np.abs(got - ref).max() < 0.005 * np.abs(ref).max()
