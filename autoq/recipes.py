"""Named recipes: the options that measurably help one model family, as data.

A recipe fills the :class:`autoq.Config` fields left to it (``activation``, ``rounding``,
``check_scales``, ``rules``: None = "the recipe's choice") and puts its overrides before the
user's. ``Config(recipe="auto")``, the default, takes the recipe the model's structure
calls for (:func:`detect`); ``QuantizeResult.recipe`` and the command's report say which
and why. The tables that justify each recipe are in docs/recipes.md.

>>> from autoq.config import Config
>>> cfg = resolve_named(Config(recipe="transformer", rounding="float"))
>>> cfg.rounding, cfg.check_scales, cfg.rules
('float', False, ('residual_per_channel', 'lookup_per_channel'))
>>> resolve_named(cfg) == cfg  # resolving again changes nothing
True
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax

from autoq.config import Config, Override, QuantSpec
from autoq.ir.toolkit import bindings, free_vars, op_name, shape_of
from autoq.qnn.checks import static_int

__all__ = ["RECIPES", "Recipe", "detect", "resolve", "resolve_named"]


@dataclass(frozen=True)
class Recipe:
    """What one recipe sets: the values of the recipe fields, the overrides it adds (before
    the user's), what it is for and where it is measured."""

    summary: str
    activation: QuantSpec
    rounding: str = "float"
    check_scales: bool = True
    rules: tuple[str, ...] = ()
    overrides: tuple[Override, ...] = ()


def _percentile(p: float) -> QuantSpec:
    from autoq.calibrators.percentile import Percentile

    return QuantSpec(dtype="int8", calibrator=Percentile(percentile=p))


def _table() -> dict[str, Recipe]:
    mse = QuantSpec(dtype="int8", symmetric=False, calibrator="mse")
    dense_per_token = Override(
        "pattern:dense*", activation=QuantSpec(dynamic=True, granularity="token")
    )
    return {
        "cnn": Recipe(
            "convolutional networks without depthwise convs (ResNet-style): MSE activation "
            "ranges, per-channel GPTQ weights",
            activation=mse,
        ),
        "depthwise_cnn": Recipe(
            "depthwise-separable CNNs (MobileNet, EfficientNet, PP-OCR): percentile 99.99 "
            "ranges, per-channel grids on lookup and depthwise inputs, lookup range cuts",
            activation=_percentile(99.99),
            rules=("lookup_input_ranges", "lookup_per_channel", "depthwise_per_channel"),
        ),
        "transformer": Recipe(
            "attention / LayerNorm models: dense layers int8 with per-token run-time "
            "activation scales, the rest static int8, the residual stream and GELU lookups "
            "per channel, round half to even",
            activation=mse,
            rounding="half_even",
            check_scales=False,
            rules=("residual_per_channel", "lookup_per_channel"),
            overrides=(dense_per_token,),
        ),
        "dynamic": Recipe(
            "no calibration data: dense layers int8 with per-token run-time activation "
            "scales, everything else fp32",
            activation=QuantSpec(dynamic=True, granularity="token"),
        ),
    }


class _Recipes(dict):
    """The recipe table, built on first use (the percentile calibrator is a plug-in)."""

    def _fill(self):
        if not dict.__len__(self):
            self.update(_table())

    def __getitem__(self, name):
        self._fill()
        return dict.__getitem__(self, name)

    def __iter__(self):
        self._fill()
        return dict.__iter__(self)

    def __len__(self):
        self._fill()
        return dict.__len__(self)

    def items(self):
        self._fill()
        return dict.items(self)


#: name -> :class:`Recipe`
RECIPES: dict[str, Recipe] = _Recipes()


def detect(mod, params=None) -> tuple[str, str]:
    """``(recipe name, why)`` for a float model: an ``IRModule`` or its ``main`` with
    ``params`` the weights (by parameter name; the other parameters are the inputs), or an
    :class:`autoq.ir.graph.Graph`. A LayerNorm or a matmul of two computed tensors
    (attention) -> ``transformer``; a depthwise conv -> ``depthwise_cnn``; else ``cnn``."""
    if hasattr(mod, "weight_params"):  # a Graph
        mod, params = mod.func, [p.name for p in mod.weight_params]
    func = mod if isinstance(mod, relax.Function) else mod["main"]
    weights = set(params or ())
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


def resolve_named(config: Config) -> Config:
    """``config`` with its recipe's values in the fields left to it (``config.recipe`` must
    name a recipe, not ``"auto"``) and the recipe's overrides that it lacks put first."""
    if config.recipe == "auto":
        raise ValueError("resolve_named needs a recipe name; use resolve(config, mod) for 'auto'")
    r = RECIPES[config.recipe]
    changes = {f: getattr(r, f) for f in ("activation", "rounding", "check_scales", "rules")}
    changes = {k: v for k, v in changes.items() if getattr(config, k) is None}
    extra = tuple(o for o in r.overrides if o not in config.overrides)
    if extra:
        changes["overrides"] = extra + config.overrides
    return config.replace(**changes) if changes else config


def resolve(config: Config | None, mod, params=None) -> tuple[Config, str]:
    """``(config resolved for the model, why its recipe)``: ``"auto"`` replaced by the
    recipe :func:`detect` picks for ``mod`` / ``params`` (as there), then
    :func:`resolve_named`."""
    config = config or Config()
    if config.recipe == "auto":
        name, why = detect(mod, params)
        config = config.replace(recipe=name)
    else:
        why = "named in Config.recipe"
    return resolve_named(config), why


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
