"""The runtime (issue 35): EXL2 / GPTQ models run packed in transformers.

On the trained fixture ``tests/fixtures/tiny-llama`` quantized to GPTQ 4-bit with activation order (a non-monotone
g_idx) and repacked exactly to EXL2 (its permutation then is a real q_invperm): the packed model's logits equal
those of the same model dequantized by ``convert --to fp16`` and run in the same dtype (float32), through
``exl2fmt.load_model`` and through ``AutoModelForCausalLM.from_pretrained`` after ``import exl2fmt.hf``; the
decoder's loaded tensors stay at their stored size; no quantized linear holds a float weight.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-llama"
IDS = [[0, 5, 17, 300, 42, 99, 1000, 7, 8, 9, 10, 11, 12, 13, 400, 401, 402, 3, 2, 1999]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from exl2fmt import convert, quantize

    d = tmp_path_factory.mktemp("runtime")
    quantize(FIXTURE, d / "gptq", "gptq", bits=4, group_size=128, rows=8, length=64, device="cpu", order="act")
    convert(d / "gptq", d / "exl2", "exl2")
    convert(d / "gptq", d / "gptq-fp16", "fp16")
    convert(d / "exl2", d / "exl2-fp16", "fp16")
    return d


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float()


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _close(a, b):
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= 1e-3 * scale, (float((a - b).abs().max()), scale)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
def test_load_model_logits_equal_the_fp16_conversion(models, fmt):
    import exl2fmt
    from exl2fmt.runtime import PackedLinear, packed_modules

    m = exl2fmt.load_model(models / fmt, device="cpu", dtype=torch.float32)
    assert m.exl2fmt_format == fmt
    packed = packed_modules(m)
    assert len(packed) == 4 * 7 and all(isinstance(p, PackedLinear) for p in packed.values())
    ref = _reference(models / f"{fmt}-fp16")
    _close(_logits(m, IDS), _logits(ref, IDS))          # prefill: the scratch-tile path
    _close(_logits(m, [IDS[0][:3]]), _logits(ref, [IDS[0][:3]]))  # few rows: the fused path
    # generation: greedy tokens equal
    g1 = m.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=12, do_sample=False)
    g2 = ref.generate(torch.tensor([IDS[0][:4]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(g1, g2)


def test_packed_model_holds_no_float_weight_and_stays_small(models):
    import exl2fmt
    from exl2fmt.runtime import packed_modules, weight_bytes

    for fmt in ("exl2", "gptq"):
        m = exl2fmt.load_model(models / fmt, device="cpu", dtype=torch.float32)
        ref = _reference(models / f"{fmt}-fp16").half()
        for name, mod in packed_modules(m).items():
            for bname, b in mod.named_buffers():
                assert not (b.is_floating_point() and b.dim() == 2 and b.numel() >= mod.in_features * mod.out_features
                            // 4), (name, bname, b.shape)
            assert not list(mod.parameters())
        packed = weight_bytes(m.model.layers)
        fp16 = weight_bytes(ref.model.layers)
        # 4-bit g128 + the decoder's fp32 norms; the derived tables (row table, q_perm) included
        assert packed <= 0.4 * fp16, (fmt, packed, fp16)


def test_from_pretrained_after_import_hf(models, tmp_path):
    import exl2fmt.hf  # noqa: F401  (registers the quantizers)
    from transformers import AutoModelForCausalLM

    from exl2fmt.runtime import Exl2PackedLinear, GptqPackedLinear

    # an ExLlamaV2 directory may name its file output.safetensors, which from_pretrained does not look for
    src = models / "exl2"
    d = tmp_path / "exl2"
    d.mkdir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, d / ("model.safetensors" if f.suffix == ".safetensors" else f.name))
    for path, cls, ref in ((d, Exl2PackedLinear, "exl2-fp16"), (models / "gptq", GptqPackedLinear, "gptq-fp16")):
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        assert isinstance(m.model.layers[0].mlp.down_proj, cls)
        _close(_logits(m, IDS), _logits(_reference(models / ref), IDS))


def test_dense_directories_load_as_plain_transformers_models(models):
    import exl2fmt

    m = exl2fmt.load_model(FIXTURE, device="cpu", dtype=torch.float32)
    assert m.exl2fmt_format == "dense"
    assert isinstance(m.model.layers[0].mlp.down_proj, torch.nn.Linear)
    tok = exl2fmt.load_tokenizer(FIXTURE)
    assert tok("hello world")["input_ids"]


def test_kernels_match_the_dequantized_weight_on_odd_shapes():
    """Straddling 3/5/6-bit rows, a partial last tile (N = 48 of N_pad 64), a permutation, bias; GPTQ 3-bit with
    act-order g_idx; both the few-rows and the scratch-tile path."""
    from exl2fmt.formats import GptqLinear, layer_from_tensors
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.formats.gptq import gptq_layer_tensors
    from exl2fmt.layout import Tier
    from exl2fmt.runtime import Exl2PackedLinear, GptqPackedLinear

    rng = np.random.default_rng(0)
    K, N = 256, 48
    w = rng.standard_normal((N, K)).astype(np.float32)
    tiers = [Tier(0.25, 6, 32), Tier(0.25, 5, 32), Tier(0.5, 3, 64)]
    t = quantize_rtn(w, tiers, perm=rng.permutation(K), bias=rng.standard_normal(N).astype(np.float32))
    layer = layer_from_tensors("x", t, out_features=N)
    m = Exl2PackedLinear.from_layer(layer)
    W = torch.from_numpy(layer.dequantize().astype(np.float32))
    b = torch.from_numpy(layer.bias().astype(np.float32))
    for M in (1, 5, 40):
        x = torch.randn(M, K)
        assert torch.allclose(m(x), x @ W.T + b, atol=1e-4, rtol=1e-5)

    bits, G = 3, 4
    codes = rng.integers(0, 1 << bits, (K, 64)).astype(np.uint8)
    g_idx = rng.permutation(np.arange(K) // (K // G)).astype(np.int32)
    t = gptq_layer_tensors(codes, rng.random((G, 64)).astype(np.float16) * 0.1 + 0.01,
                           rng.integers(1, 1 << bits, (G, 64)), g_idx, bits)
    layer = GptqLinear("y", t, {"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"}, bits_hint=bits)
    m = GptqPackedLinear.from_layer(layer)
    W = torch.from_numpy(layer.dequantize().astype(np.float32))
    for M in (1, 40):
        x = torch.randn(M, K)
        assert torch.allclose(m(x), x @ W.T, atol=1e-4, rtol=1e-5)
