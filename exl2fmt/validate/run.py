"""``exl2fmt validate --run``: a whole forward pass through the Triton kernel against the dequantized weights.

Importing this module imports torch; building the model imports transformers (``exl2fmt.runner.model``).
``exl2fmt.validate`` imports it only when ``run`` is set, after ``load_kernels`` has chosen Triton's mode.  The
kernel module itself is handed in.

What runs
---------
One sequence of token ids (``default_ids``: ``RUN_DEFAULT_LENGTH`` ids drawn from ``RUN_SEED`` over the vocabulary,
or the caller's) goes through the model runner (``runner.model.HFModel``: transformers' own modeling code for the
config's ``model_type``, one decoder layer materialized at a time; every decoder-only architecture transformers
implements with ``nn.Linear`` layers) three times, layer by layer side by side, so each layer is read and
dequantized once.  Every quantized linear is swapped for a substitute through the runner's ``subs``; the
module's own weight is then a NaN stand-in that no pass reads (``run_model``):

``reference``  every quantized linear as float32 ``F.linear`` over its dequantized float16 weight (the Numba
               reference, ``layer.dequantize()``), residual stream, norms, RoPE and attention in float32.  This
               is what transformers computes in float32 over ``exl2fmt convert --to fp16`` output.
``kernel``     every EXL2 linear through the Triton fused dequantize-matmul on the packed tensors
               (``Exl2KernelLinear``): x rounded to float16, fp32 accumulation, y rounded to float16, then back
               to float32 for the rest of the layer.  The path is ``choose_path(M)`` with M = the number of ids.
``fp16 I/O``   the kernel's arithmetic model without the kernel: x rounded to float16, x @ W + b in float64 from
               the reference weights, one rounding to float16.  Its distance from ``reference`` is the part of
               the kernel path's deviation that float16 activations cause on this model (the noise floor).

GPTQ layers (the kernel covers EXL2 only) and dense layers run over their (dequantized) weights in all three
passes, so they contribute no difference; the report says how many did.  Embeddings and norms are the model's
own tensors.

Pass/fail rules (``verdict``)
-----------------------------
1. Every kernel call, on the activations the kernel path actually produced: each output within the
   fp32-accumulation bound of ``validate --kernel``, |y - y64| <= u_out |y64| + 2 (K + 1) 2^-24 (|x16| @ |W| +
   |b|), y64 = x16 @ W + b in float64 from the reference weights, u_out = 2^-11 (1 + 2^-10) (one float16
   rounding of y).  This is a proof about the kernel, not a tolerance: otherwise ``KERNEL_MISMATCH`` naming the
   layer.  (An output beyond float16's range fails here too: the model's activations do not fit float16.)
2. Logits finite in both passes (otherwise ``RUN_MISMATCH``; non-finite reference logits: ``NONFINITE_VALUES``).
3. max |z_kernel - z_ref| <= T, with T = ``RUN_MARGIN`` x max(D, 2^-11 max |z_ref|), D = max |z_fp16io - z_ref|.
   Rule 1 leaves the kernel path differing from the fp16 I/O pass only by fp32 summation order: float16
   roundings that flip by one unit, each no larger than twice a rounding the fp16 I/O pass already makes, so to
   first order the kernel path lands within about 2 D of the reference; ``RUN_MARGIN`` = 4 doubles that again.
   The 2^-11 max |z_ref| floor is one float16 rounding of the largest logit (D can be 0 on exactly
   representable toy data).  Otherwise ``RUN_MISMATCH``.
4. mean over positions of KL(p_ref || p_kernel) <= T^2 / 2: Hoeffding's lemma gives KL <= (2T)^2 / 8 at every
   position where |z_kernel - z_ref| <= T, so rule 3 implies it; checked and reported on its own.
5. top-1: every position whose reference margin (largest minus second-largest logit) exceeds 2T picks the same
   token (implied by rule 3); disagreements at smaller margins are near-ties, reported but not failed.

Numbers measured on the embedded sample (CPU interpreter, 16 ids): kernel path max |dz| about 7e-3, fp16 I/O
about 8e-3 (T about 3e-2), mean KL about 6e-7, top-1 agreement 1.0.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ErrorCode, Exl2Error, Severity
from ..runner.weights import Linear, WeightSource, dense_linear
from .kernel import KernelSetup
from .report import CheckId, PassCode, Report, Status

__all__ = ["RUN_DEFAULT_LENGTH", "RUN_SEED", "RUN_MARGIN", "RUN_MAX_IDS", "default_ids", "check_ids", "RunResult",
           "run_model", "run_forward", "run_metrics", "verdict", "U16", "KernelCallError", "run_preflight",
           "run_pass"]

#: Ids in the default sequence (M = 16 rows of x: the kernel's tensor-core "dot" path).
RUN_DEFAULT_LENGTH = 16
#: Seed of the default ids (NumPy PCG64 via ``np.random.default_rng``).
RUN_SEED = 0
#: Safety factor on the fp16 I/O deviation (rule 3 of the module docstring).
RUN_MARGIN = 4.0
#: Most ids accepted (the forward holds [ids, ids] attention scores per head).
RUN_MAX_IDS = 4096
#: Unit roundoff of float16.
U16 = 2.0 ** -11
_U_OUT = 2.0 ** -11 * (1 + 2.0 ** -10)
_REF_CHUNK_ELEMS = 1 << 24
_INTERP_MAX_BLOCK_N = 4096


def default_ids(vocab_size: int, length: int = RUN_DEFAULT_LENGTH, seed: int = RUN_SEED) -> list[int]:
    """``length`` token ids uniform over 0..vocab_size-1 from ``np.random.default_rng(seed)`` (deterministic)."""
    rng = np.random.default_rng(seed)
    return [int(v) for v in rng.integers(0, vocab_size, size=min(length, RUN_MAX_IDS))]


def check_ids(ids: Sequence[int], vocab_size: int, max_positions: int | None = None) -> list[int]:
    """The ids as a list, or ``Exl2Error(USAGE)`` naming the first one outside 0..vocab_size-1 (or a bad count:
    at most min(``RUN_MAX_IDS``, ``max_positions``))."""
    out = []
    for i, v in enumerate(ids):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise Exl2Error(ErrorCode.USAGE, f"--prompt-ids: id #{i} is {v!r}, not an integer")
        if not 0 <= int(v) < vocab_size:
            raise Exl2Error(ErrorCode.USAGE, f"--prompt-ids: id #{i} = {int(v)} is outside the vocabulary "
                            f"0..{vocab_size - 1} (config.json vocab_size = {vocab_size})")
        out.append(int(v))
    if not out:
        raise Exl2Error(ErrorCode.USAGE, "--prompt-ids: give at least one token id")
    limit = RUN_MAX_IDS if max_positions is None else min(RUN_MAX_IDS, max_positions)
    if len(out) > limit:
        raise Exl2Error(ErrorCode.USAGE, f"--prompt-ids: {len(out)} ids; at most {limit} (min of {RUN_MAX_IDS} and "
                        f"max_position_embeddings = {max_positions})")
    return out


def _max_positions(eng) -> int | None:
    v = getattr(eng.hf_config, "max_position_embeddings", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# ------------------------------------------------------------------------------------------------ the model


class _RunSource(WeightSource):
    """The model's tensors, plus a NaN stand-in for every parameter of a module whose linears all run as
    substitutes (the quantized layers, which store no ``.weight``).  A stand-in is one element broadcast to the
    parameter's shape (no memory); it is never read by a pass, and if it were, the logits would be NaN."""

    def __init__(self, model, quant_keys):
        super().__init__(model)
        self.quant_keys = frozenset(quant_keys)
        self.standins: dict[str, tuple[int, ...]] = {}

    def has(self, name: str) -> bool:
        return name in self.standins or (name.endswith(".weight") and name[:-7] in self.quant_keys) or \
            super().has(name)

    def get(self, name: str, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        shape = self.standins.get(name)
        if shape is not None:
            return torch.full((), math.nan, dtype=dtype, device=device or "cpu").expand(shape)
        return super().get(name, dtype, device)


_SIZE_KEYS = ("hidden_size", "intermediate_size", "head_dim", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "moe_intermediate_size", "num_local_experts", "num_experts")


def _check_sizes(config: Mapping[str, Any], model) -> None:
    """The config's layer count and sizes are bounded by the checkpoint before transformers builds anything from
    them (a skeleton of 10^9 layers, or a RoPE table of a 10^9 head_dim, would hang or exhaust memory):
    ``num_hidden_layers`` at most the number of numbered layers in the tensor names, every size at most the
    largest tensor dimension.  Raises ``CONFIG_MISMATCH`` naming the key."""
    import re

    where = str(model.config_path)
    idx = {int(m.group(1)) for n in model.names() if (m := re.search(r"\.layers\.(\d+)\.", n))}
    n = config.get("num_hidden_layers")
    if isinstance(n, int) and not isinstance(n, bool) and n > len(idx):
        raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"num_hidden_layers = {n}, but the tensors hold {len(idx)} "
                        "numbered layers", file=where)
    biggest = max((max(model.info(t).shape, default=1) for t in model.names()), default=1)
    for key in _SIZE_KEYS:
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > biggest:
            raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"{key} = {v} exceeds every tensor dimension of the "
                            f"checkpoint (largest {biggest})", file=where)


def run_model(model, device: "str | torch.device" = "cpu"):
    """The runner (``runner.model.HFModel``) over an open model (``ModelFiles``) with quantized layers: their keys
    (EXL2 / GPTQ, from the tensor names) count as present weights; ``run_forward`` swaps substitutes in for
    them.  Fused projections (Phi-3 ``qkv_proj``) stay fused when the model stores them fused.  Reads no tensor
    data.  Raises ``Exl2Error`` ``ARCH_UNSUPPORTED`` (no causal-LM class or no linear layers transformers can
    drive), ``CONFIG_INVALID``, or ``CONFIG_MISMATCH`` for sizes the checkpoint cannot hold (``_check_sizes``)."""
    from ..detect import detect_layers
    from ..layout import Format
    from ..runner.model import HFModel

    _check_sizes(model.config, model)
    quant = {k for k, info in detect_layers(model.tensors).items() if info.format in (Format.EXL2, Format.GPTQ)}
    fused = any(part in ("qkv_proj", "gate_up_proj") for n in model.names() for part in n.split("."))
    return HFModel(model.config, _RunSource(model, quant), device, split_fused=not fused)


def _modules(eng) -> dict[str, list[tuple[str, str]]]:
    """Checkpoint path of every module the runner materializes linears into -> [(linear name, linear key)]."""
    out: dict[str, list[tuple[str, str]]] = {}
    for i in range(eng.num_layers):
        p = eng.layer_prefix(i)
        for n in eng.path_of:
            out.setdefault(f"{p}.{eng.path_of[n]}", []).append((n, eng.linear_key(i, n)))
        for n in eng.expert_names:
            out[eng.linear_key(i, n)] = [(n, eng.linear_key(i, n))]
    return out


def _set_standins(eng, quant_keys) -> None:
    """Stand-ins for the parameters of every module whose linears are all in ``quant_keys``."""
    src = eng.src
    if not isinstance(src, _RunSource):
        return
    src.standins = {}
    want = eng.expected_tensors()
    for mod, lins in _modules(eng).items():
        if all(k in quant_keys for _, k in lins):
            for leaf in ("weight", "bias"):
                if f"{mod}.{leaf}" in want:
                    src.standins[f"{mod}.{leaf}"] = want[f"{mod}.{leaf}"]


# ------------------------------------------------------------------------------------------------ the passes


class KernelCallError(Exception):
    """The kernel wrapper or the device refused a layer (carries the layer key)."""

    def __init__(self, key: str, err: BaseException):
        super().__init__(f"{type(err).__name__}: {' '.join(str(err).split())}")
        self.key = key


@dataclass
class RunResult:
    """Logits of the three passes, float32 [T, vocab] each (``kernel`` None when no kernel module was given),
    and one record per kernel call."""

    ids: list[int]
    reference: torch.Tensor
    fp16io: torch.Tensor
    kernel: torch.Tensor | None
    calls: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)   # {"exl2": n (through the kernel), "gptq": n, "dense": n}
    seconds: dict = field(default_factory=dict)


def _f64_chunks(x16: torch.Tensor, w16: torch.Tensor, b16: torch.Tensor | None, need_abs: bool):
    """Yield (n0, n1, y64 [M, n], A [M, n] or None) for y64 = x16 @ W^T + b in float64, A = |x16| @ |W|^T + |b|.

    x16 float16 [M, K]; w16 float16 [N, K] (nn.Linear orientation); b16 float16 [N] or None; chunked over N so
    float64 copies stay bounded."""
    xd = x16.double()
    xa = xd.abs() if need_abs else None
    N, K = w16.shape
    step = max(1, _REF_CHUNK_ELEMS // max(K, 1))
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        W = w16[n0:n1].double()
        y = xd @ W.T
        A = (xa @ W.abs().T) if need_abs else None
        if b16 is not None:
            bd = b16[n0:n1].double()
            y += bd
            if A is not None:
                A += bd.abs()
        yield n0, n1, y, A
        del W, y, A


def _fp16io_linear(w16: torch.Tensor, b16: torch.Tensor | None) -> Linear:
    """x float32 [..., K] -> fp16(fp16(x) @ W^T + b computed in float64), as float32 (the kernel's model)."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x16 = x.reshape(-1, x.shape[-1]).half()
        out = torch.empty((x16.shape[0], w16.shape[0]), dtype=torch.float32, device=x.device)
        for n0, n1, y, _ in _f64_chunks(x16, w16, b16, need_abs=False):
            out[:, n0:n1] = y.half().float()
        return out.reshape(*lead, w16.shape[0])
    return apply


def _kernel_linear(key: str, kern, w16: torch.Tensor, b16: torch.Tensor | None, block_n: int | None,
                   calls: list[dict]) -> Linear:
    """x float32 [..., K] -> the Triton kernel on fp16(x), as float32; every call is checked against the
    fp32-accumulation bound (rule 1) and recorded in ``calls``."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x16 = x.reshape(-1, x.shape[-1]).half()
        M, K = x16.shape
        path = kern.path_for(M)
        kw = {"block_n": block_n} if block_n is not None and path != "dense" else {}
        t0 = time.perf_counter()
        try:
            y = kern.lin(x16, **kw)
        except (ValueError, RuntimeError) as e:
            raise KernelCallError(key, e) from None
        secs = time.perf_counter() - t0
        outside = 0
        err_max = ref_max = 0.0
        nan = False
        for n0, n1, r, A in _f64_chunks(x16, w16, b16, need_abs=True):
            e = (y[:, n0:n1].double() - r).abs()
            outside += int((~(e <= _U_OUT * r.abs() + 2 * (K + 1) * 2.0 ** -24 * A)).sum())  # NaN is outside
            nan = nan or bool(torch.isnan(e).any())
            err_max = max(err_max, float(torch.nan_to_num(e, nan=0.0, posinf=math.inf).max()))
            ref_max = max(ref_max, float(r.abs().max()))
        rel = math.nan if nan else err_max / max(ref_max, 1e-300)
        calls.append({"key": key, "M": int(M), "path": path,
                      "max_rel_err": rel if math.isfinite(rel) else None,
                      "within_bound": outside == 0, "outside": outside,
                      "nonfinite": int((~torch.isfinite(y)).sum()), "ref_absmax": ref_max,
                      "seconds": round(secs, 4)})
        return y.float().reshape(*lead, y.shape[-1])
    return apply


@dataclass
class _Kern:
    lin: Any
    path_for: Callable[[int], str]


def _interp_block_n(kt, n_pad: int) -> int | None:
    """Under the interpreter one column block per layer (N_pad rounded up to a power of two, at most 4096): the
    interpreter's cost is per program, results are identical.  None on a GPU (the kernels' own heuristics)."""
    if not kt.interpreted():
        return None
    bn = 64
    while bn < n_pad and bn < _INTERP_MAX_BLOCK_N:
        bn *= 2
    return bn


def run_forward(eng, layers: Mapping[str, Any], ids: Sequence[int], kernels=None,
                device: "str | torch.device | None" = None,
                progress: Callable[[int, int, str], None] | None = None,
                kernel_hook: Callable[[str, Any], Any] | None = None) -> RunResult:
    """The three passes of the module docstring over one sequence.

    eng      the model runner (``run_model``; any ``runner.model.HFModel`` whose source holds every dense tensor)
    layers   layer key -> layer object for the quantized linears (``Exl2Linear``, ``GptqLinear``); other keys
             (and other layer types) run over the dense weights the runner reads from its source
    ids      token ids (checked with ``check_ids``)
    kernels  the Triton kernel module (``exl2fmt.kernels.load_triton``); None = no kernel pass (``kernel`` None)
    device   where the passes run (default: the runner's device)
    progress called as (layers done, layers + 1, last key)
    kernel_hook  test seam: (key, Exl2KernelLinear) -> the object called in place of it
    Returns a ``RunResult``.  Raises ``KernelCallError`` when the kernel wrapper refuses a layer, and
    ``Exl2Error`` from the layers' dequantization.
    """
    ids = check_ids(ids, eng.vocab_size, _max_positions(eng))
    dev = torch.device(device) if device is not None else eng.device
    tid = torch.tensor([ids], dtype=torch.int64)
    res = RunResult(ids=list(ids), reference=None, fp16io=None, kernel=None,  # type: ignore[arg-type]
                    counts={"exl2": 0, "gptq": 0, "dense": 0})
    secs = {"reference": 0.0, "fp16io": 0.0, "kernel": 0.0, "load": 0.0}
    names = ("ref", "emu", "ker") if kernels is not None else ("ref", "emu")
    quant_keys = {k for k, v in layers.items() if type(v).__name__ in ("Exl2Linear", "GptqLinear")}
    _set_standins(eng, quant_keys)

    def linears_for(key: str) -> dict[str, Any] | None:
        layer = layers.get(key)
        fmt = type(layer).__name__
        if fmt not in ("Exl2Linear", "GptqLinear"):  # dense: the stored tensor, widened to float32, in every pass
            res.counts["dense"] += 1
            return None
        t0 = time.perf_counter()
        w16 = torch.from_numpy(np.ascontiguousarray(np.asarray(layer.dequantize(), dtype=np.float16))).to(dev)
        b = layer.bias()
        b16 = None if b is None else torch.from_numpy(np.asarray(b, dtype=np.float16)).to(dev)
        ref = dense_linear(w16.float(), None if b16 is None else b16.float())
        out = {"ref": ref}
        if fmt == "Exl2Linear":
            out["emu"] = _fp16io_linear(w16, b16)
            if kernels is not None:
                kl = kernels.Exl2KernelLinear.from_layer(layer, dev)
                if kernel_hook is not None:
                    kl = kernel_hook(key, kl)
                bn = _interp_block_n(kernels, int(kl.q_weight.shape[1]))
                out["ker"] = _kernel_linear(key, _Kern(kl, kernels.choose_path), w16, b16, bn, res.calls)
            res.counts["exl2"] += 1
        else:  # GPTQ: the kernel covers EXL2 only, so every pass uses the dequantized weights
            out["emu"] = out["ker"] = ref
            res.counts["gptq"] += 1
        secs["load"] += time.perf_counter() - t0
        return out

    def timed(name: str, fn):
        t0 = time.perf_counter()
        r = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        secs[{"ref": "reference", "emu": "fp16io", "ker": "kernel"}[name]] += time.perf_counter() - t0
        return r

    L = eng.num_layers
    try:
        with torch.no_grad():
            h0 = eng.embed(tid, dev)
            h = {n: h0 for n in names}
            for i in range(L):
                subs = {n: linears_for(eng.linear_key(i, n)) for n in (*eng.path_of, *eng.expert_names)}
                r = eng.runner(i, dev)
                for p in names:
                    lin = {n: s[p] for n, s in subs.items() if s is not None}
                    h[p] = timed(p, lambda: r.forward(h[p], lin))
                subs = r = None       # the layer is freed before the next is read
                if progress is not None:
                    progress(i + 1, L + 1, eng.layer_prefix(i))
            eng.release()
            head = linears_for("lm_head")
            dense = eng.dense_head(dev) if head is None else None
            logits = {p: timed(p, lambda: eng.logits(h[p], dense if head is None else head[p]))[0] for p in names}
            if progress is not None:
                progress(L + 1, L + 1, "lm_head")
    finally:
        eng.release()
    res.reference, res.fp16io, res.kernel = logits["ref"], logits["emu"], logits.get("ker")
    res.seconds = {k: round(v, 3) for k, v in secs.items()}
    return res


# ------------------------------------------------------------------------------------------------ metrics


def _compare(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """max |dz|, KL(ref || test) per position and mean, top-1 agreement of logits float32 [T, V]."""
    d = (test.double() - ref.double()).abs()
    finite = bool(torch.isfinite(test).all())
    lp = F.log_softmax(ref.double(), dim=-1)
    lq = F.log_softmax(test.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    top_r, top_t = ref.argmax(-1), test.argmax(-1)
    per_pos_max = torch.nan_to_num(d, nan=math.inf).max(-1).values
    return {
        "finite": finite,
        "max_abs_logit_diff": float(per_pos_max.max()),
        "mean_kl": float(kl.mean()) if finite else math.inf,
        "max_kl": float(kl.max()) if finite else math.inf,
        "top1_agree": float((top_r == top_t).double().mean()),
        "_per_pos_max": per_pos_max, "_kl": kl, "_top_t": top_t,
    }


def _num(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def run_metrics(res: RunResult) -> dict:
    """The report's numbers (JSON-ready): kernel vs reference, fp16 I/O vs reference, thresholds, per position,
    per kernel call.  Infinite values become None."""
    ref = res.reference
    ref_finite = bool(torch.isfinite(ref).all())
    zmax = float(ref.abs().max()) if ref_finite else math.inf
    emu = _compare(ref, res.fp16io)
    noise = emu["max_abs_logit_diff"]
    tol = RUN_MARGIN * max(noise, U16 * zmax)
    top2 = ref.topk(min(2, ref.shape[-1]), dim=-1).values
    margin = (top2[:, 0] - top2[:, -1]) if top2.shape[-1] > 1 else torch.full_like(top2[:, 0], math.inf)
    out: dict = {
        "ids": list(res.ids),
        "length": len(res.ids),
        "linears": dict(res.counts),
        "reference_finite": ref_finite,
        "logit_absmax": _num(zmax),
        "fp16io": {"max_abs_logit_diff": _num(noise), "mean_kl": _num(emu["mean_kl"]),
                   "top1_agree": emu["top1_agree"]},
        "thresholds": {"max_abs_logit_diff": _num(tol), "mean_kl": _num(tol * tol / 2),
                       "top1_margin": _num(2 * tol), "margin_factor": RUN_MARGIN},
        "kernel": None,
        "positions": [],
        "calls": [dict(c) for c in res.calls],
        "seconds": dict(res.seconds),
    }
    if res.kernel is None:
        return out
    k = _compare(ref, res.kernel)
    top_r = ref.argmax(-1)
    disagree = (k["_top_t"] != top_r)
    out["kernel"] = {"finite": k["finite"], "max_abs_logit_diff": _num(k["max_abs_logit_diff"]),
                     "mean_kl": _num(k["mean_kl"]), "max_kl": _num(k["max_kl"]), "top1_agree": k["top1_agree"],
                     "top1_disagree_clear": int((disagree & (margin > 2 * tol)).sum()),
                     "top1_disagree_near_tie": int((disagree & ~(margin > 2 * tol)).sum())}
    for t in range(ref.shape[0]):
        out["positions"].append({"pos": t, "id": res.ids[t], "max_abs_logit_diff": _num(float(k["_per_pos_max"][t])),
                                 "kl": _num(float(k["_kl"][t])), "top1_ref": int(top_r[t]),
                                 "top1_kernel": int(k["_top_t"][t]), "margin_ref": _num(float(margin[t]))})
    return out


def verdict(m: dict) -> list[tuple[ErrorCode, str, str | None]]:
    """Failures of the rules of the module docstring, as (code, message, layer key or None); [] = pass."""
    bad: list[tuple[ErrorCode, str, str | None]] = []
    by_key: dict[str, list[dict]] = {}
    for c in m["calls"]:
        if not c["within_bound"]:
            by_key.setdefault(c["key"], []).append(c)
    for key, cs in by_key.items():
        c = cs[0]
        rel = "not finite" if c["max_rel_err"] is None else f"{c['max_rel_err']:.3e}"
        hint = ""
        if c["nonfinite"] and c["ref_absmax"] > 65504:
            hint = f" (|x @ W| reaches {c['ref_absmax']:.4g}, beyond float16's 65504)"
        bad.append((ErrorCode.KERNEL_MISMATCH, f"kernel call on the forward's activations (M={c['M']}, {c['path']}): "
                    f"{c['outside']} output(s) outside the fp32-accumulation bound, {c['nonfinite']} NaN/Inf, "
                    f"max rel err {rel}{hint}", key))
    if not m["reference_finite"]:
        bad.append((ErrorCode.NONFINITE_VALUES, "the reference forward (float32 over the dequantized weights) gives "
                    "NaN/Inf logits", None))
        return bad
    k = m["kernel"]
    if k is None:
        return bad
    th = m["thresholds"]
    if not k["finite"]:
        bad.append((ErrorCode.RUN_MISMATCH, "the kernel forward gives NaN/Inf logits where the reference is finite",
                    None))
        return bad
    if not k["max_abs_logit_diff"] <= th["max_abs_logit_diff"]:
        bad.append((ErrorCode.RUN_MISMATCH, f"max |logit_kernel - logit_ref| = {k['max_abs_logit_diff']:.4g} exceeds "
                    f"the tolerance {th['max_abs_logit_diff']:.4g} ({RUN_MARGIN:g} x max(fp16 I/O deviation "
                    f"{m['fp16io']['max_abs_logit_diff']:.4g}, 2^-11 x max |logit_ref| {m['logit_absmax']:.4g}))",
                    None))
    if not k["mean_kl"] <= th["mean_kl"]:
        bad.append((ErrorCode.RUN_MISMATCH, f"mean KL(ref || kernel) = {k['mean_kl']:.4g} nats exceeds "
                    f"{th['mean_kl']:.4g} (T^2/2)", None))
    if k["top1_disagree_clear"]:
        bad.append((ErrorCode.RUN_MISMATCH, f"top-1 token differs at {k['top1_disagree_clear']} position(s) whose "
                    f"reference margin exceeds {th['top1_margin']:.4g}", None))
    return bad


# ------------------------------------------------------------------------------------------------ the check


def run_preflight(model, prompt_ids, device: "str | torch.device" = "cpu") -> dict:
    """validate --run before any tensor data is read: the model runner can be built for the architecture (else
    ``ARCH_UNSUPPORTED`` is raised) and the ids lie in the vocabulary (else ``USAGE``).  A config that cannot be
    read or is invalid is not raised here: it becomes a failed ``run`` check (the structural checks report it as
    well).  Returns {"engine": the runner on ``device`` or None, "ids", "source", "error"}."""
    where = str(model.config_path)
    try:
        config = model.config
    except Exl2Error as e:
        return {"engine": None, "ids": None, "error": e}
    if not isinstance(config, dict):
        return {"engine": None, "ids": None, "error": Exl2Error(
            ErrorCode.CONFIG_MISSING, "--run needs config.json (architecture and sizes)", file=where)}
    try:
        eng = run_model(model, device)
    except Exl2Error as e:
        if e.code is ErrorCode.ARCH_UNSUPPORTED:
            raise Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"--run has no forward for this model: {e.message}",
                            file=e.file if e.file and e.file != "config.json" else where) from None
        return {"engine": None, "ids": None, "error": Exl2Error(e.code, e.message, file=where, tensor=e.tensor)}
    ids = default_ids(eng.vocab_size) if prompt_ids is None else check_ids(list(prompt_ids), eng.vocab_size,
                                                                            _max_positions(eng))
    return {"engine": eng, "ids": ids, "source": "default" if prompt_ids is None else "prompt-ids", "error": None}


def _run_inputs(rep: Report, model, det, loaded: dict, deep: bool, eng) -> dict | None:
    """The layer objects the forward substitutes (EXL2 and GPTQ), after checking that every tensor the runner
    reads is present with the shape transformers builds from config.json; None (and FAIL checks) when the
    forward cannot run."""
    from ..layout import Format

    quant: dict = {}
    problems: list[tuple[ErrorCode, str, str]] = []
    modules = _modules(eng)
    shape_of = {k: eng.linear_shape(n) for lins in modules.values() for n, k in lins}
    for key, shape in shape_of.items():
        info = det.layers.get(key)
        if info is None:
            continue
        if info.format in (Format.EXL2, Format.GPTQ):
            layer = loaded.get(key)
            if layer is None:
                problems.append((ErrorCode.LAYER_NOT_FOUND, "the forward needs this layer and it failed the "
                                 "structural checks (see the layers check)", key))
            elif (int(layer.out_features), int(layer.in_features)) != tuple(shape):
                problems.append((ErrorCode.CONFIG_MISMATCH, f"config.json implies [out, in] = {list(shape)}, the "
                                 f"layer is [{layer.out_features}, {layer.in_features}]", key))
            else:
                quant[key] = layer
        elif info.format is not Format.DENSE:
            problems.append((ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layers cannot run in the "
                             "forward (exl2fmt decodes EXL2, GPTQ and dense layers)", key))
    covered = set()      # parameters of modules whose linears all run as substitutes (or failed above)
    bad_keys = {t for _, _, t in problems}
    for mod, lins in modules.items():
        if all(k in quant or k in bad_keys for _, k in lins):
            covered |= {f"{mod}.weight", f"{mod}.bias"}
    want = eng.expected_tensors()
    head = loaded.get("lm_head")
    info = det.layers.get("lm_head")
    if head is not None and info is not None and info.format in (Format.EXL2, Format.GPTQ):
        if (int(head.out_features), int(head.in_features)) == (eng.vocab_size, eng.hidden_size):
            quant["lm_head"] = head  # also with tied embeddings: run the head that ships
            covered |= {"lm_head.weight", "lm_head.bias"}
        elif "lm_head.weight" in want:
            problems.append((ErrorCode.CONFIG_MISMATCH, f"config.json implies [out, in] = "
                             f"[{eng.vocab_size}, {eng.hidden_size}], the layer is "
                             f"[{head.out_features}, {head.in_features}]", "lm_head"))
            covered.add("lm_head.weight")
    for name, shape in want.items():
        if name in covered:
            continue
        if name not in model:
            problems.append((ErrorCode.TENSOR_NOT_FOUND, f"the {eng.arch} forward needs this tensor", name))
        elif tuple(model.info(name).shape) != tuple(shape):
            problems.append((ErrorCode.CONFIG_MISMATCH, f"config.json implies shape {list(shape)}, found "
                             f"{list(model.info(name).shape)}", name))
    for key, layer in quant.items():
        if deep:
            continue  # the data invariants (permutation, finite scales, g_idx) were checked by the deep pass
        for i in layer.validate(deep=True):
            if i.severity is Severity.ERROR:
                problems.append((i.code, i.message, i.tensor or key))
    for code, msg, tensor in problems:
        rep.add(CheckId.RUN, Status.FAIL, code, f"forward not run: {msg}", tensor=tensor, file=model.root)
    return None if problems else quant


def run_pass(rep: Report, model, det, loaded: dict, deep: bool, ks: KernelSetup, pre: dict, progress) -> None:
    """validate --run (rules in the module docstring)."""
    where = f"{ks.device}" + (" (Triton interpreter)" if ks.interpreted else "")
    rep.run = {"device": ks.device, "interpreter": ks.interpreted, "activation_dtype": "float16",
               "ids_source": pre.get("source"), "arch": None}
    if pre["error"] is not None:
        e = pre["error"]
        rep.add(CheckId.RUN, Status.FAIL, e.code, f"forward not run: {e.message}", tensor=e.tensor, file=e.file)
        return
    eng = pre["engine"]
    rep.run["arch"] = eng.arch
    quant = _run_inputs(rep, model, det, loaded, deep, eng)
    if quant is None:
        return
    total = sum(det.layers[k].stored_bytes for k in quant) or 1
    cb = None if progress is None else (lambda done, n, what: progress(int(total * done / n), total, what))
    if progress is not None:
        progress(0, total, "")
    try:
        res = run_forward(eng, quant, pre["ids"], kernels=ks.module, device=ks.device, progress=cb)
    except KernelCallError as e:
        rep.add(CheckId.RUN, Status.FAIL, ErrorCode.KERNEL_MISMATCH, f"the kernel failed on this layer during the "
                f"forward ({where}): {e}", tensor=e.key, file=model.root)
        return
    except Exl2Error as e:
        rep.add(CheckId.RUN, Status.FAIL, e.code, f"forward not run: {e.message}", tensor=e.tensor, file=e.file)
        return
    m = run_metrics(res)
    rep.run.update(m)
    n = m["linears"]
    if n["gptq"]:
        rep.add(CheckId.RUN, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, f"{n['gptq']} GPTQ layer(s) ran over their "
                "dequantized weights in both passes: the Triton kernel covers EXL2 only", file=model.root)
    if not n["exl2"]:
        rep.add(CheckId.RUN, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, "no EXL2 linear in the forward: the kernel "
                "was not exercised", file=model.root)
    bad = verdict(m)
    for code, msg, key in bad:
        rep.add(CheckId.RUN, Status.FAIL, code, f"{msg} ({where}, {m['length']} ids)", tensor=key, file=model.root)
    k = m["kernel"]
    if not bad and n["exl2"] and k is not None:
        th = m["thresholds"]
        paths = sorted({c["path"] for c in m["calls"]})
        rep.ok(CheckId.RUN, PassCode.RUN_OK, f"{eng.arch} forward on {m['length']} ids, {n['exl2']} EXL2 linear(s) "
               f"through the Triton kernel ({'/'.join(paths)} path, {where}) vs the dequantized weights in float32: "
               f"max |logit diff| {k['max_abs_logit_diff']:.3g} (tolerance {th['max_abs_logit_diff']:.3g}; float16 "
               f"activations alone {m['fp16io']['max_abs_logit_diff']:.3g}), mean KL {k['mean_kl']:.3g} nats, "
               f"top-1 agreement {k['top1_agree']:.4g}; every kernel call within the fp32-accumulation bound",
               count=n["exl2"], file=model.root)
