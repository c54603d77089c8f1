"""The device code of the EXL2 Triton kernels: the layout constants they are specialised on (checked against
``exl2fmt.layout`` at import), the ``@triton.jit`` helpers and the four kernels (``dequant_kernel``,
``matmul_kernel``, ``prep_kernel``, ``finalize_kernel``).  The host side - tables, checks, launches, the paths -
and the whole story of the layout and the arithmetic are in ``exl2fmt.kernels.exl2_triton``, which imports this
module; import both through ``exl2fmt.kernels.load_triton(device)`` (the interpreter mode is fixed when a
``@triton.jit`` function is created)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import round_out
from ..layout import BIT_WIDTHS, EXL2_BITS, ROW_MULTIPLE, SCALE_CODE_BITS, SCALE_DIVISOR

__all__ = ["BLOCK_ROWS", "LOG_BLOCK_ROWS", "CODES_PER_WORD", "N_SLOTS", "SLOT_BITS", "SLOT_WIDTHS", "LAYOUT_CONSTS",
           "INTERPRETED", "dequant_kernel", "matmul_kernel", "prep_kernel", "finalize_kernel"]

# ---------------------------------------------------------------------------------------------------
# Layout constants the kernels are specialised on (imported, checked, never redefined)
# ---------------------------------------------------------------------------------------------------

#: Rows per block: every group is a multiple of this many stored rows (spec rule G4).
BLOCK_ROWS = ROW_MULTIPLE
#: 4-bit scale codes per int32 word of q_scale.
CODES_PER_WORD = 32 // SCALE_CODE_BITS
#: Number of width slots of the kernels (one loop specialised per width).
N_SLOTS = 6

if len(EXL2_BITS) > N_SLOTS:  # pragma: no cover - a layout change needs a kernel change
    raise RuntimeError(f"exl2fmt.layout.EXL2_BITS has {len(EXL2_BITS)} widths; the kernels have {N_SLOTS} slots")
for _b in EXL2_BITS:
    _bw = BIT_WIDTHS[_b]
    if BLOCK_ROWS % _bw.rows_per_unit or (BLOCK_ROWS * _b) % 32 \
            or (BLOCK_ROWS // _bw.rows_per_unit) * _bw.words_per_unit * 32 \
            != BLOCK_ROWS * _b:  # pragma: no cover
        raise RuntimeError(f"{_b}-bit packing units do not tile a {BLOCK_ROWS}-row block; the kernels assume they do")
if CODES_PER_WORD & (CODES_PER_WORD - 1) or SCALE_DIVISOR & (SCALE_DIVISOR - 1) or BLOCK_ROWS & (BLOCK_ROWS - 1) \
        or max(EXL2_BITS) > 8:  # pragma: no cover
    raise RuntimeError("the kernels assume power-of-two block rows, scale codes per word and scale divisor, and "
                       "at most 8 words per block")
#: log2 of the block rows (number of trailing dims of 2 of a decoded block).
LOG_BLOCK_ROWS = BLOCK_ROWS.bit_length() - 1
#: Width of each kernel slot (0 = unused slot).
SLOT_BITS = tuple(EXL2_BITS) + (0,) * (N_SLOTS - len(EXL2_BITS))
#: log2 of codes per q_scale word, the nibble mask, 1 / SCALE_DIVISOR (a power of two, exact in fp32).
_CPW_SHIFT = CODES_PER_WORD.bit_length() - 1
_CODE_MASK = (1 << SCALE_CODE_BITS) - 1
_INV_DIV = 1.0 / SCALE_DIVISOR

# ---------------------------------------------------------------------------------------------------
# Device helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------------
#
# Block decoding.  A block of ROWS (32) stored rows at width B (a compile-time constant in every kernel: each
# kernel runs one loop per width, over that width's block range) occupies NW = ROWS*B/32 q_weight rows.  Its NW
# words of BLOCK_N columns are loaded once (w0 .. w7, unused ones are dummies) and every row's field is cut out
# with constant shifts; a field that straddles two words joins the top of one with the bottom of the next.  The
# tensor-core and dequantize kernels assemble the ROWS per-row vectors into one [BLOCK_N, 2, .., 2] tensor with a
# binary tree of ``tl.join`` (even rows, odd rows), which keeps them in registers (no shuffles, as long as every
# column has its own thread: BLOCK_N >= 32 * num_warps) and in row order.  The GEMV kernel consumes the rows one
# by one instead (outer products with scalar activations).


@triton.jit
def _code_minus_z(q, hz):
    """fp16(q - z) for codes q (uint32 < 256) without an int->float conversion: the fp16 bit pattern
    0x6400 | q is the number 1024 + q, and (1024 + q) - hz with hz = 1024 + z is exact in fp16."""
    hq = (q | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    return hq - hz


@triton.jit
def _scale_row(qs_ptr, stride_qs, qsm_ptr, g, offs_n, n_mask,
               CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr):
    """fp16 [BLOCK_N] scales of group ``g`` (int32 scalar) for columns ``offs_n``:
    s = fp16(fp16((c+1)^2) * fp16(q_scale_max[g] / SCALE_DIVISOR))."""
    m = (tl.load(qsm_ptr + g).to(tl.float32) * INV_DIV).to(tl.float16)
    word = tl.load(qs_ptr + g.to(tl.int64) * stride_qs + (offs_n >> CPW_SHIFT), mask=n_mask, other=0)
    word = word.to(tl.uint32, bitcast=True)
    sh = ((offs_n & ((1 << CPW_SHIFT) - 1)) * CODE_BITS).to(tl.uint32)
    c = ((word >> sh) & CODE_MASK).to(tl.int32)
    return ((c + 1) * (c + 1)).to(tl.float16) * m


@triton.jit
def _pick(w0, w1, w2, w3, w4, w5, w6, w7, I: tl.constexpr):
    """Word I of the block (compile-time choice, no code)."""
    if I == 0:
        r = w0
    elif I == 1:
        r = w1
    elif I == 2:
        r = w2
    elif I == 3:
        r = w3
    elif I == 4:
        r = w4
    elif I == 5:
        r = w5
    elif I == 6:
        r = w6
    else:
        r = w7
    return r


@triton.jit
def _row_code(w0, w1, w2, w3, w4, w5, w6, w7, T: tl.constexpr, B: tl.constexpr):
    """uint32 [BLOCK_N] codes of block row T: bits [T*B, T*B + B) of the little-endian word string."""
    W: tl.constexpr = (T * B) // 32
    SH: tl.constexpr = (T * B) % 32
    lo = _pick(w0, w1, w2, w3, w4, w5, w6, w7, W)
    if SH + B > 32:  # straddles words W and W+1: low bits at the top of W, high bits at the bottom of W+1
        hi = _pick(w0, w1, w2, w3, w4, w5, w6, w7, W + 1)
        v = (lo >> SH) | (hi << (32 - SH))
    else:
        v = lo >> SH
    return v & ((1 << B) - 1)


@triton.jit
def _weights_tree(w0, w1, w2, w3, w4, w5, w6, w7, s, T0: tl.constexpr, STEP: tl.constexpr, CNT: tl.constexpr,
                  B: tl.constexpr):
    """fp16 weights of the CNT block rows T0, T0 + STEP, T0 + 2*STEP, ... as a [BLOCK_N, 2, .., 2] tensor
    (log2(CNT) trailing dims of 2).  Built by ``tl.join`` of the even and the odd rows, so the trailing dims stay
    in registers and, read row-major, are in row order: reshaped to [BLOCK_N, CNT], column c is row
    T0 + c*STEP.  w = fp16(fp16(q - 2^(B-1)) * s)."""
    if CNT == 1:
        r = _code_minus_z(_row_code(w0, w1, w2, w3, w4, w5, w6, w7, T0, B), 1024 + (1 << (B - 1))) * s
    else:
        a = _weights_tree(w0, w1, w2, w3, w4, w5, w6, w7, s, T0, 2 * STEP, CNT // 2, B)
        b = _weights_tree(w0, w1, w2, w3, w4, w5, w6, w7, s, T0 + STEP, 2 * STEP, CNT // 2, B)
        r = tl.join(a, b)
    return r


@triton.jit
def _block_weights(qw_ptr, stride_qw, qbase, s, offs_n, n_mask, B: tl.constexpr, ROWS: tl.constexpr):
    """fp16 weights of the block whose first q_weight row is ``qbase`` (int32 scalar) as a
    [BLOCK_N, 2, .., 2] tensor (see ``_weights_tree``); ``s`` fp16 [BLOCK_N] its scales.  Each of the block's
    words is loaded once."""
    NW: tl.constexpr = ROWS * B // 32
    p = qw_ptr + qbase.to(tl.int64) * stride_qw + offs_n
    w0 = tl.load(p, mask=n_mask, other=0).to(tl.uint32, bitcast=True)
    w1 = tl.load(p + 1 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 1 else w0
    w2 = tl.load(p + 2 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 2 else w0
    w3 = tl.load(p + 3 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 3 else w0
    w4 = tl.load(p + 4 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 4 else w0
    w5 = tl.load(p + 5 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 5 else w0
    w6 = tl.load(p + 6 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 6 else w0
    w7 = tl.load(p + 7 * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True) if NW > 7 else w0
    return _weights_tree(w0, w1, w2, w3, w4, w5, w6, w7, s, 0, 1, ROWS, B)


@triton.jit
def _index_tree(T0: tl.constexpr, STEP: tl.constexpr, CNT: tl.constexpr):
    """int32 [1, 2, .., 2] block-row numbers laid out like ``_weights_tree``."""
    if CNT == 1:
        r = tl.full([1], T0, tl.int32)
    else:
        r = tl.join(_index_tree(T0, 2 * STEP, CNT // 2), _index_tree(T0 + STEP, 2 * STEP, CNT // 2))
    return r


@triton.jit
def _expand_trailing(x, LOG: tl.constexpr):
    """x[:, None, ..., None] with LOG new trailing dims."""
    for i in tl.static_range(LOG):
        x = tl.expand_dims(x, i + 1)
    return x


@triton.jit
def _slot_range(seg_ptr, SLOT: tl.constexpr, kb0, kb1):
    """[start, end) blocks of the width in SLOT, clipped to this program's blocks [kb0, kb1)."""
    start = tl.maximum(tl.load(seg_ptr + 2 * SLOT), kb0)
    end = tl.minimum(tl.load(seg_ptr + 2 * SLOT + 1), kb1)
    return start, end


@triton.jit
def _gemv_row(acc, v, s, xk_ptrs, m_mask, Z: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] += x_stored[:, k] (outer) w[k, :] with w = fp16(fp16(v - Z) * s), in fp32
    (``v`` uint32 codes [BLOCK_N], ``s`` fp16 scales [BLOCK_N]; ``xk_ptrs`` [BLOCK_M] point at column k of the
    fp32 stored-order activations)."""
    xv = tl.load(xk_ptrs, mask=m_mask, other=0)
    w = (_code_minus_z(v, 1024 + Z) * s).to(tl.float32)
    return acc + xv[:, None] * w[None, :]


@triton.jit
def _gemv_slot(acc, xrow_ptrs, m_mask,
               qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1,
               offs_n, n_mask, B: tl.constexpr, SLOT: tl.constexpr, ROWS: tl.constexpr,
               CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr):
    """CUDA-core path: acc[BLOCK_M, BLOCK_N] += x_block @ W_block over the blocks of width B in [kb0, kb1).

    ``xrow_ptrs`` [BLOCK_M]: rows of the fp32 activations in stored order (made by ``prep_kernel``).
    Each of the block's words is loaded once; its rows are cut out with constant shifts, row by row, and a row
    that straddles words W and W+1 is finished when word W+1 arrives."""
    if B != 0:
        NW: tl.constexpr = ROWS * B // 32
        MASK: tl.constexpr = (1 << B) - 1
        Z: tl.constexpr = 1 << (B - 1)
        start, end = _slot_range(seg_ptr, SLOT, kb0, kb1)
        for blk in range(start, end):
            g = tl.load(blk_group_ptr + blk)
            qbase = tl.load(blk_qrow_ptr + blk)
            s = _scale_row(qs_ptr, stride_qs, qsm_ptr, g, offs_n, n_mask, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
            wptr = qw_ptr + qbase.to(tl.int64) * stride_qw + offs_n
            xk = xrow_ptrs + blk * ROWS
            prev = tl.zeros_like(offs_n).to(tl.uint32)
            for w in tl.static_range(NW):
                cur = tl.load(wptr + w * stride_qw, mask=n_mask, other=0).to(tl.uint32, bitcast=True)
                for t in tl.static_range(ROWS):
                    if (t * B) // 32 == w:
                        if (t * B) % 32 + B <= 32:  # the whole field lies in this word
                            v = (cur >> ((t * B) % 32)) & MASK
                            acc = _gemv_row(acc, v, s, xk + t, m_mask, Z)
                    if (t * B) // 32 + 1 == w:
                        if (t * B) % 32 + B > 32:  # low bits at the top of prev, high bits at the bottom of cur
                            v = ((prev >> ((t * B) % 32)) | (cur << (32 - (t * B) % 32))) & MASK
                            acc = _gemv_row(acc, v, s, xk + t, m_mask, Z)
                prev = cur
    return acc


@triton.jit
def _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r,
              qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1,
              offs_n, n_mask, B: tl.constexpr, SLOT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
              X_BF16: tl.constexpr,
              CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr):
    """Tensor-core path: acc[BLOCK_N, BLOCK_M] += (x_block @ W_block)^T over the blocks of width B in [kb0, kb1).

    The block's weights come as [BLOCK_N, 2, .., 2] (``_block_weights``), reshaped to [BLOCK_N, ROWS] in row
    order; ``x_ptr`` holds the activations in stored order (``prep_kernel``) in x's dtype.  bf16 x goes through
    tf32, which holds bf16 x and fp16 w exactly, like the fp16 x fp16 products."""
    if B != 0:
        start, end = _slot_range(seg_ptr, SLOT, kb0, kb1)
        for blk in range(start, end):
            g = tl.load(blk_group_ptr + blk)
            qbase = tl.load(blk_qrow_ptr + blk)
            s = _scale_row(qs_ptr, stride_qs, qsm_ptr, g, offs_n, n_mask, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
            w = tl.reshape(_block_weights(qw_ptr, stride_qw, qbase, s, offs_n, n_mask, B, ROWS), [BLOCK_N, ROWS])
            xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (blk * ROWS + offs_r)[:, None],
                         mask=m_mask[None, :], other=0)  # [ROWS, BLOCK_M]: x block, transposed
            # acc is y^T [BLOCK_N, BLOCK_M]: the weight tile is the A operand (it can stay in registers)
            if X_BF16:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="tf32")
            else:
                acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t,
                  B: tl.constexpr, SLOT: tl.constexpr, ROWS: tl.constexpr, LOG_ROWS: tl.constexpr,
                  UNPERMUTE: tl.constexpr, OUT_BF16: tl.constexpr,
                  CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr):
    """Write the blocks of width B in [kb0, kb1) to their rows (stored row k, or q_perm[k] when UNPERMUTE).
    ``rows_t`` int32 [1, 2, .., 2]: block-row numbers in the layout of ``_block_weights``."""
    if B != 0:
        start, end = _slot_range(seg_ptr, SLOT, kb0, kb1)
        n_off = _expand_trailing(offs_n.to(tl.int64) * stride_on, LOG_ROWS)
        n_ok = _expand_trailing(n_mask, LOG_ROWS)
        for blk in range(start, end):
            g = tl.load(blk_group_ptr + blk)
            qbase = tl.load(blk_qrow_ptr + blk)
            s = _scale_row(qs_ptr, stride_qs, qsm_ptr, g, offs_n, n_mask, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
            w = _block_weights(qw_ptr, stride_qw, qbase, s, offs_n, n_mask, B, ROWS)  # [BLOCK_N, 2, .., 2]
            k = blk * ROWS + rows_t
            if UNPERMUTE:
                rows = tl.load(perm_ptr + k)
            else:
                rows = k
            optr = out_ptr + rows.to(tl.int64) * stride_ok + n_off
            if OUT_BF16:
                tl.store(optr, round_out(w.to(tl.float32), True), mask=n_ok)
            else:
                tl.store(optr, w, mask=n_ok)


@triton.jit
def _epilogue(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, out_ptr, stride_om, stride_on, ws_ptr, N,
              HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, OUT_BF16: tl.constexpr):
    """Not ATOMIC: out = (acc + bias) rounded to out's dtype.  ATOMIC (K is split): add acc atomically to the
    fp32 workspace [M, N] (row-major); ``finalize_kernel`` then adds the bias and rounds."""
    mask = m_mask[:, None] & n_mask[None, :]
    if not ATOMIC:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
        optr = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(optr, round_out(acc, OUT_BF16), mask=mask)
    else:
        tl.atomic_add(ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def dequant_kernel(
    qw_ptr, stride_qw,          # int32 [Q, N_pad] q_weight, row stride in elements (column stride 1)
    qs_ptr, stride_qs,          # int32 [G, N_pad/8] q_scale, row stride (column stride 1)
    qsm_ptr,                    # fp16 [G] q_scale_max
    blk_qrow_ptr,               # int32 [KB] first q_weight row of each 32-row block (KB = K / 32)
    blk_group_ptr,              # int32 [KB] group of each block
    seg_ptr,                    # int32 [2 * 6] [start, end) blocks of the width of each slot
    perm_ptr,                   # int32 [K] q_perm (read only when UNPERMUTE)
    out_ptr, stride_ok, stride_on,  # fp16/bf16 output W[k, n] at out_ptr + k*stride_ok + n*stride_on
    N_out,                      # int: columns written (N_pad for stored order, N for the un-permuted W)
    KB,                         # int: number of 32-row blocks
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,  # slot widths (EXL2_BITS order; 0 = unused)
    B3: tl.constexpr, B4: tl.constexpr, B5: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr,  # 32-row blocks per program along K
    BLOCK_N: tl.constexpr,      # columns per program
    ROWS: tl.constexpr, LOG_ROWS: tl.constexpr,  # rows per block (ROW_MULTIPLE) and its log2
    UNPERMUTE: tl.constexpr,    # False: out row k = stored row k; True: out row q_perm[k] = stored row k
    OUT_BF16: tl.constexpr,     # output dtype: bf16 (each fp16 weight rounded once) or fp16 (exact)
    # scale-code layout from exl2fmt.layout: log2(codes per q_scale word), bits per code, code mask, 1/256
    CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_out
    rows_t = _index_tree(0, 1, ROWS)
    kb0 = pid_k * BLOCKS_PER_PROG
    kb1 = tl.minimum(kb0 + BLOCKS_PER_PROG, KB)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B0, 0, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B1, 1, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B2, 2, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B3, 3, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B4, 4, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
    _dequant_slot(qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, perm_ptr,
                  out_ptr, stride_ok, stride_on, kb0, kb1, offs_n, n_mask, rows_t, B5, 5, ROWS, LOG_ROWS,
                  UNPERMUTE, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)


@triton.jit
def matmul_kernel(
    x_ptr, stride_xm,               # [M, K] activations from prep_kernel (stored order, bit-reversed in each
                                    # block; fp32 when not USE_DOT, else x's dtype), unit column stride
    qw_ptr, stride_qw,              # int32 [Q, N_pad] q_weight
    qs_ptr, stride_qs,              # int32 [G, N_pad/8] q_scale
    qsm_ptr,                        # fp16 [G] q_scale_max
    blk_qrow_ptr, blk_group_ptr,    # int32 [KB] per 32-row block: first q_weight row, group
    seg_ptr,                        # int32 [2 * 6] [start, end) blocks of the width of each slot
    bias_ptr,                       # fp16/bf16/fp32 [>= N] bias (read only when HAS_BIAS)
    out_ptr, stride_om, stride_on,  # [M, N] output in x's dtype (not ATOMIC)
    ws_ptr,                         # fp32 [M, N] zeroed workspace, row-major (ATOMIC)
    M, N, KB,                       # rows of x, output columns, number of 32-row blocks
    blocks_per_split,               # 32-row blocks per K split (program axis 2)
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,  # slot widths (EXL2_BITS order; 0 = unused)
    B3: tl.constexpr, B4: tl.constexpr, B5: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    USE_DOT: tl.constexpr,          # tensor cores (tl.dot) or CUDA-core FMAs
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, OUT_BF16: tl.constexpr,
    # scale-code layout from exl2fmt.layout: log2(codes per q_scale word), bits per code, code mask, 1/256
    CPW_SHIFT: tl.constexpr, CODE_BITS: tl.constexpr, CODE_MASK: tl.constexpr, INV_DIV: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] W[k, n] (+ bias[n]) for a BLOCK_M x BLOCK_N tile over one K split."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, ROWS)
    kb0 = pid_k * blocks_per_split
    kb1 = tl.minimum(kb0 + blocks_per_split, KB)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B0, 0, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B1, 1, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B2, 2, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B3, 3, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B4, 4, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = _dot_slot(acc, x_ptr, stride_xm, offs_m, m_mask, offs_r, qw_ptr, stride_qw, qs_ptr, stride_qs,
                        qsm_ptr, blk_qrow_ptr, blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B5, 5, ROWS,
                        BLOCK_N, OUT_BF16, CPW_SHIFT, CODE_BITS, CODE_MASK, INV_DIV)
        acc = tl.trans(acc)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xrow = x_ptr + offs_m.to(tl.int64) * stride_xm
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B0, 0, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B1, 1, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B2, 2, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B3, 3, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B4, 4, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
        acc = _gemv_slot(acc, xrow, m_mask, qw_ptr, stride_qw, qs_ptr, stride_qs, qsm_ptr, blk_qrow_ptr,
                         blk_group_ptr, seg_ptr, kb0, kb1, offs_n, n_mask, B5, 5, ROWS, CPW_SHIFT, CODE_BITS,
                         CODE_MASK, INV_DIV)
    _epilogue(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, out_ptr, stride_om, stride_on, ws_ptr, N,
              HAS_BIAS, ATOMIC, OUT_BF16)


@triton.jit
def prep_kernel(
    x_ptr, stride_xm, stride_xk,    # fp16/bf16 [M, K] activations (original feature order), strides in elements
    perm_ptr,                       # int32 [K] q_perm (read only when HAS_PERM)
    xs_ptr,                         # [M, K] out (fp32 or x's dtype), row-major: xs[m, k] = x[m, q_perm[k]]
    ws_ptr,                         # fp32 [M, N] workspace, set to zero (only when ZERO_WS)
    K,                              # columns of x
    MK, MN,                         # element counts M*K and M*N (int64 when large)
    BLOCK: tl.constexpr, HAS_PERM: tl.constexpr, ZERO_WS: tl.constexpr,
):
    """One launch before the matmul kernel: gather x into stored row order (act-order) in the kernel's dtype and
    zero the K-split workspace."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MK
    m = offs // K
    k = (offs % K).to(tl.int32)
    if HAS_PERM:
        src = tl.load(perm_ptr + k, mask=mask, other=0)
    else:
        src = k
    v = tl.load(x_ptr + m * stride_xm + src.to(tl.int64) * stride_xk, mask=mask, other=0)
    tl.store(xs_ptr + offs, v.to(xs_ptr.dtype.element_ty), mask=mask)
    if ZERO_WS:
        tl.store(ws_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < MN)


@triton.jit
def finalize_kernel(
    ws_ptr,                         # fp32 [M, N] row-major sums
    bias_ptr,                       # [>= N] bias (read only when HAS_BIAS)
    out_ptr, stride_om, stride_on,  # [M, N] output
    N, MN,                          # columns, element count M*N (int64 when large)
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """out = round(ws + bias) after a K-split matmul."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    m = offs // N
    n = offs % N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n * stride_on, round_out(acc, OUT_BF16), mask=mask)


INTERPRETED = type(matmul_kernel).__name__ == "InterpretedFunction"
LAYOUT_CONSTS = dict(CPW_SHIFT=_CPW_SHIFT, CODE_BITS=SCALE_CODE_BITS, CODE_MASK=_CODE_MASK, INV_DIV=_INV_DIV)
SLOT_WIDTHS = {f"B{i}": b for i, b in enumerate(SLOT_BITS)}
