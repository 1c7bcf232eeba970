"""A model with no layer left to quantize (issue 38, item 9): a softmax-only model, every
layer kept in fp32 by a rule, every layer's input unbounded. Calibration used to compile an
empty module and fail with ``Module has no function 'vm_load_executable'``; now the result
is the fp32 model, with a warning saying that nothing was quantized and why (what ONNX
Runtime's quantize_static does with such a model: it returns it unchanged)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cli import TARGET as CLI_TARGET
from test_cli import run as run_cli

import autoq
from models import TARGET, run

W = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)


def _save(path, nodes, out_shape, inits=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        list(inits),
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("nothing")
    _save(d / "softmax.onnx", [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [1, 8])
    w = numpy_helper.from_array(W, "w")
    _save(d / "matmul.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"])], [1, 4], [w])
    x = np.random.default_rng(1).normal(size=(4, 1, 8)).astype(np.float32)
    np.save(d / "x.npy", x)
    x = x.copy()
    x[:, 0, 3] = 1e31  # a sentinel in every sample: the guard keeps the layer in fp32
    np.save(d / "unbounded.npy", x)
    return d


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


CASES = {  # model, data, Config keywords, CLI options, want(x), the warning's reason
    "softmax only": ("softmax.onnx", "x.npy", {}, [], softmax, "none of the model's ops"),
    "all kept fp32": (
        "matmul.onnx", "x.npy", {"fallback": autoq.Fallback(ids=("w",))}, ["--skip", "w"],
        lambda x: x @ W, "all 1 layer(s) are kept in fp32 (fallback rule: w)",
    ),
    "all unbounded": (
        "matmul.onnx", "unbounded.npy", {}, [], lambda x: x @ W,
        "all 1 layer(s) are kept in fp32 (unbounded activations (guard): w)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_api_returns_the_fp32_model_with_a_warning(d, case):
    model, data, kw, _, want, reason = CASES[case]
    mod, params = autoq.from_onnx(d / model)
    x = np.load(d / data)
    with pytest.warns(UserWarning, match="no layer is quantized"):
        r = autoq.Quantizer(autoq.Config(recipe="cnn", **kw), target=TARGET).run(mod, params, x)
    assert r.int8_layers == []
    (msg,) = [w for w in r.warnings if w.startswith("no layer is quantized")]
    assert reason in msg and msg.endswith("the result is the fp32 model")
    for sample in x[:2]:
        got = run(r.module, [sample], params)
        np.testing.assert_allclose(
            got, want(sample), rtol=1e-5, atol=1e-6 * np.abs(want(sample)).max()
        )


@pytest.mark.parametrize("case", ["softmax only", "all kept fp32"])
def test_the_cli_writes_the_fp32_model_and_says_so(d, tmp_path, capsys, case):
    model, data, _, opts, _, reason = CASES[case]
    argv = ["quantize", d / model, "--calib", d / data, "--out", tmp_path / "out", *opts]
    code, out, err = run_cli(
        capsys, *argv, "--no-progress", "--recipe", "cnn", "--target", CLI_TARGET
    )
    assert code == 0, err
    assert f"autoq: warning: no layer is quantized: {reason}" in err
    assert "0 quantized to int8" in out
    assert (tmp_path / "out" / "model.so").is_file()
