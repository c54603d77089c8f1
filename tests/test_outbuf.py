"""The decoders' output buffers (exl2fmt.codec.outbuf): a large output dropped by its user is reused by the next
decode of the same size class.  What must hold: a reused buffer's stale contents never show through (the decode
overwrites every element: checked against the NumPy twin with the old contents poisoned), a mapping is reused only
once no array or view over it is alive, and the pool never keeps more than one mapping."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from exl2fmt.codec import exl2 as X
from exl2fmt.codec import exl3 as E3
from exl2fmt.codec import oracle as O
from exl2fmt.codec import outbuf
from exl2fmt.groups import group_table_from_rows

K, N = 2048, 1024  # fp16 [1024, 2048] = 4 MiB: the smallest pooled output
BR = ((8, 64), (5, 128), (4, 1856))


def _exl2_layer(seed):
    rng = np.random.default_rng(seed)
    gt = group_table_from_rows(BR)
    codes = np.concatenate([rng.integers(0, 1 << b, size=(r, N), dtype=np.uint8) for b, r in BR])
    qw = X.pack_q_weight(codes, gt)
    qs = X.pack_q_scale(rng.integers(0, 16, size=(len(BR), N)).astype(np.uint8))
    qsm = rng.uniform(0.01, 2.0, len(BR)).astype(np.float16)
    inv = rng.permutation(K).astype(np.int32)
    return (qw, qs, qsm, gt, inv), (qw, qs, qsm, BR, inv)


@pytest.fixture(autouse=True)
def _empty_pool():
    gc.collect()
    outbuf.release_pool()
    yield
    outbuf.release_pool()


def test_reused_exl2_output_equals_twin_whatever_it_held():
    assert 2 * K * N >= outbuf.POOL_MIN_BYTES
    args1, twin1 = _exl2_layer(1)
    args2, twin2 = _exl2_layer(2)
    a = X.dequantize(*args1)
    assert not outbuf.is_reused(a) and a.ctypes.data % 64 == 0
    assert np.array_equal(a.view(np.uint16), O.dequantize(*twin1).view(np.uint16))
    addr = a.ctypes.data
    a.view(np.uint16)[...] = 0x7E01  # poison: a NaN pattern the decode never produces here
    del a
    b = X.dequantize(*args2)
    assert outbuf.is_reused(b) and b.ctypes.data == addr  # non-temporal stores on x86 into the reused mapping
    assert np.array_equal(b.view(np.uint16), O.dequantize(*twin2).view(np.uint16))


def test_reused_exl3_output_equals_a_fresh_decode():
    rng = np.random.default_rng(3)
    tr = rng.integers(-32768, 32768, size=(K // 16, N // 16, 8 * 4), dtype=np.int16)
    suh = rng.uniform(-2, 2, K).astype(np.float16)
    svh = rng.uniform(-0.02, 0.02, N).astype(np.float16)
    fresh = E3.dequantize(tr, suh, svh, 4, "3inst", K, N)
    want = fresh.view(np.uint16).copy()
    fresh.view(np.uint16)[...] = 0x7E01
    addr = fresh.ctypes.data
    del fresh
    again = E3.dequantize(tr, suh, svh, 4, "3inst", K, N)
    assert outbuf.is_reused(again) and again.ctypes.data == addr
    assert np.array_equal(again.view(np.uint16), want)


def test_a_live_view_keeps_its_mapping_out_of_the_pool():
    a = outbuf.empty_aligned((N, K))
    view = a.view(np.float16)[3:, 5:]
    addr = a.ctypes.data
    del a
    b = outbuf.empty_aligned((N, K))
    assert b.ctypes.data != addr and not outbuf.is_reused(b)
    del b  # b's mapping is pooled now; the view's is still in use
    del view  # the view's mapping replaces it: the pool keeps one mapping, the newest
    assert len(outbuf._pool) == 1
    c = outbuf.empty_aligned((N, K))
    assert c.ctypes.data == addr and outbuf.is_reused(c)
    assert outbuf.is_reused(c.view(np.float16)[1:])


def test_other_size_class_releases_the_pooled_mapping():
    a = outbuf.empty_aligned((N, K))
    del a
    assert len(outbuf._pool) == 1
    b = outbuf.empty_aligned((N, 3 * K))  # another size class: the pooled mapping is dropped, not kept beside b
    assert not outbuf.is_reused(b) and len(outbuf._pool) == 0
    del b
    outbuf.release_pool()
    assert len(outbuf._pool) == 0


def test_small_outputs_are_plain_aligned_arrays():
    a = outbuf.empty_aligned((7, 33))
    assert a.shape == (7, 33) and a.dtype == np.uint16 and a.flags.c_contiguous and a.ctypes.data % 64 == 0
    del a
    assert len(outbuf._pool) == 0


def test_pool_size_zero_keeps_nothing(monkeypatch):
    monkeypatch.setattr(outbuf, "POOL_SIZE", 0)
    a = outbuf.empty_aligned((N, K))
    del a
    assert len(outbuf._pool) == 0
    b = outbuf.empty_aligned((N, K))
    assert not outbuf.is_reused(b)
