"""Backward elimination for the int16 escalation (autoq.fallback.escalation_elimination,
AutoFallback(search="eliminate")): on a synthetic score with redundant tensors it finds the
brute-force best set of the budget's size where the one-shot revert ranking does not; tensors
that do not help are dropped (trial and held-out); on the tiny transformer every kept tensor's
revert lowers both the trial and the held-out output SQNR (checked with direct runs)."""

from __future__ import annotations

from itertools import combinations

import pytest
from test_escalation import calibrated, data  # noqa: F401  (the fixture)

import autoq
from autoq import AutoFallback, Config
from autoq.calibration import samples_for
from autoq.fallback.escalation import escalate_search, trial_set
from autoq.fallback.escalation_elimination import eliminate, prune_on_held
from autoq.fallback.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.simulation import simulate
from models import TARGET, small_cnn

ALONE = {"a": 4.0, "b": 4.0, "c": 4.0, "d": 2.0, "e": 1.5, "z": 0.0}


def score(sel):
    """a, b, c redundant (one 4, two 5, three 5.5), d, e, z additive (z: no effect)."""
    n = len({"a", "b", "c"} & set(sel))
    return (0.0, 4.0, 5.0, 5.5)[n] + sum(ALONE[x] for x in sel if x in "dez")


def best_of_size(k):
    return max(score(list(s)) for s in combinations(ALONE, k))


def test_elimination_finds_the_best_set_the_one_shot_ranking_misses():
    every = list(ALONE)
    kept, value, cost, rounds = eliminate(every, 2, score)
    assert len(kept) == 2 and value == score(kept) == best_of_size(2) == 6.0
    assert "d" in kept and len({"a", "b", "c"} & set(kept)) == 1
    assert all(cost[c] == value - score([x for x in kept if x != c]) > 0 for c in kept)
    assert rounds[0]["size"] == 6 and rounds[-1]["dropped"] == []
    # the one-shot ranking (revert costs with all six int16) puts d, e first: 3.5
    full = score(every)
    ranked = sorted(every, key=lambda c: score([x for x in every if x != c]) - full)
    assert score(ranked[:2]) == 3.5 < value


def test_tensors_that_do_not_help_or_are_not_needed_are_dropped():
    kept, value, _cost, _ = eliminate(list(ALONE), 6, score)  # budget for all: z still goes
    assert "z" not in kept and value == score(list(ALONE))
    # the budget met with fewer: the cheapest go while the metric stays within it
    kept, value, _cost, _ = eliminate(list(ALONE), 2, score, within=lambda v: v >= 4.0)
    assert len(kept) == 1 and value == 4.0
    assert eliminate(list(ALONE), 0, score)[0] == []


def test_held_out_pruning():
    # the held-out samples disagree about d: it goes, the rest stays
    def held(sel):
        return score(sel) - (3.0 if "d" in sel else 0.0)

    kept, rounds = prune_on_held(["a", "d", "e"], held)
    assert kept == ["a", "e"] and rounds[0]["worst"] == "d"
    # nothing helps there: empty; without held-out samples: unchanged
    assert prune_on_held(["a", "d"], lambda sel: -score(sel))[0] == []
    assert prune_on_held(["a", "d"], None) == (["a", "d"], [])


def test_eliminate_search_on_the_tiny_transformer(calibrated):  # noqa: F811
    _mod, _params, sim, _qp, eg = calibrated
    held = samples_for(data(3, 5), sim.graph.inputs)
    fb = AutoFallback(
        precision="int16_tensors", min_sqnr=99.0, max_int16_fraction=0.2, search="eliminate"
    )
    found = escalate_search(eg, fb, eg.run_fp32, held)
    limit = int(0.2 * eg.n_activation_slots)
    chosen = found["tensors"]
    assert 1 <= len(chosen) <= limit
    assert found["metric"] > found["base"] + 3.0
    assert {t["kind"] for t in found["trials"]} >= {"base", "eliminate"}
    # the first round measured every escalable tensor (no shortlist)
    first = [t for t in found["trials"] if t["kind"] == "eliminate"][: len(eg.candidates) + 1]
    assert {x for t in first for x in t["layers"]} == set(eg.candidates)
    # every kept tensor: back in int8 (the rest int16) the trial and held-out SQNR drop
    some = trial_set(eg)
    for samples in (some, held):
        ref = eg.run_fp32(samples)
        full = sqnr_db(ref, eg.run(chosen, samples))
        for sid in chosen:
            assert sqnr_db(ref, eg.run([x for x in chosen if x != sid], samples)) < full, sid
        assert full > sqnr_db(ref, eg.run([], samples))
    assert found["metric"] == pytest.approx(sqnr_db(eg.run_fp32(some), eg.run(chosen, some)))
    assert {r["layer"] for r in found["ranking"]} >= set(chosen)


def test_pipeline_on_a_cnn_realizes_the_choice_exactly():
    """End to end on a small CNN (per-tensor and lookup slots): within budget, int16 qparams
    for the picks, realized == simulated bit for bit."""
    mod, params, make_data = small_cnn()
    fb = AutoFallback(
        precision="int16_tensors", min_sqnr=99.0, holdout=4, max_int16_fraction=0.5,
        search="eliminate",
    )  # fmt: skip
    cfg = Config(recipe="cnn", check_scales=False, fallback=fb)
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, make_data(10, 0))
    d = res.decision
    sim = simulate(res.matched, None, res.config)
    assert 1 <= len(d.layers) <= int(0.5 * len(sim.activation_slots()) + 1e-9)
    assert res.config.int16_tensors == tuple(d.layers) and not res.fp32_layers
    assert all(res.qparams[s].dtype == "int16" for s in d.layers)
    assert {t["kind"] for t in d.trials} >= {"base", "eliminate"}
    rep = compare(sim, res.module, res.qparams, samples_for(make_data(2, 5), sim.graph.inputs))
    assert rep.exact, rep.table()


def test_option_round_trips_and_is_validated():
    fb = AutoFallback(precision="int16_tensors", search="eliminate")
    cfg = Config(recipe="cnn", fallback=fb)
    assert Config.loads(cfg.dumps()) == cfg
    with pytest.raises(ValueError, match=r"AutoFallback\.search"):
        AutoFallback(precision="int16_tensors", search="forward")
    with pytest.raises(ValueError, match="search"):
        AutoFallback(precision="fp32", search="eliminate")
