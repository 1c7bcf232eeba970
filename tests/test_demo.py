"""The bundled demo model and data (``autoq/data``) and a reduced ``autoq demo``.

ONNX Runtime is the independent reference for the fp32 model's predictions.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from autoq import cli
from autoq.cli import demo
from models import TARGET


@pytest.fixture(scope="module")
def digits():
    return demo.load_digits()


@pytest.fixture(scope="module")
def ort_predict():
    import onnxruntime as ort

    sess = ort.InferenceSession(str(demo.MODEL_FILE), providers=["CPUExecutionProvider"])
    return lambda x: np.array(
        [int(sess.run(None, {demo.INPUT: x[i : i + 1]})[0].argmax()) for i in range(len(x))]
    )


def test_bundled_files():
    model = onnx.load(str(demo.MODEL_FILE))
    onnx.checker.check_model(model)
    assert model.ir_version <= 13  # what ONNX Runtime 1.31 accepts
    (inp,) = model.graph.input
    assert inp.name == demo.INPUT
    assert [d.dim_value for d in inp.type.tensor_type.shape.dim] == [1, 1, 8, 8]
    # package data next to the module (pyproject [tool.setuptools.package-data])
    from importlib.resources import files

    assert (files("autoq") / "data" / "digits_cnn.onnx").is_file()
    assert (files("autoq") / "data" / "digits.npz").is_file()


def test_digits_data(digits):
    assert digits.x.shape == (1797, 1, 8, 8) and digits.x.dtype == np.float32
    assert sorted(set(digits.labels.tolist())) == list(range(10))
    assert int(digits.train.sum()) == 1197 and len(digits.test_labels) == 600
    # every class is held out in proportion (the stratified split of train_digits.py)
    counts = np.bincount(digits.test_labels, minlength=10)
    assert counts.min() >= 55 and counts.max() <= 65
    # preprocessing (pixels / 16 - mean) / std maps pixel 0 and 16 to the stored constants
    with np.load(demo.DATA_FILE) as d:
        lo = (0 - float(d["mean"])) / float(d["std"])
        hi = (16 * float(d["pixel_scale"]) - float(d["mean"])) / float(d["std"])
        pix = d["images"]
    assert np.isclose(digits.x[pix[:, None] == 0], lo).all()
    assert np.isclose(digits.x[pix[:, None] == 16], hi).all()
    cal = demo.calibration_images(5, digits)
    assert len(cal) == 5 and cal[0].shape == (1, 1, 8, 8)
    np.testing.assert_array_equal(cal[3][0], digits.train_x[3])


def test_imported_model_matches_onnxruntime(digits, ort_predict):
    import tvm
    from tvm import relax

    import autoq

    mod, params = demo.load_model()
    assert {"conv1.weight", "res.weight", "fc.weight"} <= set(params)
    vm = relax.VirtualMachine(
        autoq.compile(relax.transform.BindParams("main", params)(mod), TARGET), tvm.cpu()
    )
    x = digits.test_x[:50]
    np.testing.assert_array_equal(demo.evaluate(vm, x), ort_predict(x))
    # the model is trained: held-out accuracy far above chance
    assert np.mean(ort_predict(x) == digits.test_labels[:50]) > 0.9


def test_reduced_demo(digits, ort_predict):
    lines = []
    res = demo.run(
        calib_samples=16,
        eval_samples=60,
        target=TARGET,
        latency=False,
        progress=False,
        echo=lines.append,
    )
    ref = ort_predict(digits.test_x[:60])
    assert res.calib_samples == 16 and res.eval_samples == 60
    assert res.accuracy_fp32 == pytest.approx(np.mean(ref == digits.test_labels[:60]))
    # int8 keeps the fp32 decision on nearly every image and accuracy within 5 points
    assert res.agreement >= 0.95
    assert res.accuracy_int8 >= res.accuracy_fp32 - 0.05
    assert res.layers_int8 == ["conv1", "conv2", "conv3", "res", "mean_0", "fc"]
    assert sum(res.bytes_fp32.values()) == 4 * sum(
        int(np.prod(t.dims)) for t in onnx.load(str(demo.MODEL_FILE)).graph.initializer
    )
    assert sum(res.bytes_int8.values()) < sum(res.bytes_fp32.values()) / 3
    text = "\n".join(lines)
    assert "accuracy" in text and "weights (bytes)" in text and "latency" not in text


def test_demo_command_options(monkeypatch, capsys):
    """``autoq demo`` passes its options through to demo.run."""
    seen = {}
    monkeypatch.setattr(demo, "run", lambda **kw: seen.update(kw))
    code = cli.main(
        ["demo", "--calib-samples", "7", "--eval-samples", "9", "--method", "max", "--no-latency"]
    )
    assert code == 0
    assert seen["calib_samples"] == 7 and seen["eval_samples"] == 9
    assert seen["method"] == "max" and seen["latency"] is False
    assert cli.main(["demo", "--calib-samples", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err
