"""Named recipes: the options that measurably help one model family.

A recipe (the table :data:`RECIPES`, in :mod:`autoq.config.recipe_table`) fills the
:class:`autoq.Config` fields left to it (``activation``, ``rounding``, ``check_scales``,
``rules``: None = "the recipe's choice") and puts its overrides before the user's.
``Config(recipe="auto")``, the default, takes the recipe the model's structure calls for
(:func:`detect`, applied by :func:`resolve` when a stage starts); ``QuantizeResult.recipe``
and the command's report say which and why. The tables that justify each recipe are in
docs/recipes.md.

>>> from autoq.config import Config
>>> cfg = Config(recipe="transformer", rounding="float")
>>> cfg.rounding, cfg.check_scales, cfg.rules
('float', False, ('residual_per_channel', 'lookup_per_channel'))
>>> cfg.replace() == cfg  # filling again changes nothing
True
"""

from __future__ import annotations

from tvm import relax

from autoq.config import Config
from autoq.config.recipe_table import RECIPES, Recipe
from autoq.ir.toolkit import bindings, free_vars, op_name, shape_of
from autoq.qnn.checks import static_int

__all__ = ["RECIPES", "Recipe", "detect", "resolve"]


def detect(mod, params=None) -> tuple[str, str]:
    """``(recipe name, why)`` for a float model: an ``IRModule`` or its ``main`` with
    ``params`` the weights (by parameter name; the other parameters are the inputs; without
    them the module's ``num_input`` attribute says which parameters are inputs), or an
    :class:`autoq.ir.graph.Graph`. A LayerNorm or a matmul of two computed tensors
    (attention) -> ``transformer``; a depthwise conv -> ``depthwise_cnn``; else ``cnn``."""
    if hasattr(mod, "weight_params"):  # a Graph
        mod, params = mod.func, [p.name for p in mod.weight_params]
    func = mod if isinstance(mod, relax.Function) else mod["main"]
    weights = set(params or ()) or _weights_by_attr(func)
    data = {v for v in func.params if v.name not in weights}
    seen: dict[str, str] = {}
    for var, value in bindings(func):
        if any(u in data for u in free_vars(value)):
            data.add(var)
        if not isinstance(value, relax.Call):
            continue
        name = op_name(value)
        if name == "relax.nn.layer_norm":
            seen.setdefault("layer_norm", "a LayerNorm")
        elif name == "relax.matmul" and all(a in data for a in value.args[:2]):
            seen.setdefault("attention", "a matmul of two activations (attention)")
        elif name == "relax.nn.conv2d" and _depthwise(value):
            seen.setdefault("depthwise", "depthwise convs")
    if "layer_norm" in seen or "attention" in seen:
        why = " and ".join(v for k, v in seen.items() if k != "depthwise")
        return "transformer", f"the model has {why}"
    if "depthwise" in seen:
        return "depthwise_cnn", "the model has depthwise convs"
    return "cnn", "no attention, LayerNorm or depthwise conv"


def resolve(config: Config | None, mod, params=None) -> tuple[Config, str]:
    """``(config resolved for the model, why its recipe)``: ``"auto"`` replaced by the
    recipe :func:`detect` picks for ``mod`` / ``params`` (as there); a config naming a recipe
    is resolved already (:class:`autoq.config.Config` fills its fields on construction)."""
    config = config or Config()
    if config.recipe != "auto":
        return config, "named in Config.recipe"
    name, why = detect(mod, params)
    return config.replace(recipe=name), why


def _weights_by_attr(func: relax.Function) -> set[str]:
    """Without ``params``: the parameters after the first ``num_input`` (Relax's attribute
    for "the rest are weights", which the importers set), else none."""
    n = func.attrs.get("num_input") if func.attrs is not None else None
    return set() if n is None else {p.name for p in list(func.params)[int(n) :]}


def _depthwise(call) -> bool:
    """A conv2d whose every group reads one input channel and writes one output channel."""
    x, w = shape_of(call.args[0]), shape_of(call.args[1])
    groups = int(call.attrs.groups)
    if x is None or w is None or len(x) != 4 or len(w) != 4 or groups <= 1:
        return False
    c = static_int(x[str(call.attrs.data_layout).index("C")])
    kernel = str(call.attrs.kernel_layout)
    per_group = static_int(w[kernel.index("I")])
    return c is not None and groups == c and per_group == 1
