"""autoq.rules.softmax_ranges (``Config.rules`` "softmax_input_ranges"): masked attention
logits, where the -100 mask dominates the sum's int8 grid; the int8 model's softmax
against numpy's softmax of the float logits, with the rule off and on; which slots it
finds; its bound against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config
from autoq.rules import softmax_ranges
from autoq.simulation import simulate
from models import TARGET

HEADS, SEQ = 2, 16
OFF = Config(recipe="cnn", check_scales=False, smooth_quant=None)
ON = OFF.replace(rules=("softmax_input_ranges",))


def masked_attention(extra_reader: bool = False) -> tvm.IRModule:
    """softmax(scores + mask) over the keys (mask: 0 or -100, one row for every head);
    ``extra_reader``: the sum is also a model output (then it is not cut)."""
    bb = relax.BlockBuilder()
    s = relax.Var("scores", relax.TensorType([1, HEADS, SEQ, SEQ], "float32"))
    m = relax.Var("mask", relax.TensorType([1, 1, 1, SEQ], "float32"))
    with bb.function("main", [s, m]):
        with bb.dataflow():
            total = bb.emit(relax.op.add(s, m))
            p = bb.emit(relax.op.nn.softmax(total, axis=-1))
            gv = bb.emit_output(relax.Tuple([p, total]) if extra_reader else p)
        bb.emit_func_output(gv)
    return bb.get()


def samples(n: int, seed: int) -> list[dict]:
    """Scores ~ N(0, 4) (about [-15, 15]), the last 4-12 keys masked at -100."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = np.zeros((1, 1, 1, SEQ), np.float32)
        mask[..., SEQ - int(rng.integers(4, 13)) :] = -100.0
        scores = (rng.normal(size=(1, HEADS, SEQ, SEQ)) * 4).astype(np.float32)
        out.append({"scores": scores, "mask": mask})
    return out


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _run(mod, sample):
    ex = tvm.compile(mod, TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(sample[k]) for k in ("scores", "mask")])
    return out.numpy()


def test_the_softmax_input_grid_stops_16_below_the_scores_and_the_softmax_gets_closer():
    mod = masked_attention()
    calib, test = samples(24, 0), samples(4, 1)
    err = {}
    for name, cfg in (("off", OFF), ("on", ON)):
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, None, calib)
        got = [_run(res.module, s) for s in test]
        want = [softmax(s["scores"] + s["mask"]) for s in test]
        err[name] = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
        lo = {k: float(res.qparams[k].grid_range()[0]) for k in ("add_0", "scores", "mask")}
        if name == "off":
            assert lo["add_0"] < lo["scores"] - 90  # the grid spans the mask
        else:
            step = float(res.qparams["add_0"].scale)
            assert lo["add_0"] == pytest.approx(lo["scores"] - softmax_ranges.SPAN, abs=step)
    # the masked keys' probabilities stay below exp(-16) ~ 1e-7 in float: the error is the
    # finer grid's rounding of the live logits
    assert err["on"] < 0.6 * err["off"], err


def test_only_a_sum_read_by_softmax_alone_with_a_mask_operand_is_cut():
    sim = simulate(masked_attention(), None, ON)
    assert softmax_ranges.softmax_input_slots(sim) == {"add_0": ("scores", "mask")}
    assert softmax_ranges.softmax_input_slots(simulate(masked_attention(True), None, ON)) == {}
    spec = sim.plan.specs["add_0"]
    qp = autoq.qparams.QParam.from_range
    scores, total = qp(np.float64(-12.0), np.float64(14.0)), qp(np.float64(-110), np.float64(14))
    positive = qp(np.float64(-3.0), np.float64(2.0))  # not a mask: it also raises some scores
    assert softmax_ranges.cut(total, scores, positive, spec) is total
    cut = softmax_ranges.cut(total, positive, qp(np.float64(-100.0), np.float64(0.0)), spec)
    assert float(cut.grid_range()[0]) == pytest.approx(-3.0 - 16.0, abs=float(cut.scale))
