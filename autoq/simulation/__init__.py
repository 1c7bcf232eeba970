"""Stage 1, simulate: rewrite every matched pattern into its simulated-quantized form.

The simulated module's ``main`` takes the model's inputs, its weight parameters, and then,
for every slot, ``<slot>.scale`` (float32) and ``<slot>.zero_point`` (int32) as *runtime
inputs*: one compiled module serves every choice of qparams during calibration.

Values inside a simulated pattern are float32 tensors holding integers
(``qnn.simulated_quantize``) or reals (``qnn.simulated_dequantize``); accumulations run on
integer-valued floats, exactly as the integer graph computes them (see docs/design.md,
"Fidelity"). Everything outside the matches stays fp32.

**Per-layer switches** (``simulate(..., switches=True)``, used by :mod:`autoq.analyze`; the
default graph has none). ``main`` then also takes one float32 scalar ``<layer>.enable`` per
layer, after the qparams, and every ``qnn.simulated_quantize`` a layer emits (its input
activations, weight, bias, residual, output) gets that switch: 1 quantizes, 0 passes the
float value through (see :func:`autoq.qnn.simulated_quantize`), so a layer set to 0 computes
what that layer computes when it is left in fp32 (``Fallback(ids=[layer])``), up to float32
rounding. To make that true for shared tensors, each consumer quantizes its activation
inputs itself, with its own switch, instead of reusing the first consumer's quantized
tensor (an output slot is re-quantized from its dequantized value, which gives the same
integers). With every switch at 1 the graph computes exactly what the default graph does.
"""

from __future__ import annotations

from typing import Any

from tvm import relax

from autoq.config import Config
from autoq.config.progress import bar
from autoq.config.recipe_table import RECIPES
from autoq.ir.graph import Graph
from autoq.ir.matching import as_matched, closest
from autoq.ir.registry import Match
from autoq.ir.toolkit import (
    with_main,
)
from autoq.layer_rules import PATTERN_RULE, compile_layer_rule
from autoq.recipes import resolve
from autoq.rules import hybrid
from autoq.rules.exits import exit_tensors

__all__ = ["SimContext", "SimResult", "SlotPlan", "simulate", "validate_overrides"]


from autoq.simulation.context import SimContext, SlotPlan
from autoq.simulation.result import SimResult


def validate_overrides(config: Config, matches: list[Match]) -> None:
    """Every override the user wrote must match one of the (quantized) ``matches``: else an
    error naming the closest layer ids (a recipe's own overrides may match nothing: a
    transformer without dense layers)."""
    layers = [m.layer for m in matches]
    own = RECIPES[config.recipe].overrides if config.recipe in RECIPES else ()
    for o in config.overrides:
        if o in own:
            continue
        rule = compile_layer_rule(o.match)
        if any(rule(m.layer, m.pattern.name) for m in matches):
            continue
        if o.match.startswith(PATTERN_RULE):
            names = sorted({m.pattern.name for m in matches})
            raise ValueError(
                f"override {o.match!r} matches no quantized layer; patterns of the quantized "
                f"layers: {', '.join(names)}"
            )
        raise ValueError(
            f"override {o.match!r} matches no quantized layer; closest layer ids: "
            f"{closest(o.match.removeprefix('re:'), layers)}"
        )


def build_function(
    g: Graph, ctx: Any, matches: list[Match], callback, extra_params=lambda: [], desc: str = ""
) -> relax.Function:
    """Shared by simulate and realize: walk the bindings in topological order, emit every
    match through its callback (the pattern attribute named ``callback``, or
    ``callback(match)`` when it is a function) and copy every other binding (``ctx.copy``),
    then wrap in a function of the graph's inputs, weights and ``extra_params()`` (known
    after the walk). ``desc``: the name of the progress bar over the layers (drawn inside
    a shown run, :mod:`autoq.config.progress`)."""
    by_root = {m.root: m for m in matches}
    interior = {v for m in matches for v in m.covered if not v.same_as(m.root)}
    layers = bar(total=len(matches), desc=desc or "layers", unit="layer")
    try:
        for var, value in g.bindings:
            if var in interior:
                continue
            if var in by_root:
                m = by_root[var]
                ctx.match = m
                name = callback(m) if callable(callback) else callback
                new = getattr(m.pattern, name)(ctx, m)
                ctx.match = None
                layers.update(1)
                nv = new if isinstance(new, relax.Var) else ctx.emit(new, var.name)
            else:
                nv = ctx.emit(ctx.copy(value), var.name)
            ctx.vmap[var] = nv
        result = ctx.copy_result(g.output)  # (may create exit slots: before the params)
    except BaseException:
        ctx.writer.abandon()
        raise
    finally:
        layers.close()
    params = list(g.inputs) + list(g.weight_params) + list(extra_params())
    func = ctx.writer.finish(params, result)
    return func.with_attr("global_symbol", "main")


def simulate(
    model,
    params: dict | None = None,
    config: Config | None = None,
    switches: bool = False,
    *,
    exits: bool = True,
) -> SimResult:
    """Rewrite ``model`` into its simulated-quantized form (see the module docstring).

    ``model``: the fp32 ``IRModule`` (matched here) or its :class:`autoq.ir.matching.Matched`
    (reused: nothing is matched again). ``switches=True`` adds a runtime ``<layer>.enable``
    input per layer (module docstring); slots, qparam inputs and, with every switch at 1,
    all values are those of the default graph. ``exits``: give every int32 result a float
    op reads an exit slot (:mod:`autoq.rules.exits`; off for a pre-quantized file, which fixes
    its own rounding points)."""
    matched = as_matched(model, params, config or Config())
    g = matched.graph
    config = resolve(config, g)[0]
    if not g.inputs:
        raise ValueError("the model has no data inputs (every parameter is in params)")
    matches = matched.active(config.fallback)
    validate_overrides(config, matches)
    hybrid.check_dynamic_layers(config, matches)
    dynamic = hybrid.dynamic_names(config, matches)
    ctx = SimContext(
        g,
        config,
        matches,
        switches,
        exit_tensors(g, matches, config.int8_outputs, dynamic) if exits else None,
    )

    def qparam_inputs():
        qvars = [v for pair in ctx.qparam_vars.values() for v in pair]
        qvars += list(ctx.table_vars.values()) + list(ctx.value_vars.values())
        return qvars + [ctx.switch_vars[m.layer] for m in matches if m.layer in ctx.switch_vars]

    callback = hybrid.callbacks(dynamic, "simulate", "simulate_dynamic")
    func = build_function(g, ctx, matches, callback, qparam_inputs, desc="simulate")
    _check_int16_tensors(config, ctx.plan)
    return SimResult(
        with_main(g.module, func),
        g,
        matches,
        ctx.plan,
        ctx.qparam_vars,
        ctx.sq_vars,
        switch_vars=dict(ctx.switch_vars),
        values=dict(ctx.vmap),
        layer_slots=dict(ctx.layer_slots),
        matched=matched,
        table_vars=dict(ctx.table_vars),
        value_vars=dict(ctx.value_vars),
        config=config,
    )


def _check_int16_tensors(config: Config, plan: SlotPlan) -> None:
    acts = [s for s, info in plan.slots.items() if info.kind == "activation"]
    bad = [t for t in config.int16_tensors if t not in acts]
    if bad:
        raise ValueError(
            f"Config.int16_tensors names {bad} which are not activation tensors of the "
            f"quantized model; closest slot ids: {closest(bad[0], acts)}"
        )
