"""autoq.cpu: ``qnn.dense`` with a run-time activation zero point (the dynamic layers of
``qnn.dynamic_quantize``, per token or per tensor) runs on the packed kernels (AMX, VNNI,
AVX2) instead of the generic matmul: the int32 accumulator against numpy int64 and the
generic lowering, bit for bit, on odd shapes and on shapes that fill the blocks; the
realized dynamic layer's float32 output against a numpy reference of the per-token
quantization and of the kernel pipeline's fused multiply-add tail."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, qnn
from autoq.cpu import amx
from autoq.cpu import dynamic_quantize as dq_kernel
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import const_array, is_call
from autoq.qnn.runtime_qparams import dynamic_quantize
from models import Builder

HOST = tvm.target.codegen.llvm_get_system_cpu()
_TEXT = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
FLAGS = amx.cpu_flags(_TEXT)
HAS_AMX = {"amx_tile", "amx_int8"} <= FLAGS and amx.request_amx() is None
TARGETS = [
    pytest.param(
        {"mcpu": HOST, "mattr": ["+amx-tile", "+amx-int8"]},
        "amx",
        marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX int8 tiles (or Linux refuses them)"),
        id="amx",
    ),
    pytest.param(
        {"mcpu": HOST},
        "vnni",
        marks=pytest.mark.skipif("avx512_vnni" not in FLAGS, reason="this CPU has no VNNI"),
        id="vnni",
    ),
    pytest.param(
        {"mcpu": "haswell"},
        "avx2",
        marks=pytest.mark.skipif("avx2" not in FLAGS, reason="this CPU has no AVX2"),
        id="avx2",
    ),
]
# (rows, K, N): odd sizes below / between the register tiles and AMX's 32 x 32 blocks and
# 64-deep K steps, and sizes that fill them
SHAPES = [(13, 37, 29), (1, 20, 17), (64, 128, 96)]


def _target(attrs: dict) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", **attrs})


def _accumulator_module(w: np.ndarray, m: int, spec: dict):
    """main(x [1, m, K] float32) = the int32 ``qnn.dense`` of ``qnn.dynamic_quantize(x)``
    (its run-time scale and zero point) with the constant int8 weight ``w`` [N, K]."""
    x = relax.Var("x", relax.TensorType((1, m, w.shape[1]), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            dq = bb.emit(qnn.dynamic_quantize(x, **spec))
            q, s, z = (bb.emit(relax.TupleGetItem(dq, i)) for i in range(3))
            sw = relax.const(np.full(w.shape[0], 0.01, np.float32))
            zw = relax.const(np.zeros(w.shape[0], np.int32))
            out = bb.emit_output(qnn.dense(q, relax.const(w), s, z, sw, zw))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def _run(mod, target, x, cpu_kernels=True) -> np.ndarray:
    vm = relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=cpu_kernels), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _kernels(mod, target) -> list[str]:
    lowered = lower_to_cpu_kernels(mod, target)
    return sorted(gv.name_hint for gv in lowered.functions if gv.name_hint.startswith("autoq_"))


# (rows, K, N) and the qnn.dynamic_quantize attributes
CASES = [
    (SHAPES[0], {"granularity": "token"}),
    (SHAPES[1], {"granularity": "tensor"}),
    (SHAPES[2], {"granularity": "token", "out_dtype": "uint8"}),
    (SHAPES[0], {"granularity": "token", "symmetric": True, "narrow_range": True}),
]


@pytest.mark.parametrize(("shape", "spec"), CASES, ids=lambda v: "-".join(map(str, v.values()))
                         if isinstance(v, dict) else "x".join(map(str, v)))  # fmt: skip
@pytest.mark.parametrize(("attrs", "kind"), TARGETS)
def test_accumulator_bit_exact(attrs, kind, shape, spec):
    m, k, n = shape
    rng = np.random.default_rng(m * k + n)
    w = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    x = (rng.normal(size=(1, m, k)) * rng.uniform(0.1, 3.0, size=(1, m, 1))).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row: scale 1
    mod, target = _accumulator_module(w, m, spec), _target(attrs)
    amx_rows = kind == "amx" and m >= 8  # fewer rows stay on VNNI (AMX_MIN_ROWS)
    want = f"autoq_dense_{'amx' if amx_rows else 'vnni' if kind == 'amx' else kind}"
    assert want in _kernels(mod, target)
    dt = spec.get("out_dtype", "int8")
    q, _s, z = dynamic_quantize(x, spec["granularity"], dt, **_range(spec))
    ref = (q.astype(np.int64) - z) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_run(mod, target, x), ref)


def _range(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k in ("symmetric", "narrow_range")}


def _one_dense(m: int, k: int, n: int, seed: int = 0):
    """x [1, m, k] @ W.T + bias (a transformer projection as exported)."""
    b = Builder(seed)
    x = b.input("x", (1, m, k))

    def body(b):
        w = b.randw("fc.weight", (n, k))
        h = b.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(h, b.weight("fc.bias", b.rng.normal(size=n) * 0.1)))

    return b.build(body)


def _dense_constants(qmod):
    """(int8 weight, weight scales, float bias) of the realized module's one dense layer."""
    values = [b.value for blk in qmod["main"].body.blocks for b in blk.bindings]
    dense = next(v for v in values if is_call(v, "qnn.dense"))
    bias = next(const_array(v.args[1]) for v in values if is_call(v, "relax.add"))
    return const_array(dense.args[1]), const_array(dense.args[4]), bias


@pytest.mark.parametrize(("attrs", "kind"), TARGETS)
def test_realized_dynamic_layer(attrs, kind):
    """The whole dynamic layer (``recipe="dynamic"``: per-token int8) on the kernels: each
    output is numpy's ``float32(acc) * (s_x * s_w) + bias`` rounded once (the kernel
    pipeline's fused elementwise tail contracts the multiply-add, with or without this
    lowering) or twice (where LLVM keeps them apart), as the generic lowering does."""
    m, k, n = SHAPES[0]
    mod, params = _one_dense(m, k, n)
    qmod = autoq.quantize(mod, params, None, Config(recipe="dynamic"))
    target = _target(attrs)
    assert any(name.startswith("autoq_dense_") for name in _kernels(qmod, target))
    wq, sw, bias = _dense_constants(qmod)
    rng = np.random.default_rng(7)
    for _ in range(2):
        x = rng.normal(size=(1, m, k)).astype(np.float32)
        q, s, z = dynamic_quantize(x, "token")
        acc = ((q.astype(np.int64) - z) @ wq.astype(np.int64).T).astype(np.float32)
        scale = (s * sw).astype(np.float32)
        twice = (acc * scale + bias).astype(np.float32)
        once = (acc.astype(np.float64) * scale + bias).astype(np.float32)  # exact product
        got = _run(qmod, target, x)
        np.testing.assert_array_equal(_run(qmod, target, x, cpu_kernels=False), twice)
        assert np.all((got == once) | (got == twice))
        assert np.any(once != twice)  # the inputs tell the two roundings apart


def _quantize_module(shape, spec: dict):
    """main(x float32 of ``shape``) = the tuple (q, scale, zero_point) of
    ``qnn.dynamic_quantize`` per token."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(qnn.dynamic_quantize(x, "token", **spec))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


QUANTIZE_CASES = [
    ((3, 20), {}),  # K: one 16-lane block and a tail
    ((2, 5, 7), {"out_dtype": "uint8"}),  # K below the lanes
    ((1, 9, 48), {"symmetric": True, "narrow_range": True}),
    ((4, 33), {"reduce_range": True}),
]


@pytest.mark.parametrize(("shape", "spec"), QUANTIZE_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("mcpu", [HOST, "haswell"])
def test_dynamic_quantize_kernel_bit_exact(mcpu, shape, spec):
    """The row-parallel per-token quantize kernel against numpy's dynamic_quantize and the
    generic lowering: q, scale and zero point bit for bit (rows of mixed signs, a positive
    row, an all-zero row)."""
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = (rng.normal(size=shape) * rng.uniform(0.01, 5.0, size=(*shape[:-1], 1))).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0] = 0.0
    flat[-1] = np.abs(flat[-1]) + 0.5
    mod, target = _quantize_module(shape, spec), _target({"mcpu": mcpu})
    assert "autoq_dynamic_quantize" in _kernels(mod, target)
    dt = spec.get("out_dtype", "int8")
    options = {k: v for k, v in spec.items() if k != "out_dtype"}
    ref = dynamic_quantize(x, "token", dt, **options)
    outs = []
    for use in (True, False):
        vm = relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=use), tvm.cpu())
        outs.append([t.numpy() for t in vm["main"](tvm.runtime.tensor(x))])
    for got, generic, want in zip(*outs, ref, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(generic, want)


def test_doctests():
    assert doctest.testmod(dq_kernel).failed == 0


def _midpoint_rows(rng, rows: int, k: int) -> np.ndarray:
    """float32 rows whose values sit on or next to ``(n + 1/2) * s`` (``s``: the row's own
    run-time scale, ``(max - min) / 255``): the quotients whose rounding to a code turns on
    the last bit of ``x / s``."""
    x = np.empty((rows, k), np.float32)
    for i in range(rows):
        lo, hi = np.float32(-rng.uniform(0.3, 4.0)), np.float32(rng.uniform(0.3, 4.0))
        s = np.float32(hi - lo) / np.float32(255)
        n = rng.integers(int(lo / s) + 1, int(hi / s) - 1, size=k - 2)
        mid = ((n + 0.5) * np.float64(s)).astype(np.float32)
        side = rng.integers(-1, 2, size=k - 2).astype(np.float32)
        x[i] = np.concatenate([[lo, hi], np.where(side == 0, mid, np.nextafter(mid, mid + side))])
    return x


def test_reciprocal_quantize_on_midpoints():
    """On the targets that divide by a reciprocal (AMX), the per-token quantize's ``x / s``
    is ``x * RN(1/s)`` plus two FMA corrections: codes, scales and zero points equal numpy's
    division on quotients next to a half-integer (where the product alone gives other
    codes: checked below, so the case tells them apart), on a row of values above 2**67
    (a scale beyond ``RECIPROCAL_SCALE_RANGE``: it divides) and on an all-zero row."""
    from autoq.cpu.isa import kernel_isa
    from autoq.primitives import divide_by_reciprocal

    target = _target({"mcpu": HOST, "mattr": ["+amx-tile", "+amx-int8"]})
    assert kernel_isa(target).reciprocal
    x = _midpoint_rows(np.random.default_rng(3), 64, 200)
    x[1] = x[1] * np.float32(2.0**70)
    x[2] = 0.0
    q, s, z = dynamic_quantize(x, "token")
    r = np.float32(1) / s
    product = np.clip(np.round(divide_by_reciprocal(x, s, r, 0)) + z, -128, 127)
    assert np.any(product != q)
    mod = _quantize_module(x.shape, {})
    assert "autoq_dynamic_quantize" in _kernels(mod, target)
    vm = relax.VirtualMachine(autoq.compile(mod, target), tvm.cpu())
    got = [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]
    for g, want in zip(got, (q, s, z), strict=True):
        np.testing.assert_array_equal(g, want)
