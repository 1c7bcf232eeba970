"""Which layers leave int8: fixed rules (:class:`Fallback`) and the automatic search's
options (:class:`AutoFallback`), plus the layer-id rule syntax they share.

>>> rule = compile_rule("layer[34].*")
>>> rule("layer3.conv1"), rule("layer2.conv1")
(True, False)
>>> Fallback(ids="fc").ids
('fc',)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autoq.errors import InputError
from autoq.json_document import callable_from_json, callable_to_json, check_keys, drop_removed

__all__ = [
    "AUTO_PRECISIONS",
    "AUTO_RANKINGS",
    "FALLBACK_TYPES",
    "MAX_RULE_CHARS",
    "PATTERN_RULE",
    "AutoFallback",
    "Fallback",
    "check_rule_length",
    "compile_layer_rule",
    "compile_rule",
    "str_tuple",
]


#: the longest layer id, op type or rule autoq takes (a longer one is a mistake: matching a
#: 100,000-character glob of ``[`` took minutes, a deeply nested regex overflowed the parser)
MAX_RULE_CHARS = 1024


def check_rule_length(rule: str, where: str) -> None:
    """Refuse a rule longer than :data:`MAX_RULE_CHARS`, naming ``where`` and its start.

    >>> check_rule_length("x" * 2000, "Fallback.ids")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoq.errors.InputError: Fallback.ids: a rule of 2000 characters ('xxxxxxxxxxxxxxxxxxxx'...) is longer ...
    """
    if len(rule) > MAX_RULE_CHARS:
        raise InputError(
            f"{where}: a rule of {len(rule)} characters ({rule[:20]!r}...) is longer than the "
            f"{MAX_RULE_CHARS} characters a layer id, op type, glob or regex may have: name "
            "the layers by their ids (report.txt or QuantizeResult.int8_layers list them) or "
            "a shorter glob"
        )


def str_tuple(obj, name: str) -> None:
    """Normalize the field ``name`` of a frozen dataclass to a tuple of non-empty strings
    (each at most :data:`MAX_RULE_CHARS` long)."""
    v = getattr(obj, name)
    if isinstance(v, str):
        v = (v,)
    v = tuple(v)
    if not all(isinstance(x, str) and x for x in v):
        raise TypeError(
            f"{type(obj).__name__}.{name} must be a sequence of non-empty strings, got {v!r}"
        )
    for x in v:
        check_rule_length(x, f"{type(obj).__name__}.{name}")
    object.__setattr__(obj, name, v)


def compile_rule(rule: str):
    """A layer-id rule as a predicate: ``re:<regex>`` (full match), a glob (``*``, ``?``,
    ``[...]``), or an exact id."""
    import fnmatch

    check_rule_length(rule, "layer rule")
    if rule.startswith("re:"):
        try:
            rx = re.compile(rule[3:])
        except re.error as e:
            raise InputError(f"invalid regular expression in rule {rule!r}: {e}") from None
        except RecursionError:
            raise InputError(
                f"invalid regular expression in rule {rule[:40]!r}...: nested too deeply"
            ) from None
        return lambda s: rx.fullmatch(s) is not None
    if any(c in rule for c in "*?["):
        return lambda s: fnmatch.fnmatchcase(s, rule)
    return lambda s: s == rule


#: prefix of an ``Override.match`` that selects layers by their pattern's name (a glob):
#: ``"pattern:dense*"`` is every dense layer (``dense``, ``dense_bias``, ``dense_bias_add``)
PATTERN_RULE = "pattern:"


def compile_layer_rule(rule: str):
    """An ``Override.match`` as a predicate ``(layer id, pattern name) -> bool``:
    ``pattern:<glob>`` matches the layer's pattern name, any other rule its id
    (:func:`compile_rule`). A pattern rule asked about a layer without its pattern name
    (None) is an error naming the rule and the layer.

    >>> rule = compile_layer_rule("pattern:dense*")
    >>> rule("fc1", "dense_bias"), rule("matmul_3", "matmul")
    (True, False)
    """
    import fnmatch

    if not rule.startswith(PATTERN_RULE):
        by_id = compile_rule(rule)
        return lambda layer, pattern=None: by_id(layer)
    glob = rule[len(PATTERN_RULE) :]
    if not glob:
        raise ValueError(f"rule {rule!r} names no pattern: write e.g. 'pattern:dense*'")

    def by_pattern(layer: str, pattern: str | None = None) -> bool:
        if pattern is None:
            raise ValueError(
                f"rule {rule!r} selects layers by pattern name, but layer {layer!r} was "
                "looked up without its pattern"
            )
        return fnmatch.fnmatchcase(pattern, glob)

    return by_pattern


@dataclass(frozen=True)
class Fallback:
    """Layers to keep in fp32 (like NNCF's IgnoredScope).

    ``ids``: exact layer ids; ``op_types``: pattern names or op names (``"conv2d"``,
    ``"matmul"``, ``"add"``); ``patterns``: globs (``"layer4.*"``) or regexes
    (``"re:layer[34]\\..*"``). With ``validate`` (default) a rule that matches no layer is an
    error that lists the closest ids.
    """

    ids: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    validate: bool = True

    def __post_init__(self) -> None:
        for name in ("ids", "op_types", "patterns"):
            str_tuple(self, name)
        for p in self.patterns:
            compile_rule(p)

    def __bool__(self) -> bool:
        return bool(self.ids or self.op_types or self.patterns)

    def to_json(self) -> dict:
        return {
            "ids": list(self.ids),
            "op_types": list(self.op_types),
            "patterns": list(self.patterns),
            "validate": self.validate,
        }

    @classmethod
    def from_json(cls, d: dict) -> Fallback:
        check_keys(cls, d)
        return cls(**d)


AUTO_RANKINGS = ("local", "revert")
AUTO_PRECISIONS = ("fp32", "int16", "int16_tensors", "int16_first")
#: calibration samples the int16 searches' SQNR trials run on (the held-out ones never):
#: all-MiniLM-L6-v2 with 12 instead of 4 changed one of 23 tensors at 2.3x the search time
TRIAL_SAMPLES = 4
AUTO_SEARCHES = ("greedy", "eliminate")


@dataclass(frozen=True)
class AutoFallback(Fallback):
    """Choose the layers to keep in fp32 automatically (see :mod:`autoq.analyze`).

    ``autoq.quantize`` calibrates once, ranks the layers by sensitivity, then tries keeping
    the ``k`` most sensitive layers in fp32 for ``k = 0, 1, 2, ...`` until the metric is
    within budget (or ``max_fp32_layers`` is reached), and realizes the winner as an ordinary
    ``Fallback(ids=...)``. A trial is one run of the already compiled simulated graph with
    per-layer switches (no recalibration, no recompilation). The decision is attached to the
    result as ``result.attrs["autoq.fallback"]`` (JSON, see :class:`autoq.FallbackDecision`).

    ``ids`` / ``op_types`` / ``patterns`` (inherited from :class:`Fallback`): layers that
    always stay fp32 and are not candidates.

    ``metric``: ``"sqnr"`` (default): the SQNR in dB of the model outputs on the calibration
    data against fp32; the budget is ``sqnr >= min_sqnr``. Or a callable
    ``metric(run) -> float`` (higher is better) where ``run(samples)`` runs the model under
    test (the fp32 reference or a trial) on any samples (``{input: array}`` dicts or arrays)
    and returns one output per sample (a numpy array, or a list of arrays for several
    outputs): e.g. accuracy on a labelled set. The budget is
    ``metric(run_fp32) - metric(run_trial) <= max_drop``.

    ``max_fp32_layers``: most layers the search may keep in fp32 (when even that misses the
    budget, the best trial is used and the decision says ``met=False``).
    ``ranking``: ``"local"`` (default, free): by the SQNR of each layer's output with only
    that layer quantized on fp32 inputs (the analysis report's "alone" column, lowest
    first); ``"revert"``: by the metric with everything quantized except that one layer
    (one trial per layer, like NNCF's accuracy control; better for unusual networks).
    ``precision``: ``"fp32"``, or ``"int16"``: the chosen layers get int16 activations
    (``Override(layer, activation=QuantSpec(dtype="int16", ...))``) instead of fp32 when that
    still meets the budget (checked with one more compiled simulated graph; int16 qparams
    come from the calibrated ranges), else they fall back to fp32.
    ``holdout``: the last ``holdout`` samples of the dataset are kept out of calibration and
    of the ranking; a layer group the search adds is kept only if it also raises the output
    SQNR on them (else it is skipped and the search goes on with the next one), so the
    fp32 layers are the ones that help beyond the calibration samples. With a callable
    ``metric`` the held-out check uses the output SQNR too (the metric decides the budget).
    ``precision="int16_tensors"``: no layer leaves int8; instead activation *tensors* the
    metric is most sensitive to go int16 (greedy by measured effect, at most
    ``max_int16_fraction`` of them; :mod:`autoq.fallback.escalation`), written to
    ``Config.int16_tensors``.
    ``precision="int16_first"``: layer by layer in the ranking's order, a layer is tried
    with int16 activations first and in fp32 only when int16 does not raise the metric;
    each step is kept only if it raises the metric on the calibration samples and (with
    ``holdout``) the output SQNR on the held-out ones; ``max_fp32_layers`` then counts the
    int16 and fp32 layers together (:mod:`autoq.fallback.int16_first`; ``ranking="revert"`` ranks by
    the output SQNR with that one layer int16). The trials' output SQNR is measured on the first
    :data:`TRIAL_SAMPLES` calibration samples (the held-out ones never).
    ``search`` (``int16_tensors`` only): ``"greedy"`` (default): the shortlist ranked once
    with all of it int16, tensors added in that order, the held-out samples keeping the best
    prefix; ``"eliminate"``: backward elimination from *every* escalable tensor int16, revert
    costs re-measured in rounds as the set shrinks to the budget, then tensors whose revert
    does not lower the held-out output SQNR (with the rest of the set int16) dropped one by
    one (:mod:`autoq.fallback.escalation_elimination`).
    """

    metric: Any = "sqnr"
    min_sqnr: float = 30.0
    max_drop: float = 0.01
    max_fp32_layers: int = 8
    ranking: str = "local"
    precision: str = "fp32"
    holdout: int = 0
    max_int16_fraction: float = 0.2
    search: str = "greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.holdout
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ValueError(f"AutoFallback.holdout must be an int >= 0, got {h!r}")
        if not (self.metric == "sqnr" or callable(self.metric)):
            raise ValueError(
                f"AutoFallback.metric must be 'sqnr' or a callable metric(run) -> float, got {self.metric!r}"
            )
        for name in ("min_sqnr", "max_drop"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or v != v:
                raise TypeError(f"AutoFallback.{name} must be a number, got {v!r}")
        if not isinstance(self.max_fp32_layers, int) or self.max_fp32_layers < 0:
            raise ValueError(
                f"AutoFallback.max_fp32_layers must be an int >= 0, got {self.max_fp32_layers!r}"
            )
        if self.ranking not in AUTO_RANKINGS:
            raise ValueError(
                f"AutoFallback.ranking must be one of {', '.join(AUTO_RANKINGS)}, got {self.ranking!r}"
            )
        if not (
            isinstance(self.max_int16_fraction, int | float) and 0 <= self.max_int16_fraction <= 1
        ):
            raise ValueError(
                f"AutoFallback.max_int16_fraction must be in [0, 1], got {self.max_int16_fraction!r}"
            )
        if self.precision not in AUTO_PRECISIONS:
            raise ValueError(
                f"AutoFallback.precision must be one of {', '.join(AUTO_PRECISIONS)}, got {self.precision!r}"
            )
        if self.search not in AUTO_SEARCHES:
            raise ValueError(
                f"AutoFallback.search must be one of {', '.join(AUTO_SEARCHES)}, got {self.search!r}"
            )
        if self.search != "greedy" and self.precision != "int16_tensors":
            raise ValueError(
                f"AutoFallback.search chooses activation tensors of the int16 escalation: it "
                f"needs precision='int16_tensors', got {self.precision!r}"
            )

    def fixed(self) -> Fallback:
        """The user's fixed rules as a plain :class:`Fallback`."""
        return Fallback(self.ids, self.op_types, self.patterns, self.validate)

    def to_json(self) -> dict:
        d = super().to_json()
        d.update(
            metric=self.metric
            if isinstance(self.metric, str)
            else callable_to_json(self.metric, "AutoFallback.metric"),
            min_sqnr=self.min_sqnr,
            max_drop=self.max_drop,
            max_fp32_layers=self.max_fp32_layers,
            ranking=self.ranking,
            precision=self.precision,
            holdout=self.holdout,
            max_int16_fraction=self.max_int16_fraction,
            search=self.search,
        )
        return d

    @classmethod
    def from_json(cls, d: dict) -> AutoFallback:
        d = drop_removed("AutoFallback", dict(d), REMOVED_AUTOFALLBACK)
        check_keys(cls, d)
        m = d.get("metric", "sqnr")
        if isinstance(m, str) and m != "sqnr":
            d["metric"] = callable_from_json(m, "AutoFallback.metric")
        return cls(**d)


#: AutoFallback fields that were removed (measured no gain): old JSON with one at its
#: old default loads with a warning, with another value it is refused (see drop_removed)
REMOVED_AUTOFALLBACK = {
    "recalibrate": (False, None),
    "trial_samples": (4, None),
    "swap_rounds": (0, None),
    "first_tensors": (0, None),
    "shortlist": ("sqnr", None),
}

#: Fallback kinds that ``Config.from_json`` knows.
FALLBACK_TYPES: dict[str, Any] = {"Fallback": Fallback, "AutoFallback": AutoFallback}
