"""Check the package layout rules of docs/design.md; exit 1 when one is broken.

* no module over ``MAX_MODULE_LINES`` lines;
* no function (or method) over ``MAX_FUNCTION_LINES`` lines (``end_lineno - lineno + 1`` of
  the ``def``; a nested function counts in its own right and inside its parent);
* no import cycle between the package's modules (every ``import`` statement counts, also the
  ones inside functions: arrows go one way whether they run at import time or later);
* no private name (``_x``) imported from another module.

The packages and their folders are read from ``pyproject.toml``
(``[tool.setuptools] package-dir``), so ``calibrators/`` is checked as ``autoq.calibrators``.

    python scripts/check_layout.py          # from the repository root
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


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
                    if length > MAX_FUNCTION_LINES:
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


def main(root: Path) -> int:
    mods = modules(root)
    known = set(mods)
    problems = 0
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        text = path.read_text()
        rel = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            print(f"module over {MAX_MODULE_LINES} lines: {rel} ({lines})")
            problems += 1
        tree = ast.parse(text, str(path))
        for qual, line, length in long_functions(tree):
            print(f"function over {MAX_FUNCTION_LINES} lines: {rel}:{line} {qual} ({length})")
            problems += 1
        graph[name], private = imports(name, path, tree, known)
        for line, source, alias in private:
            print(f"private name imported from another module: {rel}:{line} {alias} from {source}")
            problems += 1
    for comp in cycles(graph):
        print("import cycle: " + " <-> ".join(comp))
        problems += 1
    print(f"{len(mods)} modules checked, {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent.parent))
