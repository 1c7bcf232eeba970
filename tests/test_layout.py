"""The package's layout rules (docs/design.md): levels, no import cycle, no private name
imported across modules (long modules and functions are reported, not refused). scripts/check_layout.py reads
the source with ast; this test runs it on the repository and on a planted violation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts/check_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_repository_keeps_its_layout_rules(capsys):
    assert _checker().main(ROOT) == 0, capsys.readouterr().out


def test_the_checker_catches_a_long_function_a_cycle_and_a_private_import(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "pkg" = "pkg" }\n')
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    (pkg / "a.py").write_text(f"from .b import _hidden\n\n\ndef long():\n{body}\n")
    (pkg / "b.py").write_text("from . import a\n\n_hidden = 1\n")
    assert _checker().main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "smell (split by idea when it grows): long function: pkg/a.py:4 long" in out
    assert "import cycle: pkg.a <-> pkg.b" in out or "import cycle: pkg.b <-> pkg.a" in out
    assert "private name imported from another module: pkg/a.py:1 _hidden from pkg.b" in out


def _packages_in_design_doc() -> set[str]:
    """The first cell of every row of the Layout table: ``autoq/x/`` or ``autoq/a.py, b.py``."""
    text = (ROOT / "docs/design.md").read_text()
    table = text[text.index("## Layout") : text.index("## Conventions")]
    out = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        for item in line.split("|")[1].split(","):
            name = item.strip().strip("`").rstrip("/")
            out.add(name if name.startswith("autoq/") else f"autoq/{name}")
    return out


def test_the_design_doc_names_every_package_and_only_what_exists():
    on_disk = {f"autoq/{p.name}" for p in (ROOT / "autoq").iterdir() if p.suffix == ".py"}
    on_disk |= {
        f"autoq/{p.name}" for p in (ROOT / "autoq").iterdir() if (p / "__init__.py").is_file()
    }
    on_disk |= {"autoq/calibrators", "autoq/patterns"}  # the plug-in folders, packaged there
    listed = _packages_in_design_doc()
    assert not on_disk - listed, f"missing from docs/design.md: {sorted(on_disk - listed)}"
    assert not listed - on_disk, (
        f"docs/design.md names what does not exist: {sorted(listed - on_disk)}"
    )


def test_the_checker_catches_upward_arrows_forbidden_reaches_and_plugin_imports(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "autoq" = "autoq", "autoq.patterns" = "patterns" }\n'
    )
    for folder in (
        "autoq",
        "autoq/ir",
        "autoq/calibration",
        "autoq/build",
        "autoq/cpu",
        "patterns",
    ):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "autoq/pipeline.py").write_text("")
    (tmp_path / "autoq/ir/graph.py").write_text("import autoq.pipeline\n")  # ir -> pipeline: up
    (tmp_path / "autoq/calibration/run.py").write_text("import autoq.build\n")  # down, forbidden
    (tmp_path / "autoq/build/__init__.py").write_text("import autoq.cpu\n")
    (tmp_path / "patterns/p.py").write_text("import autoq.calibration\n")  # outside the API
    assert _checker().main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "upward import: autoq.ir.graph -> autoq.pipeline" in out
    assert "forbidden reach: autoq.calibration.run -> autoq.build" in out
    assert "calibration must not import cpu" in out  # through build, transitively
    assert "plug-in imports outside the plug-in API: autoq.patterns.p -> autoq.calibration" in out


def test_pyproject_packages_every_package():
    """A package missing from ``[tool.setuptools] packages`` is silently left out of a
    non-editable install (``pip install .``, the README's first command)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "autoq").rglob("__init__.py")
    } | {"autoq.calibrators", "autoq.patterns"}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))
