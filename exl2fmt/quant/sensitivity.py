"""How much each block's error grows on its way to the model's output (``block_gains``): the weights the EXL2
solver puts on the measured block errors.

The measurement scores a block by the relative error of its own output on the FP16 input (``rel_err_tokens``),
and the solver adds those errors up as if an error of 0.02 cost the same wherever it is made.  On trained models it
does not: on Gemma 3 270M at 3.0 bpw, one block quantized at a time, the logits' KL per squared block error was
70-300 in layers 1-4 and 3-16 in layers 11-17 (bench/RESULTS.md, issue 40): the early layers' errors are
amplified by every layer after them, the late layers' are not, so a flat sum starved the early attention blocks
(2.5 bpw) and fed the late global-attention ones (4.5-5.5 bpw).

The gain of a block is measured, not modelled: every block's linears are replaced by a plain round-to-nearest copy
(``GAIN_BITS`` symmetric, groups of ``GAIN_GROUP`` input features: a quantization error of the usual structure,
no GPTQ needed), one block at a time, on a few calibration rows; the perturbed hidden state is carried through
every later FP16 layer (one decoder layer materialized at a time, all trajectories batched through it), and

    gain(block) = relative error of the final norm's output / relative error of the block's own output

(both the mean over tokens of ||y_t - y_ref_t|| / ||y_ref_t||; the final norm's output is what the head reads).
The gains are divided by their geometric mean, so only their ratios move the plan.

Opt-in (``QuantOptions.block_gain``, ``convert --block-gains``): at 3.0 bpw the gains lowered Gemma 3 270M's KL
from 0.796 / 1.137 to 0.681 / 0.884 (docs / legal) but raised SmolLM2-135M's from 0.427 / 0.983 to 0.445 / 1.039.
The round-to-nearest perturbation is the weak part: its gains follow the true per-block damage with a log
correlation of 0.78 on Gemma, the GPTQ-quantized blocks' own errors with 0.90 (layer 4's attention, the most
damaging block, gets 0.97 here and 6.2 from its GPTQ error); measuring the gains with the measurement's own
candidates is the next step (bench/RESULTS.md, issue 40).
"""

from __future__ import annotations

import math

import torch

from ..runner.weights import dense_linear
from .common import model_blocks, rel_err_tokens, row_batches

__all__ = ["block_gains", "perturbed_weight", "GAIN_ROWS", "GAIN_TOKENS", "GAIN_BITS", "GAIN_GROUP"]

#: calibration rows (evenly spaced, the first included) and tokens per row that the gains are measured on
GAIN_ROWS = 2
GAIN_TOKENS = 512
#: the perturbation: symmetric round-to-nearest at this width, one scale per GAIN_GROUP input features of a row
GAIN_BITS = 4
GAIN_GROUP = 128


def perturbed_weight(w: torch.Tensor, bits: int = GAIN_BITS, group: int = GAIN_GROUP) -> torch.Tensor:
    """w float32 [N, K] rounded to the nearest of ``2^bits`` symmetric levels, one scale (absolute maximum /
    (2^(bits-1) - 1)) per ``group`` consecutive input features of a row (the last group of a row may be shorter).
    Returns float32 [N, K]."""
    N, K = w.shape
    pad = (-K) % group
    x = torch.nn.functional.pad(w.float(), (0, pad)).view(N, -1, group)
    top = 2 ** (bits - 1) - 1
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / top
    q = (x / s).round().clamp(-top - 1, top) * s
    return q.view(N, -1)[:, :K].contiguous()


def _gain_rows(rows: int) -> list[int]:
    n = min(GAIN_ROWS, rows)
    return sorted({round(k * (rows - 1) / max(1, n - 1)) for k in range(n)}) if n > 1 else [0]


def block_gains(spec, ids: torch.Tensor, device: torch.device, batch_tokens: int, progress=None) -> dict[str, float]:
    """{block key: gain} for every attention and MLP block of ``spec`` (a ``runner.model.HFModel``), measured on
    calibration ids int64 [rows, T] (``GAIN_ROWS`` of its rows, the first ``GAIN_TOKENS`` tokens of each); the
    gains' geometric mean is 1.  Cost: about num_layers / 2 forwards of the FP16 model on those tokens, one layer's
    weights at a time; memory: one hidden state float32 [GAIN_ROWS, GAIN_TOKENS, hidden] per block."""
    sel = ids[_gain_rows(ids.shape[0]), :GAIN_TOKENS]
    h = spec.embed(sel, device)
    R, T = h.shape[:2]
    per = max(1, batch_tokens // max(1, T))         # rows per forward of the batched trajectories
    trajs: list[torch.Tensor] = []                  # per block so far: its perturbed hidden state, [R, T, hidden]
    own: list[float] = []                           # per block: its own output's relative error
    blocks = model_blocks(spec)
    for i in range(spec.num_layers):
        r = spec.runner(i, device)
        if trajs:                                   # the earlier blocks' perturbations through this FP16 layer
            allt = torch.cat(trajs)
            out = torch.empty_like(allt)
            for sl in row_batches(allt.shape[0], T, per * T):
                out[sl] = r.forward(allt[sl])
            trajs = list(out.split(R))
            del allt, out
        W = r.weights()
        y_ref = r.forward(h)
        for kind in ("attn", "mlp"):
            subs = {n: dense_linear(perturbed_weight(W[n][0]), W[n][1]) for n in spec.linear_names(kind, i)}
            y = r.forward(h, subs)
            if kind == "attn":
                own.append(rel_err_tokens(r.forward(h, subs, stop_mid=True), r.forward(h, stop_mid=True)))
            else:
                own.append(rel_err_tokens(y, y_ref))
            trajs.append(y)
        h = y_ref
        del W
        if progress:
            progress("gains", i + 1, spec.num_layers, f"layer {i}")
    spec.release()
    ref = spec.final_norm(h)
    gains = []
    for t, e in zip(trajs, own):
        f = rel_err_tokens(spec.final_norm(t), ref)
        gains.append(max(f, 1e-12) / max(e, 1e-12))
    mean = math.exp(sum(math.log(g) for g in gains) / len(gains))
    return {spec.block_key(i, kind): g / mean for (i, kind), g in zip(blocks, gains)}
