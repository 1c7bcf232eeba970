"""autoq.ir.float_ops: the float rewrites as one table, used by calibration, the build and
tuning alike (tuning's task list names the kernels the build compiles)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

import autoq
from autoq.build.tuning_database import open_database, tuned_kernels
from autoq.ir.fast_gelu import reference_gelu
from autoq.ir.float_ops import FLOAT_REWRITES, rewrite_float_ops
from autoq.ir.toolkit import bindings, is_call


def _gelu_module():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 300), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.nn.gelu(relax.op.add(x, x))))
        bb.emit_func_output(y)
    return bb.get()


def _ops(mod) -> set[str]:
    return {
        v.op.name
        for _, f in mod.functions_items()
        if isinstance(f, relax.Function)
        for _, v in bindings(f)
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)
    }


def test_every_row_removes_its_op_and_the_rest_stays():
    mod = _gelu_module()
    ops = [op for op, _ in FLOAT_REWRITES]
    assert "relax.nn.gelu" in ops and "relax.nn.gelu" in _ops(mod)
    after = rewrite_float_ops(mod)
    assert not set(ops) & _ops(after)
    assert "relax.add" in _ops(after)  # ops no row names are kept
    assert any(is_call(v, "relax.call_tir") for _, v in bindings(after["main"]))


def test_tuning_lists_the_kernels_the_build_compiles(tmp_path):
    """Before the table, tuning lowered GELU with libm's erff while the build used the fast
    kernel: the task list named a kernel the library never had."""
    mod = _gelu_module()
    target = autoq.default_target()
    open_database(tmp_path)  # an empty database: nothing tuned yet
    _, kernels = tuned_kernels(mod, target, tmp_path, cpu_kernels=False)
    assert kernels and all("gelu" not in k or "fast_gelu" in k for k in kernels), kernels
    assert any("fast_gelu" in k for k in kernels), kernels
    lib = autoq.compile(mod, target, cpu_kernels=False)
    x = np.linspace(-4, 4, 1200, dtype="float32").reshape(4, 300)
    got = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, reference_gelu(2 * x.astype(np.float64)), atol=2e-6)
