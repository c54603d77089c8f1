"""The project's one forward (the model runner, ``exl2fmt.runner.model.HFModel``) against transformers' full model.

The quantizer's calibration, ``validate --run`` and the perplexity report all run models through the runner:
transformers' modeling code on a meta skeleton, one decoder layer materialized from the safetensors files at a
time.  Each case builds a tiny random model with transformers, saves it, and checks, in float32, that

* the runner's embedding output and every decoder layer's output equal what the layers of transformers' own full
  model (loaded from the same files) compute, observed with hooks on its modules (per block, not only at the end);
* the runner's logits equal the full model's (ids outside the vocabulary read row 0);
* every tensor the runner reads is in the checkpoint and nothing saved is left unread.

Cases: Llama variants (q/k/v/o and MLP biases with llama3 RoPE scaling, linear RoPE scaling), Mistral with a
sliding window shorter than the sequence and one KV head, Qwen2 tied and stored as BF16, Qwen3 (q/k norms), and
the tiny models of ``tests/tiny_models.py`` for Gemma 2 (soft-capping, extra norms), Phi-3 (fused projections)
and Cohere (parallel residual, logit scale).  ``tests/test_hf_engine.py`` covers the other architectures' logits,
the captured linear inputs and the half-layer outputs the quantizer measures.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import make_tiny  # noqa: E402

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.runner.model import HFModel  # noqa: E402
from exl2fmt.runner.weights import WeightSource  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-5)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}

#: name -> (config class, overrides of BASE); built here with every parameter non-trivial
CASES = {
    "llama-bias-llama3rope": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "rope_parameters": LLAMA3}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 500.0}}),
    "mistral-window": ("MistralConfig", {"sliding_window": 7, "num_key_value_heads": 1}),
    "qwen2-tied-bf16": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 4}),
}
#: the shared tiny models (tests/tiny_models.py)
TINY = ("llama", "qwen2", "gemma2", "phi3", "cohere")


def _build(name, out):
    if name in TINY:
        make_tiny(name, out)
        return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    cls_name, extra = CASES[name]
    cfg = getattr(transformers, cls_name)(**{**BASE, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1: make every parameter matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() == 2 else 0.3)
    # stored as BF16 for the bf16 case; the reference is transformers reading the files back in float32
    model.to(torch.bfloat16 if "bf16" in name else torch.float32).save_pretrained(out)
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=[*CASES, *TINY])
def case(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, out)
    eng = HFModel.open(out)
    yield request.param, model, eng
    eng.close()


def _ids(vocab, rows=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g)


def _close(got, want, what, rel=2e-6):
    """|got - want| <= rel * max(|want|, 1) everywhere: float32 rounding, nothing more."""
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    scale = max(float(want.abs().max()), 1.0)
    err = float((got - want).abs().max())
    assert err <= rel * scale, (what, err, scale)


def test_block_outputs_and_logits_equal_transformers(case):
    name, model, eng = case
    V = eng.vocab_size
    ids = _ids(V)
    ids[0, 3] = V + 5                      # out of vocabulary -> row 0, as upstream's quantizer
    seen: dict = {}
    layers = model.base_model.layers
    hooks = [layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("in", a[0] if a else kw["hidden_states"]), with_kwargs=True)]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        want = model(input_ids=torch.where(ids < V, ids, 0)).logits
    for hk in hooks:
        hk.remove()

    h = eng.embed(ids)
    _close(h, seen["in"], (name, "embedding"))
    for i in range(eng.num_layers):
        h = eng.runner(i).forward(h)
        _close(h, seen[i], (name, f"layer {i}"))
    eng.release()
    _close(eng.logits(h), want, (name, "logits"), rel=5e-6)
    _close(eng.forward(ids), want, (name, "forward"), rel=5e-6)


def test_reads_exactly_the_checkpoint(case):
    name, model, eng = case
    eng.check_weights()
    assert set(eng.expected_tensors()) == set(eng.src.names()), name


@pytest.mark.parametrize("patch, words", [
    ({"model_type": "no_such_model"}, "no_such_model"),
    ({"model_type": "t5"}, "encoder-decoder"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}, "linears"),   # Conv1D, not nn.Linear
])
def test_architectures_the_runner_cannot_drive(patch, words):
    with pytest.raises(Exl2Error) as ei:
        HFModel({**BASE, **patch}, WeightSource({}))
    assert ei.value.code is ErrorCode.ARCH_UNSUPPORTED and words in str(ei.value), str(ei.value)


def test_weight_source_dtypes_and_shape_check(tmp_path):
    """F16 / BF16 / F32 tensors read back as the exact float32 values; a wrong shape is named before compute."""
    from exl2fmt.container import RawTensor, write_safetensors

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    bf_bits = (x.view(np.uint32) >> 16).astype(np.uint16)          # truncation to bf16 bit patterns
    write_safetensors(tmp_path / "model.safetensors", {
        "a": x.astype(np.float16), "b": RawTensor("BF16", (4, 8), bf_bits), "c": x, "d": np.arange(3, dtype=np.int32),
    })
    src = WeightSource(tmp_path)
    assert torch.equal(src.get("a"), torch.from_numpy(x.astype(np.float16).astype(np.float32)))
    assert torch.equal(src.get("b"), torch.from_numpy((bf_bits.astype(np.uint32) << 16).view(np.float32)))
    assert torch.equal(src.get("c"), torch.from_numpy(x)) and src.get("c", torch.float16).dtype == torch.float16
    with pytest.raises(Exl2Error) as ei:
        src.get("d")
    assert ei.value.code is ErrorCode.SLOT_DTYPE
    with pytest.raises(Exl2Error) as ei:
        src.get("zzz")
    assert ei.value.code is ErrorCode.TENSOR_NOT_FOUND
    src.close()

    cfg = {"model_type": "llama", **BASE}
    shapes = HFModel(cfg, WeightSource({})).expected_tensors()
    assert shapes["model.layers.1.mlp.up_proj.weight"] == (96, 64) and "lm_head.weight" not in shapes  # tied
    tensors = {k: np.zeros(s, np.float16) for k, s in shapes.items()}
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((95, 64), np.float16)
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    eng = HFModel.open(tmp_path / "m")
    with pytest.raises(Exl2Error) as ei:
        eng.check_weights()
    assert ei.value.code is ErrorCode.CONFIG_MISMATCH and ei.value.tensor == "model.layers.1.mlp.up_proj.weight"
    eng.close()
