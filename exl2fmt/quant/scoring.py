"""How the EXL2 measurement multiplies a candidate when it scores an option: in fp32, or as the candidate's
*difference* from the reference layer in bf16.

Scoring an option runs the block with candidate weights W_hat in place of W and compares the block's output with
the reference output.  What the comparison needs is the output's change, a few per mille to a few per cent of
the output.  For a linear whose input x differs from its reference input x_ref by dx (dx = 0 for the first
linears of a block, which read the block's own input)::

    x @ W_hat.T  =  x_ref @ W.T  +  dx @ W.T  +  x @ (W_hat - W).T
                    (recorded)      (bf16)       (bf16)

The first term is the reference sweep's own fp32 output, recorded once per block (``ReferenceTape``); the other
two are products of small quantities, so computing them in bf16 (8 significant bits, fp32 accumulation on
AMX/AVX512-BF16 or a GPU) changes the output by ~2^-9 *of the change*, not of the output: the scored error moves
by a few per mille of itself.  bf16 products on such hardware are 5-6x fp32's (bench/RESULTS.md, issue 18, where
the A/B of the plans chosen with each precision is recorded).  Where bf16 products are not fast the
measurement stays in fp32 (``resolve_precision``).
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch

from ..errors import ErrorCode, Exl2Error
from ..runner.weights import Linear

#: --measure-precision values: "auto" resolves to "bf16" where bf16 products are fast, else "fp32"
PRECISIONS = ("auto", "fp32", "bf16")

#: Blocks whose taped linears hold fewer weights than this are scored in fp32 even with precision "bf16": their
#: products are too small for bf16's speed to repay the recording forward and the differences' bookkeeping
#: (measured on the trained fixture and a 1B layer: bench/RESULTS.md).
DELTA_MIN_WEIGHTS = 1 << 22


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products on ``device`` are hardware-accelerated (CUDA with bf16 support; a CPU with AMX
    tiles or AVX512-BF16).  Unknown means no."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
            f = getattr(torch.cpu, probe, None)
            try:
                if f is not None and f():
                    return True
            except Exception:                     # a private probe that changed: treat as unknown
                pass
    return False


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``precision`` ("auto", "fp32" or "bf16") made concrete for ``device``."""
    if precision not in PRECISIONS:
        raise Exl2Error(ErrorCode.USAGE, f"--measure-precision must be one of {', '.join(PRECISIONS)}, got "
                        f"{precision!r}")
    if precision == "auto":
        return "bf16" if fast_bf16(torch.device(device)) else "fp32"
    return precision


class ReferenceTape:
    """The reference inputs and outputs of a block's linears on the scoring rows, recorded while the block's
    reference sweep runs.

    ``recorder(n, f)`` wraps the reference linear ``f`` of linear ``n``: its first ``n_score`` calls (one per
    batch, in batch order) are recorded, the input once per shared-input group (``group_of(n)``, e.g. q/k/v
    share theirs), as float32 copies (the forward cannot alter them later).  A linear the sweep did not call
    exactly ``n_batches`` times (once per batch) is not ``usable`` and its records are dropped by ``close``."""

    def __init__(self, names, group_of: Callable[[str], str], n_score: int, n_batches: int):
        self.names, self.group_of = list(names), group_of
        self.n_score, self.n_batches = n_score, n_batches
        self.x: dict[tuple[str, int], torch.Tensor] = {}     # (group, batch) -> input float32 [..., K]
        self.y: dict[tuple[str, int], torch.Tensor] = {}     # (linear, batch) -> output float32 [..., N]
        self.calls = dict.fromkeys(self.names, 0)
        self._w16: dict[str, torch.Tensor] = {}
        self._x16: dict[tuple[str, int], torch.Tensor] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}
        # (group, batch) -> (the input last compared with the recorded one, its version counter, equal?): the
        # linears of a group get the same input tensor in one forward (q/k/v, gate/up), so one comparison serves
        # them all while the tensor is unchanged (the reference is kept alive with it: no id reuse)
        self._same: dict[tuple, tuple] = {}

    def scratch(self, tag, shape, dtype=torch.bfloat16, device=None) -> torch.Tensor:
        """A buffer kept for reuse under ``tag`` (the bf16 temporaries of every option would otherwise be fresh
        heap blocks between the fp32 ones, and the heap would fragment: part of the +0.39 GB the first version
        added to the 1B MLP block's peak)."""
        t = self._scratch.get(tag)
        if t is None or t.shape != tuple(shape) or t.dtype != dtype:
            t = self._scratch[tag] = torch.empty(shape, dtype=dtype, device=device)
        return t

    def recorder(self, n: str, f: Linear) -> Linear:
        if n not in self.calls:
            return f

        def apply(x: torch.Tensor) -> torch.Tensor:
            bi = self.calls[n]
            self.calls[n] = bi + 1
            y = f(x)
            if bi < self.n_score:
                g = (self.group_of(n), bi)
                if g not in self.x:
                    self.x[g] = x.detach().to(torch.float32, copy=True)
                self.y[(n, bi)] = y.detach().to(torch.float32, copy=True)
            return y
        return apply

    def close(self) -> None:
        """The reference sweep is over: forget the linears not called once per batch."""
        for n in [n for n, c in self.calls.items() if c != self.n_batches]:
            del self.calls[n]
            for bi in range(self.n_score):
                self.y.pop((n, bi), None)
        live = {(self.group_of(n), bi) for n in self.calls for bi in range(self.n_score)}
        for g in [g for g in self.x if g not in live]:
            del self.x[g]

    def usable(self, n: str) -> bool:
        return n in self.calls and all((n, bi) in self.y for bi in range(self.n_score))

    def is_reference_input(self, g: tuple[str, int], x: torch.Tensor) -> bool:
        """Whether ``x`` equals, bit for bit, the recorded input ``g`` = (group, batch) (``torch.equal``, done once
        per input tensor and batch while the tensor is not written to)."""
        try:
            version = x._version
        except RuntimeError:                         # an inference-mode tensor keeps no version counter
            return torch.equal(x, self.x[g])
        hit = self._same.get(g)
        if hit is not None and hit[0] is x and hit[1] == version:
            return hit[2]
        same = torch.equal(x, self.x[g])
        self._same[g] = (x, version, same)
        return same

    def input_bf16(self, g: tuple[str, int]) -> torch.Tensor:
        """The recorded input ``g`` = (group, batch) in bf16, made once."""
        t = self._x16.get(g)
        if t is None:
            t = self._x16[g] = self.x[g].to(torch.bfloat16)
        return t

    def weight_bf16(self, n: str, w: torch.Tensor) -> torch.Tensor:
        """W of linear ``n`` in bf16 (for the dx @ W.T term), made once per block."""
        t = self._w16.get(n)
        if t is None:
            t = self._w16[n] = w.to(torch.bfloat16)
        return t


def _u16(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a contiguous 2-byte CPU tensor (fp16 / bf16) as uint16, same shape, no copy."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])          # a view: callers pass contiguous tensors


def _kernel_ok(*ts: torch.Tensor) -> bool:
    """Whether the Numba kernels can take these operands (CPU, C order, one shape, not 0-d)."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dim() > 0 and t.shape == ts[0].shape
               for t in ts)


def sub_bf16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` bf16 = a - b, both widened to float32 exactly, the difference in float32 and rounded once, for
    ``a`` float16 or float32 and ``b`` float32, float16 or bfloat16, all of one shape (``b`` in 16 bits: the exact
    copy of a float32 weight, ``exact_16bit``, gives the bits of that weight); on the CPU by ``scoring_kernel``
    (torch's mixed-dtype loop is much slower there), the same bits."""
    if (_kernel_ok(a, b, out) and out.dtype == torch.bfloat16 and a.dtype in (torch.float16, torch.float32)
            and (b.dtype == torch.float32 or (a.dtype == torch.float16 and b.dtype in (torch.float16,
                                                                                      torch.bfloat16)))):
        from . import scoring_kernel as k

        if b.dtype == torch.float16:
            k.sub_f16_f16_to_bf16(_u16(_rows(a)), _u16(_rows(b)), _u16(_rows(out)))
        elif b.dtype == torch.bfloat16:
            k.sub_f16_bf16_to_bf16(_u16(_rows(a)), _u16(_rows(b)), _u16(_rows(out)))
        elif a.dtype == torch.float16:
            k.sub_f16_to_bf16(_u16(_rows(a)), _rows(b).numpy(), _u16(_rows(out)))
        else:
            k.sub_f32_to_bf16(_rows(a).numpy(), _rows(b).numpy(), _u16(_rows(out)))
        return out
    # (two 16-bit operands would be subtracted in their own dtype and rounded twice: b is widened first)
    return torch.sub(a, b if b.dtype == torch.float32 else b.to(torch.float32), out=out)


def exact_16bit(w: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """float32 ``w`` as a float16 (else bfloat16) copy when that copy holds every value exactly (a weight read
    from a 16-bit checkpoint: half the bytes), else ``w`` itself.  Checked value by value in
    chunks of ``chunk`` elements (NaN never passes: its payload may not survive the round trip)."""
    if w.dtype != torch.float32:
        return w
    flat = w.reshape(-1)
    for dt in (torch.float16, torch.bfloat16):
        n = w.to(dt)
        nf = n.reshape(-1)
        if all(torch.equal(nf[i:i + chunk].to(torch.float32), flat[i:i + chunk])
               for i in range(0, flat.numel(), chunk)):
            return n
    return w


def add_bf16(y: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``y`` + bf16 ``p`` (``torch.add(y, p, out=out)``) into ``out`` (a new tensor if None; may be ``y``
    itself); on the CPU by ``scoring_kernel``, the same bits."""
    out = torch.empty_like(y) if out is None else out
    if _kernel_ok(y, p, out) and y.dtype == out.dtype == torch.float32 and p.dtype == torch.bfloat16:
        from . import scoring_kernel as k

        k.add_bf16(_rows(y).numpy(), _u16(_rows(p)), _rows(out).numpy())
        return out
    return torch.add(y, p, out=out)


class DeltaLinear:
    """A candidate W_hat of linear ``n`` scored as the reference output plus bf16 products of the differences
    (module docstring).  ``w`` float32 [N, K] is the reference weight (row n = output feature n) or its exact
    16-bit copy (``exact_16bit``: the same differences and bf16 weight, bit for bit), ``w_hat`` any float [N, K]
    the candidate; the bias is the reference's and sits in the recorded output already."""

    def __init__(self, tape: ReferenceTape, n: str, w: torch.Tensor, w_hat: torch.Tensor):
        self.tape, self.n, self.w = tape, n, w
        self.g = tape.group_of(n)
        # bf16 [N, K]: W_hat - W, in fp32 (w is) and rounded once; one buffer per linear (the cache holds one
        # candidate per linear at a time)
        self.d16 = tape.scratch(("dW", n), w.shape, device=w.device)
        sub_bf16(w_hat, w, self.d16)

    def bind(self) -> Linear:
        """The linear for one option sweep: its k-th call is batch k of the scoring rows."""
        calls = itertools.count()
        tape = self.tape

        def apply(x: torch.Tensor) -> torch.Tensor:
            bi = next(calls)
            if bi >= tape.n_score:
                raise RuntimeError(f"{self.n}: call {bi + 1} in one sweep, the tape holds {tape.n_score} batches")
            x_ref, y_ref = tape.x[(self.g, bi)], tape.y[(self.n, bi)]
            if x.shape != x_ref.shape:
                raise RuntimeError(f"{self.n}: batch {bi} input {tuple(x.shape)} is not the recorded "
                                   f"{tuple(x_ref.shape)}")
            key = (self.g, bi)
            prod = tape.scratch(("y", y_ref.shape), y_ref.shape, device=x.device)
            if tape.is_reference_input(key, x):      # a first linear: the block's own input, dx = 0
                return add_bf16(y_ref, torch.matmul(tape.input_bf16(key), self.d16.t(), out=prod))
            x16 = tape.scratch(("x", x.shape), x.shape, device=x.device)
            y = add_bf16(y_ref, torch.matmul(x16.copy_(x), self.d16.t(), out=prod))
            sub_bf16(x.contiguous(), x_ref, x16)     # dx, in fp32, rounded once to bf16
            return add_bf16(y, torch.matmul(x16, tape.weight_bf16(self.n, self.w).t(), out=prod), y)
        return apply
