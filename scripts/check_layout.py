"""Check the package layout rules of docs/design.md; exit 1 when one is broken.

Rules (each a table below, so a new package is one row):

* arrows go downward only: every package or top-level module of ``autoq`` has a level
  (``LEVELS``); a module may import only modules of its own package or of a lower level;
* no import cycle between modules (every ``import`` statement counts, also the ones inside
  functions: arrows go one way whether they run at import time or later);
* the forbidden reaches of ``FORBIDDEN`` hold transitively (calibration never imports the CPU
  backend, the stages never import the command line, ...);
* the plug-in folders (``autoq.patterns``, ``autoq.calibrators``) import only the public
  plug-in API (``PLUGIN_API``);
* no private name (``_x``) imported from another module;
* at most ``MAX_FLAT`` modules directly in ``autoq/``.

Size is a smell, not a rule: modules over ``LONG_MODULE`` lines and functions over
``LONG_FUNCTION`` lines are listed (split them by idea when they grow), never a failure.

The packages and their folders are read from ``pyproject.toml``
(``[tool.setuptools] package-dir``), so ``calibrators/`` is checked as ``autoq.calibrators``.

    python scripts/check_layout.py          # from the repository root
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

LONG_MODULE = 600
LONG_FUNCTION = 80
MAX_FLAT = 15

#: level of each package / top-level module of autoq (the first name after ``autoq.``);
#: imports go to the same package or to a lower level
LEVELS = {
    # leaves: numbers, documents, errors
    "errors": 0,
    "primitives": 0,
    "json_document": 0,
    "files": 0,
    "naming": 0,
    "qparams": 1,
    "threads": 1,
    "models": 1,
    "layer_rules": 1,
    "metrics": 2,
    "calibrators": 2,
    "config": 3,
    # the Relax toolkit and the integer op set
    "ir": 4,
    "dataset": 4,
    "qnn": 5,
    "frontends": 5,
    # how slots are quantized; the CPU backend; plug-ins; recipes
    "rules": 6,
    "cpu": 6,
    "patterns": 7,
    "byoc": 7,
    "build": 7,
    "export": 7,
    "recipes": 7,
    # the stages
    "simulation": 8,
    "tuning": 8,
    "session": 8,
    "accuracy": 9,
    "calibration": 10,
    "realization": 11,
    "fallback": 12,
    "distributed": 13,
    "importers": 13,
    # the pipeline and what calls it
    "pipeline": 14,
    "__init__": 15,
    "cli": 16,
    "command": 17,
}
#: (importer, imported) packages that must not reach each other, directly or through others
FORBIDDEN = [
    ("calibration", "cpu"),
    ("calibration", "build"),
    ("simulation", "cpu"),
    ("simulation", "build"),
    ("realization", "cpu"),
    ("accuracy", "cpu"),
    ("rules", "cpu"),
    ("ir", "cpu"),
    ("pipeline", "cli"),
    ("fallback", "cli"),
]
#: what the plug-in folders may import from autoq: the public pattern / calibrator API
PLUGIN_API = (
    "autoq.ir.registry",
    "autoq.ir.toolkit",
    "autoq.ir.activations",
    "autoq.ir.allow_list",
    "autoq.qnn",
    "autoq.rules",
    "autoq.primitives",
    "autoq.qparams",
    "autoq.errors",
    "autoq.patterns",
    "autoq.calibrators",
)


def package_dirs(root: Path) -> dict[str, Path]:
    """Top-level package names -> folders, from pyproject.toml."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in setup["package-dir"].items()}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (subpackages too)."""
    dirs = package_dirs(root)
    out: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            nested = [d for d in dirs.values() if d != folder and d.is_relative_to(folder)]
            if any(path.is_relative_to(d) for d in nested):
                continue  # a folder mapped to another package name
            out[".".join([pkg, *parts])] = path
    return out


def long_functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function over the limit."""
    found = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = child.end_lineno - child.lineno + 1
                    if length > LONG_FUNCTION:
                        found.append((name, child.lineno, length))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path, tree: ast.AST, known: set[str]):
    """Edges ``module -> imported module`` (within ``known``) and private names imported."""
    is_package = path.name == "__init__.py"
    tops = {k.split(".")[0] for k in known}
    edges: set[str] = set()
    private: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    edges.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    edges.add(sub)
                    continue
                if source in known:
                    edges.add(source)
                internal = source.split(".")[0] in tops
                if internal and alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append((node.lineno, source, alias.name))
    edges.discard(module)
    return edges, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def component(module: str) -> str | None:
    """The package or top-level module of ``autoq`` a module belongs to (its level's key)."""
    parts = module.split(".")
    if parts[0] != "autoq":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def arrow_problems(graph: dict[str, set[str]]) -> list[str]:
    """Upward arrows, forbidden reaches and plug-ins reading outside their API."""
    out = []
    for src in sorted(graph):
        a = component(src)
        if a is None:
            continue
        if a not in LEVELS:
            out.append(f"no level for {a} (add it to LEVELS in scripts/check_layout.py)")
            continue
        for dst in sorted(graph[src]):
            b = component(dst)
            if b is None or b == a:
                continue
            if LEVELS.get(b, 99) >= LEVELS[a]:
                out.append(
                    f"upward import: {src} -> {dst} ({a} {LEVELS[a]} -> {b} {LEVELS.get(b)})"
                )
            if a in ("patterns", "calibrators") and not dst.startswith(PLUGIN_API):
                out.append(f"plug-in imports outside the plug-in API: {src} -> {dst}")
    for a, b in FORBIDDEN:
        for src in sorted(m for m in graph if component(m) == a):
            hit = sorted(m for m in reaches(graph, src) if component(m) == b)
            if hit:
                out.append(f"forbidden reach: {src} -> {hit[0]} ({a} must not import {b})")
    return out


def main(root: Path) -> int:
    mods = modules(root)
    known = set(mods)
    problems = 0
    graph: dict[str, set[str]] = {}
    smells = []
    for name, path in mods.items():
        text = path.read_text()
        rel = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > LONG_MODULE:
            smells.append(f"long module: {rel} ({lines} lines)")
        tree = ast.parse(text, str(path))
        for qual, line, length in long_functions(tree):
            smells.append(f"long function: {rel}:{line} {qual} ({length} lines)")
        graph[name], private = imports(name, path, tree, known)
        for line, source, alias in private:
            print(f"private name imported from another module: {rel}:{line} {alias} from {source}")
            problems += 1
    for comp in cycles(graph):
        print("import cycle: " + " <-> ".join(comp))
        problems += 1
    names = set(mods)
    if any(n.startswith("autoq.") or n == "autoq" for n in names):
        for line in arrow_problems(graph):
            print(line)
            problems += 1
        flat = [p for p in (root / "autoq").glob("*.py")]
        if len(flat) > MAX_FLAT:
            print(
                f"{len(flat)} modules flat in autoq/ (at most {MAX_FLAT}): move some into packages"
            )
            problems += 1
    for line in smells:
        print("smell (split by idea when it grows): " + line)
    print(f"{len(mods)} modules checked, {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent.parent))
