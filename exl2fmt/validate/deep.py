"""``validate --deep`` and ``--reference``: the data pass.

Every floating-point tensor outside a checked layer is scanned for NaN/Inf (``finite``); every layer that passed
the structural checks is dequantized (``decode``, statistics in ``Report.layers``) and, with a reference model,
compared with the reference layer (``reference``): relative Frobenius error against a per-bit-width threshold.
"""

from __future__ import annotations

import math
import os

from ..errors import ErrorCode, Exl2Error
from .report import CheckId, LayerResult, PassCode, Report, Status
from .statistics import compare_weights, nonfinite_count, weight_stats

__all__ = ["REFERENCE_THRESHOLDS", "reference_threshold", "deep_pass"]


#: Per-bit-width ceilings on the relative Frobenius error ||W_deq - W_ref||_F / ||W_ref||_F of one layer
#: (data, not code).  About 1.5x what round-to-nearest with ExLlamaV2's scale search gives on heavy-tailed
#: Gaussian weights with 128-row groups (2b 0.55, 3b 0.32, 4b 0.17, 5b 0.09, 6b 0.044, 8b 0.011), leaving room
#: for GPTQ, whose error feedback trades weight error for output error.  16 = a dense layer (fp16 rounding of
#: a bf16/fp32 original only).
REFERENCE_THRESHOLDS: dict[int, float] = {2: 0.80, 3: 0.45, 4: 0.25, 5: 0.13, 6: 0.07, 8: 0.02, 16: 0.005}


def reference_threshold(fractions: dict[int, float]) -> float:
    """Threshold of a layer whose rows are split over bit widths as ``{bits: fraction of rows}``.

    Rule: the RMS combination sqrt(sum_b fraction_b * T_b^2) of the per-width thresholds T_b of
    ``REFERENCE_THRESHOLDS``: the squared error of a mixed layer is (about) the row-weighted mix of its tiers'
    squared errors.  A single-width layer gets exactly T_b.  Widths missing from the table use the next lower
    listed width (a stricter bound is never applied to fewer bits).
    """
    total = sum(fractions.values())
    if total <= 0:
        return 0.0
    acc = 0.0
    keys = sorted(REFERENCE_THRESHOLDS)
    for b, f in fractions.items():
        k = max([x for x in keys if x <= b] or [keys[0]])
        acc += (f / total) * REFERENCE_THRESHOLDS[k] ** 2
    return math.sqrt(acc)


def _layer_bits_fractions(layer, fmt: str) -> dict[int, float]:
    """{bits: fraction of the layer's rows} of a loaded layer (``fmt``: "exl2", "gptq", "exl3" or "dense")."""
    if fmt == "exl2":
        per = layer.groups.rows_per_bits()
        k = sum(per.values())
        return {b: r / k for b, r in per.items()} if k else {}
    if fmt == "gptq":
        return {int(layer.bits): 1.0}
    if fmt == "exl3":
        return {layer.rate: 1.0}
    return {16: 1.0}


def deep_pass(rep: Report, model, det, loaded: dict, reference, progress) -> None:
    """The data pass of ``deep=True`` (and ``reference``) over the layers ``loaded`` by the structural checks."""
    # tensors not belonging to a layer that was checked in depth: scan every float tensor for NaN/Inf
    # (the float tensors of EXL2 / GPTQ / dense layers are checked by the layers' own deep validation)
    from ..layout import Format
    from ..names import layer_order_key

    in_layers = set()
    for info in det.layers.values():
        if info.format in (Format.EXL2, Format.GPTQ, Format.DENSE, Format.EXL3):
            in_layers.update(t.name for t in info.slots.values())
    floats = [t for n, t in model.tensors.items() if n not in in_layers and t.dtype in ("F16", "BF16", "F32", "F64")]
    layer_bytes = {k: det.layers[k].stored_bytes for k in loaded}
    total = sum(t.nbytes for t in floats) + sum(layer_bytes.values())
    done = 0
    ref_model = None
    if reference is not None:
        from ..container import open_model

        ref_model = open_model(reference)

    def tick(n, what):
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total, what)

    if progress is not None:
        progress(0, total, "")
    # each tensor is read once: its pages leave the resident set after use (a model's files would otherwise
    # end up counted in the process's RSS; they stay in the page cache)
    release = getattr(model, "release", lambda name: None)

    def release_layer(key):
        for slot in det.layers[key].slots.values():
            release(slot.name)
    n_finite = 0
    for t in floats:
        try:
            bad = nonfinite_count(model.get(t.name), t.dtype)
        except Exl2Error as e:
            rep.add(CheckId.FINITE, Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
        else:
            if bad:
                rep.add(CheckId.FINITE, Status.FAIL, ErrorCode.NONFINITE_VALUES, f"{bad} of {t.numel} values are "
                        "NaN or Inf", tensor=t.name, file=t.file)
            else:
                n_finite += 1
        release(t.name)
        tick(t.nbytes, t.name)
    if n_finite:
        rep.ok(CheckId.FINITE, PassCode.FINITE_OK, f"{n_finite} other floating-point tensor(s) (embeddings, norms, "
               "...) hold no NaN or Inf", count=n_finite)

    n_dec = n_ref = 0
    order = sorted(loaded, key=layer_order_key)
    ahead = _Prefetcher()
    if order:
        ahead.want(det.layers[order[0]].slots.values())
    for idx, key in enumerate(order):
        if idx + 1 < len(order):  # let the kernel read the next layer while this one decodes
            ahead.want(det.layers[order[idx + 1]].slots.values())
        layer = loaded[key]
        fmt = det.layers[key].format.value
        res = LayerResult(key, fmt)
        rep.layers.append(res)
        # Without a reference to compare against, an EXL2 layer is decoded straight into statistics (same
        # values, no fp16 weight materialized: several times faster, so --deep keeps up with the disk).
        fused = ref_model is None and hasattr(layer, "stats")
        try:
            if fused:
                w = None
                res.stats = layer.stats()
                res.shape = [int(layer.out_features), int(layer.in_features)]
            else:
                w = layer.dequantize()
                res.shape = [int(x) for x in w.shape]
                res.stats = weight_stats(w)
        except Exl2Error as e:
            rep.add(CheckId.DECODE, Status.FAIL, e.code, e.message, tensor=e.tensor or key, file=e.file)
            release_layer(key)
            tick(layer_bytes[key], key)
            continue
        if res.stats["nonfinite"]:
            rep.add(CheckId.DECODE, Status.FAIL, ErrorCode.NONFINITE_VALUES, f"the dequantized weight holds "
                    f"{res.stats['nonfinite']} NaN/Inf of {res.stats['numel']}", tensor=key, file=layer.file)
        else:
            n_dec += 1
        if ref_model is not None:
            n_ref += _compare_reference(rep, res, layer, fmt, w, ref_model, key)
        del w
        release_layer(key)
        tick(layer_bytes[key], key)
    if n_dec:
        rep.ok(CheckId.DECODE, PassCode.DECODE_OK, f"{n_dec} layer(s) dequantize to finite float16 [out, in] "
               "(statistics in the layer list)", count=n_dec)
    if n_ref:
        rep.ok(CheckId.REFERENCE, PassCode.REFERENCE_OK, f"{n_ref} layer(s) within the per-bit-width error "
               f"threshold of the reference {reference}", count=n_ref)
    rep.bytes_read = done
    ahead.close()
    if ref_model is not None:
        ref_model.close()


class _Prefetcher:
    """Asks the kernel to read tensors ahead (posix_fadvise WILLNEED) so that disk reads overlap decoding.
    A no-op where posix_fadvise does not exist."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._ok = hasattr(os, "posix_fadvise")

    def want(self, infos) -> None:
        if not self._ok:
            return
        for t in infos:
            try:
                fd = self._fds.get(str(t.file))
                if fd is None:
                    fd = self._fds[str(t.file)] = os.open(t.file, os.O_RDONLY)
                if t.nbytes:
                    os.posix_fadvise(fd, t.abs_begin, t.nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # a hint only

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def _compare_reference(rep: Report, res: LayerResult, layer, fmt: str, w, ref_model, key: str) -> int:
    from ..layout import Format, marker_slot

    name = f"{key}.{marker_slot(Format.DENSE)}"
    ref_file = str(ref_model.root)
    if name not in ref_model:
        rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"the reference has no {name}; layer "
                "not compared", tensor=key, file=ref_file)
        return 0
    info = ref_model.info(name)
    if info.dtype not in ("F16", "BF16", "F32") or tuple(info.shape) != tuple(w.shape):
        rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"reference {info.dtype} "
                f"{list(info.shape)} cannot be compared with the dequantized float16 {list(w.shape)}",
                tensor=key, file=info.file)
        return 0
    from ..formats.common import as_float32

    ref = as_float32(ref_model.get(name), info.dtype)
    m = compare_weights(w, ref)
    fr = _layer_bits_fractions(layer, fmt)
    thr = reference_threshold(fr)
    m["threshold"] = thr
    m["bits"] = {str(b): round(f, 6) for b, f in sorted(fr.items(), reverse=True)}
    res.reference = m
    if not (m["rel_fro"] <= thr):
        rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"relative Frobenius error "
                f"{m['rel_fro']:.4f} exceeds the threshold {thr:.4f} for its bit widths (max abs "
                f"{m['max_abs']:.4g}, cosine {m['cosine']:.5f})", tensor=key, file=layer.file)
        return 0
    return 1
