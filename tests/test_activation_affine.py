"""Activation + per-tensor affine as one lookup (``patterns/activation_affine.py``): the
chain ``f(x) * a + b`` between two convs matches one layer, realizes to one ``qnn.lut``
whose table rounds the numpy reference once, equals the simulated graph bit for bit, and
is closer to the fp32 model (numpy) than the three-layer form it replaces."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config, realize, simulate
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from autoq.ir.activations import affine, lut_table
from autoq.ir.canonicalize import hardswish
from autoq.ir.registry import PATTERNS, load_patterns
from models import TARGET, Builder, Runner, conv2d_nchw

A, B = 0.8, 0.3  # PP-OCRv4's learnable affine block has a ~ 1, b ~ 0


def _hardswish(x):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def chain(a=A, b=B, scalar_shape=(1,)):
    """conv 3x3 -> hardswish -> * a -> + b -> conv 1x1."""
    bld = Builder(3)
    x = bld.input("x", (1, 3, 8, 8))

    def body(bld):
        w1 = bld.randw("c1.weight", (6, 3, 3, 3))
        y = bld.emit(relax.op.nn.conv2d(x, w1, padding=1))
        y = bld.emit(hardswish(y))
        y = bld.emit(relax.op.multiply(y, bld.weight("lab.a", np.full(scalar_shape, a))))
        y = bld.emit(relax.op.add(y, bld.weight("lab.b", np.full(scalar_shape, b))))
        return bld.emit(relax.op.nn.conv2d(y, bld.randw("c2.weight", (2, 6, 1, 1))))

    mod, params = bld.build(body)
    rng = np.random.default_rng(7)
    data = [rng.normal(size=(1, 3, 8, 8)).astype(np.float32) for _ in range(8)]
    return mod, params, data


def numpy_model(params, x, a=A, b=B):
    y = conv2d_nchw(x.astype(np.float64), params["c1.weight"].astype(np.float64), pad=1)
    y = _hardswish(y) * a + b
    return conv2d_nchw(y, params["c2.weight"].astype(np.float64))


def _ops(mod):
    return [
        b.value.op.name
        for blk in mod["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call)
    ]


def test_affine_table_rounds_the_reference_once():
    """Every entry is round(g(dequantize(q)) / s_out) + zp_out, g in float64 (numpy)."""
    s_in, zp_in, s_out, zp_out = 0.04, -20, 0.03, -100
    t = lut_table(affine("hardswish", A, B), s_in, zp_in, "int8", s_out, zp_out, "int8")
    q = np.arange(-128, 128)
    x = ((q - zp_in).astype(np.float32) * np.float32(s_in)).astype(np.float64)
    want = np.clip(np.rint((_hardswish(x) * A + B) / s_out) + zp_out, -128, 127)
    np.testing.assert_array_equal(t.astype(np.int64), want.astype(np.int64))


@pytest.mark.parametrize("scalar_shape", [(1,), (1, 1, 1, 1)])
def test_chain_is_one_lookup_layer_bit_exact(scalar_shape):
    mod, params, data = chain(scalar_shape=scalar_shape)
    cfg = Config(recipe="cnn")
    sim = simulate(mod, params, cfg)
    assert [m.pattern.name for m in sim.matches] == ["conv2d", "hardswish_affine", "conv2d"]
    qp = autoq.calibrate(sim, params, data, cfg, target=TARGET)
    real = realize(mod, params, qp, cfg)
    assert _ops(real) == [
        "qnn.quantize", "qnn.conv2d", "qnn.requantize", "qnn.lut", "qnn.conv2d", "qnn.dequantize"
    ]  # fmt: skip
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    assert rep.exact, rep.table()
    want = np.stack([numpy_model(params, x) for x in data])
    got = np.stack([Runner(real)(x) for x in data])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def test_one_rounding_is_closer_to_fp32_than_three():
    """The same model without the pattern (three layers: hardswish, multiply_const,
    add_const) has a larger error against numpy."""
    mod, params, data = chain()
    load_patterns()
    names = tuple(n for n, p in PATTERNS.items() if p.default and not n.endswith("_affine"))
    errs = {}
    for key, cfg in {
        "fused": Config(recipe="cnn"),
        "three": Config(recipe="cnn", patterns=names),
    }.items():
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data)
        got = np.stack([Runner(res.module)(x) for x in data])
        errs[key] = got
        if key == "three":
            assert {"multiply_const", "add_const"} <= {
                m.pattern.name for m in res.matched.active(cfg.fallback)
            }
    want = np.stack([numpy_model(params, x) for x in data])
    err = {k: np.linalg.norm(v - want) / np.linalg.norm(want) for k, v in errs.items()}
    assert err["fused"] < err["three"], err


def test_other_readers_keep_the_chain_apart():
    """The activation's output also read elsewhere: no fused match (the intermediate value
    must stay visible), the plain activation and the const layers match instead."""
    bld = Builder(4)
    x = bld.input("x", (1, 4))

    def body(bld):
        h = bld.emit(hardswish(x))
        y = bld.emit(relax.op.multiply(h, bld.weight("a", np.full((1,), A))))
        y = bld.emit(relax.op.add(y, bld.weight("b", np.full((1,), B))))
        return bld.emit(relax.op.add(y, h))

    mod, params = bld.build(body)
    names = [m.pattern.name for m in simulate(mod, params, Config(recipe="cnn")).matches]
    assert "hardswish_affine" not in names and "hardswish" in names


def test_per_channel_constants_are_not_fused():
    """A per-channel multiplier is not one number: the chain stays three layers."""
    bld = Builder(5)
    x = bld.input("x", (1, 4, 2, 2))

    def body(bld):
        h = bld.emit(hardswish(x))
        y = bld.emit(relax.op.multiply(h, bld.weight("a", np.full((1, 4, 1, 1), A))))
        return bld.emit(relax.op.add(y, bld.weight("b", np.full((1,), B))))

    mod, params = bld.build(body)
    names = [m.pattern.name for m in simulate(mod, params, Config(recipe="cnn")).matches]
    assert "hardswish_affine" not in names
