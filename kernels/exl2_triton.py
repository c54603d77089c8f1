"""Triton kernels for EXL2 layers: dequantize, and a fused dequantize-matmul ``y = x @ W (+ bias)``.

Importing this module imports torch and triton.  Import it through ``exl2fmt.kernels.load_triton(device)``,
which switches Triton to its CPU interpreter (``TRITON_INTERPRET=1``) for CPU tensors *before* the kernels
below are decorated: the interpreter mode is fixed when a ``@triton.jit`` function is created.

Layout (spec/exl2.md §2-§3; the numbers come from ``exl2fmt.layout``, never from this file)
---------------------------------------------------------------------------------------------
``q_weight`` int32 [Q, N_pad] holds the codes of K stored rows.  Every group holds a multiple of
``ROW_MULTIPLE`` (32) rows, so the rows split into K/32 *blocks* of 32 stored rows that each lie in one group,
at one bit width b.  A block at b bits occupies b consecutive q_weight rows (32 * b / 32 words per column), and
inside it stored row t (0 <= t < 32) is the little-endian bit field [t*b, t*b + b) of the 32*b-bit string made
of those words, low word first (the packing units of every width tile a block exactly, so the unit rule of
§2.2 reduces to this).  A field whose bits cross a word boundary takes its low bits from the lower word.

The kernels never decode ``q_groups``.  The host turns the ``GroupTable`` into small int32 tables, one entry per
32-row block (``Exl2Tables``): its first q_weight row and its group (and its width); plus the [start, end) block
range of each width (tiers are contiguous, widths in ``EXL2_BITS`` order) and q_perm = argsort(q_invperm).  Every
kernel runs one loop per width over that width's blocks, so inside a loop the width is a compile-time constant:
the block's words are loaded once each and every row is cut out with constant shifts.

Arithmetic, bit for bit as the reference (``exl2fmt.codec.exl2.dequantize_stored``):
    m = fp16(q_scale_max[g] / 256)             (f32 multiply by 2^-8, exact, then one rounding to fp16)
    s = fp16(fp16((c + 1)^2) * m)             (c = 4-bit scale code of column n in q_scale[g])
    w = fp16(fp16(q - 2^(b-1)) * s)           (q - 2^(b-1) formed exactly as (0x6400 | q) - (1024 + z) in fp16)
The matmul kernels use exactly these fp16 weights and accumulate ``x * w`` in fp32 (every product of an
fp16/bf16 activation and an fp16 weight is exact in fp32); the only roundings are the fp32 additions and the
final conversion of y to x's dtype.

Paths of ``exl2_matmul`` (all produce y [M, N] in x's dtype; ``choose_path(M)`` picks one, ``path=`` forces):
* ``"gemv"``  (M <= GEMV_MAX_M): one program per (BLOCK_N columns, K split); rows are consumed one by one as
  outer products with fp32 activations on CUDA cores.
* ``"dot"``   (M <= DOT_MAX_M): the block's 32 rows are assembled in registers (``tl.join`` tree) into an fp16
  [BLOCK_N, 32] tile, the A operand of ``tl.dot`` against the x block (tensor cores, y^T accumulated).  bf16 x:
  both operands go through tf32, which holds bf16 x and fp16 w exactly, so the products stay exact.
* ``"dense"`` (larger M): the dequantize kernel writes W_stored (held as W^T [N, K]) in x's dtype, then
  ``torch.addmm`` / ``torch.matmul`` with x gathered into stored order.  bf16 x: each weight is rounded once to
  bf16 (relative 2^-8), the one place where the weights are not used exactly.
gemv and dot are preceded by ``prep_kernel`` (x gathered into stored order, in the kernel's dtype, and the
split-K workspace zeroed) and, when K is split over programs, followed by ``finalize_kernel`` (fp32 sums +
bias, rounded).  Act-order therefore costs one gather of x (M x K), never a pass over the weights.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton

from ..groups import GroupTable, decode_q_groups
from ._triton_common import check_outputs
from .exl2_jit import (BLOCK_ROWS, CODES_PER_WORD, INTERPRETED, LAYOUT_CONSTS, LOG_BLOCK_ROWS, N_SLOTS, SLOT_BITS,
                       SLOT_WIDTHS, dequant_kernel, finalize_kernel, matmul_kernel, prep_kernel)
from ..layout import EXL2_BITS, MAX_K, N_PAD_MULTIPLE, Exl2Slot

__all__ = [
    "Exl2Tables", "Exl2KernelLinear", "build_tables", "exl2_dequantize", "exl2_matmul", "exl2_linear",
    "choose_path", "launch_config", "check_layer", "interpreted", "GEMV_MAX_M", "DOT_MAX_M",
]

#: Default path thresholds (M = rows of x): gemv for M <= GEMV_MAX_M, dot for M <= DOT_MAX_M, dense above.
#: Chosen from SASS instruction counts only (no GPU timing yet); ``bench/kernel.py`` times every candidate.
GEMV_MAX_M = 1
DOT_MAX_M = 64


def interpreted() -> bool:
    """True when the kernels of this module run in Triton's CPU interpreter."""
    return INTERPRETED


# ---------------------------------------------------------------------------------------------------
# Host side: tables, checks, launches
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exl2Tables:
    """Launch tables of one layer, built on the host from its ``GroupTable`` and ``q_invperm``.

    ``blk_bits``, ``blk_qrow``, ``blk_group``: int32 [K/32] on ``device``: bit width, first q_weight row and
    group of each 32-row block of stored rows.  ``segments``: int32 [12] on ``device``: [start, end) block range
    of the width in each slot of the GEMV kernel (``EXL2_BITS`` order; empty ranges for absent widths).
    ``q_perm``: int32 [K] on ``device`` (original input feature of stored row k), None when the permutation
    is the identity.  ``K``, ``Q``, ``G``: the layer geometry (ints).
    """

    K: int
    Q: int
    G: int
    blk_bits: torch.Tensor
    blk_qrow: torch.Tensor
    blk_group: torch.Tensor
    segments: torch.Tensor
    q_perm: torch.Tensor | None
    device: torch.device

    @property
    def KB(self) -> int:
        return self.K // BLOCK_ROWS


def _host_perm(q_invperm, K: int) -> np.ndarray:
    """q_invperm (int16 read as uint16, int32, int64; tensor or array) -> q_perm int64 [K]; ValueError if it is
    not a permutation of 0..K-1."""
    if isinstance(q_invperm, torch.Tensor):
        t = q_invperm.detach().cpu()
        inv = t.numpy().view(np.uint16) if t.dtype == torch.int16 else t.numpy()
    else:
        inv = np.asarray(q_invperm)
        if inv.dtype == np.int16:
            inv = inv.view(np.uint16)
    if inv.dtype.kind not in "iu":
        raise ValueError(f"q_invperm must be an integer array, got dtype {inv.dtype}")
    inv = inv.astype(np.int64).ravel()
    if inv.shape != (K,):
        raise ValueError(f"q_invperm has {inv.size} entries; the groups hold K = {K} rows")
    if K and (inv.min() < 0 or inv.max() >= K or np.bincount(inv, minlength=K).max() != 1):
        raise ValueError(f"q_invperm is not a permutation of 0..{K - 1}")
    perm = np.empty(K, dtype=np.int64)
    perm[inv] = np.arange(K, dtype=np.int64)
    return perm


def build_tables(groups: GroupTable, q_invperm=None, device: torch.device | str = "cpu") -> Exl2Tables:
    """Per-block launch tables of one layer (see ``Exl2Tables``).  ``q_invperm`` None = identity.

    Raises ValueError when a group is not a multiple of 32 rows, a width is not an EXL2 width, the widths do not
    form contiguous tiers, K exceeds the format limit, or q_invperm is not a permutation of 0..K-1.
    """
    device = torch.device(device)
    bits_l, qrow_l, grp_l = [], [], []
    for g, (b, r, q0, nq) in enumerate(zip(groups.bits.tolist(), groups.rows.tolist(), groups.qrow.tolist(),
                                          groups.qrows.tolist())):
        if b not in EXL2_BITS:
            raise ValueError(f"group {g}: bit width {b} is not one of {sorted(EXL2_BITS)}")
        if r % BLOCK_ROWS or r <= 0:
            raise ValueError(f"group {g}: {r} rows; the kernels need a positive multiple of {BLOCK_ROWS}")
        words = BLOCK_ROWS * b // 32
        if nq != r // BLOCK_ROWS * words:
            raise ValueError(f"group {g}: {nq} packed rows for {r} rows at {b} bits; expected "
                             f"{r // BLOCK_ROWS * words}")
        for j in range(r // BLOCK_ROWS):
            bits_l.append(b)
            qrow_l.append(q0 + j * words)
            grp_l.append(g)
    K = groups.K
    if K > MAX_K:
        raise ValueError(f"K = {K} rows exceeds the format limit {MAX_K}")
    blk_bits = np.asarray(bits_l, dtype=np.int64)
    seg = np.zeros(2 * N_SLOTS, dtype=np.int64)
    for i, b in enumerate(SLOT_BITS):
        idx = np.flatnonzero(blk_bits == b) if b else np.zeros(0, np.int64)
        if idx.size:
            if idx[-1] - idx[0] + 1 != idx.size:
                raise ValueError(f"the {b}-bit groups are not contiguous (blocks {idx[0]}..{idx[-1]} hold "
                                 f"{idx.size} {b}-bit blocks); tiers must be contiguous")
            seg[2 * i], seg[2 * i + 1] = idx[0], idx[-1] + 1
    perm = None
    if q_invperm is not None:
        p = _host_perm(q_invperm, K)
        if not np.array_equal(p, np.arange(K)):
            perm = torch.from_numpy(p.astype(np.int32)).to(device)

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return Exl2Tables(K=K, Q=groups.Q, G=groups.G, blk_bits=dev(blk_bits), blk_qrow=dev(qrow_l),
                      blk_group=dev(grp_l), segments=dev(seg), q_perm=perm, device=device)


def _groups_of(q_groups, Q: int) -> GroupTable:
    if isinstance(q_groups, GroupTable):
        if q_groups.Q != Q:
            raise ValueError(f"the groups need {q_groups.Q} q_weight rows; q_weight has {Q}")
        return q_groups
    qg = q_groups.detach().cpu().numpy() if isinstance(q_groups, torch.Tensor) else np.asarray(q_groups)
    try:
        return decode_q_groups(qg, Q)
    except Exception as e:  # Exl2Error: report as the wrapper's ValueError
        raise ValueError(f"q_groups: {e}") from None


def _check_layer(q_weight, q_scale, q_scale_max, tables: Exl2Tables, out_features, bias, device) -> int:
    """Check the packed tensors against the tables; return N (out_features).  Raises ValueError."""
    for name, t, dt, nd in ((Exl2Slot.Q_WEIGHT, q_weight, torch.int32, 2),
                            (Exl2Slot.Q_SCALE, q_scale, torch.int32, 2),
                            (Exl2Slot.Q_SCALE_MAX, q_scale_max, torch.float16, 1)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt or t.dim() != nd:
            raise ValueError(f"{name} must be {dt} with {nd} dims, got {t.dtype} with shape {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; expected {device}")
    Q, n_pad = q_weight.shape
    if n_pad <= 0 or n_pad % N_PAD_MULTIPLE:
        raise ValueError(f"q_weight has {n_pad} columns; N_pad must be a positive multiple of {N_PAD_MULTIPLE}")
    if Q != tables.Q:
        raise ValueError(f"q_weight has {Q} rows; the groups need {tables.Q}")
    if q_weight.stride(1) != 1 or q_scale.stride(1) != 1:
        raise ValueError(f"q_weight and q_scale need unit column stride, got strides {q_weight.stride()} and "
                         f"{q_scale.stride()}")
    if tuple(q_scale.shape) != (tables.G, n_pad // CODES_PER_WORD):
        raise ValueError(f"q_scale has shape {list(q_scale.shape)}; expected [{tables.G}, {n_pad // CODES_PER_WORD}]")
    if tuple(q_scale_max.shape) != (tables.G,):
        raise ValueError(f"q_scale_max has shape {list(q_scale_max.shape)}; expected [{tables.G}]")
    if not q_scale_max.is_contiguous():
        raise ValueError("q_scale_max must be contiguous")
    if tables.device != device:
        raise ValueError(f"the launch tables are on {tables.device}; expected {device}")
    N = n_pad if out_features is None else int(out_features)
    if not (n_pad - N_PAD_MULTIPLE < N <= n_pad):
        raise ValueError(f"out_features = {N} does not pad to N_pad = {n_pad} (need {n_pad - N_PAD_MULTIPLE} < N "
                         f"<= {n_pad})")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
            raise ValueError(f"bias must be a 1-D torch.Tensor, got {getattr(bias, 'shape', type(bias).__name__)}")
        if bias.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"bias must be float16, bfloat16 or float32, got {bias.dtype}")
        if bias.shape[0] not in (N, n_pad):
            raise ValueError(f"bias has {bias.shape[0]} entries; expected N = {N} or N_pad = {n_pad}")
        if bias.device != device or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous tensor on {device}, got {bias.device}, stride {bias.stride()}")
    return N


def _check_device(device: torch.device) -> None:
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError("CPU tensors need Triton's interpreter: load the kernels with "
                         "exl2fmt.kernels.load_triton('cpu') (sets TRITON_INTERPRET=1) in a fresh process")
    if device.type != "cpu" and INTERPRETED:
        raise ValueError(f"tensors are on {device} but the kernels were loaded in interpreter mode (CPU only)")


def _tables_for(q_weight, q_groups, q_invperm, tables):
    if tables is not None:
        return tables
    if q_groups is None:
        raise ValueError("pass q_groups (int16 [2G] or a GroupTable) or prepared tables=")
    groups = _groups_of(q_groups, int(q_weight.shape[0]))
    return build_tables(groups, q_invperm, q_weight.device)


def exl2_dequantize(q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor, q_groups=None,
                    q_invperm=None, *, out_features: int | None = None, unpermute: bool = False,
                    dtype: torch.dtype = torch.float16, tables: Exl2Tables | None = None,
                    block_n: int | None = None, blocks_per_prog: int | None = None) -> torch.Tensor:
    """Dequantize an EXL2 layer on the device.

    q_weight     int32 [Q, N_pad], unit column stride (row stride free)
    q_scale      int32 [G, N_pad/8], unit column stride
    q_scale_max  float16 [G], contiguous
    q_groups     int16 [2G] (tensor or array, read on the host) or a ``GroupTable``; unused with ``tables=``
    q_invperm    integer [K] (int16 read as uint16), read on the host; None = identity; ignored with ``tables=``
    out_features N (default N_pad); only the un-permuted output drops the padding columns
    unpermute    False: W_stored float [K, N_pad], row k = stored row k (equals ``dequantize_stored`` bit for bit);
                 True: W float [K, N], row j = original input feature j, i.e. ``dequantize(...).T``
    dtype        torch.float16 (exact) or torch.bfloat16 (each fp16 weight rounded once to bf16)
    Returns a new contiguous tensor on q_weight's device.  Raises ValueError for inconsistent inputs.
    """
    device = q_weight.device
    _check_device(device)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    tables = _tables_for(q_weight, q_groups, q_invperm, tables)
    N = _check_layer(q_weight, q_scale, q_scale_max, tables, out_features, None, device)
    n_pad = q_weight.shape[1]
    n_out = N if unpermute else n_pad
    out = torch.empty((tables.K, n_out), dtype=dtype, device=device)
    _launch_dequant(q_weight, q_scale, q_scale_max, tables, out, unpermute, block_n, blocks_per_prog)
    return out


def _launch_dequant(q_weight, q_scale, q_scale_max, tables: Exl2Tables, out: torch.Tensor, unpermute: bool,
                    block_n: int | None = None, blocks_per_prog: int | None = None) -> None:
    """Write W [K, n_out] into ``out`` (any strides; a transposed view gives W^T storage, contiguous along K).
    Row k = stored row k, or original feature q_perm[k] when ``unpermute``."""
    K, n_out = out.shape
    if K == 0 or n_out == 0:
        return
    _, bn, nw = launch_config("dequant", 0)
    bn = block_n or bn
    bpp = blocks_per_prog or 4
    perm = tables.q_perm if (unpermute and tables.q_perm is not None) else tables.blk_bits  # dummy when unused
    grid = (triton.cdiv(tables.KB, bpp), triton.cdiv(n_out, bn))
    dequant_kernel[grid](
        q_weight, q_weight.stride(0), q_scale, q_scale.stride(0), q_scale_max,
        tables.blk_qrow, tables.blk_group, tables.segments, perm, out, out.stride(0), out.stride(1), n_out,
        tables.KB, **SLOT_WIDTHS, BLOCKS_PER_PROG=bpp, BLOCK_N=bn, ROWS=BLOCK_ROWS, LOG_ROWS=LOG_BLOCK_ROWS,
        UNPERMUTE=bool(unpermute and tables.q_perm is not None), OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=nw, **LAYOUT_CONSTS)


def choose_path(M: int) -> str:
    """Default path for M rows of x: "gemv" (M <= GEMV_MAX_M), "dot" (M <= DOT_MAX_M) or "dense"."""
    if M <= GEMV_MAX_M:
        return "gemv"
    if M <= DOT_MAX_M:
        return "dot"
    return "dense"


def launch_config(path: str, M: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) the wrapper uses for ``path`` and M rows of x.

    The tensor-core and dequantize kernels keep a block's rows in registers per column, so BLOCK_N must be at
    least 32 * num_warps; more columns per thread amortise the per-block work (SASS of sm_90 builds: about 6
    instructions per weight with 2 columns per thread, 9-10 with 1).  Under the interpreter the blocks are
    small, to keep the CPU tests fast."""
    if path == "dot":
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        bn = 64 if INTERPRETED else (256 if bm <= 32 else 128)
        return bm, bn, 4
    if path == "gemv":
        bm = min(16, triton.next_power_of_2(M))
        return bm, 64 if INTERPRETED else max(64, 512 // bm), 4
    if path == "dequant":
        return 0, 64 if INTERPRETED else 128, 4
    raise ValueError(f"no launch configuration for path {path!r}")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _split_for(KB: int, programs: int, device: torch.device, split_k: int | None) -> tuple[int, int]:
    """(split count, blocks per split).  Heuristic: about 4 programs per SM, each with >= 4 blocks of K."""
    if split_k is None:
        if device.type == "cuda":
            want = max(1, (4 * _sm_count(device)) // max(programs, 1))
            split_k = max(1, min(want, KB // 4))
        else:
            split_k = 1
    split_k = max(1, min(int(split_k), max(KB, 1)))
    per = triton.cdiv(KB, split_k)
    return triton.cdiv(KB, per), per


def exl2_matmul(x: torch.Tensor, q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor,
                q_groups=None, q_invperm=None, out_features: int | None = None, bias: torch.Tensor | None = None,
                *, tables: Exl2Tables | None = None, path: str | None = None, split_k: int | None = None,
                block_n: int | None = None, block_m: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) straight from the packed EXL2 tensors, W the layer's [K, N] weight (``nn.Linear``
    weight transposed, act-order undone).

    x            float16 or bfloat16 [..., K] (any strides); leading dims are flattened to M rows
    q_weight     int32 [Q, N_pad], unit column stride
    q_scale      int32 [G, N_pad/8], unit column stride
    q_scale_max  float16 [G], contiguous
    q_groups     int16 [2G] (tensor or array, read on the host) or a ``GroupTable``; ignored with ``tables=``
    q_invperm    integer [K] (int16 read as uint16; tensor or array, read on the host); None = identity;
                 ignored with ``tables=``
    out_features N with N_pad - 32 < N <= N_pad (default N_pad)
    bias         float16 / bfloat16 / float32 [N] or [N_pad], contiguous, same device; added in fp32
    tables       ``build_tables(...)`` result, to skip the host work (what ``Exl2KernelLinear`` does)
    path         "gemv", "dot", "dense" or None (``choose_path(M)``); split_k / block_n / block_m / num_warps:
                 tuning overrides (None = heuristics)
    Returns y [..., N] in x's dtype, fp32 accumulation.  Raises ValueError with the offending numbers.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    device = x.device
    _check_device(device)
    tables = _tables_for(q_weight, q_groups, q_invperm, tables)
    N = _check_layer(q_weight, q_scale, q_scale_max, tables, out_features, bias, device)
    K = tables.K
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features (shape {list(x.shape)}); the layer has K = {K}")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=device)
    if M == 0:
        return out.reshape(*lead, N)
    path = path or choose_path(M)
    if path not in ("gemv", "dot", "dense"):
        raise ValueError(f"path must be 'gemv', 'dot' or 'dense', got {path!r}")
    has_perm = tables.q_perm is not None
    perm = tables.q_perm if has_perm else tables.blk_bits  # dummy pointer when unused
    bias_arg = bias if bias is not None else out

    if path == "dense":
        # W in stored row order, held transposed (W^T [N, K], contiguous along K: the dequantize kernel's stores
        # vectorise) and x gathered into stored order: y = x[:, q_perm] @ W_stored[:, :N]
        wt = torch.empty((N, K), dtype=x.dtype, device=device)
        _launch_dequant(q_weight, q_scale, q_scale_max, tables, wt.t(), False)
        xs = x2
        if has_perm:
            xs = torch.empty((M, K), dtype=x.dtype, device=device)
            prep_kernel[(triton.cdiv(M * K, 1024),)](x2, x2.stride(0), x2.stride(1), perm, xs, xs, K, M * K, 0,
                                                     BLOCK=1024, HAS_PERM=True, ZERO_WS=False, num_warps=4)
        if bias is not None:
            torch.addmm(bias[:N].to(x.dtype), xs, wt.t(), out=out)
        else:
            torch.matmul(xs, wt.t(), out=out)
        return out.reshape(*lead, N)

    use_dot = path == "dot"
    bm, bn, nw = launch_config(path, M)
    bm, bn, nw = block_m or bm, block_n or bn, num_warps or nw
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    splits, per = _split_for(tables.KB, grid[0] * grid[1], device, split_k)
    ws = torch.empty((M, N), dtype=torch.float32, device=device) if splits > 1 else out
    # One launch gathers x into stored row order (act-order; M x K elements, small next to the weights) in the
    # kernel's dtype and zeroes the K-split workspace.
    xs = torch.empty((M, K), dtype=x.dtype if use_dot else torch.float32, device=device)
    pb = 1024
    prep_kernel[(triton.cdiv(max(M * K, M * N if splits > 1 else 0), pb),)](
        x2, x2.stride(0), x2.stride(1), perm, xs, ws, K, M * K, M * N, BLOCK=pb, HAS_PERM=has_perm,
        ZERO_WS=splits > 1, num_warps=4)
    matmul_kernel[grid + (splits,)](
        xs, xs.stride(0), q_weight, q_weight.stride(0), q_scale, q_scale.stride(0), q_scale_max,
        tables.blk_qrow, tables.blk_group, tables.segments, bias_arg, out, out.stride(0), out.stride(1),
        ws, M, N, tables.KB, per, **SLOT_WIDTHS, BLOCK_M=bm, BLOCK_N=bn, ROWS=BLOCK_ROWS, USE_DOT=use_dot,
        HAS_BIAS=bias is not None, ATOMIC=splits > 1, OUT_BF16=x.dtype == torch.bfloat16,
        num_warps=nw, **LAYOUT_CONSTS)
    if splits > 1:
        blk = 1024
        finalize_kernel[(triton.cdiv(M * N, blk),)](ws, bias_arg, out, out.stride(0), out.stride(1), N, M * N,
                                                     BLOCK=blk, HAS_BIAS=bias is not None,
                                                     OUT_BF16=x.dtype == torch.bfloat16, num_warps=4)
    return out.reshape(*lead, N)


# ---------------------------------------------------------------------------------------------------
# Layer objects
# ---------------------------------------------------------------------------------------------------


class Exl2KernelLinear:
    """One EXL2 layer on a device, ready for the kernels: the packed tensors as torch tensors plus the launch
    tables (built once).  ``layer(x)`` = ``exl2_matmul``; ``layer.dequantize()`` = the [K, N] weight."""

    def __init__(self, q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor, q_groups,
                 q_invperm=None, out_features: int | None = None, bias: torch.Tensor | None = None):
        device = q_weight.device
        self.tables = _tables_for(q_weight, q_groups, q_invperm, None)
        self.out_features = _check_layer(q_weight, q_scale, q_scale_max, self.tables, out_features, bias, device)
        self.q_weight, self.q_scale, self.q_scale_max, self.bias = q_weight, q_scale, q_scale_max, bias
        self.in_features = self.tables.K
        self.device = device

    @classmethod
    def from_layer(cls, layer: Any, device: torch.device | str | None = None) -> "Exl2KernelLinear":
        """From an ``exl2fmt.formats.exl2.Exl2Linear`` (NumPy arrays or memory maps).  ``device`` default: cuda when
        available, else cpu (interpreter)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
        device = torch.device(device)
        layer.raise_if_invalid(deep=False)
        t = layer.tensors

        def dev(name):  # a private copy: the arrays may be read-only memory maps
            return torch.from_numpy(np.array(np.asarray(t[name]), copy=True, order="C")).to(device)

        bias = None
        if Exl2Slot.BIAS in t:
            bias = dev(Exl2Slot.BIAS)
        inv = np.asarray(t[Exl2Slot.Q_INVPERM])
        if layer.dtypes.get(Exl2Slot.Q_INVPERM) == "I16":
            inv = inv.view(np.uint16)
        return cls(dev(Exl2Slot.Q_WEIGHT), dev(Exl2Slot.Q_SCALE), dev(Exl2Slot.Q_SCALE_MAX), layer.groups, inv,
                   out_features=layer.out_features, bias=bias)

    def __call__(self, x: torch.Tensor, **kw) -> torch.Tensor:
        return exl2_matmul(x, self.q_weight, self.q_scale, self.q_scale_max, out_features=self.out_features,
                           bias=self.bias, tables=self.tables, **kw)

    forward = __call__

    def dequantize(self, unpermute: bool = True, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """unpermute: W [K, N] (= ``Exl2Linear.dequantize().T``); else W_stored [K, N_pad]."""
        return exl2_dequantize(self.q_weight, self.q_scale, self.q_scale_max, tables=self.tables,
                               out_features=self.out_features, unpermute=unpermute, dtype=dtype)


_PREPARED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def exl2_linear(x: torch.Tensor, layer: Any, **kw) -> torch.Tensor:
    """y = x @ W (+ bias) for an ``exl2fmt.formats.exl2.Exl2Linear``; its tensors are moved to x's device once
    (cached per layer object and device)."""
    per = _PREPARED.setdefault(layer, {})
    key = str(x.device)
    if key not in per:
        per[key] = Exl2KernelLinear.from_layer(layer, x.device)
    return per[key](x, **kw)


#: Column-block cap under the interpreter (BLOCK_N = N_pad rounded up to a power of two, at most this).
_INTERP_MAX_BLOCK_N = 4096


def check_layer(layer: Any, device: torch.device | str | None = None, ms: tuple[int, ...] = (1, 16),
                paths: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """Run one ``exl2fmt.formats.exl2.Exl2Linear`` through the kernels on random inputs and compare with the Numba
    reference (what ``exl2fmt validate --kernel`` reports per layer).

    x: float16 [M, K], unit-normal, drawn on the CPU from ``seed`` (the same on every device); y_ref and the
    bound in float64 on the device from the reference fp16 W [K, N] (chunked over N: bounded memory).  An output
    is within the bound when |y - y_ref| <= u_out |y_ref| + 2 (K + 1) 2^-24 (|x| @ |W_ref| + |bias|): fp32
    accumulation of exact products, one rounding to fp16.  ``paths`` default: ``choose_path`` for each M.
    Under the interpreter the column block is N_pad rounded up to a power of two (<= 4096): identical results,
    about 10x fewer interpreted programs.

    Returns {"dequant_exact": bool, "mismatches": int (fp16 weights of W [K, N] whose bit patterns differ),
    "block_n": int | None, "results": [{"M", "path", "max_rel_err" (max |y - y_ref| / max |y_ref|; None when
    not finite), "within_bound", "outside" (outputs outside the bound, NaN included), "nonfinite"}], "seconds"}.
    """
    t0 = time.perf_counter()
    lin = Exl2KernelLinear.from_layer(layer, device)
    dev = lin.device
    K, N = int(lin.in_features), int(lin.out_features)
    n_pad = int(lin.q_weight.shape[1])
    bn = None
    if interpreted():
        bn = 64
        while bn < n_pad and bn < _INTERP_MAX_BLOCK_N:
            bn *= 2
    w_ref = torch.from_numpy(np.ascontiguousarray(np.asarray(layer.dequantize(), dtype=np.float16).T)).to(dev)
    got = exl2_dequantize(lin.q_weight, lin.q_scale, lin.q_scale_max, tables=lin.tables, out_features=N,
                          unpermute=True, block_n=bn)  # float16 [K, N]
    mism = int((got.view(torch.int16) != w_ref.view(torch.int16)).sum()) if got.shape == w_ref.shape else K * N
    del got
    results = check_outputs(lambda x, path: lin(x, path=path, **({"block_n": bn} if bn is not None and
                                                                   path != "dense" else {})),
                            w_ref, layer.bias(), ms, paths or {M: (choose_path(M),) for M in ms}, seed)
    return {"dequant_exact": mism == 0, "mismatches": mism, "block_n": bn, "results": results,
            "seconds": round(time.perf_counter() - t0, 3)}


# The GPTQ kernels of the same family, reached through the same loader (``kt.gptq_matmul``).
from .gptq_triton import FUSED_MAX_M as GPTQ_FUSED_MAX_M  # noqa: E402
from .gptq_triton import check_gptq_layer, gptq_dequantize, gptq_matmul  # noqa: E402

__all__ += ["gptq_dequantize", "gptq_matmul", "check_gptq_layer", "GPTQ_FUSED_MAX_M"]
