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


def _f16(a):
    return np.asarray(a, dtype=np.float64).astype(np.float16).astype(np.float64)


def _check_layer(m, W, W16, bias, Ms):
    """The packed module against x @ W + b in float64, W [N, K] the oracle's fp16-rounded S * (v - Z), which must
    be the FP16 conversion's weight ``W16`` bit for bit; what is left is float32 summation (a weight left unrounded
    would be off by up to 2^-11 of itself, far outside the bound)."""
    assert np.array_equal(W, W16)
    b = np.zeros(W.shape[0]) if bias is None else bias
    for M in Ms:
        x = torch.randn(M, W.shape[1])
        y = m(x).double().numpy()
        xd = x.double().numpy()
        err = np.abs(y - (xd @ W.T + b)).max()
        assert err <= 2e-6 * (np.abs(xd) @ np.abs(W).T).max(), (M, err)


def test_kernels_match_the_exact_weight_on_odd_shapes():
    """Every EXL2 bit width (straddling 3/5/6-bit rows), a partial last tile (N = 48 of N_pad 64), a permutation,
    bias; GPTQ 3-bit with act-order g_idx (units holding rows of several groups) and 4-bit / 8-bit in static
    order; the few-rows (gemv) and the scratch-tile path.  Oracle: the weights S * (v - Z) in float64 from the
    unpacked codes, rounded to fp16, equal to the FP16 conversion's weights."""
    from exl2fmt.formats import GptqLinear, layer_from_tensors
    from exl2fmt.formats.exl2 import quantize_rtn
    from exl2fmt.formats.gptq import gptq_layer_tensors
    from exl2fmt.layout import Exl2Slot, Tier
    from exl2fmt.runtime import Exl2PackedLinear, GptqPackedLinear

    rng = np.random.default_rng(0)
    K, N = 256, 48
    w = rng.standard_normal((N, K)).astype(np.float32)
    tiers = [Tier(0.125, 8, 32), Tier(0.25, 6, 32), Tier(0.125, 5, 32), Tier(0.125, 4, 32), Tier(0.25, 3, 64),
             Tier(0.125, 2, 32)]
    perm = rng.permutation(K)
    t = quantize_rtn(w, tiers, perm=perm, bias=rng.standard_normal(N).astype(np.float32))
    layer = layer_from_tensors("x", t, out_features=N)
    assert sorted(set(layer.groups.bits.tolist())) == [2, 3, 4, 5, 6, 8]
    gt, codes, sc = layer.groups, layer.codes().astype(np.float64), layer.scale_codes().astype(np.float64)
    qsm = np.asarray(t[Exl2Slot.Q_SCALE_MAX]).astype(np.float16)
    W_stored = np.empty((K, N))
    for g in range(gt.G):
        r0, r = int(gt.row_start[g]), int(gt.rows[g])
        S = _f16((sc[g, :N] + 1) ** 2 * _f16(_f16(qsm[g]) / 256))
        W_stored[r0:r0 + r] = _f16(S * (codes[r0:r0 + r, :N] - 2.0 ** (gt.bits[g] - 1)))
    inv = np.asarray(t[Exl2Slot.Q_INVPERM]).astype(np.int64)  # stored row of each input feature
    m = Exl2PackedLinear.from_layer(layer)
    _check_layer(m, W_stored[inv].T, layer.dequantize().astype(np.float64), layer.bias().astype(np.float64),
                 (1, 5, 40))

    for bits, G, act in ((3, 4, True), (4, 5, False), (8, 2, False)):
        codes = rng.integers(0, 1 << bits, (K, 64)).astype(np.uint8)
        g_idx = np.minimum(np.arange(K) // 64, G - 1).astype(np.int32)
        if act:
            g_idx = rng.permutation(g_idx).astype(np.int32)
        scales = (rng.random((G, 64)) * 0.1 + 0.01).astype(np.float16)
        zeros = rng.integers(1, 1 << bits, (G, 64))
        t = gptq_layer_tensors(codes, scales, zeros, g_idx, bits)
        layer = GptqLinear("y", t, {"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"},
                           bits_hint=bits)
        m = GptqPackedLinear.from_layer(layer)
        W = _f16(scales.astype(np.float64)[g_idx] * (codes - zeros[g_idx].astype(np.float64)))
        _check_layer(m, W.T, layer.dequantize().astype(np.float64), None, (1, 3, 40))


_ACCEL_SCRIPT = """
import sys, torch
from exl2fmt.kernels import load_triton
load_triton("cpu")   # the interpreter, before transformers imports triton
import exl2fmt
from exl2fmt.runtime import linear as L, packed_modules
m = exl2fmt.load_model(sys.argv[1], device="cpu", dtype=torch.float32)
lin = packed_modules(m)["model.layers.0.mlp.down_proj"]
torch.manual_seed(0)
for M in (1, 24):
    x = torch.randn(M, lin.in_features)
    with torch.no_grad():
        L._is_accel = lambda device: False
        cpu_y = lin(x)
        L._is_accel = lambda device: True
        acc_y = lin(x)
    assert acc_y.dtype == torch.float32 and acc_y.shape == cpu_y.shape
    d, scale = float((acc_y - cpu_y).abs().max()), float(cpu_y.abs().max())
    print(M, d, scale)
    assert d <= 4e-3 * scale, (M, d, scale)
print("ok")
"""


@pytest.mark.parametrize("fmt", ["exl2", pytest.param("gptq", marks=pytest.mark.slow)])  # the interpreter is slow
def test_the_accelerator_path_runs_the_bundled_triton_kernels(models, fmt):
    """The GPU branch of a packed linear (``_accel``: the bundled Triton kernels, fp16 activations), run in
    Triton's interpreter on CPU tensors by declaring the CPU an accelerator (a fresh process: the interpreter must
    be chosen before anything imports triton): it gives the CPU kernel's result within fp16 activation rounding,
    for a few rows and for a prefill-sized batch."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", _ACCEL_SCRIPT, str(models / fmt)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
