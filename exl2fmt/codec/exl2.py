"""Numba reference codecs for EXL2 (spec/exl2.md sections 3-5).

Every public function is pure: arrays in, new arrays out, no I/O.  Argument contracts:

* ``codes``      uint8 [K, N_pad], C order: integer code of stored row k, column n, in [0, 2^b_g).
* ``q_weight``   int32 [Q, N_pad], C order: packed codes (``pack_q_weight`` layout).
* ``q_scale``    int32 [G, N_pad/8], C order: 4-bit scale codes c, column 8m+i in bits [4i, 4i+4) of word m.
* ``scale_codes`` uint8 [G, N_pad]: the codes c in [0, 15] (c = upstream qscale - 1).
* ``q_scale_max`` float16 [G].
* ``q_invperm``  int32 [K]: stored row of original input feature j.
* ``groups``     a ``GroupTable`` (``exl2fmt.groups``) describing bits and rows of each group.

The slow NumPy twins in ``exl2fmt.codec.oracle`` define the same functions the obvious way; tests assert
the two agree bit for bit.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..groups import GroupTable
from ..layout import BIT_WIDTHS
from .f16 import f16_bits_to_f32, f32_to_f16_bits
from .outbuf import empty_aligned, is_reused

__all__ = [
    "pack_q_weight", "unpack_q_weight", "pack_q_scale", "unpack_q_scale", "dequantize",
    "dequantize_stored", "invert_permutation", "is_permutation", "transpose_store", "empty_aligned", "NT_STORES",
    "store_fence",
]

# Per-width constants indexed by bit width (0 where undefined); kept as arrays for Numba.
_UNIT_ROWS = np.zeros(9, dtype=np.int64)
_UNIT_WORDS = np.zeros(9, dtype=np.int64)
for _b, _w in BIT_WIDTHS.items():
    _UNIT_ROWS[_b] = _w.rows_per_unit
    _UNIT_WORDS[_b] = _w.words_per_unit


def _unit_table(groups: GroupTable):
    """Flatten groups into packing units: (bits, first stored row, first packed row) per unit."""
    ub, ur, uq = [], [], []
    for b, r0, q0, rows in zip(groups.bits.tolist(), groups.row_start.tolist(), groups.qrow.tolist(),
                               groups.rows.tolist()):
        U = int(_UNIT_ROWS[b])
        W = int(_UNIT_WORDS[b])
        n = rows // U
        ub.extend([b] * n)
        ur.extend(range(r0, r0 + n * U, U))
        uq.extend(range(q0, q0 + n * W, W))
    return (np.asarray(ub, dtype=np.int64), np.asarray(ur, dtype=np.int64), np.asarray(uq, dtype=np.int64))


# ----------------------------------------------------------------------------------------------
# q_weight
# ----------------------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _pack_units(codes, ubits, urow, uqrow, unit_rows, unit_words, out):
    n_cols = codes.shape[1]
    for u in prange(ubits.shape[0]):
        b = ubits[u]
        U = unit_rows[b]
        W = unit_words[b]
        r0 = urow[u]
        q0 = uqrow[u]
        for w in range(W):
            for n in range(n_cols):
                out[q0 + w, n] = 0
        for t in range(U):
            pos = t * b
            w = pos >> 5
            s = pos & 31
            spill = s + b > 32
            for n in range(n_cols):
                v = np.uint32(codes[r0 + t, n])
                out[q0 + w, n] |= v << np.uint32(s)
                if spill:
                    out[q0 + w + 1, n] |= v >> np.uint32(32 - s)


@njit(cache=True, parallel=True)
def _unpack_units(q_weight_u32, ubits, urow, uqrow, unit_rows, out):
    n_cols = q_weight_u32.shape[1]
    for u in prange(ubits.shape[0]):
        b = ubits[u]
        U = unit_rows[b]
        r0 = urow[u]
        q0 = uqrow[u]
        mask = np.uint32((1 << b) - 1)
        for t in range(U):
            pos = t * b
            w = pos >> 5
            s = pos & 31
            spill = s + b > 32
            for n in range(n_cols):
                v = q_weight_u32[q0 + w, n] >> np.uint32(s)
                if spill:
                    v |= q_weight_u32[q0 + w + 1, n] << np.uint32(32 - s)
                out[r0 + t, n] = np.uint8(v & mask)


def _check_groups_fit(groups: GroupTable, K: int, what: str) -> None:
    if groups.K != K:
        raise ValueError(f"{what}: groups cover {groups.K} rows but the array has {K}")
    units = _UNIT_ROWS[np.asarray(groups.bits, dtype=np.int64)]   # one vector test: called on every decode
    bad = np.flatnonzero((units == 0) | (np.asarray(groups.rows, dtype=np.int64) % np.maximum(units, 1) != 0))
    if bad.size:
        g = int(bad[0])
        b, r = int(groups.bits[g]), int(groups.rows[g])
        raise ValueError(f"{what}: group {g} has {r} rows, not a multiple of the {b}-bit unit "
                         f"({int(_UNIT_ROWS[b])} rows)")


def pack_q_weight(codes: np.ndarray, groups: GroupTable) -> np.ndarray:
    """Pack integer codes into ``q_weight``.

    ``codes``: uint8 (or any integer dtype) [K, N_pad], stored row order; group g's rows must lie in
    [0, 2^bits_g).  Returns int32 [Q, N_pad].  Raises ValueError on out-of-range codes or a bad group table.

    Example (one column, 4 bits): codes 0,1,...,7 -> word 0x76543210.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [K, N_pad], got shape {codes.shape}")
    _check_groups_fit(groups, codes.shape[0], "pack_q_weight")
    if codes.size:
        for g, (b, r0, r) in enumerate(zip(groups.bits.tolist(), groups.row_start.tolist(), groups.rows.tolist())):
            blk = codes[r0:r0 + r]
            if blk.size and (int(blk.max()) >= (1 << b) or int(blk.min()) < 0):
                raise ValueError(f"pack_q_weight: group {g} ({b} bits) has codes outside [0, {(1 << b) - 1}]")
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.empty((groups.Q, codes.shape[1]), dtype=np.uint32)
    ub, ur, uq = _unit_table(groups)
    if ub.size:
        _pack_units(codes, ub, ur, uq, _UNIT_ROWS, _UNIT_WORDS, out)
    return out.view(np.int32)


def unpack_q_weight(q_weight: np.ndarray, groups: GroupTable) -> np.ndarray:
    """Inverse of ``pack_q_weight``: int32 [Q, N_pad] -> uint8 codes [K, N_pad] in stored row order."""
    q_weight = np.asarray(q_weight)
    if q_weight.ndim != 2 or q_weight.shape[0] != groups.Q:
        raise ValueError(f"unpack_q_weight: q_weight shape {q_weight.shape} does not have {groups.Q} packed rows")
    qw = np.ascontiguousarray(q_weight).view(np.uint32)
    out = np.empty((groups.K, q_weight.shape[1]), dtype=np.uint8)
    ub, ur, uq = _unit_table(groups)
    if ub.size:
        _unpack_units(qw, ub, ur, uq, _UNIT_ROWS, out)
    return out


# ----------------------------------------------------------------------------------------------
# q_scale
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _pack_rows4(codes, out):
    G, M = out.shape
    for g in range(G):
        for m in range(M):
            acc = np.uint32(0)
            for i in range(8):
                acc |= np.uint32(codes[g, 8 * m + i]) << np.uint32(4 * i)
            out[g, m] = acc


@njit(cache=True)
def _unpack_rows4(q_scale_u32, out):
    G, M = q_scale_u32.shape
    for g in range(G):
        for m in range(M):
            word = q_scale_u32[g, m]
            for i in range(8):
                out[g, 8 * m + i] = np.uint8((word >> np.uint32(4 * i)) & np.uint32(15))


def pack_q_scale(scale_codes: np.ndarray) -> np.ndarray:
    """uint8 [G, N_pad] codes c in [0, 15] -> ``q_scale`` int32 [G, N_pad/8].

    Example: codes 0,1,...,7 in one row -> word 0x76543210.
    """
    c = np.asarray(scale_codes)
    if c.ndim != 2 or c.shape[1] % 8:
        raise ValueError(f"scale codes must be [G, N_pad] with N_pad a multiple of 8, got {c.shape}")
    if c.size and (int(c.max()) > 15 or int(c.min()) < 0):
        raise ValueError("scale codes must lie in [0, 15]")
    out = np.empty((c.shape[0], c.shape[1] // 8), dtype=np.uint32)
    _pack_rows4(np.ascontiguousarray(c, dtype=np.uint8), out)
    return out.view(np.int32)


def unpack_q_scale(q_scale: np.ndarray) -> np.ndarray:
    """``q_scale`` int32 [G, N_pad/8] -> uint8 codes [G, N_pad]."""
    q = np.ascontiguousarray(q_scale)
    if q.ndim != 2:
        raise ValueError(f"q_scale must be 2-D, got shape {q.shape}")
    out = np.empty((q.shape[0], q.shape[1] * 8), dtype=np.uint8)
    _unpack_rows4(q.view(np.uint32), out)
    return out


# ----------------------------------------------------------------------------------------------
# permutations
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _invert(perm, out):
    n = perm.shape[0]
    for i in range(n):
        out[i] = -1
    for i in range(n):
        p = perm[i]
        if p < 0 or p >= n or out[p] != -1:
            return i
        out[p] = i
    return -1


def invert_permutation(perm: np.ndarray) -> np.ndarray:
    """Inverse of a permutation of 0..K-1 (int array [K]) as int32 [K]; q_perm <-> q_invperm.

    Raises ValueError naming the first position where ``perm`` stops being a permutation.
    """
    p = np.ascontiguousarray(perm).astype(np.int64, copy=False)
    out = np.empty(p.shape[0], dtype=np.int64)
    bad = _invert(p, out)
    if bad >= 0:
        raise ValueError(f"not a permutation: entry {bad} = {int(p[bad])} is out of range or repeated")
    return out.astype(np.int32)


def is_permutation(perm: np.ndarray) -> bool:
    p = np.ascontiguousarray(perm).astype(np.int64, copy=False)
    return _invert(p, np.empty(p.shape[0], dtype=np.int64)) < 0


# ----------------------------------------------------------------------------------------------
# dequantization
# ----------------------------------------------------------------------------------------------
#
# Why the code looks like this (numbers: bench/bench_codec.py, section "Format core codecs" of
# bench/RESULTS.md).  ``dequantize`` computes W[n, j] = w(q_invperm[j], n): q_weight is laid out along n
# (its columns) while W is written along j, in the order of a random permutation, so the job is an
# un-permuting *transpose* of 16-bit values; done one element at a time (the first version of this
# module) the gather took several times as long as the arithmetic.  Each parallel work item therefore owns a tile of _TILE_COLS output rows (q_weight columns)
# and does:
#
# 1. copy the tile's columns of q_weight into a contiguous buffer qt [Q, _TILE_COLS].  Reading q_weight in
#    place is an order of magnitude slower: its rows are 4 * N_pad bytes apart, so all the words of a tile
#    compete for a few cache sets, and the decode below visits them in random order;
# 2. decode _JROWS input features j at a time *in original order* into tmp [_JROWS, _TILE_COLS] (fp16
#    bits), driven by a per-feature table (packed row, shift, group, bits) built once per call
#    (_feature_table): every feature is one vectorised pass over the tile's columns;
# 3. transpose tmp in 32 x 32 blocks held in vector registers (transpose_store) and write W in 64-byte
#    row segments.  (Non-temporal stores were tried: they halve the kernel's time into an existing buffer,
#    but dequantize always writes a fresh array, whose lines the kernel has just zeroed into the cache on
#    the page faults, and there plain stores are as fast or faster.)
#
# ``dequantize_stored`` has no transpose to do and simply runs along the rows of q_weight and of its output.

_NPAD_MULTIPLE = 32  # N_pad is a multiple of this (EXL2 layout rule)
_TILE_COLS = 64  # output rows (q_weight columns) per parallel work item; qt = Q x 256 bytes stays in L2
_BLOCK = 32  # side of the square blocks transposed in registers: a row of 32 fp16 is one 64-byte line
_JROWS = 256  # features decoded per pass: tmp = 256 x 64 fp16 = 32 KiB, and each row of W gets 512-byte
#               runs per pass (measured: 128 is ~3% slower, 512 no better)

_UNIT_ROWS_C = tuple(int(x) for x in _UNIT_ROWS)
_UNIT_WORDS_C = tuple(int(x) for x in _UNIT_WORDS)


def _int32_shift(op):
    @intrinsic
    def shift(typingctx, x, s):
        """32-bit ``x op s`` for 0 <= s < 32.  Numba widens uint32 shifts to 64 bits, which halves the
        vector width of the decode loop; this emits the i32 shift itself."""
        if not isinstance(x, types.Integer) or not isinstance(s, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            a, b = ((builder.trunc(v, i32) if t.bitwidth > 32 else builder.zext(v, i32) if t.bitwidth < 32 else v)
                    for v, t in zip(args, signature.args))
            return getattr(builder, op)(a, b)

        return types.uint32(x, s), codegen

    return shift


_lshr32 = _int32_shift("lshr")
_shl32 = _int32_shift("shl")


def _is_c_array(t, ndim) -> bool:
    return isinstance(t, types.Array) and t.ndim == ndim and t.layout == "C"


@intrinsic
def _copy_row(typingctx, dst, drow, src, srow, scol):
    """dst[drow, 0:_TILE_COLS] = src[srow, scol:scol + _TILE_COLS] as one fixed-size memcpy.

    A plain Numba loop gets fully unrolled into scalar moves (LLVM cannot prove dst and src disjoint);
    the memcpy becomes a few 64-byte vector moves.  Both arrays 2-D, C order, same dtype; no bounds check.
    """
    if not (_is_c_array(dst, 2) and _is_c_array(src, 2) and dst.dtype == src.dtype):
        return None
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, dr, s, sr, sc = args
        da = context.make_array(signature.args[0])(context, builder, d)
        sa = context.make_array(signature.args[2])(context, builder, s)
        dp = builder.gep(da.data, [builder.mul(dr, builder.extract_value(da.shape, 1))])
        sp = builder.gep(sa.data, [builder.add(builder.mul(sr, builder.extract_value(sa.shape, 1)), sc)])
        itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        cgutils.raw_memcpy(builder, dp, sp, ir.Constant(ir.IntType(64), _TILE_COLS), itemsize)
        return context.get_dummy_value()

    return sig, codegen


def _transpose_program(rows, shuffle):
    """Transpose a 32 x 32 matrix of 16-bit values given as 32 row vectors; returns the 32 column vectors.

    ``shuffle(a, b, mask)`` picks lanes of the concatenation a ++ b (LLVM shufflevector semantics).  First
    every 128-bit lane (8 values) of 8 rows is transposed as an 8 x 8 block with the interleave patterns
    x86 calls unpck{l,h}{wd,dq,qdq} (Arm: zip1/zip2); then the 4 x 4 grid of 128-bit lanes is transposed.
    The patterns are pure data movement, so the result is exact whatever instructions LLVM picks.
    """
    n, lane = _BLOCK, 8
    n_lanes = n // lane

    def interleave(a, b, width, high):
        # elements `width` at a time from the low (or high) half of each 128-bit lane of a, then of b
        mask = []
        for ln in range(n_lanes):
            base = ln * lane + (lane // 2 if high else 0)
            for k in range(0, lane // 2, width):
                mask += [base + k + e for e in range(width)] + [n + base + k + e for e in range(width)]
        return shuffle(a, b, mask)

    cols = [None] * n
    for g in range(0, n, 8):
        r = rows[g:g + 8]
        t = [interleave(r[i], r[i + 1], 1, h) for i in (0, 2, 4, 6) for h in (0, 1)]
        u = [interleave(t[i], t[i + 2], 2, h) for i in (0, 1, 4, 5) for h in (0, 1)]
        v = [interleave(u[i], u[i + 4], 4, h) for i in (0, 1, 2, 3) for h in (0, 1)]
        for c in range(8):
            cols[g + c] = v[c]  # lane ln holds column 8 ln + c of rows g .. g + 7
    out = [None] * n
    for c in range(8):
        w = [cols[8 * gi + c] for gi in range(n_lanes)]  # w[gi] lane ln: rows 8 gi.., column 8 ln + c
        h = n_lanes // 2
        while h:  # swap the off-diagonal blocks of lanes at distance h
            lo = [(ln * lane if not ln & h else n + (ln - h) * lane) + e for ln in range(n_lanes) for e in range(lane)]
            hi = [((ln + h) * lane if not ln & h else n + ln * lane) + e for ln in range(n_lanes) for e in range(lane)]
            for i in range(n_lanes):
                if not i & h:
                    w[i], w[i + h] = shuffle(w[i], w[i + h], lo), shuffle(w[i], w[i + h], hi)
            h //= 2
        for ln in range(n_lanes):
            out[8 * ln + c] = w[ln]
    return out


@intrinsic
def transpose_store(typingctx, src, srow, scol, dst, row0, col0):
    """dst[row0 + c, col0 + r] = src[srow + r, scol + c] for r, c < 32 (uint16, 2-D, C order).

    32 row loads of 64 bytes, the shuffles of _transpose_program, 32 row stores of 64 bytes; no bounds check.
    Numba has no vector types, and LLVM does not turn the equivalent scalar loops into shuffles.
    """
    if not (_is_c_array(src, 2) and _is_c_array(dst, 2) and src.dtype == types.uint16
            and dst.dtype == types.uint16):
        return None
    sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        return _transpose_store_codegen(context, builder, signature, args, nontemporal=False)

    return sig, codegen


def _transpose_store_codegen(context, builder, signature, args, *, nontemporal: bool):
    src_v, srow_v, scol_v, dst_v, row0_v, col0_v = args
    sa = context.make_array(signature.args[0])(context, builder, src_v)
    da = context.make_array(signature.args[3])(context, builder, dst_v)
    i64 = ir.IntType(64)
    vec = ir.VectorType(ir.IntType(16), _BLOCK).as_pointer()
    s_cols = builder.extract_value(sa.shape, 1)
    d_cols = builder.extract_value(da.shape, 1)
    rows = []
    for r in range(_BLOCK):
        off = builder.add(builder.mul(builder.add(srow_v, ir.Constant(i64, r)), s_cols), scol_v)
        ld = builder.load(builder.bitcast(builder.gep(sa.data, [off]), vec))
        ld.align = 2
        rows.append(ld)
    mask_t = ir.VectorType(ir.IntType(32), _BLOCK)
    cols = _transpose_program(rows, lambda a, b, m: builder.shuffle_vector(a, b, ir.Constant(mask_t, m)))
    nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]) if nontemporal else None
    for c in range(_BLOCK):
        off = builder.add(builder.mul(builder.add(row0_v, ir.Constant(i64, c)), d_cols), col0_v)
        st = builder.store(cols[c], builder.bitcast(builder.gep(da.data, [off]), vec))
        if nt is None:
            st.align = 2
        else:
            st.align = _NT_ALIGN
            st.set_metadata("nontemporal", nt)
    return context.get_dummy_value()


# Non-temporal stores (x86: movntdq) write whole lines straight to memory, without first reading each line
# of the output into the cache (the read-for-ownership a plain store costs).  They are weakly ordered, so
# each work item ends with an sfence.  Other targets get plain stores.
NT_STORES = platform.machine().lower() in ("x86_64", "amd64")
_NT_ALIGN = 32  # the NT path needs the output's rows to start on 32-byte boundaries (one ymm store)


@intrinsic
def _transpose_store_nt(typingctx, src, srow, scol, dst, row0, col0):
    """``transpose_store`` with non-temporal stores; ``dst``'s 64-byte row segments must be 32-byte aligned."""
    if not (_is_c_array(src, 2) and _is_c_array(dst, 2) and src.dtype == types.uint16
            and dst.dtype == types.uint16):
        return None
    sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        return _transpose_store_codegen(context, builder, signature, args, nontemporal=NT_STORES)

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """sfence on x86 (orders the non-temporal stores before the work item ends); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if NT_STORES:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse.sfence")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True)
def _feature_table(gbits, grow0, gqrow, grows, rows, tab):
    """tab[i] = (packed row, bit shift, group, bits) of stored row rows[i]; tab int64 [len(rows), 4]."""
    K = grows.sum()
    by_row = np.empty((K, 4), dtype=np.int64)
    for g in range(gbits.shape[0]):
        b = gbits[g]
        U = _UNIT_ROWS_C[b]
        W = _UNIT_WORDS_C[b]
        for i in range(grows[g]):
            u = i // U
            pos = (i - u * U) * b  # bit offset of the value in its unit
            k = grow0[g] + i
            by_row[k, 0] = gqrow[g] + u * W + (pos >> 5)
            by_row[k, 1] = pos & 31
            by_row[k, 2] = g
            by_row[k, 3] = b
    for i in range(rows.shape[0]):
        for f in range(4):
            tab[i, f] = by_row[rows[i], f]


@njit(cache=True)
def _load_tile(q_weight_u32, q_scale_u32, qsm_bits, gbits, n0, qt, scale):
    """Step 1: qt[:, c] = q_weight[:, n0 + c] and scale[g, c] = s(g, n0 + c); columns past N_pad are 0."""
    Q, n_pad = q_weight_u32.shape
    T = _TILE_COLS
    width = min(T, n_pad - n0)
    if width == T:
        for r in range(Q):
            _copy_row(qt, r, q_weight_u32, r, n0)
    else:
        for r in range(Q):
            for c in range(T):
                qt[r, c] = q_weight_u32[r, n0 + c] if c < width else np.uint32(0)
    for g in range(gbits.shape[0]):
        # m = fp16(q_scale_max * 2^-8); s = fp16(fp16((c+1)^2) * m)
        m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm_bits[g]) * np.float32(0.00390625)))
        for c in range(T):
            n = n0 + c
            if c < width:
                code = (q_scale_u32[g, n >> 3] >> np.uint32(4 * (n & 7))) & np.uint32(15)
                f = np.float32((code + 1) * (code + 1))
                scale[g, c] = f16_bits_to_f32(f32_to_f16_bits(f * m))
            else:
                scale[g, c] = np.float32(0)


@njit(cache=True)
def _decode_features(qt, scale, tab, j0, jn, tmp):
    """Step 2: tmp[i, c] = fp16 bits of w(feature j0 + i, column c) for i < jn, from the tile in qt.

    w = fp16(fp16(q - 2^(b-1)) * s): q - 2^(b-1) is exact in float32 and a product of it with an fp16
    scale is exact in float32, so one rounding to fp16 at the end reproduces the fp16 arithmetic.
    The inner loop runs over the tile's _TILE_COLS columns (a compile-time trip count): contiguous loads
    and stores, vectorised by LLVM.
    """
    T = _TILE_COLS
    for i in range(jn):
        w = tab[j0 + i, 0]
        sh = tab[j0 + i, 1]
        g = tab[j0 + i, 2]
        b = tab[j0 + i, 3]
        mask = np.uint32((1 << b) - 1)
        z = np.float32(1 << (b - 1))
        if sh + b > 32:
            # the value straddles two words: low bits from word w, high bits from word w + 1
            sh2 = 32 - sh
            for c in range(T):
                v = np.int32((_lshr32(qt[w, c], sh) | _shl32(qt[w + 1, c], sh2)) & mask)
                tmp[i, c] = f32_to_f16_bits((np.float32(v) - z) * scale[g, c])
        else:
            for c in range(T):
                v = np.int32(_lshr32(qt[w, c], sh) & mask)
                tmp[i, c] = f32_to_f16_bits((np.float32(v) - z) * scale[g, c])


@njit(cache=True)
def _store_transposed(tmp, jn, out, n0, n_rows, j0, nontemporal):
    """Step 3: out[n0 + c, j0 + i] = tmp[i, c] for c < n_rows, i < jn; whole 32 x 32 blocks in registers
    (``nontemporal``: with non-temporal stores; the caller checked the alignment)."""
    full = jn // _BLOCK * _BLOCK
    for cb in range(0, n_rows, _BLOCK):
        if cb + _BLOCK <= n_rows:
            if nontemporal:
                for jb in range(0, full, _BLOCK):
                    _transpose_store_nt(tmp, jb, cb, out, n0 + cb, j0 + jb)
            else:
                for jb in range(0, full, _BLOCK):
                    transpose_store(tmp, jb, cb, out, n0 + cb, j0 + jb)
            c1, i0 = cb + _BLOCK, full  # only the features past the last whole block are left
        else:
            c1, i0 = n_rows, 0  # a partial block of rows (out_features not a multiple of 32)
        for c in range(cb, c1):
            for i in range(i0, jn):
                out[n0 + c, j0 + i] = tmp[i, c]


@njit(cache=True, parallel=True)
def _dequant_linear(q_weight_u32, q_scale_u32, qsm_bits, gbits, tab, n_out, out, nontemporal):
    K = tab.shape[0]
    n_tiles = (n_out + _TILE_COLS - 1) // _TILE_COLS
    for ti in prange(n_tiles):
        n0 = ti * _TILE_COLS
        qt = np.empty((q_weight_u32.shape[0], _TILE_COLS), dtype=np.uint32)
        scale = np.empty((gbits.shape[0], _TILE_COLS), dtype=np.float32)
        tmp = np.empty((_JROWS, _TILE_COLS), dtype=np.uint16)
        _load_tile(q_weight_u32, q_scale_u32, qsm_bits, gbits, n0, qt, scale)
        n_rows = min(_TILE_COLS, n_out - n0)
        for j0 in range(0, K, _JROWS):
            jn = min(_JROWS, K - j0)
            _decode_features(qt, scale, tab, j0, jn, tmp)
            _store_transposed(tmp, jn, out, n0, n_rows, j0, nontemporal)
        if nontemporal:
            store_fence()


@njit(cache=True, parallel=True)
def _dequant_stored(q_weight_u32, q_scale_u32, qsm_bits, gbits, grow0, gqrow, grows, out):
    """Stored order needs no transpose: each group's rows are decoded along whole rows of q_weight and
    out (both contiguous), one parallel work item per group."""
    n_pad = out.shape[1]
    for g in prange(gbits.shape[0]):
        b = gbits[g]
        z = np.float32(1 << (b - 1))
        mask = np.uint32((1 << b) - 1)
        m = f16_bits_to_f32(f32_to_f16_bits(f16_bits_to_f32(qsm_bits[g]) * np.float32(0.00390625)))
        scale = np.empty(n_pad, dtype=np.float32)
        for n in range(n_pad):
            code = (q_scale_u32[g, n >> 3] >> np.uint32(4 * (n & 7))) & np.uint32(15)
            f = np.float32((code + 1) * (code + 1))
            scale[n] = f16_bits_to_f32(f32_to_f16_bits(f * m))
        U = _UNIT_ROWS_C[b]
        W = _UNIT_WORDS_C[b]
        for u in range(grows[g] // U):
            for t in range(U):
                pos = t * b
                w = gqrow[g] + u * W + (pos >> 5)
                sh = pos & 31
                k = grow0[g] + u * U + t
                if sh + b > 32:
                    sh2 = 32 - sh
                    for n in range(n_pad):
                        v = np.int32((_lshr32(q_weight_u32[w, n], sh) | _shl32(q_weight_u32[w + 1, n], sh2)) & mask)
                        out[k, n] = f32_to_f16_bits((np.float32(v) - z) * scale[n])
                else:
                    for n in range(n_pad):
                        v = np.int32(_lshr32(q_weight_u32[w, n], sh) & mask)
                        out[k, n] = f32_to_f16_bits((np.float32(v) - z) * scale[n])


def _common_args(q_weight, q_scale, q_scale_max, groups: GroupTable):
    q_weight = np.ascontiguousarray(q_weight)
    q_scale = np.ascontiguousarray(q_scale)
    qsm = np.ascontiguousarray(q_scale_max)
    if q_weight.dtype != np.int32 or q_weight.ndim != 2:
        raise ValueError(f"q_weight must be int32 [Q, N_pad], got {q_weight.dtype} {q_weight.shape}")
    n_pad = q_weight.shape[1]
    if n_pad % _NPAD_MULTIPLE:
        raise ValueError(f"q_weight has {n_pad} columns; N_pad must be a multiple of {_NPAD_MULTIPLE}")
    if q_weight.shape[0] != groups.Q:
        raise ValueError(f"q_weight has {q_weight.shape[0]} rows; the groups need {groups.Q}")
    if q_scale.dtype != np.int32 or q_scale.shape != (groups.G, n_pad // 8):
        raise ValueError(f"q_scale must be int32 {(groups.G, n_pad // 8)}, got {q_scale.dtype} {q_scale.shape}")
    if qsm.dtype != np.float16 or qsm.shape != (groups.G,):
        raise ValueError(f"q_scale_max must be float16 ({groups.G},), got {qsm.dtype} {qsm.shape}")
    _check_groups_fit(groups, groups.K, "dequantize")
    return (q_weight.view(np.uint32), q_scale.view(np.uint32), qsm.view(np.uint16),
            groups.bits.astype(np.int64), groups.row_start.astype(np.int64), groups.qrow.astype(np.int64),
            groups.rows.astype(np.int64))


def _features(args, rows: np.ndarray) -> np.ndarray:
    """The per-feature decode table (see _feature_table) for stored rows ``rows`` (int64)."""
    tab = np.empty((rows.shape[0], 4), dtype=np.int64)
    if rows.shape[0]:
        _feature_table(args[3], args[4], args[5], args[6], rows, tab)
    return tab



def dequantize(q_weight: np.ndarray, q_scale: np.ndarray, q_scale_max: np.ndarray, groups: GroupTable,
               q_invperm: np.ndarray, out_features: int | None = None, *, out: np.ndarray | None = None) -> np.ndarray:
    """Full dequantization to the ``nn.Linear`` weight: float16 [out_features, K], C order.

    Bit-exact with ExLlamaV2's reconstruction: m = fp16(q_scale_max/256), s = fp16(fp16((c+1)^2) * m),
    w = fp16(fp16(q - 2^(b-1)) * s), then W[q_perm[k], n] = w(k, n) and the N padding is dropped
    (``out_features`` defaults to N_pad).  ``q_invperm`` must be a permutation (checked).

    ``out``: optional float16 [out_features, K], C order, writable, sharing no memory with the inputs: the
    result is written there and ``out`` is returned.  A caller that decodes layer after layer into one buffer
    so pays no page faults of a fresh output (bench/bench_codec.py measures both).
    """
    args = _common_args(q_weight, q_scale, q_scale_max, groups)
    n_pad = q_weight.shape[1]
    n_out = n_pad if out_features is None else int(out_features)
    if not (0 <= n_out <= n_pad):
        raise ValueError(f"out_features {n_out} must lie in [0, N_pad={n_pad}]")
    inv = np.ascontiguousarray(q_invperm).astype(np.int64, copy=False)
    if inv.shape != (groups.K,) or not is_permutation(inv):
        raise ValueError(f"q_invperm must be a permutation of 0..{groups.K - 1}")
    if out is None:
        res = empty_aligned((n_out, groups.K))
    else:
        if not (isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == (n_out, groups.K)
                and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"out must be a writable C-order float16 array of shape {(n_out, groups.K)}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        res = out.view(np.uint16)
    # non-temporal stores only into a caller's buffer or a reused output mapping (codec.outbuf): a fresh output's
    # pages are zeroed into the cache by their first-touch faults, and streaming past those lines writes each one
    # twice (measured: bench/RESULTS.md, 2026-12-03, and "Figures moved out of code comments")
    nontemporal = ((out is not None or is_reused(res)) and NT_STORES and res.ctypes.data % _NT_ALIGN == 0
                   and (groups.K * 2) % _NT_ALIGN == 0)
    if n_out and groups.K:
        _dequant_linear(*args[:4], _features(args, inv), n_out, res, nontemporal)
    return res.view(np.float16) if out is None else out


def dequantize_stored(q_weight: np.ndarray, q_scale: np.ndarray, q_scale_max: np.ndarray,
                      groups: GroupTable) -> np.ndarray:
    """Dequantize without un-permuting: float16 [K, N_pad] in stored row order (what kernels see)."""
    args = _common_args(q_weight, q_scale, q_scale_max, groups)
    out = np.empty((groups.K, q_weight.shape[1]), dtype=np.uint16)
    if out.size:
        _dequant_stored(*args, out)
    return out.view(np.float16)
