"""The runtime's coverage (issue 35): every architecture, fused projections, a quantized head, v5 stacked MoE
experts, EXL3, device_map placement.

Oracle everywhere: the same quantized model dequantized by ``convert --to fp16`` and run by transformers itself
(``from_pretrained``, float32).  The packed model's logits must agree within 1e-3 x the logit scale with identical
top-1 (the packed kernels reproduce the fp16 weights bit for bit, so only float32 summation order differs).

Models: seeded tiny models from transformers' config classes (``tests/tiny_models.py``, ``tests/tiny_hf.py``),
made EXL2 either by the calibrated quantizer (the slow every-architecture loop) or by a round-to-nearest copy
(``_rtn_exl2``: every decoder linear, each MoE expert projection and the untied head, in a random permutation,
the fast cases); EXL3 models by the test-side encoder of ``tests/test_exl3.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [[0, 5, 17, 100, 42, 99, 150, 7, 8, 9, 10, 11, 12, 13, 40, 41, 42, 3, 2, 159]]
ROUTERS = (".gate", ".shared_expert_gate")


# ------------------------------------------------------------------------------------------------ helpers


def _rtn_exl2(src: Path, out: Path, seed: int = 0, keep_dense=lambda key: False) -> list[str]:
    """An EXL2 copy of the dense tiny model ``src``: every linear (Phi-3's fused qkv / gate_up split as ExLlamaV2
    stores them, every MoE expert projection, an untied head) round-to-nearest in a random permutation: 4-bit
    g32, the head 6-bit g32 and each down projection 3/5-bit tiers; routers, the linears ``keep_dense(key)``
    names and everything else as stored.  Returns the quantized keys."""
    from exl2fmt.container import open_model, write_sharded
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.layout import Tier

    cfg = json.loads((src / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, k = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    m = open_model(src)
    dense = {n: np.array(m.get(n)) for n in m.names()}
    m.close()
    rng = np.random.default_rng(seed)
    out_t, linears = {}, {}
    for name, arr in dense.items():
        key = name[:-len(".weight")]
        if not name.endswith(".weight") or arr.ndim != 2 or "embed" in name or key.endswith(ROUTERS) \
                or keep_dense(key):
            out_t[name] = arr
        elif key.endswith("qkv_proj"):
            base = key[:-len("qkv_proj")]
            linears.update({base + "q_proj": arr[:q], base + "k_proj": arr[q:q + k], base + "v_proj": arr[q + k:]})
        elif key.endswith("gate_up_proj"):
            base, half = key[:-len("gate_up_proj")], arr.shape[0] // 2
            linears.update({base + "gate_proj": arr[:half], base + "up_proj": arr[half:]})
        else:
            linears[key] = arr
    for key, w in linears.items():
        tiers = ([Tier(1.0, 6, 32)] if key == "lm_head" else
                 [Tier(0.5, 5, 32), Tier(0.5, 3, 32)] if key.endswith(("down_proj", ".w2")) and w.shape[1] >= 64
                 else [Tier(1.0, 4, 32)])
        b = out_t.pop(f"{key}.bias", None)
        for slot, arr in quantize_rtn(w.astype(np.float32), tiers, rng.permutation(w.shape[1]),
                                      bias=None if b is None else b.astype(np.float32)).items():
            out_t[f"{key}.{slot}"] = arr
    out.mkdir(parents=True)
    write_sharded(out, out_t, max_shard_bytes=1 << 40, prefix="output", metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "exl2", "version": "0.2.8", "bits": 4.0, "head_bits": 6}
    (out / "config.json").write_text(json.dumps(cfg))
    return sorted(linears)


def _hf_copy(src: Path, dst: Path) -> Path:
    """A copy whose one shard is named model.safetensors (from_pretrained does not look for output.safetensors)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / ("model.safetensors" if f.suffix == ".safetensors" else f.name))
    return dst


def _reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float()


def _close(a, b):
    scale = float(b.abs().max())
    assert scale > 0 and float((a - b).abs().max()) <= 1e-3 * scale, (float((a - b).abs().max()), scale)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _check_equal_to_fp16(model, ref):
    _close(_logits(model, IDS), _logits(ref, IDS))                  # prefill: the scratch-tile path
    _close(_logits(model, [IDS[0][:3]]), _logits(ref, [IDS[0][:3]]))  # few rows: the fused path


def _no_float_weights(model):
    """No packed module holds a float tensor as large as a quarter of its weight; no 2-D/3-D float parameter is
    left in a place the files store quantized."""
    from exl2fmt.runtime import packed_modules

    packed = packed_modules(model)
    assert packed
    for name, mod in packed.items():
        assert not list(mod.parameters()), name
        for bname, b in mod.named_buffers():
            assert not (b.is_floating_point() and b.numel() >= mod.in_features * mod.out_features // 4), (name, bname)
    return packed


@pytest.fixture(scope="module")
def rtn(tmp_path_factory):
    """arch -> (EXL2 RTN dir, its fp16 conversion, quantized keys), made once per module."""
    from tiny_models import make_tiny

    from exl2fmt import convert

    made = {}

    def get(arch):
        if arch not in made:
            d = tmp_path_factory.mktemp(f"rtn-{arch}")
            keys = _rtn_exl2(make_tiny(arch, d / "src"), d / "exl2")
            convert(d / "exl2", d / "fp16", "fp16")
            made[arch] = (d / "exl2", d / "fp16", keys)
        return made[arch]
    return get


# ------------------------------------------------------------------------------------------------ fused, head


def test_fused_projections_and_a_quantized_head_stay_packed(rtn, tmp_path):
    """Phi-3: qkv_proj / gate_up_proj over the split packed parts; the untied 6-bit head packed; through
    load_model and through from_pretrained after import exl2fmt.hf."""
    import exl2fmt
    import exl2fmt.hf  # noqa: F401
    from exl2fmt.runtime import Exl2PackedLinear, FusedLinear

    exl2, fp16, keys = rtn("phi3")
    assert "lm_head" in keys and "model.layers.0.self_attn.q_proj" in keys
    ref = _reference(fp16)
    for m in (exl2fmt.load_model(exl2, device="cpu", dtype=torch.float32),
              transformers.AutoModelForCausalLM.from_pretrained(str(_hf_copy(exl2, tmp_path / "hf")),
                                                                dtype=torch.float32).eval()):
        attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
        assert isinstance(attn.qkv_proj, FusedLinear) and isinstance(mlp.gate_up_proj, FusedLinear)
        assert [type(p) for p in attn.qkv_proj._parts] == [Exl2PackedLinear] * 3
        assert attn.qkv_proj.out_features == ref.model.layers[0].self_attn.qkv_proj.out_features
        assert isinstance(m.lm_head, Exl2PackedLinear) and not m.config.tie_word_embeddings
        assert m.lm_head.q_weight.data_ptr() != 0 and m.get_input_embeddings().weight.dim() == 2
        packed = _no_float_weights(m)
        assert len(packed) == len(keys)
        _check_equal_to_fp16(m, ref)


# ------------------------------------------------------------------------------------------------ MoE


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_stacked_moe_experts_stay_packed(rtn, tmp_path, arch):
    """transformers 5's stacked experts (3-D gate_up_proj / down_proj) become one packed linear per expert
    projection (Mixtral's w1/w3/w2 and the Qwen names; Qwen2-MoE's shared expert beside them); logits and greedy
    tokens equal the fp16 conversion's, through load_model and from_pretrained."""
    import exl2fmt
    import exl2fmt.hf  # noqa: F401
    from exl2fmt.runtime import Exl2PackedLinear
    from exl2fmt.runtime.moe import PackedExperts

    exl2, fp16, keys = rtn(arch)
    ref = _reference(fp16)
    E = ref.config.num_local_experts if arch == "mixtral" else ref.config.num_experts
    leaves = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(_hf_copy(exl2, tmp_path / "hf")),
                                                           dtype=torch.float32).eval()
    for m in (exl2fmt.load_model(exl2, device="cpu", dtype=torch.float32), hf):
        for layer in m.model.layers:
            ex = layer.mlp.experts
            assert isinstance(ex, PackedExperts) and len(ex) == E
            assert all(isinstance(getattr(ex[e], leaf), Exl2PackedLinear) for e in range(E) for leaf in leaves)
        assert not [n for n, p in m.named_parameters() if p.dim() == 3]
        assert len(_no_float_weights(m)) == len(keys)
        _check_equal_to_fp16(m, ref)
    g = m.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=10, do_sample=False)
    assert torch.equal(g, ref.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=10, do_sample=False))
    # the packed experts' state dict is the checkpoint's own names (after transformers' block rename)
    sd = set(hf.state_dict())
    assert f"model.layers.0.mlp.experts.{E - 1}.{leaves[2]}.q_weight" in sd


def test_incomplete_packed_experts_are_refused(rtn, tmp_path):
    """An expert projection missing from a quantized MoE checkpoint: ARCH_UNSUPPORTED naming it, not a
    silently random expert."""
    from safetensors.numpy import load_file, save_file

    import exl2fmt
    from exl2fmt.errors import ErrorCode, Exl2Error

    exl2, _, _ = rtn("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(exl2, bad)
    f = next(bad.glob("*.safetensors"))
    t = {k: v for k, v in load_file(str(f)).items() if ".experts.2.up_proj." not in k}
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(Exl2Error) as e:
        exl2fmt.load_model(bad, device="cpu")
    assert e.value.code is ErrorCode.ARCH_UNSUPPORTED and "expert 2 up_proj" in str(e.value), str(e.value)


def test_dense_experts_beside_packed_linears_are_stacked(tmp_path):
    """A MoE checkpoint whose attention and head are EXL2 but whose experts stay 16-bit: the stacked 3-D
    parameters are built from the per-expert tensors (load_model) or by transformers' merge (from_pretrained)."""
    from tiny_models import make_tiny

    import exl2fmt
    import exl2fmt.hf  # noqa: F401
    from exl2fmt import convert

    src = make_tiny("mixtral", tmp_path / "src")
    keys = _rtn_exl2(src, tmp_path / "q", keep_dense=lambda key: ".experts." in key)
    assert keys and not [k for k in keys if ".experts." in k]
    convert(tmp_path / "q", tmp_path / "fp16", "fp16")
    ref = _reference(tmp_path / "fp16")
    for m in (exl2fmt.load_model(tmp_path / "q", device="cpu", dtype=torch.float32),
              transformers.AutoModelForCausalLM.from_pretrained(str(_hf_copy(tmp_path / "q", tmp_path / "hf")),
                                                                dtype=torch.float32).eval()):
        ex = m.model.layers[0].mlp.experts
        assert ex.gate_up_proj.dim() == 3 and ex.gate_up_proj.device.type == "cpu"
        _check_equal_to_fp16(m, ref)


# ------------------------------------------------------------------------------------------------ EXL3


@pytest.fixture(scope="module")
def exl3_models(tmp_path_factory):
    """name -> (EXL3 dir, fp16 conversion): qwen2 (q/k/v biases) and mixtral (routers kept fp16), every rate and
    codebook of the encoder's plan."""
    from test_exl3 import make_exl3
    from tiny_hf import make_tiny

    from exl2fmt import convert

    out = {}
    for i, arch in enumerate(("qwen2", "mixtral")):
        base = tmp_path_factory.mktemp(f"x3-{arch}")
        src = make_tiny(arch, base / "src", tokenizer="bpe" if arch == "qwen2" else None)
        make_exl3(src, base / "exl3", seed=70 + i, keep_dense=lambda key: key.endswith(ROUTERS))
        for f in src.glob("*token*"):
            shutil.copy(f, base / "exl3" / f.name)
        convert(base / "exl3", base / "fp16", "fp16")
        out[arch] = (base / "exl3", base / "fp16")
    return out


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_exl3_runs_packed(exl3_models, arch):
    import exl2fmt
    import exl2fmt.hf  # noqa: F401
    from exl2fmt.runtime.exl3 import Exl3PackedLinear
    from exl2fmt.runtime.moe import PackedExperts

    d, fp16 = exl3_models[arch]
    ref = _reference(fp16)
    for m in (exl2fmt.load_model(d, device="cpu", dtype=torch.float32),
              transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()):
        packed = _no_float_weights(m)
        assert all(isinstance(p, Exl3PackedLinear) for p in packed.values())
        assert isinstance(m.lm_head, Exl3PackedLinear)
        if arch == "mixtral":
            assert isinstance(m.model.layers[1].mlp.experts, PackedExperts)
        _check_equal_to_fp16(m, ref)
    assert exl2fmt.load_model(d, device="cpu").exl2fmt_format == "exl3"


def test_generate_cli_runs_an_exl3_model(exl3_models):
    """``exl2fmt generate --json`` on an EXL3 model: the greedy tokens of transformers' own generate on the fp16
    conversion."""
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    d, fp16 = exl3_models["qwen2"]
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    r = CliRunner().invoke(app, ["generate", str(d), "--prompt", "the quick brown", "-n", "8", "--ignore-eos",
                                 "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    doc = json.loads(r.stdout)
    ids = tok("the quick brown")["input_ids"]
    want = _reference(fp16).generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert doc["token_ids"] == want[0, len(ids):].tolist()


@pytest.mark.parametrize("legacy", [False, True])
def test_exl3_linear_stripes_equal_the_decoded_weight(monkeypatch, legacy):
    """K = 300, N = 200 (padded 384 x 256), a bias, legacy su/sv sign words or suh/svh; stripes forced to 128
    rows so three are decoded and summed; 1 and 40 rows.  Oracle: the NumPy reference decoder's weight."""
    import exl3_oracle as R
    from test_exl3 import encode_linear

    from exl2fmt.formats import layer_from_tensors
    from exl2fmt.runtime import exl3 as rx3

    rng = np.random.default_rng(3)
    K, N = 300, 200
    w = (0.05 * rng.standard_normal((N, K))).astype(np.float32)
    t = encode_linear(rng, w, 3, "mcg", bias=rng.standard_normal(N).astype(np.float32), legacy=legacy)
    layer = layer_from_tensors("x", t, in_features=K, out_features=N)
    m = rx3.Exl3PackedLinear.from_layer(layer)
    W = torch.from_numpy(R.dequantize({k: v for k, v in t.items() if k != "bias"}, K, N).astype(np.float32))
    b = torch.from_numpy(t["bias"][:N].astype(np.float32))
    monkeypatch.setattr(rx3, "STRIPE_ELEMENTS", 128 * N)
    assert m.stripe_rows() == 128
    for M in (1, 40):
        x = torch.randn(M, K)
        torch.testing.assert_close(m(x), x @ W.T + b, atol=1e-4, rtol=1e-5)
    assert not any(bf.is_floating_point() and bf.numel() >= K * N // 4 for bf in m.buffers())


# ------------------------------------------------------------------------------------------------ device_map


def test_device_map_auto_offloads_layers_to_disk(rtn, tmp_path):
    """max_memory too small for the packed model: accelerate puts modules on disk, their packed tensors live in
    the offload folder (meta in memory between forwards) and the logits and greedy tokens are unchanged."""
    import exl2fmt
    import exl2fmt.hf  # noqa: F401
    from exl2fmt.runtime import weight_bytes

    exl2, fp16, _ = rtn("mixtral")
    total = weight_bytes(exl2fmt.load_model(exl2, device="cpu"))
    # load_model places the loaded packed model (its gemv work lists included); transformers sizes the model
    # from the checkpoint's tensors before the quantizer builds those lists: each gets 70 % of what it counts
    stored = sum(f.stat().st_size for f in exl2.glob("*.safetensors"))
    ref = _reference(fp16)
    off = tmp_path / "offload"
    m = exl2fmt.load_model(exl2, device_map="auto", max_memory={"cpu": int(0.7 * total)}, offload_folder=off)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(_hf_copy(exl2, tmp_path / "hf")), dtype=torch.float32, device_map="auto",
        max_memory={"cpu": int(0.7 * stored)},
        offload_folder=str(tmp_path / "hf-off"), offload_buffers=True).eval()
    for model, folder in ((m, off), (hf, tmp_path / "hf-off")):
        dm = model.hf_device_map
        assert "disk" in dm.values() and "cpu" in dm.values(), dm
        on_disk = [k for k, v in dm.items() if v == "disk"]
        q = [b for k in on_disk for n, b in model.get_submodule(k).named_buffers() if n.endswith("q_weight")]
        assert q and all(b.device.type == "meta" for b in q)
        if model is m:   # (transformers reads offloaded tensors straight from the checkpoint's safetensors)
            assert any(p.name.endswith("q_weight.dat") for p in folder.iterdir())
        _check_equal_to_fp16(model, ref)
        # after the forwards, nothing of an offloaded layer stays resident: no cached view of its packed words
        held = [k for k in on_disk for mod in model.get_submodule(k).modules()
                if getattr(mod, "_np_cache", None) is not None]
        assert held == [], held
    g = m.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=6, do_sample=False)
    assert torch.equal(g, ref.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=6, do_sample=False))


def test_device_map_dict_and_the_placements_refused(rtn, tmp_path):
    import exl2fmt
    from exl2fmt.errors import ErrorCode, Exl2Error

    exl2, fp16, _ = rtn("phi3")
    dm = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
          "model.rotary_emb": "cpu", "lm_head": "disk"}
    m = exl2fmt.load_model(exl2, device_map=dm, offload_folder=tmp_path / "off")
    assert m.model.layers[1].self_attn.q_proj.q_weight.device.type == "meta"
    _check_equal_to_fp16(m, _reference(fp16))
    bad = [(dict(device_map=dm), "offload_folder"),                                        # disk, no folder
           (dict(device_map={k: v for k, v in dm.items() if k != "lm_head"}), "lm_head"),  # a module left out
           (dict(device_map={"": "meta"}), "meta")]
    if not torch.cuda.is_available():
        bad.append((dict(device_map={"": "cuda:0"}), "CUDA"))
    for kw, words in bad:
        with pytest.raises(Exl2Error) as e:
            exl2fmt.load_model(exl2, **kw)
        assert e.value.code is ErrorCode.PLACEMENT_INFEASIBLE and words in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------ every arch


def _every_arch():
    from tiny_models import ARCHS

    return [(a, "exl2") for a in sorted(ARCHS)] + [("qwen3_moe", "gptq"), ("mixtral", "gptq"), ("phi3", "gptq")]


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt", _every_arch())
def test_every_quantizer_architecture_runs_packed(tmp_path, arch, fmt):
    """The calibrated quantizer's output for every architecture it handles (EXL2 4.0 bpw, 5.0 for Qwen-MoE; GPTQ
    4-bit g32 for the fused and MoE ones): packed logits equal the fp16 conversion's; every stored quantized
    linear is packed."""
    from tiny_models import make_tiny

    import exl2fmt
    from exl2fmt import convert
    from exl2fmt.container import open_model
    from exl2fmt.model import find_layers
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    src = make_tiny(arch, tmp_path / "src")
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    # (Qwen-MoE's 32-wide experts cannot reach 4.0 bpw: their groups' overhead alone needs ~4.25)
    opts = dict(bits=5.0 if arch.endswith("_moe") else 4.0) if fmt == "exl2" else dict(bits=4, group_size=32)
    quantize_model(src, tmp_path / "q", QuantOptions(target=fmt, calibration=str(ids), rows=4, length=32,
                                                     device="cpu", **opts))
    convert(tmp_path / "q", tmp_path / "fp16", "fp16")
    with open_model(tmp_path / "q") as mf:
        stored = [k for k, r in find_layers(mf.names()).items() if r.format.value == fmt]
    m = exl2fmt.load_model(tmp_path / "q", device="cpu", dtype=torch.float32)
    assert len(_no_float_weights(m)) == len(stored)
    _check_equal_to_fp16(m, _reference(tmp_path / "fp16"))
