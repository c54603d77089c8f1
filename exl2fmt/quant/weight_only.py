"""The weight-only path, for architectures without a calibration forward (``weight_only``): every 2-D weight inside
a numbered block with K % 32 == 0 (and N % 32 == 0 for GPTQ) is quantized with an identity Hessian (round-to-nearest
with the scale search, no act-order); the EXL2 budget is spread by the relative weight error of each candidate
setting, one layer per slot.  Everything else is written as fp16."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

import torch

from ..container.publish import check_paths
from ..container.staging import staged_output
from ..errors import ErrorCode, Exl2Error
from ..layout import pad32, stays_16bit
from ..modelcard import copy_model_files, write_quant_card
from .compile import write_metadata, write_output
from .gptq import prepare, quantize_exl2, quantize_gptq
from .job import save_tensors
from .optimize import spend_slack
from .options import QuantOptions
from .qparams import QParams, block_options
from .report import LayerResult, QuantReport, bpw_of, plan_of
from .solver import solve
from ..runner.weights import WeightSource

__all__ = ["weight_only"]

_NUMBERED = re.compile(r"(?:^|\.)(\d+)\.")


def weight_only(model, src_p: Path, dst_p: Path, o: QuantOptions, force: bool, progress, config: dict,
                why: str, t0: float, verify_output: Callable[[Path], None] | None = None) -> QuantReport:
    """Quantize the model ``model`` (opened from ``src_p``) weight by weight into ``dst_p`` (``why``: the reason
    there is no calibration forward, for the report's warning; ``t0``: the run's start).  ``verify_output``: as
    in ``quantize_model``, called on the staged output before its card is written."""
    if o.measurement or o.save_measurement:
        raise Exl2Error(ErrorCode.USAGE, f"weight-only mode ({why}) has no block measurement to read or save")
    report = QuantReport(source=str(src_p), destination=str(dst_p), target=o.target, options=o.fingerprint())
    report.warnings.append(f"weight-only mode: {why}; layers are quantized without calibration (identity "
                           "Hessian), which is measurably worse than calibrated GPTQ")
    src = WeightSource(model)
    keys = _quantizable_keys(src, o, report, src_p)
    settings = sorted({qp for kind in ("attn", "mlp") for opt in block_options(kind, o.extended)
                       for _, qp in opt.layers}, key=lambda q: q.desc())
    load = _loader(src)
    t = time.monotonic()
    chosen = _plan(src, keys, settings, load, o, progress, report) if o.target == "exl2" else {}
    report.seconds["measure"] = time.monotonic() - t
    t = time.monotonic()
    check_paths(src_p, dst_p, force)
    with staged_output(dst_p, force, warnings=report.warnings) as stage:
        tmp = stage.path
        layer_dir = stage.scratch()  # marked too: a killed run's leftovers are removed by the next run
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
            save_tensors(path, packed)
            layers.append((key, path))
            err = float((r.weight_hat - w).norm() / w.norm().clamp_min(1e-30))
            report.layers.append(LayerResult(key, plan_of(r), bpw_of(packed, w.shape[0]), err))
            del r, packed, w
            if progress:
                progress("quantize", li + 1, len(keys), key)
        write_output(tmp, src, layers, {f"{k}.{s}" for k in keys for s in ("weight", "bias")}, o, report)
        report.files_copied, report.files_left_out = copy_model_files(src_p if src_p.is_dir() else src_p.parent, tmp,
                                                                      report.warnings)
        write_metadata(tmp, config, o, report, weight_only=True)
        if verify_output is not None:
            verify_output(tmp)
        write_quant_card(tmp, src_p, config, o, report, (report.files_copied, report.files_left_out),
                         weight_only=True)
        stage.publish()
    report.seconds["quantize+compile+verify"] = time.monotonic() - t
    report.seconds["total"] = time.monotonic() - t0
    return report


def _quantizable_keys(src, o: QuantOptions, report: QuantReport, src_p: Path) -> list[str]:
    """The layers the weight-only path quantizes: 2-D ``.weight`` tensors inside numbered blocks, MoE routers
    left out, those of unfit shapes kept as fp16 with a warning."""
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
    return keys


def _loader(src):
    """``load(key)``: the layer's float32 weight and bias and the identity Hessian of its K, prepared once per K."""
    eye = {}

    def load(key):
        w = src.get(f"{key}.weight", torch.float32)
        b = src.get(f"{key}.bias", torch.float32) if src.has(f"{key}.bias") else None
        K = w.shape[1]
        if K not in eye:
            eye[K] = prepare(torch.eye(K), act_order=False)
        return w, b, eye[K]
    return load


def _plan(src, keys: list[str], settings: list[QParams], load, o: QuantOptions, progress,
          report: QuantReport) -> dict[str, QParams]:
    """The EXL2 setting of every layer: each candidate setting scored by the relative weight error, one per layer
    picked within the budget, the slack spent (``report.decoder_bpw`` set to the planned bits)."""
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
    overrides, used = spend_slack(items, budget, used)
    chosen.update(overrides)
    report.decoder_bpw = used / numel
    return chosen
