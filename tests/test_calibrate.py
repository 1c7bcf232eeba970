"""calibrate(): topological order against an independent numpy computation, fp32 mode,
memory budget and spilling, dataset validation, user calibrators, QParams as data."""

from __future__ import annotations

import numpy as np
import pytest

import autoq
from autoq import Config, QParams, QuantSpec, calibrate, load_qparams, realize, simulate
from autoq import primitives as P
from autoq.config import Resources
from models import TARGET, Runner, conv2d_nchw, image_data, small_cnn, two_convs

MAX = QuantSpec(dtype="int8", symmetric=False, calibrator="max")
WMAX = QuantSpec(
    dtype="int8", symmetric=True, narrow_range=True, per_channel=True, calibrator="max"
)


def cfg(**kw):
    return Config(recipe="cnn", activation=MAX, weight=WMAX, **kw)


def _numpy_relu_range(params, data, x_qp, w_qp, quantized: bool):
    """max/min of relu(conv c1) over the dataset, computed in numpy: with the input and
    weight quantized exactly as the integer graph does (topological) or in float (fp32)."""
    w, b = params["c1.weight"], params["c1.bias"]
    lo, hi = np.inf, -np.inf
    for x in data:
        if quantized:
            xq = P.quantize(x, x_qp.scale, x_qp.zero_point).astype(np.int64) - int(x_qp.zero_point)
            wq = P.quantize(w, w_qp.scale, w_qp.zero_point, axis=0).astype(np.int64)
            s_acc = (x_qp.scale * w_qp.scale).astype(np.float32)
            bq = P.quantize_bias(b, x_qp.scale, w_qp.scale).values.astype(np.int64)
            acc = conv2d_nchw(xq, wq, pad=1) + bq.reshape(1, -1, 1, 1)
            y = acc.astype(np.float32) * s_acc.reshape(1, -1, 1, 1)
        else:
            y = conv2d_nchw(x.astype(np.float64), w.astype(np.float64), pad=1) + b.reshape(
                1, -1, 1, 1
            )
        y = np.maximum(y, 0)
        lo, hi = min(lo, y.min()), max(hi, y.max())
    return lo, hi


def test_topological_calibration_sees_upstream_quantization_error():
    mod, params, make = two_convs()
    data = make(6)
    sim = simulate(mod, params, cfg())
    topo = calibrate(sim, params, data, cfg(), target=TARGET)
    fp32 = calibrate(sim, params, data, cfg(calibration="fp32"), target=TARGET)
    assert sim.activation_slots() == ["x", "relu_0"]
    # the input and the weights see no upstream error: both modes agree exactly
    for sid in ("x", "c1.weight", "c2.weight"):
        assert topo[sid] == fp32[sid], sid
    all_x = np.concatenate([d.ravel() for d in data])
    assert topo["x"] == autoq.QParam(*P.choose_qparams(all_x.min(), all_x.max()))
    # relu_0 is downstream of x and c1.weight: topological mode calibrates it on the
    # quantized conv's output (numpy int64 reference, bit-exact), fp32 mode on the float one
    lo, hi = _numpy_relu_range(params, data, topo["x"], topo["c1.weight"], quantized=True)
    assert topo["relu_0"] == autoq.QParam(*P.choose_qparams(lo, hi))
    _flo, fhi = _numpy_relu_range(params, data, None, None, quantized=False)
    np.testing.assert_allclose(fp32["relu_0"].rmax, fhi, rtol=1e-5)
    assert topo["relu_0"] != fp32["relu_0"]


def test_spilling_to_disk_changes_nothing(tmp_path):
    mod, params, make = small_cnn()
    data = make(5)
    sim = simulate(mod, params, cfg())
    ram = calibrate(sim, params, data, cfg(), target=TARGET)
    spill = Resources(memory_budget_mb=0, cache_dir=str(tmp_path / "cache"))
    disk = calibrate(sim, params, data, cfg(), target=TARGET, resources=spill)
    assert dict(ram) == dict(disk)
    assert list((tmp_path / "cache").glob("*.npy")) == []  # cleaned up after use


def test_generators_and_single_arrays_are_datasets():
    mod, params, make = two_convs()
    data = make(3)
    sim = simulate(mod, params, cfg())
    a = calibrate(sim, params, (d for d in data), cfg(), target=TARGET)
    b = calibrate(sim, params, [{"x": d} for d in data], cfg(), target=TARGET)
    assert dict(a) == dict(b)


@pytest.mark.parametrize(
    "dataset, message",
    [
        ([], r"empty"),
        ([{"y": np.zeros((1, 3, 8, 8), np.float32)}], r"'x'"),
        ([np.zeros((1, 3, 8, 9), np.float32)], r"\(1, 3, 8, 8\)"),
        ([np.zeros((1, 3, 8, 8), np.float64)], r"float32"),
        ([np.full((1, 3, 8, 8), np.nan, np.float32)], r"NaN"),
    ],
)
def test_bad_datasets_fail_before_any_work(dataset, message):
    mod, params, _ = two_convs()
    sim = simulate(mod, params, cfg())
    with pytest.raises(ValueError, match=message):
        calibrate(sim, params, dataset, cfg(), target=TARGET)


def test_user_calibrators_plug_into_the_config():
    """A plain function batch -> (lo, hi) and an object following the contract."""
    mod, params, make = two_convs()
    data = make(4)

    def middle_half(x):
        return np.percentile(x, 25), np.percentile(x, 75)

    class Fixed:
        name = "fixed"
        needs_range = False

        def observer(self, axis=None, data_range=None):
            class Obs:
                def update(self, x):
                    pass

                def merge(self, other):
                    pass

                def compute(self, spec):
                    return autoq.QParam.from_range(-1.0, 1.0, spec.dtype, spec.symmetric)

            return Obs()

    for cal in (middle_half, Fixed()):
        c = Config(recipe="cnn", activation=QuantSpec(calibrator=cal), weight=WMAX)
        sim = simulate(mod, params, c)
        qp = calibrate(sim, params, data, c, target=TARGET)
        if cal is middle_half:
            lo = min(np.percentile(d, 25) for d in data)
            hi = max(np.percentile(d, 75) for d in data)
            assert qp["x"] == autoq.QParam(*P.choose_qparams(lo, hi))
        else:
            assert qp["x"] == autoq.QParam.from_range(-1.0, 1.0)
            assert qp["relu_0"] == autoq.QParam.from_range(-1.0, 1.0)


@pytest.mark.parametrize("method", ["max", "moving_average", "percentile", "kl", "mse"])
def test_every_shipped_calibrator_runs_through_the_pipeline(method):
    mod, params, make = two_convs()
    c = Config(recipe="cnn", activation=QuantSpec(calibrator=method))
    sim = simulate(mod, params, c)
    qp = calibrate(sim, params, make(4), c, target=TARGET)
    q = realize(mod, params, qp, c)
    x = make(1, seed=9)[0]
    ref, got = Runner(mod, params)(x), Runner(q)(x)
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_qparams_are_data_save_edit_load(tmp_path):
    mod, params, make = two_convs()
    sim = simulate(mod, params, cfg())
    qp = calibrate(sim, params, make(4), cfg(), target=TARGET)
    path = tmp_path / "q.json"
    qp.save(path)
    loaded = load_qparams(path)
    assert dict(loaded) == dict(qp) and loaded.slots == qp.slots
    x = make(1, seed=3)[0]
    a = Runner(realize(mod, params, qp, cfg()))(x)
    b = Runner(realize(mod, params, loaded, cfg()))(x)
    np.testing.assert_array_equal(a, b)
    # a hand edit: double the input scale, realize again, the output changes
    edited = loaded.replace(x=autoq.QParam(loaded["x"].scale * 2, loaded["x"].zero_point))
    c = Runner(realize(mod, params, edited, cfg()))(x)
    assert not np.array_equal(a, c)
    with pytest.raises(KeyError, match=r"no qparams for slot 'relu_1'.*closest ids: relu_0"):
        loaded.replace(relu_1=loaded["x"])
    assert isinstance(QParams.loads(qp.dumps()), QParams)


def test_dead_channel_with_a_large_bias_keeps_its_bias():
    """Channel 0 has weights ~1e-9 and bias 5: its weight scale would make
    bias / (s_x * s_w) overflow int32. The weight scale is widened instead, so the realized
    channel still outputs ~5 (the saturated bias would give ~0.02)."""
    from models import Builder, conv

    b = Builder(0)
    x = b.input("x", (1, 3, 6, 6))
    mod, params = b.build(lambda b: conv(b, x, "c", 3, 4))
    params["c.weight"][0] = 1e-9
    params["c.bias"][0] = 5.0
    data = [np.random.default_rng(i).normal(size=(1, 3, 6, 6)).astype(np.float32) for i in range(3)]
    sim = simulate(mod, params, cfg())
    qp = calibrate(sim, params, data, cfg(), target=TARGET)
    assert qp.meta["bias_widened"] == ["c"]
    s_acc = float(qp["x"].scale) * float(qp["c.weight"].scale[0])
    assert 5.0 / s_acc <= 2**22 * 1.0001
    out = Runner(realize(mod, params, qp, cfg()))(data[0])
    np.testing.assert_allclose(out[0, 0], 5.0, rtol=1e-3)


@pytest.mark.parametrize("budget", [2**26, 0])
def test_observers_on_the_runner_thread_match_the_plain_ones(tmp_path, budget):
    """``observe_ahead`` (asked before the segments producing the values run, filled on the
    runner's worker thread as they are cached) and ``observe_later`` (values taken when
    asked, kept after the segment drops them) give the states of the plain observer of
    every slot, in RAM and spilled to disk, and a feed split over two threads the same
    Hessians as one; segments run with a twin VM (odd samples on another thread) cache
    the same values as on one; a runner closed while an observer still waits for values
    raises instead of hanging."""
    from autoq.accuracy.weight_tuning import InputStats, layer_tasks
    from autoq.calibration import (
        build_plan,
        calibrate_weights,
        calibration_pipeline,
        samples_for,
        static_values,
    )
    from autoq.calibration.scale_health import HealthCheck
    from autoq.calibration.shard_runner import ShardRunner
    from autoq.ir.toolkit import compile_vms

    mod, params, make = small_cnn()
    sim = simulate(mod, params, cfg())
    plan, functions = build_plan(sim)
    vm, twin = compile_vms(functions, TARGET, sim.mod, calibration_pipeline(TARGET), 2)
    static = static_values(sim, plan, calibrate_weights(sim))
    runner = ShardRunner(vm, plan, static, budget, str(tmp_path), twin)
    single = ShardRunner(vm, plan, static, budget, str(tmp_path / "single"))  # one VM
    for r in (runner, single):
        r.load(samples_for(make(5), sim.graph.inputs))
        r.run_prologue()
    cal = MAX.calibrator
    tasks, fed, compared = layer_tasks(sim), 0, 0
    ahead = {s: runner.observe_ahead(s, cal) for s in plan.segments[0].heads}
    for j, seg in enumerate(plan.segments):
        chosen = {}
        for sid in seg.heads:
            plain = runner.observer(sid, cal)
            assert ahead[sid].state().keys() == plain.state().keys()
            for k, v in plain.state().items():
                np.testing.assert_array_equal(ahead[sid].state()[k], v)
            qp = plain.compute(MAX)
            chosen[sid] = (qp.scale, qp.zero_point)
            later = runner.observe_later(sid, HealthCheck(qp))
            want = runner.observer(sid, HealthCheck(qp)).compute()
            ahead[sid] = (later, want)
            if sid in tasks:  # the Hessians fed from two threads: the same integer sums
                one = runner.feed(sid, InputStats(tasks[sid], qp))
                two = runner.feed(sid, InputStats(tasks[sid], qp), InputStats(tasks[sid], qp))
                for layer, h in one.hessians.items():
                    other = two.hessians[layer]
                    assert (h.matrix() == other.matrix()).all() and h.rows == other.rows
                    np.testing.assert_array_equal(h.sum, other.sum)
                    np.testing.assert_array_equal(h.row_sum, other.row_sum)
                fed += 1
        nxt = plan.segments[j + 1].heads if j + 1 < len(plan.segments) else ()
        done = {s: v for s, v in ahead.items() if s in seg.heads}
        ahead = {s: runner.observe_ahead(s, cal) for s in nxt}
        runner.run_segment(j, chosen)
        single.run_segment(j, chosen)
        for k in seg.outputs:  # the twin's (odd) samples too: the same bits
            for i in range(5):
                if (k, i) in single.cache:
                    got, want = runner.cache.get_numpy((k, i)), single.cache.get_numpy((k, i))
                    assert got.tobytes() == want.tobytes()
                    compared += 1
        for later, want in done.values():  # resolved after the segment dropped the values
            assert later.compute() == want
    assert runner.stats["observe_later_cpu_s"] > 0 and fed == len(tasks) and compared > 10
    # an observer of values no segment will produce any more: closing the runner ends it
    last = next(s for seg in reversed(plan.segments) for s in seg.heads)
    waiting = runner.observe_ahead(last, cal)
    runner.close()
    single.close()
    with pytest.raises(RuntimeError, match="closed before"):
        waiting.resolve()


def test_segments_compute_no_quantize_whose_result_is_unread():
    """A lookup's output slot (the next conv reads the table's integers) and the model
    output: their quantizes are left out of the compiled segments, every slot still heads
    a segment, and its input is cached up to it (a model input or an earlier segment's
    output), so that its observer finds it."""
    from tvm import relax

    from autoq.calibration import build_plan
    from autoq.ir.canonicalize import hardswish
    from autoq.ir.toolkit import bindings, free_vars
    from models import Builder

    b = Builder(5)
    x = b.input("x", (1, 3, 8, 8))

    def body(b):
        y = b.emit(relax.op.nn.conv2d(x, b.randw("c1.weight", (6, 3, 3, 3)), padding=1))
        h = b.emit(hardswish(y))
        return b.emit(hardswish(b.emit(relax.op.nn.conv2d(h, b.randw("c2.weight", (6, 6, 1, 1))))))

    mod, params = b.build(body)
    sim = simulate(mod, params, cfg())
    plan, functions = build_plan(sim)
    computed = 0
    for seg in plan.segments:
        pairs = bindings(functions[seg.name])
        read = {u for _, e in pairs for u in free_vars(e)} | set(
            free_vars(functions[seg.name].body.body)
        )
        ops = [(v, getattr(getattr(e, "op", None), "name", "")) for v, e in pairs]
        quantizes = [v for v, op in ops if op == "qnn.simulated_quantize"]
        assert all(v in read for v in quantizes), seg.name
        computed += len(quantizes)
    assert computed <= len(sim.activation_slots()) - 2  # the lookups' outputs left out
    assert sorted(h for s in plan.segments for h in s.heads) == sorted(sim.activation_slots())
    available = {k for _, k in plan.inputs}
    for seg in plan.segments:
        assert all(plan.head_tensor[h] in available for h in seg.heads), seg.heads
        available |= set(seg.outputs)
    data = image_data((1, 3, 8, 8), 2, 4)
    qp = calibrate(sim, params, data, cfg(), target=TARGET)
    assert set(sim.activation_slots()) <= set(qp.params)
