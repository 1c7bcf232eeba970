"""autoq.import_quantized("model.tflite"): full-integer TFLite models in the canonical form.

Reference, not ours: the LiteRT interpreter (``ai-edge-litert``) run live with the reference
kernels (``OpResolverType.BUILTIN_REF``: the TFLite spec, gemmlowp's double rounding) on the
committed inputs (tests/data/tiny_cnn_int8_inputs.npz: skimage crops, int8 NHWC), models
written by scripts/make_tflite_model.py.

* ``one_conv_int8.tflite`` (one per-channel conv with int32 bias): **bit-exact** with
  ``rounding="tflite"`` (the default for TFLite files).
* ``tiny_cnn_int8.tflite`` (conv + relu6, depthwise + relu6, 1x1 conv, residual ADD, average
  pool, 1x1 conv + relu, MEAN, fully connected): **bit-exact** on the 8 crops and 8 random
  int8 images. ``rounding="tflite"`` follows TFLite's kernels where they do more than one
  requantize (:mod:`autoq.qnn.tflite_arith`): ADD rescales both operands after a 20-bit left
  shift (three roundings), AVERAGE_POOL_2D divides the raw integer sum by the count rounding
  half away from zero, MEAN folds ``1 / N`` into its multiplier by an integer division, and
  conv / fully connected multipliers take ``s_x * s_w`` in double. Before: 50/80 outputs
  equal, max 2 LSB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tflite", reason="reading .tflite files needs tflite==2.18.0")
litert = pytest.importorskip(
    "ai_edge_litert.interpreter", reason="the TFLite tests compare with ai-edge-litert"
)

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import autoq  # noqa: E402
from autoq.importers import QuantizedImportError, tflite_to_qdq  # noqa: E402
from autoq.ir.toolkit import bindings, const_array, is_call  # noqa: E402

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def inputs():
    return np.load(DATA / "tiny_cnn_int8_inputs.npz")["x"]


def _litert(path: Path, xs: np.ndarray) -> np.ndarray:
    it = litert.Interpreter(
        model_path=str(path), experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF
    )
    it.allocate_tensors()
    out = []
    for x in xs:
        it.set_tensor(it.get_input_details()[0]["index"], x[None])
        it.invoke()
        out.append(it.get_tensor(it.get_output_details()[0]["index"]).copy())
    return np.concatenate(out)


def _tvm(mod, xs: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(autoq.compile(mod), tvm.cpu())
    return np.concatenate([vm["main"](tvm.runtime.tensor(x[None])).numpy() for x in xs])


def test_one_conv_is_bit_exact_with_litert_reference_kernels(inputs):
    path = DATA / "one_conv_int8.tflite"
    mod, qparams, report = autoq.import_quantized(str(path))
    assert report.format == "TFLite" and report.config.rounding == "tflite"
    assert qparams.meta["source"] == "tflite"
    # int8 NHWC in and out, as in the file
    assert [p.ty.dtype for p in mod["main"].params] == ["int8"]
    assert list(mod["main"].params[0].ty.shape) == [1, 32, 32, 3]
    # the file's int8 weights (OHWI -> OIHW), int32 bias, tflite requantize
    convs = [v for _, v in bindings(mod["main"]) if is_call(v, "qnn.conv2d")]
    assert len(convs) == 1
    w = const_array(convs[0].args[1])
    assert w.dtype == np.int8 and w.shape == (8, 3, 3, 3)
    req = [v for _, v in bindings(mod["main"]) if is_call(v, "qnn.requantize")]
    assert req and all(str(r.attrs["rounding"]) == "tflite" for r in req)
    xs = inputs[:4]
    got, ref = _tvm(mod, xs), _litert(path, xs)
    assert got.dtype == np.int8 and got.shape == ref.shape == (4, 32, 32, 8)
    np.testing.assert_array_equal(got, ref)


def _random_images(n: int) -> np.ndarray:
    return np.random.default_rng(5).integers(-128, 128, (n, 32, 32, 3)).astype(np.int8)


def test_tiny_cnn_is_bit_exact_with_litert_reference_kernels(inputs):
    path = DATA / "tiny_cnn_int8.tflite"
    mod, _, report = autoq.import_quantized(str(path))
    assert not report.fallback and len(report.layers) == 8  # avg pool: an integer layer
    xs = np.concatenate([inputs, _random_images(8)])
    got, ref = _tvm(mod, xs), _litert(path, xs)
    assert got.shape == ref.shape == (16, 10)
    np.testing.assert_array_equal(got, ref)
    # TFLite's ADD and AVERAGE_POOL_2D, as the canonical ops carry them
    calls = [v for _, v in bindings(mod["main"])]
    adds = [c for c in calls if is_call(c, "qnn.add")]
    assert len(adds) == 1 and str(adds[0].attrs["rounding"]) == "tflite"
    pool = [
        c for c in calls if is_call(c, "qnn.requantize") and str(c.attrs["rounding"]) == "half_away"
    ]
    assert len(pool) == 1  # the window sum / 4, ties away from zero


def test_rounding_modes_other_than_tflite_are_not_exact(inputs):
    """The TFLite kernels are what makes the difference: the same file with one-rounding
    integer requantizes disagrees with LiteRT (a check that the test above can fail)."""
    path = DATA / "tiny_cnn_int8.tflite"
    mod, _, _ = autoq.import_quantized(str(path), autoq.Config(recipe="cnn", rounding="half_away"))
    got, ref = _tvm(mod, inputs), _litert(path, inputs)
    assert np.abs(got.astype(np.int64) - ref).max() >= 1


def test_unsupported_tflite_op_is_named(tmp_path):
    """A model with an op outside the rule table: the error names the op and its output."""
    from autoq.importers import tflite as T

    data = (DATA / "tiny_cnn_int8.tflite").read_bytes()
    saved = T.RULES.pop("MEAN")
    try:
        with pytest.raises(QuantizedImportError, match=r"TFLite op MEAN \(output 'Mean'\)"):
            tflite_to_qdq(data)
    finally:
        T.RULES["MEAN"] = saved
