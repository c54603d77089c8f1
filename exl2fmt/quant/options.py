"""The quantizer's options: ``QuantOptions`` (what ``quantize_model`` takes), their defaults and their resolution
(``QuantOptions.resolved``: the device, calibration size, bits, the GPTQ sweep's input order, the batch and
measurement sizes, checked before any work), and the fingerprint a resumed run must share."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from ..codec.scale_search import SEARCHES
from ..errors import ErrorCode, Exl2Error
from ..layout import GPTQ_BITS
from .qparams import head_qparams
from .scoring import resolve_precision

__all__ = ["QuantOptions", "Progress", "DEFAULT_HEAD_BITS", "resolve_head_bits", "default_measure_rows", "default_batch_tokens", "MEASURE_MIN_TOKENS",
           "MAX_BATCH_TOKENS", "BATCH_ACTIVATION_BYTES"]

Progress = Callable[[str, int, int, str], None]   # (phase, done, total, what)

#: The bits of the EXL2 head of a model whose head is its own matrix (and of a tied model's with --head-bits
#: given without a value of its own): ExLlamaV2's default.
DEFAULT_HEAD_BITS = 6


@dataclass
class QuantOptions:
    """Options of ``quantize_model``.  ``target`` ``exl2`` or ``gptq``."""

    target: str = "exl2"
    bits: float | None = None             # exl2: average bpw of the decoder linears (default 4.125); gptq: 2/3/4/8
    # exl2 head setting (2/3/4/5/6/8): the bits of a quantized ``lm_head``.  None = auto (``resolve_head_bits``,
    # once the model is open): no separate head for a model that ties its head to its embedding (the FP16
    # embedding serves as the head, as ExLlamaV2 loads it), ``DEFAULT_HEAD_BITS`` otherwise.  Given explicitly,
    # a tied model's head is also written, quantized
    head_bits: int | None = None
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
    # weight each block's measured error by how much it grows on the way to the model's output (the gains of
    # ``sensitivity.block_gains``: stored with the measurement, else measured on 2 calibration rows with each
    # block's own measured candidate) before the solver sums them.  Off by default (every block's error counts as
    # measured, ExLlamaV2's objective): it lowered Gemma 3 270M's KL 20-32 % at 3.0 and 4.0 bpw but moved
    # SmolLM2-135M's by -4 to +8 % (bench/RESULTS.md, issue 40)
    block_gain: bool = False
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
    # the distributed measurement (``distributed``; the ``distributed`` extra, Ray): ``workers`` worker processes
    # of a local Ray cluster started for the run, or at most that many tasks at once on the cluster at
    # ``ray_address`` (HOST:PORT of its head, or "auto"; None for ``workers``: one per CPU, or per GPU with a CUDA
    # ``device``, of that cluster).  Neither changes a byte of the output, so neither is in the fingerprint
    workers: int | None = None
    ray_address: str | None = None
    # False (``--no-shared-fs``): the workers never open the source; the driver reads each layer's tensors and
    # ships them through Ray's object store (the quantize pass ships its weights that way in either case)
    shared_fs: bool = True

    @property
    def quantized_head(self) -> bool:
        """An EXL2 ``lm_head`` is quantized and written (``head_bits`` resolved to a value; ``resolve_head_bits``)."""
        return self.target == "exl2" and self.head_bits is not None

    @property
    def distributed(self) -> bool:
        """The measurement and the quantize pass's independent groups run on Ray workers (``workers`` or
        ``ray_address`` given)."""
        return self.workers is not None or bool(self.ray_address)

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
            if float(o.bits) not in GPTQ_BITS:
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
        if o.measure_search not in SEARCHES:
            raise Exl2Error(ErrorCode.USAGE, f"--measure-search must be one of {', '.join(SEARCHES)}, got "
                            f"{o.measure_search!r}")
        o.measure_precision = resolve_precision(o.measure_precision, torch.device(o.device))
        _check_cluster_options(o)
        # (only the EXL2 measurement scores candidates: other targets record no count)
        o.measure_rows = min(int(o.measure_rows), o.rows) if o.target == "exl2" else None
        # checked here, before calibration and measurement, rather than when the head or first layer is reached
        if o.target == "exl2" and o.head_bits is not None:
            head_qparams(o.head_bits)
        elif o.target != "exl2" and o.group_size != -1 and (o.group_size <= 0 or o.group_size % 32):
            raise Exl2Error(ErrorCode.USAGE, f"--group-size must be -1 or a positive multiple of 32, got "
                            f"{o.group_size}")
        return o

    def fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one (paths and cosmetics excluded)."""
        d = asdict(self)
        for k in ("resume", "work_dir", "save_measurement", "shard_size", "workers", "ray_address", "shared_fs"):
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


def resolve_head_bits(o: "QuantOptions", tied: bool) -> int | None:
    """``o.head_bits`` once the model is known: as given when given; else None (no separate head: the embedding
    serves) for an EXL2 output of a model that ties its head to its embedding (``tied``), and
    ``DEFAULT_HEAD_BITS`` otherwise (also for GPTQ, which keeps a dense head and only records the value in its
    options).  A tied model's quantized head costs ~20 % of the file of a 135M model for a KL change of 0.0006
    (bench/RESULTS.md, issue 40)."""
    if o.head_bits is not None:
        return int(o.head_bits)
    return None if (o.target == "exl2" and tied) else DEFAULT_HEAD_BITS


def _check_cluster_options(o: "QuantOptions") -> None:
    """``workers``: a whole number from 1 to 1024; ``ray_address``: HOST:PORT (a port 1-65535) or "auto";
    ``shared_fs`` False only with one of them."""
    if not o.shared_fs and not o.distributed:
        raise Exl2Error(ErrorCode.USAGE, "--no-shared-fs says how Ray workers get the weights: it needs --workers "
                        "or --ray-address")
    if o.workers is not None:
        if isinstance(o.workers, bool) or not isinstance(o.workers, (int, np.integer)) or not 1 <= o.workers <= 1024:
            raise Exl2Error(ErrorCode.USAGE, f"--workers must be a whole number from 1 to 1024, got {o.workers!r}")
        o.workers = int(o.workers)
    if o.ray_address is not None:
        a = str(o.ray_address).strip()
        if a.startswith("ray://"):
            raise Exl2Error(ErrorCode.USAGE, "--ray-address takes the head's GCS address HOST:PORT (what `ray start "
                            "--head` prints, port 6379 by default), not a ray:// client address")
        host, _, port = a.rpartition(":")
        if a != "auto" and (not host or not port.isdigit() or not 1 <= int(port) <= 65535):
            raise Exl2Error(ErrorCode.USAGE, f"--ray-address must be HOST:PORT of a Ray cluster's head (or auto), "
                            f"got {o.ray_address!r}")
        o.ray_address = a


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
