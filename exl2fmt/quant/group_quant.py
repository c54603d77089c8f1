"""One group of linears that share an input quantized from its Hessian (``quantize_group``): the step of the
quantize pass that the driver runs itself or hands to a Ray worker (``distributed_quant``), with the same code
either way, so the bytes do not depend on where it ran.

A group is what ``spec.groups`` lists: linears reading one input (q/k/v, gate/up, one expert's gate/up, a
single o/down projection).  ``GroupTask`` carries everything besides the arrays that decides the result (the
EXL2 plan of each linear or the GPTQ settings, the damping and the order), so a worker needs only the task, the
Hessian and the group's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import gptq, job
from .gptq import proxy_error_of_rows, proxy_rows, quantize_exl2, quantize_gptq
from .report import bpw_of, plan_of

__all__ = ["GroupTask", "Quantized", "quantize_group", "rows_error", "probe_digest"]


@dataclass(frozen=True)
class GroupTask:
    """What decides one group's result besides its arrays.  ``names`` / ``keys``: the linears (in the order the
    one-process pass quantizes them) and their checkpoint keys; ``plans``: per linear the EXL2 group plan
    [(bits, rows)] (``layout.plan_rows``), or None for GPTQ; ``gptq``: (bits, group size, sym) for GPTQ;
    ``prepare``: the keyword arguments of ``gptq.prepare`` (damping, act-order, group-aware / fixed groups);
    ``rows_error``: compute the proxy errors from the rows they read once the group is done, as the driver does
    when it parks a large Hessian on disk meanwhile (``job.SPILL_MIN_BYTES``) — the same values, computed the same
    way wherever the group runs."""

    names: tuple[str, ...]
    keys: tuple[str, ...]
    target: str
    plans: tuple | None
    refine_scales: bool
    gptq: tuple[int, int, bool] | None
    prepare: dict = field(default_factory=dict)
    rows_error: bool = False


@dataclass
class Quantized:
    """One quantized linear: ``tensors`` (slot -> array, the packed layer with its bias), ``hat`` (the
    reconstruction, float32 or float16 [N, K]: fp16 values either way), its ``plan`` and ``bpw`` as the report
    names them, and its proxy ``error``."""

    name: str
    key: str
    tensors: dict | None
    hat: torch.Tensor
    plan: str
    bpw: float
    error: float | None = None
    probe: tuple | None = None        # (weight rows, reconstruction rows) until the error is computed


def rows_error(K: int, device) -> bool:
    """Whether the driver parks a K-feature Hessian on disk during its group (and so computes the proxy errors
    from rows afterwards): on the CPU, at ``job.SPILL_MIN_BYTES`` and above."""
    return bool(job.SPILL_HESSIANS and torch.device(device).type == "cpu" and K * K * 4 >= job.SPILL_MIN_BYTES)


def quantize_group(task: GroupTask, H: torch.Tensor, weights: list, spill: Path | None = None,
                   on_linear: Callable[[Quantized], None] | None = None) -> list[Quantized]:
    """Quantize the linears of ``task`` with the Hessian ``H`` float32 [K, K] (the group's input second moment,
    padded for an expert with few tokens; pass a temporary: it is let go of once factored when ``rows_error``).
    ``weights``: per linear (weight float32 [N, K], bias float32 [N] or None); each entry is set to None once its
    linear is done.  ``spill``: where the driver parks ``H`` meanwhile (None: kept in memory).  ``on_linear``
    sees each result as it is made (the driver writes it and swaps it in); the errors are filled in by the time
    this returns."""
    K = H.shape[0]
    keep = not task.rows_error
    H = job.spilled(H, spill)
    prep = gptq.prepare(H, keep_hessian=keep, **task.prepare)
    if spill is not None:
        H = None
    out: list[Quantized] = []
    r = None
    for j, (n, key) in enumerate(zip(task.names, task.keys)):
        w, b = weights[j]
        weights[j] = None
        if task.target == "exl2":
            r = quantize_exl2(w, prep, list(task.plans[j]), task.refine_scales, error=keep)
        else:
            bits, gs, sym = task.gptq
            r = quantize_gptq(w, prep, bits, gs, sym=sym, error=keep)
        packed = r.tensors(None if b is None else b.cpu().numpy())
        N = w.shape[0]
        q = Quantized(n, key, packed, r.weight_hat, plan_of(r), bpw_of(packed, N), r.error,
                      None if keep else (w[proxy_rows(N)].clone(), r.weight_hat[proxy_rows(N)].clone()))
        w = b = packed = None
        if on_linear is not None:
            on_linear(q)
        out.append(q)
    if not keep:                     # the factor and sweeps are done with: the Hessian back for the errors
        prep = r = None
        if spill is not None:
            H = job.unspilled(spill, K)
        for q in out:
            q.error, q.probe = proxy_error_of_rows(*q.probe, H), None
    return out


def probe_digest(device: str = "cpu") -> str:
    """A digest of a small fixed GPTQ problem (a seeded 256-feature Hessian, an EXL2 and a GPTQ linear through
    ``quantize_group``): a worker whose libraries or hardware compute other bits than the driver's shows it here
    before its results enter the output (``distributed_quant``; the measurement has its own check)."""
    import hashlib

    g = torch.Generator().manual_seed(36)
    X = torch.randn((512, 256), generator=g)
    H = (X.T @ X).div_(512).to(device)
    w = (torch.randn((256, 256), generator=g) * 0.05).to(device)
    h = hashlib.blake2b(digest_size=16)
    for target in ("exl2", "gptq"):
        task = GroupTask(("w",), ("w",), target, (((4, 128), (3, 128)),) if target == "exl2" else None, False,
                         None if target == "exl2" else (4, 128, True), dict(percdamp=0.01, act_order=True))
        for q in quantize_group(task, H.clone(), [(w, None)]):
            h.update(q.hat.cpu().numpy().tobytes())
            for k in sorted(q.tensors):
                h.update(k.encode() + q.tensors[k].tobytes())
            h.update(repr(q.error).encode())
    return h.hexdigest()
