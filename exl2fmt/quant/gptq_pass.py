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

from . import gptq, job         # (gptq's and job's functions by module: tests wrap them)
from .common import block_linears, model_blocks, rel_err_tokens, release_memory, row_batches
from .gptq import EXL2_PERCDAMP, GPTQ_PERCDAMP, proxy_error_of_rows, proxy_rows, quantize_exl2, quantize_gptq
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
                  h_ref_final: torch.Tensor | None = None) -> None:
    """The GPTQ pass, block by block on the quantized model's own hidden states, then the head and the two
    calibration perplexities.  ``h_ref_final``: the FP16 model's last hidden state when the measurement of
    this run computed it (``measure.measure``); otherwise the FP16 trajectory is advanced here, one block forward
    more per block."""
    _QuantizePass(spec, src, strategy, options_of, work, o, progress, report).run(ids, ids_h, h_ref_final)


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

    def quantize_layer(self, i: int, kind: str, n: str, w, b, prep):
        """Linear ``n`` of layer ``i``'s ``kind`` block, weight ``w`` float32 [N, K] and bias ``b``, quantized with
        the prepared Hessian ``prep`` at the strategy's setting (EXL2) or the GPTQ options; its packed tensors go
        to the work directory unless an earlier run of this job wrote them.  Returns (result, packed tensors)."""
        spec, o, work = self.spec, self.o, self.work
        key = spec.linear_key(i, n)
        error = prep.H is not None           # (else the caller computes it once the Hessian is read back)
        if o.target == "exl2":
            ov = self.strategy["overrides"].get(key)
            qp = QParams.from_json(ov, key) if ov is not None else \
                self.options_of(kind)[self.strategy["options"][spec.block_key(i, kind)]].get(n)
            r = quantize_exl2(w, prep, qp.bits_rows(w.shape[1]), bool(o.refine_scales), error=error)
        else:
            r = quantize_gptq(w, prep, o.bits, o.group_size, sym=o.sym, error=error)
        bias = None if b is None else b.cpu().numpy()
        tensors = r.tensors(bias)
        path = work.layer_path(key)
        if not path.exists() or key not in work.job["quantized"]:
            save_tensors(path, tensors)
        return r, tensors

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
            work.job["blocks"][key].update(expert_tokens=blk.expert_tokens, expert_hessian_padded={
                spec.linear_key(i, n): pad for n, pad in blk.padded.items() if pad})
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
        gs = _gptq_groups(o, W[owner][0].shape[1])
        # on the CPU the Hessian waits in the work directory while it is factored and its linears swept (K x K
        # float32, a third of the factorization's peak); the proxy errors are
        # computed once it is read back, from the rows they read of each weight and reconstruction
        spill = work.root / "hessian.safetensors" if (job.SPILL_HESSIANS and self.device.type == "cpu"
                                                      and K * K * 4 >= job.SPILL_MIN_BYTES) else None
        prep = gptq.prepare(job.spilled(acc.take(), spill), percdamp=self.damp, act_order=o.act_order,  # one a group
                            within_groups=gs if o.order == "group" else None,
                            fixed_groups=gs if o.order == "static" else None, keep_hessian=spill is None)
        del acc
        done: list[tuple] = []           # (key, plan, bpw, error or the rows it is computed from)
        for n in group:
            w, b = W[n]
            r, packed = self.quantize_layer(i, kind, n, w, b, prep)
            lin[n] = dense_linear(r.weight_hat, b)
            N = w.shape[0]
            probe = r.error if spill is None else (w[proxy_rows(N)].clone(), r.weight_hat[proxy_rows(N)].clone())
            # no FP16 forward of this layer follows (the trajectory was handed over; not MoE, whose dense
            # sweep below counts the routed tokens): the float32 original is not needed again (freed before
            # down_proj is factored)
            w = None
            if self.final and not spec.is_moe(i) and blk.drop_linear(n):
                W[n] = (None, b)
            done.append((spec.linear_key(i, n), plan_of(r), bpw_of(packed, N), probe))
            if progress:
                progress("quantize", bi * 10 + 1 + block_linears(spec, kind, i).index(n), len(self.blocks) * 10,
                         done[-1][0])
        if spill is not None:            # the factor and sweep are done with: the Hessian back for the errors
            prep = r = packed = None
            H = job.unspilled(spill, K)
        for lk, plan, bpw, probe in done:
            err = probe if spill is None else proxy_error_of_rows(*probe, H)
            work.job.setdefault("layers", {})[lk] = asdict(LayerResult(lk, plan, bpw, err))
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
