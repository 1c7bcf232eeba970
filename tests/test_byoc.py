"""autoq.byoc + examples/npu_backend: the realized int8 graph partitions for an NPU and runs
bit-exactly.

The network (tests/models.py ``torch_cnn``: residual add, depthwise conv, hardswish,
sigmoid gate, 2x2 average pool, linear classifier) reaches autoq three ways: ``from_torch``,
``from_onnx`` of its ONNX export, and ONNX Runtime's ``quantize_static`` QDQ file of that
export through ``autoq.import_quantized``. Each int8 module is partitioned with
``autoq.byoc.pattern_table()`` and nothing else; the reference is the same module compiled
unpartitioned by TVM (the NPU's kernels come from the same legalizations, fused into one
kernel per region, so the outputs must be equal bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import autoq
import autoq.byoc
from models import TARGET, torch_cnn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import npu_backend  # registers relax.ext.autoq_npu

SHAPE = (1, 3, 16, 16)


def _samples(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=SHAPE).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    torch, net = torch_cnn()
    path = tmp_path_factory.mktemp("byoc") / "net.onnx"
    torch.onnx.export(
        net, (torch.zeros(SHAPE),), str(path), opset_version=13, dynamo=False,
        input_names=["x"], output_names=["y"],
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def int8_modules(onnx_path):
    """source -> the int8 module (built once per source, shared by the tests)."""
    cache: dict[str, tvm.IRModule] = {}

    def get(source: str) -> tvm.IRModule:
        if source not in cache:
            cache[source] = _int8_module(source, onnx_path)
        return cache[source]

    return get


def _int8_module(source: str, onnx_path) -> tvm.IRModule:
    config = autoq.Config(recipe="cnn")
    if source == "torch":
        torch, net = torch_cnn()
        mod, params = autoq.from_torch(net, (torch.zeros(SHAPE),))
    elif source == "onnx":
        mod, params = autoq.from_onnx(onnx_path)
    else:
        import onnx
        from test_import_quantized import ort_quantize

        q = ort_quantize(
            onnx.load(str(onnx_path)), SHAPE, onnx_path.with_name("q.onnx"), act="int8"
        )
        return autoq.import_quantized(q, config)[0]
    return autoq.quantize(mod, params, _samples(4, 0), config)


def _run(ex, x) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _composites(partitioned: tvm.IRModule) -> list[str]:
    """The Composite names inside the offloaded regions, in binding order."""
    names = []
    for _, f in partitioned.functions_items():
        if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs:
            for block in f.body.blocks:
                for b in block.bindings:
                    if isinstance(b.value, relax.Function):
                        names.append(str(b.value.attrs["Composite"]))
    return names


@pytest.mark.parametrize("source", ["torch", "onnx", "qdq"])
def test_the_whole_network_is_one_integer_region_and_bit_exact(source, int8_modules):
    mod = int8_modules(source)
    part = npu_backend.partition(mod)
    # nothing left on the host but the call of the one region: 0 integer ops outside the
    # composites, 0 fp32 ops between the input quantize and the output dequantize
    assert npu_backend.host_ops(part) == {"regions": 1}
    names = _composites(part)
    assert names[0] == "autoq_npu.quantize" and names[-1].endswith("dequantize")
    # every layer kind of the network was offloaded as its own canonical shape
    kinds = set(names)
    assert {"autoq_npu.lut", "autoq_npu.multiply", "autoq_npu.avg_pool2d_requantize"} <= kinds
    assert any(n.startswith("autoq_npu.conv2d_bias") for n in kinds)
    assert any(n.startswith("autoq_npu.dense_bias") for n in kinds)
    x = _samples(3, 7)
    ref_ex, npu_ex = tvm.compile(mod, TARGET), npu_backend.build(mod, TARGET)
    for xi in x:
        ref = _run(ref_ex, xi)
        np.testing.assert_array_equal(_run(npu_ex, xi), ref)
        assert np.abs(ref).max() > 0  # a real output, not all zeros


def test_torch_and_onnx_give_the_same_int8_module(int8_modules):
    """The realized int8 modules of the two frontends are one graph, constants included
    (same slot ids, same qparams from the same calibration samples, same int8 weights)."""
    a, b = int8_modules("torch")["main"], int8_modules("onnx")["main"]
    tvm.ir.assert_structural_equal(
        a.without_attr("global_symbol"), b.without_attr("global_symbol"), map_free_vars=True
    )
    # the comparison sees constants: the ORT file's own int8 weights make another module
    qdq = int8_modules("qdq")["main"]
    assert not tvm_ffi.structural_equal(a, qdq, map_free_vars=True)


def test_checks_reject_float_and_leaked_intermediates():
    """A float op in the middle stays on the host; an accumulator that a second consumer
    reads is not fused into a requantize composite (it would leak out of the composite)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 4], "float32"))
    s, z = relax.const(np.float32(0.1)), relax.const(np.int32(0))
    w = relax.const(np.ones((3, 4), np.int8))
    with bb.function("main", [x]):
        with bb.dataflow():
            q = bb.emit(autoq.qnn.quantize(x, s, z))
            f = bb.emit(autoq.qnn.dequantize(q, s, z))
            e = bb.emit(relax.op.exp(f))  # float op: stays on the host
            q2 = bb.emit(autoq.qnn.quantize(e, s, z))
            acc = bb.emit(autoq.qnn.dense(q2, w, s, z, s, z))
            r = bb.emit(autoq.qnn.requantize(acc, relax.const(np.float32(0.01)), z, s, z))
            gv = bb.emit_output(relax.Tuple([r, acc]))  # acc leaks
        bb.emit_func_output(gv)
    part = npu_backend.partition(bb.get())
    host = npu_backend.host_ops(part)
    assert host[("relax.exp", "float32")] == 1
    names = _composites(part)
    assert "autoq_npu.dense_requantize" not in names
    assert "autoq_npu.requantize" in names  # the requantize alone, reading the int32 output


def test_pattern_table_names_and_errors():
    table = autoq.byoc.pattern_table("npu", ["lut", "quantize"])
    assert [t[0] for t in table] == ["npu.lut", "npu.quantize"]  # table order
    assert len(autoq.byoc.pattern_table()) == len(autoq.byoc.SHAPES)
    with pytest.raises(ValueError, match="unknown layer shapes"):
        autoq.byoc.pattern_table("npu", ["conv3d"])
    with pytest.raises(ValueError, match="prefix"):
        autoq.byoc.pattern_table("a.b")


def test_integer_rounding_puts_multiplier_and_shift_on_every_requantize():
    """Config(rounding="half_even"): each qnn.requantize carries the int32 multiplier and
    shift (m * 2**(shift - 31) ~= s_in / s_out) as constant arguments; the module computes
    what the same ops without them compute (the legalization derives them from the scales),
    and the pattern table still partitions the whole network into one region, which the
    example NPU runs bit for bit."""
    from autoq import primitives as P
    from autoq.ir.toolkit import bindings, const_array

    torch, net = torch_cnn()
    mod, params = autoq.from_torch(net, (torch.zeros(SHAPE),))
    config = autoq.Config(recipe="cnn", rounding="half_even")
    real = autoq.quantize(mod, params, _samples(4, 0), config)
    calls = [
        v
        for _, v in bindings(real["main"])
        if getattr(v, "op", None) == tvm.ir.Op.get("qnn.requantize")
    ]
    assert calls and all(len(c.args) == 7 for c in calls)
    for c in calls:
        s_in, s_out = const_array(c.args[1]), const_array(c.args[3])
        m, sh = P.quantize_multiplier(s_in.astype(np.float64) / s_out.astype(np.float64))
        np.testing.assert_array_equal(const_array(c.args[5]), m)
        np.testing.assert_array_equal(const_array(c.args[6]), sh)

    stripped = tvm.IRModule({"main": _strip_multipliers(real["main"])})
    x = _samples(2, 9)
    a_ex, b_ex = tvm.compile(real, TARGET), tvm.compile(stripped, TARGET)
    for xi in x:
        np.testing.assert_array_equal(_run(a_ex, xi), _run(b_ex, xi))
    assert npu_backend.host_ops(npu_backend.partition(real)) == {"regions": 1}
    # the NPU's one kernel computes the same integers (its scalar qparams inlined: the
    # integer elementwise ops derive their multipliers from constant scales)
    npu_ex = npu_backend.build(real, TARGET)
    for xi in x:
        np.testing.assert_array_equal(_run(npu_ex, xi), _run(a_ex, xi))


def _strip_multipliers(func):
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    pattern = is_op("qnn.requantize")(*[wildcard() for _ in range(7)])

    def strip(call, _):
        return tvm.ir.Call(call.op, list(call.args[:5]), call.attrs, list(call.ty_args))

    return rewrite_call(pattern, strip, func)


def test_per_channel_lookup_and_depthwise_input_offload_bit_exact():
    """``Config(rules=("lookup_per_channel", "depthwise_per_channel"))`` (the depthwise_cnn
    recipe's): a stem conv -> hardswish -> depthwise conv -> hardswish -> 1x1 conv chain whose
    hardswish tables are ``[C, 256]`` (``qnn.lut`` with ``axis``) and whose depthwise conv
    reads a per-channel input (scale / zero point of shape ``[C]``). The pattern table still
    offloads the whole network as one integer region, bit for bit equal to TVM's own build."""
    torch = pytest.importorskip("torch", reason="torch is not installed (autoq[torch])")
    from autoq.ir.toolkit import bindings, const_array

    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Hardswish(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardswish(), nn.Conv2d(8, 4, 1),
    ).eval()  # fmt: skip
    mod, params = autoq.from_torch(net, (torch.zeros(SHAPE),))
    config = autoq.Config(recipe="cnn", rules=("lookup_per_channel", "depthwise_per_channel"))
    real = autoq.quantize(mod, params, _samples(8, 0), config)
    calls = [v for _, v in bindings(real["main"]) if isinstance(v, relax.Call)]
    luts = [c for c in calls if c.op == tvm.ir.Op.get("qnn.lut")]
    assert luts and all(c.attrs["axis"] is not None for c in luts)
    depthwise = [
        c for c in calls if c.op == tvm.ir.Op.get("qnn.conv2d") and int(c.attrs.groups) == 8
    ]
    assert len(depthwise) == 1
    assert np.shape(const_array(depthwise[0].args[2])) == (8,)  # per-channel input scale
    part = npu_backend.partition(real)
    assert npu_backend.host_ops(part) == {"regions": 1}
    names = _composites(part)
    assert "autoq_npu.lut" in names and any(n.startswith("autoq_npu.conv2d") for n in names)
    ref_ex, npu_ex = tvm.compile(real, TARGET), npu_backend.build(real, TARGET)
    for xi in _samples(3, 7):
        ref = _run(ref_ex, xi)
        np.testing.assert_array_equal(_run(npu_ex, xi), ref)
        assert np.abs(ref).max() > 0
