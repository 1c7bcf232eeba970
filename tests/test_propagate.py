"""autoq.realization.propagate as a specification: Before / Expected modules, hand-built, compared
with tvm.ir.assert_structural_equal (the way TVM's own tests/python/relax pin passes).

Each case states one rule of the allow-list table (autoq/allow_list.py) or of requantize
merging, and the expected integer graph is written out by hand with the constants a reader
can check: e.g. a clip(-1, 1) quantized with scale 0.5 / zero point 3 becomes
max(min(q, 5), 1), because round(1 / 0.5) + 3 = 5 and round(-1 / 0.5) + 3 = 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import qnn
from autoq.realization import propagate

F32 = "float32"


def c(v, dtype):
    return relax.const(np.asarray(v, dtype), dtype)


def S(v):
    return c(v, "float32")


def Z(v):
    return c(v, "int32")


def module(inputs: dict[str, tuple], body) -> tvm.IRModule:
    """``main(inputs) -> body(bb, *vars)`` built with a dataflow block."""
    bb = relax.BlockBuilder()
    xs = [
        relax.Var(n, relax.TensorType(list(shape), dtype)) for n, (shape, dtype) in inputs.items()
    ]
    with bb.function("main", xs):
        with bb.dataflow():
            out = body(bb, *xs)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def canonical(mod: tvm.IRModule) -> tvm.IRModule:
    """As realize() leaves it: normalized, trivial bindings folded."""
    return relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(mod))


def check(before: tvm.IRModule, expected: tvm.IRModule, rounding: str = "float") -> None:
    after = canonical(propagate(before, rounding))
    tvm.ir.assert_structural_equal(after["main"], canonical(expected)["main"], map_free_vars=True)


X = {"x": ((1, 4), F32)}
Q8 = {"q": ((1, 4), "int8")}


def test_quantize_moves_above_relu_and_relu_becomes_max_with_the_zero_point():
    before = module(
        X, lambda bb, x: qnn.quantize(bb.emit(relax.op.nn.relu(x)), S(0.1), Z(-5), out_dtype="int8")
    )
    expected = module(
        X,
        lambda bb, x: relax.op.maximum(
            bb.emit(qnn.quantize(x, S(0.1), Z(-5), out_dtype="int8")), c(-5, "int8")
        ),
    )
    check(before, expected)


def test_relu_on_a_grid_starting_at_its_zero_point_disappears():
    """zero point = -128 = qmin: every int8 is >= the zero point, relu is the identity."""
    before = module(
        X,
        lambda bb, x: qnn.quantize(bb.emit(relax.op.nn.relu(x)), S(0.1), Z(-128), out_dtype="int8"),
    )
    expected = module(X, lambda bb, x: qnn.quantize(x, S(0.1), Z(-128), out_dtype="int8"))
    check(before, expected)


def test_clip_bounds_are_quantized_on_the_output_grid():
    """clip(-1, 1) with scale 0.5, zp 3: Q(1) = 2 + 3 = 5, Q(-1) = -2 + 3 = 1."""
    before = module(
        X,
        lambda bb, x: qnn.quantize(
            bb.emit(relax.op.clip(x, -1.0, 1.0)), S(0.5), Z(3), out_dtype="int8"
        ),
    )

    def expected_body(bb, x):
        q = bb.emit(qnn.quantize(x, S(0.5), Z(3), out_dtype="int8"))
        return relax.op.maximum(relax.op.minimum(q, c(5, "int8")), c(1, "int8"))

    check(before, module(X, expected_body))


def test_dequantize_moves_below_data_movement():
    before = module(
        Q8,
        lambda bb, q: relax.op.reshape(bb.emit(qnn.dequantize(q, S(0.25), Z(1))), [2, 2]),
    )
    expected = module(
        Q8, lambda bb, q: qnn.dequantize(bb.emit(relax.op.reshape(q, [2, 2])), S(0.25), Z(1))
    )
    check(before, expected)


def test_dequantize_does_not_move_below_clip():
    """clip's bounds need the output grid: a dequantize above it stays where it is."""
    before = module(
        Q8, lambda bb, q: relax.op.clip(bb.emit(qnn.dequantize(q, S(0.25), Z(1))), 0.0, 1.0)
    )
    check(before, before)


def test_dequantize_then_quantize_merge_into_requantize():
    before = module(
        Q8,
        lambda bb, q: qnn.quantize(
            bb.emit(qnn.dequantize(q, S(0.25), Z(1))), S(0.5), Z(-2), out_dtype="int8"
        ),
    )
    expected = module(
        Q8,
        lambda bb, q: qnn.requantize(
            q, S(0.25), Z(1), S(0.5), Z(-2), out_dtype="int8", rounding="half_even"
        ),
    )
    check(before, expected, rounding="half_even")


def test_equal_qparams_drop_the_pair():
    before = module(
        Q8,
        lambda bb, q: relax.op.add(
            bb.emit(qnn.quantize(bb.emit(qnn.dequantize(q, S(0.25), Z(1))), S(0.25), Z(1), "int8")),
            q,
        ),
    )
    expected = module(Q8, lambda bb, q: relax.op.add(q, q))
    check(before, expected)


def test_requantize_through_max_pool_chain():
    """dequantize -> max_pool2d -> quantize with other qparams: the quantize moves up first
    (through the pool), meets the dequantize and becomes one requantize; the pool runs on
    the requantized int8 (exact: a requantize is monotone, max commutes with it)."""
    inp = {"q": ((1, 1, 4, 4), "int8")}
    before = module(
        inp,
        lambda bb, q: qnn.quantize(
            bb.emit(relax.op.nn.max_pool2d(bb.emit(qnn.dequantize(q, S(0.25), Z(0))), 2, 2)),
            S(0.5),
            Z(0),
            out_dtype="int8",
        ),
    )
    expected = module(
        inp,
        lambda bb, q: relax.op.nn.max_pool2d(
            bb.emit(qnn.requantize(q, S(0.25), Z(0), S(0.5), Z(0), out_dtype="int8")), 2, 2
        ),
    )
    check(before, expected)


def test_concat_quantizes_each_input_with_the_output_qparams():
    inp = {"a": ((1, 2), F32), "b": ((1, 3), F32)}
    before = module(
        inp,
        lambda bb, a, b: qnn.quantize(
            bb.emit(relax.op.concat([a, b], axis=1)), S(0.1), Z(0), out_dtype="int8"
        ),
    )

    def expected_body(bb, a, b):
        qa = bb.emit(qnn.quantize(a, S(0.1), Z(0), out_dtype="int8"))
        qb = bb.emit(qnn.quantize(b, S(0.1), Z(0), out_dtype="int8"))
        return relax.op.concat([qa, qb], axis=1)

    check(before, module(inp, expected_body))


def test_split_quantizes_its_input_once():
    inp = {"x": ((1, 4), F32)}
    before = module(
        inp,
        lambda bb, x: qnn.quantize(
            bb.emit(relax.TupleGetItem(bb.emit(relax.op.split(x, 2, axis=1)), 1)),
            S(0.1),
            Z(0),
            out_dtype="int8",
        ),
    )

    def expected_body(bb, x):
        q = bb.emit(qnn.quantize(x, S(0.1), Z(0), out_dtype="int8"))
        return relax.TupleGetItem(bb.emit(relax.op.split(q, 2, axis=1)), 1)

    check(before, module(inp, expected_body))


@pytest.mark.parametrize("pad_value, int_value", [(0.0, 7.0), (1.0, 17.0)])
def test_pad_value_is_quantized(pad_value, int_value):
    """pad 0 -> the zero point 7; pad 1.0 with scale 0.1 -> round(10) + 7 = 17."""
    before = module(
        X,
        lambda bb, x: qnn.quantize(
            bb.emit(relax.op.nn.pad(x, [0, 0, 1, 1], "constant", pad_value)),
            S(0.1),
            Z(7),
            out_dtype="int8",
        ),
    )

    def expected_body(bb, x):
        q = bb.emit(qnn.quantize(x, S(0.1), Z(7), out_dtype="int8"))
        return relax.op.nn.pad(q, [0, 0, 1, 1], "constant", int_value)

    check(before, module(X, expected_body))


def test_per_channel_dequantize_moves_below_relu_only_with_one_zero_point():
    inp = {"q": ((1, 2, 2, 2), "int8")}

    def before_body(zp):
        return lambda bb, q: relax.op.nn.relu(
            bb.emit(qnn.dequantize(q, S([0.1, 0.2]), Z(zp), axis=1))
        )

    uniform = module(inp, before_body([3, 3]))
    expected = module(
        inp,
        lambda bb, q: qnn.dequantize(
            bb.emit(relax.op.maximum(q, c(3, "int8"))), S([0.1, 0.2]), Z([3, 3]), axis=1
        ),
    )
    check(uniform, expected)
    mixed = module(inp, before_body([3, 4]))
    check(mixed, mixed)


def test_per_channel_quantize_drops_a_clip_that_covers_every_channel_grid():
    """clip(0, 6) (a ReLU6) under a per-channel quantize on axis 1, zero points -128: on
    channel 0 (scale 0.02) Q(0) = -128 = qmin and Q(6) = round(6 / 0.02) - 128 = 172 -> 127 =
    qmax; on channel 1 (scale 6 / 255) Q(6) = 255 - 128 = 127. The clip is the identity on
    every int8 of both grids, so the quantize reads its input and the clip disappears."""
    inp = {"x": ((1, 2, 2, 2), F32)}
    scales = [0.02, 6 / 255]
    before = module(
        inp,
        lambda bb, x: qnn.quantize(
            bb.emit(relax.op.clip(x, 0.0, 6.0)), S(scales), Z([-128, -128]), 1, "int8"
        ),
    )
    expected = module(inp, lambda bb, x: qnn.quantize(x, S(scales), Z([-128, -128]), 1, "int8"))
    check(before, expected)


def test_per_channel_quantize_stays_below_a_clip_one_channel_needs():
    """As above with channel 1 on scale 0.05: Q(6) = 120 - 128 = -8 < 127, so its codes
    above -8 are cut by the clip; per-channel integer bounds are not emitted, so the clip
    stays in float and the quantize under it."""
    inp = {"x": ((1, 2, 2, 2), F32)}
    before = module(
        inp,
        lambda bb, x: qnn.quantize(
            bb.emit(relax.op.clip(x, 0.0, 6.0)), S([0.02, 0.05]), Z([-128, -128]), 1, "int8"
        ),
    )
    check(before, before)
