"""autoq.cpu.tensor_intrinsics: the cheap stack TVMScript's prim_func reads while TVM's tensor
intrinsics are imported gives the same frames as inspect.stack where TVMScript looks, the
same parsed functions (closure variables hidden by PEP 563, prim_funcs inside an
``@I.ir_module`` class), and the import registers TVM's stock intrinsics."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from autoq.cpu.tensor_intrinsics import CONTEXT_FRAMES, cheap_stack, cheap_tvmscript_stack


def _nested(depth: int):
    """Both stacks taken from the same frame, ``depth`` calls below the test."""
    if depth:
        return _nested(depth - 1)
    return inspect.stack(), cheap_stack()


def test_cheap_stack_matches_inspect_where_tvmscript_reads():
    ref, got = _nested(4)
    assert len(got) == len(ref) > CONTEXT_FRAMES + 4
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert g.frame is r.frame, i
        assert (g.filename, g.lineno, g.function) == (r.filename, r.lineno, r.function), i
        if i < CONTEXT_FRAMES:  # files of this test and autoq: context as inspect gives it
            assert (g.code_context, g.index) == (r.code_context, r.index), i
            assert g.code_context is not None
        else:
            assert (g.code_context, g.index) == (None, None), i


def test_frames_without_a_file_carry_no_context():
    """A frame of code compiled from a string (no file on disk, like the frozen import
    machinery's frames): inspect finds no source either."""
    scope: dict = {"cheap_stack": cheap_stack, "inspect": inspect}
    exec(
        compile("def f():\n    return inspect.stack(), cheap_stack()\n", "<no file>", "exec"), scope
    )
    ref, got = scope["f"]()
    assert got[0].filename == ref[0].filename == "<no file>"
    assert got[0].code_context is None and ref[0].code_context is None
    assert got[0].lineno == ref[0].lineno == 2


def _closure_func(n: int):
    """A prim_func whose buffer shape comes from the enclosing scope: with PEP 563 the
    name lives only in an annotation, found through the outer stack's frames."""
    m = n + 1

    @T.prim_func(s_tir=True)
    def add_one(A: T.Buffer((m,), "int32"), B: T.Buffer((m,), "int32")):
        for i in range(m):
            with T.sblock("B"):
                vi = T.axis.spatial(m, i)
                B[vi] = A[vi] + 1

    return add_one


def _class_module():
    @I.ir_module
    class Mod:
        @T.prim_func(s_tir=True)
        def main(A: T.Buffer((4,), "int8"), B: T.Buffer((4,), "int8")):
            for i in range(4):
                with T.sblock("B"):
                    vi = T.axis.spatial(4, i)
                    B[vi] = A[vi]

    return Mod


@pytest.mark.parametrize("build", [lambda: _closure_func(7), _class_module])
def test_tvmscript_parses_the_same_with_the_cheap_stack(build):
    from tvm.tirx.script.parser import entry

    ref = build()
    with cheap_tvmscript_stack():
        got = build()
    assert entry.inspect is inspect  # restored
    tvm.ir.assert_structural_equal(got, ref)


def test_stack_restored_after_an_error():
    from tvm.tirx.script.parser import entry

    with pytest.raises(ZeroDivisionError), cheap_tvmscript_stack():
        assert entry.inspect is not inspect
        _ = 1 / 0
    assert entry.inspect is inspect


def test_import_registers_the_stock_intrinsics():
    """In a fresh process: the stock x86/ARM/CUDA intrinsics are registered and equal
    to the ones TVMScript parses with the real inspect.stack (re-parsed here)."""
    code = textwrap.dedent(
        """
        import inspect, sys
        from autoq.cpu.tensor_intrinsics import import_tensor_intrinsics
        import_tensor_intrinsics()
        import_tensor_intrinsics()  # idempotent
        import tvm
        from tvm.s_tir import TensorIntrin
        from tvm.s_tir.tensor_intrin import arm_cpu, cuda, x86
        from tvm.tirx.script.parser import entry
        assert entry.inspect is inspect
        for name in (x86.VNNI_DOT_16x4_INTRIN, arm_cpu.ARM_DOT_4x4_i8_NEON_INTRIN,
                     cuda.WMMA_SYNC_16x16x16_f16f16f32_INTRIN):
            assert TensorIntrin.get(name) is not None, name
        # the x86 module parsed again with the real inspect.stack: same functions
        import importlib.util
        spec = importlib.util.spec_from_file_location("x86_again", x86.__file__,
            submodule_search_locations=None)
        again = importlib.util.module_from_spec(spec)
        again.__package__ = "tvm.s_tir.tensor_intrin"
        TensorIntrin.register = lambda *a, **k: None  # parse only
        spec.loader.exec_module(again)
        for name in ("dot_product_16x4_u8i8i32_desc", "dot_product_16x4_u8i8i32_vnni"):
            tvm.ir.assert_structural_equal(getattr(again, name), getattr(x86, name))
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_autoq_dot_intrinsics_parsed_at_first_use_as_with_inspect_stack():
    """In a fresh process: importing the lowering parses none of autoq's dot intrinsics;
    registering parses them (cheap stack) into the functions the real inspect.stack gives."""
    code = textwrap.dedent(
        """
        import inspect
        import autoq.build, autoq.cpu.lowering
        from tvm.s_tir import TensorIntrin
        from tvm.tirx.script.parser import entry
        import tvm
        from autoq.cpu import intrinsics
        assert intrinsics.dot_functions.cache_info().currsize == 0
        for name in (intrinsics.VNNI_DOT, intrinsics.AVX2_DOT):
            try:
                TensorIntrin.get(name)
            except Exception:
                pass
            else:
                raise AssertionError(name + " registered at import")
        intrinsics.register_intrinsics()
        intrinsics.register_intrinsics()  # idempotent
        assert entry.inspect is inspect
        # parsed again with the real inspect.stack (the cheap stack swapped for a no-op)
        import contextlib
        intrinsics.cheap_tvmscript_stack = contextlib.nullcontext
        ref = intrinsics.dot_functions.__wrapped__()
        assert sorted(ref) == sorted([intrinsics.VNNI_DOT, intrinsics.AVX2_DOT])
        for name, (desc, impl) in ref.items():
            got = TensorIntrin.get(name)
            tvm.ir.assert_structural_equal(got.desc, desc)
            tvm.ir.assert_structural_equal(got.impl, impl)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
