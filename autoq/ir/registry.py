"""The pattern registry: what a pattern is and how plug-ins register.

A pattern module in ``patterns/`` builds one :class:`Pattern` and calls :func:`register`.
A pattern is: a ``name`` (also its op type for fallback rules), a ``priority``, a DPL
pattern with named parts (built fresh by ``build()``), a ``check`` (returns a reason to
reject a match, or None), and two callbacks, ``simulate(ctx, match)`` and
``realize(ctx, match)``, that return the expression replacing the match's root. The
contexts are :class:`autoq.simulation.SimContext` and :class:`autoq.realization.RealizeContext`.
Matching itself (the priority rule) is :mod:`autoq.ir.matching`; the allow-list table of ops
that run in affine space without a pattern is :mod:`autoq.ir.allow_list`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import relax

from autoq.config import Config
from autoq.ir.graph import Graph

__all__ = [
    "PATTERNS",
    "Match",
    "Pattern",
    "load_patterns",
    "ordered_patterns",
    "register",
    "slot_id_of",
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
    #: the realized result is already int8 (own output qparams, e.g. qnn.add); otherwise it
    #: is an int32 accumulator and gets an exit slot where a float op reads it (autoq.rules.exits)
    int8_output: bool = False
    #: used when ``Config.patterns`` is None; an opt-in pattern (False) runs only when
    #: ``Config.patterns`` names it
    default: bool = True
    #: ``dynamic(ctx, match)``: the realized form with run-time activation qparams
    #: (``Config(activation=QuantSpec(dynamic=True))``, :mod:`autoq.realization.dynamic`); None: the
    #: pattern needs static qparams and stays fp32 in that mode
    dynamic: Callable[[Any, Match], relax.Expr] | None = None
    #: ``simulate_dynamic(ctx, match)``: the simulated form of ``dynamic`` (the same
    #: run-time quantize, integers as float32), for a layer made dynamic in an otherwise
    #: static model (:mod:`autoq.rules.hybrid`); set together with ``dynamic``
    simulate_dynamic: Callable[[Any, Match], relax.Expr] | None = None


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


#: the plug-in package whose modules are the patterns (found by name: the registry does not
#: depend on its plug-ins, they depend on it)
PLUGINS = "autoq.patterns"


def load_patterns() -> None:
    """Import every pattern module of :data:`PLUGINS` (each registers itself)."""
    pkg = importlib.import_module(PLUGINS)
    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{PLUGINS}.{mod.name}")


def ordered_patterns(config: Config | None = None) -> list[Pattern]:
    """The registered patterns ``config.patterns`` selects (None: every default pattern),
    in the order matching tries them: descending priority, then name."""
    load_patterns()
    pats = list(PATTERNS.values())
    if config is None or config.patterns is None:
        pats = [p for p in pats if p.default]
    else:
        unknown = sorted(set(config.patterns) - set(PATTERNS))
        if unknown:
            raise ValueError(f"unknown patterns {unknown}; registered: {sorted(PATTERNS)}")
        pats = [p for p in pats if p.name in config.patterns]
    return sorted(pats, key=lambda p: (-p.priority, p.name))
