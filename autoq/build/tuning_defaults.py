"""Which tuned kernels keep autoq's default schedule: the side file of a tuning database.

Every kernel autoq compiles already has a schedule without tuning (the packed int8 kernels
their fixed tensorized one, the others :func:`autoq.cpu.injective.schedule_fused`). A
MetaSchedule record found after a handful of trials can be slower than that default, and
MetaSchedule's ``MetaScheduleApplyDatabase`` always applies the record. So after tuning,
:func:`autoq.tuning` measures each tuned kernel's default schedule and its best record with
the same builder and runner, in the same batch, and writes the outcome here; compiling with
the database (:mod:`autoq.build.tuning_database`) skips the records of the kernels whose default
won. Kernels are keyed by their workload's hash in the database (MetaSchedule's
``anchor-block`` equality), the key the records themselves use.

The file, ``autoq_default_schedules.json`` next to ``database_workload.json``::

    {"format": "autoq.default_schedules", "version": 1, "min_gain": 0.03,
     "kernels": [{"workload": "1234...", "task": "fused_add_qnn_requantize",
                  "default_s": 1.2e-05, "tuned_s": 1.5e-05, "default_hash": "987..."}, ...]}

A kernel keeps the tuned record only when it is at least ``min_gain`` (3%) faster than the
default in that measurement (a tie or noise keeps the default); a default that failed to
build or run (``default_s`` null) loses. ``default_hash`` is the structural hash of the
default-scheduled kernel that was measured: when autoq's default schedule changes (a new
autoq version), ``autoq.tuning`` measures that kernel again; until then compiles use the
stored decision.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from autoq.errors import InputError
from autoq.json_document import JsonDocument, check_keys

__all__ = ["DEFAULTS_FILE", "MIN_GAIN", "DefaultSchedules", "KernelChoice", "keeps_default"]

DEFAULTS_FILE = "autoq_default_schedules.json"
FORMAT = "autoq.default_schedules"
VERSION = 1
#: a tuned record must be this much faster than the default schedule to be used
MIN_GAIN = 0.03


def keeps_default(
    default_s: float | None, tuned_s: float | None, min_gain: float = MIN_GAIN
) -> bool:
    """True when the default schedule stays: the tuned record is not at least ``min_gain``
    faster (a default that could not be measured, None, loses to any measured record; a
    record that could not be measured loses to the default).

    >>> keeps_default(10e-6, 9.0e-6)   # 10% faster: the record is used
    False
    >>> keeps_default(10e-6, 9.9e-6)   # 1% is noise: the default stays
    True
    >>> keeps_default(10e-6, 12e-6), keeps_default(None, 12e-6), keeps_default(10e-6, None)
    (True, False, True)
    """
    if tuned_s is None:
        return True
    if default_s is None:
        return False
    return not tuned_s < default_s * (1.0 - min_gain)


def _seconds(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds or null, got {value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0 seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class KernelChoice:
    """One measured kernel: its ``workload`` key in the database, the ``task`` name it was
    tuned under, the seconds of its default schedule and of its best record measured
    together (None: that one failed to build or run), and the structural hash of the
    default-scheduled kernel measured (``default_hash``)."""

    workload: str
    task: str
    default_s: float | None
    tuned_s: float | None
    default_hash: str

    def __post_init__(self) -> None:
        for name in ("workload", "task", "default_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"KernelChoice.{name} must be a non-empty string")
        object.__setattr__(self, "default_s", _seconds(self.default_s, "default_s"))
        object.__setattr__(self, "tuned_s", _seconds(self.tuned_s, "tuned_s"))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> KernelChoice:
        check_keys(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class DefaultSchedules(JsonDocument):
    """The measured kernels of one tuning database (``kernels``, one per workload) and the
    gain a record needs over the default (``min_gain``)."""

    kernels: tuple[KernelChoice, ...] = ()
    min_gain: float = MIN_GAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", tuple(self.kernels))
        if not all(isinstance(k, KernelChoice) for k in self.kernels):
            raise TypeError("DefaultSchedules.kernels must hold KernelChoice objects")
        keys = [k.workload for k in self.kernels]
        if len(set(keys)) != len(keys):
            raise ValueError("DefaultSchedules.kernels lists a workload twice")
        if isinstance(self.min_gain, bool) or not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain!r}")

    def measured(self) -> dict[str, str]:
        """Workload key -> ``default_hash`` of every kernel measured (not measured again
        while its default schedule stays the same)."""
        return {k.workload: k.default_hash for k in self.kernels}

    def default_wins(self) -> frozenset[str]:
        """Workload keys whose records compiles must not apply."""
        return frozenset(
            k.workload for k in self.kernels if keeps_default(k.default_s, k.tuned_s, self.min_gain)
        )

    def with_kernels(self, new) -> DefaultSchedules:
        """These choices plus ``new`` (a new measurement replaces an old one)."""
        replaced = {k.workload for k in new}
        kept = [k for k in self.kernels if k.workload not in replaced]
        return DefaultSchedules((*kept, *new), self.min_gain)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "min_gain": self.min_gain,
            "kernels": [k.to_json() for k in self.kernels],
        }

    @classmethod
    def from_json(cls, d: dict) -> DefaultSchedules:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT!r} document")
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')!r} is not supported (only {VERSION})")
        body = {k: v for k, v in d.items() if k not in ("format", "version")}
        check_keys(cls, body)
        if not isinstance(d["kernels"], list):
            raise ValueError("'kernels' must be a list")
        return cls(tuple(KernelChoice.from_json(k) for k in d["kernels"]), d["min_gain"])

    @classmethod
    def load(cls, folder: str | Path) -> DefaultSchedules:
        """The side file of the database in ``folder`` (none yet: no kernel measured); a
        corrupt file is an :class:`autoq.errors.InputError` naming it."""
        path = Path(folder) / DEFAULTS_FILE
        if not path.exists():
            return cls()
        try:
            return cls.loads(path.read_text())
        except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            raise InputError(
                f"{str(path)!r} is not a valid autoq default-schedules file ({e}); delete it "
                "and run 'autoq tune' / autoq.tune(...) again to re-measure the kernels"
            ) from None

    def save_to(self, folder: str | Path) -> Path:
        """Write atomically as the side file of the database in ``folder``."""
        return self.save(Path(folder) / DEFAULTS_FILE)
