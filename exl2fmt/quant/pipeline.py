"""FP16/BF16 -> EXL2 (and GPTQ): measure, optimize, quantize, compile, verify.

``quantize_model(src, dst, QuantOptions(...))`` runs the whole conversion; each phase lives in a module of its own:

1. **Options** (``options``): ``QuantOptions.resolved()`` checks and completes them before any work.
2. **Calibration**: token ids [rows, length] (``calib.load_calibration``; the built-in set by default).
3. **Measurement** (``measure``; EXL2 only, skipped with ``measurement=``): for every attention and MLP block, the
   GPTQ Hessians of its linear layers are accumulated from the block's reference inputs; every distinct candidate
   setting of every layer is GPTQ-quantized (``candidates``: parked, packed, in the work directory, so memory does
   not grow with the candidate tables); every candidate option of the block is scored by the relative error of
   the block's output (ExLlamaV2's "accuracy").  Blocks are measured independently: the next block's input is the
   reference output.
4. **Optimization** (``optimize``): ``solver.solve`` picks one option per block so that the decoder linears'
   stored bits (overhead included) stay within ``bits x sum(K x N)``.
5. **Quantization** (``gptq_pass``): sequential GPTQ through the model on the quantized model's own activations;
   the head is quantized last with ``head_bits`` (EXL2; none for a model that ties its head to its embedding
   unless ``head_bits`` is given: the embedding serves); embeddings and norms are written as fp16.
6. **Compile** (``compile``): ``output.safetensors`` (or shards with an index) in a temporary sibling of DST, side
   files copied, ``config.json`` with ``quantization_config``, a per-layer manifest ``exl2fmt-manifest.json``;
   then the caller's ``verify_output`` (the converters pass the deep validator), every layer must dequantize to
   exactly the reconstruction the quantizer computed, and only then is the directory renamed to DST.

Work state lives in a work directory (``job``, ``workdir``; default: ``.<DST name>.exl2fmt-work`` next to DST):
``job.json`` (options fingerprint, measurement, strategy, progress), ``hidden.safetensors`` (a snapshot of the
hidden state) and ``out/<layer>.safetensors`` (each quantized layer).  ``resume=True`` continues from it; the result
is byte-identical to an uninterrupted run.  The work directory is removed after success.  Architectures without a
calibration forward take the weight-only path (``weight_only``).  The report: ``report.QuantReport``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from pathlib import Path
from typing import Callable

import torch

from ..container import open_model
from ..container.publish import check_paths, lower_shield
from ..container.staging import staged_output
from ..errors import ErrorCode, Exl2Error
from ..extras import require
from ..modelcard import write_quant_card
from ..outputs import file_output_error
from .calib import load_calibration
from .common import block_linears, model_blocks, release_memory
from .compile import check_output, compile_output
from .gptq_pass import quantize_pass
from ..runner.model import EXL2_ARCHS, HFModel
from .job import Work, check_disk, disk_needed
from .measure import measure, measured_from_file, read_measurement_for, write_measurement_file
from .sensitivity import block_gains, candidate_perturbation
from .optimize import optimize
from .options import Progress, QuantOptions, default_batch_tokens, resolve_head_bits
from .qparams import block_options, read_measurement_gains
from .report import QuantReport
from .weight_only import weight_only
from ..runner.weights import WeightSource
from .workdir import check_work_dir, remove_work_dir

__all__ = ["quantize_model", "check_side_paths"]


def check_side_paths(src: Path, dst: Path, o: QuantOptions, force: bool) -> Path:
    """The quantizer's paths besides SRC and DST, checked before any work (``Exl2Error``; issue 41): the work
    directory (``workdir.check_work_dir``: outside SRC and DST, one exl2fmt made, a leftover job only with
    ``--resume``) and ``--save-measurement FILE`` (never in SRC, DST or the work directory; an existing file
    only with ``--force`` and only a measurement.json).  Returns the work directory."""
    root = check_work_dir(src, dst, o.work_dir, bool(o.resume))
    if o.save_measurement:
        err = file_output_error(o.save_measurement, force, "measurement", "--save-measurement",
                                never_inside=((src, "the source"), (dst, "the destination"),
                                              (root, "the work directory")))
        if err is not None:
            raise err
    return root


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, options: QuantOptions, *, force: bool = False,
                   progress: Progress | None = None,
                   verify_output: Callable[[Path], None] | None = None) -> QuantReport:
    """Quantize the dense Hugging Face model at ``src`` into a new EXL2 or GPTQ model directory ``dst``.

    ``verify_output(staged_dir)``: a check of the complete staged output (a temporary directory next to DST) before
    the quantizer's own layer-equality checks and before it is published; it raises ``Exl2Error`` to refuse it
    (the converters pass their deep validation).  None: no such check."""
    t0 = time.monotonic()
    o = options.resolved()
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    check_paths(src_p, dst_p, force)
    work_root = check_side_paths(src_p, dst_p, o, force)     # before any work (issue 41)
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise Exl2Error(ErrorCode.USAGE, f"--device {o.device}: torch {torch.__version__} sees no CUDA device")
    if o.distributed:                # the extra installed, the cluster's head reachable: before any work
        require("distributed", "--workers / --ray-address (distributed quantization)")
        from .distributed import check_address
        check_address(o)
    model = open_model(src_p)
    froze = False
    pool = None
    try:
        if o.distributed:
            # Ray and its workers start in the background now, while this process sets up and tokenizes; they
            # measure (EXL2) and quantize the quantize pass's independent groups
            from .distributed import Pool, catalog_of
            pool = Pool(o, str(src_p.resolve()), catalog_of(model), model.config,
                        measure=o.target == "exl2" and not o.measurement)
        config = model.config
        if config is None:
            raise Exl2Error(ErrorCode.CONFIG_MISSING, "the quantizer needs config.json", file=str(src_p))
        try:
            srcw = WeightSource(model)
            spec = HFModel(config, srcw, o.device, split_fused=o.target == "exl2")
        except Exl2Error as e:
            if e.code is not ErrorCode.ARCH_UNSUPPORTED:
                raise
            o.head_bits = resolve_head_bits(o, False)     # (recorded in the options only: no head is quantized)
            return weight_only(model, src_p, dst_p, o, force, progress, config, str(e.message), t0, verify_output)
        spec.check_weights()
        # a model that ties its head to its embedding gets no separate EXL2 head unless --head-bits asks for one
        o.head_bits = resolve_head_bits(o, spec.tied)
        if o.batch_tokens is None:
            widest = max(max(spec.linear_shape(n)) for i, kind in model_blocks(spec)
                         for n in block_linears(spec, kind, i))
            o.batch_tokens = default_batch_tokens(o.length, max(widest, spec.hidden_size), o.device)
        # what exists now (torch, transformers and their modules, the model's set-up) lives for the whole run:
        # set it aside from the cyclic GC, so that each block's gc.collect (release_memory) walks only what the
        # run itself created (measured: bench/RESULTS.md); a caller's
        # own frozen set (gc.freeze for a fork server) is left as it is
        if not gc.get_freeze_count():
            gc.freeze()
            froze = True
        loaded = None
        if o.target == "exl2" and o.measurement:       # a file for another model is refused before any work
            loaded = read_measurement_for(spec, o.measurement)
        ids = _calibration_ids(src_p, o, spec)
        check_disk(dst_p.parent, work_root,
                   disk_needed(spec, srcw, o, measuring=o.target == "exl2" and not o.measurement))
        tok_hash = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
        fp = dict(o.fingerprint(), calibration_sha256=tok_hash, source_config=config)
        work = Work(work_root, fp, o.resume, dst_p)
        report = QuantReport(source=str(src_p), destination=str(dst_p), target=o.target, options=o.fingerprint())
        if o.target == "exl2" and spec.arch not in EXL2_ARCHS:
            report.warnings.append(f"model type {spec.arch!r} is calibrated through transformers, but ExLlamaV2 may "
                                   "not load its EXL2 output (supported there: " + ", ".join(EXL2_ARCHS) + ")")

        def ids_h():
            return spec.embed(ids, device=o.device)

        options_of = (lambda kind: block_options(kind, extended=o.extended))
        measured = strategy = h_ref_final = None
        if o.target == "exl2":
            measured, strategy, h_ref_final = _measure_and_optimize(spec, srcw, ids, ids_h, options_of, work, o,
                                                                    progress, report, loaded, src_p, pool)
        t = time.monotonic()
        quantize_pass(spec, srcw, ids, ids_h, strategy, options_of, work, o, progress, report, h_ref_final, pool)
        if pool is not None:
            pool.close()
        h_ref_final = None
        release_memory()                 # the head's work matrices: hand the pages back before compiling
        report.seconds["quantize"] = time.monotonic() - t
        t = time.monotonic()
        _compile_and_publish(spec, srcw, src_p, dst_p, work, o, report, config, measured, options_of, force,
                             progress, verify_output)
        report.seconds["compile+verify"] = time.monotonic() - t
        if not remove_work_dir(work.root):   # only a work directory exl2fmt made (its marker) is ever removed
            report.warnings.append(f"left {work.root} in place: it is not a work directory exl2fmt made")
        report.seconds["total"] = time.monotonic() - t0
        report.warnings.extend(lower_shield())
        return report
    finally:
        if pool is not None:
            pool.close()
        if froze:
            gc.unfreeze()
        model.close()


def _calibration_ids(src_p: Path, o: QuantOptions, spec) -> torch.Tensor:
    """The calibration token ids int64 [rows, length], checked against the model's vocabulary."""
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
    return ids


def _measure_and_optimize(spec, srcw, ids, ids_h, options_of, work: Work, o: QuantOptions, progress,
                          report: QuantReport, loaded: dict | None, src_p: Path, pool=None):
    """The EXL2 strategy: measured (or read from ``o.measurement``, ``loaded``) and optimized once per job, the
    measurement saved where asked.  Returns (measured, strategy, the FP16 trajectory's end when this run
    measured).  With ``o.distributed`` the measurement runs on Ray workers (``distributed``; ``pool``: the run's
    ``distributed.Pool``, started early), which read the source at ``src_p`` themselves (or are shipped each
    layer's tensors: ``o.shared_fs`` False)."""
    t = time.monotonic()
    h_ref_final = None
    if o.measurement:
        measured = measured_from_file(spec, loaded, options_of, o.measurement)
    else:
        if work.job.get("strategy") is None and o.distributed:
            from .distributed import measure_distributed
            measured, h_ref_final = measure_distributed(spec, str(src_p.resolve()), ids_h, options_of, work, o, progress,
                                                        report, tuple(ids.shape), pool)
        elif work.job.get("strategy") is None:
            measured, h_ref_final = measure(spec, srcw, ids_h, options_of, work, o, progress, report,
                                            tuple(ids.shape))
        else:
            measured = work.job["measured"]
    report.seconds["measure"] = time.monotonic() - t
    if work.job.get("strategy") is None:
        # the gains on the measured errors (--block-gains): stored with a measurement that has them, else
        # measured now
        gains = None
        if o.block_gain:
            keys = [spec.block_key(i, k) for i, k in model_blocks(spec)]
            gains = read_measurement_gains(o.measurement, keys) if o.measurement else None
            if gains is None:
                t = time.monotonic()
                # each block perturbed by its own measured candidate (kept by this run's measurement); a
                # measurement read from a file without gains has none: round-to-nearest then, said in the report
                perturb = candidate_perturbation(spec, work.root)
                if perturb is None:
                    report.warnings.append(
                        "--block-gains: the measurement file has no gains stored and this run did not measure, so "
                        "the gains are measured with a round-to-nearest perturbation, which predicts a block's "
                        "damage less well than its own GPTQ candidates (bench/RESULTS.md, issue 40): to get those, "
                        "measure with --block-gains (--save-measurement keeps the gains for reuse)")
                gains = block_gains(spec, ids, torch.device(o.device), o.batch_tokens, progress, perturb=perturb)
                report.seconds["gains"] = time.monotonic() - t
        work.job["gains"] = gains
    report.block_gains = work.job.get("gains")
    if o.save_measurement:       # (before the plan: a budget it cannot meet still leaves the measurement)
        write_measurement_file(Path(o.save_measurement), spec, measured, options_of, report.block_gains)
    if work.job.get("strategy") is None:
        work.job["strategy"] = optimize(spec, srcw, measured, options_of, o, report, report.block_gains)
        work.job["decoder_bpw"] = report.decoder_bpw
        work.job["snapshot"] = None
        work.save()
    strategy = work.job["strategy"]
    report.decoder_bpw = work.job.get("decoder_bpw")
    return measured, strategy, h_ref_final


def _compile_and_publish(spec, srcw, src_p: Path, dst_p: Path, work: Work, o: QuantOptions, report: QuantReport,
                         config: dict, measured, options_of, force: bool, progress,
                         verify_output: Callable[[Path], None] | None) -> None:
    """Write the output into a partial directory next to DST, verify it (``verify_output``, then every layer and
    the bpw: ``compile.check_output``), write its card and publish it as DST; on any failure the partial
    directory is removed."""
    layer_keys = [spec.linear_key(i, n) for i, k in model_blocks(spec) for n in block_linears(spec, k, i)]
    with staged_output(dst_p, force, warnings=report.warnings) as stage:
        tmp = stage.path
        if progress:
            progress("compile", 0, 1, "writing the output")
        compile_output(spec, srcw, src_p if src_p.is_dir() else src_p.parent, tmp, work, o, report, config,
                       layer_keys)
        if o.target == "exl2":     # next to the model, as ExLlamaV2 leaves it: publishers reuse it
            write_measurement_file(tmp / "measurement.json", spec, measured, options_of, report.block_gains)
        if progress:
            progress("verify", 0, 1, "validating the output")
        if verify_output is not None:
            verify_output(tmp)
        check_output(tmp, work, layer_keys, o, report)
        write_quant_card(tmp, src_p, config, o, report, (report.files_copied, report.files_left_out))
        stage.publish()
        if progress:
            progress("done", 1, 1, str(dst_p))
