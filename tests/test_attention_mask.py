"""finfo.min attention masks rewritten to a quantizable constant (autoq.ir.attention_mask):
the float function of a tiny BERT-style block is unchanged within float precision, the
unbounded-activation guard no longer fires and the mask add is quantized."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config
from autoq.ir.attention_mask import MASK_VALUE
from autoq.ir.matching import match
from autoq.ir.toolkit import bindings, const_array
from models import TARGET, Builder, Runner

SEQ, DIM = 8, 16
FMIN = np.finfo(np.float32).min


def _bert_block(form: str, seed: int = 0):
    """dense q/k/v -> q k^T / sqrt(d) + additive mask from the 0/1 ``mask`` input (``form``
    "multiply": ``(1 - mask) * finfo.min``; "where": ``where(mask > 0.5, 0, finfo.min)``)
    -> softmax -> @ v -> dense + residual -> layer norm."""
    b = Builder(seed)
    x = b.input("x", (1, SEQ, DIM))
    mask = b.input("mask", (1, 1, 1, SEQ))

    def dense(name, y):
        w = b.randw(f"{name}.weight", (DIM, DIM))
        out = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(out, b.weight(f"{name}.bias", b.rng.normal(size=DIM) * 0.1)))

    def body(b):
        q, k, v = dense("q", x), dense("k", x), dense("v", x)
        kt = b.emit(relax.op.permute_dims(k, [0, 2, 1]))
        s = b.emit(relax.op.multiply(b.emit(relax.op.matmul(q, kt)), relax.const(0.25, "float32")))
        s = b.emit(relax.op.expand_dims(s, 1))  # (1, 1, SEQ, SEQ): one head
        if form == "multiply":
            inv = b.emit(relax.op.subtract(relax.const(1.0, "float32"), mask))
            add = b.emit(relax.op.multiply(inv, relax.const(FMIN, "float32")))
        else:
            keep = b.emit(relax.op.greater(mask, relax.const(0.5, "float32")))
            add = b.emit(
                relax.op.where(keep, relax.const(0.0, "float32"), relax.const(FMIN, "float32"))
            )
        p = b.emit(relax.op.nn.softmax(b.emit(relax.op.add(s, add)), axis=-1))
        a = b.emit(
            relax.op.squeeze(b.emit(relax.op.matmul(p, b.emit(relax.op.expand_dims(v, 1)))), [1])
        )
        y = b.emit(relax.op.add(dense("o", a), x))
        g, beta = b.weight("ln.weight", np.ones(DIM)), b.weight("ln.bias", np.zeros(DIM))
        return b.emit(relax.op.nn.layer_norm(y, g, beta, [-1]))

    return b.build(body)


def _samples(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = np.ones((1, 1, 1, SEQ), np.float32)
        mask[..., rng.integers(3, SEQ) :] = 0.0
        out.append({"x": rng.normal(size=(1, SEQ, DIM)).astype(np.float32), "mask": mask})
    return out


def _numpy_reference(params, x, mask):
    """The block in numpy with the finfo.min mask (float64, then compared loosely)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x = x.astype(np.float64)

    def dense(n, y):
        return y @ p[f"{n}.weight"].T + p[f"{n}.bias"]

    q, k, v = dense("q", x), dense("k", x), dense("v", x)
    s = (q @ k.transpose(0, 2, 1)) * 0.25 + (1.0 - mask[0]) * float(FMIN)
    e = np.exp(s - s.max(-1, keepdims=True))
    y = dense("o", (e / e.sum(-1, keepdims=True)) @ v) + x
    mu, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
    return (y - mu) / np.sqrt(var + 1e-5)


@pytest.mark.parametrize("form", ["multiply", "where"])
def test_rewrite_keeps_the_float_function(form):
    mod, params = _bert_block(form)
    g = match(mod, params).graph
    consts = [const_array(a) for _, v in bindings(g.module["main"]) for a in getattr(v, "args", [])]
    consts = [c for c in consts if c is not None and c.dtype.kind == "f"]
    assert not any(np.any(c <= -1e30) for c in consts)
    assert any(np.all(c == MASK_VALUE) for c in consts)
    before, after = Runner(mod, params), Runner(g.module, params)
    for s in _samples(4, 1):
        want = before(s["x"], s["mask"])
        got = after(s["x"], s["mask"])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got, _numpy_reference(params, s["x"], s["mask"]), atol=1e-4)


def test_softmax_of_masked_scores_is_unchanged_within_float_precision():
    """Scores spanning up to ~70 (BERT's are within +-15): the unmasked probabilities stay
    within one float32 ulp and the masked ones below 1e-8."""
    rng = np.random.default_rng(0)
    s = rng.uniform(-35, 35, size=(64, 128)).astype(np.float32)
    keep = rng.random((64, 128)) < 0.3
    keep[:, 0] = True

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    a = softmax(np.where(keep, s, s + FMIN).astype(np.float32))
    b = softmax((s + np.where(keep, 0, np.float32(MASK_VALUE))).astype(np.float32))
    np.testing.assert_array_max_ulp(a[keep], b[keep], maxulp=1)
    assert np.all(a[~keep] == 0) and np.all(b[~keep] < 1e-8)


def test_guard_no_longer_fires_and_the_mask_add_is_int8():
    mod, params = _bert_block("multiply")
    calib, test = _samples(8, 1), _samples(4, 2)
    res = autoq.Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, calib)
    assert not any("unbounded" in w for w in res.warnings)
    assert not any("guard" in why for why in res.fp32_layers.values())
    assert "autoq.skipped_unbounded" not in (res.module.attrs or {})
    text = res.module["main"].script()
    assert '"qnn.add"' in text  # scores + mask in the integer graph
    f, q = Runner(mod, params), Runner(res.module)
    for s in test:
        want, got = f(s["x"], s["mask"]), q(s["x"], s["mask"])
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1
