"""The benchmark scripts still refer to names that exist.

Benchmarks are not run by the suite (they take minutes to hours), and they import autoq
inside their functions, so a renamed function breaks them silently until someone runs
them (that happened to ``calibration_speed.py``). This test reads every script with
``ast`` and resolves, without running anything:

- every ``from autoq... import name`` (also inside functions) to a real attribute;
- every attribute chain rooted at ``autoq`` (``autoq.Config``, ``autoq.cpu.lowering.x``)
  or at a name bound to an autoq module (``import autoq.cpu as c``, ``from autoq import
  frontends``, ``cal = importlib.import_module("autoq.calibration")``);
- every ``common.name`` / ``from common import name`` to a function of
  ``benchmarks/common.py`` (the shared helpers the scripts call).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
LOCAL = {p.stem for p in SCRIPTS}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Names bound to modules the test resolves: {'autoq': 'autoq', 'cal': 'autoq.calibration'}."""
    roots = {"autoq", *LOCAL}
    names = {r: r for r in roots}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in roots:
                    names[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module == "autoq":
            names.update({a.asname or a.name: f"autoq.{a.name}" for a in node.names})
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call, target = node.value, node.targets[0]
            if (
                _chain(call.func) == ["importlib", "import_module"]
                and call.args
                and isinstance(call.args[0], ast.Constant)
                and isinstance(target, ast.Name)
            ):
                names[target.id] = call.args[0].value
    return names


def _chain(node: ast.AST) -> list[str] | None:
    """['autoq', 'cpu', 'x'] for the expression ``autoq.cpu.x``; None for other roots."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _references(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, attribute path) pairs a script needs: ('autoq.accuracy.gptq', 'rtn'), ..."""
    aliases = _aliases(tree)
    refs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            root = node.module.split(".")[0]
            if root == "autoq" or node.module in LOCAL:
                refs.update((node.module, a.name) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            chain = _chain(node)
            if chain and chain[0] in aliases:
                full = aliases[chain[0]].split(".") + chain[1:]
                refs.add((full[0], ".".join(full[1:])))
    return refs


def _resolve(module: str, path: str):
    """getattr along ``path`` from the longest importable module prefix.

    The longest prefix, because ``autoq.calibration`` is both a module and a function the
    package re-exports; a chain like ``autoq.calibration.calibration_pipeline`` means the module.
    """
    parts = [*module.split("."), *path.split(".")]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name != ".".join(parts[:i]) and not ".".join(parts[:i]).startswith(exc.name):
                raise
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(module, name=module)


def test_every_script_is_found():
    # Guards the glob: an empty list would make the parametrized test vacuous.
    assert {"common", "calibration_speed", "vs_onnxruntime", "int8_kernels"} <= LOCAL


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_names_resolve(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tree = ast.parse(script.read_text(), filename=str(script))
    missing = []
    for module, path in sorted(_references(tree)):
        try:
            _resolve(module, path)
        except AttributeError:
            missing.append(f"{module}.{path}")
        except ModuleNotFoundError as exc:
            # Optional extras (torch, the model packages) imported by a helper module.
            pytest.skip(f"{script.name} needs {exc.name}")
    assert not missing, f"{script.name} refers to names that no longer exist: {missing}"


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from autoq.pipeline import no_such_stage\n",
        "import importlib\ncal = importlib.import_module('autoq.calibration')\ncal.no_such_stage\n",
        "from autoq import calibrate as c\nc.no_such_stage()\n",
    ],
)
def test_a_renamed_function_is_caught(source):
    # The second form is how calibration_speed.py referred to a renamed private name.
    refs = {r for r in _references(ast.parse(source)) if "no_such_stage" in r[1]}
    assert len(refs) == 1
    with pytest.raises(AttributeError):
        _resolve(*refs.pop())
