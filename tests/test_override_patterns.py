"""``Override("pattern:<glob>", ...)``: layers selected by their pattern's name instead of
their ids (autoq.layer_rules.compile_layer_rule). On the tiny transformer the rule
``pattern:dense*`` selects exactly the layers whose pattern name starts with "dense" (listed
by hand from the matches), realizes the same module as the id rule naming them, and a
static rule (``pattern:gelu`` int16) changes only that layer's slots; JSON round trip and
the errors naming the rule."""

from __future__ import annotations

import fnmatch

import numpy as np
import pytest
from test_escalation import data, tiny_transformer

import autoq
from autoq import Config, Override, QuantSpec
from autoq.ir.matching import match
from autoq.layer_rules import compile_layer_rule
from autoq.simulation import simulate
from models import TARGET, Runner

TOKEN = QuantSpec(dynamic=True, granularity="token")
BASE = Config(recipe="cnn", check_scales=False)


def _layers_by_pattern(mod, params, glob: str) -> list[str]:
    return [
        m.layer for m in match(mod, params, BASE).matches if fnmatch.fnmatch(m.pattern.name, glob)
    ]


def test_dense_rule_equals_the_id_rule():
    mod, params = tiny_transformer()
    dense = _layers_by_pattern(mod, params, "dense*")
    assert sorted(dense) == ["ffn.in", "ffn.out", "k", "o", "q", "v"]
    by_id = BASE.replace(overrides=(Override(f"re:({'|'.join(dense)})", activation=TOKEN),))
    by_kind = BASE.replace(overrides=(Override("pattern:dense*", activation=TOKEN),))
    calib, test = data(6, 1), data(2, 5)
    a = autoq.Quantizer(by_id, target=TARGET).run(mod, params, calib)
    b = autoq.Quantizer(by_kind, target=TARGET).run(mod, params, calib)
    assert b.module["main"].script().count('"qnn.dynamic_quantize"') == 4
    assert set(a.qparams.slots) == set(b.qparams.slots)
    ra, rb = Runner(a.module), Runner(b.module)
    for x in test:
        np.testing.assert_array_equal(ra(x), rb(x))


def test_static_rule_changes_only_that_pattern():
    mod, params = tiny_transformer()
    cfg = BASE.replace(overrides=(Override("pattern:gelu", activation=QuantSpec(dtype="int16")),))
    sim = simulate(match(mod, params, cfg), None, cfg)
    wide = sorted(s for s, sp in sim.plan.specs.items() if sp.dtype == "int16")
    gelu = _layers_by_pattern(mod, params, "gelu")
    assert gelu == ["gelu_0"]
    assert wide == sorted(sim.layer_slots["gelu_0"])  # its input and output, nothing else
    assert len(wide) == 2


def test_json_round_trip():
    cfg = BASE.replace(overrides=(Override("pattern:dense*", activation=TOKEN),))
    assert Config.from_json(cfg.to_json()) == cfg


def test_rule_predicate():
    rule = compile_layer_rule("pattern:dense_bias*")
    assert rule("o", "dense_bias_add") and not rule("o", "dense")
    assert compile_layer_rule("re:ffn\\..*")("ffn.in", None)  # id rules need no pattern
    with pytest.raises(ValueError, match=r"'pattern:dense_bias\*'.*layer 'o'.*without its pattern"):
        rule("o")


ERRORS = [
    (lambda: Override("pattern:", activation=TOKEN), r"rule 'pattern:' names no pattern"),
    (
        lambda: BASE.replace(overrides=(Override("pattern:conv*", activation=TOKEN),)),
        r"override 'pattern:conv\*' matches no quantized layer; patterns of the quantized "
        r"layers: .*dense_bias_add.*gelu",
    ),
]


@pytest.mark.parametrize("make,fragment", ERRORS)
def test_errors_name_the_rule(make, fragment):
    mod, params = tiny_transformer()
    with pytest.raises(ValueError, match=fragment):
        cfg = make()
        simulate(match(mod, params, cfg), None, cfg)
