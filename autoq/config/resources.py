"""What a run may use, not what it computes: memory, a cache folder, progress bars and a
Dask cluster (``autoq.Quantizer(..., memory_budget_mb=, cache_dir=, progress=,
distributed=)``). The same :class:`autoq.Config` gives the same model whatever these are.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

from autoq.json_document import check_keys

__all__ = ["Distributed", "Resources"]


@dataclass(frozen=True)
class Distributed:
    """Calibrate data-parallel on a Dask cluster (see :mod:`autoq.distributed`; needs the
    optional extra ``autoq[dask]``).

    ``scheduler``: the address of a running Dask scheduler (``"tcp://host:8786"``), or None
    for a local cluster of ``workers`` processes started for the run (one thread each).
    ``shards``: how many shards the samples are split into (default: one per worker; shard
    ``i`` lives on worker ``i % workers``). ``timeout_s``: how long to wait for the workers
    to appear (connecting to ``scheduler`` takes at most 5 s of it). Each shard caches its
    activations within ``Resources.memory_budget_mb``.
    ``retries``: restarts of a lost shard on another worker (:mod:`autoq.distributed.remote_shards`).

    >>> Distributed.from_json(Distributed(workers=2).to_json()) == Distributed(workers=2)
    True
    """

    scheduler: str | None = None
    workers: int | None = None
    shards: int | None = None
    timeout_s: float = 60.0
    retries: int = 1

    def __post_init__(self) -> None:
        if (s := self.scheduler) is not None and (not isinstance(s, str) or not s):
            raise TypeError(f"Distributed.scheduler must be an address string, got {s!r}")
        for name in ("workers", "shards"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"Distributed.{name} must be an int >= 1 or None, got {v!r}")
        if type(self.retries) is not int or self.retries < 0:  # (bool is not int)
            raise ValueError(f"Distributed.retries must be an int >= 0, got {self.retries!r}")
        if (self.scheduler is None) == (self.workers is None):
            raise ValueError(
                "Distributed needs exactly one of scheduler (the address of a running Dask "
                f"scheduler) or workers (a local cluster of that many processes); got "
                f"scheduler={self.scheduler!r}, workers={self.workers!r}"
            )
        if not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise ValueError(f"Distributed.timeout_s must be > 0, got {self.timeout_s!r}")

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> Distributed:
        check_keys(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class Resources:
    """What a run may use, not what it computes (``autoq.Quantizer(..., memory_budget_mb=,
    cache_dir=, progress=, distributed=)``): the same choices give the same model whatever
    these are.

    ``memory_budget_mb``: RAM for cached activations during calibration (beyond it they
    spill to ``cache_dir`` or a temporary directory). ``progress``: every stage's live progress
    (:mod:`autoq.config.progress`; None: only when standard error is a terminal). ``distributed``: calibrate on a Dask cluster
    (:class:`Distributed`); None: in this process, without importing Dask.

    >>> Resources(memory_budget_mb=-1)
    Traceback (most recent call last):
    ValueError: memory_budget_mb must be a number >= 0 (MB), got -1
    """

    memory_budget_mb: float = 1024.0
    cache_dir: str | None = None
    progress: bool | None = None
    distributed: Distributed | None = None

    def __post_init__(self) -> None:
        m = self.memory_budget_mb
        if isinstance(m, bool) or not isinstance(m, int | float) or not m >= 0:
            raise ValueError(f"memory_budget_mb must be a number >= 0 (MB), got {m!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str | os.PathLike):
            raise TypeError(f"cache_dir must be a folder path or None, got {self.cache_dir!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise TypeError(f"progress must be True, False or None, got {self.progress!r}")
        if self.distributed is not None and not isinstance(self.distributed, Distributed):
            raise TypeError(f"distributed must be a Distributed or None, got {self.distributed!r}")

    @property
    def show_progress(self) -> bool:
        """Whether to draw progress bars: ``progress``, or (None) standard error is a TTY."""
        if self.progress is not None:
            return self.progress
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
