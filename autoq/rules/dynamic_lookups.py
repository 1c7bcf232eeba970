"""A lookup between dynamic layers runs in float (``Config.rules`` "lookup_between_dynamic").

A transformer's FFN is ``dense -> GELU -> dense``. With the dense layers dynamic
(:mod:`autoq.rules.hybrid`), the first one's result is float32 and the second one quantizes
its float input per token at run time: no integer op writes the GELU's input or reads its
output. As an 8-bit table lookup the GELU would still round twice (its input and output
grids, per channel with "lookup_per_channel") before the second dense layer rounds a third
time, per token. With this rule such a lookup layer is kept in float: the second dense
layer's run-time quantize is its output's one rounding, and every matmul stays int8.

A lookup layer (the patterns of :data:`autoq.rules.lut_channels.LUT_PATTERNS`) qualifies when
its input is the result of a dynamic layer and every reader of its output is a dynamic layer,
both possibly through data-movement ops outside every match (the reshapes between
``(tokens, hidden)`` and ``(1, tokens, hidden)``); never when its output is a model output.
The pipeline adds them to ``Config.fallback``'s ids (``QuantizeResult.fp32_layers`` gives the
reason). all-MiniLM-L6-v2, 32 calibration sentences: embedding cosine 0.99608 -> 0.99767 on
64 pydoc sentences, 0.99550 -> 0.99776 on 320 pooled ones (docs/recipes.md).
"""

from __future__ import annotations

from autoq.ir.allow_list import ALLOW_LIST
from autoq.ir.toolkit import op_name
from autoq.rules.hybrid import dynamic_names
from autoq.rules.lut_channels import LUT_PATTERNS

__all__ = ["REASON", "lookups_between_dynamic"]

#: the reason :attr:`autoq.pipeline.QuantizeResult.fp32_layers` gives for these layers
REASON = 'float between dynamic layers (Config.rules "lookup_between_dynamic")'


def _moved(g, var) -> bool:
    """Whether ``var`` is a data-movement (commute) op's result."""
    value = g.value.get(var)
    rule = ALLOW_LIST.get(op_name(value)) if value is not None else None
    return rule is not None and rule.kind == "commute" and op_name(value) != "relax.concat"


def lookups_between_dynamic(matched, config) -> list[str]:
    """The lookup layers of ``matched`` (fallback applied) that run in float under
    ``config`` (module docstring), in topological order; empty when the rule is off."""
    if not config.has_rule("lookup_between_dynamic"):
        return []
    g = matched.graph
    matches = matched.active(config.fallback)
    dynamic = dynamic_names(config, matches)
    roots = {m.root: m for m in matches}
    owner = {v: m for m in matches for v in m.covered}
    outputs = set(g.output_vars())

    def written_by_dynamic(var) -> bool:
        while var not in roots and var not in owner and _moved(g, var):
            var = g.value[var].args[0]
        m = roots.get(var)
        return m is not None and m.layer in dynamic

    def read_by_dynamic(var) -> bool:
        users = g.users.get(var, [])
        if not users or var in outputs:
            return False
        for u in users:
            m = owner.get(u)
            if m is not None:
                if m.layer not in dynamic:
                    return False
            elif not (_moved(g, u) and read_by_dynamic(u)):
                return False
        return True

    out = []
    for m in matches:
        if m.pattern.name in LUT_PATTERNS and m.layer not in dynamic:
            if written_by_dynamic(m["data"]) and read_by_dynamic(m.root):
                out.append(m.layer)
    return out
