"""Triton helpers shared by the EXL2 and GPTQ kernels (imported after ``load_triton`` chose the mode)."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import triton
import triton.language as tl

#: Reference outputs are computed over column chunks of at most this many float64 weights.
_REF_CHUNK_ELEMS = 1 << 24


@triton.jit
def round_out(acc, OUT_BF16: tl.constexpr):
    """fp32 -> fp16 or bf16, round to nearest even.  The bf16 rounding is spelled out on the bits so that the
    interpreter (whose bf16 cast truncates) rounds exactly like the GPU."""
    if OUT_BF16:
        u = acc.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(acc != acc, 0x7FC0, r)  # NaN stays a quiet NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(tl.float16)


def check_outputs(matmul: Callable[[torch.Tensor, str], torch.Tensor], w_ref: torch.Tensor,
                  bias: np.ndarray | None, ms, paths, seed: int) -> list[dict]:
    """Run ``matmul(x, path)`` (-> y float16 [M, N]) for every M in ``ms`` and path in ``paths[M]`` (or
    ``paths`` itself when it is a tuple) on x float16 [M, K], unit-normal, drawn on the CPU from ``seed``, and
    compare with x @ ``w_ref`` (float16 [K, N], on the kernel's device) + ``bias`` in float64, chunked over N.

    An output is within the bound when |y - y_ref| <= u_out |y_ref| + 2 (K + 1) 2^-24 (|x| @ |W| + |bias|):
    fp32 accumulation of exact products, one rounding to fp16.  Returns [{"M", "path", "max_rel_err" (max
    |y - y_ref| / max |y_ref|; None when not finite), "within_bound", "outside" (outputs outside the bound, NaN
    included), "nonfinite"}]."""
    dev = w_ref.device
    K, N = int(w_ref.shape[0]), int(w_ref.shape[1])
    b64 = None if bias is None else torch.from_numpy(np.asarray(bias, dtype=np.float64)).to(dev)
    gen = torch.Generator().manual_seed(int(seed))
    step = max(1, _REF_CHUNK_ELEMS // max(K, 1))
    u_out = 2.0 ** -11 * (1 + 2.0 ** -10)
    acc = 2 * (K + 1) * 2.0 ** -24
    results = []
    for M in ms:
        x = torch.randn(M, K, generator=gen).half().to(dev)
        xd = x.double()
        xa = xd.abs()
        for path in (paths[M] if isinstance(paths, dict) else paths):
            y = matmul(x, path)
            nonfinite = int((~torch.isfinite(y)).sum())
            err_max = ref_max = 0.0
            outside = 0
            nan = False
            for n0 in range(0, N, step):
                n1 = min(N, n0 + step)
                W = w_ref[:, n0:n1].double()
                r = xd @ W
                A = xa @ W.abs()
                if b64 is not None:
                    r += b64[n0:n1]
                    A += b64[n0:n1].abs()
                e = (y[:, n0:n1].double() - r).abs()
                outside += int((~(e <= u_out * r.abs() + acc * A)).sum())  # NaN counts as outside
                nan = nan or bool(torch.isnan(e).any())
                err_max = max(err_max, float(torch.nan_to_num(e, nan=0.0, posinf=math.inf).max()))
                ref_max = max(ref_max, float(torch.nan_to_num(r.abs(), nan=0.0, posinf=math.inf).max()))
                del W, r, A, e
            rel = math.nan if nan else err_max / max(ref_max, 1e-300)
            results.append({"M": int(M), "path": path, "max_rel_err": rel if math.isfinite(rel) else None,
                            "within_bound": outside == 0, "outside": outside, "nonfinite": nonfinite})
    return results
