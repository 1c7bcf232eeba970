"""Samples stacked along axis 0 in one array per input, and the ``.npz``/``.npy`` loaders."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from autoq.dataset.contract import (
    DatasetError,
    InputSpec,
    check_names,
    describe_inputs,
    format_shape,
)

__all__ = ["ArrayDataset", "from_npy", "from_npz"]


class ArrayDataset:
    """Samples stacked along axis 0 in one array per input (see the module docstring).

    ``arrays`` maps input names to arrays (``None`` or ``"arr_0"``, ``np.savez``'s default
    key, for "the only input"). Without specs it yields ``arr[i:i+1]`` slices.
    """

    def __init__(self, arrays: Mapping[str | None, np.ndarray]):
        if not arrays:
            raise DatasetError("no arrays given: the dataset is empty")
        self.arrays = {
            k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in arrays.items()
        }
        for k, v in self.arrays.items():
            if v.ndim == 0:
                raise DatasetError(f"array {k!r} is a scalar; stack samples along axis 0")

    def __len__(self) -> int:
        return len(self.samples(None))

    def __iter__(self) -> Iterator[dict | np.ndarray]:
        return iter(self.samples(None))

    def _bind(self, specs: Sequence[InputSpec] | None) -> dict[str, np.ndarray]:
        if specs is None:
            return dict(self.arrays)
        keys = list(self.arrays)
        if len(keys) == 1 and len(specs) == 1 and keys[0] in (None, "arr_0"):
            return {specs[0].name: self.arrays[keys[0]]}
        if None in keys:
            raise DatasetError(
                f"an unnamed array cannot feed a model with {len(specs)} inputs "
                f"({describe_inputs(specs)}): name each array after its input"
            )
        check_names(keys, specs, "arrays")
        return {s.name: self.arrays[s.name] for s in specs}

    def samples(self, specs: Sequence[InputSpec] | None) -> list:
        """Per-sample slices: a list of dicts (or arrays when unnamed and no specs)."""
        bound = self._bind(specs)
        by_name = {s.name: s for s in specs} if specs else {}
        counts: dict = {}
        rows: dict = {}
        for name, arr in bound.items():
            spec = by_name.get(name)
            shape = tuple(arr.shape)
            if spec is None:
                step, count = 1, shape[0]
            elif spec.matches(shape):
                step, count = shape[0] if shape else 1, 1
            elif (
                len(shape) == len(spec.shape)
                and spec.matches((spec.shape[0], *shape[1:]))
                and (spec.shape[0] is not None and shape[0] % spec.shape[0] == 0)
            ):
                step, count = spec.shape[0], shape[0] // spec.shape[0]
            elif len(shape) == len(spec.shape) + 1 and spec.matches(shape[1:]):
                step, count = 0, shape[0]  # one sample per row, row has the full shape
            elif spec.shape and spec.shape[0] == 1 and spec.matches((1, *shape)):
                step, count = -1, 1  # one sample without its batch axis
            else:
                raise DatasetError(
                    f"array for input {name!r} has shape {format_shape(shape)}; expected the input's "
                    f"shape {format_shape(spec.shape)}, samples stacked along axis 0 "
                    f"(k * {spec.shape[0]}, ...), or (k, *{format_shape(spec.shape)})"
                )
            counts[name], rows[name] = count, step
        if len(set(counts.values())) > 1:
            raise DatasetError(
                f"the arrays hold different numbers of samples: {counts}; every input needs "
                "one entry per sample"
            )
        n = next(iter(counts.values()))
        if n == 0:
            raise DatasetError("the calibration dataset is empty: the arrays have 0 samples")
        out = []
        for i in range(n):
            sample = {}
            for name, arr in bound.items():
                step = rows[name]
                if step == -1:
                    sample[name] = arr[None]
                elif step == 0:
                    sample[name] = arr[i]
                else:
                    sample[name] = arr[i * step : (i + 1) * step]
            out.append(sample[None] if list(sample) == [None] else sample)
        return out


def from_npz(path: str | Path) -> ArrayDataset:
    """Arrays saved with ``np.savez(path, x=..., y=...)``: one array per input, named after it.

    Each array is either one sample or samples stacked along axis 0 (see the module
    docstring). The arrays are read into memory.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no .npz file at {str(path)!r}")
    check_npz_sizes(path)
    with np.load(path, allow_pickle=False) as npz:
        try:
            arrays = {k: npz[k] for k in npz.files}
        except MemoryError:
            raise DatasetError(
                f"{str(path)!r} does not fit in this process's memory: split it into several "
                "files (autoq.dataset.NpzShards) or save one input as .npy (memory-mapped)"
            ) from None
    return ArrayDataset(arrays)


def check_npz_sizes(path: Path, memory: int | None = None) -> None:
    """Refuse, before anything is allocated, an ``.npz`` member whose header declares more
    bytes than the member holds (a corrupt or hostile header: a 2.8 TiB shape), or members
    that together declare more than ``memory`` bytes (default: the machine's physical
    memory); headers are read with :mod:`numpy.lib.format`. Not a zip file: left to
    ``np.load``, which names the problem.

    >>> import io, tempfile, zipfile
    >>> from numpy.lib import format as npformat
    >>> head = io.BytesIO()
    >>> npformat.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False,
    ...                                        "shape": (750_000, 1024, 1024)})
    >>> f = Path(tempfile.mkdtemp()) / "x.npz"
    >>> with zipfile.ZipFile(f, "w") as z:
    ...     z.writestr("x.npy", head.getvalue() + bytes(64))
    >>> check_npz_sizes(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoq.errors.DatasetError: '...x.npz': member 'x' declares shape (750000, 1024, 1024) float32 (2.9 TiB) but holds 64 bytes: the file is truncated or corrupt; write it again with np.savez
    """
    import zipfile

    from numpy.lib import format as npformat

    if not zipfile.is_zipfile(path):
        return
    total = 0
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[: -len(".npy")]
            with z.open(info) as f:
                try:
                    version = npformat.read_magic(f)
                    read = npformat.read_array_header_1_0 if version == (1, 0) else None
                    shape, _, dtype = (read or npformat.read_array_header_2_0)(f)
                except ValueError as e:
                    raise DatasetError(f"{str(path)!r}: member {name!r}: {e}") from None
                held = info.file_size - f.tell()
            declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if declared > held and not dtype.hasobject:
                raise DatasetError(
                    f"{str(path)!r}: member {name!r} declares shape {tuple(shape)} {dtype} "
                    f"({_size(declared)}) but holds {held} bytes: the file is truncated or "
                    "corrupt; write it again with np.savez"
                )
            total += declared
    memory = _physical_memory() if memory is None else memory
    if memory and total > memory:
        raise DatasetError(
            f"{str(path)!r} holds {_size(total)} of arrays, more than this machine's "
            f"{_size(memory)} of memory: split it into several files "
            "(autoq.dataset.NpzShards) or save one input as .npy (memory-mapped)"
        )


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0


def _size(n: int) -> str:
    """``2.9 TiB``: bytes in the largest binary unit that keeps a number >= 1."""
    value, unit = float(n), "bytes"
    for u in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, u
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def from_npy(path: str | Path, input_name: str | None = None) -> ArrayDataset:
    """One ``.npy`` array: the only input's samples (or name it with ``input_name``).

    The file is memory-mapped, so only the samples in use are read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no .npy file at {str(path)!r}")
    return ArrayDataset({input_name: np.load(path, mmap_mode="r", allow_pickle=False)})
