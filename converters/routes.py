"""How ``convert`` runs a route of the table (``converters.registry``), and the drivers of the routes with their
own pipeline.

``dispatch(job)`` picks the route: from the paths alone for a ``.gguf`` source or the ``gguf`` target (their
drivers open SRC themselves), otherwise from the format detected in SRC.  A ``Converter`` route is run by
``base.run_conversion``; a driver route gets the ``Job`` (with the open model and its detection when it was chosen
after detection).

The drivers registered here:

=======================  ===================================================================================
``dense -> exl2 / gptq``  the calibrated quantizer (``exl2fmt.quant``)
``* -> gguf``             EXL2 / GPTQ / EXL3 / dense -> one GGUF file (``gguf_write.convert_to_gguf``)
``gguf -> fp16 / bf16``   a ``.gguf`` file -> Hugging Face directory (``gguf_read.convert_from_gguf``)
``gguf -> exl2 / gptq``   decoded to a staging FP16 directory next to DST, quantized, the staging removed
``exl2 -> gptq --order``  the same through an FP16 decode of the EXL2 model (``requantize``); without
                          ``--order`` EXL2 -> GPTQ is the exact re-pack (``exl2_to_gptq``)
=======================  ===================================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ErrorCode, Exl2Error
from .options import QUANTIZING, check_bits, no_quantizer_options
from .registry import Route, register, registered_pairs, route, routes_to

__all__ = ["Job", "dispatch", "get_route", "FAIL_AFTER_ENV", "fail_after_from_env", "validate_quantized_output"]

#: Test seam, not an option: with ``EXL2FMT_TEST_FAIL_AFTER=N`` in the environment a conversion raises
#: ``RuntimeError("injected ...")`` after writing N units (tests of the no-partial-output promise).
FAIL_AFTER_ENV = "EXL2FMT_TEST_FAIL_AFTER"


@dataclass
class Job:
    """One ``convert`` call, its arguments checked (``options.check_arguments``)."""

    src: str | os.PathLike
    dst: str | os.PathLike
    target: str
    force: bool
    shard_size: int
    dtype: str | None
    bits: float | None
    group_size: int | None
    sym: bool | None
    progress: Callable | None
    verify: str
    gguf_type: str
    quant: dict | None
    fail_after: int | None = None
    #: ``quantize()``: the source must be an FP16/BF16 model (said as soon as SRC is detected)
    needs_dense: bool = False
    #: set once SRC is open and detected (the routes chosen from the detected format)
    model: object = None
    detection: object = None


def fail_after_from_env() -> int | None:
    """``FAIL_AFTER_ENV`` as an int (None when unset); one environment lookup per conversion."""
    v = os.environ.get(FAIL_AFTER_ENV)
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise Exl2Error(ErrorCode.USAGE, f"{FAIL_AFTER_ENV} must be an integer, got {v!r}") from None


def load_routes() -> None:
    """Import the converter modules (they register themselves).  Deferred so that importing the package, or the
    CLI, costs nothing: numba, the codecs and the converters load on first use."""
    from . import exl2_to_gptq, gptq_to_exl2, to_dense  # noqa: F401


def get_route(source: str, target: str) -> Route:
    """The route of (``source``, ``target``), or ``Exl2Error(USAGE)`` listing the pairs that exist."""
    load_routes()
    r = route(source, target)
    if r is None:
        have = ", ".join(f"{s}->{t}" for s, t in registered_pairs()) or "none yet"
        raise Exl2Error(ErrorCode.USAGE, f"no converter from {source} to {target}; available: {have}")
    return r


def _path(p) -> Path:
    return Path(os.fspath(p))


def dispatch(job: Job):
    """Run ``job`` through its route; returns the route's report."""
    from ..inspect import is_gguf

    load_routes()
    src, target = job.src, job.target
    src_gguf = os.path.isfile(src) and is_gguf(src)
    if not os.path.lexists(src) and os.fspath(src).lower().endswith(".gguf"):
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such GGUF file", file=os.fspath(src))
    if src_gguf and target == "gguf":
        raise Exl2Error(ErrorCode.USAGE, "converting a GGUF file into another GGUF file (re-quantizing) is not "
                        "supported: use llama.cpp's llama-quantize for that, or decode it to a model directory "
                        f"first (exl2fmt convert {os.fspath(src)} DIR --to fp16) and convert DIR --to gguf")
    if src_gguf:
        return get_route("gguf", target).run(job)
    # a route that opens and detects a model SRC itself, whatever its format (the GGUF writer)
    early = [r for r in routes_to(target) if r.opens_source and r.source != "gguf"]
    if early:
        return early[0].run(job)
    return _dispatch_detected(job)


def _dispatch_detected(job: Job):
    """The routes chosen from the format detected in SRC."""
    from ..config_values import config_value_issues
    from ..container import open_model
    from ..container.publish import check_paths
    from ..detect import Verdict, detect_model, quantization_config
    from ..layout import Format
    from .base import ConversionReport, Options, run_conversion
    from .requantize import REPACK_HINT, wants_requantize

    src, dst, target = job.src, job.dst, job.target
    model = open_model(src)
    try:
        config = model.config
        det = None
        if job.needs_dense:   # quantize(): a quantized source is refused before anything else is said about it
            det = detect_model(model.tensors, config, root=model.root)
            if det.format is not Format.DENSE:
                raise Exl2Error(ErrorCode.USAGE, f"quantize needs an FP16/BF16 model; the source is "
                                f"{det.format.value} (convert re-packs quantized models)", file=str(src))
        bad_numbers = config_value_issues(config, quantization_config(config, model.root)[0], str(model.config_path))
        if bad_numbers:  # checked before any arithmetic on them (issue 11)
            raise bad_numbers[0].to_error()
        if det is None:
            det = detect_model(model.tensors, config, root=model.root)
        fatal = [i for i in det.issues if i.code is ErrorCode.FORMAT_AMBIGUOUS]
        if fatal:
            raise fatal[0].to_error()
        fmt = det.format
        if fmt is Verdict.UNKNOWN:
            raise Exl2Error(ErrorCode.FORMAT_UNKNOWN, "no linear layer of a known format found", file=str(src))
        r = route(fmt.value, target)
        if r is not None and r.driver:
            job.model, job.detection = model, det
            return r.run(job)
        if fmt is Format.EXL2 and target == "gptq" and wants_requantize(job.quant):
            job.model, job.detection = model, det
            return _requantize_exl2(job)
        # a Converter route re-packs or dequantizes: nothing to calibrate
        no_quantizer_options(job.quant, f"the source is {fmt.value}, not an FP16/BF16 model to quantize"
                             + (f"; {REPACK_HINT}" if fmt is Format.EXL2 and target == "gptq" else ""))
        bits = check_bits(target, job.bits, source=fmt.value)
        cls = get_route(fmt.value, target).run
        check_paths(_path(src), _path(dst), job.force)
    except BaseException:
        model.close()
        raise
    opts = Options(target=target, shard_size=job.shard_size, dtype=job.dtype, bits=bits, group_size=job.group_size,
                   sym=job.sym)
    report = ConversionReport(source=str(src), destination=str(dst), source_format=fmt.value, target=target,
                              options={"shard_size": job.shard_size, "dtype": job.dtype, "bits": bits,
                                       "group_size": job.group_size, "sym": job.sym, "force": job.force,
                                       "verify": job.verify})
    if fmt is Format.DENSE:
        report.linear_layers = len(det.layers)
    for i in det.issues:
        report.warnings.append(f"detect: [{i.code.value}] {i.message}")
    return run_conversion(cls, src, dst, opts, force=job.force, progress=job.progress, model=model, detection=det,
                          report=report, verify=job.verify, _fail_after=job.fail_after)


# ------------------------------------------------------------------------------------------------ drivers


def _quantize_dense(job: Job):
    """Dense source (open, detected) -> EXL2 / GPTQ: the quantizer reads SRC itself."""
    from ..extras import require
    from ..names import layer_order_key   # model order, blocks 0, 1, 2, ... 10 (not string order)

    require("quant", f"quantizing to {job.target.upper()}")
    job.model.close()
    return _quantize(job.src, job, linear_layers=sorted(job.detection.layers, key=layer_order_key))


for _t in QUANTIZING:
    register("dense", _t, driver=True)(_quantize_dense)


def _quantize(src, job: Job, quant: dict | None = None, linear_layers=None):
    """``src`` (a dense model directory) -> EXL2 / GPTQ in ``job.dst``: the calibrated quantizer
    (``exl2fmt.quant.pipeline``).  ``linear_layers``: the source's linear layers as ``inspect`` counts them; those
    the quantizer keeps unquantized are named in a warning, so the two counts can be reconciled."""
    from ..quant.options import QuantOptions
    from ..quant.pipeline import quantize_model

    progress = job.progress
    q = {k: v for k, v in dict((job.quant if quant is None else quant) or {}).items() if v is not None}
    if job.group_size is not None:
        q["group_size"] = job.group_size
    if job.sym is not None:
        q["sym"] = job.sym
    unknown = set(q) - set(QuantOptions.__dataclass_fields__)
    if unknown:
        raise Exl2Error(ErrorCode.USAGE, f"unknown quantizer option(s): {', '.join(sorted(unknown))}")
    # resolved (checked) here, before the first progress line: a bad option is refused before calibration starts
    opts = QuantOptions(target=job.target, bits=job.bits, shard_size=job.shard_size, **q).resolved()
    if progress is not None:   # at once: tokenizing and embedding the calibration set takes a while
        progress(0, 1, "calibrate: calibrating (tokenizing and embedding the calibration set)")
    cb = None if progress is None else (lambda phase, done, total, what: progress(done, total, f"{phase}: {what}"))
    rep = quantize_model(src, job.dst, opts, force=job.force, progress=cb, verify_output=validate_quantized_output)
    if job.target == "gptq":   # which runtimes load it (vLLM: desc_act, bits, K // group size)
        from .requantize import written_compatibility

        rep.compatibility = written_compatibility(_path(job.dst))
    if linear_layers:
        done = {l.key for l in rep.layers}
        kept = [k for k in linear_layers if k not in done and k != "lm_head"]  # GPTQ keeps a dense head
        if kept:
            rep.warnings.append(f"{len(done)} of the source's {len(linear_layers)} linear layers quantized; kept "
                                f"as they are: {', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''}")
    return rep


def _requantize_exl2(job: Job):
    """EXL2 (open, detected) -> GPTQ with ``--order`` (``converters.requantize``): the EXL2 decode to a staging FP16
    directory next to DST (exact, verified), the calibrated quantizer on it, each layer's weight error against
    the decode."""
    from ..container.partials import SHIELD
    from ..container.publish import check_paths
    from ..container.staging import scratch_dir
    from ..extras import require
    from .requantize import finish_report, weight_errors

    require("quant", "re-quantizing EXL2 to GPTQ (--order)")
    from ..quant.pipeline import QuantOptions, check_side_paths

    src, dst = _path(job.src), _path(job.dst)
    job.model.close()
    q = {k: v for k, v in dict(job.quant or {}).items() if v is not None}
    extra = {k: v for k, v in (("group_size", job.group_size), ("sym", job.sym)) if v is not None}
    o = QuantOptions(target="gptq", bits=job.bits, shard_size=job.shard_size, **q, **extra).resolved()
    if o.order == "act":
        raise Exl2Error(ErrorCode.USAGE, "--order act: EXL2 -> GPTQ without --order already is the act-order GPTQ, "
                        "exact and without calibration; --order static|group|natural re-quantizes for runtimes that "
                        "refuse desc_act (vLLM)")
    check_paths(src, dst, job.force)
    check_side_paths(src, dst, o, job.force)
    if o.calibration is None and not (src / "tokenizer.json").exists():   # (the decode copies it)
        raise Exl2Error(ErrorCode.CALIBRATION_INVALID, "the EXL2 model has no tokenizer.json, so the built-in "
                        "calibration text cannot be tokenized: pass --calibration with token ids (.npy, .json, "
                        ".safetensors input_ids)", file=str(src))
    with scratch_dir(dst) as staging:
        mid = staging.path / "fp16"
        with SHIELD.intermediate():
            dispatch(Job(src=src, dst=mid, target="fp16", force=False, shard_size=job.shard_size, dtype=None,
                         bits=None, group_size=None, sym=None, progress=job.progress, verify="auto",
                         gguf_type="auto", quant=None))
        rep = _quantize(mid, job, quant=q)
        errs = weight_errors(mid, dst, [l.key for l in rep.layers])
    finish_report(rep, src, o, errs, staging.stale)
    return rep


def validate_quantized_output(path: Path) -> None:
    """The quantizer's deep check of its written, unpublished output (``quantize_model(verify_output=...)``): the
    deep validator must report no failure, else ``Exl2Error(REFERENCE_MISMATCH)`` naming the first."""
    from ..validate import validate_model

    rep = validate_model(path, deep=True)
    if rep.failed:
        first = next(c for c in rep.checks if c.status.value == "FAIL")
        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the quantized output fails validation: [{first.code}] "
                        f"{first.message}", file=str(path))


def _to_gguf(job: Job):
    from ..extras import require

    require("gguf", "converting to GGUF")
    from .gguf_write import convert_to_gguf

    return convert_to_gguf(job.src, job.dst, gguf_type=job.gguf_type, force=job.force, progress=job.progress,
                           verify=job.verify, _fail_after=job.fail_after)


for _s in ("exl2", "gptq", "exl3", "dense"):
    register(_s, "gguf", driver=True, opens_source=True)(_to_gguf)


def _from_gguf(job: Job):
    from ..extras import require

    require("gguf", "reading a GGUF file")
    from .gguf_read import convert_from_gguf

    return convert_from_gguf(job.src, job.dst, job.target, force=job.force, shard_size=job.shard_size,
                             progress=job.progress, verify=job.verify, _fail_after=job.fail_after)


for _t in ("fp16", "bf16"):
    register("gguf", _t, driver=True, opens_source=True)(_from_gguf)


def _gguf_to_quantized(job: Job):
    """GGUF -> EXL2 / GPTQ: decode to a temporary FP16 directory next to DST (verified like any conversion),
    quantize that, remove it.  The quantizer's calibration needs the rebuilt tokenizer.json (byte-level BPE and,
    with transformers 5, SentencePiece vocabularies) or ``--calibration`` token ids.

    The staging directory is a marked working directory of DST (``container.staging.scratch_dir``): removed when
    the run ends or is interrupted, and by a later run for the same DST once its process is gone (after a
    SIGKILL).  Its publish is no end of the run: the interrupt shield it raises is lowered when the FP16 copy is
    in place (``SHIELD.intermediate``), so Ctrl-C / SIGTERM stop the quantization that follows."""
    from ..container.partials import SHIELD
    from ..container.publish import check_paths
    from ..container.staging import scratch_dir
    from ..extras import require

    require("gguf", "reading a GGUF file")
    from .gguf_read import convert_from_gguf

    require("quant", f"quantizing to {job.target.upper()}")
    from ..quant.pipeline import QuantOptions, check_side_paths

    src, target = job.src, job.target
    q0 = {k: v for k, v in dict(job.quant or {}).items() if v is not None and k in QuantOptions.__dataclass_fields__}
    o = QuantOptions(target=target, bits=job.bits, shard_size=job.shard_size, **q0).resolved()  # before DST
    d = _path(job.dst)
    check_paths(_path(src), d, job.force)
    check_side_paths(_path(src), d, o, job.force)   # --work-dir, --save-measurement, a leftover job: before decoding
    with scratch_dir(d) as staging:
        mid = staging.path / "fp16"
        with SHIELD.intermediate():
            convert_from_gguf(src, mid, "fp16", shard_size=job.shard_size, progress=job.progress)
        q = dict(job.quant or {})
        if q.get("calibration") is None and not (mid / "tokenizer.json").exists():
            raise Exl2Error(ErrorCode.CALIBRATION_INVALID, "the GGUF's tokenizer could not be rebuilt as "
                            "tokenizer.json, so the built-in calibration text cannot be tokenized: pass "
                            "--calibration with token ids (.npy, .json, .safetensors input_ids)", file=str(src))
        rep = _quantize(mid, job, quant=q)
        rep.warnings.extend(staging.stale)
        return rep


for _t in QUANTIZING:
    register("gguf", _t, driver=True, opens_source=True)(_gguf_to_quantized)
