"""Numba codec for EXL3 (ExLlamaV3 trellis) linear layers: the fast twin of the NumPy oracle ``tests/exl3_oracle.py``.

Format and rounding points: spec/exl3.md sections 1-5.  Every public function is pure
(arrays in, new arrays out, no I/O) and bit-exact with the NumPy oracle ``tests/exl3_oracle.py`` (tests/test_exl3_codec.py).

Argument contracts (all arrays any memory order; they are made C-contiguous on entry):

* ``trellis``   int16 (uint16 accepted) [tiles_k, tiles_n, 8*K2]: tile (tk, tn) covers input rows
                16 tk .. 16 tk + 15 and output columns 16 tn .. 16 tn + 15 of W_hat [in_p, out_p]; its words
                form one tail-biting ring of 128*K2 bits (spec/exl3.md, section 2).
* ``K2``        int, 2 * bits per weight: 2..16, or 3 / 5 / 7 for the half rates 1.5 / 2.5 / 3.5 (mul1 only).
* ``codebook``  "3inst", "mcg" or "mul1" (the marker tensor present: none / mcg / mul1).
* ``suh``       float16 [in_p]  input-side scales; with ``legacy_signs=True`` the legacy ``su``:
                int16 [in_p / 16], 16 signs per word, LSB first, set bit = -1.
* ``svh``       float16 [out_p] output-side scales; legacy ``sv``: int16 [out_p / 16].

Outputs: ``decode_states`` uint16 [in_p, out_p] and ``inner_weight`` float16 [in_p, out_p], row-major with
rows = input features (W_hat as exllamav3 reconstructs it); ``dequantize`` float16 [out_features, in_features],
C order (``nn.Linear.weight``).

How ``dequantize`` runs.  Every step of the Hadamard stage stays inside a 128 x 128 block of W_hat (spec/exl3.md
section 5).  A work item is 128 input rows x 512 output columns (the LANES = 32 tiles of a tile row, side by
side in the SIMD lanes: the same ring position has the same window offset in every tile); items are spread
over the threads in static chunks that reuse their buffers.

1. ring words of the item's 8 x 32 tiles as uint32 wt [8, 4 K2 + 1, 32] (tile row, word, tile column), the
   first word repeated at the end so that a 16-bit window never needs a modulo (the trellis read as the
   little-endian 32-bit words it holds, 16 x 16 register transposes, when 4 K2 is a multiple of 16); the next
   item's trellis rows are prefetched while this one computes (they stream from memory);
2. for each tile column c (16): the 128 input rows j of the 32 output columns n = 16 tn + c are decoded
   (window -> codebook -> fp32) 16 rows at a time (16 lanes per register) straight into the butterflies of
   widths 1, 2, 4, 8 (registers), then into G [128, 32]; widths 16, 32, 64 run over the rows of G (radix 8,
   32 lanes at once) and also form A = fp16(. * s), B = fp16(A * suh[j]) into G16 [128, 32] uint16, which
   goes transposed (32 x 32 in registers) into Z [512, 128 + 16] (row 32 c + l; the 288-byte rows keep the
   16 rows a right-Hadamard load reads, 32 Z rows apart, out of one L1 set);
3. for each 128 output columns x 32 input rows slice: the right Hadamard over n reads Z in its first four
   stages (radix 16) and its last three (radix 8) form C = fp16(. * s), D = fp16(C * svh[n]) straight into
   out[n, j] (64-byte rows; non-temporal stores on x86 when in_features % 16 == 0, an sfence per item).

The butterflies run in the oracle's hadamard_128's order (widths 1, 2, 4, ..., 64, each add/sub rounded to fp32, then
one fp32 multiply by s = fp32(1/sqrt(128))), up to four stages at a time in registers (radix 16 / 8; radix 4 in the
portable loops): the very same operations in the same order, so the
result is bit-identical (on x86 each difference a - b is issued as fma(b, -1, a): the same single rounding, on the
multiply-add pipes, which halves the load on the adders; exl3_ops._butterflies).  The 3INST / MCG codebook's two
fp16 halves become fp32 by integer shifts and masks (they are always normal: exl3_ops._LOP3_F32_MASK), and every
codebook value is rounded to fp16 precision by Veltkamp's split (exl3_ops._rn16_split: exact for all 65536
states).  The chunks' buffers are 64-byte aligned (no vector row straddles two cache lines).  Where the CPU has no
hardware fp16 conversion (HW_HALF false) the portable loop twins of these steps run instead (same bits;
test_loop_fallback_path).
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ..layout import EXL3_CODEBOOKS, Exl3Slot
from . import exl2, exl3_ops, f16
from .cache_deps import watch
from .exl2 import NT_STORES, empty_aligned, store_fence, transpose_store  # shared with the EXL2 decoder
from .f16 import f32_to_f16_bits
from .exl3_ops import (ADD, LANES, MUL1, MULT, SLICE, add32, decode_left, decode_pos, load_rings16, prefetch, right_had,
                       shl32, window16)

# the kernels below inline code of these files: a change there must invalidate their cached machine code too
watch(__file__, (exl3_ops.__file__, exl2.__file__, f16.__file__))

__all__ = ["CODEBOOKS", "decode_states", "inner_weight", "dequantize", "unpack_sign_bits", "check_k2"]

#: codebook name ("3inst", "mcg", "mul1": the layout table's EXL3_CODEBOOKS) -> kernel id
CODEBOOKS = {name: i for i, name in enumerate(EXL3_CODEBOOKS)}

# ----------------------------------------------------------------------------------------------
# Ring tables
# ----------------------------------------------------------------------------------------------

def check_k2(K2) -> int:
    """K2 = 2 * rate as an int; ValueError unless it is one exllamav3 reads (2..16, 3, 5, 7)."""
    if isinstance(K2, (bool, np.bool_)) or not isinstance(K2, (int, np.integer)):
        raise ValueError(f"K2 must be an int (2 * bits per weight), got {K2!r}")
    k2 = int(K2)
    if not (2 <= k2 <= 16 or k2 in (3, 5, 7)):
        raise ValueError(f"K2 = {k2} is not an EXL3 rate (2 * rate with rate 1..8, 1.5, 2.5, 3.5)")
    return k2


def _ring_tables(k2: int):
    """Per ring position t (0..255): the window's first 32-bit word and bit offset in it, and tpos [16, 16]:
    tpos[c, r] = the ring position holding tile element (row r, column c) (tensor-core order, spec/exl3.md)."""
    t = np.arange(256, dtype=np.int64)
    e = ((t + 1) * k2) // 2                                  # window end e(t) (spec/exl3.md)
    p = (e - 16) % (128 * k2)                                # window start, wrapped (tail-biting)
    lane, j = t // 8, t % 8
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = lane // 4 + 8 * (j >> 2)
    tpos = np.empty((16, 16), dtype=np.int64)
    tpos[c, r] = t
    return p >> 5, p & 31, tpos


def _prep_trellis(trellis, k2: int) -> np.ndarray:
    tr = np.asarray(trellis)
    if tr.ndim != 3 or tr.dtype not in (np.int16, np.uint16):
        raise ValueError(f"trellis must be int16 [tiles_k, tiles_n, 8*K2], got {tr.dtype} {tr.shape}")
    if tr.shape[2] != 8 * k2:
        raise ValueError(f"trellis last dim {tr.shape[2]} != 8 * K2 = {8 * k2}")
    return np.ascontiguousarray(tr).view(np.uint16)


def _codebook_id(codebook, k2: int) -> int:
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {sorted(CODEBOOKS)}, got {codebook!r}")
    if k2 % 2 and codebook != MUL1:
        raise ValueError(f"half rate {k2 / 2} requires the mul1 codebook, got {codebook!r}")
    return CODEBOOKS[codebook]


# ----------------------------------------------------------------------------------------------
# Shared decode step: 8 tiles of one tile row, side by side in the lanes
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _load_rings(tr, tk, tn0, nlanes, wt, b):
    """wt[b, q, l] = 32-bit ring word q of tile (tk, tn0 + l) (u16 word 2q low, 2q+1 high), q < 4 K2, and
    wt[b, 4 K2, l] = wt[b, 0, l]; lanes l >= nlanes are 0.
    tr uint16 [tiles_k, tiles_n, 8 K2]; wt uint32 [*, 4 K2 + 1, LANES]."""
    nw = tr.shape[2] // 2
    dst = wt[b]                      # views: no negative-index fix-ups in the loops
    for l in range(LANES):
        if l < nlanes:
            src = tr[tk, tn0 + l]
            for q in range(nw):
                dst[q, l] = add32(src[2 * q], shl32(src[2 * q + 1], 16))
            dst[nw, l] = dst[0, l]
        else:
            for q in range(nw + 1):
                dst[q, l] = 0



@njit(cache=True, parallel=True)
def _states_kernel(tr, widx, woff, tpos, out):
    """out uint16 [16 tiles_k, 16 tiles_n] = states (row-major tiles)."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + LANES - 1) // LANES
    for item in prange(tiles_k * ng):
        tk = item // ng
        tn0 = (item % ng) * LANES
        nl = min(LANES, tiles_n - tn0)
        wt = np.empty((1, L // 2 + 1, LANES), dtype=np.uint32)
        _load_rings(tr, tk, tn0, nl, wt, 0)
        st = np.empty(LANES, dtype=np.uint32)
        for c in range(16):
            for r in range(16):
                t = tpos[c, r]
                i = widx[t]
                o = woff[t]
                for l in range(LANES):
                    st[l] = window16(wt[0, i, l], wt[0, i + 1, l], o)
                for l in range(nl):
                    out[16 * tk + r, 16 * (tn0 + l) + c] = np.uint16(st[l])


@njit(cache=True, parallel=True)
def _inner_kernel(tr, widx, woff, tpos, cbk, mult, add, out):
    """out uint16 [16 tiles_k, 16 tiles_n] = fp16 bits of W_hat."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + LANES - 1) // LANES
    for item in prange(tiles_k * ng):
        tk = item // ng
        tn0 = (item % ng) * LANES
        nl = min(LANES, tiles_n - tn0)
        wt = np.empty((1, L // 2 + 1, LANES), dtype=np.uint32)
        _load_rings(tr, tk, tn0, nl, wt, 0)
        v = np.empty((1, LANES), dtype=np.float32)
        for c in range(16):
            for r in range(16):
                t = tpos[c, r]
                decode_pos(wt, 0, widx[t], woff[t], cbk, mult, add, v, 0)
                for l in range(nl):
                    out[16 * tk + r, 16 * (tn0 + l) + c] = f32_to_f16_bits(v[0, l])



@njit(cache=True, inline="always")
def _empty64(n, dtype):
    """Uninitialised 1-D array of n elements of ``dtype`` (2 to 8 bytes) whose data starts on a 64-byte boundary."""
    raw = np.empty(n + 32, dtype=dtype)
    off = (-raw.ctypes.data % 64) // raw.itemsize
    return raw[off:off + n]


@njit(cache=True, parallel=True)
def _dequant_kernel(tr, itab, otab, cbk, mult, add, suh, svh, out, n_chunks, nt):
    """tr uint16 [tiles_k, tiles_n, 8 K2] (tiles_k, tiles_n multiples of 8); suh float32 [in_p];
    svh float32 [out_p]; out uint16 [out_features, in_features] (fp16 bits), C order.

    Work item: 128 input rows x 512 output columns (the LANES = 32 tiles of a tile row side by side)."""
    tiles_k, tiles_n, L = tr.shape
    ng = (tiles_n + LANES - 1) // LANES
    n_items = (tiles_k // 8) * ng
    n_chunks = max(1, min(n_items, n_chunks))
    for chunk in prange(n_chunks):
        # buffers once per chunk of work items (Z alone is 128 KiB: malloc would mmap and fault it in each time)
        # 64-byte aligned (Numba's own arrays start 32 bytes into a line): the 64-byte rows of the vector passes
        # then never straddle two cache lines
        wt = _empty64(8 * (L // 2 + 1) * LANES, np.uint32).reshape(8, L // 2 + 1, LANES)
        G = _empty64(128 * LANES, np.float32).reshape(128, LANES)
        G16 = _empty64(128 * LANES, np.uint16).reshape(128, LANES)
        Z = _empty64(16 * LANES * (128 + 16), np.uint16).reshape(16 * LANES, 128 + 16)   # row 32 c + l: output column 16 (tn0 + l) + c
        F = _empty64(128 * SLICE, np.float32).reshape(128, SLICE)
        for item in range(chunk * n_items // n_chunks, (chunk + 1) * n_items // n_chunks):
            _dequant_item(tr, itab, otab, cbk, mult, add, suh, svh, out, item, ng, wt, G, G16, Z, F, nt)


@njit(cache=True)
def _dequant_item(tr, itab, otab, cbk, mult, add, suh, svh, out, item, ng, wt, G, G16, Z, F, nt):
    """One work item of _dequant_kernel: input rows 128 bi.., output columns 16 tn0 .. 16 tn0 + 511."""
    tiles_n = tr.shape[1]
    n_out, n_in = out.shape
    bi = item // ng
    tn0 = (item - bi * ng) * LANES
    nl = min(LANES, tiles_n - tn0)          # a multiple of 8
    j0 = 128 * bi
    if nl == LANES and tr.shape[2] % 32 == 0:
        for tkl in range(8):
            load_rings16(tr, 8 * bi + tkl, tn0, wt, tkl)
    else:
        for tkl in range(8):
            _load_rings(tr, 8 * bi + tkl, tn0, nl, wt, tkl)
    # the next item's trellis rows (8 runs of nl * 8 K2 uint16), requested while this item computes: 1/16 of
    # them per tile column c, so that its ring loads do not wait on memory (the trellis streams from DRAM)
    nxt = item + 1
    nbi = nxt // ng
    ntn0 = (nxt - nbi * ng) * LANES
    has_next = 8 * nbi < tr.shape[0]
    run = min(LANES, tiles_n - ntn0) * tr.shape[2]     # uint16 per tile row of the next item
    half = (run + 1) // 2
    for c in range(16):
        if has_next:
            base = ((8 * nbi + (c >> 1)) * tiles_n + ntn0) * tr.shape[2] + (c & 1) * half
            for e in range(0, min(half, run - (c & 1) * half), 32):
                prefetch(tr, base + e)
        decode_left(wt, itab, otab, c, cbk, mult, add, suh, j0, G, G16)
        for jb in range(0, 128, 32):
            transpose_store(G16, jb, 0, Z, LANES * c, jb)
    for nb in range(nl // 8):
        n0 = 16 * tn0 + 128 * nb
        nrows = min(128, n_out - n0)
        if nrows <= 0:
            break
        for jc in range(0, 128, SLICE):
            ncols = min(SLICE, n_in - j0 - jc)
            if ncols <= 0:
                break
            right_had(Z, nb, jc, F, svh, n0, nrows, ncols, out, j0 + jc, nt)
    if nt:
        store_fence()


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def decode_states(trellis: np.ndarray, K2: int) -> np.ndarray:
    """int16 trellis [tiles_k, tiles_n, 8 K2] -> uint16 states [16 tiles_k, 16 tiles_n] (row = input)."""
    k2 = check_k2(K2)
    tr = _prep_trellis(trellis, k2)
    widx, woff, tpos = _ring_tables(k2)
    out = np.empty((16 * tr.shape[0], 16 * tr.shape[1]), dtype=np.uint16)
    if out.size:
        _states_kernel(tr, widx, woff, tpos, out)
    return out


def inner_weight(trellis: np.ndarray, K2: int, codebook: str) -> np.ndarray:
    """W_hat: float16 [16 tiles_k, 16 tiles_n] = codebook(state), exact (the oracle's inner_weight's array)."""
    k2 = check_k2(K2)
    cbk = _codebook_id(codebook, k2)
    tr = _prep_trellis(trellis, k2)
    widx, woff, tpos = _ring_tables(k2)
    out = np.empty((16 * tr.shape[0], 16 * tr.shape[1]), dtype=np.uint16)
    if out.size:
        _inner_kernel(tr, widx, woff, tpos, cbk, np.uint32(MULT[cbk % 2]), np.uint32(ADD[cbk % 2]), out)
    return out.view(np.float16)


def unpack_sign_bits(packed: np.ndarray) -> np.ndarray:
    """Legacy su/sv: int16 [m] (16 signs a word, LSB first, set bit = -1) -> float16 +-1 [16 m]."""
    u = np.ascontiguousarray(packed)
    if u.ndim != 1 or u.dtype not in (np.int16, np.uint16):
        raise ValueError(f"legacy sign words must be int16 [m], got {u.dtype} {u.shape}")
    bits = (u.view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & np.uint16(1)
    return np.where(bits.reshape(-1) != 0, np.float16(-1), np.float16(1)).astype(np.float16)


def _scales(v, n: int, legacy: bool, name: str) -> np.ndarray:
    v = np.asarray(v)
    if legacy:
        if v.shape != (n // 16,) or v.dtype not in (np.int16, np.uint16):
            raise ValueError(f"legacy {name} must be int16 [{n // 16}], got {v.dtype} {v.shape}")
        v = unpack_sign_bits(v)
    elif v.shape != (n,) or v.dtype != np.float16:
        raise ValueError(f"{name} must be float16 [{n}], got {v.dtype} {v.shape}")
    return v.astype(np.float32)


def dequantize(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, K2: int, codebook: str,
               in_features: int, out_features: int, *, legacy_signs: bool = False) -> np.ndarray:
    """One EXL3 linear -> float16 [out_features, in_features], C order (nn.Linear.weight).

    Bit-exact with the oracle's dequantize: A = fp16(H_l W_hat), B = fp16(A * suh), C = fp16(B H_r),
    D = fp16(C * svh), W = D[:in_features, :out_features]^T, H in 128-blocks with the oracle's fp32 order.
    ``legacy_signs``: ``suh``/``svh`` are the legacy packed sign words ``su``/``sv`` (int16 [in_p/16], [out_p/16]).
    The padded sizes in_p = 16 tiles_k, out_p = 16 tiles_n must be multiples of 128 that pad the features by
    less than 128 (spec/exl3.md, section 1)."""
    k2 = check_k2(K2)
    cbk = _codebook_id(codebook, k2)
    tr = _prep_trellis(trellis, k2)
    in_p, out_p = 16 * tr.shape[0], 16 * tr.shape[1]
    if in_p % 128 or out_p % 128:
        raise ValueError(f"padded shape {in_p}x{out_p} is not a multiple of 128")
    in_f, out_f = int(in_features), int(out_features)
    if not (0 < in_f <= in_p and in_p - in_f < 128 and 0 < out_f <= out_p and out_p - out_f < 128):
        raise ValueError(f"trellis {in_p}x{out_p} does not pad {in_f}x{out_f} to 128")
    su = _scales(suh, in_p, legacy_signs, Exl3Slot.SU if legacy_signs else Exl3Slot.SUH)
    sv = _scales(svh, out_p, legacy_signs, Exl3Slot.SV if legacy_signs else Exl3Slot.SVH)
    widx, woff, tpos = _ring_tables(k2)
    out = empty_aligned((out_f, in_f))   # 64-byte aligned rows: whole cache lines for the stores
    nt = NT_STORES and in_f % 16 == 0      # every 64-byte row segment then starts on a 32-byte boundary
    _dequant_kernel(tr, widx[tpos], woff[tpos], cbk, np.uint32(MULT[cbk % 2]), np.uint32(ADD[cbk % 2]), su, sv, out,
                    4 * get_num_threads(), nt)
    return out.view(np.float16)
