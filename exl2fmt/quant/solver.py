"""Choose one candidate option per block under an exact bit budget.

Input: per block ("slot") a list of options, each (cost in bits: int, error: float >= 0).  Output: one option
index per slot with total cost <= budget, minimising ``sum_slots error**norm``.

ExLlamaV2 solves this with unseeded simulated annealing (non-reproducible).  This is a deterministic exact
solver of the discretised problem: a dynamic programme over the budget in ``resolution`` units in which
every cost is rounded *up* to whole units (so any solution it finds fits the true budget), followed by a
greedy pass that spends the slack left by the rounding on the upgrades with the best error reduction per bit,
using exact costs.  Ties break towards the lower option index, so the same inputs always give the same plan.
"""

from __future__ import annotations

import numpy as np

from ..errors import ErrorCode, Exl2Error

__all__ = ["solve", "DEFAULT_NORM"]

#: Objective exponent: block errors (relative output errors) are combined as a sum of squares, the way
#: independent errors add up in the residual stream.
DEFAULT_NORM = 2.0


def solve(slots: list[list[tuple[int, float]]], budget: int, *, norm: float = DEFAULT_NORM,
          resolution: int = 20000) -> list[int]:
    """Return the chosen option index per slot.  Raises BUDGET_INFEASIBLE if even the cheapest option of
    every slot exceeds ``budget``."""
    if not slots:
        return []
    cheapest = sum(min(c for c, _ in opts) for opts in slots)
    if cheapest > budget:
        raise Exl2Error(ErrorCode.BUDGET_INFEASIBLE, f"the cheapest settings need {cheapest} bits, more than the "
                        f"budget of {budget} bits: raise --bits")
    unit = max(1, -(-budget // resolution))
    B = budget // unit
    INF = np.inf
    best = np.full(B + 1, INF)
    best[0] = 0.0  # best[b] = minimal objective with rounded cost exactly b
    choice = []
    for opts in slots:
        new = np.full(B + 1, INF)
        arg = np.full(B + 1, -1, dtype=np.int32)
        for j, (c, e) in enumerate(opts):
            cu = -(-int(c) // unit)
            if cu > B:
                continue
            cand = np.full(B + 1, INF)
            cand[cu:] = best[:B + 1 - cu] + float(e) ** norm
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        best = new
        choice.append(arg)
    if not np.isfinite(best).any():
        # The rounding up made it infeasible although the exact costs fit: fall back to the cheapest options.
        picks = [int(np.argmin([c for c, _ in opts])) for opts in slots]
    else:
        b = int(np.argmin(best))  # first (cheapest) of the minimal-objective budgets
        picks = [0] * len(slots)
        for s in range(len(slots) - 1, -1, -1):
            j = int(choice[s][b])
            picks[s] = j
            b -= -(-int(slots[s][j][0]) // unit)
    return _spend_slack(slots, picks, budget, norm)


def _spend_slack(slots, picks, budget, norm) -> list[int]:
    """Greedy upgrades with exact costs: repeatedly apply the single-slot change that lowers the objective most
    per extra bit while the total stays within the budget."""
    picks = list(picks)
    total = sum(slots[s][j][0] for s, j in enumerate(picks))
    while True:
        best_gain, best_move = 0.0, None
        for s, opts in enumerate(slots):
            c0, e0 = opts[picks[s]]
            for j, (c, e) in enumerate(opts):
                dc = c - c0
                de = e0 ** norm - e ** norm
                if de <= 0 or total + dc > budget:
                    continue
                gain = de / dc if dc > 0 else np.inf
                if gain > best_gain:
                    best_gain, best_move = gain, (s, j, dc)
        if best_move is None:
            return picks
        s, j, dc = best_move
        picks[s] = j
        total += dc
