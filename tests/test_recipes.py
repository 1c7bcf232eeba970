"""autoq.recipes and the recipe fields of Config: which recipe the structure picks, what a
named recipe fills, that the user's fields win, and that the pipeline realizes the recipe it
reports (the same module as naming it)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, Override, QuantSpec
from autoq.config.recipe_table import RECIPE_FIELDS, RECIPES
from autoq.recipes import detect, resolve
from models import TARGET, Builder, attention, conv, ln_block, small_cnn, two_convs


def depthwise_cnn(seed=0):
    """conv 3x3 -> relu -> depthwise 3x3 (groups = channels) -> relu -> 1x1 conv."""
    b = Builder(seed)
    x = b.input("x", (1, 3, 8, 8))

    def body(b):
        y = b.emit(relax.op.nn.relu(conv(b, x, "stem", 3, 8)))
        y = b.emit(relax.op.nn.relu(conv(b, y, "dw", 8, 8, groups=8)))
        return conv(b, y, "pw", 8, 4, k=1, pad=0)

    mod, params = b.build(body)
    return mod, params


@pytest.mark.parametrize(
    ("model", "name", "why"),
    [
        (lambda: two_convs()[:2], "cnn", "no attention"),
        (lambda: depthwise_cnn(), "depthwise_cnn", "depthwise convs"),
        (lambda: small_cnn()[:2], "depthwise_cnn", "depthwise convs"),
        (lambda: ln_block()[:2], "transformer", "LayerNorm"),
        (lambda: attention()[:2], "transformer", "two activations"),
    ],
    ids=["cnn", "depthwise", "small_cnn", "layernorm", "attention"],
)
def test_the_structure_picks_the_recipe(model, name, why):
    mod, params = model()
    got, reason = detect(mod, params)
    assert got == name and why in reason
    # the weights are parameters here: without params every parameter is an input, and a
    # dense layer's matmul would look like attention; with them it must not
    if name == "cnn":
        assert detect(mod, None)[0] == "cnn"


def test_a_dense_layer_is_not_attention():
    """x @ W with W a weight (parameter or constant) is a dense layer, not attention."""
    b = Builder(0)
    x = b.input("x", (1, 4, 8))

    def body(b):
        return b.emit(relax.op.matmul(x, relax.op.permute_dims(b.randw("fc", (8, 8)), [1, 0])))

    mod, params = b.build(body)
    assert detect(mod, params)[0] == "cnn"


def test_a_named_recipe_fills_only_the_fields_left_to_it():
    for name, r in RECIPES.items():
        cfg = Config(recipe=name)
        assert all(getattr(cfg, f) == getattr(r, f) for f in RECIPE_FIELDS), name
        assert cfg.overrides == r.overrides
    own = Config(recipe="transformer", rounding="float", check_scales=True, rules=())
    assert (own.rounding, own.check_scales, own.rules) == ("float", True, ())
    assert own.activation == RECIPES["transformer"].activation
    # the recipe's overrides come first (the user's, later, win) and are added once
    mine = Override("attn.*", activation=QuantSpec(dtype="int16"))
    cfg = Config(recipe="transformer", overrides=(mine,))
    assert cfg.overrides == (*RECIPES["transformer"].overrides, mine)
    assert cfg.replace() == cfg and Config.loads(cfg.dumps()) == cfg


def test_the_depthwise_recipe_corrects_biases_unless_the_config_says_otherwise():
    """``bias_correction`` is a recipe field: on (``BiasCorrection()``) in ``depthwise_cnn``,
    off (False) elsewhere; the user's explicit choice (False, or a gated correction) is kept
    through the recipe, ``auto``'s resolution and JSON."""
    from autoq.config import BiasCorrection

    on = Config(recipe="depthwise_cnn")
    assert on.bias_correction == BiasCorrection() and on.corrects_bias and on.bias_holdout == 0
    assert all(Config(recipe=r).bias_correction is False for r in RECIPES if r != "depthwise_cnn")
    mod, params = depthwise_cnn()
    for mine in (False, BiasCorrection(holdout=8)):
        named = Config(recipe="depthwise_cnn", bias_correction=mine)
        auto, _ = resolve(Config(bias_correction=mine), mod, params)
        assert named.bias_correction == mine and auto == named
        assert Config.loads(named.dumps()) == named and Config.loads(auto.dumps()) == auto
    assert not Config(recipe="depthwise_cnn", bias_correction=False).corrects_bias
    assert Config().to_json()["bias_correction"] is None  # the recipe's, after resolution
    assert resolve(Config(), mod, params)[0].bias_correction == BiasCorrection()
    with pytest.raises(TypeError, match=r"Config\.bias_correction must be .* False \(off\)"):
        Config(recipe="cnn", bias_correction=True)


def test_auto_waits_for_the_model():
    cfg = Config()
    assert cfg.recipe == "auto" and not cfg.resolved
    assert all(getattr(cfg, f) is None for f in RECIPE_FIELDS)
    assert Config.loads(cfg.dumps()) == cfg
    mod, params = ln_block()[:2]
    done, why = resolve(Config(check_scales=True), mod, params)
    assert done == Config(recipe="transformer", check_scales=True) and "LayerNorm" in why
    assert resolve(done, mod, params) == (done, "named in Config.recipe")
    with pytest.raises(ValueError, match=r"Config\.recipe must be one of auto, cnn"):
        Config(recipe="bert")


def test_the_pipeline_reports_and_realizes_the_recipe_it_picked():
    """Config() on a LayerNorm block: the transformer recipe, reported with its reason, and
    the realized module is the one Config(recipe="transformer") gives."""
    mod, params, data = ln_block()
    res = autoq.Quantizer(target=TARGET).run(mod, params, data(4, 1))
    assert res.recipe[0] == "transformer" and "LayerNorm" in res.recipe[1]
    assert res.config.rounding == "half_even" and res.config.has_rule("residual_per_channel")
    named = autoq.Quantizer(Config(recipe="transformer"), target=TARGET).run(
        mod, params, data(4, 1)
    )
    assert named.recipe == ("transformer", "named in Config.recipe")
    tvm.ir.assert_structural_equal(res.module["main"], named.module["main"])
    # every dense layer took its activation scale at run time (the recipe's override)
    ops = [v.op.name for v in _calls(res.module) if isinstance(v.op, tvm.ir.Op)]
    assert "qnn.dynamic_quantize" in ops


def test_the_cnn_recipe_is_the_default_of_a_plain_cnn():
    mod, params, make = two_convs()
    auto = autoq.Quantizer(target=TARGET).run(mod, params, make(4, 1))
    cnn = autoq.Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, make(4, 1))
    assert auto.recipe[0] == "cnn"
    tvm.ir.assert_structural_equal(auto.module["main"], cnn.module["main"])
    x = make(1, 9)[0]
    a = relax.VirtualMachine(autoq.compile(auto.module, TARGET), tvm.cpu())
    c = relax.VirtualMachine(autoq.compile(cnn.module, TARGET), tvm.cpu())
    np.testing.assert_array_equal(
        a["main"](tvm.runtime.tensor(x)).numpy(), c["main"](tvm.runtime.tensor(x)).numpy()
    )


def _calls(mod):
    out = []
    relax.analysis.post_order_visit(
        mod["main"].body, lambda e: out.append(e) if isinstance(e, relax.Call) else None
    )
    return out
