"""The GGUF bridge per architecture (issue 15) against llama.cpp's own converter, and GGUF -> HF (issue 12.11).

Oracles:
* the golden GGUF files in spec/vectors/gguf/, written by llama.cpp's ``convert_hf_to_gguf.py`` (commit and
  command in MANIFEST.json / README.md there) from ``tiny_hf.make_tiny`` models; ours must have the same
  metadata keys, value types and values (except our two provenance keys), the same tensors in the same order,
  the same ggml types, shapes and data bytes (``gguf_diff``, read with ``gguf.GGUFReader`` only);
* transformers' tokenizer on the source directory for the rebuilt tokenizer's ids (BOS/EOS included), and
  sentencepiece itself on the source's ``tokenizer.model`` for SentencePiece vocabularies;
* the source safetensors for the f16 round trip HF -> GGUF -> HF (bit for bit).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_diff import gguf_diff  # noqa: E402
from tiny_hf import make_tiny  # noqa: E402

from exl2fmt.converters import convert  # noqa: E402

GOLD = Path(__file__).resolve().parents[1] / "spec" / "vectors" / "gguf"
MANIFEST = json.loads((GOLD / "MANIFEST.json").read_text())
#: keys only exl2fmt writes (provenance); everything else must equal llama.cpp's
OURS_ONLY = ("general.quantized_by", "general.source.format")
#: documented deliberate differences per architecture (spec/vectors/gguf/README.md)
DELIBERATE = {"gemma": ("tokenizer.ggml.prefix_token_id", "tokenizer.ggml.suffix_token_id",
                        "tokenizer.ggml.middle_token_id", "tokenizer.ggml.fsep_token_id",
                        "tokenizer.ggml.eot_token_id")}


def _default(arch: str) -> dict:
    """The MANIFEST entry of an architecture's default tiny model (not a variant: no config overrides, the
    architecture's usual tokenizer)."""
    return next(v for v in MANIFEST.values() if v["arch"] == arch and "config" not in v
                and not v["tokenizer"].startswith("sp-"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch)`` or ``tiny(manifest_entry)``: the source model directory (``tiny-<arch>``, the name
    llama.cpp derived general.name from), built once per module."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, Path] = {}

    def get(which) -> Path:
        m = _default(which) if isinstance(which, str) else which
        key = json.dumps([m["arch"], m["tokenizer"], m.get("config")], sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny(m["arch"], root / str(len(cache)) / f"tiny-{m['arch']}", tokenizer=m["tokenizer"],
                                   **m.get("config", {}))
        return cache[key]

    return get


#: goldens written with 1 KiB chunks (every 2-D tensor split into many pieces); the others fit one default 8 MB
#: chunk, so both streaming paths are held to llama.cpp's bytes
_CHUNKED = ("llama-f16.gguf", "llama-q8_0.gguf")


@pytest.mark.parametrize("golden", sorted(MANIFEST))
def test_matches_llama_cpp_converter(golden, tiny, tmp_path, monkeypatch):
    """Plain tensors are converted and written a few rows at a time (peak memory: a chunk, not the tensor)."""
    from exl2fmt.converters import gguf_plan

    if golden in _CHUNKED:
        monkeypatch.setattr(gguf_plan, "_CHUNK_BYTES", 1024)
    m = MANIFEST[golden]
    src = tiny(m)
    out = tmp_path / golden
    convert(src, out, to="gguf", gguf_type=m["type"])
    diffs = gguf_diff(GOLD / golden, out, ignore=OURS_ONLY + DELIBERATE.get(m["arch"], ()))
    assert diffs == [], "\n".join(diffs)


def test_golden_differs_when_a_byte_differs(tiny, tmp_path):
    """The comparison can fail: one flipped data byte and one changed metadata value are both reported."""
    name = "llama-f16.gguf"
    blob = bytearray((GOLD / name).read_bytes())
    r = gguf.GGUFReader(str(GOLD / name))
    t = r.tensors[0]
    blob[int(t.data_offset) + 3] ^= 1
    p = tmp_path / "x.gguf"
    p.write_bytes(bytes(blob))
    diffs = gguf_diff(GOLD / name, p)
    assert any(t.name in d and "bytes differ" in d for d in diffs)


#: round trips run in the default suite for these (one per kind of quirk); the others are marked slow
_ROUND_TRIP_FAST = ("llama", "gemma3_text", "mixtral", "qwen2_moe", "starcoder2")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a in _ROUND_TRIP_FAST else pytest.mark.slow)
                                  for a in sorted({v["arch"] for v in MANIFEST.values()})])
def test_f16_round_trip_is_bit_exact(arch, tiny, tmp_path):
    from safetensors.numpy import load_file

    src = tiny(arch)
    g = tmp_path / "m.gguf"
    convert(src, g, to="gguf", gguf_type="f16")
    back = tmp_path / "back"
    convert(g, back, to="fp16")
    a = load_file(str(src / "model.safetensors"))
    b = {}
    for f in sorted(back.glob("*.safetensors")):
        b.update(load_file(str(f)))
    cfg_src = json.loads((src / "config.json").read_text())
    if cfg_src.get("tie_word_embeddings"):
        b.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    from exl2fmt.converters.gguf_arch import SPECS

    offset = SPECS[arch].norm_offset
    moved = {}
    for k in a:
        want = a[k]
        if offset and k.endswith("norm.weight"):
            # llama.cpp's Gemma norms hold fp16(w + 1) (rounded in the source dtype); back is that minus 1
            want = moved[k] = ((want.astype(np.float32) + offset).astype(np.float16).astype(np.float32) - offset
                               ).astype(np.float16)
        assert np.array_equal(want.view(np.uint16), b[k].view(np.uint16)), k
    cfg = json.loads((back / "config.json").read_text())
    # GGUF records the llama.cpp architecture only: a Mistral comes back as the Llama it computes like
    assert cfg["model_type"] == {"mistral": "llama"}.get(arch, arch)
    import transformers

    # the rebuilt directory loads in transformers as the source architecture and gives the source's logits
    ids = np.array([[1, 5, 9, 200, 17, 3]])
    import torch

    m_src = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    m_back = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    if moved:  # the reference is the source with exactly those norm values: the config must do the rest
        params = dict(m_src.named_parameters())
        with torch.no_grad():
            for k, v in moved.items():
                params[k].copy_(torch.from_numpy(v.astype(np.float32)))
    with torch.no_grad():
        la = m_src(torch.from_numpy(ids)).logits
        lb = m_back(torch.from_numpy(ids)).logits
    assert torch.equal(la, lb)


@pytest.mark.parametrize("arch,style,adds_bos", [("llama", "llama3", True), ("qwen2", "bpe", False)])
def test_rebuilt_tokenizer_gives_the_source_ids(arch, style, adds_bos, tmp_path):
    """Issue 12.11: GGUF -> HF keeps BOS handling (Llama 3 adds <|begin_of_text|>, Qwen adds nothing)."""
    from transformers import AutoTokenizer

    src = make_tiny(arch, tmp_path / "src", tokenizer=style)
    g = tmp_path / "m.gguf"
    convert(src, g, to="gguf", gguf_type="f16")
    r = gguf.GGUFReader(str(g))
    assert r.get_field("tokenizer.ggml.add_bos_token") is not None or not adds_bos
    back = tmp_path / "back"
    convert(g, back, to="fp16")
    a, b = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(back)
    texts = ["Hello world, the quick brown fox.", " two  spaces\nand a newline 0123 ", "router gate expert"]
    for t in texts:
        ia, ib = a(t)["input_ids"], b(t)["input_ids"]
        assert ia == ib, t
        assert (ia[0] == a.bos_token_id) is adds_bos
        assert a(t, add_special_tokens=False)["input_ids"] == b(t, add_special_tokens=False)["input_ids"]
        assert a(t, "second part")["input_ids"] == b(t, "second part")["input_ids"]
        assert b.decode(ib, skip_special_tokens=True) == a.decode(ia, skip_special_tokens=True)
    assert (a.bos_token, a.eos_token) == (b.bos_token, b.eos_token)
    assert json.loads((back / "special_tokens_map.json").read_text()).get("eos_token") == a.eos_token


#: ASCII, accents, CJK and emoji (byte fallback: not in the 384-piece vocabulary), leading/double spaces, tabs,
#: newlines, special-token strings inside text, the chat markers, empty text
SP_TEXTS = ["Hello world, the quick brown fox.", "  two  spaces\nand a newline 0123 ", "Caf\u00e9 na\u00efve d\u00e9j\u00e0 "
            "\u6771\u4eac \U0001f600 \u00df", " leading", "\n\nnew\tline", "a</s>b<s> c <bos><eos>",
            "<start_of_turn>user\nhi<end_of_turn>", "", "x  "]
#: (architecture, tiny_hf.write_sp_tokenizer style): Llama 2, Mistral v0.1 with add_eos_token, Gemma 3, Phi-3
SP_CASES = [("llama", "llama2"), ("mistral", "llama2-eos"), ("gemma3_text", "gemma"), ("phi3", "phi3")]


@pytest.mark.parametrize("arch,style", SP_CASES)
def test_rebuilt_sentencepiece_tokenizer_gives_the_source_ids(arch, style, tiny, tmp_path):
    """GGUF -> HF for SentencePiece ("llama") vocabularies: the rebuilt tokenizer gives transformers' ids for the
    source directory (single, pair, without specials; BOS/EOS as the source adds them; decode), names the same
    special tokens, and agrees with sentencepiece itself on the texts where the two layouts agree.  The GGUF
    tokenizer metadata of the Llama 2 and Gemma sources is llama.cpp's (goldens llama-sp / gemma3_text-sp)."""
    import sentencepiece
    from transformers import AutoTokenizer

    golden = {"llama2": "llama-sp-q8_0.gguf", "gemma": "gemma3_text-sp-q8_0.gguf"}.get(style)
    src = tiny(MANIFEST[golden]) if golden else make_tiny(arch, tmp_path / f"tiny-{arch}", tokenizer="sp-" + style)
    g = tmp_path / "m.gguf"
    convert(src, g, to="gguf", gguf_type="f16")
    r = gguf.GGUFReader(str(g))
    assert r.get_field("tokenizer.ggml.model").contents() == "llama"
    back = tmp_path / "back"
    rep = convert(g, back, to="fp16")
    assert not [w for w in rep.warnings if w.startswith("tokenizer")], rep.warnings
    a, b = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(back)
    adds_eos = style == "llama2-eos"
    for t in SP_TEXTS:
        ia, ib = a(t)["input_ids"], b(t)["input_ids"]
        assert ia == ib, t
        assert ia[0] == a.bos_token_id
        assert a(t, add_special_tokens=False)["input_ids"] == b(t, add_special_tokens=False)["input_ids"], t
        assert a(t, "second part")["input_ids"] == b(t, "second part")["input_ids"], t
        assert b.decode(ib, skip_special_tokens=True) == a.decode(ia, skip_special_tokens=True), t
    assert (b("plain text")["input_ids"][-1] == b.eos_token_id) is adds_eos
    for typ in ("bos", "eos", "unk", "pad"):
        assert getattr(a, f"{typ}_token") == getattr(b, f"{typ}_token"), typ
    # byte fallback was exercised: the emoji is four <0xNN> pieces
    types = r.get_field("tokenizer.ggml.token_type").contents()
    assert [types[i] for i in b("\U0001f600", add_special_tokens=False)["input_ids"][-4:]] == [6] * 4
    # the independent oracle: sentencepiece on the source's tokenizer.model (no leading space, no special-token
    # strings: there transformers' Metaspace layout and sentencepiece differ by design)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    for t in ("Hello world, the quick brown fox.", SP_TEXTS[2], "new\tline\n\nx  two  spaces"):
        assert b(t, add_special_tokens=False)["input_ids"] == sp.encode(t), t


def test_phi3_longrope_round_trip(tiny, tmp_path):
    """Phi-3 long-rope (rope_scaling longrope, long/short factors): the GGUF is llama.cpp's (golden
    phi3-longrope), and GGUF -> HF puts the factors back into rope_scaling, so at 90 tokens (past the original 64
    context, where the long factors apply) the rebuilt model gives the source's logits exactly, while the same
    model without the factors does not."""
    import torch
    import transformers

    m = MANIFEST["phi3-longrope-q8_0.gguf"]
    src = tiny(m)
    g = tmp_path / "m.gguf"
    convert(src, g, to="gguf", gguf_type="f16")
    r = gguf.GGUFReader(str(g))
    want = m["config"]["rope_scaling"]
    for kind in ("long", "short"):
        t = next(t for t in r.tensors if t.name == f"rope_factors_{kind}.weight")
        assert np.array_equal(np.asarray(t.data), np.float32(want[f"{kind}_factor"]))
    back = tmp_path / "back"
    convert(g, back, to="fp16")
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["original_max_position_embeddings"] == 64 and cfg["rope_scaling"]["type"] == "longrope"
    for kind in ("long", "short"):
        assert np.array_equal(np.float32(cfg["rope_scaling"][f"{kind}_factor"]), np.float32(want[f"{kind}_factor"]))
    ids = (torch.arange(90).reshape(1, 90) * 7) % 300
    with torch.no_grad():
        la = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        lb = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()(ids).logits
        cfg.pop("rope_scaling")
        (back / "config.json").write_text(json.dumps(cfg))
        lc = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(la, lb)
    assert not torch.allclose(la[0, 80], lc[0, 80], atol=1e-4)


def test_phi3_longrope_bad_factors_are_refused(tiny, tmp_path):
    """A factor list of the wrong length is CONFIG_VALUE_INVALID naming the rule, before anything is written."""
    import shutil

    from exl2fmt.errors import ErrorCode, Exl2Error

    src = tmp_path / "tiny-phi3"
    shutil.copytree(tiny(MANIFEST["phi3-longrope-q8_0.gguf"]), src)
    cfg = json.loads((src / "config.json").read_text())
    rp = cfg.get("rope_parameters") or cfg["rope_scaling"]
    rp["long_factor"] = rp["long_factor"][:5]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exl2Error) as e:
        convert(src, tmp_path / "m.gguf", to="gguf", gguf_type="f16")
    assert e.value.code is ErrorCode.CONFIG_VALUE_INVALID and "rope_dims / 2 = 8.0 entries" in str(e.value)
    assert not (tmp_path / "m.gguf").exists()


#: architectures whose GGUF files transformers' own loader (transformers.integrations.ggml, 5.x) rebuilds
#: completely.  It also lists qwen3, qwen2_moe, qwen3_moe, gemma2, gemma3 and starcoder2, but its config mapping
#: drops keys those need (qwen3/qwen3_moe: attention.key_length -> head_dim, so the default 128 is used;
#: gemma2/3: query_pre_attn_scalar and the sliding-window layout), so it cannot load these tiny models (nor
#: llama.cpp's own goldens of them, which our files equal byte for byte) as the source model.
TRANSFORMERS_GGUF = ("llama", "qwen2")


@pytest.mark.parametrize("arch", [a for a in TRANSFORMERS_GGUF if any(v["arch"] == a for v in MANIFEST.values())])
def test_transformers_gguf_loader_gives_the_source_logits(arch, tiny, tmp_path):
    """transformers' GGUF loader (its own name table, reverse permutation, expert split and norm shift) on our
    F16 file gives the logits of the FP16 source (for Gemma: of the source with the fp16(w + 1) - 1 norms
    the format holds)."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    from exl2fmt.converters.gguf_arch import SPECS

    src = tiny(arch)
    d = tmp_path / "g"
    d.mkdir()
    convert(src, d / "m.gguf", to="gguf", gguf_type="f16")
    m_g = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf", dtype=torch.float32).eval()
    m_s = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    off = SPECS[arch].norm_offset
    if off:
        a = load_file(str(src / "model.safetensors"))
        params = dict(m_s.named_parameters())
        with torch.no_grad():
            for k, v in a.items():
                if k.endswith("norm.weight"):
                    moved = (v.astype(np.float32) + off).astype(np.float16).astype(np.float32) - off
                    params[k].copy_(torch.from_numpy(moved.astype(np.float16).astype(np.float32)))
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
    with torch.no_grad():
        lg, ls = m_g(ids).logits, m_s(ids).logits
    assert lg.shape == ls.shape
    assert torch.allclose(lg, ls, rtol=0, atol=1e-5 * float(ls.abs().max())), float((lg - ls).abs().max())


@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
def test_gptq_source_equals_its_fp16_reconstruction(arch, tiny, tmp_path):
    """GPTQ -> GGUF writes what GPTQ -> FP16 -> GGUF writes (experts reconstructed and stacked, Gemma's norm
    offset applied to the unquantized norms): every tensor byte and every metadata key but the source format and
    the quantized source's card facts."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors

    src = tiny(arch)
    q = tmp_path / f"tiny-{arch}"  # same directory name: general.name is derived from it
    shutil.copytree(src, q)
    t = load_file(str(src / "model.safetensors"))
    out = {}
    for n, a in t.items():
        if n.endswith("_proj.weight") or n.endswith((".w1.weight", ".w2.weight", ".w3.weight")):
            c, s, z, g = rtn_quantize(a.astype(np.float16), 4, 32, sym=True)
            for slot, arr in gptq_layer_tensors(c, s, z, g, 4).items():
                out[f"{n[:-7]}.{slot}"] = arr
        else:
            out[n] = a
    save_file(out, str(q / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "desc_act": False}
    (q / "config.json").write_text(json.dumps(cfg))
    direct = tmp_path / "direct.gguf"
    convert(q, direct, to="gguf", gguf_type="f16")
    dense = tmp_path / "dense" / f"tiny-{arch}"
    convert(q, dense, to="fp16")
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (q / f).is_file() and not (dense / f).is_file():
            shutil.copy(q / f, dense / f)
    via = tmp_path / "via.gguf"
    convert(dense, via, to="gguf", gguf_type="f16")
    # the quantized source's card facts (general.base_model.*, tags, description: exl2fmt/modelcard.py) are the
    # only metadata a dense source does not get
    card = ("general.base_model.count", "general.base_model.0.name", "general.tags", "general.description")
    assert gguf_diff(via, direct, ignore=OURS_ONLY + card) == []


@pytest.mark.parametrize("bits,want", [(4, "Q4_0"), (8, "Q8_0")])
def test_gptq_experts_are_repacked_exactly(bits, want, tiny, tmp_path):
    """Regression, found by running our files through llama.cpp (bench/gguf_llamacpp_check.py): ``--gguf-type auto``
    chose Q4_0 for a GPTQ 4-bit Mixtral because its integers fit, but quantized the stacked experts a second time
    from their fp16 reconstruction (up to 8 % of the largest weight off) while reporting every layer exact.  Oracle:
    each expert's RTN integers, zeros and scales reconstructed here in NumPy (``fp16((q - z) * s)``), against the
    ``gguf`` package's own dequantization of the file's ``ffn_{gate,down,up}_exps``; every expert is a layer of the
    report, exact."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from exl2fmt.codec.gptq_fit import rtn_quantize
    from exl2fmt.formats.gptq import gptq_layer_tensors

    src = tiny("mixtral")
    q = tmp_path / "tiny-mixtral"
    shutil.copytree(src, q)
    t = load_file(str(src / "model.safetensors"))
    out, oracle = {}, {}
    for n, a in t.items():
        if n.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            c, s, z, g = rtn_quantize(a.astype(np.float16), bits, 32, sym=True)
            qz = c.astype(np.float32) - z[g].astype(np.float32)               # [K, N]
            oracle[n] = (qz * s[g].astype(np.float32)).astype(np.float16).T  # [N, K]
            for slot, arr in gptq_layer_tensors(c, s, z, g, bits).items():
                out[f"{n[:-7]}.{slot}"] = arr
        else:
            out[n] = a
    save_file(out, str(q / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": 32, "sym": True,
                                  "desc_act": False}
    (q / "config.json").write_text(json.dumps(cfg))
    rep = convert(q, tmp_path / "m.gguf", to="gguf")  # auto
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    tens = {x.name: x for x in r.tensors}
    E, L = 4, 2
    for li in range(L):
        for w, kind in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            x = tens[f"blk.{li}.ffn_{kind}_exps.weight"]
            assert x.tensor_type.name == want
            got = gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float16)  # [E, N, K]
            for e in range(E):
                ref = oracle[f"model.layers.{li}.block_sparse_moe.experts.{e}.{w}.weight"]
                assert np.array_equal(got[e].view(np.uint16), ref.view(np.uint16)), (li, w, e)
    s = rep.summary()
    assert s["layers"] == L * (4 + 3 * E) and s["lossy_layers"] == 0, s
    assert all(lr.verified for lr in rep.layers)


@pytest.mark.parametrize("arch,renormalized", [("qwen3_moe", True), ("qwen2_moe", False)])
def test_qwen_moe_router_normalization_is_llama_cpps(arch, renormalized, tiny, tmp_path):
    """Regression, found by running our files through llama.cpp (bench/gguf_llamacpp_check.py: a Qwen3-MoE
    with transformers' default norm_topk_prob=False gave logits 14 % of their scale off): GGUF has no key for the
    router's top-k renormalization, llama.cpp hard-codes it per architecture (src/models/qwen3moe.cpp
    ``build_moe_ffn(..., norm_w = true)``, qwen2moe.cpp ``false``).  GGUF -> HF now writes what llama.cpp
    computes (it wrote nothing, so transformers' default False made a Qwen3-MoE GGUF - llama.cpp's own
    converter's golden here - come back as a different model), and HF -> GGUF warns for a source that differs."""
    golden = next(k for k, v in MANIFEST.items() if v["arch"] == arch and v["type"] == "f16")
    back = tmp_path / "back"
    convert(GOLD / golden, back, to="fp16")
    assert json.loads((back / "config.json").read_text())["norm_topk_prob"] is renormalized
    import shutil

    src = tiny(arch)
    for have in (renormalized, not renormalized):
        d = tmp_path / f"src-{have}" / src.name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["norm_topk_prob"] = have
        (d / "config.json").write_text(json.dumps(cfg))
        rep = convert(d, tmp_path / f"{have}.gguf", to="gguf", gguf_type="f16")
        warned = [w for w in rep.warnings if "norm_topk_prob" in w]
        assert bool(warned) is (have != renormalized), rep.warnings


def test_goldens_are_small_and_listed():
    """Every golden is in MANIFEST.json with its sha256 and the llama.cpp commit; the set stays a few MB."""
    import hashlib

    files = sorted(p.name for p in GOLD.glob("*.gguf"))
    assert files == sorted(MANIFEST)
    for name in files:
        m = MANIFEST[name]
        assert hashlib.sha256((GOLD / name).read_bytes()).hexdigest() == m["sha256"], name
        assert len(m["llama_cpp_commit"]) == 40 and m["command"].startswith("python convert_hf_to_gguf.py")
    assert sum((GOLD / n).stat().st_size for n in files) < 5_000_000


def test_sentencepiece_rebuild_bounds_its_work(tmp_path):
    """A GGUF whose SentencePiece tokens are huge is not handed to the merge recovery (quadratic in a token's
    length): a warning and no tokenizer files, quickly, instead of minutes of work."""
    import time

    from exl2fmt.converters.gguf_vocab import rebuild_sentencepiece

    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    toks = ["<unk>", "<s>", "</s>", "a" * 20000]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 4)
    w.add_token_types([2, 3, 3, 1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    warnings: list[str] = []
    t0 = time.perf_counter()
    assert rebuild_sentencepiece(gguf.GGUFReader(str(p)), warnings) == {}
    assert time.perf_counter() - t0 < 2 and "too long to recover merges" in warnings[0]


def test_llama_layout_without_space_prefix(tiny, tmp_path):
    """transformers' Llama builder always prepends the SentencePiece space; a llama-architecture GGUF that says
    ``add_space_prefix = false`` is rebuilt without it, as llama.cpp tokenizes it (oracle: sentencepiece on a
    model trained without the dummy prefix)."""
    import sentencepiece
    from transformers import AutoTokenizer

    from exl2fmt.converters.gguf_vocab import rebuild_sentencepiece, spm_vocab

    src = tiny(MANIFEST["gemma3_text-sp-q8_0.gguf"])  # its tokenizer.model has add_dummy_prefix false
    tokens, scores, types = spm_vocab(src, 384)
    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    warnings: list[str] = []
    files = rebuild_sentencepiece(gguf.GGUFReader(str(p)), warnings)
    assert not warnings and json.loads(files["tokenizer_config.json"])["add_prefix_space"] is False
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    b = AutoTokenizer.from_pretrained(tmp_path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    for t in ("Hello world, the quick brown fox.", "new\tline\n\nx  two  spaces"):
        assert b(t)["input_ids"] == [2] + sp.encode(t), t
