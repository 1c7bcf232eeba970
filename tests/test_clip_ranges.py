"""Min/max ranges on clipped activations (``autoq/rules/clip_ranges.py``, ``Config.rules``
"clip_output_ranges", on in the ``depthwise_cnn`` recipe): the failing pattern (a ReLU6
output whose largest values are rare, where a range-cutting calibrator, here the 99th
percentile, puts the range below them; ``mse`` did so on ImageNet MobileNetV2) against
numpy, which tensors the rule covers, and that it leaves other slots and recipes alone."""

from __future__ import annotations

import numpy as np
from tvm import relax

from autoq import Config, QuantSpec, calibrate, simulate
from autoq.calibrators.max import Max
from autoq.calibrators.percentile import Percentile
from autoq.recipes import RECIPES
from models import TARGET, Builder

RULE = "clip_output_ranges"


def relu6_model(relu=False):
    """x -> ReLU6 -> conv 1x1 (+ relu of x -> conv 1x1 with ``relu``): the ReLU6 output is
    a slot read by a conv, its values those of ``clip(x, 0, 6)`` exactly (x itself is not
    quantized: nothing reads it as an int8 input)."""
    b = Builder(3)
    x = b.input("x", (1, 4, 8, 8))

    def body(b):
        h = b.emit(relax.op.clip(x, 0.0, 6.0))
        y = b.emit(relax.op.nn.conv2d(h, b.randw("c.weight", (4, 4, 1, 1))))
        if relu:
            r = b.emit(relax.op.nn.relu(x))
            y = b.emit(relax.op.add(y, relax.op.nn.conv2d(r, b.randw("r.weight", (4, 4, 1, 1)))))
        return y

    return b.build(body)


def data(n=6):
    """Mostly small values with a rare tail up to (and clipped at) 6."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.exponential(0.3, (1, 4, 8, 8)) - 0.1
        x.reshape(-1)[rng.choice(x.size, 2, replace=False)] = rng.uniform(4.0, 7.0, 2)
        out.append(x.astype(np.float32))
    return out


def cfg(on=True):
    return Config(
        recipe="cnn", activation=QuantSpec(calibrator=Percentile(percentile=99.0)),
        rules=(RULE,) if on else (),
        weight_rounding="nearest",
    )  # fmt: skip


def test_relu6_slot_takes_the_numpy_min_max_where_mse_cuts_below_it():
    mod, params = relu6_model()
    xs = data()
    want_max = max(float(np.clip(x, 0.0, 6.0).max()) for x in xs)
    on, off = (simulate(mod, params, cfg(v)) for v in (True, False))
    sid = next(s for s in on.activation_slots() if s.startswith("clip"))
    got_on = calibrate(on, params, xs, cfg(True), target=TARGET)[sid]
    got_off = calibrate(off, params, xs, cfg(False), target=TARGET)[sid]
    assert float(got_on.rmin) == 0.0 and float(got_on.rmax) == want_max
    assert float(got_off.rmax) < 0.8 * want_max  # the failing pattern: the tail cut
    assert isinstance(on.plan.specs[sid].calibrator, Max)


def test_only_clip_outputs_and_only_with_the_rule():
    mod, params = relu6_model(relu=True)
    on = simulate(mod, params, cfg())
    maxed = {s for s, sp in on.plan.specs.items() if isinstance(sp.calibrator, Max)}
    clip_slots = {s for s in on.activation_slots() if s.startswith("clip")}
    assert clip_slots and maxed & set(on.activation_slots()) == clip_slots  # not the relu's
    off = simulate(mod, params, cfg(False))
    assert not any(isinstance(off.plan.specs[s].calibrator, Max) for s in off.activation_slots())
    assert RULE in RECIPES["depthwise_cnn"].rules and RULE not in RECIPES["cnn"].rules
    assert Config.from_json(cfg().to_json()) == cfg()
