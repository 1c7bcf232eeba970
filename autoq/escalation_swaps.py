"""Swap refinement of the int16 escalation's tensor choice (``AutoFallback(swap_rounds=n)``).

The greedy search of :mod:`autoq.escalation` ranks each shortlisted tensor by what it costs
back in int8 while the *other shortlisted tensors are int16*, and adds tensors in that order.
Once most tensors are int8 again those costs change (errors of neighbouring tensors add up
or hide each other), and tensors outside the shortlist were never measured. This module
improves the chosen set with the interchange (vertex substitution) heuristic of Teitz and
Bart (1968, "Heuristic Methods for Estimating the Generalized Vertex Median of a Weighted
Graph", Operations Research 16(5)) for budgeted subset selection; each round:

1. the gain of adding each candidate that is not chosen, and the cost of dropping each
   chosen tensor, both measured with the current set (one trial each, on the trial samples);
2. the pairs (one in, one out) whose gain exceeds the cost, best predicted first, are tried
   with one more trial each; the first that raises the metric on the trial samples *and*
   the output SQNR on the held-out samples (``AutoFallback.holdout``; without them the trial
   samples only) replaces the set;
3. no such pair (or ``swap_rounds`` rounds done): stop.

The set size never grows, so the budget holds. Cost per round: one trial per candidate, plus
one per tried pair (at most ``PAIRS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["PAIRS", "refine_by_swaps"]

#: most (in, out) pairs tried per round (best predicted first)
PAIRS = 9


def refine_by_swaps(
    candidates: Sequence[str],
    chosen: Sequence[str],
    score: Callable[[list], float],
    held_score: Callable[[list], float] | None,
    rounds: int,
) -> tuple[list[str], list[dict]]:
    """(refined set, one record per accepted swap) from ``chosen`` (module docstring).
    ``score(selected)``: the trial metric, higher is better; ``held_score(selected)``: the
    held-out output SQNR (None: no held-out check)."""
    cur = list(chosen)
    value = score(cur)
    held = held_score(cur) if held_score is not None else -math.inf
    history: list[dict] = []
    for _ in range(rounds):
        if not cur:
            break
        gain = {c: score([*cur, c]) - value for c in candidates if c not in cur}
        cost = {c: value - score([x for x in cur if x != c]) for c in cur}
        pairs = sorted(
            ((gain[i] - cost[o], i, o) for i in gain for o in cost if gain[i] > cost[o]),
            reverse=True,
        )[:PAIRS]
        step = _first_better(pairs, cur, value, held, score, held_score)
        if step is None:
            break
        cur, value, held, record = step
        history.append(record)
    return cur, history


def _first_better(pairs, cur, value, held, score, held_score):
    """The first pair whose swap raises the trial metric and the held-out SQNR, as
    ``(set, value, held, record)``, or None."""
    for predicted, i, o in pairs:
        cand = [x for x in cur if x != o] + [i]
        v = score(cand)
        if v <= value:
            continue
        h = held_score(cand) if held_score is not None else -math.inf
        if held_score is not None and h <= held:
            continue
        record = {"in": i, "out": o, "predicted": predicted, "metric": v, "held": h}
        return cand, v, h, record
    return None
