"""The EXL2 measurement: every candidate option of every attention and MLP block scored by the relative error of
the block's output (``measure``), on the calibration rows ``score_plan`` picks; ExLlamaV2's ``measurement.json``
written from it (``write_measurement_file``) and read back for this model (``read_measurement_for``,
``measured_from_file``); ``plan_from_measurement``: the plan a measurement gives, without quantizing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..container import open_model
from ..errors import ErrorCode, Exl2Error
from . import candidates, gptq, scoring
from .candidates import SharedOutputs, VariantCache, candidate_tensors, kept_bytes, make_variants
from .common import (block_index, block_linears, file_option, model_blocks, option_layers, rel_err_tokens,
                     release_memory, row_batches, trim_heap)
from ..runner.model import HFModel
from .job import Work
from ..runner.moe import hessian_chunks
from .optimize import optimize
from .options import QuantOptions
from .qparams import (block_options, exllamav2_last_module_idx, read_measurement, read_measurement_gains,
                      write_measurement)
from .report import QuantReport
from .sensitivity import gain_option, save_gain_candidates
from ..runner.weights import WeightSource, dense_linear, widened_linear

__all__ = ["score_plan", "measure", "measure_block", "write_measurement_file",
           "read_measurement_for", "measured_from_file", "plan_from_measurement"]


def score_plan(rows: int, length: int, batch_tokens: int, measure_rows: int | None
               ) -> tuple[torch.Tensor | None, list[slice], int]:
    """How the measurement runs its rows: (row order, batches, batches that score the candidates).

    With every row scoring (``measure_rows`` None, i.e. not resolved, or >= rows): no reordering, the run's usual
    batches, all of them. Otherwise the ``measure_rows`` evenly spaced rows (first and last included) go first,
    int64 [rows] ``order`` (rows are independent sequences, so the order changes no row's result), and the batches
    are cut so that the first ones cover exactly those rows: the candidates are scored on them alone, while the
    reference pass (and with it every candidate's Hessian) still covers every row."""
    if measure_rows is None or measure_rows >= rows:
        batches = row_batches(rows, length, batch_tokens)
        return None, batches, len(batches)
    m = int(measure_rows)
    pick = np.unique(np.round(np.linspace(0, rows - 1, m)).astype(np.int64)) if m > 1 else np.array([0])
    rest = np.setdiff1d(np.arange(rows), pick)
    order = torch.from_numpy(np.concatenate([pick, rest]))
    per = max(1, batch_tokens // max(1, length))
    per_m = max(d for d in range(1, min(per, m) + 1) if m % d == 0)
    return order, row_batches(rows, length, per_m * length), m // per_m


def measure(spec, src, ids_h, options_of, work: Work, o: QuantOptions, progress, report, ids_shape: tuple
            ) -> tuple[dict, torch.Tensor]:
    """Score every candidate option of every block: ({block key: [[option, bits, accuracy]]}, the FP16 model's
    hidden state after the last block, float32 [rows, T, hidden] in the calibration's row order: the reference
    trajectory this pass runs anyway, which the quantize pass then need not run again).  ``ids_shape``: the
    calibration ids' (rows, T), which a resumed snapshot's states must match."""
    device = torch.device(o.device)
    blocks = model_blocks(spec)
    start, states = work.restore("measure", (*ids_shape, spec.hidden_size), blocks=len(blocks))
    if progress and work.resumed:     # the earlier run's blocks are not this run's work (the ETA's rate)
        done = sum(spec.block_key(i, kind) in work.job["measured"] for i, kind in blocks)
        progress("measure", done * 1000, len(blocks) * 1000, f"resumed at block {done + 1} of {len(blocks)}")
        work.resumed = False
    h = ids_h() if states is None else states["h"]
    rows, T = h.shape[0], h.shape[1]
    order, batches, n_score = score_plan(rows, T, o.batch_tokens, o.measure_rows)
    if order is not None and states is None:      # a snapshot is stored in this order already
        h = h.index_select(0, order.to(h.device))
    h = h.to(device)
    measured = work.job["measured"]
    for bi in range(start, len(blocks)):
        i, kind = blocks[bi]
        key = spec.block_key(i, kind)
        on_option = None
        if key not in measured and progress:
            progress("measure", bi * 1000, len(blocks) * 1000, f"{key} candidates")
            on_option = _option_progress(progress, bi, len(blocks), key)
        cands = {} if o.block_gain else None
        rows_out, h = measure_block(spec, i, kind, h, batches, n_score, o, options_of, work.root / "variants",
                                    score=key not in measured, on_option=on_option, gain_candidates=cands)
        if rows_out is not None:
            if cands is not None:         # (stored before the block counts as measured: a resumed job has both)
                save_gain_candidates(work.root, key, cands)
            measured[key] = rows_out
            work.save()
        if progress:
            progress("measure", (bi + 1) * 1000, len(blocks) * 1000, key)
        if kind == "mlp":            # a layer's attention result lives only until its MLP half is measured
            work.snapshot("measure", bi + 1, {"h": h})
    spec.release()
    if order is not None:                           # back to the calibration's row order
        h = torch.empty_like(h).index_copy_(0, order.to(h.device), h)
    return measured, h


def _option_progress(progress, bi: int, blocks: int, key: str) -> Callable[[int, int], None]:
    """``measure_block``'s ``on_option`` for a progress callback: a block is 1000 units, spread over its options
    (the bar moves inside a block too)."""
    def step(j: int, n: int) -> None:
        progress("measure", bi * 1000 + (j + 1) * 1000 // n, blocks * 1000, f"{key} option {j + 1}/{n}")
    return step


def measure_block(spec, i: int, kind: str, h: torch.Tensor, batches: list[slice], n_score: int, o: QuantOptions,
                  options_of, vdir: Path, score: bool = True,
                  on_option: Callable[[int, int], None] | None = None, gain_candidates: dict | None = None
                  ) -> tuple[list | None, torch.Tensor]:
    """One block of the measurement, on the block's FP16 input ``h`` float32 [rows, T, hidden] (the rows in
    ``score_plan``'s order, on ``o.device``): the reference sweep (the Hessians of its linears gathered), then, with
    ``score``, every candidate of every linear made (parked in ``vdir``, a scratch directory made and removed here)
    and every option of ``options_of(kind)`` scored on the first ``n_score`` of ``batches``.  Returns (the rows
    [[option index, bits, accuracy]] or None without ``score``, the next block's FP16 input).  ``on_option(j,
    count)``: called after option j is scored.

    The same call on the same input gives the same bits in any process with the same library versions and thread
    counts: ``measure`` runs it block after block, the distributed measurement (``distributed``) one layer per
    worker task."""
    device = torch.device(o.device)
    key = spec.block_key(i, kind)
    score_rows = batches[n_score - 1].stop
    rows_out = None
    blk = spec.block(i, kind, batches, device)
    if kind == "mlp":                    # its sweeps replay the recorded attention result
        blk.drop_attention()
    W = blk.weights()
    dense = {n: dense_linear(w, b) for n, (w, b) in W.items()}
    owners = sorted({blk.owner(n) for n in blk.names})
    # MoE blocks: Hessians in chunks that fit moe.LIVE_HESSIAN_BYTES, one sweep each (one chunk if all fit)
    chunks = hessian_chunks(owners, {ow: W[ow][0].shape[1] for ow in owners})
    hess = {ow: gptq.HessianAccumulator(W[ow][0].shape[1], device) for ow in chunks[0]}
    y_ref = blk.sweep(h, dense, hess, record=True)
    if score:
        options = options_of(kind)
        shutil.rmtree(vdir, ignore_errors=True)
        vdir.mkdir()

        def narrow(n):
            # a layer whose candidates are made is read again only by the tape's reference forward (the
            # option sweeps replace every linear: by a candidate's dense reconstruction, which reads no W, or
            # by a DeltaLinear, which reads W_hat - W and W in bf16): the exact 16-bit copy of a weight from a
            # 16-bit checkpoint, widened per call, gives the same bits at half the bytes, and the layer's own
            # float32 copy is freed (measured: bench/RESULTS.md)
            w, b = W[n]
            w16 = scoring.exact_16bit(w)
            if w16 is not w and blk.drop_linear(n):
                W[n] = (w16, b)
                dense[n] = widened_linear(w16, b)
        made = make_variants(blk, W, hess, options, vdir, bool(o.refine_scales), scale_search=o.measure_search,
                             done=narrow)
        for chunk in chunks[1:]:         # the in-memory budget is the block's, shared by its chunks
            hess = {ow: gptq.HessianAccumulator(W[ow][0].shape[1], device) for ow in chunk}
            blk.sweep(h, dense, hess)
            made.update(make_variants(blk, W, hess, options, vdir, bool(o.refine_scales),
                                      in_memory=candidates.CANDIDATES_IN_MEMORY - kept_bytes(made),
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
        trim_heap()                     # the candidates' GPTQ and the tape's forward leave free heap behind
        cache = VariantCache(made, W, tape)
        # (a first linear scored from the tape costs one bf16 product and an addition, about what keeping,
        # comparing and copying its output costs, and the kept outputs add to the measurement's peak: only
        # fp32-scored first linears keep theirs)
        shared = SharedOutputs(made, options, [n for n in spec.groups(kind, i)[0]
                                                if n in made and not (tape is not None and tape.usable(n))])
        for j, opt in enumerate(options):
            lin = {n: shared.wrap(j, n, qp, cache.linear(n, qp)) for n, qp in option_layers(opt, blk.names)}
            scorer.sweep(h_s, lin, out=y)
            shared.done(j)
            trim_heap()
            acc = max(1e-6, 1.0 - rel_err_tokens(y, y_ref_s))
            bits = sum(qp.total_bits(W[n][0].shape[1], W[n][0].shape[0], W[n][1] is not None)
                       for n, qp in option_layers(opt, blk.names))
            rows_out.append([j, bits, acc])
            if on_option is not None:
                on_option(j, len(options))
        if max(a for _, _, a in rows_out) < 0.1:
            raise Exl2Error(ErrorCode.QUANT_NUMERICS, f"every candidate of {key} has accuracy below 0.1: the "
                            "block's reference outputs are degenerate (non-finite or exploding activations?)")
        if gain_candidates is not None:
            j = gain_option(rows_out, sum(W[n][0].numel() for n in blk.names))
            for n, qp in option_layers(options[j], blk.names):
                gain_candidates.update(candidate_tensors(made[n][qp], n))
        del cache, lin, y, shared, tape, made     # (the next block's candidates are made without these)
        shutil.rmtree(vdir, ignore_errors=True)
    h = blk.next_input(h, y_ref)
    del W, dense, hess, y_ref
    release_memory()
    return rows_out, h


def write_measurement_file(path: Path, spec, measured: dict, options_of, gains: dict | None = None) -> None:
    """ExLlamaV2's ``measurement.json`` from ``measured`` {block key: [[option index, bits, accuracy]]}: each
    row's ``total_bits`` is this model's exact cost of the setting, the rows in ascending cost
    (``qparams.write_measurement``), ``last_module_idx`` counted as ExLlamaV2 counts modules; ``gains`` (block
    key -> factor, ``sensitivity.block_gains``) in exl2fmt's own key beside them."""
    rows_by_key = {}
    where = block_index(spec)
    order = list(where)                                   # block order, however the run was resumed
    for key in [k for k in order if k in measured]:
        rows = measured[key]
        i, kind = where[key]
        opts = options_of(kind)
        out = []
        for j, _, acc in rows:
            opt = file_option(spec, kind, opts[j], i)       # only the linears the block has
            bits = 0
            for n, qp in option_layers(opts[j], block_linears(spec, kind, i)):  # every expert's linears, for MoE
                N, K = spec.linear_shape(n)
                bits += qp.total_bits(K, N, spec.has_bias(n))
            out.append((opt, bits, acc))
        rows_by_key[key] = out
    write_measurement(path, rows_by_key, exllamav2_last_module_idx(spec.num_layers), gains=gains)


def read_measurement_for(spec, path) -> dict:
    """``qparams.read_measurement`` of ``path`` for this model's blocks, linear shapes and layer count (a file for
    another model is refused)."""
    names = {spec.block_key(i, k): tuple(f for f, _ in spec.measurement_names(k, i)) for i, k in model_blocks(spec)}
    shapes = {}             # file name -> [(K, N, has_bias)] of one block's linears that take its setting
    for i, k in model_blocks(spec):       # (dense and MoE MLP blocks name their settings apart: gate_proj / w1)
        files = dict((r, f) for f, r in spec.measurement_names(k, i))
        block: dict = {}
        for n in block_linears(spec, k, i):
            block.setdefault(files.get(n, files.get(spec.role(n))), []).append(
                (*spec.linear_shape(n)[::-1], spec.has_bias(n)))
        for f, sh in block.items():
            shapes.setdefault(f, sh)
    return read_measurement(path, names, shapes=shapes, num_layers=spec.num_layers)


def measured_from_file(spec, loaded: dict, options_of, where) -> dict:
    """Map a read measurement's options onto our option list by their settings (ExLlamaV2's files have upstream's
    19/17 rows in upstream's order; ours are sorted by cost), in our table's order, so the solver sees what a
    fresh measurement gives it: {block key: [[option index, bits, accuracy]]}."""
    measured = {}
    block_at = block_index(spec)
    for key, rows in loaded.items():
        i, kind = block_at[key]
        opts = options_of(kind)
        index: dict = {}         # by the settings of the linears the block has (first option wins)
        for j, opt in enumerate(opts):
            index.setdefault(file_option(spec, kind, opt, i), j)
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
                          extended: bool = True, block_gain: bool = False) -> dict:
    """The plan the EXL2 quantizer picks for ``src`` at ``bits`` from ``measurement`` (a measurement.json), without
    quantizing: {"options": {block key: option index}, "overrides": {linear key: QParams dict}, "decoder_bpw"}.
    The same optimization ``quantize_model`` runs; compare two measurements by the plans they give."""
    o = QuantOptions(target="exl2", bits=bits, extended=extended, device="cpu").resolved()
    model = open_model(Path(os.fspath(src)))
    try:
        srcw = WeightSource(model)
        spec = HFModel(model.config, srcw, "cpu", split_fused=True)
        options_of = (lambda kind: block_options(kind, extended=o.extended))
        measured = measured_from_file(spec, read_measurement_for(spec, measurement), options_of, measurement)
        report = QuantReport(source=str(src), destination="", target="exl2", options=o.fingerprint())
        # with ``block_gain``, the gains stored with the measurement (none in ExLlamaV2's files: every block's
        # error as measured; this function measures none)
        gains = read_measurement_gains(measurement, [spec.block_key(i, k) for i, k in model_blocks(spec)]) \
            if block_gain else None
        plan = optimize(spec, srcw, measured, options_of, o, report, gains)
        return dict(plan, decoder_bpw=report.decoder_bpw)
    finally:
        model.close()
