"""``Config.dynamic_gptq`` (autoq.dynamic_gptq): the hybrid's dynamic dense layers get
GPTQ-rounded weights on the Hessian of their fp32 inputs. On the tiny transformer, layer q
reads the model input, so its Hessian is known in numpy: its weights equal a from-scratch
numpy GPTQ (the OBS update with the explicit inverse Hessian, not autoq.gptq's Cholesky
form) and beat round-to-nearest on that Hessian's objective; the realized module still
equals the calibrated simulation; off (default) the dynamic weights stay round-to-nearest;
JSON round trip and the option error."""

from __future__ import annotations

import numpy as np
import pytest
from test_escalation import data, tiny_transformer

import autoq
from autoq import Config, Distributed, Override, QuantSpec
from autoq.calibrate import samples_for
from autoq.fidelity import compare
from autoq.simulate import simulate
from models import TARGET

TOKEN = QuantSpec(dynamic=True, granularity="token")
HYBRID = Config(
    progress=False, check_scales=False, overrides=(Override("pattern:dense*", activation=TOKEN),)
)
CALIB = 8  # samples of (1, 8, 16): 64 rows for q's 16 columns (>= 4 per column)


def _numpy_gptq(w, h, scale, damp=0.01, qmin=-127, qmax=127):
    """GPTQ (Frantar et al. 2022) written from the paper's OBS update: columns in order,
    each rounded, its error spread on the later columns through the inverse Hessian, then
    that column eliminated from the inverse (the explicit form, float64)."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    h += damp * np.mean(np.diag(h)) * np.eye(len(h))
    hinv = np.linalg.inv(h)
    q = np.zeros(w.shape, np.int64)
    for i in range(w.shape[1]):
        q[:, i] = np.clip(np.rint(w[:, i] / scale), qmin, qmax)
        err = (w[:, i] - q[:, i] * scale) / hinv[i, i]
        w[:, i:] -= np.outer(err, hinv[i, i:])
        hinv -= np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return q


@pytest.fixture(scope="module")
def tuned():
    mod, params = tiny_transformer()
    calib = data(CALIB, 1)
    res = autoq.Quantizer(HYBRID.replace(dynamic_gptq=True), target=TARGET).run(mod, params, calib)
    return mod, params, calib, res


def test_q_weights_are_numpy_gptq_on_the_input_hessian(tuned):
    _, params, calib, res = tuned
    x = np.concatenate([s.reshape(-1, s.shape[-1]) for s in calib]).astype(np.float64)
    h = 2.0 * x.T @ x / len(x)
    w = params["q.weight"].astype(np.float64)  # (out, in): the layer computes x @ w.T
    qp = res.qparams["q.weight"]
    scale = np.asarray(qp.scale, np.float64)
    got = res.qparams.values["q.weight"].T.astype(np.int64)  # the graph's (in, out) -> (out, in)
    want = _numpy_gptq(w, h, scale)
    assert (got != want).mean() < 0.01 and np.abs(got - want).max() <= 1  # float64 order
    rtn = np.clip(np.rint(w / scale[:, None]), -127, 127)

    def loss(q):
        d = w - q * scale[:, None]
        return np.einsum("oi,ij,oj->", d, h, d)

    assert loss(got) < 0.9 * loss(rtn), (loss(got), loss(rtn))
    assert res.qparams.meta["stats"]["dynamic_gptq"] >= 4  # q, k, v, o (16 columns)


def test_realized_equals_simulated(tuned):
    _, _, _, res = tuned
    sim = simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(data(2, 4), sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()


def test_off_by_default_weights_round_to_nearest():
    mod, params = tiny_transformer()
    res = autoq.Quantizer(HYBRID, target=TARGET).run(mod, params, data(CALIB, 1))
    assert "q.weight" not in res.qparams.values
    assert "dynamic_gptq" not in res.qparams.meta["stats"]


def test_json_and_option_error():
    cfg = HYBRID.replace(dynamic_gptq=True)
    assert Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match=r"Config\.dynamic_gptq needs weight_rounding='gptq'"):
        HYBRID.replace(dynamic_gptq=True, weight_rounding="nearest")
    with pytest.raises(TypeError, match=r"Config\.dynamic_gptq must be True or False"):
        HYBRID.replace(dynamic_gptq=1)
    with pytest.raises(ValueError, match=r"Config\.dynamic_gptq runs in this process"):
        HYBRID.replace(dynamic_gptq=True, distributed=Distributed(workers=1))
