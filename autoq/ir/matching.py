"""Pattern matching, done once per quantization.

:func:`match` prepares the model (:func:`autoq.ir.graph.prepare`) and finds **every** match of
the registered patterns (fallback not applied) with :func:`match_all`. The result,
:class:`Matched`, is what simulate, calibrate, realize, the analysis, the automatic
fallback and the pre-quantized import all work on: a fallback choice only *filters* its
matches (:meth:`Matched.active`), it never changes which bindings a pattern covers, so no
stage has to match again.

**Priority rule (the only one).** Patterns are tried in descending ``priority`` (by
convention the number of ops they cover, so conv2d+bias+add beats conv2d+bias beats conv2d),
ties broken by name; each pattern is tried at every binding in topological order. A binding
belongs to at most one match, and a match is rejected when any value inside it (other than
its root) is used outside it or is a function output. A layer left in fp32 still claims its
bindings, so the other layers' matches do not depend on the fallback.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax
from tvm.relax.dpl import CallPattern, ExprPattern, WildcardPattern

from autoq.config import Config, Fallback, compile_rule
from autoq.config.progress import bar
from autoq.ir.graph import Graph, prepare
from autoq.ir.registry import Match, Pattern, ordered_patterns
from autoq.ir.toolkit import op_name, short_op_name

__all__ = [
    "Matched",
    "as_matched",
    "closest",
    "find_matches",
    "layer_ids",
    "match",
    "match_all",
    "validate_rules",
]


@dataclass(frozen=True, eq=False)
class Matched:
    """A prepared model and every match of the patterns in it (see the module doc).

    ``patterns``: the ``Config.patterns`` selection the matches were found with (None: all
    registered patterns)."""

    graph: Graph
    matches: tuple[Match, ...]
    patterns: tuple[str, ...] | None = None

    @property
    def layers(self) -> list[str]:
        """Every layer id, in topological order (fallback not applied)."""
        return [m.layer for m in self.matches]

    def active(self, fallback: Fallback | None = None) -> list[Match]:
        """The matches quantized under ``fallback`` (its rules checked against the layers:
        a rule that matches nothing is an error naming the closest layer ids)."""
        if not fallback:
            return list(self.matches)
        if getattr(fallback, "validate", True):
            validate_rules(fallback, list(self.matches))
        skip = _fallback_predicate(fallback)
        return [m for m in self.matches if not skip(m)]

    def kept_float(self, fallback: Fallback | None = None) -> list[str]:
        """Layers that ``fallback`` keeps in fp32, in topological order."""
        active = {m.layer for m in self.active(fallback)}
        return [x for x in self.layers if x not in active]

    def check_config(self, config: Config) -> None:
        """Raise if ``config`` selects other patterns than the matches were found with."""
        want = None if config.patterns is None else tuple(config.patterns)
        if want != self.patterns:
            raise ValueError(
                f"these matches were found with patterns={self.patterns!r}, the config asks "
                f"for patterns={want!r}: match the model again with this config"
            )


def match(mod_or_graph, params: dict | None = None, config: Config | None = None) -> Matched:
    """Prepare ``mod`` (an IRModule, or an already prepared :class:`Graph`) and find every
    match of the patterns ``config.patterns`` selects."""
    g = mod_or_graph if isinstance(mod_or_graph, Graph) else prepare(mod_or_graph, params)
    pats = ordered_patterns(config)
    selection = None if config is None or config.patterns is None else tuple(config.patterns)
    return Matched(g, tuple(match_all(g, pats)), selection)


def as_matched(model, params: dict | None = None, config: Config | None = None) -> Matched:
    """``model`` as a :class:`Matched`: an IRModule is matched here; a ``Matched`` (or an
    object carrying one as ``.matched``, e.g. a :class:`autoq.simulation.SimResult`) is reused
    after checking that ``config`` selects the same patterns."""
    m = model if isinstance(model, Matched) else getattr(model, "matched", None)
    if not isinstance(m, Matched):
        return match(model, params, config)
    if config is not None:
        m.check_config(config)
    return m


def match_all(g: Graph, patterns: list[Pattern]) -> list[Match]:
    """Every match of ``patterns`` (in priority order) in ``g``: the matcher itself."""
    v2v = dict(g.value)
    val2var = {value: var for var, value in g.bindings}
    claimed: set = set()
    matches: list[Match] = []
    taken: dict[str, int] = {}
    for pat in bar(patterns, desc="match", unit="pattern"):  # (drawn inside a shown run)
        alts = pat.build()
        alts = alts if isinstance(alts, list) else [alts]
        alts = [(root_pat, named, root_op(root_pat)) for root_pat, named in alts]
        for var, value in g.bindings:
            if var in claimed or not isinstance(value, tvm.ir.Call):
                continue
            m = None
            for root_pat, named, op in alts:
                if op is not None and not value.op.same_as(op):
                    continue  # a call of another op: the matcher would find nothing
                m = _try_match(g, pat, root_pat, named, var, value, v2v, val2var)
                if m is not None and not any(c in claimed for c in m.covered):
                    break
                m = None
            if m is None:
                continue
            m.layer = _name_layer(g, m, taken)
            claimed.update(m.covered)
            matches.append(m)
    matches.sort(key=lambda m: g.index[m.root])
    return matches


def find_matches(g: Graph, config: Config | None = None) -> list[Match]:
    """The matches quantized under ``config`` (its fallback excluded, rules validated)."""
    fb = config.fallback if config is not None else None
    return match(g, None, config).active(fb)


def layer_ids(g: Graph, config: Config | None = None) -> list[str]:
    """Ids of every layer the patterns find (fallback ignored), in topological order."""
    return match(g, None, config).layers


# ------------------------------------------------------------------------------ helpers


def root_op(pattern) -> tvm.ir.Op | None:
    """The op a call must call for ``pattern`` to match it: that of an ``is_op(...)(...)``
    call pattern; None for any other pattern (no op known up front).

    >>> from tvm.relax.dpl import is_op, wildcard
    >>> root_op(is_op("relax.add")(wildcard(), wildcard())).name
    'relax.add'
    >>> root_op(wildcard()) is None
    True
    """
    if isinstance(pattern, CallPattern) and isinstance(pattern.op, ExprPattern):
        expr = pattern.op.expr
        return expr if isinstance(expr, tvm.ir.Op) else None
    return None


def _interior_patterns(named: dict) -> set[str]:
    return {k for k, p in named.items() if not isinstance(p, WildcardPattern)}


def _weight_layer_name(name: str) -> str:
    for suffix in (".weight", "_weight", ".w", ".kernel"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _try_match(g: Graph, pat: Pattern, root_pat, named, var, value, v2v, val2var):
    mm = root_pat.extract_matched_expr(value, v2v)
    if mm is None:
        return None
    interior = _interior_patterns(named)
    nodes: dict[str, Any] = {}
    covered = [var]
    for key, p in named.items():
        if p not in mm:
            continue
        e = val2var.get(mm[p], mm[p])
        nodes[key] = e
        if key in interior and isinstance(e, relax.Var) and not e.same_as(var):
            covered.append(e)
    nodes.setdefault("root", var)
    if pat.check(g, nodes) is not None:
        return None
    outputs = set(g.output_vars())
    cov = set(covered)
    for c in covered:
        if c.same_as(var):
            continue
        if c in outputs or any(u not in cov for u in g.users.get(c, [])):
            return None
    return Match(pat, var, nodes, sorted(covered, key=lambda v: g.index[v]))


def _name_layer(g: Graph, m: Match, taken: dict[str, int]) -> str:
    name = None
    if m.pattern.weight and m.pattern.weight in m.nodes:
        ref = g.weight_of(m.nodes[m.pattern.weight])
        if ref is not None and ref.name:
            name = _weight_layer_name(ref.name)
    anchor = m.nodes.get(m.pattern.anchor, m.root)
    if name is None:
        name = g.ids.get(anchor, g.ids[m.root])
    m.anchor_op = short_op_name(op_name(g.value[anchor])) if anchor in g.value else m.pattern.name
    if name in taken:  # weight shared by two layers
        taken[name] += 1
        name = f"{name}#{taken[name]}"
    else:
        taken[name] = 0
    return name


def _fallback_predicate(fb: Fallback) -> Callable[[Match], bool]:
    rules = [compile_rule(p) for p in fb.patterns]
    ids, types = set(fb.ids), set(fb.op_types)

    def skip(m: Match) -> bool:
        return (
            m.layer in ids
            or m.pattern.name in types
            or m.anchor_op in types
            or any(r(m.layer) for r in rules)
        )

    return skip


def closest(word: str, candidates: list[str]) -> str:
    """The candidates closest to ``word`` (for "did you mean" errors)."""
    close = difflib.get_close_matches(word, candidates, n=5, cutoff=0.3)
    return ", ".join(close) if close else ", ".join(sorted(candidates)[:8])


def validate_rules(fb: Fallback, matches: list[Match]) -> None:
    """Every fallback rule must match a layer; the error lists the closest layer ids."""
    layers = [m.layer for m in matches]
    types = sorted({m.pattern.name for m in matches} | {m.anchor_op for m in matches})
    for i in fb.ids:
        if i not in layers:
            raise ValueError(
                f"fallback id {i!r} matches no layer; closest layer ids: {closest(i, layers)}"
            )
    for t in fb.op_types:
        if t not in types:
            raise ValueError(
                f"fallback op type {t!r} matches no layer; op types in this model: {', '.join(types)}"
            )
    for p in fb.patterns:
        rule = compile_rule(p)
        if not any(rule(x) for x in layers):
            raise ValueError(
                f"fallback pattern {p!r} matches no layer; closest layer ids: {closest(p.removeprefix('re:'), layers)}"
            )
