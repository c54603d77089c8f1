"""GGML block quantizers with a scale search: the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the legacy
32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), written byte for byte in ggml's block layouts.

The ``gguf`` package decodes all of these but quantizes only the legacy ones, by plain rounding from the
block's extremes.  Here each block's integers, scales and minimums come from a weighted least-squares search
(``ggml_fit``; the idea of llama.cpp's ``ggml-quants.c``, not its code), then this module packs them.  The
block layouts (one row of ``K`` weights is ``K / block`` blocks in order; fp16 values little-endian):

* ``Q4_K`` (256 weights, 144 bytes): ``d`` fp16, ``dmin`` fp16, 12 bytes of eight 6-bit scales and eight 6-bit
  minimums, 128 bytes of 4-bit ``L``; sub-block j of 32 decodes ``d * sc[j] * L - dmin * mn[j]``.  The 12 bytes:
  byte j (j < 4) = sc[j] low 6 bits | sc[j+4] bits 4-5 in bits 6-7; byte 4+j the same for the minimums; byte
  8+j = sc[j+4] low 4 bits | mn[j+4] low 4 bits << 4.  ``L`` byte 32c+l = L[64c+l] | L[64c+32+l] << 4.
* ``Q5_K`` (256, 176): as Q4_K, then 32 bytes ``qh`` (bit j of qh[l] = bit 4 of L[32j+l]) before the 128 bytes
  of low nibbles; L in 0..31.
* ``Q6_K`` (256, 210): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, ``d`` fp16; sixteen
  sub-blocks of 16 decode ``d * sc[j] * (U - 32)``, U in 0..63.  In half h (weights 128h..128h+127, local p):
  low nibble of U[p] in byte 64h + (p mod 64), shifted 4 when p >= 64; its bits 4-5 in byte 32h + (p mod 32),
  shifted 2 * (p div 32).
* ``Q3_K`` (256, 110): 32 bytes ``hmask``, 64 bytes of 2-bit low parts, 12 bytes of sixteen 6-bit scales
  (stored + 32), ``d`` fp16; weight decodes ``d * sc[j] * (U - 4)``, U in 0..7: bit 2 of U[32i+l] is bit i of
  hmask[l]; the low 2 bits of U[128h+32t+l] are bits 2t..2t+1 of byte 32h+l.  Scale bytes: byte j (j < 8) =
  S[j] low 4 bits | S[j+8] low 4 bits << 4; byte 8+k holds bits 4-5 of S[k+4t] at bits 2t..2t+1.
* ``Q2_K`` (256, 84): 16 bytes of (4-bit scale | 4-bit minimum << 4), 64 bytes of 2-bit L (as Q3_K's low
  parts), ``d`` fp16, ``dmin`` fp16; sub-block j of 16 decodes ``d * sc[j] * L - dmin * mn[j]``.
* ``IQ4_NL`` (32, 18): fp16 ``d``, then 16 bytes of 4-bit indices laid out as Q4_0's nibbles; a weight decodes
  ``d * IQ4_NL_VALUES[index]`` (16 fixed, non-uniform values: 4.5 bits per weight, as Q4_0, with a finer grid
  near zero).
* ``Q4_0`` / ``Q5_0`` / ``Q8_0`` (32 weights): fp16 ``d``, then (Q5_0) a little-endian uint32 of the fifth bits,
  then the nibbles (byte j = U[j] | U[j+16] << 4; U = L + 8 or + 16) or (Q8_0) 32 int8.  ``Q4_1`` / ``Q5_1``: fp16
  ``d``, fp16 ``m``, [qh], nibbles; decode ``d * U + m``.

``tests/test_ggml_quant.py`` checks every type against the ``gguf`` package's own decoder (independent code) and
the fit against a slow NumPy twin.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KQUANT_TYPES", "LEGACY_TYPES", "BLOCK", "TYPE_SIZE", "quantize", "fits_row", "fit_integers"]

#: weights per block and bytes per block of each type
BLOCK = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256,
         "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32}
TYPE_SIZE = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
             "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "IQ4_NL": 18}
KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
#: IQ4_NL's 16 fixed values (the format's table, as ggml and the gguf package's decoder hold it)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

#: the search of each type: affine (sub-block, L max, scale max, steps, first step, step) or symmetric
#: (sub-block, L min, L max, scale min, scale max, steps each side, step); the step counts are those that cost
#: a few trials per weight (llama.cpp tries 16-21 for the affine K-quants, 19 for the symmetric ones)
_AFFINE = {"Q4_K": (32, 15.0, 63.0, 20, -1.0, 0.1), "Q5_K": (32, 31.0, 63.0, 15, -0.5, 0.1),
           "Q2_K": (16, 3.0, 15.0, 15, -0.5, 0.1)}
_SYM = {"Q6_K": (16, -32.0, 31.0, -128.0, 127.0, 9, 0.1), "Q3_K": (16, -4.0, 3.0, -32.0, 31.0, 9, 0.1)}
_LEGACY_SYM = {"Q4_0": (-8.0, 7.0), "Q5_0": (-16.0, 15.0), "Q8_0": (-128.0, 127.0)}
_LEGACY_AFFINE = {"Q4_1": 15.0, "Q5_1": 31.0}


def fits_row(gtype: str, cols: int) -> bool:
    """True when a row of ``cols`` weights is a whole number of ``gtype`` blocks (llama.cpp's rule)."""
    return cols > 0 and cols % BLOCK[gtype] == 0


def fit_integers(x: np.ndarray, gtype: str, w: np.ndarray | None = None) -> dict:
    """The fitted integers and scales of ``x`` (float32 [N, K], finite, K a multiple of the block) as ``gtype``:
    ``L`` int8 [N, K] (the stored integer less its offset: U - 32 for Q6_K, U - 4 for Q3_K, U - 8 / - 16 for
    Q4_0 / Q5_0), ``sc`` / ``mn`` int8 [N, K / sub] (K-quants), ``d`` / ``dmin`` uint16 fp16 bits [N, K / block]
    (``dmin`` is the legacy affine types' fp16 minimum ``m``).  ``w``: float32 [N, K] or [1, K] importance
    (None: uniform)."""
    from . import ggml_fit as f

    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or not fits_row(gtype, x.shape[1]):
        raise ValueError(f"{gtype}: rows of {x.shape[-1]} weights are not whole blocks of {BLOCK[gtype]}")
    N, K = x.shape
    w = np.ones((1, K), np.float32) if w is None else np.asarray(w, dtype=np.float32).reshape(-1, K)
    if w.shape[0] not in (1, N):
        raise ValueError(f"importance of shape {w.shape} for weights of shape {x.shape}")
    w = np.ascontiguousarray(w)
    nb = K // BLOCK[gtype]
    L = np.zeros((N, K), np.int8)
    d = np.zeros((N, nb), np.uint16)
    out = {"L": L, "d": d}
    if gtype in _AFFINE:
        sub, nmax, smax, nstep, rmin, rdelta = _AFFINE[gtype]
        sc = np.zeros((N, K // sub), np.int8)
        mn = np.zeros((N, K // sub), np.int8)
        dm = np.zeros((N, nb), np.uint16)
        f.kquant_affine(x, w, sub, nmax, smax, nstep, rmin, rdelta, L, sc, mn, d, dm)
        out.update(sc=sc, mn=mn, dmin=dm)
    elif gtype in _SYM:
        sub, nlo, nhi, slo, shi, nstep, rdelta = _SYM[gtype]
        sc = np.zeros((N, K // sub), np.int8)
        f.kquant_sym(x, w, sub, nlo, nhi, slo, shi, nstep, rdelta, L, sc, d)
        out.update(sc=sc)
    elif gtype in _LEGACY_SYM:
        nlo, nhi = _LEGACY_SYM[gtype]
        f.legacy_sym(x, w, nlo, nhi, 9, 0.1, L, d)
    elif gtype == "IQ4_NL":
        f.legacy_nl(x, w, np.asarray(IQ4_NL_VALUES, np.float64), 9, 1.0, L, d)
    elif gtype in _LEGACY_AFFINE:
        dm = np.zeros((N, nb), np.uint16)
        f.legacy_affine(x, w, _LEGACY_AFFINE[gtype], 15, -0.5, 0.1, L, d, dm)
        out.update(dmin=dm)
    else:
        raise ValueError(f"no quantizer for {gtype}")
    return out


def quantize(x: np.ndarray, gtype: str, w: np.ndarray | None = None) -> np.ndarray:
    """uint8 [N, K / block * type_size]: ``x`` (float32 [N, K], finite) as ``gtype`` blocks (``fit_integers``
    packed in ggml's layout)."""
    f = fit_integers(x, gtype, w)
    N, K = f["L"].shape
    return _PACK[gtype](f, N, K // BLOCK[gtype]).reshape(N, -1)


# ------------------------------------------------------------------------------------------------- packing


def _f16(bits: np.ndarray, nblk: int) -> np.ndarray:
    return np.ascontiguousarray(bits).reshape(nblk, 1).view(np.uint8)


def _nibbles_64(u: np.ndarray) -> np.ndarray:
    """uint8 [B, 256] values < 16 -> [B, 128]: byte 32c+l = u[64c+l] | u[64c+32+l] << 4."""
    v = u.reshape(-1, 4, 2, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(-1, 128)


def _bits_2(u: np.ndarray) -> np.ndarray:
    """uint8 [B, 256] values < 4 -> [B, 64]: bits 2t..2t+1 of byte 32h+l = u[128h+32t+l]."""
    v = u.reshape(-1, 2, 4, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)).reshape(-1, 64)


def _bit_planes(bit: np.ndarray) -> np.ndarray:
    """uint8 [B, 256] values 0/1 -> [B, 32]: bit j of byte l = bit[32j+l]."""
    v = bit.reshape(-1, 8, 32)
    out = np.zeros((v.shape[0], 32), np.uint8)
    for j in range(8):
        out |= v[:, j] << j
    return out


def _scales_12(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and minimums [B, 8] -> the 12 bytes of Q4_K / Q5_K."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _pack_q4k(f, N, nb):
    B = N * nb
    u = f["L"].reshape(B, 256).astype(np.uint8)
    return np.concatenate([_f16(f["d"], B), _f16(f["dmin"], B), _scales_12(f["sc"].reshape(B, 8),
                           f["mn"].reshape(B, 8)), _nibbles_64(u & 15)], axis=1)


def _pack_q5k(f, N, nb):
    B = N * nb
    u = f["L"].reshape(B, 256).astype(np.uint8)
    return np.concatenate([_f16(f["d"], B), _f16(f["dmin"], B), _scales_12(f["sc"].reshape(B, 8),
                           f["mn"].reshape(B, 8)), _bit_planes((u >> 4) & 1), _nibbles_64(u & 15)], axis=1)


def _pack_q6k(f, N, nb):
    B = N * nb
    u = (f["L"].reshape(B, 256).astype(np.int16) + 32).astype(np.uint8)
    h = u.reshape(B, 2, 128)
    ql = ((h[:, :, :64] & 15) | ((h[:, :, 64:] & 15) << 4)).reshape(B, 128)
    qh = _bits_2((u >> 4) & 3)
    return np.concatenate([ql, qh, f["sc"].reshape(B, 16).view(np.uint8), _f16(f["d"], B)], axis=1)


def _pack_q3k(f, N, nb):
    B = N * nb
    u = (f["L"].reshape(B, 256).astype(np.int16) + 4).astype(np.uint8)
    s = (f["sc"].reshape(B, 16).astype(np.int16) + 32).astype(np.uint8)
    low = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    hs = (s >> 4) & 3
    high = hs[:, 0:4] | (hs[:, 4:8] << 2) | (hs[:, 8:12] << 4) | (hs[:, 12:16] << 6)
    return np.concatenate([_bit_planes(u >> 2), _bits_2(u & 3), low, high, _f16(f["d"], B)], axis=1)


def _pack_q2k(f, N, nb):
    B = N * nb
    u = f["L"].reshape(B, 256).astype(np.uint8)
    sm = f["sc"].reshape(B, 16).astype(np.uint8) | (f["mn"].reshape(B, 16).astype(np.uint8) << 4)
    return np.concatenate([sm, _bits_2(u), _f16(f["d"], B), _f16(f["dmin"], B)], axis=1)


def _legacy(f, N, nb, offset: int, five: bool, with_min: bool):
    B = N * nb
    u = (f["L"].reshape(B, 32).astype(np.int16) + offset).astype(np.uint8)
    parts = [_f16(f["d"], B)]
    if with_min:
        parts.append(_f16(f["dmin"], B))
    if five:
        hb = ((u >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        parts.append(hb.sum(axis=1, dtype=np.uint32).astype("<u4").reshape(B, 1).view(np.uint8))
    parts.append((u[:, :16] & 15) | ((u[:, 16:] & 15) << 4))
    return np.concatenate(parts, axis=1)


def _pack_q8_0(f, N, nb):
    B = N * nb
    return np.concatenate([_f16(f["d"], B), f["L"].reshape(B, 32).view(np.uint8)], axis=1)


_PACK = {"Q4_K": _pack_q4k, "Q5_K": _pack_q5k, "Q6_K": _pack_q6k, "Q3_K": _pack_q3k, "Q2_K": _pack_q2k,
         "Q4_0": lambda f, N, nb: _legacy(f, N, nb, 8, False, False),
         "Q5_0": lambda f, N, nb: _legacy(f, N, nb, 16, True, False),
         "Q4_1": lambda f, N, nb: _legacy(f, N, nb, 0, False, True),
         "Q5_1": lambda f, N, nb: _legacy(f, N, nb, 0, True, True),
         "IQ4_NL": lambda f, N, nb: _legacy(f, N, nb, 0, False, False),
         "Q8_0": _pack_q8_0}
