"""Backward elimination for the int16 escalation (``AutoFallback(search="eliminate")``).

The greedy search of :mod:`autoq.fallback.escalation` measures each shortlisted tensor's cost once,
with *every* shortlisted tensor int16, and adds tensors in that order; its held-out rule then
keeps the prefix with the best held-out SQNR. On all-MiniLM-L6-v2 (82 activation tensors,
budget 16) that stops after 4 tensors: costs measured with 48 tensors int16 are not the costs
within a 16-tensor set, and one noisy held-out dip ends the prefix. This search instead:

1. starts from **every** escalable tensor int16 (no shortlist) and, in rounds, measures each
   remaining tensor's *revert cost* (the trial metric with the others int16 minus the metric
   with it back in int8, on the trial samples) and drops the cheapest ones: half the excess
   over the budget per round (:data:`DROP_FRACTION`), so costs are re-measured as the set
   shrinks to the budget (backward elimination);
2. at the budget, goes on dropping the cheapest tensor, one per round, while its revert cost
   is <= 0 or the metric still meets the budget without it (no tensor that does not help);
3. **held-out check** (``AutoFallback.holdout``): the same one-at-a-time pruning on the
   held-out samples' output SQNR: while some kept tensor's revert lowers nothing there (held
   cost <= 0), the worst one goes back to int8; then the set is kept only if it beats all
   int8 on the held-out samples. So every tensor kept improves the metric on the trial
   samples *and* the output SQNR on the held-out samples, each measured with the rest of the
   chosen set int16 (issue 16 item 5's rule, in the context the tensor is used in).

Trials: about ``n + n/2 + ... `` on the trial samples (n escalable tensors; MiniLM: ~250 for
82 -> 16) plus ``|set|`` held-out runs per held-out pruning round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["DROP_FRACTION", "eliminate", "memo", "prune_on_held"]

#: each elimination round above the budget drops this fraction of the excess (at least one)
DROP_FRACTION = 0.5


def memo(score: Callable[[list], float]) -> Callable[[list], float]:
    """``score`` measured once per distinct set (the order of its members aside)."""
    seen: dict = {}

    def cached(sel):
        key = frozenset(sel)
        if key not in seen:
            seen[key] = score(list(sel))
        return seen[key]

    return cached


def _costs(cur: list, score: Callable[[list], float]) -> tuple[float, dict]:
    """(metric of ``cur``, revert cost of each member: metric lost with it int8)."""
    value = score(cur)
    return value, {c: value - score([x for x in cur if x != c]) for c in cur}


def eliminate(
    candidates: Sequence[str],
    limit: int,
    score: Callable[[list], float],
    within: Callable[[float], bool] | None = None,
) -> tuple[list[str], float, dict[str, float], list[dict]]:
    """Backward elimination (module docstring, steps 1-2) from ``candidates`` down to at most
    ``limit``. ``score(selected)``: trial metric, higher is better; ``within(metric)``: the
    budget is met. Returns (kept set, its metric, revert cost of each kept tensor within
    it, one record per round)."""
    cur, rounds, score = list(candidates), [], memo(score)
    if limit <= 0 or not cur:
        return [], score([]), {}, rounds
    while cur:
        value, cost = _costs(cur, score)
        order = sorted(cur, key=lambda c: cost[c])  # cheapest first; ties: candidate order
        excess = len(cur) - limit
        if excess > 0:
            drop = order[: max(1, math.ceil(DROP_FRACTION * excess))]
        else:
            c = order[0]
            met = within is not None and within(value - cost[c])
            drop = [c] if cost[c] <= 0 or met else []
        rounds.append({"size": len(cur), "metric": value, "dropped": drop})
        if not drop:
            return cur, value, cost, rounds
        cur = [c for c in cur if c not in drop]
    return [], score([]), {}, rounds


def prune_on_held(
    chosen: Sequence[str], held_score: Callable[[list], float] | None
) -> tuple[list[str], list[dict]]:
    """The held-out check (module docstring, step 3): ``chosen`` minus the tensors whose
    revert does not lower ``held_score`` (the held-out output SQNR), worst first, one per
    round; empty if what is left does not beat all int8 there. Without held-out samples
    (``held_score`` None) ``chosen`` as it is. Returns (kept, one record per round)."""
    cur, rounds = list(chosen), []
    if held_score is None or not cur:
        return cur, rounds
    held_score = memo(held_score)
    while cur:
        value, cost = _costs(cur, held_score)
        worst = min(cur, key=lambda c: cost[c])
        rounds.append({"size": len(cur), "held": value, "worst": worst, "cost": cost[worst]})
        if cost[worst] > 0:
            break
        cur.remove(worst)
    if cur and not held_score(cur) > held_score([]):
        rounds.append({"size": len(cur), "held": held_score(cur), "empty": held_score([])})
        return [], rounds
    return cur, rounds
