"""Triton EXL2 kernels (exl2fmt.kernels) against the Numba reference and the spec's golden words.

Device: ``EXL2FMT_TEST_DEVICE`` ("cpu", "cuda", "cuda:1", ...); default cuda when torch sees one, else cpu.  On
cpu the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``load_triton`` before the kernel
module is imported), so shapes stay tiny.  The module is skipped when torch or triton is not installed.

* Dequantization must equal ``exl2fmt.codec.exl2.dequantize_stored`` / ``dequantize`` bit for bit (fp16 compared
  as uint16 patterns), for every width, mixed tiers, odd N, with and without act-order, and q_scale_max values
  over the whole fp16 range (subnormals, overflow to inf).
* The matmul is compared with y_ref = x @ W_ref + bias computed in float64 from the reference fp16 W, with the
  elementwise bound documented at ``matmul_bound``, for M in {1, 3, 16, 33} on every path (gemv, dot, dense),
  fp16 and bf16 x, bias of length N or N_pad, act-order on and off, K split over programs, strided x.

Runtime on the interpreter: about 20 s on 2 CPU cores.  On a GPU the first run compiles about 20 kernel
variants (the matmul kernel takes ~10 s each to compile), later runs hit Triton's cache.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kernel tests need torch: pip install 'exl2fmt[kernels]'")
if importlib.util.find_spec("triton") is None:  # not imported here: load_triton must see it first (interpreter)
    pytest.skip("kernel tests need triton: pip install 'exl2fmt[kernels]'", allow_module_level=True)

from conftest import F16_SPECIAL_POSITIVE, f16_bits, random_codes, random_f16  # noqa: E402
from exl2fmt.codec import exl2 as ref  # noqa: E402
from exl2fmt.groups import group_table_from_rows  # noqa: E402
from exl2fmt.kernels import load_triton  # noqa: E402
from exl2fmt.formats import layer_from_tensors  # noqa: E402
from exl2fmt.layout import BIT_WIDTHS, EXL2_BITS, pad32  # noqa: E402
from exl2fmt.formats.exl2 import exl2_tensors  # noqa: E402

DEVICE = os.environ.get("EXL2FMT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"EXL2FMT_TEST_DEVICE={DEVICE} but torch sees no CUDA device", allow_module_level=True)
kt = load_triton(DEVICE)

#: A plan with every width, in tier order, K = 288 (nine 32-row blocks: uneven K splits are possible).
MIXED = [(8, 32), (6, 32), (5, 32), (4, 64), (3, 64), (2, 64)]
#: Odd out_features: N_pad = 64, 19 padding columns.
N_ODD = 45


def make_layer(rng, bits_rows, N, *, act_order=True, bias=False, qsm=None):
    """Random EXL2 layer tensors (NumPy, on-disk dtypes) via the exact writer: codes with forced extremes,
    scale codes 0..15, q_scale_max small enough that y stays finite in fp16 unless ``qsm`` is given."""
    n_pad = pad32(N)
    K = sum(r for _, r in bits_rows)
    G = len(bits_rows)
    codes = random_codes(rng, bits_rows, n_pad)
    sc = rng.integers(0, 16, size=(G, n_pad)).astype(np.uint8)
    sc[:, :2] = [0, 15]  # both ends of the code range in every group
    if qsm is None:
        qsm = (rng.uniform(0.002, 0.02, size=G)).astype(np.float16)
    inv = rng.permutation(K) if act_order else np.arange(K)
    b = rng.standard_normal(N).astype(np.float16) if bias else None
    return exl2_tensors(codes, sc, qsm, bits_rows, inv, bias=b)


def on_device(t: dict) -> dict:
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE) for k, v in t.items()}


def reference_w(t: dict, bits_rows, N) -> np.ndarray:
    """W float16 [K, N] (rows in original feature order) from the Numba reference."""
    gt = group_table_from_rows(bits_rows)
    return np.ascontiguousarray(ref.dequantize(t["q_weight"], t["q_scale"], t["q_scale_max"], gt, t["q_invperm"],
                                               out_features=N).T)


def u16(a: torch.Tensor) -> np.ndarray:
    return a.cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


# ---------------------------------------------------------------------------------------------------
# Dequantization, bit for bit
# ---------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter: fp16 inf, on purpose
@pytest.mark.parametrize("bits", EXL2_BITS)
def test_dequant_stored_bit_exact_each_width(bits):
    """One width, two groups, q_scale_max over the whole positive fp16 range (subnormal m, overflow to inf)."""
    rng = np.random.default_rng(100 + bits)
    bits_rows = [(bits, 32), (bits, 64)]
    qsm = np.array([random_f16(rng, 1)[0], F16_SPECIAL_POSITIVE[rng.integers(len(F16_SPECIAL_POSITIVE))]],
                   dtype=np.float16)
    t = make_layer(rng, bits_rows, 64, qsm=qsm)
    T = on_device(t)
    got = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"])
    want = ref.dequantize_stored(t["q_weight"], t["q_scale"], t["q_scale_max"], group_table_from_rows(bits_rows))
    assert got.dtype == torch.float16 and tuple(got.shape) == want.shape == (96, 64)
    assert np.array_equal(u16(got), f16_bits(want))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_dequant_special_scales_bit_exact():
    """Every special q_scale_max pattern (subnormals, 2^-14 boundary, 65504) in one layer of 16 groups."""
    rng = np.random.default_rng(7)
    bits_rows = [(b, 32) for b in (8, 8, 6, 6, 5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 2, 2)]
    qsm = np.array(F16_SPECIAL_POSITIVE, dtype=np.uint16).view(np.float16)
    assert qsm.size == len(bits_rows)
    t = make_layer(rng, bits_rows, 32, qsm=qsm)
    T = on_device(t)
    got = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"])
    want = ref.dequantize_stored(t["q_weight"], t["q_scale"], t["q_scale_max"], group_table_from_rows(bits_rows))
    assert np.array_equal(u16(got), f16_bits(want))


@pytest.mark.parametrize("act_order", [True, False], ids=["act-order", "identity"])
def test_dequant_mixed_tiers_odd_n(act_order):
    """All six widths in one launch; stored order [K, N_pad] and un-permuted [K, N] (= dequantize().T), and the
    bf16 output (= the fp16 reference rounded to bf16)."""
    rng = np.random.default_rng(11 if act_order else 12)
    t = make_layer(rng, MIXED, N_ODD, act_order=act_order)
    T = on_device(t)
    gt = group_table_from_rows(MIXED)
    stored = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], gt)
    want_stored = ref.dequantize_stored(t["q_weight"], t["q_scale"], t["q_scale_max"], gt)
    assert np.array_equal(u16(stored), f16_bits(want_stored))
    W = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"],
                           out_features=N_ODD, unpermute=True)
    want = reference_w(t, MIXED, N_ODD)
    assert tuple(W.shape) == want.shape == (288, N_ODD)
    assert np.array_equal(u16(W), f16_bits(want))
    Wb = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"],
                            out_features=N_ODD, unpermute=True, dtype=torch.bfloat16)
    assert Wb.dtype == torch.bfloat16
    assert np.array_equal(u16(Wb), u16(torch.from_numpy(want).to(torch.bfloat16)))


@pytest.mark.parametrize("bits", EXL2_BITS)
def test_dequant_golden_words(bits):
    """The spec's worked examples (exl2-format.md 2.2) as raw words, with scale code 0 and q_scale_max 256 so
    that s = 1 and the kernel must return exactly q - 2^(b-1): independent of every codec in exl2fmt."""
    golden = {
        2: ([0, 1, 2, 3] * 4, [0xE4E4E4E4]),
        3: ([t % 8 for t in range(32)], [0x88FAC688, 0xC688FAC6, 0xFAC688FA]),
        4: (list(range(8)), [0x76543210]),
        5: (list(range(32)), [0x8A418820, 0xC5A92839, 0xCA307B9A, 0x38BDAB49, 0xFFBBCDEB]),
        6: (list(range(16)), [0x440C2040, 0xA2481C61, 0x3CE34C2C]),
        8: ([1, 2, 3, 4], [0x04030201]),
    }
    values, words = golden[bits]
    reps = 32 // len(values)  # units per 32-row block
    col = np.array(words * reps, dtype=np.uint64).astype(np.uint32).view(np.int32)
    q_weight = np.repeat(col[:, None], 32, axis=1)  # [bits, 32]: every column holds the example
    T = on_device({"q_weight": q_weight, "q_scale": np.zeros((1, 4), np.int32),
                   "q_scale_max": np.array([256.0], np.float16)})
    got = kt.exl2_dequantize(T["q_weight"], T["q_scale"], T["q_scale_max"], group_table_from_rows([(bits, 32)]))
    z = BIT_WIDTHS[bits].zero_point
    want = np.repeat((np.array(values * reps) - z)[:, None], 32, axis=1).astype(np.float16)
    assert np.array_equal(u16(got), f16_bits(want))


# ---------------------------------------------------------------------------------------------------
# Matmul
# ---------------------------------------------------------------------------------------------------

#: Unit roundoff of the output dtype (round to nearest: half an ulp of 1).
U_OUT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def matmul_bound(x: np.ndarray, W: np.ndarray, bias, out_dtype, weights_rounded_to=None):
    """Elementwise bound on |y - y_ref| with y_ref = x @ W + bias in float64 (x, W float64 copies of the exact
    inputs).  Every product x*w of an fp16/bf16 activation and an fp16 weight is exact in fp32 (11 x 11
    significant bits < 24), so the fp32 result differs from y_ref only by the K + 1 additions, in any order
    (K split, tensor-core blocks): |e_acc| <= (K + 1) * 2^-24 * A with A = |x| @ |W| + |bias|; a factor 2 covers
    tensor cores that truncate instead of rounding while aligning.  The final rounding to the output dtype adds
    u_out * |y| (u_out = 2^-11 fp16, 2^-8 bf16).  When the dense path rounds W (and the bias) to bf16 first,
    each term moves by at most 2^-8 of itself: + 2^-8 * A.  A kernel that drops or repeats one of the K rows
    errs by about A / K, far above this bound (see test_bound_detects_a_missing_row)."""
    K = x.shape[1]
    A = np.abs(x) @ np.abs(W)
    yref = x @ W
    if bias is not None:
        A = A + np.abs(bias)[None, :]
        yref = yref + bias[None, :]
    tol = U_OUT[out_dtype] * np.abs(yref) * (1 + 2.0 ** -10) + 2 * (K + 1) * 2.0 ** -24 * A
    if weights_rounded_to is torch.bfloat16:
        tol = tol + 2.0 ** -8 * A
    return yref, tol


def assert_within(y: torch.Tensor, yref: np.ndarray, tol: np.ndarray, what: str):
    got = y.detach().float().cpu().numpy().astype(np.float64)
    assert got.shape == yref.shape, f"{what}: shape {got.shape}, expected {yref.shape}"
    err = np.abs(got - yref)
    bad = err > tol
    if bad.any():
        i = np.unravel_index(np.argmax(err / np.maximum(tol, 1e-300)), err.shape)
        pytest.fail(f"{what}: {int(bad.sum())} of {err.size} outputs outside the bound; worst at {i}: got "
                    f"{got[i]!r}, want {yref[i]!r}, |err| {err[i]:.3g} > tol {tol[i]:.3g}")


def test_bound_detects_a_missing_row():
    """The bound is tight enough to fail: dropping one of the 288 rows of W, or using W[:, n+1] for column n,
    breaks it for most outputs."""
    rng = np.random.default_rng(3)
    t = make_layer(rng, MIXED, N_ODD)
    W = reference_w(t, MIXED, N_ODD).astype(np.float64)
    x = rng.standard_normal((16, 288)).astype(np.float16).astype(np.float64)
    yref, tol = matmul_bound(x, W, None, torch.float16)
    drop = W.copy()
    drop[100] = 0
    assert (np.abs(x @ drop - yref) > tol).mean() > 0.5
    shifted = np.roll(W, 1, axis=1)
    assert (np.abs(x @ shifted - yref) > tol).mean() > 0.9
    # and the exact result rounded to fp16 lies inside it
    assert (np.abs(yref.astype(np.float16).astype(np.float64) - yref) <= tol).all()


MS = (1, 3, 16, 33)
PATHS = ("gemv", "dot", "dense")
#: Orthogonal array over (bf16 x, bias, act-order): each path sees every value and every pair of values.
FLAGS = ((0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0))


@functools.lru_cache(maxsize=None)
def mixed_layer(act: bool):
    """The MIXED / N_ODD layer with or without act-order, bias included (tests choose whether to pass it):
    (NumPy tensors, device tensors, reference W float64 [K, N])."""
    rng = np.random.default_rng(21 if act else 22)
    t = make_layer(rng, MIXED, N_ODD, act_order=act, bias=True)
    return t, on_device(t), reference_w(t, MIXED, N_ODD).astype(np.float64)


def run_case(M, path, bf16, with_bias, act, *, seed=0, split_k=None, bias_len="pad", **kw):
    t, T, W = mixed_layer(act)
    dtype = torch.bfloat16 if bf16 else torch.float16
    g = torch.Generator().manual_seed(1000 * M + seed)
    x = torch.randn(M, W.shape[0], generator=g).to(dtype).to(DEVICE)
    bias = None
    if with_bias:
        bias = T["bias"] if bias_len == "pad" else T["bias"][:N_ODD].contiguous()
    y = kt.exl2_matmul(x, T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"],
                       out_features=N_ODD, bias=bias, path=path, split_k=split_k, **kw)
    assert y.dtype == dtype and y.device == x.device
    b = t["bias"][:N_ODD].astype(np.float64) if with_bias else None
    yref, tol = matmul_bound(x.float().cpu().numpy().astype(np.float64), W, b, dtype,
                             weights_rounded_to=dtype if path == "dense" else None)
    assert_within(y, yref, tol, f"path={path} M={M} {dtype} bias={with_bias} act_order={act}")


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("path", PATHS)
def test_matmul(path, M):
    bf16, with_bias, act = FLAGS[(MS.index(M) + PATHS.index(path)) % len(FLAGS)]
    run_case(M, path, bool(bf16), bool(with_bias), bool(act), bias_len="pad" if M % 2 else "n")


@pytest.mark.parametrize("M", MS + (65,))
def test_matmul_default_path(M):
    want = "gemv" if M <= kt.GEMV_MAX_M else "dot" if M <= kt.DOT_MAX_M else "dense"
    assert kt.choose_path(M) == want
    run_case(M, None, M % 2 == 0, True, True)


@pytest.mark.parametrize("path,M,split", [("gemv", 1, 2), ("gemv", 3, 9), ("dot", 16, 2), ("dot", 33, 4)])
def test_matmul_split_k(path, M, split):
    """K split over several programs (fp32 atomics into a workspace, then the bias and the rounding)."""
    run_case(M, path, M == 3, True, True, split_k=split, seed=5)


@pytest.mark.parametrize("bits", EXL2_BITS)
def test_gemv_each_width(bits):
    """The GEMV kernel specialises one loop per width: a layer of a single width runs only that loop (the
    others see empty block ranges)."""
    rng = np.random.default_rng(200 + bits)
    bits_rows = [(bits, 32), (bits, 32)]
    t = make_layer(rng, bits_rows, 32)
    T = on_device(t)
    W = reference_w(t, bits_rows, 32).astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((1, 64)).astype(np.float16)).to(DEVICE)
    y = kt.exl2_matmul(x, T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"],
                       path="gemv")
    yref, tol = matmul_bound(x.float().cpu().numpy().astype(np.float64), W, None, torch.float16)
    assert_within(y, yref, tol, f"gemv {bits}-bit")


def test_matmul_leading_dims_and_strides():
    """x [2, 3, K] taken with a column stride of 2 (not contiguous) -> y [2, 3, N]."""
    t, T, W = mixed_layer(True)
    g = torch.Generator().manual_seed(9)
    base = torch.randn(2, 3, 2 * W.shape[0], generator=g).half().to(DEVICE)
    x = base[..., ::2]
    assert not x.is_contiguous()
    for path in ("gemv", "dot"):
        y = kt.exl2_matmul(x, T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"],
                           out_features=N_ODD, path=path)
        assert tuple(y.shape) == (2, 3, N_ODD)
        yref, tol = matmul_bound(x.reshape(6, -1).float().cpu().numpy().astype(np.float64), W, None, torch.float16)
        assert_within(y.reshape(6, N_ODD), yref, tol, f"strided x, {path}")


def test_exl2_linear_from_layer_object():
    """The convenience path from an exl2fmt.formats.Exl2Linear (I16 q_invperm read as uint16, bias from the
    file, out_features from the hint) against the layer's own dequantize()."""
    rng = np.random.default_rng(31)
    t = make_layer(rng, MIXED, N_ODD, bias=True)
    t["q_invperm"] = t["q_invperm"].astype(np.int16)
    layer = layer_from_tensors("model.layers.0.mlp.down_proj", t, out_features=N_ODD)
    assert layer.dtypes["q_invperm"] == "I16"
    W = layer.dequantize().T.astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((3, 288)).astype(np.float16)).to(DEVICE)
    y = kt.exl2_linear(x, layer)
    yref, tol = matmul_bound(x.float().cpu().numpy().astype(np.float64), W, layer.bias().astype(np.float64),
                             torch.float16)
    assert_within(y, yref, tol, "exl2_linear")
    lin = kt.Exl2KernelLinear.from_layer(layer, DEVICE)
    assert (lin.in_features, lin.out_features) == (288, N_ODD)
    assert np.array_equal(u16(lin.dequantize()), f16_bits(layer.dequantize().T))


# ---------------------------------------------------------------------------------------------------
# Wrapper checks: ValueError with the numbers
# ---------------------------------------------------------------------------------------------------


def test_wrapper_rejects_bad_inputs():
    t, T, W = mixed_layer(True)
    qw, qs, qsm, qg, inv = T["q_weight"], T["q_scale"], T["q_scale_max"], T["q_groups"], T["q_invperm"]
    x = torch.zeros(2, 288, dtype=torch.float16, device=DEVICE)

    def bad(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            kt.exl2_matmul(*args, **kw)

    bad(r"x has 287 features .*K = 288", x[:, :287], qw, qs, qsm, qg, inv)
    bad(r"float16 or bfloat16, got torch.float32", x.float(), qw, qs, qsm, qg, inv)
    Q = sum(r * b for b, r in MIXED) // 32
    bad(rf"the groups need {Q} q_weight rows; q_weight has 10", x, qw[:10], qs, qsm, group_table_from_rows(MIXED),
        inv)
    bad(rf"q_groups: .*end of q_weight \(10 rows\)", x, qw[:10], qs, qsm, qg, inv)
    bad(r"q_scale has shape \[6, 4\]; expected \[6, 8\]", x, qw, qs[:, :4].contiguous(), qsm, qg, inv)
    bad(r"q_scale_max must be torch.float16", x, qw, qs, qsm.float(), qg, inv)
    bad(r"out_features = 30 does not pad to N_pad = 64", x, qw, qs, qsm, qg, inv, out_features=30)
    bad(r"bias has 50 entries; expected N = 45 or N_pad = 64", x, qw, qs, qsm, qg, inv, out_features=45,
        bias=torch.zeros(50, dtype=torch.float16, device=DEVICE))
    dup = inv.clone()
    dup[0] = dup[1]
    bad(r"q_invperm is not a permutation of 0..287", x, qw, qs, qsm, qg, dup)
    bad(r"q_invperm has 200 entries; the groups hold K = 288", x, qw, qs, qsm, qg, inv[:200])
    bad(r"path must be", x, qw, qs, qsm, qg, inv, path="fast")
    with pytest.raises(ValueError, match=r"q_groups: "):
        kt.exl2_matmul(x, qw, qs, qsm, np.array([4, 0, 9, 8], np.int16), inv)
    # a 16-row 2-bit group is a valid packing unit but not a 32-row block
    g16 = group_table_from_rows([(4, 32), (2, 16)])
    with pytest.raises(ValueError, match=r"group 1: 16 rows; the kernels need a positive multiple of 32"):
        kt.build_tables(g16)
    # widths that come back after another width are not contiguous tiers
    with pytest.raises(ValueError, match=r"the 4-bit groups are not contiguous"):
        kt.build_tables(group_table_from_rows([(4, 32), (3, 32), (4, 32)]))


def test_check_layer_on_the_sample_model(tmp_path):
    """``check_layer`` (what ``validate --kernel`` reports) on a layer read back from the sample model's
    safetensors file: bit-exact dequantization and every path within the bound."""
    from exl2fmt.container import open_model
    from exl2fmt.model import load_layer
    from exl2fmt.sample import write_sample

    write_sample(tmp_path)
    model = open_model(tmp_path)
    layer = load_layer(model, "model.layers.0.self_attn.k_proj")  # K = 256, N = 128, 4-bit and 3-bit tiers
    rep = kt.check_layer(layer, DEVICE, ms=(1, 5), paths=("gemv", "dot", "dense"))
    assert rep["dequant_exact"]
    assert [(r["path"], r["M"]) for r in rep["results"]] == [(p, m) for m in (1, 5) for p in ("gemv", "dot", "dense")]
    for r in rep["results"]:
        assert r["within_bound"], r
        assert r["max_rel_err"] < 2.0 ** -9, r
