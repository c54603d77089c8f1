"""The measurement's bf16 scoring of candidates (exl2fmt.quant.scoring): the reference tape and the delta
products, against float64 products of the same weights (the trained fixture's MLP)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.quant import scoring  # noqa: E402
from exl2fmt.runner.weights import dense_linear  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-llama"


def _mlp_weights():
    """The trained fixture's layer-0 gate_proj [768, 256] and down_proj [256, 768], float32, and 8-bit
    per-row round-to-nearest candidates of them in fp16 (what a measurement candidate is)."""
    from safetensors.torch import load_file

    t = {}
    for f in sorted(FIXTURE.glob("*.safetensors")):
        t.update(load_file(f))
    out = {}
    for n in ("gate_proj", "down_proj"):
        w = t[f"model.layers.0.mlp.{n}.weight"].float()
        s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        out[n] = (w, (torch.round(w / s).clamp(-128, 127) * s).half())
    return out


def _taped(ws, xs, n_batches=None):
    """A tape of gate (input xs[b]) and down (input silu(gate)) over the batches xs."""
    tape = scoring.ReferenceTape(["gate_proj", "down_proj"], lambda n: n, len(xs), n_batches or len(xs))
    g = tape.recorder("gate_proj", dense_linear(ws["gate_proj"][0]))
    d = tape.recorder("down_proj", dense_linear(ws["down_proj"][0]))
    for x in xs:
        d(torch.nn.functional.silu(g(x)))
    tape.close()
    return tape


def test_delta_products_carry_the_change_to_bf16_precision_of_the_change():
    """gate reads its recorded input (dx = 0), down a changed one (the quantized gate's): both outputs equal the
    float64 products with the candidates to ~2^-8 of the output's *change*, where a plain bf16 product is off by
    a large fraction of the change (it is what the measurement scores, so that would swamp it)."""
    ws = _mlp_weights()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 24, 256, generator=gen) for _ in range(2)]
    tape = _taped(ws, xs)
    assert tape.usable("gate_proj") and tape.usable("down_proj")
    (wg, wg_hat), (wd, wd_hat) = ws["gate_proj"], ws["down_proj"]
    g = scoring.DeltaLinear(tape, "gate_proj", wg, wg_hat).bind()
    d = scoring.DeltaLinear(tape, "down_proj", wd, wd_hat).bind()
    for x in xs:                                       # batch order: the k-th call is batch k
        yg = g(x.clone())
        z = torch.nn.functional.silu(yg)
        yd = d(z)
        assert yg.dtype == yd.dtype == torch.float32
        for y, inp, w, w_hat in ((yg, x, wg, wg_hat), (yd, z, wd, wd_hat)):
            want = inp.double() @ w_hat.double().T
            ref = (torch.nn.functional.silu(x.double() @ wg.double().T) if w is wd else x.double()) @ w.double().T
            change = (want - ref).norm()
            assert change > 1e-3 * want.norm()
            assert (y.double() - want).norm() < 2 ** -7 * change
            plain = (inp.bfloat16() @ w_hat.bfloat16().T).double()
            assert (plain - want).norm() > 0.05 * change
    with pytest.raises(RuntimeError, match="call 3 in one sweep"):   # the tape holds two batches, no third
        g(xs[0])


def test_one_input_is_compared_with_the_recorded_one_once_while_unchanged(monkeypatch):
    """The linears of a group read one tensor per forward: the comparison with the recorded input is made once
    for it, again after the tensor is written to, and for every other tensor, even one with equal values."""
    w = torch.randn(6, 4)
    tape = scoring.ReferenceTape(["q", "k"], lambda n: "qk", 1, 1)
    x = torch.randn(2, 4)
    for n in ("q", "k"):
        tape.recorder(n, dense_linear(w))(x)
    tape.close()
    calls = []
    real = torch.equal
    monkeypatch.setattr(scoring.torch, "equal", lambda a, b: (calls.append(1), real(a, b))[1])
    g = ("qk", 0)
    x2 = x.clone()
    assert tape.is_reference_input(g, x2) and tape.is_reference_input(g, x2) and len(calls) == 1
    x2.add_(1)                                          # written to: compared again, now different
    assert not tape.is_reference_input(g, x2) and len(calls) == 2
    x3 = x.clone()
    assert tape.is_reference_input(g, x3) and len(calls) == 3
    with torch.inference_mode():                        # no version counter: always compared
        xi = x.clone()
        assert tape.is_reference_input(g, xi) and tape.is_reference_input(g, xi) and len(calls) == 5


def test_a_batch_of_another_shape_is_refused():
    ws = _mlp_weights()
    x = torch.randn(1, 8, 256)
    tape = _taped(ws, [x])
    g = scoring.DeltaLinear(tape, "gate_proj", *ws["gate_proj"]).bind()
    with pytest.raises(RuntimeError, match="gate_proj: batch 0 input"):
        g(torch.randn(1, 9, 256))


def test_the_tape_records_copies_once_per_group_and_only_the_scoring_batches():
    w = torch.randn(6, 4)
    tape = scoring.ReferenceTape(["q", "k", "o"], lambda n: "qk" if n in "qk" else n, n_score=2, n_batches=3)
    fq, fk = tape.recorder("q", dense_linear(w)), tape.recorder("k", dense_linear(w[:3]))
    fo = tape.recorder("o", dense_linear(w[:, :4]))
    assert tape.recorder("expert", fo) is fo           # not taped: passed through
    xs = [torch.randn(2, 4) for _ in range(3)]
    orig = [x.clone() for x in xs]
    for x in xs:
        yq = fq(x)
        fk(x)
        yq.mul_(0)                                     # the forward may write to what it got
        x.add_(1)                                      # ... and to its input
    tape.close()
    assert sorted(tape.x) == [("qk", 0), ("qk", 1)]    # one input per group and batch, two scoring batches
    assert torch.equal(tape.x[("qk", 1)], orig[1]) and torch.equal(tape.y[("q", 1)], orig[1] @ w.T)
    assert not tape.usable("o") and ("o", 0) not in tape.y      # never called: forgotten
    assert tape.usable("q") and tape.usable("k")
    # a linear called more often than once per batch is not usable either
    tape2 = scoring.ReferenceTape(["q"], lambda n: n, 1, 1)
    f = tape2.recorder("q", dense_linear(w))
    f(xs[0])
    f(xs[0])
    tape2.close()
    assert not tape2.usable("q") and tape2.y == {} and tape2.x == {}


@pytest.mark.parametrize("value", ["bf", "", "FP32", "bf16 "])
def test_measure_precision_resolves_by_hardware_and_refuses_unknown_values(value, monkeypatch):
    from exl2fmt.quant.options import QuantOptions

    for fast, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(scoring, "fast_bf16", lambda device, _f=fast: _f)
        assert QuantOptions().resolved().measure_precision == want
        assert QuantOptions(measure_precision="fp32").resolved().measure_precision == "fp32"
        assert QuantOptions(measure_precision="bf16").resolved().measure_precision == "bf16"
    with pytest.raises(Exl2Error) as e:
        QuantOptions(measure_precision=value).resolved()
    assert e.value.code is ErrorCode.USAGE and "--measure-precision" in e.value.message


def test_fast_bf16_is_a_plain_answer_for_every_device_kind():
    assert scoring.fast_bf16(torch.device("meta")) is False
    assert isinstance(scoring.fast_bf16(torch.device("cpu")), bool)


def test_the_cli_refuses_an_unknown_measure_precision_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    r = CliRunner().invoke(app, ["convert", str(FIXTURE), str(tmp_path / "out"), "--to", "exl2",
                                 "--measure-precision", "fp16"])
    assert r.exit_code == 2 and "[USAGE]" in r.stderr and "--measure-precision" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())


def _special_f32(gen, shape):
    """float32 values covering the bf16 rounding cases: random magnitudes over 2^-130..2^126 (subnormals
    included), exact ties (bit 15 set, lower bits clear) with an even and an odd kept half, values that round up
    to the next exponent or to inf, +-0, +-inf."""
    n = int(torch.tensor(shape).prod())
    bits = torch.randint(0, 1 << 31, (n,), generator=gen, dtype=torch.int64)
    bits[: n // 4] = (bits[: n // 4] & ~0xFFFF) | 0x8000                    # ties
    special = torch.tensor([0x7F7FFFFF, 0x7F7F8000, 0x3F80FFFF, 0x3FFF8000, 0, 0x80000000, 0x7F800000,
                            0xFF800000])
    k = min(len(special), n - n // 4)
    bits[n // 4: n // 4 + k] = special[:k]
    bits = bits & 0xFFFFFFFF
    bits[bits >= 0x7F800001] &= 0x7F7FFFFF                                  # NaNs apart (their own test)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64) << 31
    return ((bits ^ signs) & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32).reshape(shape)


@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 33), (1, 1)])
def test_the_cpu_kernels_give_torchs_bits(shape):
    """scoring.sub_bf16 / add_bf16 (Numba on the CPU) against torch's own mixed-dtype ops: the same bits,
    ties, subnormals, overflow to inf and signed zeros included."""
    gen = torch.Generator().manual_seed(len(shape))
    a32, b32 = _special_f32(gen, shape), _special_f32(gen, shape)
    a16 = (a32 * 2.0 ** -100).clamp(-60000, 60000).half()        # fp16 operands from the same bit spread
    b_small = b32 * 2.0 ** -100
    for a, b in ((a16, b_small), (a16, b32), (a32, b32), (a32, b_small)):
        got = scoring.sub_bf16(a, b, torch.empty(shape, dtype=torch.bfloat16))
        want = torch.sub(a, b, out=torch.empty(shape, dtype=torch.bfloat16))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (a.dtype, b.abs().max())
    p = _special_f32(gen, shape).bfloat16()
    for y in (a32, b_small):
        want = torch.add(y, p)
        got = scoring.add_bf16(y, p)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        inplace = y.clone()
        assert scoring.add_bf16(inplace, p, inplace) is inplace
        assert torch.equal(inplace.view(torch.int32), want.view(torch.int32))


def test_the_cpu_kernels_keep_nan_a_nan_and_fall_back_off_their_layout():
    nan = torch.full((2, 3), float("nan"))
    out = scoring.sub_bf16(nan, torch.zeros(2, 3), torch.empty(2, 3, dtype=torch.bfloat16))
    assert torch.isnan(out).all()
    assert torch.isnan(scoring.add_bf16(torch.zeros(2, 3), nan.bfloat16())).all()
    # a transposed (non-contiguous) operand takes torch's path: still the right values
    a = torch.randn(4, 6).T
    b = torch.randn(6, 4)
    got = scoring.sub_bf16(a, b, torch.empty(6, 4, dtype=torch.bfloat16))
    assert torch.equal(got, (a - b).bfloat16())


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 33)])
def test_a_16bit_weight_gives_the_bits_of_its_float32_original(narrow, shape):
    """sub_bf16(w_hat, b16) for b16 the exact 16-bit copy of a float32 b: the bits of sub_bf16(w_hat, b) (torch's
    fp16 - fp32 into bf16, the oracle of the kernels above), on the Numba kernels and on torch's fallback (a
    transposed operand); and the bf16 weight made from the copy is the one made from the original."""
    gen = torch.Generator().manual_seed(len(shape) + (narrow == torch.bfloat16))
    b16 = _special_f32(gen, shape).clamp(-60000, 60000).to(narrow)
    b16 = torch.where(b16.isnan(), torch.zeros_like(b16), b16)   # (a NaN weight is never narrowed)
    b = b16.to(torch.float32)
    a = (_special_f32(gen, shape) * 2.0 ** -100).clamp(-60000, 60000).half()
    want = torch.sub(a, b, out=torch.empty(shape, dtype=torch.bfloat16))
    got = scoring.sub_bf16(a, b16, torch.empty(shape, dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if len(shape) == 2:
        at, bt = a.T.contiguous().T, b16.T.contiguous().T                  # same values, not C order
        got_t = scoring.sub_bf16(at, bt, torch.empty(shape, dtype=torch.bfloat16))
        assert torch.equal(got_t.view(torch.int16), want.view(torch.int16))
    assert torch.equal(b16.to(torch.bfloat16).view(torch.int16), b.to(torch.bfloat16).view(torch.int16))


def test_exact_16bit_narrows_only_what_it_holds_exactly():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(50, 70, generator=gen)
    f16 = w.half().float()
    got = scoring.exact_16bit(f16, chunk=333)
    assert got.dtype == torch.float16 and torch.equal(got.float(), f16)
    bf = (w * 1e6).bfloat16().float()                        # beyond fp16's range: bf16 holds it
    got = scoring.exact_16bit(bf, chunk=333)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), bf)
    assert scoring.exact_16bit(w, chunk=333) is w            # float32 detail in the last chunk's values too
    late = f16.clone()
    late.view(-1)[-1] = 0.1                                   # one inexact value, in the last chunk
    assert scoring.exact_16bit(late, chunk=333) is late
    nan = f16.clone()
    nan[3, 3] = float("nan")
    assert scoring.exact_16bit(nan) is nan
    signed = torch.tensor([[-0.0, 0.0, 1.0]])
    got = scoring.exact_16bit(signed)
    assert torch.equal(got.view(torch.int16), signed.half().view(torch.int16))


def test_a_widened_16bit_linear_is_the_float32_linear_bit_for_bit():
    from exl2fmt.runner.weights import dense_linear, widened_linear

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(96, 64, generator=gen).half().float()
    b = torch.randn(96, generator=gen)
    x = torch.randn(3, 5, 64, generator=gen)
    w16 = scoring.exact_16bit(w)
    assert w16.dtype == torch.float16
    f = widened_linear(w16, b)
    assert torch.equal(f(x), dense_linear(w, b)(x)) and f.weight is w16 and f.bias is b
