"""AutoFallback(holdout=n): the last n samples are kept out of calibration and of the
ranking, and every layer group the search keeps in fp32 raises the output SQNR on them."""

from __future__ import annotations

import numpy as np
import pytest

from autoq import AutoFallback, Config, Quantizer
from autoq.fallback.auto_fallback import split_holdout
from autoq.metrics import sqnr_db
from models import TARGET, small_cnn


def test_holdout_round_trips_and_is_validated():
    cfg = Config(recipe="cnn", fallback=AutoFallback(holdout=3))
    assert Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="holdout"):
        AutoFallback(holdout=-1)
    with pytest.raises(ValueError, match="leaves no calibration samples"):
        split_holdout([1, 2], 2)
    assert split_holdout([1, 2, 3], 1) == ([1, 2], [3])


def test_kept_layers_improve_the_held_out_samples():
    mod, params, data = small_cnn()
    samples = data(8, 1)
    fb = AutoFallback(min_sqnr=200.0, max_fp32_layers=3, holdout=3)
    res = Quantizer(Config(recipe="cnn", fallback=fb), target=TARGET).run(mod, params, samples)
    assert res.qparams.meta["samples"] == 5  # calibrated without the held-out samples
    searched = [t for t in res.decision.trials if "kept" in t]
    assert searched, res.decision.trials
    kept = [t for t in searched if t["kept"]]
    held = [t["held_out_sqnr"] for t in kept]
    assert held == sorted(held) and len(set(held)) == len(held)  # each kept set raised it
    assert res.decision.layers in [t["layers"] for t in kept]  # the best kept trial
    # the recorded held-out SQNR is the simulated model's on those samples
    an, last = res.analysis, searched[-1]
    ref = an.run_fp32(samples[5:])
    assert np.isclose(sqnr_db(ref, an.run(last["layers"], samples[5:])), last["held_out_sqnr"])
