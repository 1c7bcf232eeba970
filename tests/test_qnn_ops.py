"""The ``qnn.*`` ops, compiled with TVM and run on the CPU, against numpy bit for bit.

Every op is built with its builder function into a small Relax function, compiled for
``llvm`` and run in the Relax VM. The references are :mod:`autoq.primitives` (quantize,
dequantize, requantize, elementwise) and plain numpy int64 convolution / matmul written
here. Quantization parameters are passed both as ``relax.const`` constants and as runtime
inputs (calibration graphs feed them at run time); one module computes several outputs so
that the number of compilations stays small.

The last section checks the error paths of type inference and legalization: each raises
``autoq.qnn.QnnError`` naming the op, the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import primitives as P
from autoq import qnn
from autoq.qnn import QnnError
from autoq.qnn import tflite_arith as TA
from models import build_tuple_module as build_module
from models import run_tuple

TARGET = tvm.target.Target({"kind": "llvm"})
INT_MODES = ("half_even", "half_away", "half_up", "tflite", "tflite_single")


# --------------------------------------------------------------------------- helpers


def f32(v) -> relax.Expr:
    return relax.const(np.asarray(v, np.float32))


def i32(v) -> relax.Expr:
    return relax.const(np.asarray(v, np.int32))


def run(inputs: dict[str, np.ndarray], body: Callable[..., Sequence]) -> list[np.ndarray]:
    """Compile ``body`` for llvm, run it on ``inputs`` and return every output as numpy."""
    return run_tuple(inputs, body, TARGET)


def assert_bit_exact(got: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    """Same dtype, same shape and the same bytes (float results compared bit for bit)."""
    ref = np.asarray(ref)
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    if got.tobytes() != ref.tobytes():
        bad = (
            np.argwhere(got != ref)
            if got.dtype.kind != "f"
            else np.argwhere(got.view(f"u{got.itemsize}") != ref.view(f"u{ref.itemsize}"))
        )
        i = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {got.size} elements differ, first at {i}: "
            f"got {got[i]!r}, expected {ref[i]!r}"
        )


def int_data(rng, dtype: str, shape, extremes: bool = True) -> np.ndarray:
    """Random integers of ``dtype`` that always include the dtype's min and max."""
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    a = rng.integers(lo, hi, size=shape, endpoint=True, dtype=np.int64)
    if extremes:
        flat = a.reshape(-1)
        flat[0], flat[-1] = lo, hi
    return a.astype(dtype)


def conv2d_ref(x, w, strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1):
    """Exact int64 NCHW x OIHW conv2d (padding with 0, i.e. already zero-point-free data)."""
    x = np.pad(
        x.astype(np.int64), ((0, 0), (0, 0), (padding[0], padding[2]), (padding[1], padding[3]))
    )
    w = w.astype(np.int64)
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    oh = (h - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((n, o, oh, ow), np.int64)
    og = o // groups
    for oc in range(o):
        g = oc // og
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilation[0], j * dilation[1]
                patch = x[
                    :,
                    g * cg : (g + 1) * cg,
                    r0 : r0 + strides[0] * (oh - 1) + 1 : strides[0],
                    c0 : c0 + strides[1] * (ow - 1) + 1 : strides[1],
                ]
                out[:, oc] += np.einsum("nchw,c->nhw", patch, w[oc, :, i, j])
    return out


# ------------------------------------------------------- quantize / dequantize


# Zero points per dtype: a negative one for the signed types, off-center for unsigned.
QDT_ZP = {"int8": -3, "uint8": 130, "int16": -1000, "uint16": 40000}


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
def test_quantize_dequantize(dtype):
    rng = np.random.default_rng(1)
    qmin, qmax = P.qrange(dtype)
    zp = QDT_ZP[dtype]
    s = np.float32(0.5)
    # x / 0.5 = k / 2: every other value an exact tie (round half to even decides), plus
    # random values, values that saturate at both ends and signed zeros.
    ties = np.arange(-40, 40, dtype=np.float32) * np.float32(0.25)
    span = float(qmax - qmin) * 0.5
    rand = rng.uniform(-span, span, size=104).astype(np.float32)
    special = np.array([1e9, -1e9, 3e38, -3e38, 0.0, -0.0, 1e-30, -1e-30], np.float32)
    x = np.concatenate([ties, rand, special]).reshape(2, 3, 32)
    # per-axis on axis 1 (3 channels) and on the last axis (32 channels)
    sv = np.array([0.5, 0.3, 7.0], np.float32)
    zv = np.array([zp, qmin, qmax], np.int32)
    s_last = rng.uniform(0.05, 4.0, size=32).astype(np.float32)
    z_last = rng.integers(qmin, qmax, size=32, endpoint=True).astype(np.int32)
    q = int_data(rng, dtype, (2, 3, 32))

    def body(x, q, s_rt, z_rt, sv_rt, zv_rt):
        return [
            qnn.quantize(x, f32(s), i32(zp), out_dtype=dtype),
            qnn.quantize(x, s_rt, z_rt, out_dtype=dtype),
            qnn.quantize(x, f32(sv), i32(zv), axis=1, out_dtype=dtype),
            qnn.quantize(x, sv_rt, zv_rt, axis=1, out_dtype=dtype),
            qnn.quantize(x, f32(s_last), i32(z_last), axis=-1, out_dtype=dtype),
            qnn.dequantize(q, f32(s), i32(zp)),
            qnn.dequantize(q, s_rt, z_rt),
            qnn.dequantize(q, f32(sv), i32(zv), axis=1),
            qnn.dequantize(q, sv_rt, zv_rt, axis=1),
            qnn.dequantize(q, f32(s_last), i32(z_last), axis=2),
        ]

    inputs = {
        "x": x,
        "q": q,
        "s": np.array(s),
        "z": np.array(zp, np.int32),
        "sv": sv,
        "zv": zv,
    }
    got = run(inputs, body)
    refs = [
        P.quantize(x, s, zp, dtype),
        P.quantize(x, s, zp, dtype),
        P.quantize(x, sv, zv, dtype, axis=1),
        P.quantize(x, sv, zv, dtype, axis=1),
        P.quantize(x, s_last, z_last, dtype, axis=-1),
        P.dequantize(q, s, zp),
        P.dequantize(q, s, zp),
        P.dequantize(q, sv, zv, axis=1),
        P.dequantize(q, sv, zv, axis=1),
        P.dequantize(q, s_last, z_last, axis=2),
    ]
    names = ["q_const", "q_rt", "q_axis_const", "q_axis_rt", "q_last", "dq_const", "dq_rt"]
    names += ["dq_axis_const", "dq_axis_rt", "dq_last"]
    for g, r, n in zip(got, refs, names, strict=True):
        assert_bit_exact(g, r, n)
    # the reference itself saturates and rounds ties to even (a check that the data is
    # what the comments say): 0.25 / 0.5 = 0.5 -> 0, 0.75 / 0.5 = 1.5 -> 2
    qt = refs[0].reshape(-1)
    assert qt[40 + 1] - zp == 0 and qt[40 + 3] - zp == 2
    assert qt[184] == qmax and qt[185] == qmin


def test_quantize_divides_instead_of_multiplying_by_the_reciprocal():
    # x / s and x * (1 / s) round differently for these x (pytorch/ao#229): the op must
    # divide, as ONNX QuantizeLinear and primitives.quantize do.
    s = np.float32(0.1)
    recip = np.float32(1) / s
    cands = []
    for k in range(-1000, 1000):
        x = np.float32((k + 0.5) * float(s))
        for _ in range(4):
            for y in (x, -x):
                if np.rint(y / s) != np.rint(y * recip):
                    cands.append(y)
            x = np.nextafter(x, np.float32(np.inf))
    x = np.array(sorted(set(cands)), np.float32)
    assert len(x) >= 20, "the search for distinguishing inputs found too few"
    got = run(
        {"x": x, "s": np.array(s)},
        lambda x, s_rt: [
            qnn.quantize(x, f32(s), i32(0), out_dtype="int16"),
            qnn.quantize(x, s_rt, i32(0), out_dtype="int16"),
        ],
    )
    ref = P.quantize(x, s, 0, "int16")
    assert not np.array_equal(ref, np.rint(x * recip).astype(np.int16))
    assert_bit_exact(got[0], ref, "const scale")
    assert_bit_exact(got[1], ref, "runtime scale")


def test_quantize_scalar_data():
    # 0-d data with the default axis -1 and per-tensor parameters
    got = run(
        {"x": np.array(1.25, np.float32)},
        lambda x: [
            qnn.quantize(x, f32(0.5), i32(1)),
            qnn.dequantize(qnn.quantize(x, f32(0.5), i32(1)), f32(0.5), i32(1)),
        ],
    )
    assert_bit_exact(got[0], np.array(3, np.int8))  # 2.5 -> 2 (ties to even) + 1
    assert_bit_exact(got[1], np.array(1.0, np.float32))


def test_dequantize_int32_accumulator():
    # int32 data (an accumulator) with per-channel scales; the subtraction of the zero
    # point must not wrap in int32 (2**31 - 1 - (-5) is outside int32), and int32 values
    # beyond 2**24 round when converted to float32 (16777217 -> 16777216).
    q = np.array([[2**31 - 1, -(2**31), 16777217, -16777217, 0, 1]] * 2, np.int32)  # shape [2, 6]
    sv = np.array([1e-6, 0.25], np.float32)
    got = run(
        {"q": q, "z": np.array(-5, np.int32)},
        lambda q, z_rt: [
            qnn.dequantize(q, f32(sv), i32(0), axis=0),
            qnn.dequantize(q, f32(0.5), z_rt),
            qnn.dequantize(q, f32(0.5), i32(-5)),
        ],
    )
    assert_bit_exact(got[0], P.dequantize(q, sv, 0, axis=0), "per-channel")
    assert_bit_exact(got[1], P.dequantize(q, 0.5, -5), "runtime zero point")
    assert_bit_exact(got[2], P.dequantize(q, 0.5, -5), "const zero point")
    assert got[2][0, 0] == np.float32(2**31 + 4) * np.float32(0.5)  # not a wrapped negative


# ------------------------------------------------------------------ requantize

# Per-axis input scales (4 channels of axis 1) against the output scale 3 * 2**-8:
#   channel 0: ratio exactly 0.25 (exact ties at q = 2 mod 4; the TFLite right shift is 1,
#              so its negative ties go away from zero);
#   channel 1: ratio exactly 0.5 (ties at odd q; TFLite's right shift is 0 and its
#              doubling high multiply sends negative ties toward zero);
#   channel 2: ratio 3.0 (> 1: left shift, no rounding);
#   channel 3: ratio ~1e-11 (the multiplier underflows to 0: everything maps to the zp).
S_OUT = np.float32(3 * 2.0**-8)
S_IN_AXIS = np.array([3 * 2.0**-10, 3 * 2.0**-9, 9 * 2.0**-8, 3e-11 * 2.0**-8], np.float32)
# Per-tensor: the exact-tie ratio 0.25 and an arbitrary one.
S_IN_TENSOR = {"tie": np.float32(3 * 2.0**-10), "arbitrary": np.float32(0.0123457)}

# Per-axis "tflite" kernels take ~3 s to compile (every other mode 0.1-0.3 s), so the
# per-axis tflite path runs in two of the cases (and in test_conv2d) only.
ALL_MODES = ("float", *INT_MODES)
AXIS_NO_TFLITE = ("float", "half_even", "half_away", "half_up", "tflite_single")
REQUANT_CASES = [
    # (input dtype, input zero point, output dtype, output zero point, per-axis modes)
    ("int32", 0, "int8", -7, ALL_MODES),
    ("int32", 0, "uint8", 128, AXIS_NO_TFLITE),
    ("int32", 0, "int32", 0, AXIS_NO_TFLITE),
    ("int8", -5, "uint8", 3, ALL_MODES),
    ("uint8", 200, "int8", 0, AXIS_NO_TFLITE),
    ("int16", -300, "int16", 17, AXIS_NO_TFLITE),
    ("uint16", 40000, "int16", -2, AXIS_NO_TFLITE),
]


@pytest.mark.parametrize("in_dtype,zin,out_dtype,zout,axis_modes", REQUANT_CASES)
def test_requantize(in_dtype, zin, out_dtype, zout, axis_modes):
    rng = np.random.default_rng(2)
    n = 96
    if in_dtype == "int32":
        # mostly moderate accumulators (so that int8 outputs do not all saturate) around
        # every residue mod 4, plus the extremes of int32
        base = np.arange(-n // 2, n // 2, dtype=np.int64)
        data = np.stack([base, base * 37, base * 1001, rng.integers(-(2**31), 2**31, n)])
        data[3, :2] = [-(2**31), 2**31 - 1]
        data = data.reshape(1, 4, n).repeat(2, axis=0).astype(np.int32)
    else:
        data = int_data(rng, in_dtype, (2, 4, n))
    modes = ("float", *INT_MODES)

    def body(q, s_in_rt, z_in_rt, s_out_rt, z_out_rt, s_axis_rt):
        outs = []
        for mode in modes:
            for key in ("tie", "arbitrary"):
                outs.append(
                    qnn.requantize(
                        q,
                        f32(S_IN_TENSOR[key]),
                        i32(zin),
                        f32(S_OUT),
                        i32(zout),
                        out_dtype=out_dtype,
                        rounding=mode,
                    )
                )
            if mode in axis_modes:
                outs.append(
                    qnn.requantize(
                        q, f32(S_IN_AXIS), i32(zin), f32(S_OUT), i32(zout), 1, out_dtype, mode
                    )
                )
        # per-axis output scale and zero point, too
        outs.append(
            qnn.requantize(
                q,
                f32(S_IN_AXIS),
                i32(zin),
                f32(S_IN_AXIS[::-1] * 4),
                i32([zout] * 4),
                1,
                out_dtype,
                "half_even",
            )
        )
        # runtime scales and zero points (float mode only)
        outs.append(qnn.requantize(q, s_in_rt, z_in_rt, s_out_rt, z_out_rt, 1, out_dtype))
        outs.append(qnn.requantize(q, s_axis_rt, z_in_rt, s_out_rt, z_out_rt, 1, out_dtype))
        return outs

    inputs = {
        "q": data,
        "s_in": np.array(S_IN_TENSOR["arbitrary"]),
        "z_in": np.array(zin, np.int32),
        "s_out": np.array(S_OUT),
        "z_out": np.array(zout, np.int32),
        "s_axis": S_IN_AXIS,
    }
    got = iter(run(inputs, body))
    for mode in modes:
        for key in ("tie", "arbitrary"):
            ref = P.requantize(data, S_IN_TENSOR[key], zin, S_OUT, zout, out_dtype, mode)
            assert_bit_exact(next(got), ref, f"{mode} per-tensor {key}")
        if mode in axis_modes:
            ref = P.requantize(data, S_IN_AXIS, zin, S_OUT, zout, out_dtype, mode, axis=1)
            assert_bit_exact(next(got), ref, f"{mode} per-axis")
    ref = P.requantize(
        data, S_IN_AXIS, zin, S_IN_AXIS[::-1] * 4, [zout] * 4, out_dtype, "half_even", axis=1
    )
    assert_bit_exact(next(got), ref, "per-axis output scale")
    ref = P.requantize(data, S_IN_TENSOR["arbitrary"], zin, S_OUT, zout, out_dtype, "float")
    assert_bit_exact(next(got), ref, "runtime per-tensor")
    ref = P.requantize(data, S_IN_AXIS, zin, S_OUT, zout, out_dtype, "float", axis=1)
    assert_bit_exact(next(got), ref, "runtime per-axis")


def test_requantize_tie_rules_are_visible():
    # The data of test_requantize hits exact ties; check that the modes really disagree
    # there (otherwise the bit-exact comparisons above would not tell the modes apart).
    # Row 0 uses the ratio 0.25, row 1 the ratio 0.5 (per-tensor scales, two outputs).
    q = np.array([[-10, -6, -2, 2, 6, 10], [-5, -3, -1, 1, 3, 5]], np.int32)
    ratios = (np.float32(3 * 2.0**-10), np.float32(3 * 2.0**-9))

    def body(q):
        return [
            qnn.requantize(q, f32(s_in), i32(0), f32(S_OUT), i32(0), -1, "int8", m)
            for m in ALL_MODES
            for s_in in ratios
        ]

    outs = iter(run({"q": q}, body))
    got = {m: np.stack([next(outs)[0], next(outs)[1]]) for m in ALL_MODES}
    # q / 4 = -2.5 -1.5 -0.5 0.5 1.5 2.5 and q / 2 = -2.5 -1.5 -0.5 0.5 1.5 2.5
    half_even = [-2, -2, 0, 0, 2, 2]
    half_away = [-3, -2, -1, 1, 2, 3]
    half_up = [-2, -1, 0, 1, 2, 3]
    assert got["float"].tolist() == [half_even, half_even]
    assert got["half_even"].tolist() == [half_even, half_even]
    assert got["half_away"].tolist() == [half_away, half_away]
    assert got["half_up"].tolist() == [half_up, half_up]
    assert got["tflite_single"].tolist() == [half_up, half_up]
    # TFLite: right shift 1 rounds ties away from zero; right shift 0 (ratio 0.5) leaves
    # the rounding to the doubling high multiply, whose negative ties go toward zero.
    assert got["tflite"].tolist() == [half_away, half_up]


# ------------------------------------------------------------------------ conv2d

CONV_CASES = {
    "int8_basic": dict(xdt="int8", wdt="int8", x=(1, 3, 6, 6), w=(4, 3, 3, 3)),
    "uint8_pad_stride_dilation": dict(
        xdt="uint8",
        wdt="int8",
        x=(2, 3, 9, 8),
        w=(5, 3, 3, 2),
        strides=(2, 1),
        padding=(1, 2, 0, 1),
        dilation=(2, 1),
    ),
    "groups": dict(
        xdt="int8", wdt="int8", x=(2, 4, 5, 5), w=(6, 2, 3, 3), groups=2, padding=(1, 1)
    ),
    "depthwise": dict(
        xdt="uint8",
        wdt="int8",
        x=(1, 4, 7, 7),
        w=(8, 1, 3, 3),
        groups=4,
        strides=(2, 2),
        padding=(1, 1, 1, 1),
    ),
    "uint8_weight": dict(xdt="uint8", wdt="uint8", x=(1, 2, 4, 5), w=(3, 2, 2, 3), padding=(2, 0)),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d(case):
    c = CONV_CASES[case]
    rng = np.random.default_rng(3)
    strides, dilation = c.get("strides", (1, 1)), c.get("dilation", (1, 1))
    padding, groups = list(c.get("padding", (0, 0, 0, 0))), c.get("groups", 1)
    pad4 = padding * 2 if len(padding) == 2 else padding
    x = int_data(rng, c["xdt"], c["x"])
    w = int_data(rng, c["wdt"], c["w"])
    o = c["w"][0]
    xlo = P.qrange(c["xdt"])[0]
    wlo, whi = P.qrange(c["wdt"])
    zx = xlo + 7 if c["xdt"] == "uint8" else -9  # negative for int8
    zw_vec = rng.integers(wlo, whi, size=o, endpoint=True).astype(np.int32)  # per channel
    zw_vec[0] = whi
    zw_scalar = np.int32(wlo + 3)
    sx, sw = np.float32(0.02), rng.uniform(1e-3, 1e-2, size=o).astype(np.float32)
    kw = dict(strides=strides, padding=padding, dilation=dilation, groups=groups)
    sy, zy = np.float32(0.37), np.int32(-4)
    # a per-channel "tflite" requantize takes ~3 s to compile: once is enough
    mode2 = "tflite" if case == "int8_basic" else "half_away"

    def body(x, w, zx_rt, zw_rt, sx_rt, sw_rt):
        acc_pc = qnn.conv2d(x, w, f32(sx), i32(zx), f32(sw), i32(zw_vec), **kw)
        return [
            acc_pc,
            qnn.conv2d(x, w, sx_rt, zx_rt, sw_rt, zw_rt, **kw),
            qnn.conv2d(x, w, f32(sx), i32(zx), f32(sw[0]), i32(zw_scalar), **kw),
            # the int32 accumulator requantized per output channel (scale sx * sw[c])
            qnn.requantize(acc_pc, f32(sx * sw), i32(0), f32(sy), i32(zy), 1, "int8", "float"),
            qnn.requantize(acc_pc, f32(sx * sw), i32(0), f32(sy), i32(zy), 1, "int8", mode2),
        ]

    inputs = {"x": x, "w": w, "zx": np.array(zx, np.int32), "zw": zw_vec, "sx": np.array(sx)}
    inputs["sw"] = sw
    got = run(inputs, body)
    xc = x.astype(np.int64) - zx
    ref_pc = conv2d_ref(
        xc, w.astype(np.int64) - zw_vec.reshape(-1, 1, 1, 1), strides, pad4, dilation, groups
    )
    ref_pt = conv2d_ref(xc, w.astype(np.int64) - zw_scalar, strides, pad4, dilation, groups)
    assert np.abs(ref_pc).max() < 2**31
    assert_bit_exact(got[0], ref_pc.astype(np.int32), "per-channel weight zp, const")
    assert_bit_exact(got[1], ref_pc.astype(np.int32), "per-channel weight zp, runtime")
    assert_bit_exact(got[2], ref_pt.astype(np.int32), "per-tensor weight zp")
    for g, mode in zip(got[3:], ("float", mode2), strict=True):
        ref = P.requantize(ref_pc.astype(np.int32), sx * sw, 0, sy, zy, "int8", mode, axis=1)
        assert_bit_exact(g, ref, f"requantize {mode}")
    if any(pad4):
        # padding is the real value 0, i.e. the integer input_zero_point; padding the raw
        # integers with 0 (then subtracting the zero point) would change the border outputs
        xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad4[0], pad4[2]), (pad4[1], pad4[3])))
        wc = w.astype(np.int64) - zw_vec.reshape(-1, 1, 1, 1)
        wrong = conv2d_ref(xp - zx, wc, strides, (0, 0, 0, 0), dilation, groups)
        assert not np.array_equal(wrong, ref_pc)


# ------------------------------------------------------------------ dense / matmul


@pytest.mark.parametrize("xdt,wdt", [("int8", "int8"), ("uint8", "int8"), ("uint8", "uint8")])
def test_dense(xdt, wdt):
    rng = np.random.default_rng(4)
    k, n = 7, 5
    x = int_data(rng, xdt, (2, 3, k))
    w = int_data(rng, wdt, (n, k))
    wlo, whi = P.qrange(wdt)
    zx = -11 if xdt == "int8" else 140
    zw = rng.integers(wlo, whi, size=n, endpoint=True).astype(np.int32)
    sw = rng.uniform(1e-3, 1e-2, size=n).astype(np.float32)

    def body(x, w, zx_rt, zw_rt):
        return [
            qnn.dense(x, w, f32(0.1), i32(zx), f32(sw), i32(zw)),
            qnn.dense(x, w, f32(0.1), zx_rt, f32(sw), zw_rt),
            qnn.dense(x, w, f32(0.1), i32(zx), f32(0.01), i32(zw[0])),
        ]

    got = run({"x": x, "w": w, "zx": np.array(zx, np.int32), "zw": zw}, body)
    xc = x.astype(np.int64) - zx
    ref = xc @ (w.astype(np.int64) - zw[:, None]).T
    assert_bit_exact(got[0], ref.astype(np.int32), "per-channel const")
    assert_bit_exact(got[1], ref.astype(np.int32), "per-channel runtime")
    assert_bit_exact(got[2], (xc @ (w.astype(np.int64) - zw[0]).T).astype(np.int32), "per-tensor")


MATMUL_CASES = {
    "2d": ((3, 5), (5, 4)),
    "batched": ((2, 3, 5), (2, 5, 4)),
    "broadcast_batch": ((2, 1, 3, 5), (4, 5, 6)),
    "rank_mix": ((3, 5), (2, 5, 4)),
}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_matmul(case):
    rng = np.random.default_rng(5)
    ashape, bshape = MATMUL_CASES[case]
    a = int_data(rng, "uint8", ashape)
    b = int_data(rng, "int8", bshape)
    za, zb = 131, -7
    # zero points as scalars, as 1-element 1-D tensors (ONNX style) and at run time
    got = run(
        {"a": a, "b": b, "za": np.array([za], np.int32), "zb": np.array(zb, np.int32)},
        lambda a, b, za_rt, zb_rt: [
            qnn.matmul(a, b, f32(0.1), i32(za), f32(0.2), i32(zb)),
            qnn.matmul(a, b, f32([0.1]), i32([za]), f32([0.2]), i32([zb])),
            qnn.matmul(a, b, f32(0.1), za_rt, f32(0.2), zb_rt),
        ],
    )
    ref = np.matmul(a.astype(np.int64) - za, b.astype(np.int64) - zb).astype(np.int32)
    for g, n in zip(got, ("scalar", "1-element", "runtime"), strict=True):
        assert_bit_exact(g, ref, n)


# --------------------------------------------------------------------------- sum


@pytest.mark.parametrize("dtype,zp", [("int8", -3), ("uint8", 128), ("int16", 1000)])
def test_sum(dtype, zp):
    rng = np.random.default_rng(6)
    x = int_data(rng, dtype, (2, 3, 4, 5))
    got = run(
        {"x": x, "z": np.array(zp, np.int32)},
        lambda x, z_rt: [
            qnn.sum(x, f32(0.1), i32(zp), axis=[2, 3]),
            qnn.sum(x, f32(0.1), z_rt, axis=[2, 3], keepdims=True),
            qnn.sum(x, f32(0.1), i32(zp), axis=[-1]),
            qnn.sum(x, f32(0.1), i32(zp), axis=[0, 1, 2, 3]),
        ],
    )
    xc = x.astype(np.int64) - zp
    refs = [xc.sum((2, 3)), xc.sum((2, 3), keepdims=True), xc.sum(-1), xc.sum()]
    for g, r in zip(got, refs, strict=True):
        assert_bit_exact(g, r.astype(np.int32))


# ------------------------------------------------------------- add/subtract/multiply

# Scale sets: "exact" (powers of two: the real results are exact binary fractions, with
# many exact ties at the output scale) and "arbitrary".
EW_SCALES = {
    "exact": (0.5, 0.25, 1.0),
    "arbitrary": (0.0173, 0.0291, 0.0417),
}
EW_SCALES_MUL = {
    "exact": (0.5, 0.25, 8.0),
    "arbitrary": (0.0173, 0.0291, 0.0117),
}


@pytest.mark.parametrize("scales", ["exact", "arbitrary"])
@pytest.mark.parametrize("op", ["add", "subtract", "multiply"])
def test_elementwise(op, scales):
    rng = np.random.default_rng(7)
    build = getattr(qnn, op)
    sa, sb, so = (EW_SCALES_MUL if op == "multiply" else EW_SCALES)[scales]
    # lhs uint8 [2, 3, 16], rhs int8 [3, 1] (broadcast); two output dtypes per scale set
    a = int_data(rng, "uint8", (2, 3, 16))
    b = int_data(rng, "int8", (3, 1))
    za, zb = 128, -2
    outs = [("uint8", 120), ("int16", 5)] if scales == "exact" else [("int8", -1), ("uint8", 3)]
    modes = ("float", *INT_MODES)

    def body(a, b, sa_rt, za_rt, so_rt):
        res = []
        for dt, zo in outs:
            for mode in modes:
                res.append(
                    build(a, b, f32(sa), i32(za), f32(sb), i32(zb), f32(so), i32(zo), dt, mode)
                )
        # runtime scales (float mode)
        res.append(build(a, b, sa_rt, za_rt, f32(sb), i32(zb), so_rt, i32(-1), "int8", "float"))
        return res

    got = iter(
        run(
            {
                "a": a,
                "b": b,
                "sa": np.array(sa, np.float32),
                "za": np.array(za, np.int32),
                "so": np.array(so, np.float32),
            },
            body,
        )
    )
    ab = np.broadcast_arrays(a, b)
    for dt, zo in outs:
        for mode in modes:
            # tflite follows TFLite's kernels (three roundings for add/subtract)
            ref_fn = TA.elementwise if mode == "tflite" else P.elementwise
            ref = ref_fn(op, ab[0], sa, za, ab[1], sb, zb, so, zo, dt, mode)
            assert_bit_exact(next(got), ref, f"{dt} {mode}")
    ref = P.elementwise(op, ab[0], sa, za, ab[1], sb, zb, so, -1, "int8", "float")
    assert_bit_exact(next(got), ref, "runtime scales")


@pytest.mark.parametrize("op", ["add", "multiply"])
def test_elementwise_int16_operands(op):
    """int16 x int16 -> int16 (an int16 residual stream: MiniLM's FFN residual adds and
    pooling multiply): every mode bit for bit against numpy, with zero points at the range
    ends so that ``|q - zp|`` reaches 65535 (the integer modes' int64 accumulator at its
    widest: 65535**2 * a 31-bit multiplier < 2**63); the integer modes within one step of
    the exact real result (float64)."""
    rng = np.random.default_rng(11)
    a, b = int_data(rng, "int16", (4, 33)), int_data(rng, "int16", (4, 33))
    b.flat[-1] = -32768  # with a's last 32767: both operands 65535 from their zero points
    za, zb, zo = -32768, 32767, 5
    sa, sb, so = (0.0173, 0.0291, 0.0417) if op == "add" else (0.0173, 0.0291, 39.7)
    modes = ("float", "half_even", "half_away", "half_up", "tflite_single")
    got = run(
        {"a": a, "b": b},
        lambda a, b: [
            getattr(qnn, op)(a, b, f32(sa), i32(za), f32(sb), i32(zb), f32(so), i32(zo), "int16", m)
            for m in modes
        ],
    )
    da = a.astype(np.float64) - za
    db = b.astype(np.float64) - zb
    f = [float(np.float32(v)) for v in (sa, sb, so)]
    real = (da * f[0] + db * f[1]) / f[2] if op == "add" else da * db * f[0] * f[1] / f[2]
    exact = np.clip(np.rint(real) + zo, -32768, 32767)
    assert np.abs(da * db).max() == 65535**2
    for g, mode in zip(got, modes, strict=True):
        ref = P.elementwise(op, a, sa, za, b, sb, zb, so, zo, "int16", mode)
        assert_bit_exact(g, ref, mode)
        if mode != "float":
            assert np.abs(g.astype(np.float64) - exact).max() <= 1, mode
    assert (np.abs(exact - zo) < 32000).mean() > 0.5  # mostly inside the range, not clipped


@pytest.mark.parametrize("op", ["add", "subtract"])
def test_float_elementwise_is_not_contracted_on_fma_targets(op):
    """Float-rounding add / subtract of every pair of int8 codes, compiled for the host CPU
    (FMA instructions, which the baseline ``llvm`` target lacks), bit for bit against numpy,
    which rounds both dequantize products: LLVM contracts an unfenced ``(a - za) * sa + (b -
    zb) * sb`` into one fused multiply-add, one step off wherever the real result is a tie
    (3-4% of the pairs at these scales; per-channel-constant adds run as lookups of the
    numpy values)."""
    host = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    codes = np.arange(-128, 128, dtype=np.int8)
    a, b = np.repeat(codes, 256).reshape(256, 256), np.tile(codes, 256).reshape(256, 256)
    sa, sb, so, za, zb, zo = 0.05, 0.15, 0.1, 3, -5, 1  # many real results are ties
    (got,) = run_tuple(
        {"a": a, "b": b},
        lambda a, b: [
            getattr(qnn, op)(a, b, f32(sa), i32(za), f32(sb), i32(zb), f32(so), i32(zo), "int8")
        ],
        host,
    )
    assert_bit_exact(got, P.elementwise(op, a, sa, za, b, sb, zb, so, zo, "int8", "float"), op)


# -------------------------------------------------------- simulated quantize / dequantize


def _sim_ref(x, s, z, bits, signed, overflow, axis=None):
    """numpy: float32 round(x / s) + z, then saturate or wrap into the intN/uintN range."""
    x = np.asarray(x, np.float32)
    s = np.asarray(s, np.float32)
    z = np.asarray(z, np.int32)
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        s, z = s.reshape(shape), z.reshape(shape)
    v = np.rint(x / s) + z.astype(np.float32)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    if overflow == "saturate":
        return np.clip(v, lo, hi).astype(np.float32)
    if signed:
        return P.simulate_accumulator(v.astype(np.int64), bits, "wrap").astype(np.float32)
    return (np.mod(v.astype(np.int64) - lo, 2**bits) + lo).astype(np.float32)


def test_simulated_quantize_dequantize():
    rng = np.random.default_rng(8)
    x = np.concatenate(
        [
            np.arange(-40, 40, dtype=np.float32) * np.float32(0.25),  # ties at scale 0.5
            rng.normal(0, 3000, size=44).astype(np.float32),
            np.array([9000.0, -9000.0, 70000.5, -70001.5], np.float32),
        ]
    ).reshape(4, 32)
    sv = np.array([0.5, 0.7, 2.0, 0.01], np.float32)
    zv = np.array([0, 3, -3, 1], np.int32)

    def body(x, s_rt, z_rt):
        sq = qnn.simulated_quantize
        return [
            sq(x, f32(0.5), i32(-3)),  # int8, saturate
            sq(x, s_rt, z_rt, dtype="int14"),
            sq(x, f32(0.5), i32(5), dtype="int14", overflow="wrap"),
            sq(x, f32(1.0), i32(0), dtype="int16", overflow="wrap"),  # narrow accumulator
            sq(x, f32(sv), i32(np.abs(zv)), axis=0, dtype="uint4"),
            sq(x, f32(sv), i32(zv), axis=0, dtype="int2", overflow="wrap"),
            sq(x, f32(0.25), i32(0), dtype="uint12", overflow="wrap"),
            sq(x, f32(0.001), i32(0), dtype="int32"),
            # simulated_quantize + simulated_dequantize must equal quantize + dequantize
            qnn.quantize(x, f32(0.5), i32(-3)),
            qnn.simulated_dequantize(sq(x, f32(0.5), i32(-3)), f32(0.5), i32(-3)),
            qnn.dequantize(qnn.quantize(x, f32(0.5), i32(-3)), f32(0.5), i32(-3)),
            qnn.simulated_dequantize(sq(x, f32(sv), i32(zv), axis=0), f32(sv), i32(zv), axis=0),
            qnn.simulated_dequantize(sq(x, s_rt, z_rt, dtype="int14"), s_rt, z_rt),
        ]

    got = run({"x": x, "s": np.array(0.7, np.float32), "z": np.array(-20, np.int32)}, body)
    refs = [
        _sim_ref(x, 0.5, -3, 8, True, "saturate"),
        _sim_ref(x, 0.7, -20, 14, True, "saturate"),
        _sim_ref(x, 0.5, 5, 14, True, "wrap"),
        _sim_ref(x, 1.0, 0, 16, True, "wrap"),
        _sim_ref(x, sv, np.abs(zv), 4, False, "saturate", axis=0),
        _sim_ref(x, sv, zv, 2, True, "wrap", axis=0),
        _sim_ref(x, 0.25, 0, 12, False, "wrap"),
        _sim_ref(x, 0.001, 0, 32, True, "saturate"),
    ]
    names = ["int8", "int14", "int14 wrap", "int16 wrap", "uint4", "int2 wrap", "uint12 wrap"]
    for g, r, n in zip(got[:8], refs, [*names, "int32"], strict=True):
        assert_bit_exact(g, r, n)
    # the wrap cases really wrapped something, and the saturate cases saturated
    assert np.any(refs[2] != _sim_ref(x, 0.5, 5, 14, True, "saturate"))
    assert np.any(refs[3] != _sim_ref(x, 1.0, 0, 16, True, "saturate"))
    # fidelity: the simulated pair reproduces the integer pair bit for bit
    q_int8 = got[8]
    assert_bit_exact(got[0], q_int8.astype(np.float32), "simulated_quantize == quantize")
    assert_bit_exact(got[9], got[10], "simulated_dequantize == dequantize")
    assert_bit_exact(got[9], P.dequantize(P.quantize(x, 0.5, -3), 0.5, -3), "dequantize ref")
    ref_axis = P.dequantize(_sim_ref(x, sv, zv, 8, True, "saturate", axis=0), sv, zv, axis=0)
    assert_bit_exact(got[11], ref_axis, "per-axis simulated_dequantize")
    ref_rt = ((refs[1] - np.float32(-20)) * np.float32(0.7)).astype(np.float32)
    assert_bit_exact(got[12], ref_rt, "runtime simulated_dequantize")


def test_simulated_ops_of_any_shape_share_one_kernel():
    # every layer's weight / activation quantize of a calibration graph: one PrimFunc per
    # rank and parameter kind, whatever the shapes, and still numpy's values bit for bit
    rng = np.random.default_rng(9)
    shapes = [(1, 16, 6, 5), (1, 8, 3, 7), (2, 16, 1, 9)]
    inputs = {f"x{k}": rng.normal(0, 40, s).astype(np.float32) for k, s in enumerate(shapes)}
    inputs |= {"s": np.array(0.3, np.float32), "z": np.array(-4, np.int32)}
    chans = [rng.uniform(0.1, 2.0, s[1]).astype(np.float32) for s in shapes]
    zps = [rng.integers(-5, 5, s[1]).astype(np.int32) for s in shapes]

    def body(*v):
        xs, s_rt, z_rt = v[:-2], v[-2], v[-1]
        out = []
        for x, sc, zp in zip(xs, chans, zps, strict=True):
            out.append(qnn.simulated_quantize(x, s_rt, z_rt))
            q = qnn.simulated_quantize(x, f32(sc), i32(zp), axis=1)
            out += [q, qnn.simulated_dequantize(q, f32(sc), i32(zp), axis=1)]
        return out

    lowered = relax.transform.LegalizeOps()(build_module(inputs, body))
    kernels = [gv.name_hint for gv in lowered.functions if gv.name_hint != "main"]
    # the three shapes (dims of 1 in other places too) share the three kernels
    assert len(kernels) == 3, kernels
    got = run(inputs, body)
    for k, (x, sc, zp) in enumerate(zip(list(inputs.values())[:3], chans, zps, strict=True)):
        q = _sim_ref(x, sc, zp, 8, True, "saturate", axis=1)
        assert_bit_exact(got[3 * k], _sim_ref(x, 0.3, -4, 8, True, "saturate"), f"{k} per tensor")
        assert_bit_exact(got[3 * k + 1], q, f"{k} per channel")
        ref = P.dequantize(q, sc, zp, axis=1).astype(np.float32)
        assert_bit_exact(got[3 * k + 2], ref, f"{k} dequantize")


# ----------------------------------------------------------------------- errors


def _tensor(name, shape, dtype):
    return relax.Var(name, relax.TensorType(list(shape), dtype))


def _expect_error(body, inputs: dict[str, tuple], *fragments: str, compile: bool = False):
    """Build (and optionally compile) ``body``; assert a QnnError whose message has
    every fragment (op, argument, expected value)."""
    arrays = {n: np.zeros(shape, dtype) for n, (shape, dtype) in inputs.items()}
    with pytest.raises(QnnError) as info:
        mod = build_module(arrays, body)
        if compile:
            tvm.compile(mod, TARGET)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


X23 = {"x": ((2, 3), "float32")}
Q23 = {"q": ((2, 3), "int8")}
ACC = {"acc": ((2, 3), "int32")}
CONV = {"x": ((1, 3, 5, 5), "int8"), "w": ((4, 3, 3, 3), "int8")}
MM = {"a": ((2, 5), "int8"), "b": ((5, 4), "int8")}

ERROR_CASES = {
    # wrong dtypes
    "quantize_data_dtype": (
        lambda q: [qnn.quantize(q, f32(1), i32(0))],
        Q23,
        ("qnn.quantize", "'data'", "of dtype float32", "got int8"),
    ),
    "quantize_scale_dtype": (
        lambda x: [qnn.quantize(x, relax.const(np.float16(1)), i32(0))],
        X23,
        ("qnn.quantize", "'scale'", "of dtype float32", "got float16"),
    ),
    "dequantize_zero_point_dtype": (
        lambda q: [qnn.dequantize(q, f32(1), relax.const(np.int8(0)))],
        Q23,
        ("qnn.dequantize", "'zero_point'", "of dtype int32", "got int8"),
    ),
    "dequantize_float_data": (
        lambda x: [qnn.dequantize(x, f32(1), i32(0))],
        X23,
        ("qnn.dequantize", "'data'", "int8 or uint8 or int16 or uint16 or int32", "float32"),
    ),
    "conv2d_int32_data": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32(1), i32(0))],
        {"x": ((1, 3, 5, 5), "int32"), "w": ((4, 3, 3, 3), "int8")},
        ("qnn.conv2d", "'data'", "of dtype int8 or uint8", "got int32"),
    ),
    "matmul_uint16_rhs": (
        lambda a, b: [qnn.matmul(a, b, f32(1), i32(0), f32(1), i32(0))],
        {"a": ((2, 5), "int8"), "b": ((5, 4), "uint16")},
        ("qnn.matmul", "'rhs'", "of dtype int8 or uint8 or int16", "got uint16"),
    ),
    "sum_int32_data": (
        lambda acc: [qnn.sum(acc, f32(1), i32(0), axis=[0])],
        ACC,
        ("qnn.sum", "'data'", "int8 or uint8 or int16", "got int32"),
    ),
    "quantize_out_dtype": (
        lambda x: [qnn.quantize(x, f32(1), i32(0), out_dtype="int4")],
        X23,
        ("qnn.quantize", "'out_dtype'", "one of int8, uint8, int16, uint16", "got int4"),
    ),
    "requantize_out_dtype": (
        lambda acc: [qnn.requantize(acc, f32(1), i32(0), f32(1), i32(0), out_dtype="float32")],
        ACC,
        ("qnn.requantize", "'out_dtype'", "int32", "got float32"),
    ),
    # per-axis lengths
    "quantize_axis_length": (
        lambda x: [qnn.quantize(x, f32([1, 2, 3, 4]), i32(0), axis=1)],
        X23,
        ("qnn.quantize", "'scale'", "of length 3 (dimension 1 of the data)", "length 4"),
    ),
    "dequantize_zero_point_length": (
        lambda q: [qnn.dequantize(q, f32(1), i32([0, 0]), axis=-1)],
        Q23,
        ("qnn.dequantize", "'zero_point'", "of length 3", "length 2"),
    ),
    "scale_vs_zero_point_length": (
        lambda x: [qnn.quantize(x, f32([1, 2, 3]), i32([0, 0]), axis=1)],
        X23,
        ("qnn.quantize", "'zero_point'", "of length 3 like 'scale'", "length 2"),
    ),
    "conv2d_weight_scale_length": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32([1, 1, 1]), i32(0))],
        CONV,
        ("qnn.conv2d", "'weight_scale'", "of length 4", "length 3"),
    ),
    "dense_weight_zero_point_length": (
        lambda x, w: [qnn.dense(x, w, f32(1), i32(0), f32(1), i32([0, 0, 0, 0]))],
        {"x": ((2, 5), "int8"), "w": ((3, 5), "int8")},
        ("qnn.dense", "'weight_zero_point'", "of length 3", "length 4"),
    ),
    "requantize_axis_length": (
        lambda acc: [qnn.requantize(acc, f32([1, 1]), i32(0), f32(1), i32(0), axis=1)],
        ACC,
        ("qnn.requantize", "'input_scale'", "of length 3", "length 2"),
    ),
    "axis_out_of_range": (
        lambda x: [qnn.quantize(x, f32([1, 2, 3]), i32(0), axis=2)],
        X23,
        ("qnn.quantize", "'axis'", "in [-2, 2)", "got 2"),
    ),
    "scalar_data_per_axis": (
        lambda x: [qnn.quantize(x, f32([1, 2]), i32(0))],
        {"x": ((), "float32")},
        ("qnn.quantize", "'scale'", "a scalar (the data is 0-d)", "length 2"),
    ),
    "conv2d_per_channel_input_scale": (
        lambda x, w: [qnn.conv2d(x, w, f32([1, 1, 1]), i32(0), f32(1), i32(0))],
        CONV,
        ("qnn.conv2d", "'input_scale'", "a scalar", "[3]"),
    ),
    "matmul_per_axis_scale": (
        lambda a, b: [qnn.matmul(a, b, f32(1), i32(0), f32([1, 1, 1, 1]), i32(0))],
        MM,
        ("qnn.matmul", "'rhs_scale'", "a scalar", "[4]"),
    ),
    "add_per_axis_output_scale": (
        lambda q: [qnn.add(q, q, f32(1), i32(0), f32(1), i32(0), f32([1, 2, 3]), i32(0))],
        Q23,
        ("qnn.add", "'output_scale'", "a scalar", "[3]"),
    ),
    # scale values
    "zero_scale": (
        lambda x: [qnn.quantize(x, f32(0.0), i32(0))],
        X23,
        ("qnn.quantize", "'scale'", "positive and finite", "[0.0]"),
    ),
    "negative_output_scale": (
        lambda acc: [qnn.requantize(acc, f32(0.1), i32(0), f32(-0.5), i32(0))],
        ACC,
        ("qnn.requantize", "'output_scale'", "positive and finite", "[-0.5]"),
    ),
    "negative_weight_scale_channel": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32([1, 1, -2, 1]), i32(0))],
        CONV,
        ("qnn.conv2d", "'weight_scale'", "positive and finite", "[-2.0]"),
    ),
    "nan_scale": (
        lambda q: [qnn.dequantize(q, f32(np.nan), i32(0))],
        Q23,
        ("qnn.dequantize", "'scale'", "positive and finite", "nan"),
    ),
    "inf_lhs_scale": (
        lambda q: [qnn.multiply(q, q, f32(np.inf), i32(0), f32(1), i32(0), f32(1), i32(0))],
        Q23,
        ("qnn.multiply", "'lhs_scale'", "positive and finite", "inf"),
    ),
    # zero point ranges
    "quantize_uint8_negative_zero_point": (
        lambda x: [qnn.quantize(x, f32(1), i32(-1), out_dtype="uint8")],
        X23,
        ("qnn.quantize", "'zero_point'", "inside the uint8 range [0, 255]", "[-1]"),
    ),
    "requantize_output_zero_point": (
        lambda acc: [qnn.requantize(acc, f32(1), i32(0), f32(1), i32(128))],
        ACC,
        ("qnn.requantize", "'output_zero_point'", "inside the int8 range [-128, 127]", "[128]"),
    ),
    "conv2d_weight_zero_point_channel": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32(1), i32([0, 200, 0, -129]))],
        CONV,
        ("qnn.conv2d", "'weight_zero_point'", "inside the int8 range", "[200, -129]"),
    ),
    "subtract_rhs_zero_point": (
        lambda q: [qnn.subtract(q, q, f32(1), i32(0), f32(1), i32(-200), f32(1), i32(0))],
        Q23,
        ("qnn.subtract", "'rhs_zero_point'", "inside the int8 range", "[-200]"),
    ),
    "quantize_int16_zero_point": (
        lambda x: [qnn.quantize(x, f32(1), i32(40000), out_dtype="int16")],
        X23,
        ("qnn.quantize", "'zero_point'", "inside the int16 range [-32768, 32767]", "[40000]"),
    ),
    # rounding / overflow / dtype attributes
    "requantize_unknown_rounding": (
        lambda acc: [qnn.requantize(acc, f32(1), i32(0), f32(1), i32(0), rounding="nearest")],
        ACC,
        (
            "qnn.requantize",
            "'rounding'",
            "one of float, half_even, half_away, half_up, tflite, tflite_single",
            "'nearest'",
        ),
    ),
    "add_unknown_rounding": (
        lambda q: [qnn.add(q, q, f32(1), i32(0), f32(1), i32(0), f32(1), i32(0), rounding="up")],
        Q23,
        ("qnn.add", "'rounding'", "one of float, half_even", "'up'"),
    ),
    "simulated_quantize_dtype": (
        lambda x: [qnn.simulated_quantize(x, f32(1), i32(0), dtype="int33")],
        X23,
        ("qnn.simulated_quantize", "'dtype'", "intN (N in 2..32) or uintN (N in 2..16)", "int33"),
    ),
    "simulated_quantize_overflow": (
        lambda x: [qnn.simulated_quantize(x, f32(1), i32(0), overflow="clamp")],
        X23,
        ("qnn.simulated_quantize", "'overflow'", "'saturate' or 'wrap'", "clamp"),
    ),
    # shapes and layouts
    "conv2d_layout": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32(1), i32(0), data_layout="NHWC")],
        CONV,
        ("qnn.conv2d", "'data_layout/kernel_layout'", "NCHW/OIHW", "NHWC"),
    ),
    "conv2d_groups": (
        lambda x, w: [qnn.conv2d(x, w, f32(1), i32(0), f32(1), i32(0), groups=2)],
        {"x": ((1, 4, 5, 5), "int8"), "w": ((4, 4, 3, 3), "int8")},
        ("qnn.conv2d", "'weight'", "of shape [O, 4/groups=2, kH, kW]", "got [4, 4, 3, 3]"),
    ),
    "matmul_inner_dimension": (
        lambda a, b: [qnn.matmul(a, b, f32(1), i32(0), f32(1), i32(0))],
        {"a": ((2, 5), "int8"), "b": ((6, 4), "int8")},
        ("qnn.matmul", "'rhs'", "of shape [..., 5, N]", "[6, 4]"),
    ),
    "dense_inner_dimension": (
        lambda x, w: [qnn.dense(x, w, f32(1), i32(0), f32(1), i32(0))],
        {"x": ((2, 5), "int8"), "w": ((3, 4), "int8")},
        ("qnn.dense", "'weight'", "of shape [N, 5]", "[3, 4]"),
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_type_inference_errors(case):
    body, inputs, fragments = ERROR_CASES[case]
    _expect_error(body, inputs, *fragments)


def test_integer_rounding_needs_constant_scales():
    # Integer modes compute the multiplier at compile time: runtime scales are refused by
    # the legalization (type inference accepts them: the float mode works with them).
    inputs = {"acc": ((2, 3), "int32"), "s": ((), "float32")}
    _expect_error(
        lambda acc, s: [qnn.requantize(acc, s, i32(0), f32(1), i32(0), rounding="tflite")],
        inputs,
        "qnn.requantize",
        "'input_scale'",
        "a constant for integer rounding modes",
        compile=True,
    )
    inputs = {"q": ((2, 3), "int8"), "s": ((), "float32")}
    _expect_error(
        lambda q, s: [
            qnn.add(q, q, f32(1), i32(0), f32(1), i32(0), s, i32(0), rounding="half_even")
        ],
        inputs,
        "qnn.add",
        "'output_scale'",
        "a constant for integer rounding modes",
        compile=True,
    )


def test_int16_accumulation_saturates_instead_of_wrapping():
    """An int16 x int8 dense over K=1536 (MiniLM's FFN-out reading an int16 GELU output) can
    exceed int32 (65535 * 127 * 1536 = 1.3e10): such an accumulator is computed in int64 and
    saturated to int32, never wrapped; within range it stays exact. Same for qnn.matmul of
    two int16 operands (K=32: 65535**2 * 32 = 1.4e11)."""
    rng = np.random.default_rng(11)
    k, n = 1536, 4
    big = np.full((1, 2, k), 32767, np.int16)
    small = rng.integers(-3000, 3000, size=(1, 2, k)).astype(np.int16)
    w = np.full((n, k), 127, np.int8)
    w[1] = -127
    w[2] = rng.integers(-127, 128, size=k)
    zx = -32768

    def body(x, y):
        wc = relax.const(w)
        return [qnn.dense(t, wc, f32(0.1), i32(zx), f32(0.01), i32(0)) for t in (x, y)]

    got = run({"x": big, "y": small}, body)
    for g, x in zip(got, (big, small), strict=True):
        ref = (x.astype(np.int64) - zx) @ w.astype(np.int64).T
        assert_bit_exact(g, np.clip(ref, -(2**31), 2**31 - 1).astype(np.int32), "dense int16")
    assert got[0][0, 0, 0] == 2**31 - 1 and got[0][0, 0, 1] == -(2**31)

    a = np.full((1, 3, 32), 32767, np.int16)
    b = np.full((1, 32, 2), -32768, np.int16)
    b[..., 1] = 100

    def body_mm(a, b):
        return [qnn.matmul(a, b, f32(0.1), i32(-100), f32(0.1), i32(0))]

    got = run({"a": a, "b": b}, body_mm)[0]
    ref = (a.astype(np.int64) + 100) @ b.astype(np.int64)
    assert_bit_exact(got, np.clip(ref, -(2**31), 2**31 - 1).astype(np.int32), "matmul int16")


@pytest.mark.parametrize("mode", ("half_even", "half_away", "half_up"))
def test_constant_shift_rounding_compiled(mode):
    """``rshift_round`` with a constant shift (the one-add form the per-tensor integer
    elementwise ops use) against :func:`autoq.primitives.rounding_right_shift`, compiled:
    every remainder around the tie for small shifts, ties and their neighbours for large ones,
    negative values and accumulators beyond 32 bits."""
    from tvm import te, tirx

    from autoq.qnn.tensor_exprs import rshift_round

    shifts = (1, 2, 3, 7, 31, 40)
    rng = np.random.default_rng(3)
    base = [np.arange(-70, 71)] + [
        np.concatenate([k * (1 << s) + (1 << (s - 1)) + np.arange(-2, 3) for k in (-5, 0, 4)])
        for s in shifts
    ]
    x = np.concatenate([*base, rng.integers(-(1 << 45), 1 << 45, 500)]).astype(np.int64)
    xt = te.placeholder((x.size,), "int64", name="x")

    def rounded(s):
        return te.compute(x.shape, lambda i: rshift_round(xt[i], tirx.const(s, "int64"), mode))

    outs = [rounded(s) for s in shifts]
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([xt, *outs])}), TARGET)
    got = [tvm.runtime.tensor(np.zeros_like(x)) for _ in shifts]
    lib["main"](tvm.runtime.tensor(x), *got)
    for s, g in zip(shifts, got, strict=True):
        np.testing.assert_array_equal(g.numpy(), P.rounding_right_shift(x, s, mode), f"shift {s}")
