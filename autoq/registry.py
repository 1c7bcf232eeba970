"""Pattern registry, matching, and the allow-list table.

**Patterns.** A pattern module in ``patterns/`` builds one :class:`Pattern` and calls
:func:`register`. A pattern is: a ``name`` (also its op type for fallback rules), a
``priority``, a DPL pattern with named parts (built fresh by ``build()``), a ``check``
(returns a reason to reject a match, or None), and two callbacks, ``simulate(ctx, match)``
and ``realize(ctx, match)``, that return the expression replacing the match's root. The
contexts are :class:`autoq.simulate.SimContext` and :class:`autoq.realize.RealizeContext`.

**Priority rule (the only one).** Patterns are tried in descending ``priority`` (by
convention the number of ops they cover, so conv2d+bias+add beats conv2d+bias beats conv2d),
ties broken by name; each pattern is tried at every binding in topological order. A binding
belongs to at most one match, and a match is rejected when any value inside it (other than
its root) is used outside it or is a function output.

**Allow-list.** :data:`ALLOW_LIST` is one table ``op -> rule`` that both stages read:

* ``commute``: the op gives the same result on integers as on reals (monotone or pure data
  movement), so ``quantize`` can move above it and ``dequantize`` below it without changing
  any value; simulate leaves it in float, realize moves it into the integer domain.
* ``accumulate``: the op sums (mean, global average pool); simulate quantizes its input and
  sums integer-valued floats, realize emits ``qnn.sum`` with 1/N folded into the next scale.
  Accumulate ops are registered as patterns (op type ``mean``) built from the table.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, WildcardPattern, is_op, wildcard

from .config import Config, Fallback, compile_rule
from .graph import Graph, op_name, short_op_name

__all__ = [
    "ALLOW_LIST",
    "PATTERNS",
    "AllowRule",
    "Match",
    "Pattern",
    "find_matches",
    "layer_ids",
    "ordered_patterns",
    "register",
]


@dataclass(frozen=True)
class Pattern:
    """One quantizable pattern (see the module docstring)."""

    name: str
    priority: int
    #: returns ``(root, named_parts)`` or a list of such alternatives (tried in order)
    build: Callable[[], Any]
    check: Callable[[Graph, dict[str, Any]], str | None]
    simulate: Callable[[Any, Match], relax.Expr]
    realize: Callable[[Any, Match], relax.Expr]
    #: named part that carries the layer's weight (its name becomes the layer id)
    weight: str | None = "weight"
    #: named part whose binding id names the layer when there is no weight name
    anchor: str = "root"
    doc: str = ""


@dataclass
class Match:
    """A pattern matched at a root binding: named parts (binding Vars, parameters or
    constants of the original graph), the bindings it covers, and the layer id."""

    pattern: Pattern
    root: relax.Var
    nodes: dict[str, Any]
    covered: list[relax.Var]
    layer: str = ""
    anchor_op: str = ""

    def __getitem__(self, key: str):
        return self.nodes[key]

    def get(self, key: str, default=None):
        return self.nodes.get(key, default)


def slot_id_of(g: Graph, matches: list[Match]) -> Callable[[relax.Var], str]:
    """``id(var)``: the activation slot id of a tensor: the layer id of the match whose root
    produces it, else the tensor's node id (graph input name, ``<op>_<k>``)."""
    roots = {m.root: m.layer for m in matches}
    return lambda var: roots.get(var) or g.ids[var]


PATTERNS: dict[str, Pattern] = {}


def register(pattern: Pattern) -> Pattern:
    if pattern.name in PATTERNS and PATTERNS[pattern.name] is not pattern:
        raise ValueError(f"a pattern named {pattern.name!r} is already registered")
    PATTERNS[pattern.name] = pattern
    return pattern


def _load_patterns() -> None:
    import autoq.patterns as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"autoq.patterns.{mod.name}")


# --------------------------------------------------------------------------- allow-list


@dataclass(frozen=True)
class AllowRule:
    """How an op runs in affine space. ``kind``: "commute" or "accumulate".
    ``dequantize``: whether a dequantize may also move *below* the op (exact for
    data movement and relu/max-pool, not for clip with off-grid bounds)."""

    kind: str
    dequantize: bool = True
    per_axis_ok: bool = False
    doc: str = ""


ALLOW_LIST: dict[str, AllowRule] = {
    "relax.nn.relu": AllowRule("commute", True, True, "max(q, zero_point)"),
    "relax.clip": AllowRule("commute", False, False, "clip(q, Q(lo), Q(hi))"),
    "relax.nn.max_pool2d": AllowRule("commute", True, True, "max pool on integers"),
    "relax.reshape": AllowRule("commute", True, False, "same op on integers"),
    "relax.permute_dims": AllowRule("commute", True, False, "same op on integers"),
    "relax.squeeze": AllowRule("commute", True, False, "same op on integers"),
    "relax.expand_dims": AllowRule("commute", True, False, "same op on integers"),
    "relax.flatten": AllowRule("commute", True, False, "same op on integers"),
    "relax.strided_slice": AllowRule("commute", True, False, "same op on integers"),
    "relax.split": AllowRule("commute", False, False, "same op on integers (quantize moves up)"),
    "relax.concat": AllowRule(
        "commute", False, False, "each input quantized to the output's qparams"
    ),
    "relax.nn.pad": AllowRule("commute", True, False, "pad value Q(value) (zero_point for 0)"),
    "relax.mean": AllowRule("accumulate", doc="qnn.sum, scale / N"),
    "relax.nn.adaptive_avg_pool2d": AllowRule(
        "accumulate", doc="qnn.sum over H, W when the output is 1x1"
    ),
}


# ------------------------------------------------------------------------------ matching


def _value_to_var(g: Graph) -> dict:
    return {value: var for var, value in g.bindings}


def _interior_patterns(named: dict[str, DFPattern]) -> set[str]:
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
        e = mm[p]
        e = val2var.get(e, e)
        nodes[key] = e
        if key in interior and isinstance(e, relax.Var) and not e.same_as(var):
            covered.append(e)
    nodes.setdefault("root", var)
    reason = pat.check(g, nodes)
    if reason is not None:
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


def ordered_patterns(config: Config | None = None) -> list[Pattern]:
    """The registered patterns in the order matching tries them (the priority rule)."""
    return _all_patterns(config)


def _all_patterns(config: Config | None) -> list[Pattern]:
    _load_patterns()
    pats = list(PATTERNS.values())
    if config is not None and config.patterns is not None:
        unknown = sorted(set(config.patterns) - set(PATTERNS))
        if unknown:
            raise ValueError(f"unknown patterns {unknown}; registered: {sorted(PATTERNS)}")
        pats = [p for p in pats if p.name in config.patterns]
    return sorted(pats, key=lambda p: (-p.priority, p.name))


def _greedy(g: Graph, patterns: list[Pattern], skip: Callable[[Match], bool] | None):
    v2v = dict(g.value)
    val2var = _value_to_var(g)
    claimed: set = set()
    matches: list[Match] = []
    taken: dict[str, int] = {}
    for pat in patterns:
        alts = pat.build()
        alts = alts if isinstance(alts, list) else [alts]
        for var, value in g.bindings:
            if var in claimed or not isinstance(value, tvm.ir.Call):
                continue
            m = None
            for root_pat, named in alts:
                m = _try_match(g, pat, root_pat, named, var, value, v2v, val2var)
                if m is not None and not any(c in claimed for c in m.covered):
                    break
                m = None
            if m is None:
                continue
            m.layer = _name_layer(g, m, taken)
            claimed.update(m.covered)
            if skip is not None and skip(m):
                continue
            matches.append(m)
    matches.sort(key=lambda m: g.index[m.root])
    return matches


def _fallback_predicate(fb: Fallback):
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


def _closest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=5, cutoff=0.3)
    return ", ".join(close) if close else ", ".join(sorted(candidates)[:8])


def validate_rules(fb: Fallback, matches: list[Match]) -> None:
    """Every fallback rule must match a layer; the error lists the closest layer ids."""
    layers = [m.layer for m in matches]
    types = sorted({m.pattern.name for m in matches} | {m.anchor_op for m in matches})
    for i in fb.ids:
        if i not in layers:
            raise ValueError(
                f"fallback id {i!r} matches no layer; closest layer ids: {_closest(i, layers)}"
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
                f"fallback pattern {p!r} matches no layer; closest layer ids: {_closest(p.removeprefix('re:'), layers)}"
            )


def find_matches(g: Graph, config: Config | None = None) -> list[Match]:
    """All matches of the registered patterns, fallback layers excluded (see module doc)."""
    patterns = _all_patterns(config)
    fb = config.fallback if config is not None else None
    if not fb:
        return _greedy(g, patterns, None)
    all_matches = _greedy(g, patterns, None)
    if getattr(fb, "validate", True):
        validate_rules(fb, all_matches)
    return _greedy(g, patterns, _fallback_predicate(fb))


def layer_ids(g: Graph, config: Config | None = None) -> list[str]:
    """Ids of every layer the patterns find (fallback ignored), in topological order."""
    return [m.layer for m in _greedy(g, _all_patterns(config), None)]


# ------------------------------------------------------------ pattern-building helpers


def commutative(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    """``op(a, b) | op(b, a)``."""
    return is_op(op)(a, b) | is_op(op)(b, a)


def leaf() -> DFPattern:
    return wildcard()
