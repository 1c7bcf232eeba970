"""The ``autoq`` console script's entry point (``[project.scripts]`` in pyproject.toml).

It only imports :mod:`autoq.cli` and calls its ``main``: a Ctrl-C that lands while the
command's modules are still being imported (before ``main`` installs its signal handlers)
is the same one line ``autoq: interrupted`` and exit code 130, not a traceback.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    try:
        from autoq.cli import main as run
    except KeyboardInterrupt:
        print("autoq: interrupted", file=sys.stderr)
        return 130
    return run()
