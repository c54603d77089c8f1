"""The quantizer's calibration forward (exl2fmt.quant.forward) against transformers as a peer.

Each case builds a tiny random model with transformers, saves it as safetensors, and checks that our streamed
forward over the saved files gives transformers' logits (fp32, eager attention), and that the captured inputs
of the linear layers are exactly what transformers' modules receive.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.quant import forward as fw  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-5)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-bias-llama3rope": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True,
                                                   "rope_parameters": LLAMA3}),
    "llama-linear-rope": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 500.0}}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 7, "num_key_value_heads": 1}),
    "qwen2-tied-bf16": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {"num_key_value_heads": 4}),
}
CONFIG_CLS = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
              "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config"}


def _build(name, tmp_path_factory):
    cls_name, extra = CASES[name]
    cfg = getattr(transformers, CONFIG_CLS[cls_name])(**{**BASE, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(hash(name) % 1000)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1: make every parameter matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() == 2 else 0.3)
    out = tmp_path_factory.mktemp(name)
    if "bf16" in name:
        # stored as BF16; the reference is transformers reading those files back in float32 (casting the module
        # in memory would also round its RoPE frequency buffer)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        model = getattr(transformers, cls_name).from_pretrained(out, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    else:
        model.save_pretrained(out, safe_serialization=True)
    return model, out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model, path = _build(request.param, tmp_path_factory)
    spec, src = fw.load_spec(path)
    yield request.param, model, spec, src
    src.close()


def _ids(spec, rows=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (rows, length), generator=g)


def test_spec_from_saved_config(case):
    name, model, spec, src = case
    cfg = model.config
    assert spec.arch == cfg.model_type
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == \
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert spec.qk_norm == (cfg.model_type == "qwen3")
    assert spec.qkv_bias == (cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)))
    fw.check_weights(spec, src)   # every tensor the forward reads is there with the implied shape
    # the expected-tensor list is exactly the checkpoint (nothing read that is not saved, nothing left unread)
    assert set(spec.expected_tensors(src)) == set(src.names())


def test_logits_match_transformers(case):
    name, model, spec, src = case
    ids = _ids(spec)
    ids[0, 3] = spec.vocab_size + 5        # out of vocabulary -> row 0, as upstream's quantizer
    with torch.no_grad():
        ref = model(input_ids=torch.where(ids < spec.vocab_size, ids, 0)).logits
    ours = fw.forward(spec, src, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 2e-5 * max(scale, 1.0), (name, err, scale)


def test_capture_matches_module_inputs(case):
    name, model, spec, src = case
    ids = _ids(spec, seed=1)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    layer = model.model.layers[1]
    for key, mod in [("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                     ("o_proj", layer.self_attn.o_proj), ("gate_proj", layer.mlp.gate_proj),
                     ("down_proj", layer.mlp.down_proj)]:
        hooks.append(mod.register_forward_pre_hook(lambda m, args, key=key: seen.__setitem__(key, args[0].clone())))
    with torch.no_grad():
        model(input_ids=ids)
    for hk in hooks:
        hk.remove()

    h = fw.embed(spec, src, ids)
    cs = fw.rope(spec, ids.shape[1])
    cap: dict = {}
    for i in range(spec.num_layers):
        cap = {}
        h = fw.attention_block(spec, i, h, src, rope=cs, capture=cap)
        h = fw.mlp_block(spec, i, h, src, capture=cap)
    assert cap["k_proj"] is cap["q_proj"] and cap["v_proj"] is cap["q_proj"] and cap["up_proj"] is cap["gate_proj"]
    for key, want in seen.items():
        got = cap[key]
        assert got.shape == want.shape and got.dtype == torch.float32, key
        tol = 2e-5 * max(want.abs().max().item(), 1.0)
        assert (got - want).abs().max().item() <= tol, (name, key)


def test_substitute_linears(case):
    """A substitute Linear is used where given: replacing o_proj of layer 0 by its dense twin changes nothing,
    replacing it by zero removes that block's attention contribution exactly."""
    name, model, spec, src = case
    ids = _ids(spec, rows=1, length=12, seed=2)
    base = fw.forward(spec, src, ids)
    key = spec.linear_key(0, "o_proj")
    w = src.get(f"{key}.weight")
    b = src.get(f"{key}.bias") if src.has(f"{key}.bias") else None
    calls = []

    def same(k):
        if k == key:
            calls.append(k)
            return fw.dense_linear(w, b)
        return None
    assert torch.equal(fw.forward(spec, src, ids, same), base) and calls == [key]

    zero = fw.dense_linear(torch.zeros_like(w))
    h0 = fw.embed(spec, src, ids)
    h1 = fw.attention_block(spec, 0, h0, src, {"o_proj": zero})
    assert torch.equal(h1, h0)


def test_llama3_rope_differs_from_plain():
    """The llama3 rule keeps short wavelengths, divides long ones by factor and interpolates in between --
    checked by hand on the inverse frequencies."""
    cfg = {"model_type": "llama", **BASE, "rope_theta": 10000.0,
           "rope_scaling": {"rope_type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_theta"}}}
    spec = fw.ModelSpec.from_config(cfg)
    plain = fw.ModelSpec.from_config({**cfg, "rope_scaling": None})
    inv = fw._inv_freq(spec, None).double()
    inv0 = fw._inv_freq(plain, None).double()
    wl = 2 * np.pi / inv0
    for j in range(len(inv0)):
        if wl[j] < 16 / 4:
            assert inv[j] == inv0[j]
        elif wl[j] > 16 / 1:
            assert torch.isclose(inv[j], inv0[j] / 8)
        else:
            t = (16 / wl[j] - 1) / (4 - 1)
            assert torch.isclose(inv[j], (1 - t) * inv0[j] / 8 + t * inv0[j])
    assert spec.rope_scaling["rope_type"] == "llama3" and plain.rope_scaling is None


@pytest.mark.parametrize("patch, code, words", [
    ({"model_type": "gemma2"}, ErrorCode.ARCH_UNSUPPORTED, "gemma2"),
    ({"model_type": None, "architectures": ["Qwen2ForCausalLM"]}, None, None),
    ({"hidden_act": "gelu"}, ErrorCode.ARCH_UNSUPPORTED, "gelu"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ErrorCode.ARCH_UNSUPPORTED, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ErrorCode.CONFIG_INVALID, "low_freq_factor"),
    ({"num_key_value_heads": 3}, ErrorCode.CONFIG_INVALID, "multiple"),
    ({"hidden_size": "64"}, ErrorCode.CONFIG_INVALID, "hidden_size"),
    ({"intermediate_size": None}, ErrorCode.CONFIG_INVALID, "intermediate_size"),
])
def test_config_errors(patch, code, words):
    cfg = {"model_type": "llama", **BASE, **patch}
    if code is None:
        assert fw.ModelSpec.from_config(cfg).arch == "qwen2"
        return
    with pytest.raises(Exl2Error) as ei:
        fw.ModelSpec.from_config(cfg)
    assert ei.value.code is code and words in str(ei.value)


def test_weight_source_dtypes_and_shape_check(tmp_path):
    """F16 / BF16 / F32 tensors read back as the exact float32 values; a wrong shape is named before compute."""
    from exl2fmt.container import RawTensor, write_safetensors

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    bf_bits = (x.view(np.uint32) >> 16).astype(np.uint16)          # truncation to bf16 bit patterns
    write_safetensors(tmp_path / "model.safetensors", {
        "a": x.astype(np.float16), "b": RawTensor("BF16", (4, 8), bf_bits), "c": x, "d": np.arange(3, dtype=np.int32),
    })
    src = fw.WeightSource(tmp_path)
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

    spec = fw.ModelSpec.from_config({"model_type": "llama", **BASE})
    tensors = {k: np.zeros(s, np.float16) for k, s in spec.expected_tensors().items()}
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((95, 64), np.float16)
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", **BASE}))
    spec2, src2 = fw.load_spec(tmp_path / "m")
    with pytest.raises(Exl2Error) as ei:
        fw.check_weights(spec2, src2)
    assert ei.value.code is ErrorCode.CONFIG_MISMATCH and ei.value.tensor == "model.layers.1.mlp.up_proj.weight"
    src2.close()
