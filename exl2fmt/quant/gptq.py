"""GPTQ for one linear layer: Hessians, act-order, the error-feedback sweep, EXL2 and GPTQ outputs.

The algorithm is the one of spec/exl2.md ("Conversion"), written for torch on CPU or CUDA:

1. ``HessianAccumulator`` sums ``H = X^T X`` (float32) over the calibration inputs ``X`` of the layer.
2. ``prepare`` orders the input features by descending ``diag(H)`` (act-order; a stable sort, so ties keep
   their index order and runs are reproducible) or group-aware (``group_aware_order``: whole GPTQ groups of
   consecutive features, most important first, by descending ``diag(H)`` within each), dampens ``H`` by ``percdamp * mean(diag(H))`` and returns the
   upper Cholesky factor ``U`` of ``H^-1`` in that order (retrying with more damping if the factorization
   fails).
3. ``quantize_exl2`` / ``quantize_gptq`` sweep the stored rows group by group.  At the start of a group the
   group's quantization parameters are fitted to the *current* (already error-compensated) rows; then each
   row is rounded, its fp16 reconstruction taken, and the scaled error ``e = (w - w_hat) / U[c, c]`` pushed
   into the remaining rows of the group (``w_r -= U[c, r] * e``); after the group, one matrix product pushes
   the group's errors into every later row (``W[b:] -= U[a:b, b:]^T E``).

Arrays: ``weight`` is always the ``nn.Linear`` weight, float [N, K] (out features x in features), C order.
Inside, the work matrix is ``W^T`` in stored (permuted) row order, float32 [K, N_pad] with N padded to 32
(EXL2) or unpadded (GPTQ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..errors import ErrorCode, Exl2Error
from ..layout import BIT_WIDTHS, GPTQ_BITS, pad32

__all__ = ["HessianAccumulator", "Prepared", "prepare", "group_aware_order", "Exl2Result", "GptqResult", "quantize_exl2",
           "quantize_exl2_plans", "quantize_gptq", "proxy_error", "EXL2_PERCDAMP", "GPTQ_PERCDAMP"]

#: Relative damping of ExLlamaV2 (``percdamp = 0.12``) and of the GPTQ reference implementations (0.01).
EXL2_PERCDAMP = 0.12
GPTQ_PERCDAMP = 0.01


class HessianAccumulator:
    """``H = sum X^T X`` over calibration inputs; ``add(x)`` with ``x`` float [..., K] (any leading shape)."""

    def __init__(self, K: int, device: str | torch.device = "cpu"):
        self.K = int(K)
        self.H = torch.zeros((self.K, self.K), dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).to(device=self.H.device, dtype=torch.float32)
        if x2.shape[1] != self.K:
            raise ValueError(f"Hessian of K={self.K} fed inputs with {x2.shape[1]} features")
        self.H.addmm_(x2.T, x2)
        self.rows += x2.shape[0]

    def result(self) -> torch.Tensor:
        """H / rows, float32 [K, K] (a new matrix); the identity when nothing was added (weight-only mode)."""
        if self.rows == 0:
            return torch.eye(self.K, dtype=torch.float32, device=self.H.device)
        return self.H / self.rows

    def take(self) -> torch.Tensor:
        """``result()`` without a copy: the sum is divided in place and handed over; the accumulator is then
        spent (a K x K float32 matrix: the largest single buffer of a layer's GPTQ work)."""
        if self.H is None:
            raise RuntimeError("HessianAccumulator.take() was already called")
        H, self.H = self.H, None
        if self.rows == 0:
            return torch.eye(self.K, dtype=torch.float32, device=H.device)
        return H.div_(self.rows)


@dataclass(frozen=True)
class Prepared:
    """``perm`` int64 [K]: stored row k holds input feature perm[k].  ``U`` float32 [K, K]: upper Cholesky
    factor of the damped ``H^-1`` in stored order.  ``H`` float32 [K, K]: the undamped Hessian in original
    order (kept for error estimates; None where a caller that computes none dropped it).  ``within_groups``:
    set when ``perm`` is a group-aware order (``group_aware_order``) of groups of that many consecutive
    features."""

    perm: torch.Tensor
    U: torch.Tensor
    H: torch.Tensor | None
    damp: float
    within_groups: int | None = None
    fixed_groups: int | None = None


def group_aware_order(diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-aware act-order: the processing order of GPTQ that keeps every group of ``group_size`` consecutive
    input features together (so ``g_idx`` stays ``k // group_size``, monotone) while processing the important
    features first, as act-order does.

    ``diag`` float [K] (the Hessian diagonal, the features' importance).  The groups (the last one may be
    shorter) are ranked by their largest ``diag`` value, decreasing; within a group the features go by
    decreasing ``diag``.  Both sorts are stable (ties keep their index order).  Returns ``perm`` int64 [K]:
    stored (processing) row k holds feature perm[k].  (GPTQModel's default, "group aware reordering" after
    Gafni et al., CVPRW 2025, ranks groups the same way.)"""
    K = int(diag.shape[0])
    gs = int(group_size)
    if gs <= 0:
        raise ValueError(f"group-aware order needs a positive group size, got {group_size}")
    d = diag.detach().to(torch.float64).cpu()
    starts = list(range(0, K, gs))
    tops = torch.stack([d[a:a + gs].max() for a in starts])
    parts = []
    for g in torch.argsort(tops, descending=True, stable=True).tolist():
        a = starts[g]
        parts.append(a + torch.argsort(d[a:a + gs], descending=True, stable=True))
    return torch.cat(parts).to(device=diag.device, dtype=torch.int64)


def prepare(H: torch.Tensor, *, percdamp: float = EXL2_PERCDAMP, act_order: bool = True,
            within_groups: int | None = None, fixed_groups: int | None = None,
            keep_hessian: bool = True) -> Prepared:
    """Act-order permutation and the inverse-Hessian factor for ``H`` float32 [K, K] (symmetric, PSD).

    ``act_order`` orders the input features by decreasing ``diag(H)``; with ``within_groups`` (a group size)
    they are ordered group-aware instead (``group_aware_order``: whole groups of that many consecutive
    features, most important group first); with ``fixed_groups`` (a group size) the order is the full
    act-order and only ``quantize_gptq`` treats groups differently (consecutive features, not processing runs).

    ``keep_hessian=False``: the result's ``H`` is None, and ``H`` is let go of once its permuted copy is made,
    so a caller that passes a temporary (``prepare(acc.take(), keep_hessian=False)``) factorizes with two K x K
    matrices alive instead of three (the same factor: a retry restores the copy's diagonal instead of
    permuting H again)."""
    K = H.shape[0]
    H = H.to(torch.float32)
    if within_groups and fixed_groups:
        raise ValueError("within_groups and fixed_groups exclude each other")
    if not act_order:
        fixed_groups = None
    if act_order and within_groups:
        perm = group_aware_order(torch.diag(H), within_groups)
    elif act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    else:
        perm = torch.arange(K, device=H.device)
        within_groups = None
    # The upper Cholesky factor of H^-1 without forming H^-1: with J the order reversal, J Hp J = Lr Lr^T gives
    # H^-1 = (J Lr^-1 J)^T (J Lr^-1 J), and J Lr^-1 J is upper triangular with a positive diagonal, so it *is*
    # that factor (unique).  One Cholesky and one triangular solve (~1.3 K^3 flops) instead of Cholesky, solve,
    # a full product and a second Cholesky (~3.7 K^3): faster, and closer to a float64 reference (tests/test_quant.py;
    # the measured figures are in bench/RESULTS.md).  Written for memory: at most three K x K float32 matrices
    # live at once (a 70B MLP's down_proj has K = 28672).
    diag_mean = float(torch.diag(H).mean())
    base = max(float(percdamp) * diag_mean, 1e-5)
    rev = torch.flip(perm, (0,))
    Hr0 = d0 = None
    if not keep_hessian:                                          # J Hp J once; H itself is not needed again
        Hr0 = _permute_both(H, rev)
        d0 = Hr0.diagonal().clone()
        H = None
    for attempt in range(1, 11):
        damp = base * attempt
        if Hr0 is None:
            Hr = _permute_both(H, rev)                            # J Hp J, damped below
        else:
            Hr = Hr0
            Hr.diagonal().copy_(d0)                               # undamped again (a retry), then damped
        Hr.diagonal().add_(damp)
        Lr, info = torch.linalg.cholesky_ex(Hr)
        del Hr
        if int(info) != 0:
            continue
        # (the permuted copy is not needed past a successful Cholesky: of a finite, damped PSD matrix the factor
        # is finite with a positive diagonal, |U| <= 1 / sqrt(damp); only a non-finite Hessian fails the check
        # below, and more damping does not cure that)
        Hr0 = None
        # Lr^-1 by a triangular solve into the identity's storage (column-major, as LAPACK works)
        Linv = torch.eye(K, dtype=torch.float32, device=Lr.device).T
        torch.linalg.solve_triangular(Lr, Linv, upper=False, out=Linv)
        del Lr
        U = torch.flip(Linv, (0, 1))                  # (keeps the column-major strides)
        del Linv
        U = U.contiguous()
        # (aminmax: one read pass, no K x K mask; a NaN anywhere makes both NaN, an inf one of them)
        if bool(torch.isfinite(torch.stack(torch.aminmax(U))).all()) and bool((torch.diagonal(U) > 0).all()):
            return Prepared(perm=perm, U=U, H=H, damp=damp, within_groups=within_groups or None,
                            fixed_groups=fixed_groups or None)
        if not keep_hessian:
            break
    raise Exl2Error(ErrorCode.QUANT_NUMERICS, f"the Hessian (K={K}) is not positive definite even with "
                    f"damping {damp:.3g}: calibration inputs are degenerate or non-finite")


def _permute_both(H: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``H[p][:, p]`` for ``H`` float32 [K, K] and ``p`` int64 [K]: by ``gptq_kernel.permute_both`` on the CPU
    (past ``_UNPERMUTE_KERNEL_MIN`` elements), by two ``index_select`` elsewhere; the same values."""
    K = H.shape[0]
    if H.device.type == "cpu" and H.dtype == torch.float32 and H.is_contiguous() and K * K >= _UNPERMUTE_KERNEL_MIN:
        from .gptq_kernel import permute_both

        out = torch.empty((K, K), dtype=torch.float32)
        permute_both(H.numpy(), p.to(torch.int64).numpy(), out.numpy())
        return out
    return H.index_select(0, p).index_select(1, p)


# ------------------------------------------------------------------------------------------------ the sweep


def _group_kernel():
    """The row loop of one group on the CPU (``quant.gptq_kernel.kernel``, a Numba kernel cached on disk)."""
    from .gptq_kernel import kernel

    return kernel




def _sweep_group(Wt: torch.Tensor, U: torch.Tensor, codes: torch.Tensor, g: int, a: int, r: int, fit,
                 use_kernel: bool | None = None) -> None:
    """One group of the GPTQ sweep, in place: rows a..a+r of ``Wt`` float32 [K, N] (stored order) are fitted
    (``fit(g, Wt[a:a + r])``, see ``_sweep``), rounded one by one with their errors pushed into the group's
    later rows, written back as their fp16 reconstructions, their codes stored in ``codes[a:a + r]``; then one
    matrix product pushes the group's errors into every later row.  Reads and writes nothing else, so the
    state after a group depends only on the state before it and the group's (a, r, fit)."""
    K, N = Wt.shape
    b = a + r
    s, z, maxq = fit(g, Wt[a:b])
    blk = Wt[a:b]
    Ublk = U[a:b, a:b]
    err = torch.empty((r, N), dtype=torch.float32, device=Wt.device)
    if use_kernel if use_kernel is not None else Wt.device.type == "cpu":
        kernel = _group_kernel()
        codes_g = codes[a:b].numpy()                  # views: the kernel writes Wt and codes in place
        blk_np = blk.numpy()
        kernel(blk_np, np.ascontiguousarray(Ublk.numpy()), s.numpy(), z.numpy(), np.float32(maxq), codes_g,
               err.numpy())
    else:
        live = s > 0
        s_div = torch.where(live, s, torch.ones_like(s))
        for c in range(r):
            w = blk[c]
            q = torch.clamp(torch.round(w / s_div) + z, 0, maxq)
            q = torch.where(live, q, z)
            w_hat = ((q - z) * s).half().float()
            e = (w - w_hat) / Ublk[c, c]
            err[c] = e
            if c + 1 < r:
                # (a broadcast product: Tensor.addr_ takes a slow generic path on the CPU)
                blk[c + 1:].sub_(Ublk[c, c + 1:, None] * e[None, :])
            codes[a + c] = q.to(torch.uint8)
            blk[c] = w_hat
    if b < K:
        Wt[b:].addmm_(U[a:b, b:].T, err, alpha=-1.0)


def _sweep(Wt: torch.Tensor, U: torch.Tensor, groups: list[tuple[int, int]], fit,
           use_kernel: bool | None = None) -> torch.Tensor:
    """Run the GPTQ sweep in place on ``Wt`` float32 [K, N] (stored order).

    ``groups``: (first row, rows) per group, covering 0..K in order.  ``fit(g, X)`` gets the current rows of
    group g, float32 [r, N], and returns (scale float32 [N] of exact fp16 values, zero float32 [N], maxq);
    columns with scale 0 quantize to the zero point.  Returns the integer codes, uint8 [K, N]; on return
    ``Wt`` holds the fp16 reconstruction (as float32) of every row.  ``use_kernel``: run each group's row loop
    as the Numba kernel (default on the CPU) or as torch ops (default elsewhere); both give the same bits.
    """
    K, N = Wt.shape
    codes = torch.empty((K, N), dtype=torch.uint8, device=Wt.device)
    for g, (a, r) in enumerate(groups):
        _sweep_group(Wt, U, codes, g, a, r, fit, use_kernel)
    return codes


def _sweep_fixed_groups(Wt: torch.Tensor, U: torch.Tensor, row_group: np.ndarray, group_rows: list[np.ndarray],
                        fit, block: int = 128) -> torch.Tensor:
    """The GPTQ sweep in place on ``Wt`` float32 [K, N] (stored order) where a group is any set of stored rows:
    ``row_group`` int [K] is the group of each stored row, ``group_rows[g]`` the stored rows of group g
    (ascending).  A group's parameters are fitted (``fit(g, X)`` as in ``_sweep``) when its first row comes up,
    on the current values of all its rows, i.e. with every error pushed so far (the updates still pending in
    the current block are applied to those rows for the fit).  Rows go in blocks of ``block``: inside a block
    each row's error moves the block's later rows at once, after it the block's errors move every later row by
    one matrix product.  Returns the codes uint8 [K, N]; ``Wt`` ends as the fp16 reconstruction."""
    K, N = Wt.shape
    codes = torch.empty((K, N), dtype=torch.uint8, device=Wt.device)
    params: dict[int, tuple] = {}
    for a in range(0, K, block):
        b = min(K, a + block)
        blk = Wt[a:b]
        Ublk = U[a:b, a:b]
        err = torch.zeros((b - a, N), dtype=torch.float32, device=Wt.device)
        for c in range(b - a):
            g = int(row_group[a + c])
            if g not in params:
                rows = torch.from_numpy(np.asarray(group_rows[g], dtype=np.int64)).to(Wt.device)
                X = Wt.index_select(0, rows)
                later = rows >= b
                if c > 0 and bool(later.any()):      # pending updates of this block's rows so far
                    X[later] -= U[a:a + c].index_select(1, rows[later]).T @ err[:c]
                s_, z_, maxq = fit(g, X)
                live = s_ > 0
                params[g] = (s_, z_, maxq, live, torch.where(live, s_, torch.ones_like(s_)))
            s_, z_, maxq, live, s_div = params[g]
            w = blk[c]
            q = torch.where(live, torch.clamp(torch.round(w / s_div) + z_, 0, maxq), z_)
            w_hat = ((q - z_) * s_).half().float()
            e = (w - w_hat) / Ublk[c, c]
            err[c] = e
            if c + 1 < b - a:
                blk[c + 1:].sub_(Ublk[c, c + 1:, None] * e[None, :])
            codes[a + c] = q.to(torch.uint8)
            blk[c] = w_hat
        if b < K:
            Wt[b:].addmm_(U[a:b, b:].T, err, alpha=-1.0)
    return codes


def _work_matrix(weight: torch.Tensor, perm: torch.Tensor, n_cols: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """float [N, K] -> float32 [K, n_cols] in stored row order, zero columns beyond N (one new matrix, or written
    into ``out``, float32 [K, n_cols] C order; no float32 copy of ``weight`` is made first).  A float32 weight on
    the CPU moves through the tiles of ``gptq_kernel.permute_f32`` (torch's ``index_select`` on the transposed
    view reads with a stride of K: several times slower); the same values either way."""
    N, K = weight.shape
    w = weight.to(device=perm.device)
    if (w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
            and N * K >= _UNPERMUTE_KERNEL_MIN and (out is None or out.is_contiguous())):
        from .gptq_kernel import permute_f32

        Wt = torch.empty((K, n_cols), dtype=torch.float32) if out is None else out
        permute_f32(w.numpy(), perm.to(torch.int64).numpy(), Wt.numpy())
        if n_cols > N:
            Wt[:, N:] = 0
        return Wt
    if out is not None:
        out[:, :N] = w.T.index_select(0, perm)
        out[:, N:] = 0
        return out
    if n_cols == N:
        return w.T.index_select(0, perm).to(torch.float32)
    Wt = torch.zeros((K, n_cols), dtype=torch.float32, device=perm.device)
    Wt[:, :N] = w.T.index_select(0, perm)
    return Wt


#: Below this many elements ``_unpermute`` stays with torch (a Numba parallel launch costs more than the copy).
_UNPERMUTE_KERNEL_MIN = 1 << 18


def _unpermute(Wt_hat: torch.Tensor, perm: torch.Tensor, N: int, dtype: torch.dtype = torch.float32,
               invperm: np.ndarray | None = None) -> torch.Tensor:
    """float32 [K, N_pad] stored order -> ``dtype`` (float32 or float16) [N, K] original order.  float16 is
    exact when ``Wt_hat`` holds fp16 values (the sweep's reconstructions).  ``invperm`` int32 [K], the
    inverse of ``perm``, when the caller has it.

    On the CPU a Numba kernel moves square tiles (``gptq_kernel.unpermute_f32`` / ``unpermute_f16_bits``;
    2-3x torch's ``index_copy_`` into a transposed view, whose writes are strided, and no float32 temporary
    when float16 is asked for); elsewhere, and for small matrices, the rows are copied straight into the
    transposed view of the result: no temporary of the full matrix."""
    K = Wt_hat.shape[0]
    if Wt_hat.device.type == "cpu" and N * K >= _UNPERMUTE_KERNEL_MIN and Wt_hat.is_contiguous():
        from .gptq_kernel import unpermute_f16_bits, unpermute_f32

        if invperm is None:
            invperm = torch.argsort(perm).to(torch.int32).cpu().numpy()
        out = torch.empty((N, K), dtype=dtype)
        if dtype == torch.float16:
            unpermute_f16_bits(Wt_hat.numpy(), invperm, out.numpy().view(np.uint16))
        else:
            unpermute_f32(Wt_hat.numpy(), invperm, out.numpy())
        return out
    out = torch.empty((N, K), dtype=torch.float32, device=Wt_hat.device)
    out.T.index_copy_(0, perm, Wt_hat[:, :N])
    return out.to(dtype)


def proxy_error(weight: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor, max_rows: int = 256) -> float:
    """Relative output error on the calibration inputs: sqrt(tr(D H D^T) / tr(W H W^T)), D = w_hat - W (both
    float [N, K]), i.e. ||X D^T||_F / ||X W^T||_F.  Evaluated on at most ``max_rows`` evenly spaced output
    features (a fixed subset, ``proxy_rows``), so it costs K^2 * 256 rather than K^2 * N multiply-adds."""
    rows = proxy_rows(weight.shape[0], max_rows)
    return proxy_error_of_rows(weight[rows], w_hat[rows], H)


def proxy_rows(N: int, max_rows: int = 256) -> slice:
    """The output features ``proxy_error`` reads: every step-th, at most ``max_rows`` of them."""
    return slice(None, None, max(1, -(-N // max_rows)))


def proxy_error_of_rows(weight_rows: torch.Tensor, hat_rows: torch.Tensor, H: torch.Tensor) -> float:
    """``proxy_error`` from the rows it reads (``weight[proxy_rows(N)]``, ``w_hat[proxy_rows(N)]``, float
    [n, K], any layout): a caller that computes the error once H is back (after a sweep run without it) keeps
    only these."""
    W = weight_rows.to(torch.float32)
    D = hat_rows.to(torch.float32) - W
    num = float(torch.sum((D @ H) * D))
    den = float(torch.sum((W @ H) * W))
    return float(np.sqrt(max(num, 0.0) / den)) if den > 0 else 0.0


# ------------------------------------------------------------------------------------------------ EXL2


@dataclass(frozen=True)
class Exl2Result:
    """One quantized EXL2 layer, ready for ``exl2fmt.formats.exl2.exl2_tensors``.

    ``codes`` uint8 [K, N_pad] (stored order), ``scale_codes`` uint8 [G, N_pad] (0..15), ``q_scale_max``
    float16 [G], ``bits_rows`` [(bits, rows)] per group, ``q_invperm`` int32 [K], ``weight_hat`` float32
    (or float16: ``quantize_exl2_plans(hat_dtype=)``) [N, K] (the exact fp16 reconstruction, original order;
    None where the caller did not want it: ``quantize_exl2_plans(want_hat=)``), ``error`` (``proxy_error``; None
    where it was not computed: ``quantize_exl2_plans(error=False)``)."""

    codes: np.ndarray
    scale_codes: np.ndarray
    q_scale_max: np.ndarray
    bits_rows: list[tuple[int, int]]
    q_invperm: np.ndarray
    weight_hat: torch.Tensor | None
    error: float | None

    def tensors(self, bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
        from ..formats.exl2 import exl2_tensors

        return exl2_tensors(self.codes, self.scale_codes, self.q_scale_max, self.bits_rows, self.q_invperm, bias)


def quantize_exl2(weight: torch.Tensor, prep: Prepared, bits_rows: list[tuple[int, int]],
                  refine_scales: bool = False, hat_dtype: torch.dtype = torch.float32, error: bool = True
                  ) -> Exl2Result:
    """GPTQ-quantize ``weight`` float [N, K] to the EXL2 group plan ``bits_rows`` (``layout.plan_rows``), with
    ExLlamaV2's per-group 4-bit scale search (``exl2fmt.formats.exl2.find_scales``) on the compensated rows;
    ``refine_scales`` adds exl2fmt's per-column refinement of the scale codes (``find_scales(refine=True)``).
    The result carries ``proxy_error`` (``error=False``: None, and ``prep.H`` may be None).  (``quantize_exl2_plans``
    with one plan: the same sweep.)

    Holds ``weight`` only until its work matrix is made (and the rows the proxy error reads): a caller that
    passes a temporary (``quantize_exl2(src.get(...), ...)``) has it freed during the sweep."""
    plans = quantize_exl2_plans(weight, prep, [bits_rows], refine_scales, error=error, hat_dtype=hat_dtype)
    del weight
    return next(plans)[1]


#: ``quantize_exl2_plans`` keeps saved sweep states (the not yet processed rows of the work matrix at a point
#: where plans part) up to this many times the work matrix's own size, and never more than SHARE_CAP_BYTES (a
#: 70B down_proj's work matrix is large enough that twice it would outweigh the rest of a layer's working set).
SHARE_MATRICES = 2
SHARE_CAP_BYTES = 256 << 20


def _exl2_fit(bits: int, refine: bool, scale_codes: np.ndarray, qsm: np.ndarray, search: str = "full"):
    """The ``fit`` of ``_sweep_group`` for one EXL2 group of ``bits``: ExLlamaV2's scale search on the current
    rows (``find_scales(search=)``), its codes and q_scale_max written into ``scale_codes[g]`` / ``qsm[g]``."""
    from ..formats.exl2 import find_scales

    z = float(BIT_WIDTHS[bits].zero_point)
    maxq = float((1 << bits) - 1)

    def fit(g, X):
        c, m, s = find_scales(X.detach().cpu().numpy(), bits, refine=refine, search=search)
        scale_codes[g], qsm[g] = c, m
        s_t = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)).to(X.device)
        return s_t, torch.full_like(s_t, z), maxq
    return fit


def _common_prefix(p: tuple, q: tuple) -> int:
    n = 0
    for x, y in zip(p, q):
        if x != y:
            break
        n += 1
    return n


def quantize_exl2_plans(weight: torch.Tensor, prep: Prepared, plans: list[list[tuple[int, int]]],
                        refine_scales: bool = False, *, error: bool = False, share_bytes: int | None = None,
                        use_kernel: bool | None = None, hat_dtype: torch.dtype = torch.float32,
                        scale_search: str = "full", want_hat: Callable[[], bool] | None = None
                        ) -> Iterator[tuple[int, Exl2Result]]:
    """``quantize_exl2`` of ``weight`` for every group plan in ``plans``, sharing the work the plans have in
    common; yields ``(i, result)`` once for every index i of ``plans`` (equal plans get the same result object),
    in an order of its own.  Each result is bit for bit what ``quantize_exl2(weight, prep, plans[i])`` returns.

    Why sharing is exact: a group's step of the sweep (``_sweep_group``) reads and writes only the rows from
    the group's first row on, and depends only on them and the group's (first row, rows, bits).  Two plans
    whose first j groups are equal therefore leave the work matrix in the same state after those groups; the
    plans are taken in sorted order (a depth-first walk of the trie of their groups), and where the next plan
    parts from the current one after j groups, the rows not yet processed at that point were saved and are
    copied back (into the same matrix, so every later product sees the same memory layout) instead of
    sweeping the first j groups again (plans that part at the first group start from the weight again).  Saved
    states take at most ``share_bytes`` (default ``SHARE_MATRICES`` times the work matrix, capped at
    ``SHARE_CAP_BYTES``); past that, a plan
    restarts from the deepest state that was saved.

    ``error``: compute each result's ``proxy_error`` (the measurement does not read it; otherwise None).
    ``use_kernel``: as in ``_sweep``.  ``hat_dtype``: the results' ``weight_hat`` dtype, float32 or float16
    (the same values: the reconstruction is fp16; float16 halves what a caller that keeps it holds).
    ``scale_search``: ``find_scales(search=)`` of every group; ``"full"`` is ExLlamaV2's search, ``"bracket"`` the
    measurement's cheaper one (each result is then bit for bit that plan's own sweep with that search).
    ``want_hat``: asked once per distinct plan, just before its result is built (so it may read what the caller
    did with the results so far); False leaves that result's ``weight_hat`` None and skips its un-permute (a
    caller that parks the packed form instead: the un-permute is a measurable part of each candidate's sweep).

    With one distinct plan the weight is read once, into the work matrix, and the generator lets go of it then
    (keeping the rows ``proxy_error`` reads); the last plan's result takes the codes without copying them."""
    N, K = weight.shape
    if error and prep.H is None:
        raise ValueError("a proxy error needs the Hessian, and this Prepared was made without it")
    plans_t = [tuple((int(b), int(r)) for b, r in p) for p in plans]
    if K % 32 or any(sum(r for _, r in p) != K for p in plans_t):
        raise Exl2Error(ErrorCode.USAGE, f"EXL2 needs K % 32 == 0 and a group plan covering K={K}")
    if not plans_t:
        return
    n_pad = pad32(N)
    Wt = _work_matrix(weight, prep.perm, n_pad)
    distinct = sorted(set(plans_t))
    probe = proxy_rows(N)
    ref_rows = weight[probe].clone() if error else None        # what proxy_error reads of the weight
    if len(distinct) == 1:
        weight = None        # one sweep, never restarted from the weight: let a caller's temporary go now
    row_bytes = n_pad * Wt.element_size()
    budget = min(SHARE_MATRICES * K * row_bytes, SHARE_CAP_BYTES) if share_bytes is None else int(share_bytes)
    codes = torch.empty((K, n_pad), dtype=torch.uint8, device=Wt.device)
    G = max(len(p) for p in plans_t)
    scale_codes = np.empty((G, n_pad), dtype=np.uint8)
    qsm = np.empty(G, dtype=np.float16)
    invperm = torch.argsort(prep.perm).to(torch.int32).cpu().numpy()
    fits: dict[int, object] = {}                      # bits -> the fit of a group of that width

    # distinct plans in sorted order (the trie's depth-first order, ``distinct`` above) and the indices that ask
    # for each
    asked: dict[tuple, list[int]] = {}
    for i, p in enumerate(plans_t):
        asked.setdefault(p, []).append(i)
    # lcp[m]: groups plan m shares with plan m + 1; a state at depth d is needed again when d is one of them
    lcp = [_common_prefix(distinct[m], distinct[m + 1]) for m in range(len(distinct) - 1)]
    saved: list[tuple[int, int, torch.Tensor]] = []   # (depth, first row, Wt[row:] there), depth increasing
    depth = 0                                         # groups of the current plan that Wt has been swept through
    for m, plan in enumerate(distinct):
        starts = [0]
        for _, r in plan:
            starts.append(starts[-1] + r)
        if m > 0:                                     # back to the state after the groups shared with the last plan
            keep = lcp[m - 1]
            while saved and saved[-1][0] > keep:
                saved.pop()
            if saved:
                depth, a0, t = saved[-1]
                Wt[a0:].copy_(t)
            else:
                depth = 0
                _work_matrix(weight, prep.perm, n_pad, out=Wt)         # straight into the same matrix
        # the depths at which a later plan parts from this one, whose state is not saved yet
        need, low = set(), None
        for d in lcp[m:]:
            low = d if low is None else min(low, d)
            if low >= depth:
                need.add(low)
        for j in range(depth, len(plan)):
            a = starts[j]
            # (never at depth 0: the weight itself is the state there, rebuilt by _work_matrix as cheaply as a copy)
            if j > 0 and j in need and not (saved and saved[-1][0] == j):
                held = sum(t.numel() * t.element_size() for _, _, t in saved)
                if held + (K - a) * row_bytes <= budget:
                    saved.append((j, a, Wt[a:].clone()))
            bits, r = plan[j]
            fit = fits.get(bits)
            if fit is None:
                fit = fits[bits] = _exl2_fit(bits, refine_scales, scale_codes, qsm, scale_search)
            _sweep_group(Wt, prep.U, codes, j, a, r, fit, use_kernel)
        depth = len(plan)
        w_hat = _unpermute(Wt, prep.perm, N, hat_dtype, invperm) if error or want_hat is None or want_hat() else None
        codes_np = codes.cpu().numpy()
        if m + 1 < len(distinct):         # the next plan sweeps into the same codes; the last one's are handed over
            codes_np = codes_np.copy()
        res = Exl2Result(codes=codes_np, scale_codes=scale_codes[:len(plan)].copy(),
                         q_scale_max=qsm[:len(plan)].copy(), bits_rows=list(plan), q_invperm=invperm.copy(),
                         weight_hat=w_hat,
                         error=proxy_error_of_rows(ref_rows.to(w_hat.device), w_hat[probe], prep.H)
                         if error else None)
        del codes_np
        for i in asked[plan]:
            yield i, res


# ------------------------------------------------------------------------------------------------ GPTQ format


@dataclass(frozen=True)
class GptqResult:
    """One quantized GPTQ layer in the arrays of ``exl2fmt.formats.gptq.gptq_layer_tensors``:
    ``codes`` uint8 [K, N] (ORIGINAL row order), ``scales`` float16 [G, N], ``zeros`` int32 [G, N] (true zero
    points), ``g_idx`` int32 [K]; ``weight_hat`` float32 [N, K]; ``error`` (``proxy_error``; None from ``quantize_gptq(error=False)``)."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    bits: int
    weight_hat: torch.Tensor
    error: float | None

    def tensors(self, bias: np.ndarray | None = None, v2: bool = False) -> dict[str, np.ndarray]:
        from ..formats.gptq import gptq_layer_tensors

        return gptq_layer_tensors(self.codes, self.scales, self.zeros, self.g_idx, self.bits, v2=v2, bias=bias)


def quantize_gptq(weight: torch.Tensor, prep: Prepared, bits: int, group_size: int, *, sym: bool = True,
                  error: bool = True) -> GptqResult:
    """GPTQ-quantize ``weight`` float [N, K] to ``bits`` (2/3/4/8) with groups of ``group_size`` rows (-1 = one
    group).  With a plain act-order ``prep`` the groups are cut in processing order, so
    ``g_idx[perm[i]] = i // group_size`` (non-monotone); with a group-aware ``prep`` (``within_groups`` equal
    to the group size) each group is a run of consecutive input features processed together, so
    ``g_idx[k] = k // group_size`` (monotone) and ``scales[g]`` / ``zeros[g]`` belong to features
    g*group_size.. as without reordering.  Each group's scale (and zero point when asymmetric) is the best fp16
    fit of the compensated rows (``codec.gptq_fit.fit_group``); asymmetric zero points stay >= 1 so the
    v1 zero field is never negative.  ``error=False``: no ``proxy_error`` (None; ``prep.H`` may be None)."""
    from ..codec.gptq_fit import fit_group

    if bits not in GPTQ_BITS:
        raise Exl2Error(ErrorCode.USAGE, f"GPTQ bits must be 2, 3, 4 or 8, got {bits}")
    N, K = weight.shape
    gs = K if group_size == -1 else int(group_size)
    if gs <= 0 or K % 32 or N % 32:
        raise Exl2Error(ErrorCode.USAGE, f"GPTQ needs K and N multiples of 32 and a positive group size "
                        f"(K={K}, N={N}, group size {group_size})")
    fixed = prep.fixed_groups is not None
    if fixed and prep.fixed_groups != gs:
        raise Exl2Error(ErrorCode.USAGE, f"an act-order with fixed {prep.fixed_groups}-feature groups cannot make "
                        f"GPTQ groups of {gs} rows")
    if prep.within_groups is not None and prep.within_groups != gs:
        raise Exl2Error(ErrorCode.USAGE, f"a group-aware order of {prep.within_groups}-feature groups cannot make "
                        f"GPTQ groups of {gs} rows")
    Wt = _work_matrix(weight, prep.perm, N)
    G = -(-K // gs)
    scales = np.empty((G, N), dtype=np.float16)
    zeros = np.empty((G, N), dtype=np.int32)
    perm = prep.perm.cpu().numpy()
    if prep.within_groups is None:
        groups = [(h * gs, min(gs, K - h * gs)) for h in range(G)]
        gid = list(range(G))                       # stored group h is group h
    else:
        groups, gid, a = [], [], 0                 # whole feature groups, in the order they are processed
        while a < K:
            g = int(perm[a]) // gs
            r = min(gs, K - g * gs)
            groups.append((a, r))
            gid.append(g)
            a += r
    maxq = float((1 << bits) - 1)

    def fit(g, X):
        _, s, z = fit_group(X.detach().cpu().numpy(), bits, sym, want_codes=False)
        scales[gid[g]], zeros[gid[g]] = s, z
        return (torch.from_numpy(s.astype(np.float32)).to(X.device),
                torch.from_numpy(z.astype(np.float32)).to(X.device), maxq)

    if fixed:                                      # groups of consecutive features, rows in full act-order
        row_group = perm // gs
        gid = list(range(G))
        codes_stored = _sweep_fixed_groups(Wt, prep.U, row_group, [np.nonzero(row_group == g)[0] for g in range(G)],
                                           fit)
    else:
        codes_stored = _sweep(Wt, prep.U, groups, fit)
    codes = np.empty((K, N), dtype=np.uint8)
    codes[perm] = codes_stored.cpu().numpy()
    g_idx = np.empty(K, dtype=np.int32)
    if fixed:
        g_idx[:] = np.arange(K) // gs
    else:
        for (a, r), g in zip(groups, gid):
            g_idx[perm[a:a + r]] = g
    w_hat = _unpermute(Wt, prep.perm, N)
    return GptqResult(codes=codes, scales=scales, zeros=zeros, g_idx=g_idx, bits=bits, weight_hat=w_hat,
                      error=proxy_error(weight.to(w_hat.device), w_hat, prep.H) if error else None)
