"""exl2fmt.codec.exl3 (Numba) against tests/exl3_oracle.py (the slow NumPy oracle), bit for bit (fp16 compared
as uint16): states, codebooks, W_hat and the whole decode at all 11 rates and 3 codebooks, padded shapes, legacy
su/sv signs, every 16-bit state, and the portable loop path."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import exl3_oracle as R  # tests/ is on sys.path under pytest
from exl2fmt.codec import exl3 as C

HERE = os.path.dirname(os.path.abspath(__file__))

K2S = (2, 4, 6, 8, 10, 12, 14, 16, 3, 5, 7)      # all 11 rates (1..8, 1.5, 2.5, 3.5)
CODEBOOKS = ("3inst", "mcg", "mul1")
MARKER = {"3inst": {}, "mcg": {"mcg": R.MCG_MARKER}, "mul1": {"mul1": R.MUL1_MARKER}}


def _rate(k2):
    return k2 // 2 if k2 % 2 == 0 else k2 / 2


def _valid(k2, cb):
    return k2 % 2 == 0 or cb == "mul1"


def _random_trellis(rng, tk, tn, k2):
    return rng.integers(-32768, 32768, size=(tk, tn, 8 * k2)).astype(np.int16)


def _ref_deq(tr, suh, svh, cb, in_f, out_f, legacy=False):
    t = {"trellis": tr, **MARKER[cb]}
    t.update({"su": suh, "sv": svh} if legacy else {"suh": suh, "svh": svh})
    return R.dequantize(t, in_f, out_f)


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype == np.float16
    ua, ub = a.view(np.uint16), b.view(np.uint16)
    if not np.array_equal(ua, ub):
        bad = np.argwhere(ua != ub)
        pytest.fail(f"{len(bad)} of {ua.size} differ, first at {tuple(bad[0])}: {ua[tuple(bad[0])]:#06x} vs "
                    f"{ub[tuple(bad[0])]:#06x}")


# 8 x 40 tiles: in_p 128, out_p 640 -> one full 32-tile lane group and one of 8 tiles (both decode paths)
@pytest.mark.parametrize("k2", K2S)
def test_states(k2):
    rng = np.random.default_rng(100 + k2)
    tr = _random_trellis(rng, 8, 40, k2)
    assert np.array_equal(C.decode_states(tr, k2), R.decode_states(tr, _rate(k2)))
    tr = _random_trellis(rng, 3, 5, k2)        # any tile counts
    assert np.array_equal(C.decode_states(tr, k2), R.decode_states(tr, _rate(k2)))


@pytest.mark.parametrize("cb", CODEBOOKS)
@pytest.mark.parametrize("k2", K2S)
def test_inner_weight_and_dequantize(k2, cb):
    rng = np.random.default_rng(1000 + 7 * k2 + len(cb))
    tr = _random_trellis(rng, 8, 40, k2)
    if not _valid(k2, cb):
        with pytest.raises(ValueError):
            C.inner_weight(tr, k2, cb)
        with pytest.raises(ValueError):
            C.dequantize(tr, np.ones(128, np.float16), np.ones(640, np.float16), k2, cb, 128, 640)
        return
    _same(C.inner_weight(tr, k2, cb), R.inner_weight({"trellis": tr, **MARKER[cb]})[0])
    suh = (rng.choice([-1.0, 1.0], 128) * rng.uniform(0.25, 4.0, 128)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], 640) * rng.uniform(0.001, 0.05, 640)).astype(np.float16)
    for in_f, out_f in ((128, 640), (100, 600), (1, 513)):
        _same(C.dequantize(tr, suh, svh, k2, cb, in_f, out_f), _ref_deq(tr, suh, svh, cb, in_f, out_f))


@pytest.mark.parametrize("k2,cb", [(8, "3inst"), (4, "mcg"), (5, "mul1"), (16, "mul1")])
@pytest.mark.parametrize("in_f,out_f", [(256, 1024), (250, 1000), (129, 130), (384, 520)])
def test_padded_shapes(k2, cb, in_f, out_f):
    rng = np.random.default_rng(in_f * 7 + out_f)
    in_p, out_p = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    tr = _random_trellis(rng, in_p // 16, out_p // 16, k2)
    suh = rng.uniform(-3, 3, in_p).astype(np.float16)
    svh = rng.uniform(-0.1, 0.1, out_p).astype(np.float16)
    w = C.dequantize(tr, suh, svh, k2, cb, in_f, out_f)
    assert w.flags.c_contiguous and w.shape == (out_f, in_f)
    _same(w, _ref_deq(tr, suh, svh, cb, in_f, out_f))


@pytest.mark.parametrize("cb", CODEBOOKS)
def test_legacy_signs(cb):
    rng = np.random.default_rng(7)
    k2 = 6 if cb != "mul1" else 7
    tr = _random_trellis(rng, 16, 48, k2)
    su = rng.integers(-32768, 32768, 256 // 16).astype(np.int16)
    sv = rng.integers(-32768, 32768, 768 // 16).astype(np.int16)
    _same(C.dequantize(tr, su, sv, k2, cb, 250, 700, legacy_signs=True), _ref_deq(tr, su, sv, cb, 250, 700, True))
    assert np.array_equal(C.unpack_sign_bits(su).view(np.uint16), R.unpack_sign_bits(su).view(np.uint16))


@pytest.mark.parametrize("fill", [0, -1])
@pytest.mark.parametrize("k2", [2, 3, 8, 16])
def test_all_zero_all_ones(fill, k2):
    tr = np.full((8, 40, 8 * k2), fill, dtype=np.int16)
    assert np.array_equal(C.decode_states(tr, k2), R.decode_states(tr, _rate(k2)))
    rng = np.random.default_rng(3)
    suh = rng.uniform(-2, 2, 128).astype(np.float16)
    svh = rng.uniform(-2, 2, 640).astype(np.float16)
    for cb in CODEBOOKS:
        if _valid(k2, cb):
            _same(C.dequantize(tr, suh, svh, k2, cb, 128, 640), _ref_deq(tr, suh, svh, cb, 128, 640))


def test_zero_and_extreme_scales():
    """svh exactly 0 (all-zero output channels), huge suh (fp16 overflow to inf), subnormal results."""
    rng = np.random.default_rng(11)
    tr = _random_trellis(rng, 8, 32, 8)
    suh = rng.uniform(-2, 2, 128).astype(np.float16)
    suh[:5] = np.float16(60000)
    suh[5:10] = np.float16(1e-7)
    svh = rng.uniform(-2, 2, 512).astype(np.float16)
    svh[::3] = 0
    svh[1::7] = np.float16(3e-6)
    for cb in CODEBOOKS:
        _same(C.dequantize(tr, suh, svh, 8, cb, 128, 512), _ref_deq(tr, suh, svh, cb, 128, 512))


def test_rejects():
    tr = np.zeros((8, 8, 64), np.int16)
    one, one_o = np.ones(128, np.float16), np.ones(128, np.float16)
    for bad_k2 in (1, 9, 17, 0, 2.5, "8", True):
        with pytest.raises(ValueError):
            C.decode_states(tr, bad_k2)
    with pytest.raises(ValueError):
        C.decode_states(tr, 4)                                        # last dim != 8 * K2
    with pytest.raises(ValueError):
        C.inner_weight(tr, 8, "mul2")
    with pytest.raises(ValueError):
        C.dequantize(np.zeros((6, 8, 64), np.int16), np.ones(96, np.float16), one_o, 8, "mcg", 96, 128)
    with pytest.raises(ValueError):
        C.dequantize(tr, one, one_o, 8, "mcg", 0, 128)
    with pytest.raises(ValueError):
        C.dequantize(np.zeros((16, 8, 64), np.int16), np.ones(256, np.float16), one_o, 8, "mcg", 100, 128)
    with pytest.raises(ValueError):
        C.dequantize(tr, one[:64], one_o, 8, "mcg", 128, 128)           # suh length
    with pytest.raises(ValueError):
        C.dequantize(tr, one.astype(np.float32), one_o, 8, "mcg", 128, 128)
    with pytest.raises(ValueError):
        C.dequantize(tr, one, one_o, 8, "mcg", 128, 128, legacy_signs=True)
    with pytest.raises(ValueError):
        C.dequantize(tr.astype(np.int32), one, one_o, 8, "mcg", 128, 128)


def test_uint16_trellis_and_noncontiguous():
    rng = np.random.default_rng(2)
    tr = _random_trellis(rng, 8, 16, 8)
    suh = rng.uniform(-2, 2, 128).astype(np.float16)
    svh = rng.uniform(-2, 2, 256).astype(np.float16)
    ref = _ref_deq(tr, suh, svh, "3inst", 128, 256)
    _same(C.dequantize(tr.view(np.uint16), suh, svh, 8, "3inst", 128, 256), ref)
    big = np.zeros((8, 32, 64), np.int16)
    big[:, ::2] = tr
    _same(C.dequantize(big[:, ::2], suh, svh, 8, "3inst", 128, 256), ref)


@pytest.mark.slow  # CI time (the fallback decodes the same bits as the main path)
def test_loop_fallback_path(tmp_path):
    """The portable loop path (taken where HW_HALF is false) gives the same bits: run in a child process with
    HW_HALF forced off and a private Numba cache (the choice is made at import)."""
    import subprocess
    code = f"""
import sys; sys.path[:0] = [{HERE!r}]
import numpy as np
import exl2fmt.codec.f16 as F
F.HW_HALF = False
import exl2fmt.codec.exl3 as C, exl3_oracle as R
import exl2fmt.codec.exl3_ops as O
assert O.decode_left is O._decode_left_loop
rng = np.random.default_rng(9)
for k2, cb, mk in ((8, "mcg", {{"mcg": R.MCG_MARKER}}), (5, "mul1", {{"mul1": R.MUL1_MARKER}})):
    tr = rng.integers(-32768, 32768, size=(16, 40, 8 * k2)).astype(np.int16)
    suh = rng.uniform(-2, 2, 256).astype(np.float16); svh = rng.uniform(-2, 2, 640).astype(np.float16)
    a = C.dequantize(tr, suh, svh, k2, cb, 250, 600)
    b = R.dequantize({{"trellis": tr, "suh": suh, "svh": svh, **mk}}, 250, 600)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
print("ok")
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("cb", CODEBOOKS)
def test_all_states(cb):
    """Every 16-bit state through the codebook (states, W_hat and the full decode): a K2 = 16 ring holds state(t) = sym(t-1) << 8 | sym(t), so tile a
    with sym(even t) = a, sym(odd t) = b(t) covers the states (a << 8 | b) and (b << 8 | a)."""
    sym = np.empty((512, 256), np.uint16)
    for a in range(256):
        for half in range(2):
            tile = 2 * a + half
            sym[tile, 0::2] = a
            sym[tile, 1::2] = np.arange(128) + 128 * half
    ring = R.states_from_symbols(sym, 8)
    rm = np.empty_like(ring)
    rm[:, R.tc_perm()] = ring
    states = rm.reshape(16, 32, 16, 16).transpose(0, 2, 1, 3).reshape(256, 512)
    assert np.unique(states).size == 65536
    tr = R.pack_trellis(states, 8)
    assert np.array_equal(C.decode_states(tr, 16), states)
    _same(C.inner_weight(tr, 16, cb), R.codebook_values(states, cb))
    suh = np.ones(256, np.float16)
    svh = np.ones(512, np.float16)
    _same(C.dequantize(tr, suh, svh, 16, cb, 256, 512), _ref_deq(tr, suh, svh, cb, 256, 512))


def test_codebook_bound_holds_for_every_state():
    """``Exl3Linear.CODEBOOK_BOUND`` (the finite proof of formats/exl3.py) bounds |value| of all 65536 states of
    each codebook, computed by the oracle."""
    from exl2fmt.formats.exl3 import Exl3Linear

    states = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    for cb in CODEBOOKS:
        v = np.asarray(R.codebook_values(states, cb), dtype=np.float32)
        assert np.isfinite(v).all() and np.abs(v).max() < Exl3Linear.CODEBOOK_BOUND, cb


def test_finite_proof_is_sound_and_falls_back_to_counting(tmp_path):
    """A layer whose scales keep every stage under 65504 skips the output scan; one that can overflow is counted,
    and an overflowing decode is refused with NONFINITE_VALUES through ``dequantize_layer``."""
    from safetensors.numpy import save_file

    from exl2fmt import dequantize_layer
    from exl2fmt.errors import Exl2Error
    from exl2fmt.container import open_model
    from exl2fmt.model import load_layer

    rng = np.random.default_rng(5)
    key = "model.layers.0.mlp.up_proj"
    tr = rng.integers(-32768, 32768, size=(8, 16, 64)).astype(np.int16)
    cases = {"small": (np.float16(2.0), np.float16(2.0), True),
             "huge": (np.float16(60000.0), np.float16(60000.0), False)}
    for name, (s_u, s_v, proof) in cases.items():
        f = tmp_path / f"{name}.safetensors"
        save_file({f"{key}.trellis": tr, f"{key}.suh": np.full(128, s_u, np.float16),
                   f"{key}.svh": np.full(256, s_v, np.float16)}, str(f))
        layer = load_layer(open_model(f), key)
        assert layer._decode_is_finite() is proof
        w = layer.dequantize()
        if proof:
            assert np.isfinite(w.astype(np.float32)).all()
            assert np.array_equal(dequantize_layer(f, key).view(np.uint16), w.view(np.uint16))
        else:
            assert not np.isfinite(w.astype(np.float32)).all()
            with pytest.raises(Exl2Error) as e:
                dequantize_layer(f, key)
            assert e.value.code.value == "NONFINITE_VALUES"
