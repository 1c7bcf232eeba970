"""JSON text and files for autoq's documents (Config, QParams, Report, FallbackDecision).

A class with ``to_json() -> dict`` and ``from_json(dict)`` gets ``dumps``/``loads``/``save``
from :class:`JsonDocument`. ``save`` writes atomically: a temporary file next to the target,
renamed over it once complete, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path

__all__ = [
    "JsonDocument",
    "callable_from_json",
    "callable_to_json",
    "check_keys",
    "drop_removed",
    "write_atomic",
]


def write_atomic(path: str | Path, text: str | bytes) -> Path:
    """Write ``text`` (or bytes) to ``path`` all at once (temporary file + rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
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


def callable_to_json(f, what: str) -> str:
    """``'module:qualname'`` of a module-level function (option ``what``, for the error)."""
    mod, name = getattr(f, "__module__", None), getattr(f, "__qualname__", "")
    if not mod or not name or "<" in name:
        raise ValueError(
            f"{what} {f!r} cannot be written to JSON: only module-level functions "
            "(saved as 'module:name') round-trip; lambdas and local functions do not"
        )
    return f"{mod}:{name}"


def callable_from_json(ref: str, what: str):
    """The function ``'module:qualname'`` names (inverse of :func:`callable_to_json`)."""
    import importlib

    mod, _, name = ref.partition(":")
    try:
        obj = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {ref!r} cannot be imported: {e}") from None
    return obj


def check_keys(cls, d: dict) -> None:
    """Refuse JSON keys that are not fields of the dataclass ``cls``, naming both sets."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}; it has {sorted(known)}")


def drop_removed(owner: str, d: dict, removed: dict) -> dict:
    """``d`` (a JSON object of ``owner``) without the fields that were removed from it.

    ``removed``: field -> (its old default, replacement). A removed field at its old default
    is dropped; otherwise ``replacement`` decides: a callable ``replacement(value, d)``
    moves the value to its new home in ``d`` and says where, a string is where the option
    went (the value is ignored), and None means the option is gone (it measured no gain):
    an error naming the field. One warning lists what was dropped or moved.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     drop_removed("AutoFallback", {"swap_rounds": 0, "holdout": 2}, {"swap_rounds": (0, None)})
    {'holdout': 2}
    >>> print(w[0].message)
    AutoFallback from an older version: swap_rounds (at its old default) dropped
    """
    import warnings

    out, said = dict(d), []
    for name, (old_default, replacement) in removed.items():
        if name not in out:
            continue
        value = out.pop(name)
        if value == old_default or (isinstance(value, list) and list(old_default or ()) == value):
            said.append(f"{name} (at its old default) dropped")
        elif callable(replacement):
            said.append(f"{name}={value!r} read as {replacement(value, out)}")
        elif isinstance(replacement, str):
            said.append(f"{name}={value!r} ignored: it is now {replacement}")
        else:
            raise ValueError(
                f"{owner}.{name}={value!r}: this option was removed (it measured no gain, see "
                "docs/configuration.md); delete it from the JSON to load the rest"
            )
    if said:
        warnings.warn(f"{owner} from an older version: " + "; ".join(said), stacklevel=3)
    return out
