"""The EXL2 head of a model that ties its head to its embedding (issue 40): by default no separate head is written
(the FP16 embedding serves as the head, as in GPTQ files and as ExLlamaV2 loads it: ``lm_head`` maps to
``model.embed_tokens`` under ``tie_word_embeddings`` and the loader falls back to that key); ``head_bits`` given
writes the quantized head; an untied model keeps its quantized head.

Oracle for the logits: transformers' own model built from the *source* checkpoint, each linear's weight replaced by
the NumPy twin's decode (``codec.oracle.dequantize``) of the raw EXL2 tensors, the embedding (and so the tied head)
kept from the source; against it, the output converted with ``convert --to fp16`` and loaded by transformers, and
``exl2fmt.runtime.load_model`` of the EXL2 directory itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exl2fmt.codec import oracle  # noqa: E402
from exl2fmt.container import open_model  # noqa: E402
from exl2fmt.converters import convert, validate_quantized_output  # noqa: E402
from exl2fmt.groups import decode_q_groups  # noqa: E402

VOCAB, HIDDEN = 384, 128


def _tiny(d, tied: bool):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=128, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (source dir, EXL2 dir, report): tied default, tied with head_bits 6, untied default (3.0 bpw)."""
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    base = tmp_path_factory.mktemp("tied")
    ids = base / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, VOCAB, (4, 32)))
    tied, untied = _tiny(base / "tied-src", True), _tiny(base / "untied-src", False)
    out = {}
    m = base / "measurement.json"       # measured once (the head is not measured): the later runs reuse it
    for name, src, kw in (("tied", tied, {"save_measurement": str(m)}), ("tied-head6", tied, {"head_bits": 6}),
                          ("untied", untied, {})):
        if name != "tied":
            kw["measurement"] = str(m)
        o = QuantOptions(target="exl2", bits=3.0, calibration=str(ids), rows=4, length=32, device="cpu",
                         extended=False, **kw)
        out[name] = (src, base / name, quantize_model(src, base / name, o, verify_output=validate_quantized_output))
    return out


def _names(d):
    m = open_model(d)
    try:
        return set(m.names())
    finally:
        m.close()


def _twin_logits(src, exl2_dir, ids):
    """Logits of the source model with every EXL2 linear of ``exl2_dir`` decoded by the NumPy twin."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    m = open_model(exl2_dir)
    try:
        keys = sorted({n.rsplit(".", 1)[0] for n in m.names() if n.endswith(".q_weight")})
        with torch.no_grad():
            for key in keys:
                g = {s: m.get(f"{key}.{s}") for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
                mod = hf.get_submodule(key)
                br = decode_q_groups(g["q_groups"], g["q_weight"].shape[0]).bits_rows()
                w = oracle.dequantize(g["q_weight"], g["q_scale"], g["q_scale_max"], br, g["q_invperm"],
                                      out_features=mod.weight.shape[0])
                if key == "lm_head" and hf.config.tie_word_embeddings:
                    hf.config.tie_word_embeddings = False
                    mod.weight = torch.nn.Parameter(mod.weight.detach().clone())   # untie: its own matrix
                mod.weight.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)))
            return hf(torch.tensor([ids])).logits[0].double(), keys
    finally:
        m.close()


def _fp16_logits(d, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


@pytest.mark.parametrize("name", ["tied", "tied-head6", "untied"])
def test_the_head_is_written_only_when_untied_or_asked_for_and_decodes_as_the_twin(runs, name, tmp_path):
    from exl2fmt.inspect import inspect_model
    from exl2fmt.validate import validate_model

    src, d, rep = runs[name]
    names = _names(d)
    quantized_head = name != "tied"
    assert any(n.startswith("lm_head.") for n in names) == quantized_head
    assert "lm_head.weight" not in names
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (name != "untied")       # the source's setting, as ExLlamaV2 reads it
    assert cfg["quantization_config"]["head_bits"] == (None if name == "tied" else 6)
    assert (rep.head_bpw is not None) == quantized_head
    assert rep.options["head_bits"] == (None if name == "tied" else 6)
    manifest = json.loads((d / "exl2fmt-manifest.json").read_text())
    assert ("lm_head" in manifest["layers"]) == quantized_head
    if not quantized_head:
        assert any("tied to the embedding" in line for line in rep.summary_lines())
        assert "tied to the embedding" in (d / "README.md").read_text()
    # inspect and validate
    s = inspect_model(d)["summary"]
    assert s["head_tied"] is (not quantized_head) and (s["bpw"]["head"] is None) == (not quantized_head)
    v = validate_model(d, deep=True)
    assert not v.failed, [c for c in v.checks if c.status.value == "FAIL"]
    # the fp16 conversion computes what the twin decode computes
    ids = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 12)]
    want, keys = _twin_logits(src, d, ids)
    assert ("lm_head" in keys) == quantized_head and len(keys) == 2 * 7 + quantized_head
    convert(d, tmp_path / "fp16", "fp16")
    got = _fp16_logits(tmp_path / "fp16", ids)
    out_cfg = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert ("lm_head.weight" in _names(tmp_path / "fp16")) == quantized_head
    assert out_cfg["tie_word_embeddings"] is (name == "tied")
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    # the runtime loads the EXL2 directory itself: the same logits at its float32 arithmetic's level
    from exl2fmt.runtime import load_model

    rt = load_model(d, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        run = rt(torch.tensor([ids])).logits[0].double()
    assert bool(rt.config.tie_word_embeddings) is (name == "tied")
    assert float((run - want).abs().max()) <= 1e-3 * scale
    assert torch.equal(run.argmax(-1), want.argmax(-1))


def test_the_tied_file_is_smaller_by_the_head(runs):
    """The tied default drops exactly the quantized head's bytes; the decoder layers are the same bytes."""
    a, b = runs["tied"][1], runs["tied-head6"][1]
    ma, mb = open_model(a), open_model(b)
    try:
        head = sum(mb.info(n).nbytes for n in mb.names() if n.startswith("lm_head."))
        assert head > 0 and set(mb.names()) - set(ma.names()) == {n for n in mb.names() if n.startswith("lm_head.")}
        for n in ma.names():
            assert np.array_equal(ma.get(n), mb.get(n)), n
    finally:
        ma.close()
        mb.close()


@pytest.mark.parametrize("name", ["tied", "tied-head6", "untied"])
def test_exl2_to_gptq_writes_no_dead_head_for_a_tied_model(runs, name, tmp_path):
    """EXL2 -> GPTQ: a tied model's quantized EXL2 head (``head_bits`` given, or ExLlamaV2's own files) is not
    written as a dense ``lm_head.weight`` that GPTQ loaders would ignore (they tie the head to the embedding);
    an untied model's head stays dense, the EXL2 reconstruction."""
    from exl2fmt.validate import validate_model

    d = runs[name][1]
    rep = convert(d, tmp_path / "g", "gptq")
    names = _names(tmp_path / "g")
    assert ("lm_head.weight" in names) == (name == "untied") and not any(n.startswith("lm_head.q") for n in names)
    assert any("ties its head to its embedding" in w for w in rep.warnings) == (name == "tied-head6")
    assert json.loads((tmp_path / "g" / "config.json").read_text())["tie_word_embeddings"] is (name != "untied")
    assert not validate_model(tmp_path / "g", deep=True).failed


def test_a_redundant_stored_head_of_a_tied_source_is_not_copied(runs, tmp_path):
    """A tied source that also stores ``lm_head.weight`` (which transformers ties away): the GPTQ output keeps one
    matrix, the embedding, as its head."""
    from safetensors.numpy import load_file, save_file

    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    src = runs["tied"][0]
    d = tmp_path / "src"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    t = load_file(str(src / "model.safetensors"))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, VOCAB, (2, 32)))
    quantize_model(d, tmp_path / "g", QuantOptions(target="gptq", bits=4, group_size=32, calibration=str(ids),
                                                   rows=2, length=32, device="cpu"),
                   verify_output=validate_quantized_output)
    names = _names(tmp_path / "g")
    assert "model.embed_tokens.weight" in names and not any(n.startswith("lm_head.") for n in names)
