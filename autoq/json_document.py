"""JSON text and files for autoq's documents (Config, QParams, Report, FallbackDecision).

A class with ``to_json() -> dict`` and ``from_json(dict)`` gets ``dumps``/``loads``/``save``
from :class:`JsonDocument`. ``save`` writes atomically: a temporary file next to the target,
renamed over it once complete, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["JsonDocument", "write_atomic"]


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` all at once (temporary file + rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class JsonDocument:
    """``dumps``/``loads``/``save`` on top of ``to_json``/``from_json``."""

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def loads(cls, text: str):
        return cls.from_json(json.loads(text))

    def save(self, path: str | Path) -> Path:
        return write_atomic(path, self.dumps())
