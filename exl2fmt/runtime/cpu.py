"""CPU kernels of the packed linears (Numba): y = x W^T with W decoded on the fly from EXL2 / GPTQ integers.

One model covers both formats.  A packed layer is a sequence of *units*: ``U`` consecutive stored input rows whose
``b``-bit codes sit, for every output column, in ``W`` consecutive int32 rows of the packed matrix as one bit
string (row j of the unit at bit j * b, a field may straddle two words): (b, U, W) = (2, 16, 1) (3, 32, 3)
(4, 8, 1) (5, 32, 5) (6, 16, 3) (8, 4, 1), EXL2's ``layout.BIT_WIDTHS``; GPTQ packs its 2/3/4/8-bit ``qweight``
the same way.  Stored row k, column n has the weight  w = S[g, n] * (v - Z[g, n])  with g the row's group and v
its code: EXL2 S = fp16(fp16((c + 1)^2) * fp16(q_scale_max / 256)) from the 4-bit scale code c, Z = 2^(b-1);
GPTQ S = the fp16 scale, Z = the zero field (+1 for v1 zeros).

What is exact and what is not: every weight is the FP16 conversion's weight bit for bit: S as the format defines
it (fp16 roundings included), S * (v - Z) formed in float32 (exact: an fp16 value times an integer of at most 9
bits) and rounded once to fp16 (F16C / AVX-512 conversions, vectorised), as ``convert --to fp16`` and ExLlamaV2's
kernel do.  What differs from running the FP16 conversion is the float32 summation order (four partial sums per
unit, units in stored order) against BLAS's, so the logits agree to a few 1e-6 of their scale, not bit for bit
(tests/test_runtime.py: 1e-3 and the top-1 token on models; each layer against a float64 oracle).  Folding the
scale out of the sum (S * sum x (v - Z)) would halve the arithmetic but drops that rounding; on SmolLM2-135M its
logits differed by 0.9e-3 of their scale, too close to the issue's 1e-3 tolerance.

* ``exl2_gemv`` / ``gptq_gemv`` (few rows: decode).  The weight is never stored.  The work is a list of *pieces*
  (``Pieces``: one unit and one group, its U activations gathered through ``xidx``, which also applies EXL2's input
  permutation), cut into chunks of equal packed size (one per thread; one chunk runs on the calling thread
  without a parallel region).  A chunk streams its packed rows once, front to back over all columns: per run of
  pieces of one group it forms S and Z for every column, then adds sum_j x_j * fp16(S * (v_j - Z)) unit by unit.
  The per-unit loop is generated for each bit width: unrolled over the unit's rows, 32-bit shifts and masks,
  vectorised over columns (16 lanes on AVX-512).  Several chunks' partial results are summed at the end.
* ``exl2_decode_rows`` / ``gptq_decode_rows`` (many rows: prefill): stored rows [k0, k1) as float32 weights (the
  same fp16 values) into a scratch tile that the caller multiplies with BLAS.

Arrays are C-contiguous; ``q_weight`` / ``qweight`` / ``q_scale`` are passed as uint32 views, fp16 tensors as their
uint16 bit patterns.  Interface for callers (``runtime.linear`` and other modules that hold packed tensors):
``exl2_pieces`` / ``gptq_pieces`` once per layer, then ``exl2_gemv`` / ``gptq_gemv`` or the row decoders per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..codec.f16 import f16_bits_to_f32, f32_to_f16_bits
from ..layout import BIT_WIDTHS

__all__ = ["Pieces", "exl2_pieces", "gptq_pieces", "exl2_row_table", "gptq_row_table", "exl2_gemv", "gptq_gemv",
           "exl2_decode_rows", "gptq_decode_rows", "decode_block"]

_FM = {"contract"}  # let LLVM fuse x * v + acc into one FMA; no reassociation (the sums keep the written order)


# --- 32-bit field extraction ----------------------------------------------------------------------------------------

def _i32(builder, v, t):
    i32 = ir.IntType(32)
    return builder.trunc(v, i32) if t.bitwidth > 32 else builder.zext(v, i32) if t.bitwidth < 32 else v


@intrinsic
def _field(typingctx, w, s, mask):
    """float32((w >> s) & mask) in 32-bit integer ops (Numba widens integer arithmetic to 64 bits, which halves
    the vector width of a decode loop); 0 <= s < 32, the field below 2^31."""
    if not all(isinstance(a, types.Integer) for a in (w, s, mask)):
        return None

    def codegen(context, builder, signature, args):
        a, sh, mk = (_i32(builder, v, t) for v, t in zip(args, signature.args))
        return builder.sitofp(builder.and_(builder.lshr(a, sh), mk), ir.FloatType())

    return types.float32(w, s, mask), codegen


@intrinsic
def _field2(typingctx, lo, hi, s, mask):
    """float32(((lo >> s) | (hi << (32 - s))) & mask): a field that straddles two words, 0 < s < 32."""
    if not all(isinstance(a, types.Integer) for a in (lo, hi, s, mask)):
        return None

    def codegen(context, builder, signature, args):
        a, b, sh, mk = (_i32(builder, v, t) for v, t in zip(args, signature.args))
        v = builder.or_(builder.lshr(a, sh), builder.shl(b, builder.sub(ir.Constant(ir.IntType(32), 32), sh)))
        return builder.sitofp(builder.and_(v, mk), ir.FloatType())

    return types.float32(lo, hi, s, mask), codegen


@njit(inline="always")
def _round16(f):
    """f rounded to the nearest fp16 value (ties to even), as float32: F16C / AVX-512 conversions where the CPU
    has them, so the rounding vectorises with the loop."""
    return f16_bits_to_f32(f32_to_f16_bits(f))


# --- the per-unit loops, one per bit width --------------------------------------------------------------------------

def _unit_source(b: int) -> str:
    """Source of ``_unit<b>(qw, q, xb, sc, nz, out, n)``: out[c] += sum_j xb[j] * fp16(sc[c] * v_j[c] + nz[c])
    for c < n, the unit's codes v_j in packed rows q .. q + W - 1 of ``qw`` (uint32 [Q, >= n]); ``xb`` float32
    [>= U]; ``sc`` / ``nz`` / ``out`` float32 [>= n], nz = -S * Z (exact), so that S * v + nz is S * (v - Z)
    exactly, fused or not.  The rows are unrolled (constant shifts) into four partial sums per column, so the
    column loop vectorises."""
    bw = BIT_WIDTHS[b]
    U, W, mask = bw.rows_per_unit, bw.words_per_unit, (1 << b) - 1
    lines = [f"def _unit{b}(qw, q, xb, sc, nz, out, n):"]
    lines += [f"    r{i} = qw[q + {i}]" for i in range(W)]
    lines += [f"    x{j} = xb[{j}]" for j in range(U)]
    lines.append("    for c in range(n):")
    lines.append("        s, z = sc[c], nz[c]")
    lines += [f"        w{i} = r{i}[c]" for i in range(W)]
    for j in range(U):
        i, sh = (j * b) >> 5, (j * b) & 31
        f = f"_field(w{i}, {sh}, {mask})" if sh + b <= 32 else f"_field2(w{i}, w{i + 1}, {sh}, {mask})"
        lines.append(f"        p{j % 4} {'=' if j < 4 else '+='} x{j} * _round16(s * {f} + z)")
    lines.append("        out[c] += (p0 + p1) + (p2 + p3)")
    return "\n".join(lines) + "\n"


def _make_unit(b: int):
    ns = {"_field": _field, "_field2": _field2, "_round16": _round16}
    exec(compile(_unit_source(b), f"<exl2fmt.runtime.cpu unit {b}-bit>", "exec"), ns)  # noqa: S102 - own source
    return njit(fastmath=_FM)(ns[f"_unit{b}"])


_unit2, _unit3, _unit4, _unit5, _unit6, _unit8 = (_make_unit(b) for b in (2, 3, 4, 5, 6, 8))


@njit(cache=True, fastmath=_FM)
def _unit(b, qw, q, xb, sc, nz, out, n):
    """Every row m of ``out`` [M, >= n] += the unit at packed row q (b bits) times ``xb`` [M, U]."""
    for m in range(out.shape[0]):
        xm, om = xb[m], out[m]
        if b == 4:
            _unit4(qw, q, xm, sc, nz, om, n)
        elif b == 3:
            _unit3(qw, q, xm, sc, nz, om, n)
        elif b == 6:
            _unit6(qw, q, xm, sc, nz, om, n)
        elif b == 5:
            _unit5(qw, q, xm, sc, nz, om, n)
        elif b == 8:
            _unit8(qw, q, xm, sc, nz, om, n)
        else:
            _unit2(qw, q, xm, sc, nz, om, n)


# --- the work list --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pieces:
    """The work list of one packed layer for the gemv kernels; arrays C-contiguous.

    ``table`` int32 [P + 1, 4]  per piece: bit width of its unit, its first packed int32 row, its group (the
                               pieces of a group form consecutive runs), and ``xoff``: its activations are
                               ``x[:, xidx[xoff[p]:xoff[p + 1]]]`` (U of them); row P holds only xoff[P]
    ``xidx``  int32 [xoff[P]]   input feature (original order) of each of the unit's rows; -1 for a row of
                               another group (GPTQ with activation order: a unit with rows of several groups is
                               one piece per group, each seeing only its own rows)
    ``words`` int64 [P + 1]     packed rows before each piece (what the split into chunks balances)
    """

    table: np.ndarray
    xidx: np.ndarray
    words: np.ndarray
    _bounds: dict = field(default_factory=dict, compare=False, repr=False)

    def bounds(self, parts: int) -> np.ndarray:
        """int64 [parts + 1]: piece boundaries of ``parts`` chunks of about equal packed size."""
        b = self._bounds.get(parts)
        if b is None:
            P = self.table.shape[0] - 1
            targets = self.words[-1] * np.arange(parts + 1) / max(parts, 1)
            b = np.searchsorted(self.words, targets, side="left").astype(np.int64)
            b[0], b[-1] = 0, P
            b = np.maximum.accumulate(b)
            self._bounds[parts] = b
        return b

    def nbytes(self) -> int:
        return self.table.nbytes + self.xidx.nbytes + self.words.nbytes


def _pieces(bits, word, group, xidx_rows) -> Pieces:
    P = len(bits)
    table = np.zeros((P + 1, 4), dtype=np.int32)
    table[:P, 0], table[:P, 1], table[:P, 2] = bits, word, group
    table[P, 2] = -1
    np.cumsum([len(r) for r in xidx_rows], out=table[1:, 3])
    xidx = np.concatenate(xidx_rows).astype(np.int32) if P else np.zeros(0, np.int32)
    words = np.zeros(P + 1, dtype=np.int64)
    np.cumsum([BIT_WIDTHS[int(b)].words_per_unit for b in bits], out=words[1:])
    return Pieces(table, xidx, words)


def exl2_pieces(gbits: np.ndarray, row_start: np.ndarray, qrow: np.ndarray, rows: np.ndarray,
                perm: np.ndarray) -> Pieces:
    """The pieces of an EXL2 layer from its ``GroupTable`` columns (int [G]) and ``perm`` (int [K]: the original
    input feature of each stored row, i.e. the inverse of ``q_invperm``)."""
    perm = np.asarray(perm, dtype=np.int64)
    bits, word, group, xr = [], [], [], []
    for g in range(len(gbits)):
        b, r0, q0, r = int(gbits[g]), int(row_start[g]), int(qrow[g]), int(rows[g])
        bw = BIT_WIDTHS[b]
        U, W = bw.rows_per_unit, bw.words_per_unit
        for u in range(r // U):
            bits.append(b)
            word.append(q0 + u * W)
            group.append(g)
            xr.append(perm[r0 + u * U: r0 + (u + 1) * U])
    return _pieces(bits, word, group, xr)


def gptq_pieces(K: int, b: int, g_idx: np.ndarray) -> Pieces:
    """The pieces of a GPTQ layer (``K`` input rows, ``b`` bits, ``g_idx`` int [K]).  Units whose rows all lie in
    one group stay in stored order; a unit with rows of several groups (activation order) becomes one piece per
    group, and then all pieces are ordered by group so that each group is one run (the unit's words are then read
    once per group it holds)."""
    bw = BIT_WIDTHS[b]
    U, W = bw.rows_per_unit, bw.words_per_unit
    gi = np.asarray(g_idx, dtype=np.int64)
    nu = K // U
    ug = gi[: nu * U].reshape(nu, U)
    rows = np.arange(nu * U, dtype=np.int64).reshape(nu, U)
    if (ug == ug[:, :1]).all():
        return _pieces([b] * nu, np.arange(nu) * W, ug[:, 0], list(rows))
    items = []
    for u in range(nu):
        for g in np.unique(ug[u]):
            items.append((int(g), u, np.where(ug[u] == g, rows[u], -1)))
    items.sort(key=lambda t: (t[0], t[1]))
    return _pieces([b] * len(items), [u * W for _, u, _ in items], [g for g, _, _ in items],
                   [r for _, _, r in items])


def exl2_row_table(bits: np.ndarray, row_start: np.ndarray, qrow: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """int32 [K, 4]: (packed word, bit shift, group, bits) of every stored row of an EXL2 layer (the row
    decoders' table), from its ``GroupTable`` columns."""
    K = int(np.asarray(rows).sum())
    tab = np.empty((K, 4), dtype=np.int32)
    for g in range(len(bits)):
        b, r0, q0, r = int(bits[g]), int(row_start[g]), int(qrow[g]), int(rows[g])
        bw = BIT_WIDTHS[b]
        i = np.arange(r)
        u = i // bw.rows_per_unit
        pos = (i - u * bw.rows_per_unit) * b
        tab[r0:r0 + r, 0] = q0 + u * bw.words_per_unit + (pos >> 5)
        tab[r0:r0 + r, 1] = pos & 31
        tab[r0:r0 + r, 2] = g
        tab[r0:r0 + r, 3] = b
    return tab


def gptq_row_table(K: int, bits: int, g_idx: np.ndarray) -> np.ndarray:
    """int32 [K, 4] of a GPTQ layer: 32 rows of a column form one bit string of ``bits`` words (packed along K)."""
    k = np.arange(K)
    pos = (k % 32) * bits
    tab = np.empty((K, 4), dtype=np.int32)
    tab[:, 0] = (k // 32) * bits + (pos >> 5)
    tab[:, 1] = pos & 31
    tab[:, 2] = np.asarray(g_idx, dtype=np.int64)
    tab[:, 3] = bits
    return tab


# --- scales ---------------------------------------------------------------------------------------------------------

@njit(cache=True, fastmath=_FM)
def _exl2_scales(q_scale, qsm_bits, g, n0, w, out):
    """out[c] = S[g, n0 + c] of an EXL2 layer for c < w: fp16(fp16((code + 1)^2) * fp16(q_scale_max[g] / 256))."""
    m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm_bits[g]) * np.float32(0.00390625)))
    row = q_scale[g]
    for c in range(w):
        n = n0 + c
        f = _field(row[n >> 3], (n & 7) * 4, 15) + np.float32(1.0)
        out[c] = f16_bits_to_f32(f32_to_f16_bits(f * f * m))


@njit(cache=True, fastmath=_FM)
def _gptq_scales(scales, zeros, zoff, g, n0, w, s_out, z_out):
    for c in range(w):
        s_out[c] = f16_bits_to_f32(scales[g, n0 + c])
        z_out[c] = np.float32(zeros[g, n0 + c]) + zoff


# --- few rows: gemv -------------------------------------------------------------------------------------------------

@njit(cache=True, fastmath=_FM)
def _run(qw, table, xidx, p, end, x, xb, sc, nz, out):
    """out [M, N] += the run of pieces from p (one group, before ``end``) times x, the group's S and -S * Z in
    ``sc`` / ``nz``.  Returns the end of the run."""
    g = table[p, 2]
    while p < end and table[p, 2] == g:
        a, e = table[p, 3], table[p + 1, 3]
        for m in range(x.shape[0]):
            for j in range(e - a):
                i = xidx[a + j]
                xb[m, j] = x[m, i] if i >= 0 else np.float32(0)
        _unit(table[p, 0], qw, table[p, 1], xb, sc, nz, out, out.shape[1])
        p += 1
    return p


@njit(cache=True, fastmath=_FM)
def _sum_parts(part, y):
    for m in range(y.shape[0]):
        for c in range(y.shape[1]):
            s = part[0, m, c]
            for t in range(1, part.shape[0]):
                s += part[t, m, c]
            y[m, c] = s


@njit(cache=True, fastmath=_FM)
def _exl2_chunk(x, q_weight, q_scale, qsm_bits, table, xidx, p, end, out):
    """out [M, N] += the pieces [p, end) of an EXL2 layer times x."""
    M, N = out.shape
    xb = np.empty((M, 32), dtype=np.float32)
    sc = np.empty(N, dtype=np.float32)
    nz = np.empty(N, dtype=np.float32)
    while p < end:
        _exl2_scales(q_scale, qsm_bits, table[p, 2], 0, N, sc)
        z = -np.float32(1 << (table[p, 0] - 1))
        for c in range(N):
            nz[c] = z * sc[c]
        p = _run(q_weight, table, xidx, p, end, x, xb, sc, nz, out)


@njit(cache=True, parallel=True, fastmath=_FM)
def exl2_gemv(x, q_weight, q_scale, qsm_bits, table, xidx, bounds, y):
    """y[M, N] (float32, overwritten) = x[M, K] (float32, original feature order) @ W of an EXL2 layer, N <= N_pad.

    ``q_weight`` uint32 [Q, N_pad], ``q_scale`` uint32 [G, N_pad / 8], ``qsm_bits`` uint16 [G] (q_scale_max);
    ``table`` / ``xidx`` of ``exl2_pieces``; ``bounds`` int64 [T + 1] of ``Pieces.bounds(T)``: T chunks run in
    parallel, and T = 1 runs on the calling thread alone (no parallel region is entered).
    """
    T = bounds.shape[0] - 1
    y[:] = 0
    if T == 1:
        _exl2_chunk(x, q_weight, q_scale, qsm_bits, table, xidx, bounds[0], bounds[1], y)
        return
    part = np.zeros((T, y.shape[0], y.shape[1]), dtype=np.float32)
    for t in prange(T):
        _exl2_chunk(x, q_weight, q_scale, qsm_bits, table, xidx, bounds[t], bounds[t + 1], part[t])
    _sum_parts(part, y)


@njit(cache=True, fastmath=_FM)
def _gptq_chunk(x, qweight, scales, zeros, zoff, table, xidx, p, end, out):
    M, N = out.shape
    xb = np.empty((M, 32), dtype=np.float32)
    sc = np.empty(N, dtype=np.float32)
    nz = np.empty(N, dtype=np.float32)
    while p < end:
        _gptq_scales(scales, zeros, zoff, table[p, 2], 0, N, sc, nz)
        for c in range(N):
            nz[c] = -nz[c] * sc[c]
        p = _run(qweight, table, xidx, p, end, x, xb, sc, nz, out)


@njit(cache=True, parallel=True, fastmath=_FM)
def gptq_gemv(x, qweight, scales, zeros, zoff, table, xidx, bounds, y):
    """y[M, N] (float32, overwritten) = x[M, K] (float32) @ W of a GPTQ layer.

    ``qweight`` uint32 [K * b / 32, N], ``scales`` uint16 [G, N] (fp16 bits), ``zeros`` uint8 [G, N] (stored zero
    fields; the zero point is field + ``zoff``, float32: 1 for v1 zeros, 0 for v2); ``table`` / ``xidx`` /
    ``bounds`` as for ``exl2_gemv`` (of ``gptq_pieces``).
    """
    T = bounds.shape[0] - 1
    y[:] = 0
    if T == 1:
        _gptq_chunk(x, qweight, scales, zeros, zoff, table, xidx, bounds[0], bounds[1], y)
        return
    part = np.zeros((T, y.shape[0], y.shape[1]), dtype=np.float32)
    for t in prange(T):
        _gptq_chunk(x, qweight, scales, zeros, zoff, table, xidx, bounds[t], bounds[t + 1], part[t])
    _sum_parts(part, y)


# --- many rows: weights into a scratch tile -------------------------------------------------------------------------

def decode_block(N: int) -> int:
    """Columns per pass of the row decoders: the scales of a block stay in L1, rows are written in 4 KiB runs."""
    return min(N, 1024)


@njit(cache=True, fastmath=_FM)
def _decode_row(qw, wi, sh, b, n0, w, sc, zr, out):
    """out[n0 + c] = fp16(sc[c] * (v - zr[c])) for c < w, v the b-bit code at (word wi, shift sh) of column
    n0 + c."""
    mask = (1 << b) - 1
    r0 = qw[wi]
    if sh + b <= 32:
        for c in range(w):
            out[n0 + c] = _round16(sc[c] * (_field(r0[n0 + c], sh, mask) - zr[c]))
    else:
        r1 = qw[wi + 1]
        for c in range(w):
            out[n0 + c] = _round16(sc[c] * (_field2(r0[n0 + c], r1[n0 + c], sh, mask) - zr[c]))


@njit(cache=True, fastmath=_FM)
def exl2_decode_rows(q_weight, q_scale, qsm_bits, tab, k0, k1, block, out):
    """out[k - k0, n] = W[k, n] (float32 [k1 - k0, N], stored row order) for k0 <= k < k1; ``tab`` is
    ``exl2_row_table``; ``block`` columns per pass (``decode_block``).  Runs on the calling thread (no parallel
    region); the BLAS product that follows is the larger part of a prefill."""
    N = out.shape[1]
    for bi in range((N + block - 1) // block):
        n0 = bi * block
        w = min(block, N - n0)
        sc = np.empty(w, dtype=np.float32)
        zr = np.empty(w, dtype=np.float32)
        k = k0
        while k < k1:
            g = tab[k, 2]
            _exl2_scales(q_scale, qsm_bits, g, n0, w, sc)
            zr[:] = np.float32(1 << (tab[k, 3] - 1))
            while k < k1 and tab[k, 2] == g:
                _decode_row(q_weight, tab[k, 0], tab[k, 1], tab[k, 3], n0, w, sc, zr, out[k - k0])
                k += 1


@njit(cache=True, fastmath=_FM)
def gptq_decode_rows(qweight, scales, zeros, zoff, tab, k0, k1, block, out):
    """As ``exl2_decode_rows`` for a GPTQ layer (``gptq_row_table``; rows of any group order)."""
    N = out.shape[1]
    G = scales.shape[0]
    for bi in range((N + block - 1) // block):
        n0 = bi * block
        w = min(block, N - n0)
        sc = np.empty((G, w), dtype=np.float32)
        zr = np.empty((G, w), dtype=np.float32)
        for g in range(G):
            _gptq_scales(scales, zeros, zoff, g, n0, w, sc[g], zr[g])
        for k in range(k0, k1):
            g = tab[k, 2]
            _decode_row(qweight, tab[k, 0], tab[k, 1], tab[k, 3], n0, w, sc[g], zr[g], out[k - k0])


def threads() -> int:
    """Numba's thread count (what the gemv kernels split their work into)."""
    return numba.get_num_threads()
