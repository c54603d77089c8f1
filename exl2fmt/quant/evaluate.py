"""Quality of a quantized model against its reference: perplexity, KL divergence, top-1 agreement.

Both models run through the model runner (``runner.model.HFModel``: transformers' own modeling code, one decoder
layer materialized at a time), a few rows at a time, so memory holds one layer's weights and one row batch of
logits per model.  The test model is either another set of weights of the same architecture (a ``WeightSource`` or
a model directory: e.g. a dequantized FP16 copy) or the reference's weights with some linears replaced (a
``Callable[[str], Linear | None]`` keyed by checkpoint layer name, e.g. quantized layers built by the caller).

Definitions, over every predicted position (rows x (length - 1) next-token predictions):

* ``ppl``          exp(mean negative log-likelihood of the next token)
* ``kl_mean``      mean over positions of KL(p_ref || p_test) = sum_v p_ref(v) (log p_ref(v) - log p_test(v)), nats
* ``top1_agree``   fraction of positions where both models' most likely next token is the same
* ``max_logit_diff`` largest |logit_ref - logit_test| over all positions and the vocabulary (all positions)
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ErrorCode, Exl2Error
from ..runner.model import HFModel
from ..runner.weights import Linear, WeightSource

__all__ = ["perplexity_kl", "compare_many", "eval_ids", "dequantized_source"]

TestModel = Union[WeightSource, str, os.PathLike, Callable[[str], "Linear | None"]]


def _runner(ref: HFModel, test: TestModel, device):
    if isinstance(test, (str, os.PathLike)):
        test = WeightSource(test)
    if isinstance(test, WeightSource):
        eng = HFModel(ref.config_dict, test, ref.device, split_fused=ref.split_fused)
        return lambda ids: eng.forward(ids, device=device)
    if callable(test):
        return lambda ids: ref.forward(ids, linears_for_layer=test, device=device)
    raise TypeError(f"test model must be a WeightSource, a path or a callable, got {type(test).__name__}")


def compare_many(ref: HFModel, tests: Mapping[str, TestModel], ids: torch.Tensor, *, batch_rows: int = 4,
                 device: "torch.device | str | None" = None) -> dict[str, dict]:
    """``perplexity_kl`` for several test models against one reference, running the reference once per row batch.

    Returns {name: metrics}; every metrics dict also carries ``ppl_ref`` (the same for all).
    """
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise Exl2Error(ErrorCode.USAGE, f"expected token ids int64 [rows, length >= 2], found {list(ids.shape)}")
    runners = {name: _runner(ref, t, device) for name, t in tests.items()}
    nll_ref = 0.0
    acc = {name: {"nll": 0.0, "kl": 0.0, "agree": 0, "maxdiff": 0.0} for name in tests}
    n = 0
    with torch.no_grad():
        for r0 in range(0, ids.shape[0], batch_rows):
            chunk = ids[r0:r0 + batch_rows]
            target = chunk[:, 1:].to(device or "cpu").reshape(-1)
            z_ref = ref.forward(chunk, device=device)
            lp_ref = F.log_softmax(z_ref[:, :-1].reshape(-1, z_ref.shape[-1]).double(), dim=-1)
            nll_ref += -lp_ref.gather(1, target[:, None]).sum().item()
            p_ref = lp_ref.exp()
            top_ref = lp_ref.argmax(-1)
            n += target.numel()
            for name, run in runners.items():
                test = run(chunk)
                a = acc[name]
                a["maxdiff"] = max(a["maxdiff"], (test - z_ref).abs().max().item())
                lp = F.log_softmax(test[:, :-1].reshape(-1, test.shape[-1]).double(), dim=-1)
                a["nll"] += -lp.gather(1, target[:, None]).sum().item()
                a["kl"] += (p_ref * (lp_ref - lp)).sum().item()
                a["agree"] += int((lp.argmax(-1) == top_ref).sum().item())
                del test, lp
            del z_ref, lp_ref, p_ref
    ppl_ref = math.exp(nll_ref / n)
    return {name: {"ppl_ref": ppl_ref, "ppl_test": math.exp(a["nll"] / n), "kl_mean": max(a["kl"] / n, 0.0),
                   "top1_agree": a["agree"] / n, "max_logit_diff": a["maxdiff"], "tokens": n}
            for name, a in acc.items()}


def perplexity_kl(ref: HFModel, test: TestModel, ids: torch.Tensor, *, batch_rows: int = 4,
                  device: "torch.device | str | None" = None) -> dict:
    """Compare a test model with the reference model ``ref`` on ids int64 [rows, length].

    ``test``: a ``WeightSource`` / model directory with the same architecture (run with ``ref``'s config), or a
    callable ``layer key -> Linear | None`` substituting linears of the reference (``HFModel.forward``'s
    ``linears_for_layer``).  Returns dict(ppl_ref, ppl_test, kl_mean, top1_agree, max_logit_diff, tokens); see
    the module docstring for the definitions.  Sums are accumulated in float64.
    """
    return compare_many(ref, {"test": test}, ids, batch_rows=batch_rows, device=device)["test"]


def eval_ids(tokenizer_json: "str | os.PathLike", rows: int | None, length: int) -> torch.Tensor:
    """Held-out evaluation ids int64 [rows, length] from the shipped corpus's ``eval`` part.

    The part's documents, in stored order, each followed by a blank line, are tokenized with the model's
    tokenizer.json (no special tokens) into one stream, cut row-major into ``rows`` windows of ``length`` tokens
    (``rows=None``: as many whole windows as the text gives).  Deterministic; never overlaps the training or
    calibration parts.
    """
    from .calib import corpus_documents, load_tokenizer, tokenize_stream

    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise Exl2Error(ErrorCode.USAGE, f"length must be an integer >= 2, found {length!r}")
    tok = load_tokenizer(tokenizer_json)
    need = None if rows is None else rows * length
    stream = tokenize_stream(tok, (d + "\n\n" for d in corpus_documents("eval")), need)
    if rows is None:
        rows = len(stream) // length
    if rows <= 0 or len(stream) < rows * length:
        raise Exl2Error(ErrorCode.CALIBRATION_INVALID,
                        f"the held-out text gives {len(stream)} tokens, {max(rows, 1) * length} are needed for "
                        f"{max(rows, 1)} rows x {length} tokens")
    return torch.from_numpy(np.asarray(stream[:rows * length], dtype=np.int64).reshape(rows, length))


def dequantized_source(model_dir: "str | os.PathLike") -> WeightSource:
    """An in-memory ``WeightSource`` of a quantized (EXL2 / GPTQ) or dense model directory: every linear layer
    dequantized by the reference decoders (``load_layer(...).dequantize()``, float16 [out, in] with padding
    dropped, held as float32), every other tensor as stored.  Memory: the whole model in float32."""
    from ..container import open_model
    from ..model import find_layers, load_layer

    m = open_model(model_dir)
    try:
        names = m.names()
        layers = find_layers(names)
        out: dict[str, torch.Tensor] = {}
        used = set()
        for key in layers:
            lay = load_layer(m, key)
            out[f"{key}.weight"] = torch.from_numpy(np.asarray(lay.dequantize(), dtype=np.float32))
            bias = lay.tensors.get("bias")
            if bias is not None:
                b = np.asarray(bias, dtype=np.float32)[: out[f"{key}.weight"].shape[0]]
                out[f"{key}.bias"] = torch.from_numpy(b.copy())
            used |= {f"{key}.{s}" for s in lay.tensors}
        src = WeightSource(m)
        for n in names:
            if n not in used and n not in out:
                info = m.info(n)
                if info.dtype in ("F16", "BF16", "F32"):
                    out[n] = src.get(n, torch.float32)
    finally:
        m.close()
    return WeightSource(out)
