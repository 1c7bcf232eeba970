"""Imported models in the accelerator form (issue 15, item 5): a TFLite file and PT2E models
(torchao, XNNPACK quantizer) partition with ``autoq.byoc.pattern_table()`` alone into one
offloaded region (0 integer ops left on the host), run bit-exactly like the unpartitioned
module, and hold the same layers as autoq's own quantization of the same float model.

One difference is the file's and stays: where the source quantizes a convolution's output
before a residual add (XNNPACK, TFLite), the import keeps that rounding, so the residual is a
``qnn.add`` layer of its own; autoq's own quantization fuses it into the convolution's
accumulator (``conv2d_bias_add_requantize``). Files that leave tensors in float (torchao's
X86InductorQuantizer before hardswish, sigmoid and the global pool) keep those ops in float
on the host: the file's decision, reported in ``report.fallback``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq.ir.toolkit import bindings, is_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import npu_backend

from models import TARGET

DATA = Path(__file__).parent / "data"


def _run(ex, x) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _one_region(mod) -> None:
    part = npu_backend.partition(mod)
    assert npu_backend.host_ops(part) == {"regions": 1}  # 0 ops on the host but the call


def _one_region_and_bit_exact(mod, xs) -> None:
    _one_region(mod)
    ref_ex, npu_ex = tvm.compile(mod, TARGET), npu_backend.build(mod, TARGET)
    for x in xs:
        np.testing.assert_array_equal(_run(npu_ex, x), _run(ref_ex, x))


def _qnn_ops(mod) -> Counter:
    out: Counter = Counter()
    for _, v in bindings(mod["main"]):
        if is_call(v) and v.op.name.startswith("qnn."):
            name = v.op.name
            if name == "qnn.requantize" and str(v.attrs["out_dtype"]) == "int32":
                name = "residual"  # a residual moved onto an accumulator's grid
            out[name] += 1
    return out


def test_tflite_import_is_one_integer_region():
    pytest.importorskip("tflite", reason="reading .tflite files needs tflite==2.18.0")
    mod = autoq.import_quantized(str(DATA / "tiny_cnn_int8.tflite"))[0]
    # the example NPU (examples/npu_backend) gets the qparams as region arguments
    # (bind_constants=False), and qnn.add in an integer rounding mode needs constant scales
    # to legalize: the TFLite module partitions whole, but that codegen cannot build it
    _one_region(mod)
    ops = _qnn_ops(mod)
    # 4 convs + the avg pool's window sum, the residual add, the mean, the classifier
    assert ops["qnn.conv2d"] == 5 and ops["qnn.add"] == 1
    assert ops["qnn.sum"] == 1 and ops["qnn.dense"] == 1


@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_pt2e_import_partitions_like_autoqs_own_quantization(name):
    torch = pytest.importorskip("torch", reason="PT2E import tests need torch (autoq[torch])")
    pytest.importorskip("torchao", reason="PT2E import tests need torchao==0.18.0")
    pytest.importorskip("skimage", reason="the PT2E tests run on skimage.data images")
    from pt2e_models import images, make_model, pt2e

    calib, test = images(4, seed=0), images(2, seed=1)
    gm = pt2e(make_model(name), "xnnpack", calib)
    mod, _, report = autoq.import_quantized(gm, example_inputs=(torch.from_numpy(test[:1]),))
    assert not report.fallback
    _one_region_and_bit_exact(mod, [test[i : i + 1] for i in range(2)])

    fmod, params = autoq.from_torch(make_model(name), (torch.from_numpy(test[:1]),))
    cfg = autoq.Config(recipe="cnn")
    own = autoq.quantize(fmod, params, [calib[i : i + 1] for i in range(4)], cfg)
    assert npu_backend.host_ops(npu_backend.partition(own)) == {"regions": 1}
    got, want = _qnn_ops(mod), _qnn_ops(own)
    # the same layers: convolutions, classifier, global pools, table lookups, SE multiply
    for op in ("qnn.conv2d", "qnn.dense", "qnn.sum", "qnn.lut", "qnn.multiply"):
        assert got[op] == want[op], op
    # every residual autoq fuses into an accumulator is a qnn.add layer in the file
    assert got["qnn.add"] == want["residual"] > 0 and got["residual"] == 0
