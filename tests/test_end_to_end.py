"""autoq.quantize end to end: one test per supported op, the small CNN / MLP / attention
models, fallback, bit-exactness with the optimizing target, and export to a .so.

Tolerance: over 4 held-out samples, the int8 outputs must be within 4% relative L2 error of
the fp32 outputs (int8 per-tensor activations, per-channel int8 weights, 8 calibration
samples from the same distribution): a step of ~1/255 of each range, accumulated over up to
six layers of random weights whose outputs are small next to their intermediate ranges (a
single sample's small output can be off by more, hence the aggregate). The integer graph
must also equal the simulated graph exactly (0 LSB on every quantized tensor).
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config, Fallback, calibrate, realize, simulate
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from models import TARGET, Builder, Runner, attention, conv, mlp, small_cnn

TOL = 0.04


def rel_err(got, ref):
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12))


def check(mod, params, make_data, config=None, layers=None, target=TARGET):
    config = config or Config(recipe="cnn")
    data = make_data(8, 1)
    sim = simulate(mod, params, config)
    if layers is not None:
        assert [(m.layer, m.pattern.name) for m in sim.matches] == layers
    qp = calibrate(sim, params, data, config, target=target)
    real = realize(mod, params, qp, config)
    test = make_data(4, 7)
    f, q = Runner(mod, params, target), Runner(real, target=target)
    assert rel_err(np.stack([q(x) for x in test]), np.stack([f(x) for x in test])) < TOL
    rep = compare(sim, real, qp, samples_for(test, sim.graph.inputs), target=target)
    assert rep.exact and set(rep.elements) == set(sim.activation_slots()), rep.table()
    return sim, qp, real


def data_fn(shape):
    def make(n, seed):
        rng = np.random.default_rng(seed)
        return [rng.normal(size=shape).astype(np.float32) for _ in range(n)]

    return make


def model(shape, body):
    b = Builder(3)
    x = b.input("x", shape)
    mod, params = b.build(lambda b: body(b, x))
    return mod, params, data_fn(shape)


def _conv_raw(b, x, name, cin, cout, **kw):
    w = b.randw(f"{name}.weight", (cout, cin // kw.get("groups", 1), 3, 3))
    return b.emit(relax.op.nn.conv2d(x, w, **kw))


OPS = {
    "conv2d": ((1, 4, 8, 8), lambda b, x: _conv_raw(b, x, "c", 4, 6, padding=1), [("c", "conv2d")]),
    "conv2d_strided_dilated": (
        (1, 4, 12, 12),
        lambda b, x: _conv_raw(b, x, "c", 4, 6, strides=2, dilation=2, padding=2),
        [("c", "conv2d")],
    ),
    "conv2d_depthwise": (
        (1, 6, 8, 8),
        lambda b, x: conv(b, x, "dw", 6, 6, groups=6),
        [("dw", "conv2d_bias")],
    ),
    "conv2d_grouped": (
        (1, 6, 8, 8),
        lambda b, x: conv(b, x, "g", 6, 4, groups=2),
        [("g", "conv2d_bias")],
    ),
    "conv2d_bias": ((1, 4, 8, 8), lambda b, x: conv(b, x, "c", 4, 6), [("c", "conv2d_bias")]),
    "conv2d_add": (
        (1, 4, 8, 8),
        lambda b, x: b.emit(relax.op.add(_conv_raw(b, x, "c", 4, 4, padding=1), x)),
        [("c", "conv2d_add")],
    ),
    "conv2d_bias_add": (
        (1, 4, 8, 8),
        lambda b, x: b.emit(relax.op.add(x, conv(b, x, "c", 4, 4))),
        [("c", "conv2d_bias_add")],
    ),
    "dense": (
        (3, 8),
        lambda b, x: b.emit(
            relax.op.matmul(x, relax.op.permute_dims(b.randw("fc.weight", (5, 8)), [1, 0]))
        ),
        [("fc", "dense")],
    ),
    "dense_bias": (
        (3, 8),
        lambda b, x: b.emit(
            relax.op.add(
                b.emit(
                    relax.op.matmul(x, relax.op.permute_dims(b.randw("fc.weight", (5, 8)), [1, 0]))
                ),
                b.weight("fc.bias", np.linspace(-0.5, 0.5, 5)),
            )
        ),
        [("fc", "dense_bias")],
    ),
    "matmul": (
        (1, 4, 6),
        lambda b, x: b.emit(relax.op.matmul(x, b.emit(relax.op.permute_dims(x, [0, 2, 1])))),
        [("matmul_0", "matmul")],
    ),
    "add": (
        (2, 3, 4),
        lambda b, x: b.emit(relax.op.add(x, b.emit(relax.op.nn.relu(x)))),
        [("add_0", "add")],
    ),
    "subtract": (
        (2, 3, 4),
        lambda b, x: b.emit(relax.op.subtract(x, b.emit(relax.op.sigmoid(x)))),
        [("sigmoid_0", "sigmoid"), ("subtract_0", "subtract")],  # sigmoid: a lookup table
    ),
    "multiply": (
        (2, 3, 4),
        lambda b, x: b.emit(relax.op.multiply(x, b.emit(relax.op.tanh(x)))),
        [("tanh_0", "tanh"), ("multiply_0", "multiply")],  # tanh: a lookup table
    ),
    "mean": (
        (1, 4, 5, 5),
        lambda b, x: b.emit(relax.op.mean(x, axis=[2, 3], keepdims=True)),
        [("mean_0", "mean")],
    ),
    "adaptive_avg_pool2d": (
        (1, 4, 5, 5),
        lambda b, x: b.emit(relax.op.nn.adaptive_avg_pool2d(x, output_size=1)),
        [("adaptive_avg_pool2d_0", "adaptive_avg_pool2d")],
    ),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_supported_op_end_to_end(name):
    shape, body, layers = OPS[name]
    mod, params, make = model(shape, body)
    check(mod, params, make, layers=layers)


def test_dense_bias_add_in_a_transformer_block():
    mod, params, make = attention()
    sim, _, _ = check(mod, params, make)
    assert ("attn.out", "dense_bias_add") in [(m.layer, m.pattern.name) for m in sim.matches]


@pytest.mark.parametrize("build", [small_cnn, mlp, attention], ids=["cnn", "mlp", "attention"])
def test_small_models(build):
    mod, params, make = build()
    check(mod, params, lambda n, s: make(n, s))


def test_bit_exact_with_the_optimizing_default_target_too():
    mod, params, make = small_cnn()
    check(mod, params, lambda n, s: make(n, s), target=autoq.default_target())


def test_uint8_activations_and_per_tensor_weights():
    mod, params, make = small_cnn()
    cfg = Config(
        recipe="cnn",
        activation=autoq.QuantSpec(dtype="uint8", calibrator="percentile"),
        weight=autoq.QuantSpec(symmetric=True, per_channel=False),
    )
    _sim, qp, _real = check(mod, params, lambda n, s: make(n, s), cfg)
    assert qp["x"].dtype == "uint8" and qp["stem.weight"].scale.ndim == 0


def test_fallback_changes_exactly_the_named_layers():
    mod, params, make = small_cnn()
    base = simulate(mod, params, Config(recipe="cnn"))
    for fb, gone in [
        (Fallback(ids=("block.conv2",)), {"block.conv2"}),
        (Fallback(op_types=("dense_bias",)), {"fc"}),
        (Fallback(patterns=("re:(stem|dw)",)), {"stem", "dw"}),
    ]:
        cfg = Config(recipe="cnn", fallback=fb)
        sim, _, _real = check(mod, params, lambda n, s: make(n, s), cfg)
        assert set(base.layers) - set(sim.layers) == gone
        # everything else keeps its pattern
        assert [(m.layer, m.pattern.name) for m in sim.matches] == [
            (m.layer, m.pattern.name) for m in base.matches if m.layer not in gone
        ]


def test_quantize_one_call_and_export(tmp_path):
    mod, params, make = small_cnn()
    q = autoq.quantize(mod, params, make(4), Config(recipe="cnn"), target=TARGET)
    qp = autoq.QParams.loads(str(q.attrs["autoq.qparams"]))
    assert "stem.weight" in qp
    path = autoq.export_library(q, tmp_path / "model.so", target=TARGET)
    vm = autoq.load_library(path)
    x = make(1, 5)[0]
    import tvm

    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, Runner(q)(x))
    assert rel_err(got, Runner(mod, params)(x)) < TOL


def _masked_attention():
    """Attention scores + an additive mask of 0 / finfo.min given as an input (a mask made
    in the graph from a finfo.min constant is rewritten, see autoq.ir.attention_mask)."""
    b = Builder(4)
    x = b.input("x", (1, 8, 16))
    mask = b.input("mask", (1, 1, 8))

    def body(b):
        w = b.randw("q.weight", (16, 16))
        q = b.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
        s = b.emit(relax.op.matmul(q, b.emit(relax.op.permute_dims(x, [0, 2, 1]))))
        p = b.emit(relax.op.nn.softmax(b.emit(relax.op.add(s, mask)), axis=-1))
        return b.emit(relax.op.matmul(p, x))

    mod, params = b.build(body)

    def make(n, seed):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            add = np.zeros((1, 1, 8), np.float32)
            add[..., rng.integers(4, 8) :] = np.finfo(np.float32).min
            out.append({"x": rng.normal(size=(1, 8, 16)).astype(np.float32), "mask": add})
        return out

    return mod, params, make


def test_unbounded_attention_masks_stay_fp32():
    mod, params, make = _masked_attention()
    data, test = make(6, 1), make(4, 2)
    f = Runner(mod, params)
    ref = np.stack([f(s["x"], s["mask"]) for s in test])
    with pytest.warns(UserWarning, match=r"keeping 1 layer\(s\) in fp32 .*add_0"):
        q = autoq.quantize(mod, params, data, Config(recipe="cnn"), target=TARGET)
    assert str(q.attrs["autoq.skipped_unbounded"]) == "add_0"
    # the guard's one-off compile is reported apart, inside the guard's own time
    run = autoq.Quantizer(Config(recipe="cnn"), target=TARGET)
    with pytest.warns(UserWarning, match="keeping 1 layer"):
        t = run.run(mod, params, data).timings
    assert 0 < t["guard.compile"] < t["guard"], t
    got = np.stack([Runner(q)(s["x"], s["mask"]) for s in test])
    assert rel_err(got, ref) < TOL
    # with the guard off, the scale health check keeps the mask add in fp32 instead
    caught = autoq.Quantizer(Config(recipe="cnn", skip_unbounded=False), target=TARGET)
    caught = caught.run(mod, params, data)
    assert caught.fp32_layers.get("add_0") == "unusable scale (scale health)", caught.fp32_layers
    # quantizing the mask anyway destroys the scores (every score rounds to one value)
    bad = autoq.quantize(
        mod,
        params,
        data,
        Config(recipe="cnn", skip_unbounded=False, check_scales=False),
        target=TARGET,
    )
    worse = np.stack([Runner(bad)(s["x"], s["mask"]) for s in test])
    assert rel_err(worse, ref) > 5 * rel_err(got, ref)


def test_an_activation_that_is_nan_on_one_sample_is_reported_unbounded():
    """sqrt of a negative input is NaN: the dense reading it must not be quantized, even
    when the NaN shows up only in the second sample (Python's min/max would drop it)."""
    from autoq.fallback.guard import layers_using, unbounded_slots

    b = Builder(3)
    x = b.input("x", (1, 8))

    def body(b):
        r = b.emit(relax.op.sqrt(x))
        w = b.randw("fc.weight", (4, 8))
        return b.emit(relax.op.matmul(r, relax.op.permute_dims(w, [1, 0])))

    mod, params = b.build(body)
    ok = np.abs(np.random.default_rng(0).normal(size=(1, 8))).astype(np.float32)
    data = [{"x": ok}, {"x": -ok}]
    sim = simulate(mod, params, Config(recipe="cnn"))
    bad = unbounded_slots(sim, data, TARGET)
    assert list(bad) == ["sqrt_0"] and np.isnan(bad["sqrt_0"][0])
    assert layers_using(sim, bad) == ["fc"]
    assert unbounded_slots(sim, data[:1], TARGET) == {}
