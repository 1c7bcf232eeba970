"""Datasets that the workers of a distributed calibration read themselves.

A **shard source** describes the data instead of holding it: ``source.shard(i, n)`` returns
an iterable over the samples of shard ``i`` of ``n`` (the same contract as any dataset, see
:mod:`autoq.dataset`), and is called *in the worker* that holds shard ``i``, so the
coordinator never reads the samples (:mod:`autoq.distributed`). The sources are plain,
picklable objects:

* :class:`NpzShards`: ``.npz`` files (one or several samples each, as :func:`from_npz`) on a
  path every worker sees; shard ``i`` reads files ``i, i + n, i + 2n, ...`` (sorted by name);
* :class:`ImageFolderShards`: an image folder (as :func:`from_image_folder`, same options);
  shard ``i`` reads images ``i, i + n, ...`` (sorted by name);
* :class:`CallableShards`: a user function ``shard(i, n) -> iterable of samples``.

Every sample is still validated against the model's inputs, in the worker, and an error
names the shard. The union of the shards must be the dataset: calibration statistics merge
exactly, so the qparams do not depend on how the samples are split.

>>> NpzShards(["a.npz", "b.npz", "c.npz"]).files_of(1, 2)
['b.npz']
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoq.dataset.arrays import from_npz
from autoq.dataset.contract import DatasetError
from autoq.dataset.images import from_image_folder

__all__ = ["CallableShards", "ImageFolderShards", "NpzShards", "ShardSource", "is_shard_source"]


class ShardSource:
    """Base of the shard sources (see the module docstring)."""

    def shard(self, i: int, n: int) -> Iterable:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


def is_shard_source(obj) -> bool:
    """Whether ``obj`` is a dataset the workers read themselves."""
    return isinstance(obj, ShardSource)


@dataclass(frozen=True)
class NpzShards(ShardSource):
    """``.npz`` files on a shared path: a list of paths or one glob pattern
    (``"/data/calib/*.npz"``). Each file holds one or more samples (see :func:`from_npz`)."""

    files: Sequence[str] | str

    def __post_init__(self) -> None:
        if isinstance(self.files, str | Path):
            found = sorted(glob.glob(str(self.files)))
            if not found:
                raise DatasetError(f"NpzShards: no file matches {str(self.files)!r}")
            object.__setattr__(self, "files", tuple(found))
        else:
            object.__setattr__(self, "files", tuple(str(f) for f in self.files))
        if not self.files:
            raise DatasetError("NpzShards: no files given")

    def files_of(self, i: int, n: int) -> list[str]:
        return list(self.files[i::n])

    def shard(self, i: int, n: int) -> Iterable:
        for f in self.files_of(i, n):
            yield from from_npz(f)

    def describe(self) -> str:
        return f"NpzShards({len(self.files)} files, first {self.files[0]!r})"


@dataclass(frozen=True)
class ImageFolderShards(ShardSource):
    """An image folder on a shared path, read and preprocessed by the workers;
    ``options`` are :func:`from_image_folder`'s keyword arguments (``size`` is required)."""

    path: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "size" not in self.options:
            raise ValueError("ImageFolderShards needs options['size'] (see from_image_folder)")
        object.__setattr__(self, "path", str(self.path))

    def shard(self, i: int, n: int) -> Iterable:
        folder = from_image_folder(self.path, **self.options)
        folder.files = folder.files[i::n]
        return folder

    def describe(self) -> str:
        return f"ImageFolderShards({self.path!r})"


@dataclass(frozen=True)
class CallableShards(ShardSource):
    """A user function ``fn(i, n) -> iterable of samples`` (shard ``i`` of ``n``); it must be
    importable or picklable by the workers (a module-level function)."""

    fn: Callable[[int, int], Iterable]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"CallableShards needs a function shard(i, n), got {self.fn!r}")

    def shard(self, i: int, n: int) -> Iterable:
        return self.fn(i, n)

    def describe(self) -> str:
        return f"CallableShards({getattr(self.fn, '__qualname__', self.fn)!r})"
