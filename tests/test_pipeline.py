"""The one pipeline (autoq.Quantizer): every entry point runs it, the patterns are matched
once per quantization, the dataset is read once, and the CLI does what the API does
(unbounded-activation guard, automatic fallback).

References: the matcher's own call count, the samples a generator yields (counted at the
source), ONNX Runtime for the masked-attention model's fp32 output, and the API's result
for what the CLI must reproduce.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autoq
from autoq import AutoFallback, Config, Quantizer, cli
from autoq.ir import matching
from models import TARGET, Runner, small_cnn

CLI_TARGET = json.dumps({"kind": "llvm", "opt-level": 0})


@pytest.fixture
def matcher_calls(monkeypatch):
    """Count the calls of the matcher itself (autoq.ir.matching.match_all)."""
    calls = []
    real = matching.match_all

    def counting(g, patterns):
        calls.append(len(patterns))
        return real(g, patterns)

    monkeypatch.setattr(matching, "match_all", counting)
    return calls


@pytest.mark.parametrize(
    "config, report",
    [
        (Config(recipe="cnn"), False),
        (Config(recipe="cnn", skip_unbounded=False), True),
        (Config(recipe="cnn", fallback=AutoFallback(min_sqnr=80.0, max_fp32_layers=2)), False),
        (
            Config(
                recipe="cnn",
                fallback=AutoFallback(min_sqnr=80.0, max_fp32_layers=1, precision="int16"),
            ),
            False,
        ),
    ],
    ids=["default", "report", "auto_fallback", "auto_fallback_int16"],
)
def test_patterns_are_matched_once_per_quantization(matcher_calls, config, report):
    mod, params, make = small_cnn()
    with pytest.warns() if isinstance(config.fallback, AutoFallback) else _no_warning():
        res = Quantizer(config, target=TARGET, report=report).run(mod, params, make(3))
    assert len(matcher_calls) == 1, matcher_calls
    assert res.int8_layers and set(res.timings) >= {"match", "calibrate", "realize"}
    if report or isinstance(config.fallback, AutoFallback):
        assert res.report is not None and res.analysis is not None
    if isinstance(config.fallback, AutoFallback):
        assert res.decision is not None and "auto_fallback" in res.timings


def test_autoq_quantize_matches_once(matcher_calls):
    mod, params, make = small_cnn()
    autoq.quantize(mod, params, make(2), Config(recipe="cnn"), target=TARGET)
    assert len(matcher_calls) == 1


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_generator_is_read_once_and_every_sample_is_used():
    """10 samples from a generator: the guard and calibration see the same 10 samples
    (the source is pulled exactly 10 times), and a 1-sample generator is not 'empty'."""
    mod, params, make = small_cnn()
    data = make(10)
    pulled = []

    def gen(items):
        for i, s in enumerate(items):
            pulled.append(i)
            yield s

    res = Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, gen(data))
    assert pulled == list(range(10))
    assert res.samples == 10 and res.qparams.meta["samples"] == 10
    # the same qparams as a list of the same samples
    ref = Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, data)
    assert res.qparams.params == ref.qparams.params  # (meta holds timings)
    one = Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, gen(data[:1]))
    assert one.samples == 1


# ------------------------------------------------------------------ the CLI runs the pipeline


def masked_attention_onnx(path):
    """x (1, 6, 8) -> q = x W^T; scores = q x^T + mask; softmax; @ x, with ``mask`` an
    additive 0 / finfo.min input (a finfo.min constant in the graph would be rewritten to a
    quantizable one, see autoq.ir.attention_mask)."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.normal(size=(8, 8)) * 0.3).astype(np.float32), "q.weight")
    nodes = [
        helper.make_node("Transpose", ["q.weight"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["q"]),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "xt"], ["s"]),
        helper.make_node("Add", ["s", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "masked",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 6]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def mask_samples(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 6, 8)).astype(np.float32)
    mask = np.zeros((n, 1, 1, 6), np.float32)
    for i in range(n):
        mask[i, ..., rng.integers(3, 6) :] = np.finfo(np.float32).min
    return x, mask


def test_cli_keeps_unbounded_mask_adds_in_fp32_like_the_api(tmp_path, capsys):
    import onnxruntime as ort
    import tvm

    model = masked_attention_onnx(tmp_path / "masked.onnx")
    x, mask = mask_samples(6, 1)
    np.savez(tmp_path / "calib.npz", x=x[:, 0], mask=mask[:, 0])
    # the API's decision
    mod, params = autoq.from_onnx(model)
    samples = [{"x": x[i], "mask": mask[i]} for i in range(6)]
    res = Quantizer(Config(), target=TARGET).run(mod, params, samples)  # the CLI's default
    guarded = [k for k, v in res.fp32_layers.items() if "unbounded" in v]
    assert guarded, res.fp32_layers
    assert any("unbounded" in w for w in res.warnings)

    out = tmp_path / "out"
    code = cli.main(
        ["quantize", str(model), "--calib", str(tmp_path / "calib.npz"), "--out", str(out),
         "--no-progress", "--target", CLI_TARGET]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "autoq: warning: keeping" in captured.err and guarded[0] in captured.err
    report = (out / "report.txt").read_text()
    assert f"{', '.join(guarded)} (unbounded activations" in report
    # the written library equals the API's module and stays close to ONNX Runtime's fp32
    vm = autoq.load_library(out / "model.so")
    tx, tmask = mask_samples(3, 2)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for i in range(3):
        got = vm["main"](tvm.runtime.tensor(tx[i]), tvm.runtime.tensor(tmask[i])).numpy()
        np.testing.assert_array_equal(got, Runner(res.module)(tx[i], tmask[i]))
        ref = sess.run(None, {"x": tx[i], "mask": tmask[i]})[0]
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.1


def test_cli_auto_fallback_chooses_what_the_api_chooses(tmp_path, capsys):
    from test_cli import tiny_onnx

    model = tiny_onnx(tmp_path / "tiny.onnx")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 1, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x[:, 0])
    mod, params = autoq.from_onnx(model)
    fb = AutoFallback(min_sqnr=200.0, max_fp32_layers=1)
    with pytest.warns(UserWarning, match="not reached"):
        api = Quantizer(Config(recipe="cnn", fallback=fb), target=TARGET).run(mod, params, list(x))
    out = tmp_path / "out"
    code = cli.main(
        ["quantize", str(model), "--calib", str(tmp_path / "calib.npz"), "--out", str(out),
         "--no-progress", "--target", CLI_TARGET, "--auto-fallback", "--min-sqnr", "200",
         "--max-fallback-layers", "1"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    decision = autoq.FallbackDecision.loads((out / "fallback.json").read_text())
    assert decision.layers == api.decision.layers and len(decision.layers) == 1
    report = (out / "report.txt").read_text()
    assert f"{decision.layers[0]} (automatic (fp32))" in report
    assert "automatic:" in report
    qp = autoq.load_qparams(out / "qparams.json")
    assert f"{decision.layers[0]}.weight" not in qp
