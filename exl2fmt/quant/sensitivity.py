"""How much each block's error grows on its way to the model's output (``block_gains``): the weights the EXL2
solver puts on the measured block errors.

The measurement scores a block by the relative error of its own output on the FP16 input (``rel_err_tokens``),
and the solver adds those errors up as if an error of 0.02 cost the same wherever it is made.  On trained models it
does not: on Gemma 3 270M at 3.0 bpw, one block quantized at a time, the logits' KL per squared block error was
70-300 in layers 1-4 and 3-16 in layers 11-17 (bench/RESULTS.md, issue 40): the early layers' errors are
amplified by every layer after them, the late layers' are not, so a flat sum starved the early attention blocks
(2.5 bpw) and fed the late global-attention ones (4.5-5.5 bpw).

The gain of a block is measured, not modelled: the block's linears are replaced by a quantized copy, one block at
a time, on a few calibration rows; the perturbed hidden state is carried through every later FP16 layer (one
decoder layer materialized at a time, all trajectories batched through it), and

    gain(block) = relative error of the final norm's output / relative error of the block's own output

(both the mean over tokens of ||y_t - y_ref_t|| / ||y_ref_t||; the final norm's output is what the head reads).
The gains are divided by their geometric mean, so only their ratios move the plan.

The quantized copy is the block's own GPTQ candidate from the measurement, at the option nearest ``GAIN_BPW``
(``gain_option``; the measurement keeps it in the work directory, ``gain_candidates_path``): a perturbation with
the structure the plan will really have.  A measurement read from a file without gains has no candidates at hand;
then each linear is rounded to the nearest of a plain symmetric grid (``perturbed_weight``), which the report
says.  The round-to-nearest gains were the first version and were worse: their log correlation with the real
per-block damage was 0.78 on Gemma (layer 4's attention, the most damaging block, got 0.97; from its GPTQ
candidate 2.7), and on SmolLM2 they gave layer 11's MLP, which writes the massive activation, a spurious 2.9 (0.79
from its candidate).

Opt-in (``QuantOptions.block_gain``, ``convert --block-gains``).  Measured at 3.0 bpw (bench/RESULTS.md, issue 40),
docs / legal KL: Gemma 3 270M flat 0.798 / 1.136, round-to-nearest gains 0.681 / 0.884, candidate gains
0.645 / 0.827; SmolLM2-135M flat 0.427 / 0.983, round-to-nearest gains 0.445 / 1.039 (the candidate gains' row is
in RESULTS).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import ErrorCode, Exl2Error
from ..runner.weights import dense_linear
from .candidates import weight_from_candidate_tensors
from .common import model_blocks, rel_err_tokens, row_batches
from .job import load_tensors, save_tensors

__all__ = ["block_gains", "perturbed_weight", "gain_option", "gain_candidates_path", "save_gain_candidates",
           "candidate_perturbation", "GAIN_ROWS", "GAIN_TOKENS", "GAIN_BPW", "GAIN_BITS", "GAIN_GROUP"]

#: calibration rows (evenly spaced, the first included) and tokens per row that the gains are measured on
GAIN_ROWS = 2
GAIN_TOKENS = 512
#: the measurement's candidate that perturbs a block: the option nearest this many bits per weight
GAIN_BPW = 3.0
#: the fallback perturbation (a reused measurement without gains, whose candidates are gone): symmetric round-to-nearest at this width, one scale per GAIN_GROUP input features of a row
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


def gain_option(rows: list, weights: int) -> int:
    """The option whose candidate perturbs a block for its gain: of a block's measured rows [[option, bits,
    accuracy]], the one whose bits per weight (``weights``: the block's linears' weight count) is nearest
    ``GAIN_BPW`` (the first of equals)."""
    return min(rows, key=lambda r: abs(r[1] / weights - GAIN_BPW))[0]


def gain_candidates_path(root: Path, key: str) -> Path:
    """Where a measurement with ``block_gain`` keeps block ``key``'s candidate at ``gain_option``, in the job's
    work directory ``root``: ``candidates.candidate_tensors`` of each of its linears, one file per block."""
    return Path(root) / "gain-candidates" / f"{key}.safetensors"


def save_gain_candidates(root: Path, key: str, tensors: dict) -> None:
    p = gain_candidates_path(root, key)
    p.parent.mkdir(exist_ok=True)
    save_tensors(p, tensors)


def candidate_perturbation(spec, root: Path):
    """``block_gains``' ``perturb`` from the candidates the measurement kept in ``root`` (one block's file read at
    a time), or None when some block's file is missing (the measurement was read from a file, not run)."""
    paths = {spec.block_key(i, kind): gain_candidates_path(root, spec.block_key(i, kind))
             for i, kind in model_blocks(spec)}
    if not all(p.is_file() for p in paths.values()):
        return None
    held: dict = {}

    def perturb(i, name, w):
        key = next(spec.block_key(i, k) for k in ("attn", "mlp") if name in spec.linear_names(k, i))
        if held.get("key") != key:
            held.clear()
            held.update(key=key, tensors=load_tensors(paths[key]))
        w_hat = weight_from_candidate_tensors(held["tensors"], name, w.shape[0])
        if w_hat.shape != w.shape:              # (the work directory is this job's, but a file may be damaged)
            raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"the block gain's candidate of {name} is "
                            f"{list(w_hat.shape)}, the layer {list(w.shape)}", file=str(paths[key]),
                            tensor=spec.linear_key(i, name))
        return w_hat
    return perturb


def _gain_rows(rows: int) -> list[int]:
    n = min(GAIN_ROWS, rows)
    return sorted({round(k * (rows - 1) / max(1, n - 1)) for k in range(n)}) if n > 1 else [0]


def block_gains(spec, ids: torch.Tensor, device: torch.device, batch_tokens: int, progress=None,
                perturb=None) -> dict[str, float]:
    """{block key: gain} for every attention and MLP block of ``spec`` (a ``runner.model.HFModel``), measured on
    calibration ids int64 [rows, T] (``GAIN_ROWS`` of its rows, the first ``GAIN_TOKENS`` tokens of each); the
    gains' geometric mean is 1.  Cost: about num_layers / 2 forwards of the FP16 model on those tokens, one layer's
    weights at a time; memory: one hidden state float32 [GAIN_ROWS, GAIN_TOKENS, hidden] per block.

    ``perturb(i, name, w)``: the perturbed copy (float32 [N, K]) of layer ``i``'s linear ``name`` with the FP16
    weight w float32 [N, K]; default ``perturbed_weight(w)``, round-to-nearest."""
    if perturb is None:
        perturb = lambda i, name, w: perturbed_weight(w)  # noqa: E731
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
            subs = {n: dense_linear(perturb(i, n, W[n][0]).float(), W[n][1]) for n in spec.linear_names(kind, i)}
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
