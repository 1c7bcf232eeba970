"""Swap refinement of the int16 escalation (autoq.escalation_swaps, AutoFallback.swap_rounds):
on a synthetic additive-with-interaction score it finds the best set of its size that the
greedy order missed, never grows the set, respects the held-out check; on the tiny
transformer the refined set scores at least the greedy one and the option round-trips."""

from __future__ import annotations

import pytest
from test_escalation import calibrated, data  # noqa: F401  (the fixture)

from autoq import AutoFallback, Config
from autoq.calibrate import samples_for
from autoq.escalation import escalate_search
from autoq.escalation_swaps import refine_by_swaps

VALUE = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 1.0}


def score(sel):
    """Additive, except that a and b are redundant together (their gains overlap)."""
    v = sum(VALUE[x] for x in sel)
    return v - 3.5 if {"a", "b"} <= set(sel) else v


def test_swaps_replace_a_redundant_tensor():
    got, history = refine_by_swaps(list(VALUE), ["a", "b"], score, None, rounds=3)
    # {a, b} = 5.5; the best pair is {a, c} = 8: b swapped for c, then nothing better
    assert sorted(got) == ["a", "c"] and len(history) == 1
    assert history[0]["in"] == "c" and history[0]["out"] == "b" and history[0]["metric"] == 8.0
    assert all(score(got) >= score([*got[:1], x]) for x in VALUE if x not in got)


def test_held_out_check_and_rounds_limit():
    # a held-out score that disagrees: no swap is kept
    got, history = refine_by_swaps(list(VALUE), ["a", "b"], score, lambda s: -score(s), 3)
    assert got == ["a", "b"] and history == []
    got, history = refine_by_swaps(list(VALUE), ["a", "b"], score, None, rounds=0)
    assert got == ["a", "b"] and history == []
    got, _ = refine_by_swaps(list(VALUE), [], score, None, rounds=2)
    assert got == []


def test_search_with_swaps_on_the_tiny_transformer(calibrated):  # noqa: F811
    _mod, _params, sim, _qp, eg = calibrated
    held = samples_for(data(3, 5), sim.graph.inputs)
    base = dict(precision="int16_tensors", min_sqnr=99.0, max_int16_fraction=0.2)
    greedy = escalate_search(eg, AutoFallback(**base), eg.run_fp32, held)
    swapped = escalate_search(eg, AutoFallback(**base, swap_rounds=2), eg.run_fp32, held)
    assert len(swapped["tensors"]) == len(greedy["tensors"])
    assert swapped["metric"] >= greedy["metric"]
    assert len(swapped["swaps"]) <= 2
    for s in swapped["swaps"]:
        assert s["out"] in greedy["tensors"] or any(x["in"] == s["out"] for x in swapped["swaps"])
    assert any(t["kind"] == "swap" for t in swapped["trials"])


def test_option_round_trips_and_is_validated():
    fb = AutoFallback(precision="int16_tensors", swap_rounds=2)
    cfg = Config(fallback=fb)
    assert Config.loads(cfg.dumps()) == cfg
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="swap_rounds"):
            AutoFallback(precision="int16_tensors", swap_rounds=bad)
