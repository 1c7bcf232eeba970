"""Configs written before recipes (one version back): the removed fields translated to
their new home, dropped at their old default, or refused by name (they measured no gain).

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     warnings.simplefilter("always")
...     d = from_old_json({"lut_input_per_channel": True, "progress": False, "rounding": "float"})
>>> d["rules"], d["recipe"]
(['lookup_per_channel'], 'cnn')
"""

from __future__ import annotations

from autoq.json_document import drop_removed

__all__ = ["REMOVED_FIELDS", "from_old_json"]


def _rule_moved(rule: str):
    def move(value, d: dict) -> str:
        rules = list(d.get("rules") or [])
        if value and rule not in rules:
            d["rules"] = [*rules, rule]
        return f"Config.rules containing {rule!r}"

    return move


def _ebc_moved(value, d: dict) -> str:
    if value:
        d["bias_correction"] = {"holdout": d.get("bias_correction_holdout") or 0}
    return "Config.bias_correction=BiasCorrection(holdout=...)"


def _holdout_moved(value, d: dict) -> str:
    if isinstance(d.get("bias_correction"), dict):
        d["bias_correction"] = {"holdout": value}
    return "BiasCorrection.holdout"


_RESOURCE = "a keyword argument of autoq.Quantizer / autoq.quantize (--{} on the command line)"
#: Config fields of configs written before recipes (one version back): field -> (its old
#: default, where it went); see :func:`autoq.json_document.drop_removed`
REMOVED_FIELDS = {
    "memory_budget_mb": (1024.0, _RESOURCE.format("memory-budget")),
    "cache_dir": (None, _RESOURCE.format("cache-dir")),
    "progress": (True, _RESOURCE.format("quiet")),
    "distributed": (None, _RESOURCE.format("workers / --scheduler")),
    # the plain (DFQ) correction and these options measured no gain: refused when set
    "bias_correction": (False, None),
    "bias_correction_skip": ((), None),
    "scale_search": (False, None),
    "equalization": (False, None),
    "smooth_quant_alphas": ((), None),
    "token_mask": (None, None),
    "dynamic_gptq": (False, None),
    "residual_int16_per_channel": (False, None),
    # moved into Config.bias_correction / Config.rules
    "empirical_bias_correction": (False, _ebc_moved),
    "bias_correction_holdout": (0, _holdout_moved),
    "lut_input_ranges": (False, _rule_moved("lookup_input_ranges")),
    "lut_input_per_channel": (False, _rule_moved("lookup_per_channel")),
    "depthwise_input_per_channel": (False, _rule_moved("depthwise_per_channel")),
    "residual_per_channel": (False, _rule_moved("residual_per_channel")),
}


def from_old_json(d: dict) -> dict:
    """A config.json of the version before recipes: the removed fields translated (or
    refused, naming them) and the rest as it was, as the ``cnn`` recipe (its old default)
    with every recipe field concrete."""
    d = drop_removed("Config", d, REMOVED_FIELDS)
    d.setdefault("rules", [])
    d.setdefault("rounding", "float")
    d.setdefault("check_scales", True)
    d.setdefault("activation", {"calibrator": "mse"})
    d["recipe"] = "cnn"
    return d
