"""Triton kernels for GPTQ layers (2, 4 and 8 bits): dequantize, and a fused dequantize-matmul.

Reached through ``exl2fmt.kernels.load_triton(device)`` like the EXL2 kernels (this module is imported by
``exl2_triton``, after the interpreter mode is chosen), as ``kt.gptq_dequantize`` and ``kt.gptq_matmul``.

Layout (spec/gptq.md; gptq-gguf-formats A2), arrays as stored:
* ``qweight`` int32 [K*b/32, N]: along K, 32/b codes per word, code of row k in bits [(k % P)*b, (k % P)*b + b)
  of word row k // P (P = 32/b codes per word; 3-bit codes straddle words and are not handled here).
* ``qzeros`` int32 [G, N*b/32]: the zero-point fields, packed the same way along N.  v1 (``checkpoint_format``
  "gptq") stores z - 1, read as z = field + 1 without masking (like the exllama/vLLM kernels and
  ``exl2fmt.codec.gptq``); v2 stores z.
* ``scales`` float16 [G, N]; ``g_idx`` int32 [K], the group of each input row (act-order: any order).

Arithmetic, bit for bit as the reference (``exl2fmt.codec.gptq.dequantize``):
    w[k, n] = fp16(fp16(q - z) * s),  g = g_idx[k]
(q - z is an integer of at most 9 bits, exact in fp16; the product of two fp16 values is exact in fp32, so one
rounding to fp16 gives the fp16 product).  GPTQ rows are stored in their original order, so act-order needs no
gather of x: each row finds its group through ``g_idx``.

``gptq_matmul`` paths: ``"fused"`` (M <= FUSED_MAX_M) decodes a [BLOCK_K, BLOCK_N] weight tile per step and
accumulates ``tl.dot`` in fp32 (fp16 x: fp16 operands, exact products; bf16 x: both operands in fp32 with
IEEE products); ``"dense"`` dequantizes W [K, N] in x's dtype and calls ``torch.matmul`` (bf16 x: each weight
rounded once to bf16).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ..layout import GPTQ_BITS, GptqSlot
from ._triton_common import round_out, check_outputs

__all__ = ["gptq_dequantize", "gptq_matmul", "check_gptq_layer", "GPTQ_KERNEL_BITS", "FUSED_MAX_M"]

#: Widths whose codes never straddle an int32 word.
GPTQ_KERNEL_BITS = tuple(b for b in GPTQ_BITS if 32 % b == 0)
#: Largest M (rows of x) for the fused path by default.
FUSED_MAX_M = 64


@triton.jit
def _decode_tile(qw_ptr, stride_qw, qz_ptr, stride_qz, sc_ptr, stride_sc, gi_ptr, offs_k, k_mask, offs_n, n_mask,
                 BITS: tl.constexpr, ZERO_ADD: tl.constexpr):
    """The fp16 weights w [BLOCK_K, BLOCK_N] of rows ``offs_k`` and columns ``offs_n`` (0 where masked)."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = k_mask[:, None] & n_mask[None, :]
    words = tl.load(qw_ptr + (offs_k // PER)[:, None] * stride_qw + offs_n[None, :], mask=mask, other=0)
    q = (words >> ((offs_k % PER) * BITS)[:, None]) & MASK
    g = tl.load(gi_ptr + offs_k, mask=k_mask, other=0)
    zw = tl.load(qz_ptr + g[:, None] * stride_qz + (offs_n // PER)[None, :], mask=mask, other=0)
    z = ((zw >> ((offs_n % PER) * BITS)[None, :]) & MASK) + ZERO_ADD
    s = tl.load(sc_ptr + g[:, None] * stride_sc + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    w = ((q - z).to(tl.float32) * s).to(tl.float16)
    return tl.where(mask, w, 0.0)


@triton.jit
def _dequant_kernel(qw_ptr, stride_qw, qz_ptr, stride_qz, sc_ptr, stride_sc, gi_ptr, out_ptr, stride_ok, K, N,
                    BITS: tl.constexpr, ZERO_ADD: tl.constexpr, OUT_BF16: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [K, N] (x's dtype) = the fp16 weights, one [BLOCK_K, BLOCK_N] tile per program."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    w = _decode_tile(qw_ptr, stride_qw, qz_ptr, stride_qz, sc_ptr, stride_sc, gi_ptr, offs_k, k_mask, offs_n,
                     n_mask, BITS, ZERO_ADD)
    if OUT_BF16:
        w = round_out(w.to(tl.float32), True)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w, mask=k_mask[:, None] & n_mask[None, :])


@triton.jit
def _matmul_kernel(x_ptr, stride_xm, qw_ptr, stride_qw, qz_ptr, stride_qz, sc_ptr, stride_sc, gi_ptr, bias_ptr,
                   y_ptr, stride_ym, M, N, K,
                   BITS: tl.constexpr, ZERO_ADD: tl.constexpr, X_BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [M, N] = x [M, K] @ W + bias, W decoded tile by tile, fp32 accumulation, rounded once to x's dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = _decode_tile(qw_ptr, stride_qw, qz_ptr, stride_qz, sc_ptr, stride_sc, gi_ptr, offs_k, k_mask, offs_n,
                         n_mask, BITS, ZERO_ADD)
        if X_BF16:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = round_out(acc, X_BF16)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def _check(qweight, qzeros, scales, g_idx, bits: int, device) -> tuple[int, int, int]:
    """Shapes, dtypes and devices of a GPTQ layer; returns (K, N, G).  Raises ValueError with the numbers."""
    if bits not in GPTQ_KERNEL_BITS:
        raise ValueError(f"the GPTQ kernels handle {GPTQ_KERNEL_BITS}-bit codes, not {bits}")
    for name, t, dt in ((GptqSlot.QWEIGHT, qweight, torch.int32), (GptqSlot.QZEROS, qzeros, torch.int32),
                        (GptqSlot.SCALES, scales, torch.float16), (GptqSlot.G_IDX, g_idx, torch.int32)):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or t.device != device:
            raise ValueError(f"{name} must be a {dt} tensor on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '-')}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if qweight.dim() != 2 or scales.dim() != 2 or qzeros.dim() != 2 or g_idx.dim() != 1:
        raise ValueError("expected qweight [K*b/32, N], qzeros [G, N*b/32], scales [G, N], g_idx [K]")
    per = 32 // bits
    K, N = qweight.shape[0] * per, qweight.shape[1]
    G = scales.shape[0]
    if scales.shape[1] != N or qzeros.shape != (G, -(-N // per)) or g_idx.shape[0] != K:
        raise ValueError(f"inconsistent GPTQ layer: qweight {tuple(qweight.shape)} -> K={K}, N={N}; scales "
                         f"{tuple(scales.shape)}, qzeros {tuple(qzeros.shape)} (want ({G}, {-(-N // per)})), g_idx "
                         f"{tuple(g_idx.shape)} (want ({K},))")
    if K and G == 0:
        raise ValueError(f"scales hold no groups for K={K} rows")
    return K, N, G


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, *, v2: bool = False, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W [K, N] in ``dtype`` (float16: bit-exact with ``exl2fmt.codec.gptq.dequantize``, which returns W^T).

    ``qweight`` int32 [K*b/32, N], ``qzeros`` int32 [G, N*b/32], ``scales`` float16 [G, N], ``g_idx`` int32 [K]
    (values must lie in 0..G-1: the kernel does not check them), all contiguous on one device."""
    dev = qweight.device
    K, N, _ = _check(qweight, qzeros, scales, g_idx, bits, dev)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    out = torch.empty((K, N), dtype=dtype, device=dev)
    if K and N:
        BK, BN = 32, 64
        _dequant_kernel[(triton.cdiv(K, BK), triton.cdiv(N, BN))](
            qweight, qweight.stride(0), qzeros, qzeros.stride(0), scales, scales.stride(0), g_idx, out, out.stride(0),
            K, N, BITS=bits, ZERO_ADD=0 if v2 else 1, OUT_BF16=dtype == torch.bfloat16, BLOCK_K=BK, BLOCK_N=BN)
    return out


def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, *, v2: bool = False, bias: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W (+ bias [N]) in x's dtype (float16 or bfloat16, contiguous), W the GPTQ layer's
    fp16 weights (see ``gptq_dequantize``).  ``path``: "fused" or "dense" (default: fused for M <=
    FUSED_MAX_M)."""
    dev = qweight.device
    K, N, _ = _check(qweight, qzeros, scales, g_idx, bits, dev)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != K or x.device != dev \
            or x.dtype not in (torch.float16, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float16/bfloat16 [M, {K}] tensor on {dev}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if bias is not None and (bias.shape != (N,) or bias.device != dev or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [{N}] tensor on {dev}, got {tuple(bias.shape)}")
    M = x.shape[0]
    path = path or ("fused" if M <= FUSED_MAX_M else "dense")
    if path == "dense":
        W = gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2=v2, dtype=x.dtype)
        return torch.matmul(x, W) if bias is None else torch.addmm(bias.to(x.dtype), x, W)
    if path != "fused":
        raise ValueError(f"path must be 'fused' or 'dense', got {path!r}")
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    if M and N:
        BM = 16 if M <= 16 else 32 if M <= 32 else 64
        BN, BK = 64, 32
        b = bias.contiguous() if bias is not None else y
        _matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            x, x.stride(0), qweight, qweight.stride(0), qzeros, qzeros.stride(0), scales, scales.stride(0), g_idx,
            b, y, y.stride(0), M, N, K, BITS=bits, ZERO_ADD=0 if v2 else 1, X_BF16=x.dtype == torch.bfloat16,
            HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return y


def check_gptq_layer(layer: Any, device: torch.device | str | None = None, ms: tuple[int, ...] = (1, 16),
                     paths: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """Run one ``exl2fmt.formats.gptq.GptqLinear`` (2/4/8 bits) through the GPTQ kernels on random inputs and compare
    with the Numba reference, with the same inputs, bound and result dict as the EXL2 ``check_layer`` (what
    ``exl2fmt validate --kernel`` reports per layer).  A layer without g_idx gets the contiguous one of its group
    size; scales stored as bf16/fp32 are rounded to fp16 first, as the reference does (``GptqLinear.group_index``,
    ``GptqLinear.scales_f16``)."""
    t0 = time.perf_counter()
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    t = layer.tensors
    bits = int(layer.bits)
    w16 = np.asarray(layer.dequantize(), dtype=np.float16)                  # [N, K], the reference

    def dev_t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    qw = dev_t(np.asarray(t[GptqSlot.QWEIGHT]).view(np.int32))
    qz = dev_t(np.asarray(t[GptqSlot.QZEROS]).view(np.int32))
    sc, gi = dev_t(layer.scales_f16()), dev_t(layer.group_index())
    w_ref = dev_t(w16.T)                                                    # float16 [K, N]
    got = gptq_dequantize(qw, qz, sc, gi, bits, v2=bool(layer.v2))
    mism = int((got.view(torch.int16) != w_ref.view(torch.int16)).sum())
    del got
    b = layer.bias()
    bias = None if b is None else dev_t(np.asarray(b, dtype=np.float16))
    results = check_outputs(lambda x, path: gptq_matmul(x, qw, qz, sc, gi, bits, v2=bool(layer.v2), bias=bias,
                                                        path=path),
                            w_ref, b, ms, paths or {M: ("fused" if M <= FUSED_MAX_M else "dense",) for M in ms},
                            seed)
    return {"dequant_exact": mism == 0, "mismatches": mism, "block_n": None, "results": results,
            "seconds": round(time.perf_counter() - t0, 3)}
