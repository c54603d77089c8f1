"""FP16/BF16 -> EXL2 (and GPTQ): measure, optimize, quantize, compile, verify.

``quantize_model(src, dst, QuantOptions(...))`` runs the whole conversion:

1. **Calibration**: token ids [rows, length] (``calib.load_calibration``; the built-in set by default).
2. **Measurement** (EXL2 only, skipped with ``measurement=``): for every attention and MLP block, the GPTQ
   Hessians of its linear layers are accumulated from the block's reference inputs; every distinct candidate
   setting of every layer is GPTQ-quantized (and parked, packed, in the work directory, so memory does not
   grow with the candidate tables); every candidate option of the block is scored by the relative
   error of the block's output, ``1 - mean_rows ||y_test - y_ref||_F / ||y_ref||_F`` (ExLlamaV2's
   "accuracy").  Blocks are measured independently: the next block's input is the reference output.
3. **Optimization**: ``solver.solve`` picks one option per block so that the decoder linears' stored bits
   (overhead included) stay within ``bits x sum(K x N)``.
4. **Quantization**: sequential GPTQ through the model.  Each block's Hessians come from the *quantized*
   model's activations, and within a block the layers are quantized in order (q/k/v, then o_proj with inputs
   recomputed through the quantized q/k/v; gate/up, then down_proj), so errors are compensated downstream.
   The head is quantized last with ``head_bits``; embeddings and norms are written as fp16.
5. **Compile**: ``output.safetensors`` (or ``output-0000i-of-0000N`` shards with an index) in a temporary
   sibling of DST, side files copied, ``config.json`` with ``quantization_config``, a per-layer manifest
   ``exl2fmt-manifest.json``; then the validator (deep) must pass, every layer must dequantize to exactly the
   reconstruction the quantizer computed, and only then is the directory renamed to DST.

Work state lives in a work directory (default: ``.<DST name>.exl2fmt-work`` next to DST): ``job.json``
(options fingerprint, measurement, strategy, progress), ``hidden.safetensors`` (a snapshot of the hidden
state) and ``out/<layer>.safetensors`` (each quantized layer).  ``resume=True`` continues from it; the result
is byte-identical to an uninterrupted run.  The work directory is removed after success.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..container import jsonload
from ..errors import ErrorCode, Exl2Error
from ..layout import pad32, stays_16bit

__all__ = ["QuantOptions", "QuantReport", "quantize_model", "plan_from_measurement", "WORK_VERSION"]

WORK_VERSION = 2        # 2: the quantization pass snapshots the FP16 hidden state too
#: The report warns when the quantized model's calibration perplexity exceeds the FP16 model's by more than
#: ``ppl_rise_bound(bpw)``: this fraction at 4 bits per weight, halved with each further bit (quantization noise
#: power falls 4x a bit; the rise of a log-perplexity roughly with its amplitude), never more than doubling.
_PPL_RISE_AT_4BPW = 0.15


def ppl_rise_bound(bpw: float) -> float:
    """The largest relative rise of the calibration perplexity (quantized / FP16 - 1) that a quantization at ``bpw``
    average bits per weight passes without a warning: 0.15 at 4.0, 0.30 at 3.0, 0.075 at 5.0, capped at 1.0 (2x)."""
    return min(1.0, _PPL_RISE_AT_4BPW * 2.0 ** (4.0 - float(bpw)))

_SNAPSHOT_SECONDS = 180.0

Progress = Callable[[str, int, int, str], None]   # (phase, done, total, what)


@dataclass
class QuantOptions:
    """Options of ``quantize_model``.  ``target`` ``exl2`` or ``gptq``."""

    target: str = "exl2"
    bits: float | None = None             # exl2: average bpw of the decoder linears (default 4.125); gptq: 2/3/4/8
    head_bits: int = 6                    # exl2 head setting (2/3/4/5/6/8)
    group_size: int = 128                 # gptq
    sym: bool = True                      # gptq
    act_order: bool | None = None         # True = order "act", False = "natural"; None: from ``order``
    # input-feature order of the GPTQ sweep: "act" (decreasing Hessian diagonal; GPTQ: desc_act, non-monotone
    # g_idx); GPTQ only, with g_idx = k // group_size (monotone, desc_act False): "static" (the act-order over
    # groups of group_size consecutive features, each group fitted at its first row) and "group" (whole groups
    # ranked by their largest diagonal, act-order inside each: GPTQModel's default); "natural".  None = auto:
    # "act" for EXL2 (its stored permutation makes act-order free), "static" for GPTQ (monotone g_idx, which
    # vLLM's Marlin kernels need, at act-order quality: bench/RESULTS.md)
    order: str | None = None
    calibration: str | None = None        # file, or None for the built-in set
    rows: int | None = None               # default: 100 on CUDA, 32 on CPU
    length: int | None = None             # default: 2048 on CUDA, 512 on CPU
    measurement: str | None = None        # reuse this measurement.json (EXL2)
    save_measurement: str | None = None   # also write the measurement here
    device: str | None = None             # default: cuda if torch sees one
    seed: int = 0
    shard_size: int = 8192 << 20
    resume: bool = False
    work_dir: str | None = None
    extended: bool = True                 # add exl2fmt's extra candidate settings to upstream's tables
    # refine each column's scale code after the search (not in ExLlamaV2).  None = auto: on in weight-only mode
    # (plain round-to-nearest, where it lowers the weight error ~5-10%), off with calibration (under GPTQ's error
    # feedback the tighter scales clip compensated rows and the KL rises: bench/RESULTS.md)
    refine_scales: bool | None = None
    norm: float = 2.0                     # solver objective: sum of block error ** norm
    # calibration tokens per forward batch (whole rows, at least one; ``--batch-tokens``); None =
    # ``default_batch_tokens`` for the model, resolved once the model is open
    batch_tokens: int | None = None
    # calibration rows that score the measurement's candidates (ExLlamaV2's -mr): a count, "all", or None for
    # ``default_measure_rows`` (resolved() makes it a count).  The Hessians of the candidates' GPTQ and the
    # reference outputs always come from every row; fewer scoring rows cut the cost of the option forwards in
    # proportion (bench/RESULTS.md, issue 18, for the A/B of the chosen plans)
    measure_rows: int | str | None = None
    # how the candidates' GPTQ searches each group's scale multiplier in the measurement: "bracket" (27 of the 97
    # grid points, bracketing the coarse minimum: ``codec.scale_search.best_grid_index``) or "full" (ExLlamaV2's
    # search, as the quantize pass always does).  The A/B of the chosen plans is in bench/RESULTS.md (issue 18)
    measure_search: str = "bracket"
    # how the measurement multiplies candidates when it scores options: "bf16" (each candidate's difference from
    # the reference layer, in bf16: ``scoring``), "fp32", or "auto" (resolved(): bf16 where bf16 products are
    # hardware-accelerated).  The A/B of the chosen plans is in bench/RESULTS.md (issue 18)
    measure_precision: str = "auto"

    def resolved(self) -> "QuantOptions":
        o = QuantOptions(**asdict(self))
        if o.device is None:
            o.device = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = str(o.device).startswith("cuda")
        if o.rows is None:
            o.rows = 100 if cuda else 32
        if o.length is None:
            o.length = 2048 if cuda else 512
        if o.target == "exl2":
            o.bits = 4.125 if o.bits is None else float(o.bits)
            if not (2.0 <= o.bits <= 8.5):
                raise Exl2Error(ErrorCode.USAGE, f"--bits for EXL2 must lie in [2, 8.5], got {o.bits}")
        elif o.target == "gptq":
            o.bits = 4 if o.bits is None else o.bits
            if float(o.bits) not in (2.0, 3.0, 4.0, 8.0):
                raise Exl2Error(ErrorCode.USAGE, f"--bits for GPTQ must be 2, 3, 4 or 8, got {o.bits}")
            o.bits = int(o.bits)
        else:
            raise Exl2Error(ErrorCode.USAGE, f"the quantizer writes exl2 or gptq, not {o.target!r}")
        o.order = _resolve_order(o)
        o.act_order = o.order != "natural"
        if o.rows <= 0 or o.length <= 0:
            raise Exl2Error(ErrorCode.USAGE, "--rows and --length must be positive")
        if o.batch_tokens is not None:
            if isinstance(o.batch_tokens, bool) or not isinstance(o.batch_tokens, (int, np.integer)) \
                    or o.batch_tokens <= 0:
                raise Exl2Error(ErrorCode.USAGE, f"--batch-tokens must be a positive token count, got "
                                f"{o.batch_tokens!r}")
            o.batch_tokens = int(o.batch_tokens)
        if o.measure_rows is None:
            o.measure_rows = default_measure_rows(o.rows, o.length)
        elif o.measure_rows == "all":
            o.measure_rows = o.rows
        elif isinstance(o.measure_rows, str):
            try:
                o.measure_rows = int(o.measure_rows)
            except ValueError:
                raise Exl2Error(ErrorCode.USAGE, f"--measure-rows must be a row count or 'all', got "
                                f"{o.measure_rows!r}") from None
        if o.measure_rows <= 0:
            raise Exl2Error(ErrorCode.USAGE, f"--measure-rows must be positive, got {o.measure_rows}")
        from ..codec.scale_search import SEARCHES

        if o.measure_search not in SEARCHES:
            raise Exl2Error(ErrorCode.USAGE, f"--measure-search must be one of {', '.join(SEARCHES)}, got "
                            f"{o.measure_search!r}")
        from .scoring import resolve_precision

        o.measure_precision = resolve_precision(o.measure_precision, torch.device(o.device))
        # (only the EXL2 measurement scores candidates: other targets record no count)
        o.measure_rows = min(int(o.measure_rows), o.rows) if o.target == "exl2" else None
        # checked here, before calibration and measurement, rather than when the head or first layer is reached
        if o.target == "exl2":
            from .qparams import head_qparams

            head_qparams(o.head_bits)
        elif o.group_size != -1 and (o.group_size <= 0 or o.group_size % 32):
            raise Exl2Error(ErrorCode.USAGE, f"--group-size must be -1 or a positive multiple of 32, got "
                            f"{o.group_size}")
        return o

    def fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one (paths and cosmetics excluded)."""
        d = asdict(self)
        for k in ("resume", "work_dir", "save_measurement", "shard_size"):
            d.pop(k)
        return d


#: ``default_measure_rows`` never scores the candidates on fewer tokens than this (unless the calibration has
#: fewer): on the fixture 2048 scoring tokens chose the same plans as every row at 16 x 256, 512 did not.
MEASURE_MIN_TOKENS = 2048


def default_measure_rows(rows: int, length: int) -> int:
    """The calibration rows that score the EXL2 measurement's candidates by default: a quarter of them, at least
    ``MEASURE_MIN_TOKENS`` tokens' worth, at most all (CPU default 32 x 512: 8 rows; CUDA 100 x 2048: 25).

    The plans this chooses were the plans every row chooses, block for block, at 2.5/3/4/5/6 bpw on the trained
    fixture (16 x 256 and 32 x 512) and on a 1B-shaped layer (bench/RESULTS.md, issue 18); the scoring forwards,
    most of the measurement on wide models, shrink in proportion."""
    return max(1, min(rows, max(-(-rows // 4), -(-MEASURE_MIN_TOKENS // max(1, length)))))


#: The most calibration tokens one forward batch holds.
MAX_BATCH_TOKENS = 8192
#: On the CPU a forward batch holds as many whole rows as keep its widest activation (tokens x the widest
#: linear dimension, float32) within this many bytes: each sweep holds a few such activations at once, and the
#: measurement's option scoring about six of them beside its tape (bench/RESULTS.md, issue 18: a 1B layer at
#: 8 x 256 peaked 0.1 GB lower with 1024-token batches than with one of 2048, in the same time).
BATCH_ACTIVATION_BYTES = 24 << 20


def default_batch_tokens(length: int, widest: int, device: str) -> int:
    """Tokens per forward batch when ``QuantOptions.batch_tokens`` is None: ``MAX_BATCH_TOKENS`` on CUDA (device
    memory, where large products pay); on the CPU the whole rows of ``length`` tokens whose activations of the
    ``widest`` linear dimension fit ``BATCH_ACTIVATION_BYTES``, at least one row, at most ``MAX_BATCH_TOKENS``.
    (Rows are independent sequences, so a batch split changes only the float rounding of sums over tokens.)"""
    if str(device).startswith("cuda"):
        return MAX_BATCH_TOKENS
    length = max(1, int(length))
    rows = max(1, min(BATCH_ACTIVATION_BYTES // (4 * length * max(1, int(widest))), MAX_BATCH_TOKENS // length))
    return rows * length


_ORDERS = ("act", "group", "static", "natural")
#: The GPTQ default: the best in KL of the orders that keep g_idx monotone (bench/RESULTS.md, issue 16).
_GPTQ_DEFAULT_ORDER = "static"


def _resolve_order(o: "QuantOptions") -> str:
    """The GPTQ sweep's input order from ``order`` and ``act_order`` (see QuantOptions)."""
    order = o.order
    if order is not None and order not in _ORDERS:
        raise Exl2Error(ErrorCode.USAGE, f"--order must be one of {', '.join(_ORDERS)}, got {order!r}")
    if o.act_order is True and order == "natural" or o.act_order is False and order not in (None, "natural"):
        raise Exl2Error(ErrorCode.USAGE, f"--{'' if o.act_order else 'no-'}act-order contradicts --order {order}")
    if order is None and o.act_order is not None:
        order = "act" if o.act_order else "natural"
    if order is None:
        order = "act" if o.target == "exl2" else _GPTQ_DEFAULT_ORDER
    if order in ("group", "static") and o.target == "exl2":
        raise Exl2Error(ErrorCode.USAGE, f"--order {order} is for GPTQ output: EXL2 stores its own input "
                        "permutation, so it takes the full act-order at no cost (--order act, the default)")
    return order


@dataclass
class LayerResult:
    key: str
    plan: str
    bpw: float
    error: float          # proxy error: relative output error of the layer on its calibration inputs


@dataclass
class QuantReport:
    source: str
    destination: str
    target: str
    options: dict
    layers: list[LayerResult] = field(default_factory=list)
    blocks: list[dict] = field(default_factory=list)      # per block: key, option index, measured accuracy, rfn
    decoder_bpw: float | None = None
    head_bpw: float | None = None
    calibration_ppl: float | None = None          # next-token perplexity on the calibration rows, quantized
    calibration_ppl_fp16: float | None = None     # ... and of the source model
    seconds: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)     # from the source directory (modelcard.MODEL_FILES)
    files_left_out: list[str] = field(default_factory=list)   # the source's other files, not copied

    def as_dict(self) -> dict:
        d = asdict(self)
        return d

    def summary_lines(self) -> list[str]:
        out = [f"{self.source} -> {self.destination} ({self.target})"]
        if self.decoder_bpw is not None:
            tgt = self.options.get("bits")
            out.append(f"decoder linears: {self.decoder_bpw:.4f} bpw (target {tgt}); head {self.head_bpw:.3f} bpw"
                       if self.head_bpw is not None else f"decoder linears: {self.decoder_bpw:.4f} bpw")
        if self.calibration_ppl is not None:
            ref = "" if self.calibration_ppl_fp16 is None else f" (FP16 {self.calibration_ppl_fp16:.3f})"
            out.append(f"calibration perplexity of the quantized model: {self.calibration_ppl:.3f}{ref}")
        moe = [b["expert_tokens"] for b in self.blocks if b.get("expert_tokens") is not None]
        if moe:
            flat = sorted(n for t in moe for n in t)
            padded = sum(len(b.get("expert_hessian_padded") or ()) for b in self.blocks)
            out.append(f"experts: {len(flat)} in {len(moe)} MoE blocks saw {flat[0]}-{flat[-1]} calibration tokens "
                       f"each (median {flat[len(flat) // 2]}); {padded} expert Hessians padded for too few tokens")
        out.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return out


# ------------------------------------------------------------------------------------------------ helpers


def _blocks(spec) -> list[tuple[int, str]]:
    return [(i, kind) for i in range(spec.num_layers) for kind in ("attn", "mlp")]


def _linears(spec, kind, i: int = 0):
    """The linears of layer ``i``'s ``kind`` block (layers may differ: dense MLP layers of a MoE model)."""
    return spec.linear_names(kind, i)


def _block_index(spec) -> dict[str, tuple[int, str]]:
    """measurement key -> (layer, kind) of every block."""
    return {spec.block_key(i, k): (i, k) for i, k in _blocks(spec)}


def _opt_layers(opt, names) -> list:
    """(name, QParams) of an option for the linears the block has (Starcoder2's MLP has no gate_proj; a MoE
    block's ``experts.3.gate_proj`` takes the option's ``gate_proj``)."""
    return [(n, opt.get(n)) for n in names]


def _file_option(spec, kind, opt, i: int = 0):
    """The option as measurement.json names it: one setting per linear of layer ``i``'s block, or for a MoE block
    one per expert projection role (ExLlamaV2's ``w1``/``w3``/``w2``, applied to every expert)."""
    from .qparams import Option

    return Option(tuple((f, opt.get(role)) for f, role in spec.measurement_names(kind, i)))


def _batches(rows: int, length: int, batch_tokens: int) -> list[slice]:
    per = max(1, batch_tokens // max(1, length))
    return [slice(a, min(rows, a + per)) for a in range(0, rows, per)]


def _rel_err_tokens(y, y_ref) -> float:
    """A block's error: the mean over every token of ||y_t - y_ref_t|| / ||y_ref_t|| (``y``/``y_ref``: float32
    [rows, T, hidden], the block's output hidden states, residual included).

    Per token, not per calibration row: trained models carry "massive activations" (a few tokens, usually a row's
    first, whose residual norm is 100x the others': SmolLM2-135M's first token reaches 21 500 against a median of
    130-700 from layer 12 on). A row's Frobenius norm is then that one token, and a row-relative error sees only
    its error, so the blocks that carry such a token look nearly free to quantize and the solver starved them
    (2-bit plans for layers 12-16 of 30). Each following RMSNorm scales every token by its own norm, so the
    per-token ratio is the perturbation the next layer actually reads."""
    d = (y - y_ref).norm(dim=-1)
    r = y_ref.norm(dim=-1).clamp_min(1e-30)
    return float((d / r).mean())


def _atomic_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_tensors(path: Path, tensors: dict[str, np.ndarray], durable: bool = True) -> None:
    """``durable=False`` for scratch that dies with its block (parked candidates): no fsync."""
    from ..container import write_safetensors

    write_safetensors(path, tensors, durable=durable)


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    from ..container import open_model

    m = open_model(path)
    try:
        return {n: np.array(m.get(n)) for n in m.names()}
    finally:
        m.close()


# ------------------------------------------------------------------------------------------------ job state


def _check_job_shape(job, path: str) -> None:
    """The types this module relies on in a job.json it reads back (an edited or damaged one is
    CHECKPOINT_INVALID naming the key, not a TypeError deep in the run)."""
    K = jsonload.JOB
    jsonload.expect(job, "object", K, file=path)
    jsonload.expect_dict_of(job.get("measured", {}), "array", K, file=path, where="measured")
    jsonload.expect_list_of(job.get("quantized", []), "string", K, file=path, where="quantized")
    for key in ("snapshot", "strategy"):
        jsonload.expect(job.get(key), ("object", "null"), K, file=path, where=key)
    jsonload.expect_dict_of(job.get("blocks", {}), "object", K, file=path, where="blocks")
    fields_ = set(LayerResult.__dataclass_fields__)
    for k, v in jsonload.expect_dict_of(job.get("layers", {}), "object", K, file=path, where="layers").items():
        if set(v) != fields_:
            raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"job.json: layers[{k!r}]: expected the fields "
                            f"{', '.join(sorted(fields_))}", file=path)


class _Work:
    """The work directory: job.json, hidden-state snapshot, per-layer outputs."""

    def __init__(self, root: Path, fingerprint: dict, resume: bool, dst: Path | None = None):
        from .workdir import make_work_dir

        self.root = root
        self.out = root / "out"
        self.job_path = root / "job.json"
        self.resumed = False          # a job of an earlier run was loaded (progress reports say where it resumed)
        if root.exists() and (root / "job.json").exists():
            if not resume:
                raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "an interrupted quantization left this work directory; "
                                "pass --resume to continue it, or delete it to start over", file=str(root))
            # the guarded loader: regular file, caps, parser errors -> CHECKPOINT_INVALID naming job.json
            self.job = jsonload.load_json(self.job_path, jsonload.JOB)
            _check_job_shape(self.job, str(self.job_path))
            if self.job.get("version") != WORK_VERSION or self.job.get("fingerprint") != fingerprint:
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, "the work directory belongs to a run with other "
                                "inputs or options; delete it or repeat the original options", file=str(root))
            self.resumed = True
        else:
            if not root.exists():     # made here, with the work marker: the only kind removed after the run
                try:
                    make_work_dir(root, dst if dst is not None else root)
                except OSError as e:
                    raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create the work directory: {e.strerror or e}",
                                    file=str(root)) from None
            self.job = {"version": WORK_VERSION, "fingerprint": fingerprint, "measured": {}, "strategy": None,
                        "quantized": [], "snapshot": None}
            self.save()
        self.out.mkdir(exist_ok=True)
        self._last_snapshot = time.monotonic()

    def save(self) -> None:
        _atomic_json(self.job_path, self.job)

    def snapshot(self, phase: str, next_block: int, states: dict[str, torch.Tensor], force: bool = False) -> None:
        """Save the hidden states (name -> tensor) before block ``next_block`` of ``phase`` (at most every few
        minutes)."""
        if not force and time.monotonic() - self._last_snapshot < _SNAPSHOT_SECONDS:
            return
        _save_tensors(self.root / "hidden.safetensors", {k: v.detach().cpu().numpy() for k, v in states.items()})
        self.job["snapshot"] = {"phase": phase, "next_block": next_block}
        self.save()
        self._last_snapshot = time.monotonic()

    def restore(self, phase: str, shape: tuple[int, ...], need: tuple[tuple[str, ...], ...] = (("h",),),
                blocks: int | None = None) -> tuple[int, dict[str, torch.Tensor] | None]:
        """The snapshot of ``phase``: (next block, {name: float32 tensor}), or (0, None) without one.  Every
        state must be float32 of ``shape`` (rows, T, hidden), each tuple of ``need`` must have one of its names
        present, and the block index must lie in 0..``blocks``; anything else (a damaged or edited work
        directory) is ``CHECKPOINT_INVALID`` naming the file and tensor."""
        snap = self.job.get("snapshot")
        path = self.root / "hidden.safetensors"
        if not snap or snap.get("phase") != phase or not path.exists():
            return 0, None
        states = _load_tensors(path)
        nb = snap.get("next_block")
        if not isinstance(nb, int) or nb < 0 or (blocks is not None and nb > blocks):
            raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"job.json: snapshot block {nb!r} is not a block index "
                            f"of this model (0..{blocks})", file=str(self.job_path))
        for name, v in states.items():
            if v.dtype != np.float32 or tuple(v.shape) != tuple(shape):
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"hidden state {name!r} is {v.dtype} "
                                f"{list(v.shape)}, the run's is float32 {list(shape)}", file=str(path))
        for names in need:
            if not any(n in states for n in names):
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"the snapshot lacks the hidden state "
                                f"{' or '.join(map(repr, names))}", file=str(path))
        return nb, {k: torch.from_numpy(v) for k, v in states.items()}

    def layer_path(self, key: str) -> Path:
        return self.out / f"{key}.safetensors"


# ------------------------------------------------------------------------------------------------ preflight

#: Stored bits per weight of all distinct candidate settings of one layer, summed (the extended tables give
#: 76-85 with overhead; upstream's alone fewer): what the parked candidates of a block take on disk.
_CANDIDATE_BITS = 88


def _disk_needed(spec, src, o: QuantOptions, measuring: bool) -> tuple[int, int]:
    """Bytes the run will write, a slight overestimate, as (output, work directory): the output (decoder linears
    at ``bits``, the head at ~``head_bits`` + overhead, everything else as fp16); in the work directory the
    per-layer copies (the quantized part again), one block's parked candidates while measuring (the quantize
    pass's parked Hessian, at most the largest K x K float32, comes after them), and two hidden-state
    snapshots."""
    lin = sum(K * N for i, kind in _blocks(spec) for n in _linears(spec, kind, i) for N, K in [spec.linear_shape(n)])
    quant_bits = float(o.bits) + 0.2 if o.target == "exl2" else float(o.bits) + 0.3
    head = spec.vocab_size * spec.hidden_size
    head_bits = (o.head_bits + 1.5) if o.target == "exl2" else 16
    other = sum(int(np.prod(src.shape(n))) for n in src.names()) - lin - head
    headers = 2048 * len(src.names())          # safetensors header entries: ~6 slots x ~200 bytes per weight
    out = lin * quant_bits / 8 + head * head_bits / 8 + max(other, 0) * 2 + headers
    quantized = lin * quant_bits / 8 + (head * head_bits / 8 if o.target == "exl2" else 0)
    block = max(sum(K * N for n in _linears(spec, kind, i) for N, K in [spec.linear_shape(n)])
                for i, kind in _blocks(spec))
    hessian = max(K * K * 4 for i, kind in _blocks(spec) for n in _linears(spec, kind, i)
                  for _, K in [spec.linear_shape(n)]) if _SPILL_HESSIANS and torch.device(o.device).type == "cpu" else 0
    hessian = hessian if hessian >= _SPILL_MIN_BYTES else 0
    variants = max(block * _CANDIDATE_BITS / 8 if measuring else 0, hessian)
    hidden = 2 * 4 * o.rows * o.length * spec.hidden_size
    return int(out), int(quantized + variants + hidden)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_disk(dst_parent: Path, work_root: Path, need: tuple[int, int]) -> None:
    """Refuse to start when a filesystem has less free space than the run will write to it (``need`` = (output
    bytes, work-directory bytes); both count against one filesystem when DST and the work directory share it)."""
    out_at, work_at = _existing(dst_parent), _existing(work_root)
    try:
        same = os.stat(out_at).st_dev == os.stat(work_at).st_dev
        checks = [(out_at, need[0] + need[1])] if same else [(out_at, need[0]), (work_at, need[1])]
    except OSError:
        return
    for probe, n in checks:
        _check_free(probe, n)


def _check_free(probe: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return                                   # cannot tell: let the writes report what happens
    if free < need:
        raise Exl2Error(ErrorCode.DISK_SPACE, f"the run needs about {need / 1e9:.2f} GB for its work files and "
                        f"the output, and the filesystem has {free / 1e9:.2f} GB free; free some space, or choose a "
                        "destination or --work-dir on another filesystem", file=str(probe))


# ------------------------------------------------------------------------------------------------ measurement


#: The measurement keeps the fp16 reconstructions of a block's candidates in memory up to this many bytes (each
#: is exactly what its packed file dequantizes to); the rest are parked on disk, packed, and dequantized back
#: when scored, so memory stays bounded however large the layers are.
_CANDIDATES_IN_MEMORY = 64 << 20
#: ... and only candidates of at most this many bytes: parking a small one costs more time than its memory is
#: worth (the fixture's measurement +5 % with none kept), while keeping large ones only raises the peak (a 1B
#: MLP's 22 MB candidates: -31 to -39 MB at its option scoring when parked, at the same measurement time)
_CANDIDATE_IN_MEMORY_MAX = 4 << 20


def _variants(blk, W, hess, options, vdir: Path, refine_scales: bool, in_memory: int | None = None,
              scale_search: str = "full", done: Callable[[str], None] | None = None) -> dict[str, dict]:
    """GPTQ-quantize every distinct candidate setting of every layer of the block whose Hessian owner is in
    ``hess`` (once per distinct group plan at the layer's K: settings whose proportions round to the same rows
    share the result).  Returns {layer: {QParams:
    candidate}}, a candidate being the fp16 reconstruction (torch float16 [N, K], while the candidates kept so
    far take at most ``in_memory`` bytes, default ``_CANDIDATES_IN_MEMORY``) or the path of its packed EXL2 form in ``vdir`` (one small file per
    layer and setting).  ``scale_search``: ``gptq.quantize_exl2_plans(scale_search=)``.

    Only one parked candidate is in memory at a time; scoring loads them back one by one (``_VariantCache``), so
    the measurement's memory does not grow with the number of candidates.  ``done(n)`` is called once layer n's
    candidates are all made."""
    from .gptq import prepare, quantize_exl2_plans

    in_memory = _CANDIDATES_IN_MEMORY if in_memory is None else in_memory
    # every owner factorized first, while nothing else of the block's candidates is alive (the factorization's
    # transient is the largest: two K x K matrices, the Hessian itself let go of once permuted, since the
    # measurement computes no proxy error; a down_proj's is 127 MB at K = 5632), each factor kept only until its
    # owner's last layer is swept
    prepared = {o: prepare(acc.take(), keep_hessian=False) for o, acc in hess.items()}
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
        for j, r in quantize_exl2_plans(w, prepared[owner], [qp.bits_rows(w.shape[1]) for qp in settings],
                                        refine_scales, hat_dtype=torch.float16, scale_search=scale_search,
                                        want_hat=lambda: size <= _CANDIDATE_IN_MEMORY_MAX and kept + size <= in_memory):
            v = made.get(tuple(r.bits_rows))
            if v is None:
                if r.weight_hat is not None:
                    v = r.weight_hat                     # float16: exact, every value is an fp16 value
                    kept += size
                else:
                    v = vdir / f"{n}.{len(made)}.safetensors"
                    _save_tensors(v, r.tensors(None), durable=False)
                made[tuple(r.bits_rows)] = v
            out[n][settings[j]] = v
            del r
        if last[owner] == n:
            del prepared[owner]
        if done is not None:
            done(n)
    return out


def _kept_bytes(made: dict[str, dict]) -> int:
    """Bytes of the candidates that ``_variants`` kept in memory (shared candidates counted once)."""
    seen = {id(v): v for cands in made.values() for v in cands.values() if isinstance(v, torch.Tensor)}
    return sum(v.numel() * v.element_size() for v in seen.values())


class _VariantCache:
    """One candidate per layer (the last one asked for), from its fp16 reconstruction in memory or dequantized
    from its packed file (exactly the fp16 values the quantizer computed): as a dense fp32 linear, or with a
    ``scoring.ReferenceTape`` that recorded the layer, as a ``scoring.DeltaLinear`` (bf16 differences from the
    reference).  ``linear(n, qp)`` gives the linear for one option sweep."""

    def __init__(self, F, variants: dict[str, dict], W, tape=None):
        self.F, self.variants, self.W, self.tape = F, variants, W, tape
        self.cur: dict[str, tuple] = {}

    def linear(self, n: str, qp):
        from ..formats import layer_from_tensors

        v = self.variants[n][qp]
        hit = self.cur.get(n)
        if hit is None or hit[0] is not v:    # settings with the same group plan share one candidate
            self.cur.pop(n, None)             # drop the previous candidate before the next one exists
            w, b = self.W[n]
            delta = self.tape is not None and self.tape.usable(n)
            dt = None if delta else torch.float32        # DeltaLinear reads the fp16 values as they are
            if isinstance(v, torch.Tensor):
                w_hat = v.to(device=w.device, dtype=dt)
            else:
                layer = layer_from_tensors(n, _load_tensors(v), out_features=w.shape[0])
                w_hat = torch.from_numpy(layer.dequantize()).to(device=w.device, dtype=dt)
            if delta:
                from .scoring import DeltaLinear

                hit = self.cur[n] = (v, DeltaLinear(self.tape, n, w, w_hat).bind)
            else:
                f = self.F.dense_linear(w_hat, b)
                hit = self.cur[n] = (v, lambda: f)
            del w_hat
        return hit[1]()


#: The option scoring keeps outputs of candidate linears for later options up to this many bytes.
_SHARED_OUTPUTS_BYTES = 64 << 20


class _SharedOutputs:
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


def _score_plan(rows: int, length: int, batch_tokens: int, measure_rows: int | None
                ) -> tuple[torch.Tensor | None, list[slice], int]:
    """How the measurement runs its rows: (row order, batches, batches that score the candidates).

    With every row scoring (``measure_rows`` None, i.e. not resolved, or >= rows): no reordering, the run's usual
    batches, all of them. Otherwise the ``measure_rows`` evenly spaced rows (first and last included) go first,
    int64 [rows] ``order`` (rows are independent sequences, so the order changes no row's result), and the batches
    are cut so that the first ones cover exactly those rows: the candidates are scored on them alone, while the
    reference pass (and with it every candidate's Hessian) still covers every row."""
    if measure_rows is None or measure_rows >= rows:
        batches = _batches(rows, length, batch_tokens)
        return None, batches, len(batches)
    m = int(measure_rows)
    pick = np.unique(np.round(np.linspace(0, rows - 1, m)).astype(np.int64)) if m > 1 else np.array([0])
    rest = np.setdiff1d(np.arange(rows), pick)
    order = torch.from_numpy(np.concatenate([pick, rest]))
    per = max(1, batch_tokens // max(1, length))
    per_m = max(d for d in range(1, min(per, m) + 1) if m % d == 0)
    return order, _batches(rows, length, per_m * length), m // per_m


def _measure(spec, src, ids_h, options_of, work: _Work, o: QuantOptions, progress, report, ids_shape: tuple
             ) -> tuple[dict, torch.Tensor]:
    """Score every candidate option of every block: ({block key: [[option, bits, accuracy]]}, the FP16 model's
    hidden state after the last block, float32 [rows, T, hidden] in the calibration's row order: the reference
    trajectory this pass runs anyway, which the quantize pass then need not run again).  ``ids_shape``: the
    calibration ids' (rows, T), which a resumed snapshot's states must match."""
    from . import scoring
    from ..runner import weights as F
    from .gptq import HessianAccumulator
    from ..runner.moe import hessian_chunks

    device = torch.device(o.device)
    blocks = _blocks(spec)
    start, states = work.restore("measure", (*ids_shape, spec.hidden_size), blocks=len(blocks))
    if progress and work.resumed:     # the earlier run's blocks are not this run's work (the ETA's rate)
        done = sum(spec.block_key(i, kind) in work.job["measured"] for i, kind in blocks)
        progress("measure", done * 1000, len(blocks) * 1000, f"resumed at block {done + 1} of {len(blocks)}")
        work.resumed = False
    h = ids_h() if states is None else states["h"]
    rows, T = h.shape[0], h.shape[1]
    order, batches, n_score = _score_plan(rows, T, o.batch_tokens, o.measure_rows)
    if order is not None and states is None:      # a snapshot is stored in this order already
        h = h.index_select(0, order.to(h.device))
    h = h.to(device)
    score_rows = batches[n_score - 1].stop
    measured = work.job["measured"]
    for bi in range(start, len(blocks)):
        i, kind = blocks[bi]
        key = spec.block_key(i, kind)
        blk = spec.block(i, kind, batches, device)
        if kind == "mlp":                    # its sweeps replay the recorded attention result
            blk.drop_attention()
        W = blk.weights()
        dense = {n: F.dense_linear(w, b) for n, (w, b) in W.items()}
        owners = sorted({blk.owner(n) for n in blk.names})
        # MoE blocks: Hessians in chunks that fit moe.LIVE_HESSIAN_BYTES, one sweep each (one chunk if all fit)
        chunks = hessian_chunks(owners, {ow: W[ow][0].shape[1] for ow in owners})
        hess = {ow: HessianAccumulator(W[ow][0].shape[1], device) for ow in chunks[0]}
        y_ref = blk.sweep(h, dense, hess, record=True)
        if key not in measured:
            options = options_of(kind)
            if progress:
                progress("measure", bi * 1000, len(blocks) * 1000, f"{key} candidates")
            vdir = work.root / "variants"
            shutil.rmtree(vdir, ignore_errors=True)
            vdir.mkdir()

            def narrow(n):
                # a layer whose candidates are made is read again only by the tape's reference forward (the
                # option sweeps replace every linear: by a candidate's dense reconstruction, which reads no W, or
                # by a DeltaLinear, which reads W_hat - W and W in bf16): the exact 16-bit copy of a weight from a
                # 16-bit checkpoint, widened per call, gives the same bits at half the bytes, and the layer's own
                # float32 copy is freed (a 1B MLP: -66 MB, -44 MB of them while down_proj's candidates are made)
                w, b = W[n]
                w16 = scoring.exact_16bit(w)
                if w16 is not w and blk.drop_linear(n):
                    W[n] = (w16, b)
                    dense[n] = F.widened_linear(w16, b)
            made = _variants(blk, W, hess, options, vdir, bool(o.refine_scales), scale_search=o.measure_search,
                             done=narrow)
            for chunk in chunks[1:]:         # the in-memory budget is the block's, shared by its chunks
                hess = {ow: HessianAccumulator(W[ow][0].shape[1], device) for ow in chunk}
                blk.sweep(h, dense, hess)
                made.update(_variants(blk, W, hess, options, vdir, bool(o.refine_scales),
                                      in_memory=_CANDIDATES_IN_MEMORY - _kept_bytes(made),
                                      scale_search=o.measure_search))
            hess = None
            # the scoring rows: the first batches (the same layer runner, so the MLP half replays the attention
            # results the reference pass recorded for them)
            scorer = blk if n_score == len(batches) else spec.block(i, kind, batches[:n_score], device)
            h_s, y_ref_s = h[:score_rows], y_ref[:score_rows]
            rows_out = []
            y = torch.empty_like(h_s)
            tape = None
            taped = blk.tapeable() if o.measure_precision == "bf16" else []
            if sum(W[n][0].numel() for n in taped) >= scoring.DELTA_MIN_WEIGHTS:
                # the linears' reference inputs and outputs on the scoring rows, recorded now rather than in the
                # reference pass so that they are not alive while the candidates' GPTQ runs (one more forward)
                tape = scoring.ReferenceTape(taped, blk.owner, n_score, n_score)
                scorer.sweep(h_s, {n: tape.recorder(n, f) for n, f in dense.items()}, out=y)
                tape.close()
            dense = None
            _trim_heap()                     # the candidates' GPTQ and the tape's forward leave free heap behind
            cache = _VariantCache(F, made, W, tape)
            # (a first linear scored from the tape costs one bf16 product and an addition, about what keeping,
            # comparing and copying its output costs, and the kept outputs were up to 64 MiB of the measurement's
            # peak: only fp32-scored first linears keep theirs)
            shared = _SharedOutputs(made, options, [n for n in spec.groups(kind, i)[0]
                                                    if n in made and not (tape is not None and tape.usable(n))])
            for j, opt in enumerate(options):
                lin = {n: shared.wrap(j, n, qp, cache.linear(n, qp)) for n, qp in _opt_layers(opt, blk.names)}
                scorer.sweep(h_s, lin, out=y)
                shared.done(j)
                _trim_heap()
                acc = max(1e-6, 1.0 - _rel_err_tokens(y, y_ref_s))
                bits = sum(qp.total_bits(W[n][0].shape[1], W[n][0].shape[0], W[n][1] is not None)
                           for n, qp in _opt_layers(opt, blk.names))
                rows_out.append([j, bits, acc])
                if progress:
                    # a block is 1000 units, spread over its options (the bar moves inside a block too)
                    progress("measure", bi * 1000 + (j + 1) * 1000 // len(options), len(blocks) * 1000,
                             f"{key} option {j + 1}/{len(options)}")
            if max(a for _, _, a in rows_out) < 0.1:
                raise Exl2Error(ErrorCode.QUANT_NUMERICS, f"every candidate of {key} has accuracy below 0.1: the "
                                "block's reference outputs are degenerate (non-finite or exploding activations?)")
            measured[key] = rows_out
            work.save()
            del cache, lin, y, shared, tape, made     # (the next block's candidates are made without these)
            shutil.rmtree(vdir, ignore_errors=True)
        if progress:
            progress("measure", (bi + 1) * 1000, len(blocks) * 1000, key)
        h = blk.next_input(h, y_ref)
        del W, dense, hess, y_ref
        _release_memory()
        if kind == "mlp":            # a layer's attention result lives only until its MLP half is measured
            work.snapshot("measure", bi + 1, {"h": h})
    spec.release()
    if order is not None:                           # back to the calibration's row order
        h = torch.empty_like(h).index_copy_(0, order.to(h.device), h)
    return measured, h


def _write_measurement_file(path: Path, spec, measured: dict, options_of) -> None:
    """ExLlamaV2's ``measurement.json`` from ``measured`` {block key: [[option index, bits, accuracy]]}: each
    row's ``total_bits`` is this model's exact cost of the setting, the rows in ascending cost
    (``qparams.write_measurement``), ``last_module_idx`` counted as ExLlamaV2 counts modules."""
    from .qparams import exllamav2_last_module_idx, write_measurement

    rows_by_key = {}
    where = _block_index(spec)
    order = list(where)                                   # block order, however the run was resumed
    for key in [k for k in order if k in measured]:
        rows = measured[key]
        i, kind = where[key]
        opts = options_of(kind)
        out = []
        for j, _, acc in rows:
            opt = _file_option(spec, kind, opts[j], i)       # only the linears the block has
            bits = 0
            for n, qp in _opt_layers(opts[j], _linears(spec, kind, i)):  # every expert's linears, for MoE
                N, K = spec.linear_shape(n)
                bits += qp.total_bits(K, N, spec.has_bias(n))
            out.append((opt, bits, acc))
        rows_by_key[key] = out
    write_measurement(path, rows_by_key, exllamav2_last_module_idx(spec.num_layers))


def _read_measurement_for(spec, path) -> dict:
    """``qparams.read_measurement`` of ``path`` for this model's blocks, linear shapes and layer count (a file for
    another model is refused)."""
    from .qparams import read_measurement

    names = {spec.block_key(i, k): tuple(f for f, _ in spec.measurement_names(k, i)) for i, k in _blocks(spec)}
    shapes = {}             # file name -> [(K, N, has_bias)] of one block's linears that take its setting
    for i, k in _blocks(spec):       # (dense and MoE MLP blocks name their settings apart: gate_proj / w1)
        files = dict((r, f) for f, r in spec.measurement_names(k, i))
        block: dict = {}
        for n in _linears(spec, k, i):
            block.setdefault(files.get(n, files.get(spec.role(n))), []).append(
                (*spec.linear_shape(n)[::-1], spec.has_bias(n)))
        for f, sh in block.items():
            shapes.setdefault(f, sh)
    return read_measurement(path, names, shapes=shapes, num_layers=spec.num_layers)


def _measured_from_file(spec, loaded: dict, options_of, where) -> dict:
    """Map a read measurement's options onto our option list by their settings (ExLlamaV2's files have upstream's
    19/17 rows in upstream's order; ours are sorted by cost), in our table's order, so the solver sees what a
    fresh measurement gives it: {block key: [[option index, bits, accuracy]]}."""
    measured = {}
    block_at = _block_index(spec)
    for key, rows in loaded.items():
        i, kind = block_at[key]
        opts = options_of(kind)
        index: dict = {}         # by the settings of the linears the block has (first option wins)
        for j, opt in enumerate(opts):
            index.setdefault(_file_option(spec, kind, opt, i), j)
        seen = {}
        for opt, tb, acc in rows:
            if opt in index and index[opt] not in seen:
                seen[index[opt]] = [index[opt], tb, acc]
        measured[key] = [seen[j] for j in sorted(seen)]
        if not measured[key]:
            raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{key}: none of the file's options is a "
                            "candidate of this quantizer", file=where)
    return measured


def plan_from_measurement(src: str | os.PathLike, measurement: str | os.PathLike, bits: float,
                          extended: bool = True) -> dict:
    """The plan the EXL2 quantizer picks for ``src`` at ``bits`` from ``measurement`` (a measurement.json), without
    quantizing: {"options": {block key: option index}, "overrides": {linear key: QParams dict}, "decoder_bpw"}.
    The same optimization ``quantize_model`` runs; compare two measurements by the plans they give."""
    from ..container import open_model
    from ..runner import weights as F
    from ..runner.model import HFModel
    from .qparams import block_options

    o = QuantOptions(target="exl2", bits=bits, extended=extended, device="cpu").resolved()
    model = open_model(Path(os.fspath(src)))
    try:
        srcw = F.WeightSource(model)
        spec = HFModel(model.config, srcw, "cpu", split_fused=True)
        options_of = (lambda kind: block_options(kind, extended=o.extended))
        measured = _measured_from_file(spec, _read_measurement_for(spec, measurement), options_of, measurement)
        report = QuantReport(source=str(src), destination="", target="exl2", options=o.fingerprint())
        plan = _optimize(spec, srcw, measured, options_of, o, report)
        return dict(plan, decoder_bpw=report.decoder_bpw)
    finally:
        model.close()


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).  Freed blocks below
    glibc's mmap threshold stay resident in its arenas, and the blocks of one option's forward are not the sizes
    the next one asks for: without this the option scoring's resident set grew by ~0.1-0.2 GB at 1B shapes."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _release_memory() -> None:
    """Collect garbage and trim the heap (``_trim_heap``) between blocks."""
    gc.collect()
    _trim_heap()


# ------------------------------------------------------------------------------------------------ optimize


def _optimize(spec, src, measured, options_of, o: QuantOptions, report) -> dict:
    from .solver import solve

    keys, slots = [], []
    numel = 0
    for i, kind in _blocks(spec):
        key = spec.block_key(i, kind)
        opts = options_of(kind)
        rows = measured[key]
        costs = []
        for j, _, acc in rows:
            opt = opts[j]
            c = 0
            for n, qp in _opt_layers(opt, _linears(spec, kind, i)):
                N, K = spec.linear_shape(n)
                c += qp.total_bits(K, N, spec.has_bias(n))
            costs.append((c, 1.0 - acc))
        keys.append(key)
        slots.append(costs)
        for n in _linears(spec, kind, i):
            N, K = spec.linear_shape(n)
            numel += K * pad32(N) + (pad32(N) if spec.has_bias(n) else 0)
    budget = int(numel * o.bits)
    picks = solve(slots, budget, norm=o.norm)
    used = sum(slots[s][j][0] for s, j in enumerate(picks))
    strategy = {k: int(measured[k][j][0]) for k, j in zip(keys, picks)}
    items = []                                   # every linear, the blocks with the largest error first
    for s in sorted(range(len(keys)), key=lambda s: (-slots[s][picks[s]][1], s)):
        i, kind = _blocks(spec)[s]
        opt = options_of(kind)[strategy[keys[s]]]
        for n in _linears(spec, kind, i):
            N, K = spec.linear_shape(n)
            items.append((spec.linear_key(i, n), K, N, spec.has_bias(n), opt.get(n)))
    overrides, used = _spend_slack(items, budget, used)
    report.decoder_bpw = used / numel
    return {"options": strategy, "overrides": {k: v.to_json() for k, v in overrides.items()}}


def _spend_slack(items, budget: int, used: int) -> tuple[dict, int]:
    """Spend what the discrete options leave of the budget: promote rows of single layers to the next bit width,
    one group at a time, round-robin over ``items`` [(key, K, N, has_bias, QParams)] in priority order.
    Returns ({key: promoted QParams}, bits used)."""
    from .qparams import promote

    cur = {key: qp for key, _, _, _, qp in items}
    overrides = {}
    grew = True
    while grew:
        grew = False
        for key, K, N, has_bias, _ in items:
            new = promote(cur[key], K)
            if new is None:
                continue
            dc = new.total_bits(K, N, has_bias) - cur[key].total_bits(K, N, has_bias)
            if 0 < dc <= budget - used:
                cur[key] = overrides[key] = new
                used += dc
                grew = True
    return overrides, used


# ------------------------------------------------------------------------------------------------ quantize


#: the quantize pass keeps a block's last linear's inputs (LayerBlock.sweep(tail=)) when they take at most this or
#: one hidden state's bytes (a 1B down_proj's at 8 x 256 tokens: 46 MB; at 8 x 512: 92 MB, which spares one more
#: MLP sweep's gate and up products: a 2-layer 1B GPTQ run 46.9 -> 44.9 s CPU, peak RSS +24 MB, as the block's
#: other reconstructions are dropped meanwhile; at 32 x 512: 369 MB, recomputed instead)
_TAIL_BYTES = 128 << 20


def _quantize(spec, src, ids, ids_h, strategy, options_of, work: _Work, o: QuantOptions, progress, report,
              h_ref_final: torch.Tensor | None = None):
    """The GPTQ pass, block by block on the quantized model's own hidden states, then the head and the two
    calibration perplexities.  ``h_ref_final``: the FP16 model's last hidden state when the measurement of
    this run computed it (``_measure``); otherwise the FP16 trajectory is advanced here, one block forward
    more per block."""
    from ..runner import weights as F
    from .gptq import (EXL2_PERCDAMP, GPTQ_PERCDAMP, HessianAccumulator, prepare, proxy_error_of_rows, proxy_rows,
                       quantize_exl2, quantize_gptq)
    from .qparams import QParams

    device = torch.device(o.device)
    blocks = _blocks(spec)
    # h: the quantized model's hidden state; h_ref: the FP16 model's, carried along (one more block forward
    # each) for the FP16 calibration perplexity that the quantized one is judged against
    # (a snapshot names the reference state "h_ref_final" when it is the trajectory's end already)
    start, states = work.restore("quant", (*ids.shape, spec.hidden_size), need=(("h",), ("h_ref", "h_ref_final")),
                                 blocks=len(blocks))
    if progress and work.resumed:     # (the measurement, if any, and these blocks were an earlier run's work)
        progress("quantize", start * 10, len(blocks) * 10, f"resumed at block {start + 1} of {len(blocks)}")
        work.resumed = False
    h = ids_h() if states is None else states["h"]
    h_ref = h_ref_final if h_ref_final is not None or states is None else states.get("h_ref_final")
    final = h_ref is not None                # the trajectory's end already: nothing to advance
    if not final:
        h_ref = h.clone() if states is None else states["h_ref"]
    ref_key = "h_ref_final" if final else "h_ref"
    h, h_ref = h.to(device), h_ref.to(device)
    rows, T = h.shape[0], h.shape[1]
    batches = _batches(rows, T, o.batch_tokens)
    damp = EXL2_PERCDAMP if o.target == "exl2" else GPTQ_PERCDAMP

    def quant_layer(i, n, w, b, prep):
        key = spec.linear_key(i, n)
        error = prep.H is not None           # (else the caller computes it once the Hessian is read back)
        if o.target == "exl2":
            ov = strategy["overrides"].get(key)
            qp = QParams.from_json(ov, key) if ov is not None else \
                options_of(kind)[strategy["options"][spec.block_key(i, kind)]].get(n)
            r = quantize_exl2(w, prep, qp.bits_rows(w.shape[1]), bool(o.refine_scales), error=error)
        else:
            r = quantize_gptq(w, prep, o.bits, o.group_size, sym=o.sym, error=error)
        bias = None if b is None else b.cpu().numpy()
        tensors = r.tensors(bias)
        path = work.layer_path(key)
        if not path.exists() or key not in work.job["quantized"]:
            _save_tensors(path, tensors)
        return r, tensors

    for bi in range(start, len(blocks)):
        i, kind = blocks[bi]
        blk = spec.block(i, kind, batches, device)
        if kind == "mlp" and final:          # only replays of the attention result run (advance_reference would
            blk.drop_attention()             # run it: it would load the weights again)
        W = blk.weights()
        lin = {n: F.dense_linear(w, b) for n, (w, b) in W.items()}
        y_d = None
        groups = spec.groups(kind, i)        # linears sharing an input, in the order the forward runs them
        for gi, group in enumerate(groups):
            owner = group[0]
            K = W[owner][0].shape[1]
            acc = HessianAccumulator(K, device)
            if y_d is None:                  # the first sweep runs every linear dense: the block's FP16 output
                y_d = blk.sweep(h, lin, {owner: acc})
            elif spec.is_moe(i):             # MoE blocks run to the end: their sweeps also count the tokens
                blk.sweep(h, lin, {owner: acc})                              # routed to each expert
            elif gi == len(groups) - 1 and len(group) == 1 and rows * T * K * 4 <= max(_TAIL_BYTES, h.nbytes):
                # the last linear (o_proj, down_proj): its inputs are kept, so that the block's quantized output
                # is made from them once it is quantized (blk.finish) instead of by one more sweep
                blk.sweep(h, lin, {owner: acc}, tail=owner)
                if blk.tail is not None:     # finish() runs only this linear: the block's other quantized
                    lin = {n: lin[n] for n in group}   # reconstructions are done with (a 1B gate + up: 88 MB)
            else:                            # a later group's only needs its input: the forward stops there
                blk.sweep(h, lin, {owner: acc}, stop_at=owner)
            gs = _gptq_groups(o, W[owner][0].shape[1])
            # on the CPU the Hessian waits in the work directory while it is factored and its linears swept (a
            # down_proj's is 127 MB at K = 5632, a third of the factorization's peak); the proxy errors are
            # computed once it is read back, from the rows they read of each weight and reconstruction
            spill = work.root / "hessian.safetensors" if (_SPILL_HESSIANS and device.type == "cpu"
                                                  and K * K * 4 >= _SPILL_MIN_BYTES) else None
            prep = prepare(_spilled(acc.take(), spill), percdamp=damp, act_order=o.act_order,   # one per group
                           within_groups=gs if o.order == "group" else None,
                           fixed_groups=gs if o.order == "static" else None, keep_hessian=spill is None)
            del acc
            done: list[tuple] = []           # (key, plan, bpw, error or the rows it is computed from)
            for n in group:
                w, b = W[n]
                r, packed = quant_layer(i, n, w, b, prep)
                lin[n] = F.dense_linear(r.weight_hat, b)
                N = w.shape[0]
                probe = r.error if spill is None else (w[proxy_rows(N)].clone(), r.weight_hat[proxy_rows(N)].clone())
                # no FP16 forward of this layer follows (the trajectory was handed over; not MoE, whose dense
                # sweep below counts the routed tokens): the float32 original is not needed again (a 1B gate and
                # up: 92 MB while down_proj is factored)
                w = None
                if final and not spec.is_moe(i) and blk.drop_linear(n):
                    W[n] = (None, b)
                done.append((spec.linear_key(i, n), _plan_of(r), _bpw_of(packed, N), probe))
                if progress:
                    progress("quantize", bi * 10 + 1 + _linears(spec, kind, i).index(n), len(blocks) * 10,
                             done[-1][0])
            if spill is not None:            # the factor and sweep are done with: the Hessian back for the errors
                prep = r = packed = None
                H = _unspilled(spill, K)
            for lk, plan, bpw, probe in done:
                err = probe if spill is None else proxy_error_of_rows(*probe, H)
                work.job.setdefault("layers", {})[lk] = asdict(LayerResult(lk, plan, bpw, err))
            H = done = probe = None
        # the last group's factorization and result are not needed by the sweeps below (a down_proj's Hessian and
        # factor are 254 MB at K = 5632)
        prep = r = packed = None
        y_q = blk.finish(h, lin)                 # the MLP half replays this (quantized) attention result
        if blk.expert_tokens is not None:    # MoE: the tokens per expert are reported from the dense sweep's routing
            y_d = blk.sweep(h, {n: F.dense_linear(w, b) for n, (w, b) in W.items()})
        key = spec.block_key(i, kind)
        work.job.setdefault("blocks", {})[key] = {
            "block": key, "option": None if strategy is None else strategy["options"].get(key),
            "rfn_error": _rel_err_tokens(y_q, y_d)}
        if blk.expert_tokens is not None:      # MoE: calibration tokens routed to each expert (quantized model)
            work.job["blocks"][key].update(expert_tokens=blk.expert_tokens, expert_hessian_padded={
                spec.linear_key(i, n): pad for n, pad in blk.padded.items() if pad})
        for n in blk.names:
            k = spec.linear_key(i, n)
            if k not in work.job["quantized"]:
                work.job["quantized"].append(k)
        work.save()
        h = blk.next_input(h, y_q)
        del y_d, y_q
        if not final:
            h_ref = blk.advance_reference(h_ref)
        del W, lin
        _release_memory()
        if kind == "mlp":
            work.snapshot("quant", bi + 1, {"h": h, ref_key: h_ref})
        if progress:
            tokens = work.job["blocks"][key].get("expert_tokens")
            progress("quantize", (bi + 1) * 10, len(blocks) * 10,
                     key if tokens is None else f"{key} tokens per expert {' '.join(map(str, tokens))}")

    # the head (EXL2 only; GPTQ keeps a dense head, as GPTQ tools do)
    if progress:
        progress("head", 0, 1, "lm_head and calibration perplexity")
    spec.release()
    ids = ids.to(device)
    # the effective head: the embedding table when the model ties them (or stores no lm_head)
    head_name = spec.head_name
    b = spec.head_bias(device)
    dense_head = F.dense_linear(src.get(head_name, torch.float32, device), b)
    report.calibration_ppl_fp16 = _calibration_ppl(spec, src, h_ref, ids, dense_head)
    del h_ref
    if o.target == "exl2":
        from .qparams import head_qparams

        del dense_head
        _release_memory()
        N, K = src.shape(head_name)
        acc = HessianAccumulator(K, device)
        for sl in batches:
            acc.add(spec.final_norm(h[sl]))
        prep = prepare(acc.take(), percdamp=EXL2_PERCDAMP, act_order=o.act_order)
        # the head is often the largest matrix of a model: read in its stored 16-bit dtype (exact) and handed
        # over as a temporary, which quantize_exl2 frees once its float32 work matrix is made; the reconstruction
        # in float16, exact: the float32 one for the perplexity is made once the sweep's work matrix and codes
        # are gone, so no two 32000 x 2048 float32 matrices of a 1B head coexist
        r = quantize_exl2(src.get(head_name, src.stored_dtype(head_name), device), prep,
                          head_qparams(o.head_bits).bits_rows(K), bool(o.refine_scales), hat_dtype=torch.float16)
        packed = r.tensors(None if b is None else b.cpu().numpy())
        _save_tensors(work.layer_path("lm_head"), packed)
        report.head_bpw = _bpw_of(packed, N)
        work.job.setdefault("layers", {})["lm_head"] = asdict(LayerResult("lm_head", _plan_of(r), report.head_bpw,
                                                                          r.error))
        hat = r.weight_hat
        del r, acc, prep, packed
        head = F.dense_linear(hat.float(), b)
        del hat
    else:
        head = dense_head
    _release_memory()
    # per-layer and per-block results, in model order, including those of an interrupted run's blocks
    order = [spec.linear_key(i, n) for i, k in blocks for n in _linears(spec, k, i)] + ["lm_head"]
    report.layers = [LayerResult(**work.job["layers"][k]) for k in order if k in work.job["layers"]]
    report.blocks = [work.job["blocks"][spec.block_key(i, k)] for i, k in blocks]
    for b in report.blocks:
        few = sorted({int(m.group(1)) for k in b.get("expert_hessian_padded") or ()
                      if (m := re.search(r"\.experts\.(\d+)\.", k))})
        if few:
            report.warnings.append(f"{b['block']}: expert(s) {', '.join(map(str, few))} saw fewer calibration tokens "
                                   "than some projection's input features (" + ", ".join(
                                       str(b["expert_tokens"][e]) for e in few) + " tokens); those Hessians were "
                                   "padded with the all-token Hessian (gate/up) or the identity (down)")
    report.calibration_ppl = _calibration_ppl(spec, src, h, ids, head)
    a, q = report.calibration_ppl_fp16, report.calibration_ppl
    bpw = report.decoder_bpw if report.decoder_bpw is not None else o.bits
    bound = ppl_rise_bound(bpw)
    if not (math.isfinite(q) and q <= (1.0 + bound) * a):
        rise = f" (+{100 * (q / a - 1):.0f} %" if math.isfinite(q) else " ("
        report.warnings.append(f"the calibration perplexity rose from {a:.3f} (FP16) to {q:.3f} (quantized){rise}, "
                               f"more than the +{100 * bound:.0f} % expected at {bpw:.2f} bpw): the quantization "
                               "lost more than it should; try more --bits or --head-bits, or calibration text closer "
                               "to the model's use")


#: The quantize pass parks each Hessian of at least _SPILL_MIN_BYTES in the work directory while it is factored
#: and its linears swept (CPU; a 1B down_proj's is 127 MB, a small model's are not worth the file).
_SPILL_HESSIANS = True
_SPILL_MIN_BYTES = 4 << 20


def _spilled(H: torch.Tensor, path: Path | None) -> torch.Tensor:
    """``H`` float32 [K, K] (CPU), also written to ``path`` (scratch safetensors, no fsync) for ``_unspilled``;
    ``H`` itself when ``path`` is None."""
    if path is not None:
        _save_tensors(path, {"hessian": H.numpy()}, durable=False)
    return H


def _unspilled(path: Path, K: int) -> torch.Tensor:
    """The Hessian ``_spilled`` wrote, float32 [K, K], read back bit for bit (pread, not the memory map); the file
    is removed.  A damaged file is refused by the container, one of another shape here."""
    from ..container import SourceReader, open_model

    reader = SourceReader(open_model(path))
    try:
        H = reader.read("hessian")
    finally:
        reader.close()
    if H.shape != (K, K) or H.dtype != np.float32:
        raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"expected a float32 {K} x {K} Hessian, found {H.dtype} "
                        f"{list(H.shape)}", file=str(path), tensor="hessian")
    path.unlink()
    return torch.from_numpy(H)


def _gptq_groups(o: QuantOptions, K: int) -> int | None:
    """The GPTQ group size for ``prepare`` (one group of K rows for -1); None for EXL2."""
    if o.target != "gptq":
        return None
    return K if o.group_size == -1 else int(o.group_size)


def _calibration_ppl(spec, src, h, ids, head, max_logit_bytes: int = 64 << 20) -> float:
    """Perplexity of next-token prediction over the calibration rows, from the last hidden state ``h`` float
    [rows, T, hidden] and the token ids int64 [rows, T].  The logits are made a few thousand tokens at a time
    (at most ``max_logit_bytes`` of them), never for a whole batch: 8192 tokens x a 128k vocabulary would be
    4 GiB."""
    rows, T = ids.shape
    chunk = max(1, max_logit_bytes // (4 * spec.vocab_size))
    nll, count = 0.0, 0
    for r in range(rows):
        for a in range(0, T - 1, chunk):
            b = min(T - 1, a + chunk)
            logits = spec.logits(h[r, a:b], head)
            nll += float(torch.nn.functional.cross_entropy(logits, ids[r, a + 1:b + 1], reduction="sum"))
            count += b - a
    return math.exp(nll / max(count, 1))


def _plan_of(r) -> str:
    from ..layout import plan_desc

    if hasattr(r, "bits_rows"):
        return plan_desc(r.bits_rows)
    gs = int(np.bincount(r.g_idx).max())
    return f"gptq {r.bits}b g{gs}"


def _bpw_of(tensors: dict[str, np.ndarray], out_features: int) -> float:
    """Bits per weight of one packed layer (slot -> array), by the layout table's accounting."""
    from ..formats import layer_from_tensors

    return layer_from_tensors("layer", tensors, out_features=out_features).bpw()


# ------------------------------------------------------------------------------------------------ compile


def _plain_specs(src, skip: set[str]) -> list:
    """OutSpecs of every tensor of ``src`` not in ``skip``: floating point becomes F16, integer buffers (position
    ids, ...) keep their dtype."""
    from ..container import OutSpec

    out = []
    for name in src.names():
        if name in skip:
            continue
        info = src.files.info(name)
        out.append(OutSpec(name, "F16" if info.dtype in _FLOAT_DTYPES else info.dtype, tuple(info.shape)))
    return out


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _plain_tensor(src, name: str, report: QuantReport, chunk_bytes: int = 16 << 20) -> np.ndarray:
    """One tensor of ``src`` as written: floating point as fp16 (values beyond its range clamped to +-65504,
    reported when the tensor is otherwise finite), integer buffers unchanged.

    Read as stored and converted in chunks of about ``chunk_bytes`` of float32: a 32000 x 2048 embedding
    costs its stored copy and its fp16 result, not three float32 copies of itself (0.65 GB at the 1B's
    compile).  Each value is rounded to fp16 once, as a whole-tensor conversion does: the same bytes."""
    from ..container import bf16_bits_to_f32
    from ..container.dtypes import count_bit_pattern

    dtype = src.files.info(name).dtype
    if dtype not in _FLOAT_DTYPES:
        return src.read_stored(name)
    a = src.read_stored(name)
    if dtype == "F16":                  # fp16 already: only +-inf is beyond the range (and no warning was ever
        if count_bit_pattern(a.view(np.uint16), 0x7FFF, 0x7C00):     # given for a non-finite tensor; NumPy's
            np.clip(a, -65504, 65504, out=a)                          # float16 clip is slow: only when needed
        return a
    out = np.empty(a.shape, dtype=np.float16)
    flat_in, flat_out = a.reshape(-1), out.reshape(-1)
    step = max(1, chunk_bytes // 4)
    finite, big = True, False
    for s in range(0, flat_in.size, step):
        c = flat_in[s:s + step]
        c = bf16_bits_to_f32(c) if dtype == "BF16" else c.copy()        # F32 / F64: a private chunk to clip
        finite = finite and bool(np.isfinite(c).all())
        big = big or bool(np.abs(c).max(initial=0) > 65504)
        np.clip(c, -65504, 65504, out=c)
        flat_out[s:s + step] = c
    if finite and big:
        report.warnings.append(f"{name}: values beyond the fp16 range were clamped")
    return out


def _write_output(tmp: Path, src, layers: list[tuple[str, Path]], skip: set[str], o: QuantOptions,
                  report: QuantReport) -> None:
    """Write the output model into ``tmp`` tensor by tensor (never the whole model in memory): every tensor of
    ``src`` not in ``skip`` converted by ``_plain_tensor``, and the slots of each quantized layer (key, packed
    layer file) as ``{key}.{slot}``.  Shards of at most ``o.shard_size`` bytes, sorted by name, named
    ``output`` (EXL2) or ``model`` (GPTQ), with ``{prefix}.safetensors.index.json`` when there are several."""
    from ..container import OutSpec, ShardWriter, SourceReader, open_model, plan_shards

    specs = _plain_specs(src, skip)
    where: dict[str, tuple[Path, str]] = {}         # output name -> (layer file, slot)
    for key, path in layers:
        m = open_model(path)
        try:
            for slot in m.names():
                t = m.info(slot)
                specs.append(OutSpec(f"{key}.{slot}", t.dtype, tuple(t.shape)))
                where[f"{key}.{slot}"] = (path, slot)
        finally:
            m.close()
    specs.sort(key=lambda sp: sp.name)
    prefix = "output" if o.target == "exl2" else "model"
    writer = ShardWriter(tmp, plan_shards(specs, o.shard_size), {"format": "pt"}, prefix=prefix,
                         index_name=f"{prefix}.safetensors.index.json")
    cur: dict = {}                                  # the one layer file open for reading (a layer's slots are adjacent)
    try:
        for sp in specs:
            if sp.name in where:
                path, slot = where[sp.name]
                if cur.get("path") != path:
                    if cur:
                        cur["reader"].close()
                    cur.update(path=path, reader=SourceReader(open_model(path)))
                arr = cur["reader"].read(slot)
            else:
                arr = _plain_tensor(src, sp.name, report)
            writer.feed(sp.name, arr)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if cur:
            cur["reader"].close()


def _compile(spec, src, src_dir: Path, tmp: Path, work: _Work, o: QuantOptions, report: QuantReport,
             config: dict, layer_keys: list[str]) -> None:
    """The output model from the work directory's layer files and the source's other tensors, plus side files
    and metadata."""
    from ..modelcard import copy_model_files

    keys = layer_keys + (["lm_head"] if o.target == "exl2" else [])
    replaced = keys + [k for i in range(spec.num_layers) for k in spec.source_keys(i)]   # fused sources too
    skip = {f"{k}.{s}" for k in replaced for s in ("weight", "bias")}
    _write_output(tmp, src, [(k, work.layer_path(k)) for k in keys], skip, o, report)
    # the model's own files only (tokenizer, generation config, license...): not a training log; the source's
    # README.md becomes a marked section of the output's own card (written after verification)
    report.files_copied, report.files_left_out = copy_model_files(src_dir, tmp, report.warnings)
    _write_metadata(tmp, config, o, report)


def _write_metadata(tmp: Path, config: dict, o: QuantOptions, report: QuantReport, weight_only: bool = False) -> None:
    """config.json with quantization_config (and quantize_config.json for GPTQ), and exl2fmt-manifest.json."""
    from .. import __version__

    cfg = dict(config)
    cfg.pop("quantization_config", None)
    if o.target == "exl2":
        from ..arch import exl2_quantization_config

        qc = exl2_quantization_config(o.bits, None if weight_only else o.head_bits, None if weight_only else {
            "rows": o.rows, "length": o.length,
            "dataset": os.path.basename(o.calibration) if o.calibration else "(default)"}, __version__,
            manifest="exl2fmt-manifest.json", **({"weight_only": True} if weight_only else {}))
    else:
        from ..arch import autogptq_quantize_config, gptq_quantization_config
        from .gptq import GPTQ_PERCDAMP

        qc = gptq_quantization_config(o.bits, o.group_size, o.sym, o.order == "act" and not weight_only, __version__,
                                      act_group_aware=o.order == "group" and not weight_only,
                                      damp_percent=GPTQ_PERCDAMP, exl2fmt_order=None if weight_only else o.order)
        (tmp / "quantize_config.json").write_text(json.dumps(autogptq_quantize_config(qc), indent=2) + "\n",
                                                  encoding="utf-8")
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=4) + "\n", encoding="utf-8")
    manifest = {"producer": f"exl2fmt {__version__}", "target": o.target, "options": o.fingerprint(),
                "decoder_bpw": report.decoder_bpw, "head_bpw": report.head_bpw,
                "calibration_perplexity": None if weight_only else {"fp16": report.calibration_ppl_fp16,
                                                                     "quantized": report.calibration_ppl},
                "layers": {l.key: {"plan": l.plan, "bpw": l.bpw, "error": l.error} for l in report.layers},
                "blocks": report.blocks}
    if weight_only:
        manifest["weight_only"] = True
    (tmp / "exl2fmt-manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _validate_or_raise(tmp: Path) -> None:
    from ..validate import validate_model

    rep = validate_model(tmp, deep=True)
    if rep.failed:
        first = next(c for c in rep.checks if c.status.value == "FAIL")
        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the quantized output fails validation: [{first.code}] "
                        f"{first.message}", file=str(tmp))


def _verify(tmp: Path, work: _Work, layer_keys: list[str], o: QuantOptions, report: QuantReport) -> None:
    """The output must pass the deep validator, and every layer must hold exactly the tensors quantized."""
    from ..container import open_model
    from ..container import SourceReader

    _validate_or_raise(tmp)
    out = SourceReader(open_model(tmp))             # pread, not the map: one tensor resident at a time
    try:
        for k in layer_keys + (["lm_head"] if o.target == "exl2" else []):
            m = SourceReader(open_model(work.layer_path(k)))
            try:
                for slot in m.model.names():
                    if not np.array_equal(out.read(f"{k}.{slot}"), m.read(slot)):
                        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "written tensor differs from the quantized "
                                        "layer", file=str(tmp), tensor=f"{k}.{slot}")
            finally:
                m.close()
    finally:
        out.close()
    if o.target == "exl2":
        measured = _measured_decoder_bpw(tmp)
        report.decoder_bpw = measured
        if measured > o.bits + 1e-9:
            raise Exl2Error(ErrorCode.BUDGET_INFEASIBLE, f"the decoder linears measure {measured:.4f} bpw, above "
                            f"the target {o.bits}", file=str(tmp))


def _measured_decoder_bpw(path: Path) -> float:
    """The decoder linears' bpw as ``exl2fmt inspect`` reports it (headers only): MoE routers are not counted
    (``layout.STAYS_16BIT``: they stay 16-bit and are outside the budget, as in ExLlamaV2)."""
    from ..inspect import inspect_model

    return inspect_model(path, layers=False)["summary"]["bpw"]["decoder"]


# ------------------------------------------------------------------------------------------------ weight-only


_NUMBERED = re.compile(r"(?:^|\.)(\d+)\.")


def _weight_only(model, src_p: Path, dst_p: Path, o: QuantOptions, force: bool, progress, config: dict,
                 why: str, t0: float) -> QuantReport:
    """Architectures without a calibration forward: every 2-D weight inside a numbered block with K % 32 == 0
    (and N % 32 == 0 for GPTQ) is quantized with an identity Hessian (round-to-nearest with the scale search,
    no act-order); the budget is spread by the relative weight error of each candidate setting, one layer per
    slot.  Everything else is written as fp16."""
    from ..container.partials import fault_point
    from ..container.publish import (check_paths, lower_shield, make_partial_dir, name_unnamed_os_error, publish,
                                     remove_path, stale_note)
    from ..runner import weights as F
    from .gptq import prepare, quantize_exl2, quantize_gptq
    from .qparams import QParams, block_options
    from .solver import solve

    if o.measurement or o.save_measurement:
        raise Exl2Error(ErrorCode.USAGE, f"weight-only mode ({why}) has no block measurement to read or save")
    report = QuantReport(source=str(src_p), destination=str(dst_p), target=o.target, options=o.fingerprint())
    report.warnings.append(f"weight-only mode: {why}; layers are quantized without calibration (identity "
                           "Hessian), which is measurably worse than calibrated GPTQ")
    src = F.WeightSource(model)
    keys = []
    for name in src.names():
        shape = src.shape(name)
        if not name.endswith(".weight") or len(shape) != 2 or not _NUMBERED.search(name):
            continue
        if stays_16bit(name[: -len(".weight")]):
            continue                     # MoE routers stay 16-bit (layout.STAYS_16BIT, as in ExLlamaV2)
        N, K = shape
        if K % 32 or (o.target == "gptq" and N % 32):
            report.warnings.append(f"{name}: K={K}, N={N} cannot be quantized; kept as fp16")
            continue
        keys.append(name[: -len(".weight")])
    if not keys:
        raise Exl2Error(ErrorCode.FORMAT_UNKNOWN, "no linear layer inside numbered blocks to quantize",
                        file=str(src_p))
    settings = sorted({qp for kind in ("attn", "mlp") for opt in block_options(kind, o.extended)
                       for _, qp in opt.layers}, key=lambda q: q.desc())
    eye = {}
    t = time.monotonic()

    def load(key):
        w = src.get(f"{key}.weight", torch.float32)
        b = src.get(f"{key}.bias", torch.float32) if src.has(f"{key}.bias") else None
        K = w.shape[1]
        if K not in eye:
            eye[K] = prepare(torch.eye(K), act_order=False)
        return w, b, eye[K]

    chosen: dict[str, QParams] = {}
    if o.target == "exl2":
        slots, numel = [], 0
        for li, key in enumerate(keys):
            w, b, prep = load(key)
            N, K = w.shape
            numel += K * pad32(N) + (pad32(N) if b is not None else 0)
            row = []
            for qp in settings:
                r = quantize_exl2(w, prep, qp.bits_rows(K), o.refine_scales is not False)
                err = float((r.weight_hat - w).norm() / w.norm().clamp_min(1e-30))
                row.append((qp.total_bits(K, N, b is not None), err))
            slots.append(row)
            if progress:
                progress("measure", li + 1, len(keys), key)
        budget = int(numel * o.bits)
        picks = solve(slots, budget, norm=o.norm)
        used = sum(slots[i][j][0] for i, j in enumerate(picks))
        chosen = {k: settings[j] for k, j in zip(keys, picks)}
        items = [(keys[i], *src.shape(f"{keys[i]}.weight")[::-1], src.has(f"{keys[i]}.bias"), chosen[keys[i]])
                 for i in sorted(range(len(keys)), key=lambda i: (-slots[i][picks[i]][1], i))]
        overrides, used = _spend_slack(items, budget, used)
        chosen.update(overrides)
        report.decoder_bpw = used / numel
    report.seconds["measure"] = time.monotonic() - t
    t = time.monotonic()
    check_paths(src_p, dst_p, force)
    removed: list[str] = []
    tmp = make_partial_dir(dst_p, removed)
    layer_dir = make_partial_dir(dst_p)  # marked too: a killed run's leftovers are removed by the next run
    report.warnings.extend(stale_note(removed))
    try:
        # each packed layer goes to a file as it is made; the output is then written tensor by tensor
        layers = []
        for li, key in enumerate(keys):
            w, b, prep = load(key)
            bias = None if b is None else b.numpy()
            if o.target == "exl2":
                r = quantize_exl2(w, prep, chosen[key].bits_rows(w.shape[1]), o.refine_scales is not False)
            else:
                r = quantize_gptq(w, prep, o.bits, o.group_size, sym=o.sym)
            packed = r.tensors(bias)
            path = layer_dir / f"{li}.safetensors"
            _save_tensors(path, packed)
            layers.append((key, path))
            err = float((r.weight_hat - w).norm() / w.norm().clamp_min(1e-30))
            report.layers.append(LayerResult(key, _plan_of(r), _bpw_of(packed, w.shape[0]), err))
            del r, packed, w
            if progress:
                progress("quantize", li + 1, len(keys), key)
        _write_output(tmp, src, layers, {f"{k}.{s}" for k in keys for s in ("weight", "bias")}, o, report)
        from ..modelcard import copy_model_files, write_quant_card

        report.files_copied, report.files_left_out = copy_model_files(src_p if src_p.is_dir() else src_p.parent, tmp,
                                                                      report.warnings)
        _write_metadata(tmp, config, o, report, weight_only=True)
        _validate_or_raise(tmp)
        write_quant_card(tmp, src_p, config, o, report, (report.files_copied, report.files_left_out),
                         weight_only=True)
        fault_point("verified")
        publish(tmp, dst_p, force)
        fault_point("published")
    except BaseException as e:
        remove_path(tmp)
        raise name_unnamed_os_error(e, tmp)
    finally:
        shutil.rmtree(layer_dir, ignore_errors=True)
        report.warnings.extend(lower_shield())
    report.seconds["quantize+compile+verify"] = time.monotonic() - t
    report.seconds["total"] = time.monotonic() - t0
    return report


# ------------------------------------------------------------------------------------------------ entry point


def check_side_paths(src: Path, dst: Path, o: "QuantOptions", force: bool) -> Path:
    """The quantizer's paths besides SRC and DST, checked before any work (``Exl2Error``; issue 41): the work
    directory (``workdir.check_work_dir``: outside SRC and DST, one exl2fmt made, a leftover job only with
    ``--resume``) and ``--save-measurement FILE`` (never in SRC, DST or the work directory; an existing file
    only with ``--force`` and only a measurement.json).  Returns the work directory."""
    from ..outputs import file_output_error
    from .workdir import check_work_dir

    root = check_work_dir(src, dst, o.work_dir, bool(o.resume))
    if o.save_measurement:
        err = file_output_error(o.save_measurement, force, "measurement", "--save-measurement",
                                never_inside=((src, "the source"), (dst, "the destination"),
                                              (root, "the work directory")))
        if err is not None:
            raise err
    return root


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, options: QuantOptions, *, force: bool = False,
                   progress: Progress | None = None) -> QuantReport:
    """Quantize the dense Hugging Face model at ``src`` into a new EXL2 or GPTQ model directory ``dst``."""
    from ..container import open_model
    from ..container.partials import fault_point
    from ..container.publish import (check_paths, lower_shield, make_partial_dir, name_unnamed_os_error, publish,
                                     remove_path, stale_note)
    from ..runner import weights as F
    from .calib import load_calibration
    from ..runner.model import EXL2_ARCHS, HFModel
    from .qparams import block_options

    t0 = time.monotonic()
    o = options.resolved()
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    check_paths(src_p, dst_p, force)
    work_root = check_side_paths(src_p, dst_p, o, force)     # before any work (issue 41)
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise Exl2Error(ErrorCode.USAGE, f"--device {o.device}: torch {torch.__version__} sees no CUDA device")
    model = open_model(src_p)
    froze = False
    try:
        config = model.config
        if config is None:
            raise Exl2Error(ErrorCode.CONFIG_MISSING, "the quantizer needs config.json", file=str(src_p))
        try:
            srcw = F.WeightSource(model)
            spec = HFModel(config, srcw, o.device, split_fused=o.target == "exl2")
        except Exl2Error as e:
            if e.code is not ErrorCode.ARCH_UNSUPPORTED:
                raise
            return _weight_only(model, src_p, dst_p, o, force, progress, config, str(e.message), t0)
        spec.check_weights()
        if o.batch_tokens is None:
            widest = max(max(spec.linear_shape(n)) for i, kind in _blocks(spec) for n in _linears(spec, kind, i))
            o.batch_tokens = default_batch_tokens(o.length, max(widest, spec.hidden_size), o.device)
        # what exists now (torch, transformers and their modules, the model's set-up) lives for the whole run:
        # set it aside from the cyclic GC, so that each block's gc.collect (_release_memory) walks only what the
        # run itself created (0.15 s per call on the fixture, 14% of a GPTQ run there, otherwise); a caller's
        # own frozen set (gc.freeze for a fork server) is left as it is
        if not gc.get_freeze_count():
            gc.freeze()
            froze = True
        if o.target == "exl2" and o.measurement:       # a file for another model is refused before any work
            loaded = _read_measurement_for(spec, o.measurement)
        tok = src_p / "tokenizer.json"
        if o.calibration is None and not tok.exists():
            raise Exl2Error(ErrorCode.CALIBRATION_INVALID, "the built-in calibration set is text and the model has "
                            "no tokenizer.json: add the model's tokenizer.json, or pass --calibration with token "
                            "ids (.npy, .json, .safetensors input_ids)", file=str(src_p))
        ids = load_calibration(o.calibration, tok if tok.exists() else None, o.rows, o.length, o.seed,
                               vocab_size=spec.vocab_size)
        ids = torch.as_tensor(ids)
        if ids.max() >= spec.vocab_size:
            raise Exl2Error(ErrorCode.CALIBRATION_INVALID, f"token id {int(ids.max())} is outside the model's "
                            f"vocabulary ({spec.vocab_size})", file=o.calibration)
        _check_disk(dst_p.parent, work_root,
                    _disk_needed(spec, srcw, o, measuring=o.target == "exl2" and not o.measurement))
        tok_hash = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
        fp = dict(o.fingerprint(), calibration_sha256=tok_hash, source_config=config)
        work = _Work(work_root, fp, o.resume, dst_p)
        report = QuantReport(source=str(src_p), destination=str(dst_p), target=o.target, options=o.fingerprint())
        if o.target == "exl2" and spec.arch not in EXL2_ARCHS:
            report.warnings.append(f"model type {spec.arch!r} is calibrated through transformers, but ExLlamaV2 may "
                                   "not load its EXL2 output (supported there: " + ", ".join(EXL2_ARCHS) + ")")

        def ids_h():
            return spec.embed(ids, device=o.device)

        options_of = (lambda kind: block_options(kind, extended=o.extended))
        strategy = h_ref_final = None
        if o.target == "exl2":
            t = time.monotonic()
            if o.measurement:
                measured = _measured_from_file(spec, loaded, options_of, o.measurement)
            else:
                if work.job.get("strategy") is None:
                    measured, h_ref_final = _measure(spec, srcw, ids_h, options_of, work, o, progress, report,
                                                     tuple(ids.shape))
                else:
                    measured = work.job["measured"]
            report.seconds["measure"] = time.monotonic() - t
            if o.save_measurement:
                _write_measurement_file(Path(o.save_measurement), spec, measured, options_of)
            if work.job.get("strategy") is None:
                work.job["strategy"] = _optimize(spec, srcw, measured, options_of, o, report)
                work.job["decoder_bpw"] = report.decoder_bpw
                work.job["snapshot"] = None
                work.save()
            strategy = work.job["strategy"]
            report.decoder_bpw = work.job.get("decoder_bpw")
        t = time.monotonic()
        _quantize(spec, srcw, ids, ids_h, strategy, options_of, work, o, progress, report, h_ref_final)
        h_ref_final = None
        _release_memory()                 # the head's work matrices: hand the pages back before compiling
        report.seconds["quantize"] = time.monotonic() - t
        t = time.monotonic()
        layer_keys = [spec.linear_key(i, n) for i, k in _blocks(spec) for n in _linears(spec, k, i)]
        removed: list[str] = []
        tmp = make_partial_dir(dst_p, removed)
        report.warnings.extend(stale_note(removed))
        try:
            fault_point("partial")
            if progress:
                progress("compile", 0, 1, "writing the output")
            _compile(spec, srcw, src_p if src_p.is_dir() else src_p.parent, tmp, work, o, report, config, layer_keys)
            if o.target == "exl2":     # next to the model, as ExLlamaV2 leaves it: publishers reuse it
                _write_measurement_file(tmp / "measurement.json", spec, measured, options_of)
            if progress:
                progress("verify", 0, 1, "validating the output")
            _verify(tmp, work, layer_keys, o, report)
            from ..modelcard import write_quant_card

            write_quant_card(tmp, src_p, config, o, report, (report.files_copied, report.files_left_out))
            fault_point("verified")
            publish(tmp, dst_p, force)
            fault_point("published")
            if progress:
                progress("done", 1, 1, str(dst_p))
        except BaseException as e:
            remove_path(tmp)
            lower_shield()
            raise name_unnamed_os_error(e, tmp)
        report.seconds["compile+verify"] = time.monotonic() - t
        from .workdir import remove_work_dir

        if not remove_work_dir(work.root):   # only a work directory exl2fmt made (its marker) is ever removed
            report.warnings.append(f"left {work.root} in place: it is not a work directory exl2fmt made")
        report.seconds["total"] = time.monotonic() - t0
        report.warnings.extend(lower_shield())
        return report
    finally:
        if froze:
            gc.unfreeze()
        model.close()
