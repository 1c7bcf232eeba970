"""prepare() (ids, weights) and pattern matching (priority rule, fallback, registry)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import Config, Fallback
from autoq.ir.graph import GraphError, prepare
from autoq.ir.matching import find_matches, layer_ids, root_op
from autoq.ir.registry import PATTERNS, Pattern, ordered_patterns, register
from models import Builder, attention, conv, ln_block, mlp, small_cnn


def _by_layer(matches):
    return {m.layer: m.pattern.name for m in matches}


def test_ids_are_op_kind_and_topological_index():
    mod, params, _ = small_cnn()
    g = prepare(mod, params)
    ids = [g.ids[v] for v, _ in g.bindings]
    # every id is unique; the convolutions are numbered in order
    assert len(set(ids)) == len(ids)
    convs = [i for i in ids if i.startswith("conv2d_")]
    assert convs == [f"conv2d_{k}" for k in range(4)]
    # parameters keep their names; ids do not change between runs
    assert g.ids[g.inputs[0]] == "x"
    g2 = prepare(mod, params)
    assert [g2.ids[v] for v, _ in g2.bindings] == ids


def test_weights_through_data_movement_keep_their_name():
    mod, params, _ = small_cnn()
    g = prepare(mod, params)
    # fc is matmul(x, permute_dims(fc.weight)): the permuted value is a weight named fc.weight
    permuted = [
        v
        for v, e in g.bindings
        if getattr(e, "op", None) is not None and e.op.name == "relax.permute_dims"
    ]
    assert len(permuted) == 1
    ref = g.weights[permuted[0]]
    assert ref.name == "fc.weight"
    np.testing.assert_array_equal(ref.array, params["fc.weight"].T)


def test_prepare_rejects_unknown_and_misshaped_params():
    mod, params, _ = small_cnn()
    with pytest.raises(GraphError, match=r"\['nope'\] are not parameters of 'main'"):
        prepare(mod, {**params, "nope": np.zeros(3)})
    bad = dict(params)
    bad["fc.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(
        GraphError, match=r"'fc.weight' has shape \(3, 3\), the function expects \(10, 8\)"
    ):
        prepare(mod, bad)


def test_layer_ids_and_patterns_of_the_cnn():
    mod, params, _ = small_cnn()
    m = find_matches(prepare(mod, params), Config(recipe="cnn"))
    assert _by_layer(m) == {
        "stem": "conv2d_bias",
        "block.conv1": "conv2d_bias",
        # conv2d + bias + residual add: the biggest pattern wins
        "block.conv2": "conv2d_bias_add",
        "dw": "conv2d_bias",
        "mean_0": "mean",
        "fc": "dense_bias",
    }


def _conv_bias_used_twice():
    """conv+bias whose biased output feeds both a residual add and a relu: the add cannot
    absorb the conv (its interior value escapes), so conv2d_bias and add match separately."""
    b = Builder(0)
    x = b.input("x", (1, 4, 8, 8))

    def body(b):
        y = conv(b, x, "c1", 4, 4)
        z = conv(b, x, "c2", 4, 4)
        s = b.emit(relax.op.add(y, z))
        return b.emit(relax.op.add(s, relax.op.nn.relu(y)))

    return b.build(body)


def test_interior_values_used_outside_reject_a_match():
    mod, params = _conv_bias_used_twice()
    m = find_matches(prepare(mod, params))
    got = _by_layer(m)
    # c1's biased output is used twice: conv2d_bias_add would hide it, so c1 is conv2d_bias;
    # c2 is used once, by the add, which it absorbs as its residual
    assert got["c1"] == "conv2d_bias"
    assert got["c2"] == "conv2d_bias_add"


def test_priority_orders_patterns_by_size_then_name():
    names = [p.name for p in ordered_patterns()]
    assert names.index("conv2d_bias_add") < names.index("conv2d_bias") < names.index("conv2d")
    assert names.index("dense_bias_add") < names.index("dense_bias") < names.index("dense")


def test_fallback_by_id_type_and_regex():
    mod, params, _ = small_cnn()
    g = prepare(mod, params)
    all_layers = layer_ids(g)
    by_id = [
        m.layer
        for m in find_matches(g, Config(recipe="cnn", fallback=Fallback(ids=("block.conv1",))))
    ]
    assert by_id == [x for x in all_layers if x != "block.conv1"]
    by_type = [
        m.layer
        for m in find_matches(g, Config(recipe="cnn", fallback=Fallback(op_types=("conv2d",))))
    ]
    assert by_type == ["mean_0", "fc"]
    by_glob = [
        m.layer
        for m in find_matches(g, Config(recipe="cnn", fallback=Fallback(patterns=("block.*",))))
    ]
    assert by_glob == ["stem", "dw", "mean_0", "fc"]
    by_re = [
        m.layer
        for m in find_matches(
            g, Config(recipe="cnn", fallback=Fallback(patterns=(r"re:(stem|fc)",)))
        )
    ]
    assert by_re == ["block.conv1", "block.conv2", "dw", "mean_0"]


@pytest.mark.parametrize(
    "fb, message",
    [
        (
            Fallback(ids=("block.conv3",)),
            r"fallback id 'block.conv3' matches no layer; closest layer ids: block.conv2, block.conv1",
        ),
        (
            Fallback(op_types=("softmax",)),
            r"fallback op type 'softmax' matches no layer; op types in this model: .*conv2d",
        ),
        (
            Fallback(patterns=("blok.*",)),
            r"fallback pattern 'blok.\*' matches no layer; closest layer ids: block",
        ),
    ],
)
def test_fallback_rule_that_matches_nothing_is_an_error(fb, message):
    mod, params, _ = small_cnn()
    with pytest.raises(ValueError, match=message):
        find_matches(prepare(mod, params), Config(recipe="cnn", fallback=fb))


def test_a_new_pattern_is_one_registration():
    """Registering a Pattern is all it takes for matching to use it (here: exp, which no
    shipped pattern covers)."""
    name = "test_exp"

    def build():
        x = wildcard()
        return is_op("relax.exp")(x), {"data": x}

    pat = Pattern(
        name, 1, build, lambda g, n: None, lambda c, m: None, lambda c, m: None, weight=None
    )
    b = Builder(0)
    x = b.input("x", (1, 4))
    mod, params = b.build(lambda b: b.emit(relax.op.exp(x)))
    try:
        register(pat)
        m = find_matches(prepare(mod, params))
        assert [(mm.layer, mm.pattern.name) for mm in m] == [("exp_0", name)]
    finally:
        PATTERNS.pop(name, None)
    assert find_matches(prepare(mod, params)) == []


def test_unknown_pattern_names_in_config_are_an_error():
    mod, params, _ = small_cnn()
    with pytest.raises(ValueError, match=r"unknown patterns \['conv3d'\]"):
        find_matches(prepare(mod, params), Config(recipe="cnn", patterns=("conv3d",)))
    only_dense = find_matches(prepare(mod, params), Config(recipe="cnn", patterns=("dense_bias",)))
    assert [m.layer for m in only_dense] == ["fc"]


@pytest.mark.parametrize("build", [small_cnn, mlp, attention, ln_block])
def test_a_call_of_another_op_than_the_root_op_never_matches(build):
    """The matcher skips the bindings whose call is not of a pattern's root op: TVM's own
    matcher finds nothing there either (every registered pattern, every binding)."""
    mod, params = build()[:2]
    g = prepare(mod, params)
    v2v = dict(g.value)
    filtered = checked = 0
    for pat in ordered_patterns(None):
        alts = pat.build()
        for root_pat, _ in alts if isinstance(alts, list) else [alts]:
            op = root_op(root_pat)
            for _, value in g.bindings:
                if not isinstance(value, relax.Call):
                    continue
                hit = root_pat.extract_matched_expr(value, v2v) is not None
                checked += hit
                if op is not None and not value.op.same_as(op):
                    filtered += 1
                    assert not hit, (pat.name, value.op)
    assert filtered > 0 and checked > 0
