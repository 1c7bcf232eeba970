"""Static + dynamic hybrid (autoq.rules.hybrid): dense layers made dynamic by an Override in a
calibrated static model. The realized module equals the calibrated simulated graph (every
static slot's integers, and the output within float32 rounding), the dynamic layers are per
token at run time (a row's output does not depend on the other rows; per tensor it does),
their weights are the numpy per-channel max quantization, the hybrid is closer to the fp32
model than static int8, the int16 escalation runs on its static part, and the JSON round
trip and the configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_escalation import data, tiny_transformer

import autoq
from autoq import AutoFallback, Config, Fallback, Override, QuantSpec
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.simulation import simulate
from models import TARGET, Runner, attention, mlp

TOKEN = QuantSpec(dynamic=True, granularity="token")
DENSE = "re:^(q|k|v|o|ffn\\..*)$"  # every dense layer of tiny_transformer
HYBRID = Config(recipe="cnn", check_scales=False, overrides=(Override(DENSE, activation=TOKEN),))


def _simulated_output(sim, qparams, x) -> np.ndarray:
    """The calibrated simulated graph's output for input ``x``."""
    g = sim.graph
    values = sim.input_values(qparams)
    n_fixed = len(g.inputs) + len(g.weight_params)
    args = [x] + [g.params[p.name] for p in g.weight_params]
    args += [values[p.name] for p in sim.mod["main"].params[n_fixed:]]
    vm = tvm.relax.VirtualMachine(tvm.compile(sim.mod, TARGET), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(np.array(a, order="C")) for a in args]).numpy()


@pytest.fixture(scope="module")
def hybrid():
    mod, params = tiny_transformer()
    res = autoq.Quantizer(HYBRID, target=TARGET).run(mod, params, data(8, 1))
    return mod, params, res


def test_realized_equals_simulated(hybrid):
    res = hybrid[2]
    assert res.int8_layers == ["q", "k", "v", "matmul_3", "multiply_0", "matmul_4", "o",
                               "ffn.in", "gelu_0", "ffn.out"] and not res.fp32_layers  # fmt: skip
    text = res.module["main"].script()
    # x (shared by q, k, v), o's, ffn.in's and ffn.out's inputs; the attention matmuls static
    assert text.count('"qnn.dynamic_quantize"') == 4 and text.count('"granularity": "token"') == 4
    assert text.count('"qnn.dense"') == 6 and text.count('"qnn.matmul"') == 2
    sim = simulate(res.matched, None, res.config)
    acts = sim.activation_slots()
    assert "x" not in acts and "ffn.in" in acts  # no slot for a dynamic input; gelu's is one
    test = data(3, 4)
    rep = compare(sim, res.module, res.qparams, samples_for(test, sim.graph.inputs), TARGET)
    assert rep.exact and len(rep.elements) >= 6, rep.table()
    run = Runner(res.module)
    for x in test:
        want = _simulated_output(sim, res.qparams, x)
        np.testing.assert_allclose(run(x), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_dynamic_weights_are_max_per_channel(hybrid):
    """A dynamic layer's weight slot: the per-channel max quantization (numpy), not tuned."""
    _, params, res = hybrid
    for layer in ("q", "ffn.out"):
        w = params[f"{layer}.weight"]  # [N, K]
        s, _ = P.choose_qparams(w.min(axis=1), w.max(axis=1), symmetric=True, narrow_range=True)
        np.testing.assert_array_equal(res.qparams[f"{layer}.weight"].scale, s)
        assert f"{layer}.weight" not in res.qparams.values


def test_closer_to_fp32_than_static(hybrid):
    mod, params, res = hybrid
    static = autoq.quantize(mod, params, data(8, 1), HYBRID.replace(overrides=()))
    fp, q8, qh = Runner(mod, params), Runner(static), Runner(res.module)
    test = data(4, 13)
    ref = [fp(x) for x in test]
    s8, sh = sqnr_db(ref, [q8(x) for x in test]), sqnr_db(ref, [qh(x) for x in test])
    assert sh > s8 + 6, (s8, sh)  # measured 9.4 -> 23.1 dB


@pytest.mark.parametrize("gran", ["token", "tensor"])
def test_dynamic_layer_is_per_token_at_run_time(gran):
    """mlp: fc1 (reads the (2, 16) input) dynamic, fc2/fc3 static. Per token, row 0's output
    does not change when row 1 is scaled 100x; per tensor it does (the shared scale)."""
    mod, params, make = mlp()
    spec = QuantSpec(dynamic=True, granularity=gran)
    cfg = Config(recipe="cnn", check_scales=False, overrides=(Override("fc1", activation=spec),))
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, make(8))
    run = Runner(res.module)
    x = make(1, seed=7)[0]
    loud = x.copy()
    loud[1] *= 100.0
    same = np.array_equal(run(x)[0], run(loud)[0])
    assert same == (gran == "token")
    fp = Runner(mod, params)(x)
    assert np.abs(run(x) - fp).max() < 0.1 * np.abs(fp).max()  # (static fc2, fc3: 8 samples)


def test_escalation_on_the_static_part():
    mod, params = tiny_transformer()
    fb = AutoFallback(precision="int16_tensors", max_int16_fraction=0.25)
    res = autoq.Quantizer(HYBRID.replace(fallback=fb), target=TARGET).run(mod, params, data(10, 1))
    chosen = res.config.int16_tensors
    assert chosen and {res.qparams[s].dtype for s in chosen} == {"int16"}
    assert res.config.overrides == HYBRID.overrides
    sim = simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(data(2, 4), sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()


def test_json_round_trip():
    cfg = HYBRID.replace(fallback=AutoFallback(precision="int16_tensors"))
    back = Config.from_json(cfg.to_json())
    assert back == cfg and back.overrides[0].activation == TOKEN
    assert not back.activation.dynamic


CONFIG_ERRORS = [
    (
        lambda: HYBRID.replace(fallback=AutoFallback()),
        r"AutoFallback\(precision='fp32'\) with dynamic layers",
    ),
    (
        lambda: Config(
            recipe="cnn", activation=TOKEN, overrides=(Override("q", activation=QuantSpec()),)
        ),
        "a dynamic model has no calibration",
    ),
    (
        lambda: Config(recipe="cnn", overrides=(Override("q", weight=QuantSpec(dynamic=True)),)),
        "weights are always quantized statically",
    ),
]


@pytest.mark.parametrize("make,fragment", CONFIG_ERRORS)
def test_config_errors(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_a_layer_without_dynamic_form_is_an_error():
    mod, params, make = attention()
    cfg = Config(recipe="cnn", overrides=(Override("matmul_*", activation=TOKEN),))
    with pytest.raises(ValueError, match=r"layer 'matmul_3' \(pattern 'matmul'\).*matmul_\*"):
        autoq.Quantizer(cfg, target=TARGET).run(mod, params, make(2))
    cfg = Config(recipe="cnn", fallback=Fallback(ids=("matmul_3", "matmul_4")), overrides=(Override("attn.*", activation=TOKEN),))  # fmt: skip
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, make(4))
    assert sorted(res.fp32_layers) == ["matmul_3", "matmul_4"]


def test_per_layer_report_switches_dynamic_layers(hybrid):
    """Quantizer(report=True): the analysis graph has a switch per layer, dynamic ones too
    (switched off, a dynamic layer computes its float result: autoq.rules.hybrid.simulated_input);
    every layer gets an SQNR, and a dynamic layer alone is closer to fp32 than the model."""
    mod, params, _ = hybrid
    res = autoq.Quantizer(HYBRID, target=TARGET, report=True).run(mod, params, data(8, 1))
    rows = {r.layer: r for r in res.report.layers}
    assert set(rows) == set(res.int8_layers)
    assert all(np.isfinite(r.sqnr_alone) for r in rows.values())
    assert rows["q"].sqnr_alone > res.report.output_sqnr + 6
