"""Slow, explicit NumPy reference for EXL3 (ExLlamaV3 trellis) linear layers.

Written from the format description (spec/exl3.md); meant as the oracle for tests, not for speed.
Everything here works on whole arrays with plain NumPy (no torch, no numba).

Rates are carried internally as ``k2`` = 2 * bits-per-weight (an int): integer rates 1..8 give
k2 = 2..16 (even), the half-integer rates 1.5 / 2.5 / 3.5 give k2 = 3 / 5 / 7.

Public functions
    decode_states(trellis, K)        int16 [tk, tn, 16K]  -> uint16 states [16 tk, 16 tn] (row-major, input x output)
    codebook_3inst / codebook_mcg / codebook_mul1(states)  -> float16 values, bit-exact with exllamav3's CUDA decode
    hadamard_128(x, axis)            fp32 blockwise orthonormal Walsh-Hadamard, fixed butterfly order
    dequantize(tensors, in_f, out_f) -> float16 [out_f, in_f] (nn.Linear.weight layout)
    inner_weight(tensors)            -> float16 [in_p, out_p], the exact rotated-basis weight
    pack_trellis(states, K)          inverse of decode_states (independent bit-writing implementation)
    states_from_symbols(sym, K)      consistent states from per-position new bits (test-side encoder helper)
    dequantize_embedding(trellis, signs, hidden)  quantized token embedding table (LSB-first rings, mul1)
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "RATES", "rate_k2", "tile_words", "step_bits", "window_end", "tc_perm", "tc_perm_inv",
    "ring_bits", "decode_states", "codebook_3inst", "codebook_mcg", "codebook_mul1", "codebook_values",
    "hadamard_128", "unpack_sign_bits", "inner_weight", "dequantize", "pack_trellis", "states_from_symbols",
    "MCG_MARKER", "MUL1_MARKER", "HAD_SCALE_F32", "embedding_ring_states", "dequantize_embedding",
]

#: Every rate exllamav3 1.6.5 reads (bits_k.cuh: integer 1..8, half-integer only 1.5/2.5/3.5 and mul1 only).
RATES = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)

MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
#: Marker scalars as stored (int32 view of the uint32 multipliers).
MCG_MARKER = np.array(MCG_MULT, dtype=np.uint32).view(np.int32)[()]
MUL1_MARKER = np.array(MUL1_MULT, dtype=np.uint32).view(np.int32)[()]

#: fp32 nearest to 1/sqrt(128) (bits 0x3DB504F3), the entries of exllamav3's scaled Hadamard matrix.
HAD_SCALE_F32 = np.float32(1.0 / np.sqrt(128.0))

_F16_MUL1_KINV = np.array(0x1EEE, dtype=np.uint16).view(np.float16)[()]   # ~0.006775
_F16_MUL1_BIAS = np.array(0xC931, dtype=np.uint16).view(np.float16)[()]   # ~-10.383


# ------------------------------------------------------------------------------------------------
# Rates and the ring
# ------------------------------------------------------------------------------------------------

def rate_k2(K) -> int:
    """2 * rate as an int; raises ValueError for a rate exllamav3 does not read."""
    k2 = float(K) * 2.0
    if not k2.is_integer():
        raise ValueError(f"EXL3 rate {K!r} is not a whole or half number of bits")
    k2 = int(k2)
    if not (2 <= k2 <= 16 or k2 in (3, 5, 7)):
        raise ValueError(f"EXL3 rate {K!r} unsupported (1..8, 1.5, 2.5, 3.5)")
    return k2


def rate_from_last_dim(last_dim: int):
    """Rate implied by trellis.shape[-1] = 16 * rate (int for whole rates, float for half rates)."""
    if last_dim % 8:
        raise ValueError(f"trellis last dim {last_dim} is not a multiple of 8")
    k2 = last_dim // 8
    rate_k2(k2 / 2)
    return k2 // 2 if k2 % 2 == 0 else k2 / 2


def tile_words(K) -> int:
    """uint16 words per 16x16 tile: 16 * rate (= 8 * k2)."""
    return 8 * rate_k2(K)


def step_bits(K) -> np.ndarray:
    """New bits contributed by each of the 256 ring positions (K, or K-0.5 / K+0.5 alternating: odd positions
    carry the extra bit, exllamav3 mask 0xAAAA)."""
    k2 = rate_k2(K)
    t = np.arange(256)
    if k2 % 2 == 0:
        return np.full(256, k2 // 2, dtype=np.int64)
    return (k2 // 2 + (t & 1)).astype(np.int64)


def window_end(K) -> np.ndarray:
    """e(t) = floor((t + 1) * k2 / 2): the ring bit just past position t's 16-bit window."""
    k2 = rate_k2(K)
    e = ((np.arange(256, dtype=np.int64) + 1) * k2) // 2
    assert np.array_equal(e, np.cumsum(step_bits(K)))
    return e


def tc_perm() -> np.ndarray:
    """Ring position t (0..255) -> row-major index r * 16 + c inside the 16x16 tile (r: input, c: output).

    Lane L = t // 8 and slot j = t % 8: r = 2 (L % 4) + (j & 1) + 8 ((j >> 1) & 1), c = L // 4 + 8 (j >> 2)."""
    t = np.arange(256)
    lane, j = t // 8, t % 8
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = lane // 4 + 8 * (j >> 2)
    p = r * 16 + c
    assert np.array_equal(np.sort(p), t)
    return p


def tc_perm_inv() -> np.ndarray:
    inv = np.empty(256, dtype=np.int64)
    inv[tc_perm()] = np.arange(256)
    return inv


def ring_bits(tiles_u16: np.ndarray) -> np.ndarray:
    """[T, 8*k2] uint16 tile words -> [T, 128*k2] uint8 ring bits.

    The tile is read as little-endian 32-bit words (word i = u16[2i] | u16[2i+1] << 16) and each word
    MSB-first: ring bit p is bit 31 - p % 32 of word p // 32."""
    u = tiles_u16.astype(np.uint32)
    w32 = u[:, 0::2] | (u[:, 1::2] << np.uint32(16))
    shifts = (31 - np.arange(32)).astype(np.uint32)
    bits = (w32[:, :, None] >> shifts[None, None, :]) & np.uint32(1)
    return bits.reshape(w32.shape[0], -1).astype(np.uint8)


def _check_trellis(trellis: np.ndarray, K) -> int:
    trellis = np.asarray(trellis)
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be 3-D, got shape {trellis.shape}")
    if trellis.dtype not in (np.int16, np.uint16):
        raise ValueError(f"trellis must be int16, got {trellis.dtype}")
    k2 = rate_k2(K)
    if trellis.shape[2] != 8 * k2:
        raise ValueError(f"trellis last dim {trellis.shape[2]} != 16 * {K}")
    return k2


def decode_states(trellis: np.ndarray, K, chunk: int = 4096) -> np.ndarray:
    """int16 trellis [tiles_k, tiles_n, 16K] -> uint16 states [16 tiles_k, 16 tiles_n], tensor-core order undone.

    State of ring position t = the 16 ring bits [e(t) - 16, e(t)) read MSB first, indices mod the ring length
    (tail-biting: the windows of the first positions wrap to the ring's end)."""
    k2 = _check_trellis(trellis, K)
    tk, tn, L = trellis.shape
    R = 128 * k2
    e = window_end(K)
    idx = (e[:, None] - 16 + np.arange(16)[None, :]) % R          # [256, 16]
    weights = (1 << (15 - np.arange(16))).astype(np.uint32)        # MSB first
    flat = np.ascontiguousarray(trellis).view(np.uint16).reshape(tk * tn, L)
    states_tc = np.empty((tk * tn, 256), dtype=np.uint16)
    for a in range(0, tk * tn, chunk):
        bits = ring_bits(flat[a:a + chunk])                         # [T, R]
        win = bits[:, idx].astype(np.uint32)                        # [T, 256, 16]
        states_tc[a:a + chunk] = (win * weights).sum(axis=2).astype(np.uint16)
    # undo the tensor-core order: row-major element tc_perm[t] holds ring position t
    rowmajor = np.empty_like(states_tc)
    rowmajor[:, tc_perm()] = states_tc
    return rowmajor.reshape(tk, tn, 16, 16).transpose(0, 2, 1, 3).reshape(16 * tk, 16 * tn)


# ------------------------------------------------------------------------------------------------
# Codebooks (16-bit state -> fp16), bit-exact with exllamav3 codebook.cuh
# ------------------------------------------------------------------------------------------------

def _lop3_halves_sum(x: np.ndarray) -> np.ndarray:
    """(x & 0x8FFF8FFF) ^ 0x3B603B60, then fp16(low half + high half) with one round-to-nearest-even."""
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16)
    # the exact sum of two fp16 values is representable in float64; one rounding to fp16 follows
    return (lo.astype(np.float64) + hi.astype(np.float64)).astype(np.float16)


def codebook_3inst(states) -> np.ndarray:
    """3INST: x = s * 89226354 + 64248484 (mod 2^32), lop3, fp16 sum of the halves."""
    s = np.asarray(states).astype(np.uint64)
    x = (s * np.uint64(89226354) + np.uint64(64248484)) & np.uint64(0xFFFFFFFF)
    return _lop3_halves_sum(x)


def codebook_mcg(states) -> np.ndarray:
    """MCG: x = s * 0xCBAC1FED (mod 2^32), lop3, fp16 sum of the halves."""
    s = np.asarray(states).astype(np.uint64)
    x = (s * np.uint64(MCG_MULT)) & np.uint64(0xFFFFFFFF)
    return _lop3_halves_sum(x)


def codebook_mul1(states) -> np.ndarray:
    """MUL1: x = s * 0x83DCD12D (mod 2^32), h = 1024 + byte sum of x (exact fp16),
    value = fp16(h * fp16(0x1EEE) + fp16(0xC931)), one rounding (fused multiply-add)."""
    s = np.asarray(states).astype(np.uint64)
    x = (s * np.uint64(MUL1_MULT)) & np.uint64(0xFFFFFFFF)
    bsum = sum(((x >> np.uint64(8 * i)) & np.uint64(0xFF)) for i in range(4))
    h = 1024.0 + bsum.astype(np.float64)
    # h * kinv has <= 22 significant bits and the sum with the bias is exact in float64
    return (h * float(_F16_MUL1_KINV) + float(_F16_MUL1_BIAS)).astype(np.float16)


def codebook_values(states, codebook: str) -> np.ndarray:
    fn = {"3inst": codebook_3inst, "mcg": codebook_mcg, "mul1": codebook_mul1}[codebook]
    return fn(states)


# ------------------------------------------------------------------------------------------------
# Hadamard stage
# ------------------------------------------------------------------------------------------------

def hadamard_128(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """Orthonormal blockwise Walsh-Hadamard (natural/Sylvester order) over 128-long blocks of ``axis``, fp32.

    Canonical order: within each block, butterflies of width 1, 2, 4, ..., 64 (pairs (i, i + w) inside
    segments of 2w become (a + b, a - b)), every add/sub rounded to fp32; then one fp32 multiply by
    HAD_SCALE_F32 = fp32(1/sqrt(128)). The result equals sum_j H[i, j] * x[j] * fp32(1/sqrt(128)) up to
    fp32 rounding."""
    x = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    n = x.shape[-1]
    if n % 128:
        raise ValueError(f"hadamard_128: length {n} is not a multiple of 128")
    v = x.reshape(-1, n // 128, 128).copy()
    w = 1
    while w < 128:
        v = v.reshape(v.shape[0], v.shape[1], 128 // (2 * w), 2, w)
        a = v[:, :, :, 0, :].copy()
        b = v[:, :, :, 1, :].copy()
        v[:, :, :, 0, :] = a + b
        v[:, :, :, 1, :] = a - b
        v = v.reshape(v.shape[0], v.shape[1], 128)
        w *= 2
    v = (v * HAD_SCALE_F32).astype(np.float32)
    return np.moveaxis(v.reshape(x.shape), -1, axis)


# ------------------------------------------------------------------------------------------------
# Whole layer
# ------------------------------------------------------------------------------------------------

def unpack_sign_bits(packed: np.ndarray) -> np.ndarray:
    """Legacy su/sv: int16 words, 16 signs each, LSB first (element i: bit i % 16 of word i // 16);
    a set bit means -1. Returns float16 +-1."""
    u = np.asarray(packed).astype(np.int16).view(np.uint16).astype(np.uint32)
    bits = (u[:, None] >> np.arange(16, dtype=np.uint32)[None, :]) & np.uint32(1)
    return np.where(bits.reshape(-1) != 0, -1.0, 1.0).astype(np.float16)


def _codebook_of(tensors: dict) -> str:
    has_mcg, has_mul1 = "mcg" in tensors, "mul1" in tensors
    if has_mcg and has_mul1:
        raise ValueError("both mcg and mul1 markers present")
    for name, expect in (("mcg", MCG_MARKER), ("mul1", MUL1_MARKER)):
        if name in tensors:
            m = np.asarray(tensors[name])
            if m.shape != () or m.dtype != np.int32 or m[()] != expect:
                raise ValueError(f"{name} marker must be an int32 scalar {int(expect) & 0xFFFFFFFF:#x}")
            return name
    return "3inst"


def _sub(tensors: dict, key: str):
    """Accept either bare sub-keys ('trellis') or full names ('...proj.trellis')."""
    if key in tensors:
        return tensors[key]
    hits = [v for k, v in tensors.items() if k.endswith("." + key)]
    if len(hits) > 1:
        raise ValueError(f"several tensors end in .{key}")
    return hits[0] if hits else None


def _normalise(tensors: dict) -> dict:
    out = {}
    for key in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias", "scale"):
        v = _sub(tensors, key)
        if v is not None:
            out[key] = np.asarray(v)
    return out


def inner_weight(tensors: dict) -> tuple[np.ndarray, object, str]:
    """(W_hat float16 [in_p, out_p], rate, codebook). W_hat is exact (integer ops + one fp16 rounding)."""
    t = _normalise(tensors)
    if "trellis" not in t:
        raise ValueError("no trellis")
    trellis = t["trellis"]
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be 3-D, got {trellis.shape}")
    K = rate_from_last_dim(trellis.shape[2])
    cb = _codebook_of(t)
    if rate_k2(K) % 2 and cb != "mul1":
        raise ValueError(f"half-integer rate {K} requires the mul1 codebook")
    states = decode_states(trellis, K)
    return codebook_values(states, cb), K, cb


def dequantize(tensors: dict, in_features: int, out_features: int, return_padded: bool = False) -> np.ndarray:
    """fp16 nn.Linear weight [out_features, in_features] of one EXL3 linear.

    Order (mirrors LinearEXL3.get_weight_tensor, with our fixed fp32 summation order):
        A = fp16(H_l(W_hat))        H over 128-blocks of the input axis, fp32, one rounding to fp16
        B = fp16(A * suh[:, None])  exact fp16 x fp16 product, one rounding
        C = fp16(H_r(B))            H over 128-blocks of the output axis
        D = fp16(C * svh[None, :])
        W = D[:in_features, :out_features].T
    """
    t = _normalise(tensors)
    if "scale" in t:
        raise ValueError("per-tensor 'scale' (pre-suh format) is not supported")
    w_hat, K, cb = inner_weight(t)
    in_p, out_p = w_hat.shape
    if in_p % 128 or out_p % 128:
        raise ValueError(f"padded shape {in_p}x{out_p} is not a multiple of 128")
    if not (0 < in_features <= in_p and in_p - in_features < 128
            and 0 < out_features <= out_p and out_p - out_features < 128):
        raise ValueError(f"trellis {in_p}x{out_p} does not pad {in_features}x{out_features} to 128")
    suh = t["suh"].astype(np.float16) if "suh" in t else (unpack_sign_bits(t["su"]) if "su" in t else None)
    svh = t["svh"].astype(np.float16) if "svh" in t else (unpack_sign_bits(t["sv"]) if "sv" in t else None)
    if suh is None or svh is None:
        raise ValueError("missing suh/su or svh/sv")
    if suh.shape != (in_p,) or svh.shape != (out_p,):
        raise ValueError(f"suh {suh.shape} / svh {svh.shape} do not match {in_p}x{out_p}")

    a = hadamard_128(w_hat.astype(np.float32), axis=0).astype(np.float16)
    b = (a.astype(np.float32) * suh.astype(np.float32)[:, None]).astype(np.float16)
    c = hadamard_128(b.astype(np.float32), axis=1).astype(np.float16)
    d = (c.astype(np.float32) * svh.astype(np.float32)[None, :]).astype(np.float16)
    if return_padded:
        return d
    return np.ascontiguousarray(d[:in_features, :out_features].T)


# ------------------------------------------------------------------------------------------------
# Test-side encoder (independent of decode_states: writes bits instead of reading windows)
# ------------------------------------------------------------------------------------------------

def states_from_symbols(symbols: np.ndarray, K) -> np.ndarray:
    """Per-tile symbols [T, 256] (position t's new bits, < 2^d(t)) -> consistent ring-order states [T, 256].

    state(t) = the last 16 bits of the ring up to and including t's symbol, wrapping around the ring."""
    d = step_bits(K)
    T = symbols.shape[0]
    states = np.zeros((T, 256), dtype=np.uint32)
    for t in range(256):
        acc = np.zeros(T, dtype=np.uint32)
        shift = 0
        j = t
        while shift < 16:
            acc |= (symbols[:, j].astype(np.uint32) & np.uint32((1 << d[j]) - 1)) << np.uint32(shift)
            shift += int(d[j])
            j = (j - 1) % 256
        states[:, t] = acc & np.uint32(0xFFFF)
    return states.astype(np.uint16)


def pack_trellis(states: np.ndarray, K, check: bool = True) -> np.ndarray:
    """uint16 states [in_p, out_p] (row-major layout, as decode_states returns) -> int16 trellis [in_p/16, out_p/16, 16K].

    Each ring position t (tensor-core order) contributes the low d(t) bits of its state, written MSB first at
    ring bits [e(t) - d(t), e(t)); 32-bit words are emitted little-endian. With check=True the states must
    satisfy the shift-register rule state(t) = (state(t-1) << d(t) | new) & 0xFFFF, wrap included."""
    states = np.asarray(states).astype(np.uint16)
    in_p, out_p = states.shape
    if in_p % 16 or out_p % 16:
        raise ValueError("state matrix dims must be multiples of 16")
    k2 = rate_k2(K)
    tk, tn = in_p // 16, out_p // 16
    R = 128 * k2
    d = step_bits(K)
    e = window_end(K)
    tiles = states.reshape(tk, 16, tn, 16).transpose(0, 2, 1, 3).reshape(tk * tn, 256)
    ring_states = tiles[:, tc_perm()].astype(np.uint32)              # ring order
    if check:
        prev = np.roll(ring_states, 1, axis=1)
        expect_hi = (prev << d[None, :].astype(np.uint32)) & np.uint32(0xFFFF)
        mask_hi = np.uint32(0xFFFF) & ~((np.uint32(1) << d[None, :].astype(np.uint32)) - np.uint32(1))
        if np.any((ring_states & mask_hi) != (expect_hi & mask_hi)):
            raise ValueError("states do not form a tail-biting shift-register ring at this rate")
    bits = np.zeros((tk * tn, R), dtype=np.uint8)
    for t in range(256):
        for b in range(int(d[t])):
            pos = int(e[t]) - int(d[t]) + b                          # MSB of the symbol first
            bits[:, pos] = (ring_states[:, t] >> np.uint32(int(d[t]) - 1 - b)) & np.uint32(1)
    words = np.zeros((tk * tn, R // 32), dtype=np.uint32)
    for p in range(R):
        words[:, p // 32] |= bits[:, p].astype(np.uint32) << np.uint32(31 - p % 32)
    u16 = np.empty((tk * tn, R // 16), dtype=np.uint16)
    u16[:, 0::2] = (words & np.uint32(0xFFFF)).astype(np.uint16)
    u16[:, 1::2] = (words >> np.uint32(16)).astype(np.uint16)
    return u16.view(np.int16).reshape(tk, tn, R // 16)


# ------------------------------------------------------------------------------------------------
# Quantized token embeddings (a different ring format: LSB-first uint16 stream, fp16 scale word, no tc order)
# ------------------------------------------------------------------------------------------------

def embedding_ring_states(rings: np.ndarray, K: int, dim: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """rings int16 [N, 1 + dim*K/16] -> (states uint16 [N, dim], scales float16 [N]).

    Word 0 is the fp16 scale. Stream bit q is bit q % 16 of word 1 + q // 16 (LSB first); symbol i is stream
    bits [iK, (i+1)K), its least significant bit first; state i holds symbol i in its low K bits, symbol i-1
    above it, ... (mod dim), truncated to 16 bits."""
    if not (isinstance(K, (int, np.integer)) and 1 <= K <= 8):
        raise ValueError(f"embedding rate {K!r} must be an integer 1..8")
    rings = np.asarray(rings)
    if rings.ndim != 2 or rings.shape[1] != 1 + dim * K // 16:
        raise ValueError(f"embedding rings {rings.shape} do not match dim {dim}, K {K}")
    u = rings.astype(np.int16).view(np.uint16)
    scales = u[:, 0].copy().view(np.float16)
    words = u[:, 1:].astype(np.uint32)
    bits = ((words[:, :, None] >> np.arange(16, dtype=np.uint32)) & np.uint32(1)).reshape(len(u), -1)   # LSB first
    sym = np.zeros((len(u), dim), dtype=np.uint32)
    for b in range(K):
        sym |= bits[:, np.arange(dim) * K + b].astype(np.uint32) << np.uint32(b)
    states = np.zeros((len(u), dim), dtype=np.uint32)
    shift = 0
    j = 0
    while shift < 16:
        states |= np.roll(sym, j, axis=1) << np.uint32(shift)
        shift += K
        j += 1
    return (states & np.uint32(0xFFFF)).astype(np.uint16), scales


def _wht_f32(x: np.ndarray) -> np.ndarray:
    """Unscaled natural-order Walsh-Hadamard over the last axis (power of two), butterflies of width 1, 2, ..."""
    v = np.array(x, dtype=np.float32)
    n = v.shape[-1]
    w = 1
    while w < n:
        v = v.reshape(-1, n // (2 * w), 2, w)
        a, b = v[:, :, 0, :].copy(), v[:, :, 1, :].copy()
        v[:, :, 0, :], v[:, :, 1, :] = a + b, a - b
        w *= 2
    return v.reshape(x.shape)


def dequantize_embedding(trellis: np.ndarray, signs: np.ndarray, hidden: int) -> np.ndarray:
    """Quantized embedding table -> float16 [vocab, hidden].

    trellis int16 [vocab, G * (1 + 16K)], signs float16 [G, 256]. Per 256-group g of a row:
    fp16( signs[g] * (WHT(mul1(states) * scale) * fp32(1/16)) ), all in fp32, then trim to hidden."""
    trellis = np.asarray(trellis)
    signs = np.asarray(signs)
    G = signs.shape[0]
    if signs.shape != (G, 256) or trellis.ndim != 2 or trellis.shape[1] % G:
        raise ValueError("embedding trellis/signs shapes do not match")
    per = trellis.shape[1] // G
    if (per - 1) % 16 or not 1 <= (per - 1) // 16 <= 8 or G * 256 < hidden or (G - 1) * 256 >= hidden:
        raise ValueError("embedding ring width or group count inconsistent with hidden size")
    K = (per - 1) // 16
    V = trellis.shape[0]
    states, scales = embedding_ring_states(trellis.reshape(V * G, per), K)
    vals = codebook_mul1(states).astype(np.float32) * scales.astype(np.float32)[:, None]
    rot = _wht_f32(vals) * np.float32(1.0 / 16.0)
    out = rot.reshape(V, G, 256) * signs.astype(np.float32)[None, :, :]
    return out.reshape(V, G * 256)[:, :hidden].astype(np.float16)
