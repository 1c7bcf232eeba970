"""int16 per channel on the residual stream (``Config.residual_int16_per_channel``): a
residual-stream slot in ``Config.int16_tensors`` keeps its per-channel grid (int16 now); the
escalation's switched graph predicts that realized module, its per-channel int16 qparams
come from each channel's observed range (numpy), the search's picks realize exactly, and
the option is validated / round-trips and changes nothing where no slot is per channel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_escalation import OUTLIER
from test_residual_channels import CALIB, ON, block_data, residual_block

import autoq
from autoq import AutoFallback, Config
from autoq.calibrate import calibrate, samples_for
from autoq.errors import InputError
from autoq.escalation import EscalationGraph
from autoq.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.primitives import choose_qparams
from autoq.realize import realize
from autoq.simulate import simulate
from models import TARGET, Runner, small_cnn

ON16 = ON.replace(residual_int16_per_channel=True)
RESIDUAL = ("x", "pos", "layer_norm_0", "reshape_1", "add_2")


def _axes(sim) -> dict:
    return {s: sim.plan.slots[s].axis for s in sim.activation_slots()}


def test_int16_slots_stay_per_channel_only_with_the_option():
    mod, params = residual_block()
    per_tensor = simulate(mod, params, ON.replace(int16_tensors=("add_2",)))
    per_channel = simulate(mod, params, ON16.replace(int16_tensors=("add_2",)))
    assert per_tensor.plan.slots["add_2"].axis is None
    assert per_channel.plan.slots["add_2"].axis == 2
    assert per_channel.plan.specs["add_2"].dtype == "int16"
    assert {s: a for s, a in _axes(per_channel).items() if s != "add_2"} == {
        s: a for s, a in _axes(per_tensor).items() if s != "add_2"
    }


@pytest.fixture(scope="module")
def switched():
    mod, params = residual_block()
    sim = simulate(mod, params, ON16)
    qp = calibrate(sim, params, CALIB[:12], ON16, target=TARGET)
    eg = EscalationGraph(sim, qp, CALIB[:12], TARGET, int16_per_channel=True)
    return mod, params, sim, qp, eg


def test_per_channel_int16_qparams_are_each_channels_range(switched):
    """Per channel: each channel's observed range x the headroom (numpy's choose_qparams on
    it); their union is the per-tensor graph's observed range (the same values)."""
    _mod, _params, sim, qp, eg = switched
    per_tensor = EscalationGraph(sim, qp, CALIB[:12], TARGET)
    for sid in RESIDUAL:
        pc, pt = eg.qparams16[sid], per_tensor.qparams16[sid]
        assert pc.dtype == "int16" and pc.axis == 2 and np.shape(pc.scale) == (16,)
        assert pt.axis is None
        lo, hi = np.asarray(pc.rmin), np.asarray(pc.rmax)
        assert np.all(lo <= 0) and np.all(hi >= 0)
        assert lo.min() == pt.rmin and hi.max() == pt.rmax
        scale, zp = choose_qparams(lo, hi, "int16")
        np.testing.assert_array_equal(pc.scale, scale)
        np.testing.assert_array_equal(pc.zero_point, zp)
    # the stream's outlier channel has the widest grid, the others far finer
    s = np.asarray(eg.qparams16["add_2"].scale)
    assert np.argmax(s) == OUTLIER and np.median(s) < s[OUTLIER] / 4
    # a slot that is not on the residual stream: per tensor
    assert all(eg.qparams16[s].axis is None for s in eg.candidates if s not in RESIDUAL)


def test_switched_graph_predicts_the_per_channel_int16_module(switched):
    mod, params, _sim, _qp, eg = switched
    test = block_data(3, 9)
    for sid in ("add_2", "layer_norm_0"):
        cfg = ON16.replace(int16_tensors=(sid,))
        sim16 = simulate(mod, params, cfg)
        assert sim16.plan.slots[sid].axis == 2
        qp16 = eg.qparams_with([sid], sim16)
        assert qp16[sid].axis == 2 and qp16[sid].dtype == "int16"
        module = realize(mod, params, qp16, cfg)
        real = Runner(module)
        ref = [real(x) for x in test]
        got = eg.run([sid], test)
        assert sqnr_db(ref, got) > 40.0, sid
        assert sqnr_db(ref, got) >= sqnr_db(ref, eg.run([], test)), sid
        # realized == its own simulation
        rep = compare(sim16, module, qp16, samples_for(test, sim16.graph.inputs), TARGET)
        assert rep.exact, (sid, rep.table())


def test_escalation_picks_realize_per_channel_exactly():
    mod, params = residual_block()
    fb = AutoFallback(precision="int16_tensors", max_int16_fraction=0.4, holdout=2, min_sqnr=80.0)
    res = autoq.Quantizer(ON16.replace(fallback=fb), target=TARGET).run(mod, params, CALIB[:12])
    wide = res.config.int16_tensors
    assert 1 <= len(wide) <= 2
    for s in wide:
        assert res.qparams[s].dtype == "int16"
        assert res.qparams[s].axis == (2 if s in RESIDUAL else None)
    sim = simulate(res.matched, None, res.config)
    rep = compare(
        sim, res.module, res.qparams, samples_for(block_data(3, 4), sim.graph.inputs), TARGET
    )
    assert rep.exact, rep.table()


def test_option_is_validated_round_trips_and_leaves_cnns_alone():
    assert Config.loads(ON16.dumps()) == ON16
    with pytest.raises(InputError, match=r"residual_int16_per_channel needs residual_per_channel"):
        Config(residual_int16_per_channel=True)
    with pytest.raises(TypeError, match=r"Config\.residual_int16_per_channel must be True"):
        Config(residual_per_channel=True, residual_int16_per_channel=1)
    mod, params, make_data = small_cnn()
    base = Config(progress=False, check_scales=False)
    on = base.replace(residual_per_channel=True, residual_int16_per_channel=True)
    a = autoq.quantize(mod, params, make_data(2, 0), base)
    b = autoq.quantize(mod, params, make_data(2, 0), on)
    tvm.ir.assert_structural_equal(a["main"].body, b["main"].body, map_free_vars=True)
