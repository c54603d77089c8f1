"""The Triton GPTQ kernels (``exl2fmt.kernels.gptq_triton``, via ``load_triton``) against the Numba reference.

Oracles: ``exl2fmt.codec.gptq.dequantize`` (bit-exact fp16 weights); ``x @ W`` in float64 over those weights for
the matmul, within the fp32-accumulation bound.  On the CPU the kernels run in Triton's interpreter (small
shapes); set ``EXL2FMT_TEST_DEVICE=cuda`` to run the same tests compiled on a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kernel tests need torch: pip install 'exl2fmt[kernels]'")
if importlib.util.find_spec("triton") is None:
    pytest.skip("kernel tests need triton: pip install 'exl2fmt[kernels]'", allow_module_level=True)

from exl2fmt.codec import gptq as ref  # noqa: E402
from exl2fmt.kernels import load_triton  # noqa: E402

DEVICE = os.environ.get("EXL2FMT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"EXL2FMT_TEST_DEVICE={DEVICE} but torch sees no CUDA device", allow_module_level=True)
kt = load_triton(DEVICE)


def make_layer(rng, K, N, bits, group_size, *, act_order, v2):
    """Random GPTQ tensors (NumPy, on-disk dtypes): codes with both extremes, zeros over the whole field range
    (v1 fields up to 2^b - 1, so z = 2^b occurs), fp16 scales of both signs, g_idx shuffled for act-order."""
    G = -(-K // group_size)
    codes = rng.integers(0, 1 << bits, size=(K, N)).astype(np.uint8)
    codes[0, :2] = [0, (1 << bits) - 1]
    fields = rng.integers(0, 1 << bits, size=(G, N))
    fields[0, 0] = (1 << bits) - 1
    scales = (rng.uniform(0.001, 0.02, size=(G, N)) * rng.choice([-1, 1], size=(G, N))).astype(np.float16)
    g_idx = (np.arange(K) // group_size).astype(np.int32)
    if act_order:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    return (ref.pack_qweight(codes, bits), ref.pack_qzeros(fields.astype(np.int64), bits), scales, g_idx)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


CASES = [(2, 64, False, False), (4, 32, True, False), (4, 128, False, True), (8, 64, True, True)]


@pytest.mark.parametrize("bits,group_size,act_order,v2", CASES)
def test_dequantize_is_bit_exact(bits, group_size, act_order, v2):
    rng = np.random.default_rng(bits * 100 + group_size)
    K, N = 256, 96
    qw, qz, sc, gi = make_layer(rng, K, N, bits, group_size, act_order=act_order, v2=v2)
    want = ref.dequantize(qw, qz, sc, gi, bits, v2=v2)                      # float16 [N, K]
    got = kt.gptq_dequantize(_t(qw), _t(qz), _t(sc), _t(gi), bits, v2=v2).cpu().numpy()   # float16 [K, N]
    assert np.array_equal(got.T.view(np.uint16), want.view(np.uint16))
    # bf16 output: each fp16 weight rounded once, to nearest even (torch's cast is the oracle)
    got16 = kt.gptq_dequantize(_t(qw), _t(qz), _t(sc), _t(gi), bits, v2=v2, dtype=torch.bfloat16).cpu()
    assert torch.equal(got16.view(torch.int16), torch.from_numpy(want.T.copy()).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("M", [1, 3, 16, 33])
@pytest.mark.parametrize("bits,group_size,act_order,v2", CASES[1:3])
def test_matmul_matches_x_at_reference_w(M, bits, group_size, act_order, v2):
    rng = np.random.default_rng(M)
    K, N = 160, 96                                                          # K not a multiple of the K tile
    qw, qz, sc, gi = make_layer(rng, K, N, bits, group_size, act_order=act_order, v2=v2)
    W = ref.dequantize(qw, qz, sc, gi, bits, v2=v2).astype(np.float64).T   # [K, N]
    x = rng.standard_normal((M, K)).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float16)
    want = x.astype(np.float64) @ W + bias
    bound = np.abs(x.astype(np.float64)) @ np.abs(W) + np.abs(bias)        # scale of the fp32 rounding error
    for path in ("fused", "dense"):
        y = kt.gptq_matmul(_t(x), _t(qw), _t(qz), _t(sc), _t(gi), bits, v2=v2, bias=_t(bias), path=path)
        assert y.dtype == torch.float16 and tuple(y.shape) == (M, N)
        err = np.abs(y.cpu().numpy().astype(np.float64) - want)
        # fp32 accumulation (K * 2^-24 of the bound) plus the final fp16 rounding (2^-11 of |y|)
        assert (err <= 1e-5 * bound + 2.0 ** -11 * np.abs(want) + 1e-6).all(), (path, float(err.max()))


def test_bf16_activations():
    rng = np.random.default_rng(7)
    K, N = 128, 64
    qw, qz, sc, gi = make_layer(rng, K, N, 4, 32, act_order=True, v2=False)
    W = ref.dequantize(qw, qz, sc, gi, 4).astype(np.float64).T
    x = torch.randn(5, K, dtype=torch.float32).to(torch.bfloat16)
    want = x.double().numpy() @ W
    y = kt.gptq_matmul(x.to(DEVICE).contiguous(), _t(qw), _t(qz), _t(sc), _t(gi), 4, path="fused")
    assert y.dtype == torch.bfloat16
    bound = np.abs(x.double().numpy()) @ np.abs(W)
    assert (np.abs(y.float().cpu().numpy() - want) <= 1e-5 * bound + 2.0 ** -8 * np.abs(want) + 1e-6).all()


def test_bad_shapes_raise_with_the_numbers():
    rng = np.random.default_rng(0)
    qw, qz, sc, gi = make_layer(rng, 64, 32, 4, 32, act_order=False, v2=False)
    with pytest.raises(ValueError, match="handle"):
        kt.gptq_dequantize(_t(qw), _t(qz), _t(sc), _t(gi), 3)
    with pytest.raises(ValueError, match="g_idx"):
        kt.gptq_dequantize(_t(qw), _t(qz), _t(sc), _t(gi[:-1]), 4)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        kt.gptq_matmul(torch.zeros(2, 63, dtype=torch.float16, device=DEVICE), _t(qw), _t(qz), _t(sc), _t(gi), 4)
    with pytest.raises(ValueError, match="scales must be"):
        kt.gptq_dequantize(_t(qw), _t(qz), _t(sc.astype(np.float32)), _t(gi), 4)
