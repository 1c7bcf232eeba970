"""autoq.rules.dynamic_lookups (``Config.rules`` "lookup_between_dynamic"): a transformer FFN,
dense -> reshape -> GELU -> reshape -> dense with both dense layers dynamic per token; the
GELU found (and only between dynamic layers), kept in float with its reason, and the int8
FFN against a numpy FFN (erf GELU) closer than with the GELU as two 8-bit grids."""

from __future__ import annotations

import math

import numpy as np
from tvm import relax

import autoq
from autoq import Config, Override, QuantSpec
from autoq.ir.matching import match
from autoq.rules.dynamic_lookups import REASON, lookups_between_dynamic
from models import TARGET, Builder, Runner

SEQ, DIM, HID = 8, 16, 64
TOKEN = QuantSpec(dynamic=True, granularity="token")
BASE = Config(recipe="cnn", check_scales=False, smooth_quant=None)
DYNAMIC = BASE.replace(overrides=(Override("pattern:dense*", activation=TOKEN),))
ON = DYNAMIC.replace(rules=("lookup_per_channel", "lookup_between_dynamic"))


def ffn():
    b = Builder(0)
    x = b.input("x", (1, SEQ, DIM))

    def body(b):
        h = b.emit(relax.op.reshape(x, [SEQ, DIM]))
        w1, b1 = b.randw("up.weight", (DIM, HID)), b.weight("up.bias", np.zeros(HID))
        h = b.emit(relax.op.add(b.emit(relax.op.matmul(h, w1)), b1))
        g = b.emit(relax.op.nn.gelu(b.emit(relax.op.reshape(h, [1, SEQ, HID]))))
        w2, b2 = b.randw("down.weight", (HID, DIM)), b.weight("down.bias", np.zeros(DIM))
        y = b.emit(relax.op.matmul(b.emit(relax.op.reshape(g, [SEQ, HID])), w2))
        return b.emit(relax.op.add(y, b2))

    return b.build(body)


def reference(params, x):
    """The FFN in numpy, float64, with the erf GELU."""
    h = x.reshape(SEQ, DIM).astype(np.float64) @ params["up.weight"] + params["up.bias"]
    erf = np.vectorize(math.erf)
    g = 0.5 * h * (1 + erf(h / math.sqrt(2)))
    return g @ params["down.weight"] + params["down.bias"]


def test_the_gelu_between_dynamic_dense_layers_runs_in_float_and_the_ffn_gets_closer():
    mod, params = ffn()
    rng = np.random.default_rng(1)
    calib = [(rng.normal(size=(1, SEQ, DIM)) * 2).astype(np.float32) for _ in range(16)]
    test = [(rng.normal(size=(1, SEQ, DIM)) * 2).astype(np.float32) for _ in range(4)]
    matched = match(mod, params, ON)
    assert lookups_between_dynamic(matched, ON) == ["gelu_0"]
    assert lookups_between_dynamic(matched, DYNAMIC) == []  # the rule off
    assert lookups_between_dynamic(matched, BASE.replace(rules=ON.rules)) == []  # static dense
    err = {}
    for name, cfg in (("off", DYNAMIC.replace(rules=("lookup_per_channel",))), ("on", ON)):
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, calib)
        assert ("gelu_0" in res.fp32_layers) == (name == "on")
        run = Runner(res.module)
        err[name] = max(float(np.abs(run(x) - reference(params, x)).max()) for x in test)
        if name == "on":
            assert res.fp32_layers["gelu_0"] == REASON
            assert set(res.int8_layers) == {"up", "down"}  # both matmuls int8
    assert err["on"] < 0.7 * err["off"], err
