"""The named recipes as data: for each model family, the values of the fields a recipe
decides and the overrides it adds. Where each comes from (the measured tables):
docs/recipes.md. :mod:`autoq.recipes` picks one from the model's structure.

>>> sorted(RECIPES)
['cnn', 'depthwise_cnn', 'dynamic', 'transformer']
>>> RECIPES["transformer"].rounding
'half_even'
>>> RECIPES["depthwise_cnn"].bias_correction, RECIPES["cnn"].bias_correction
(BiasCorrection(holdout=0), False)
"""

from __future__ import annotations

from dataclasses import dataclass

from autoq.config.specs import BiasCorrection, Override, QuantSpec

__all__ = ["RECIPES", "RECIPE_FIELDS", "Recipe"]

#: the Config fields a recipe fills when they are None
RECIPE_FIELDS = ("activation", "rounding", "check_scales", "rules", "bias_correction")


@dataclass(frozen=True)
class Recipe:
    """What one recipe sets: the values of the recipe fields, the overrides it adds (before
    the user's), what it is for and where it is measured. ``bias_correction``: a
    :class:`BiasCorrection` (the empirical correction on) or False (off)."""

    summary: str
    activation: QuantSpec
    rounding: str = "float"
    check_scales: bool = True
    rules: tuple[str, ...] = ()
    overrides: tuple[Override, ...] = ()
    bias_correction: BiasCorrection | bool = False

    def __post_init__(self) -> None:
        bc = self.bias_correction
        if bc is not False and not isinstance(bc, BiasCorrection):
            raise TypeError(f"Recipe.bias_correction must be a BiasCorrection or False, got {bc!r}")


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
            "depthwise-separable CNNs (MobileNet, EfficientNet, PP-OCR): as cnn, with "
            "per-channel grids on the lookup and depthwise inputs, lookup range cuts, min / max "
            "ranges on ReLU6 outputs and the empirical bias correction",
            activation=mse,
            rules=(
                "lookup_input_ranges",
                "lookup_per_channel",
                "depthwise_per_channel",
                "clip_output_ranges",
            ),
            bias_correction=BiasCorrection(),
        ),
        "transformer": Recipe(
            "attention / LayerNorm models: dense layers int8 with per-token run-time "
            "activation scales, the lookups between them (the FFN GELU) in float, the rest "
            "static int8, the residual stream per channel, masked softmax inputs cut below the "
            "scores, round half to even",
            activation=mse,
            rounding="half_even",
            check_scales=False,
            rules=(
                "residual_per_channel",
                "lookup_per_channel",
                "softmax_input_ranges",
                "lookup_between_dynamic",
            ),
            overrides=(dense_per_token,),
        ),
        "dynamic": Recipe(
            "no calibration data: dense layers int8 with per-token run-time activation "
            "scales, everything else fp32",
            activation=QuantSpec(dynamic=True, granularity="token"),
        ),
    }


#: name -> :class:`Recipe`
RECIPES: dict[str, Recipe] = _table()
