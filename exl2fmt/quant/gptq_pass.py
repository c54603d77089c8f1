"""The quantize pass: sequential GPTQ through the model (``quantize_pass``).  Each block's Hessians come from the
*quantized* model's activations, and within a block the layers are quantized in order (q/k/v, then o_proj with
inputs recomputed through the quantized q/k/v; gate/up, then down_proj), so errors are compensated downstream.
The head is quantized last with ``head_bits`` (EXL2, unless a tied model's embedding serves as its head); the FP16 and quantized calibration perplexities close the
pass (``calibration_ppl``).  Every quantized layer goes to the work directory as it is made (``Work.layer_path``),
and a hidden-state snapshot after each decoder layer lets an interrupted run resume."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from . import gptq         # (gptq's functions by module: tests wrap them)
from .common import block_linears, model_blocks, rel_err_tokens, release_memory, row_batches
from .gptq import EXL2_PERCDAMP, GPTQ_PERCDAMP, quantize_exl2
from .group_quant import GroupTask, Quantized, quantize_group, rows_error
from .job import Work, save_tensors
from .options import QuantOptions
from .qparams import QParams, head_qparams
from .report import LayerResult, bpw_of, padded_expert_warnings, plan_of, ppl_warning
from ..runner.weights import dense_linear

__all__ = ["quantize_pass", "calibration_ppl"]

#: the quantize pass keeps a block's last linear's inputs (LayerBlock.sweep(tail=)) when they take at most this or
#: one hidden state's bytes (which spares one more MLP sweep's gate and up products, while the block's other
#: reconstructions are dropped meanwhile; larger inputs are recomputed instead; measured: bench/RESULTS.md)
_TAIL_BYTES = 128 << 20


def quantize_pass(spec, src, ids, ids_h, strategy, options_of, work: Work, o: QuantOptions, progress, report,
                  h_ref_final: torch.Tensor | None = None, pool=None) -> None:
    """The GPTQ pass, block by block on the quantized model's own hidden states, then the head and the two
    calibration perplexities.  ``pool``: the run's ``distributed.Pool`` (None: one process), whose workers
    quantize the groups that do not depend on each other (``distributed_quant``; the same bytes).  ``h_ref_final``: the FP16 model's last hidden state when the measurement of
    this run computed it (``measure.measure``); otherwise the FP16 trajectory is advanced here, one block forward
    more per block."""
    qp = _QuantizePass(spec, src, strategy, options_of, work, o, progress, report)
    if pool is not None:
        from .distributed_quant import QuantFanout

        qp.remote = QuantFanout(pool, o)
    qp.run(ids, ids_h, h_ref_final)
    if qp.remote is not None:
        report.seconds.update({k: round(v, 3) for k, v in qp.remote.seconds.items()})


class _QuantizePass:
    """One quantize pass: the run's context, and while it runs the quantized model's hidden state ``h`` and the
    FP16 model's ``h_ref`` (``final``: ``h_ref`` is the FP16 trajectory's end already, nothing to advance)."""

    def __init__(self, spec, src, strategy, options_of, work: Work, o: QuantOptions, progress, report):
        self.spec, self.src, self.strategy, self.options_of = spec, src, strategy, options_of
        self.work, self.o, self.progress, self.report = work, o, progress, report
        self.device = torch.device(o.device)
        self.blocks = model_blocks(spec)
        self.damp = EXL2_PERCDAMP if o.target == "exl2" else GPTQ_PERCDAMP
        self.h = self.h_ref = None
        self.final = False
        self.ref_key = "h_ref"
        self.batches: list[slice] = []
        self.remote = None                # distributed_quant.QuantFanout with a pool of Ray workers

    def run(self, ids, ids_h, h_ref_final: torch.Tensor | None) -> None:
        spec, src, o, work, progress, report = self.spec, self.src, self.o, self.work, self.progress, self.report
        device, blocks = self.device, self.blocks
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
        self.final = h_ref is not None            # the trajectory's end already: nothing to advance
        if not self.final:
            h_ref = h.clone() if states is None else states["h_ref"]
        self.ref_key = "h_ref_final" if self.final else "h_ref"
        self.h, self.h_ref = h.to(device), h_ref.to(device)
        del h, h_ref
        rows, T = self.h.shape[0], self.h.shape[1]
        self.batches = row_batches(rows, T, o.batch_tokens)

        for bi in range(start, len(blocks)):
            self.block(bi)

        # the head (EXL2 only; GPTQ keeps a dense head, as GPTQ tools do; a tied model's EXL2 head is its FP16
        # embedding unless --head-bits asked for a quantized one)
        if progress:
            progress("head", 0, 1, "lm_head and calibration perplexity" if o.quantized_head else
                     "calibration perplexity")
        spec.release()
        ids = ids.to(device)
        # the effective head: the embedding table when the model ties them (or stores no lm_head)
        head_name = spec.head_name
        b = spec.head_bias(device)
        dense_head = dense_linear(src.get(head_name, torch.float32, device), b)
        report.calibration_ppl_fp16 = calibration_ppl(spec, src, self.h_ref, ids, dense_head)
        self.h_ref = None
        if o.quantized_head:
            del dense_head
            release_memory()
            head = self.head(head_name, b)
        else:
            head = dense_head
        release_memory()
        self.finish_report(ids, head)

    def group_task(self, i: int, kind: str, group, K: int) -> GroupTask:
        """What quantizing ``group`` (linears of layer ``i``'s ``kind`` block sharing a K-feature input) needs
        besides its arrays: the strategy's EXL2 plan of each linear (its override, else the block's option) or
        the GPTQ settings, the damping and the order."""
        spec, o = self.spec, self.o
        plans = None
        if o.target == "exl2":
            plans = []
            for n in group:
                key = spec.linear_key(i, n)
                ov = self.strategy["overrides"].get(key)
                qp = QParams.from_json(ov, key) if ov is not None else \
                    self.options_of(kind)[self.strategy["options"][spec.block_key(i, kind)]].get(n)
                plans.append(tuple(qp.bits_rows(K)))
            plans = tuple(plans)
        gs = _gptq_groups(o, K)
        return GroupTask(names=tuple(group), keys=tuple(spec.linear_key(i, n) for n in group), target=o.target,
                         plans=plans, refine_scales=bool(o.refine_scales),
                         gptq=None if o.target == "exl2" else (int(o.bits), int(o.group_size), bool(o.sym)),
                         prepare=dict(percdamp=self.damp, act_order=o.act_order,
                                      within_groups=gs if o.order == "group" else None,
                                      fixed_groups=gs if o.order == "static" else None),
                         rows_error=rows_error(K, self.device))

    def take(self, q: Quantized, bi: int, W, lin, blk) -> None:
        """A quantized linear of block ``bi`` (made here or by a worker): its packed tensors to the work directory
        (unless an earlier run of this job wrote them), its reconstruction swapped into ``lin``, the float32
        original freed where no FP16 forward of it follows."""
        spec, work, progress = self.spec, self.work, self.progress
        i, kind = self.blocks[bi]
        path = work.layer_path(q.key)
        if not path.exists() or q.key not in work.job["quantized"]:
            save_tensors(path, q.tensors)
        q.tensors = None
        b = W[q.name][1]
        lin[q.name] = dense_linear(q.hat if q.hat.dtype == torch.float32 else q.hat.float(), b)
        q.hat = None
        # no FP16 forward of this layer follows (the trajectory was handed over; not MoE, whose dense sweep
        # after the block counts the routed tokens): the float32 original is not needed again (freed before
        # down_proj is factored)
        if self.final and not spec.is_moe(i) and blk.drop_linear(q.name):
            W[q.name] = (None, b)
        if progress:
            progress("quantize", bi * 10 + 1 + block_linears(spec, kind, i).index(q.name), len(self.blocks) * 10,
                     q.key)

    def record_errors(self, done: list[Quantized]) -> None:
        for q in done:
            self.work.job.setdefault("layers", {})[q.key] = asdict(LayerResult(q.key, q.plan, q.bpw, q.error))

    def block(self, bi: int) -> None:
        """Quantize block ``bi`` (its linears group by group), record its results in the job, and move ``h`` (and
        ``h_ref``) past it."""
        spec, work, progress, device = self.spec, self.work, self.progress, self.device
        i, kind = self.blocks[bi]
        blk = spec.block(i, kind, self.batches, device)
        if kind == "mlp" and self.final:     # only replays of the attention result run (advance_reference would
            blk.drop_attention()           # run it: it would load the weights again)
        W = blk.weights()
        lin = {n: dense_linear(w, b) for n, (w, b) in W.items()}
        y_d = None
        groups = spec.groups(kind, i)        # linears sharing an input, in the order the forward runs them
        if self.remote is not None and spec.is_moe(i) and kind == "mlp":
            y_d = self.remote.moe_block(self, bi, blk, W, lin, self.h)     # the experts on the workers
        else:
            for gi in range(len(groups)):
                y_d, lin = self.group(blk, bi, groups, gi, W, lin, y_d)
        h = self.h
        y_q = blk.finish(h, lin)                 # the MLP half replays this (quantized) attention result
        if blk.expert_tokens is not None:    # MoE: the tokens per expert are reported from the dense sweep's routing
            y_d = blk.sweep(h, {n: dense_linear(w, b) for n, (w, b) in W.items()})
        key = spec.block_key(i, kind)
        work.job.setdefault("blocks", {})[key] = {
            "block": key, "option": None if self.strategy is None else self.strategy["options"].get(key),
            "rfn_error": rel_err_tokens(y_q, y_d)}
        if blk.expert_tokens is not None:      # MoE: calibration tokens routed to each expert (quantized model)
            # (in the block's order of linears, however the pass took its groups: the workers' waves)
            work.job["blocks"][key].update(expert_tokens=blk.expert_tokens, expert_hessian_padded={
                spec.linear_key(i, n): blk.padded[n] for n in blk.names if blk.padded.get(n)})
        for n in blk.names:
            k = spec.linear_key(i, n)
            if k not in work.job["quantized"]:
                work.job["quantized"].append(k)
        work.save()
        self.h = blk.next_input(h, y_q)
        del h, y_d, y_q
        if not self.final:
            self.h_ref = blk.advance_reference(self.h_ref)
        del W, lin
        release_memory()
        if kind == "mlp":
            work.snapshot("quant", bi + 1, {"h": self.h, self.ref_key: self.h_ref})
        if progress:
            tokens = work.job["blocks"][key].get("expert_tokens")
            progress("quantize", (bi + 1) * 10, len(self.blocks) * 10,
                     key if tokens is None else f"{key} tokens per expert {' '.join(map(str, tokens))}")

    def group(self, blk, bi: int, groups, gi: int, W, lin, y_d):
        """The linears of ``groups[gi]`` (sharing one input, so one Hessian), quantized in order and swapped into
        ``lin``.  ``y_d``: the block's FP16 output, made by the first group's sweep.  Returns (y_d, lin)."""
        spec, o, work, progress, h = self.spec, self.o, self.work, self.progress, self.h
        i, kind = self.blocks[bi]
        rows, T = h.shape[0], h.shape[1]
        group = groups[gi]
        owner = group[0]
        K = W[owner][0].shape[1]
        acc = gptq.HessianAccumulator(K, self.device)
        if y_d is None:                  # the first sweep runs every linear dense: the block's FP16 output
            y_d = blk.sweep(h, lin, {owner: acc})
        elif spec.is_moe(i):             # MoE blocks run to the end: their sweeps also count the tokens
            blk.sweep(h, lin, {owner: acc})                              # routed to each expert
        elif gi == len(groups) - 1 and len(group) == 1 and rows * T * K * 4 <= max(_TAIL_BYTES, h.nbytes):
            # the last linear (o_proj, down_proj): its inputs are kept, so that the block's quantized output
            # is made from them once it is quantized (blk.finish) instead of by one more sweep
            blk.sweep(h, lin, {owner: acc}, tail=owner)
            if blk.tail is not None:     # finish() runs only this linear: the block's other quantized
                lin = {n: lin[n] for n in group}   # reconstructions are done with
        else:                            # a later group's only needs its input: the forward stops there
            blk.sweep(h, lin, {owner: acc}, stop_at=owner)
        if self.remote is not None and len(group) > 1:     # q/k/v, gate/up: one worker each
            self.remote.group(self, bi, group, acc.take(), W, lin, blk)
            return y_d, lin
        # on the CPU a large Hessian waits in the work directory while it is factored and its linears swept (K x K
        # float32, a third of the factorization's peak); the proxy errors are computed once it is read back
        task = self.group_task(i, kind, group, K)
        spill = work.root / "hessian.safetensors" if task.rows_error else None
        weights = [W[n] for n in group]
        done = quantize_group(task, acc.take(), weights, spill,
                              on_linear=lambda q: self.take(q, bi, W, lin, blk))
        del acc
        self.record_errors(done)
        return y_d, lin

    def head(self, head_name: str, b):
        """The EXL2 head quantized at ``head_bits`` on the final normed hidden states (written to the work
        directory, its result in the job); returns its reconstruction as a dense linear for the perplexity."""
        spec, src, o, work, report, device = self.spec, self.src, self.o, self.work, self.report, self.device
        h = self.h
        N, K = src.shape(head_name)
        acc = gptq.HessianAccumulator(K, device)
        for sl in self.batches:
            acc.add(spec.final_norm(h[sl]))
        prep = gptq.prepare(acc.take(), percdamp=EXL2_PERCDAMP, act_order=o.act_order)
        # the head is often the largest matrix of a model: read in its stored 16-bit dtype (exact) and handed
        # over as a temporary, which quantize_exl2 frees once its float32 work matrix is made; the reconstruction
        # in float16, exact: the float32 one for the perplexity is made once the sweep's work matrix and codes
        # are gone, so no two 32000 x 2048 float32 matrices of a 1B head coexist
        r = quantize_exl2(src.get(head_name, src.stored_dtype(head_name), device), prep,
                          head_qparams(o.head_bits).bits_rows(K), bool(o.refine_scales), hat_dtype=torch.float16)
        packed = r.tensors(None if b is None else b.cpu().numpy())
        save_tensors(work.layer_path("lm_head"), packed)
        report.head_bpw = bpw_of(packed, N)
        work.job.setdefault("layers", {})["lm_head"] = asdict(LayerResult("lm_head", plan_of(r), report.head_bpw,
                                                                          r.error))
        hat = r.weight_hat
        del r, acc, prep, packed
        head = dense_linear(hat.float(), b)
        del hat
        return head

    def finish_report(self, ids, head) -> None:
        """Per-layer and per-block results into the report, in model order, including those of an interrupted
        run's blocks; the quantized calibration perplexity and the warnings."""
        spec, o, work, report, blocks = self.spec, self.o, self.work, self.report, self.blocks
        order = [spec.linear_key(i, n) for i, k in blocks for n in block_linears(spec, k, i)] + ["lm_head"]
        report.layers = [LayerResult(**work.job["layers"][k]) for k in order if k in work.job["layers"]]
        report.blocks = [work.job["blocks"][spec.block_key(i, k)] for i, k in blocks]
        report.warnings.extend(padded_expert_warnings(report.blocks))
        report.calibration_ppl = calibration_ppl(spec, self.src, self.h, ids, head)
        bpw = report.decoder_bpw if report.decoder_bpw is not None else o.bits
        warning = ppl_warning(report.calibration_ppl_fp16, report.calibration_ppl, bpw,
                              quantized_head=o.quantized_head or o.target != "exl2")
        if warning is not None:
            report.warnings.append(warning)


def _gptq_groups(o: QuantOptions, K: int) -> int | None:
    """The GPTQ group size for ``prepare`` (one group of K rows for -1); None for EXL2."""
    if o.target != "gptq":
        return None
    return K if o.group_size == -1 else int(o.group_size)


def calibration_ppl(spec, src, h, ids, head, max_logit_bytes: int = 64 << 20) -> float:
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
