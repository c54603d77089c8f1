"""The optimisation: one option per block so that the decoder linears' stored bits (overhead included) stay
within ``bits x sum(K x N_pad)`` (``solver.solve`` on the measured errors, ``optimize``), then the budget the
discrete options leave spent on single layers, a group of rows at a time (``spend_slack``)."""

from __future__ import annotations

from ..layout import pad32
from .common import block_linears, model_blocks, option_layers
from .options import QuantOptions
from .qparams import promote
from .solver import solve

__all__ = ["optimize", "spend_slack"]


def optimize(spec, src, measured, options_of, o: QuantOptions, report, gains: dict | None = None) -> dict:
    """The strategy for ``measured`` ({block key: [[option index, bits, accuracy]]}): {"options": {block key:
    option index}, "overrides": {linear key: QParams dict}}; sets ``report.decoder_bpw`` to the planned bits over
    the decoder linears' K x N_pad.  ``gains`` ({block key: factor}, ``sensitivity.block_gains``) multiplies each
    block's measured error (1 - accuracy) before the solver sums them; None: every factor 1."""
    keys, slots = [], []
    numel = 0
    for i, kind in model_blocks(spec):
        key = spec.block_key(i, kind)
        opts = options_of(kind)
        rows = measured[key]
        costs = []
        for j, _, acc in rows:
            opt = opts[j]
            c = 0
            for n, qp in option_layers(opt, block_linears(spec, kind, i)):
                N, K = spec.linear_shape(n)
                c += qp.total_bits(K, N, spec.has_bias(n))
            costs.append((c, (1.0 - acc) * (gains.get(key, 1.0) if gains else 1.0)))
        keys.append(key)
        slots.append(costs)
        for n in block_linears(spec, kind, i):
            N, K = spec.linear_shape(n)
            numel += K * pad32(N) + (pad32(N) if spec.has_bias(n) else 0)
    budget = int(numel * o.bits)
    picks = solve(slots, budget, norm=o.norm)
    used = sum(slots[s][j][0] for s, j in enumerate(picks))
    strategy = {k: int(measured[k][j][0]) for k, j in zip(keys, picks)}
    items = []                                   # every linear, the blocks with the largest error first
    for s in sorted(range(len(keys)), key=lambda s: (-slots[s][picks[s]][1], s)):
        i, kind = model_blocks(spec)[s]
        opt = options_of(kind)[strategy[keys[s]]]
        for n in block_linears(spec, kind, i):
            N, K = spec.linear_shape(n)
            items.append((spec.linear_key(i, n), K, N, spec.has_bias(n), opt.get(n)))
    overrides, used = spend_slack(items, budget, used)
    report.decoder_bpw = used / numel
    return {"options": strategy, "overrides": {k: v.to_json() for k, v in overrides.items()}}


def spend_slack(items, budget: int, used: int) -> tuple[dict, int]:
    """Spend what the discrete options leave of the budget: promote rows of single layers to the next bit width,
    one group at a time, round-robin over ``items`` [(key, K, N, has_bias, QParams)] in priority order.
    Returns ({key: promoted QParams}, bits used)."""
    cur = {key: qp for key, _, _, _, qp in items}
    overrides = {}
    grew = True
    while grew:
        grew = False
        for key, K, N, has_bias, _ in items:
            new = promote(cur[key], K)
            if new is None:
                continue
            dc = new.total_bits(K, N, has_bias) - cur[key].total_bits(K, N, has_bias)
            if 0 < dc <= budget - used:
                cur[key] = overrides[key] = new
                used += dc
                grew = True
    return overrides, used
