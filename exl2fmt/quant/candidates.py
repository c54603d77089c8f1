"""The measurement's candidates: every distinct candidate setting of a block's linears GPTQ-quantized
(``make_variants``), kept in memory as fp16 reconstructions up to a budget or parked on disk packed; handed to the
option scoring one at a time (``VariantCache``, as dense linears or bf16 differences from the reference), and the
outputs of a block's first linears reused by later options with the same candidate (``SharedOutputs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..formats import layer_from_tensors
from . import gptq
from .job import load_tensors, save_tensors
from .scoring import DeltaLinear
from ..runner.weights import dense_linear

__all__ = ["CANDIDATES_IN_MEMORY", "make_variants", "kept_bytes", "candidate_weight", "candidate_tensors",
           "weight_from_candidate_tensors", "VariantCache", "SharedOutputs"]


#: The measurement keeps the fp16 reconstructions of a block's candidates in memory up to this many bytes (each
#: is exactly what its packed file dequantizes to); the rest are parked on disk, packed, and dequantized back
#: when scored, so memory stays bounded however large the layers are.
CANDIDATES_IN_MEMORY = 64 << 20
#: ... and only candidates of at most this many bytes: parking a small one costs more time than its memory is
#: worth, while keeping large ones only raises the peak (measured: bench/RESULTS.md, "Figures moved out of code
#: comments")
_CANDIDATE_IN_MEMORY_MAX = 4 << 20


def make_variants(blk, W, hess, options, vdir: Path, refine_scales: bool, in_memory: int | None = None,
                  scale_search: str = "full", done: Callable[[str], None] | None = None) -> dict[str, dict]:
    """GPTQ-quantize every distinct candidate setting of every layer of the block whose Hessian owner is in
    ``hess`` (once per distinct group plan at the layer's K: settings whose proportions round to the same rows
    share the result).  Returns {layer: {QParams: candidate}}, a candidate being the fp16 reconstruction (torch
    float16 [N, K], while the candidates kept so far take at most ``in_memory`` bytes, default
    ``CANDIDATES_IN_MEMORY``) or the path of its packed EXL2 form in ``vdir`` (one small file per layer and
    setting).  ``scale_search``: ``gptq.quantize_exl2_plans(scale_search=)``.

    Only one parked candidate is in memory at a time; scoring loads them back one by one (``VariantCache``), so
    the measurement's memory does not grow with the number of candidates.  ``done(n)`` is called once layer n's
    candidates are all made."""
    in_memory = CANDIDATES_IN_MEMORY if in_memory is None else in_memory
    # every owner factorized first, while nothing else of the block's candidates is alive (the factorization's
    # transient is the largest: two K x K matrices, the Hessian itself let go of once permuted, since the
    # measurement computes no proxy error; K x K float32 each), each factor kept only until its
    # owner's last layer is swept
    prepared = {o: gptq.prepare(acc.take(), keep_hessian=False) for o, acc in hess.items()}
    names = [n for n in blk.names if blk.owner(n) in prepared]
    last = {blk.owner(n): n for n in names}           # the last layer of each Hessian owner
    out: dict[str, dict] = {n: {} for n in names}
    kept = 0
    for n in names:
        w, _ = W[n]
        owner = blk.owner(n)
        settings = list(dict.fromkeys(opt.get(n) for opt in options))   # distinct settings, first seen first
        # one sweep per distinct group plan at this K, plans sharing their first groups sharing that work too
        # (gptq.quantize_exl2_plans: bit for bit the results of separate quantize_exl2 calls); the proxy error
        # is not computed: the measurement scores candidates by their block outputs
        made: dict[tuple, object] = {}               # group plan -> candidate
        size = w.numel() * 2                         # a candidate's fp16 reconstruction
        # (a candidate that will be parked is never un-permuted: only its packed form is written)
        plans = [qp.bits_rows(w.shape[1]) for qp in settings]
        for j, r in gptq.quantize_exl2_plans(w, prepared[owner], plans, refine_scales, hat_dtype=torch.float16,
                                             scale_search=scale_search, want_hat=lambda: (
                                                 size <= _CANDIDATE_IN_MEMORY_MAX and kept + size <= in_memory)):
            v = made.get(tuple(r.bits_rows))
            if v is None:
                if r.weight_hat is not None:
                    v = r.weight_hat                     # float16: exact, every value is an fp16 value
                    kept += size
                else:
                    v = vdir / f"{n}.{len(made)}.safetensors"
                    save_tensors(v, r.tensors(None), durable=False)
                made[tuple(r.bits_rows)] = v
            out[n][settings[j]] = v
            del r
        if last[owner] == n:
            del prepared[owner]
        if done is not None:
            done(n)
    return out


def kept_bytes(made: dict[str, dict]) -> int:
    """Bytes of the candidates that ``make_variants`` kept in memory (shared candidates counted once)."""
    seen = {id(v): v for cands in made.values() for v in cands.values() if isinstance(v, torch.Tensor)}
    return sum(v.numel() * v.element_size() for v in seen.values())


def candidate_weight(v, n: str, out_features: int) -> torch.Tensor:
    """A ``make_variants`` candidate of layer ``n`` as its fp16 reconstruction, torch float16 [N, K] (N =
    ``out_features``): the kept tensor itself, or a parked file dequantized (exactly the same fp16 values)."""
    if isinstance(v, torch.Tensor):
        return v
    return torch.from_numpy(layer_from_tensors(n, load_tensors(v), out_features=out_features).dequantize())


def candidate_tensors(v, n: str) -> dict:
    """A candidate of layer ``n`` as tensors to store (``job.save_tensors``): a kept reconstruction as ``{n: float16
    [N, K]}``, a parked one as its packed EXL2 tensors under ``n + "."`` (a few bits per weight, not 16: the block
    gains' candidates of a large model stay about the size of its quantized file).  Read back with
    ``weight_from_candidate_tensors``."""
    if isinstance(v, torch.Tensor):
        return {n: v.cpu().numpy()}
    return {f"{n}.{k}": a for k, a in load_tensors(v).items()}


def weight_from_candidate_tensors(tensors: dict, n: str, out_features: int) -> torch.Tensor:
    """Layer ``n``'s candidate from ``candidate_tensors``' form (several layers' may share ``tensors``): torch
    float32 [N, K]."""
    if n in tensors:
        return torch.as_tensor(tensors[n]).float()
    own = {k[len(n) + 1:]: a for k, a in tensors.items() if k.startswith(n + ".")}
    return torch.from_numpy(layer_from_tensors(n, own, out_features=out_features).dequantize()).float()


class VariantCache:
    """One candidate per layer (the last one asked for), from its fp16 reconstruction in memory or dequantized
    from its packed file (exactly the fp16 values the quantizer computed): as a dense fp32 linear, or with a
    ``scoring.ReferenceTape`` that recorded the layer, as a ``scoring.DeltaLinear`` (bf16 differences from the
    reference).  ``linear(n, qp)`` gives the linear for one option sweep."""

    def __init__(self, variants: dict[str, dict], W, tape=None):
        self.variants, self.W, self.tape = variants, W, tape
        self.cur: dict[str, tuple] = {}

    def linear(self, n: str, qp):
        v = self.variants[n][qp]
        hit = self.cur.get(n)
        if hit is None or hit[0] is not v:    # settings with the same group plan share one candidate
            self.cur.pop(n, None)             # drop the previous candidate before the next one exists
            w, b = self.W[n]
            delta = self.tape is not None and self.tape.usable(n)
            dt = None if delta else torch.float32        # DeltaLinear reads the fp16 values as they are
            w_hat = candidate_weight(v, n, w.shape[0]).to(device=w.device, dtype=dt)
            if delta:
                hit = self.cur[n] = (v, DeltaLinear(self.tape, n, w, w_hat).bind)
            else:
                f = dense_linear(w_hat, b)
                hit = self.cur[n] = (v, lambda: f)
            del w_hat
        return hit[1]()


#: The option scoring keeps outputs of candidate linears for later options up to this many bytes.
_SHARED_OUTPUTS_BYTES = 64 << 20


class SharedOutputs:
    """Outputs of a block's first linears (the ones reading the block's own input: q/k/v, gate/up) kept for the
    later options that use the same candidate, instead of multiplying again.

    Exact: a kept output is reused only for the same candidate (the same fp16 reconstruction) and an input equal
    bit for bit to the one it was computed from (checked, ``torch.equal`` against that input, which is kept), so
    the product would repeat the same arithmetic on the same values; the caller gets a copy, so nothing the
    forward does to it reaches the kept one.  Outputs are dropped after the last option that uses their
    candidate; kept outputs and inputs together take at most ``budget`` bytes (default
    ``_SHARED_OUTPUTS_BYTES``), past that a product is simply computed.  Calls are counted per option sweep,
    one per batch."""

    def __init__(self, variants: dict[str, dict], options, names: list[str], budget: int | None = None):
        self.variants, self.names = variants, set(names)
        self.budget = _SHARED_OUTPUTS_BYTES if budget is None else budget
        self.last: dict[tuple, int] = {}          # (linear, candidate id) -> last option that uses it
        for j, opt in enumerate(options):
            for n in self.names:
                self.last[(n, id(variants[n][opt.get(n)]))] = j
        self.y: dict[tuple, dict[int, torch.Tensor]] = {}   # (linear, candidate id) -> batch -> output
        self.x: dict[tuple, torch.Tensor] = {}              # (linear, batch) -> the input the outputs are of
        self.held = 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _inputs_held(self, x: torch.Tensor) -> bool:
        return any(v is x for v in self.x.values())

    def _drop_input(self, n: str, bi: int) -> None:
        xr = self.x.pop((n, bi), None)
        if xr is not None and not self._inputs_held(xr):
            self.held -= self._size(xr)

    def wrap(self, j: int, n: str, qp, f):
        if n not in self.names:
            return f
        key = (n, id(self.variants[n][qp]))
        if self.last[key] == j and key not in self.y:
            return f                              # no later option uses this candidate, none before kept it
        calls = iter(range(1 << 62))

        def apply(x: torch.Tensor) -> torch.Tensor:
            bi = next(calls)
            kept = self.y.get(key, {}).get(bi)
            if kept is not None and torch.equal(x, self.x[(n, bi)]):
                return kept.clone()
            out = f(x)
            if self.last[key] <= j:
                return out
            xr = self.x.get((n, bi))
            if xr is not None and not torch.equal(x, xr):
                for k2, ys in self.y.items():         # outputs of another input are of no use any more
                    if k2[0] == n and bi in ys:
                        self.held -= self._size(ys.pop(bi))
                self._drop_input(n, bi)
                xr = None
            need = self._size(out) + (0 if xr is not None or self._inputs_held(x) else self._size(x))
            if self.held + need > self.budget:
                return out
            if xr is None:
                self.x[(n, bi)] = x
            self.y.setdefault(key, {})[bi] = out.clone()
            self.held += need
            return out
        return apply

    def done(self, j: int) -> None:
        """Option ``j`` is scored: drop the outputs no later option needs, and inputs no output refers to."""
        for key in [k for k in self.y if self.last[k] <= j]:
            self.held -= sum(self._size(t) for t in self.y.pop(key).values())
        for n, bi in list(self.x):
            if not any(k[0] == n and bi in ys for k, ys in self.y.items()):
                self._drop_input(n, bi)
