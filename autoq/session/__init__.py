"""A quantized model folder as a callable: ``sess = autoq.load(folder)``.

``autoq quantize --out FOLDER`` (or :func:`autoq.export_library`) writes ``model.so`` and its
stamp ``model.so.autoq.json``, which records the inputs and outputs of the model (name,
shape, dtype); with a folder of images as calibration data, also ``preprocess.json``
(:class:`autoq.dataset.ImagePreprocessing`). :func:`load` reads them back:

* ``sess.inputs`` / ``sess.outputs``: :class:`TensorInfo` (name, shape, dtype) each;
* ``sess.run({name: array})`` -> ``{output name: ndarray}``; a missing or unknown input, a
  wrong dtype or a wrong shape is an :class:`autoq.errors.InputError` naming the input and
  what it takes;
* **batches.** The library is built for one batch size (``sess.batch``, the first dimension
  the inputs share; ``autoq quantize --batch N``). Inputs with another number of rows run in
  chunks of ``sess.batch`` rows (the last chunk padded with zeros, the padding dropped from
  the outputs), so any batch works; the outputs are the chunks' outputs concatenated;
* ``sess.run_images(paths)``: the images preprocessed as the calibration images were, stacked
  on the batch axis, run;
* **threads.** Each call runs on the calling thread's pool (:func:`autoq.set_threads`) or on
  one thread, whichever the session's recent calls found faster
  (:class:`autoq.session.pool_width.WidthChooser`: when another process keeps a CPU busy,
  one thread is many times faster than two); the pool's width is as before after the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np

from autoq.errors import InputError, LibraryError
from autoq.session.pool_width import WidthChooser

__all__ = ["LIBRARY", "PREPROCESS", "Session", "TensorInfo", "load"]

#: the library and the image preprocessing in a model folder
LIBRARY, PREPROCESS = "model.so", "preprocess.json"


@dataclass(frozen=True)
class TensorInfo:
    """An input or output of a model: ``shape`` has None for a dimension of any size."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name} ({dims}) {self.dtype}"


def _infos(items: list) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(d["name"], tuple(d["shape"]), d["dtype"]) for d in items)


def load(folder: str | Path, device=None) -> Session:
    """The model in ``folder`` (an ``autoq quantize --out`` folder, or a library file
    written by :func:`autoq.export_library`) as a :class:`Session`."""
    from autoq.build import load_library
    from autoq.dataset.images import ImagePreprocessing
    from autoq.ir.library_file import read_signature

    folder = Path(folder)
    library = folder / LIBRARY if folder.is_dir() else folder
    if not folder.exists():
        raise LibraryError(f"no model folder or library at {str(folder)!r}")
    vm = load_library(library, device)  # checks the file first
    signature = read_signature(library)
    if signature is None:
        raise LibraryError(
            f"{str(library)!r} records no inputs and outputs (exported by an older autoq or "
            "by plain TVM): export it again with autoq.export_library, or call "
            "autoq.load_library and the VM's main directly"
        )
    preprocess = None
    file = library.parent / PREPROCESS
    if file.is_file():
        try:
            preprocess = ImagePreprocessing.loads(file.read_text())
        except (ValueError, TypeError) as e:
            raise InputError(f"{file} is not a valid image preprocessing file: {e}") from None
    return Session(vm, _infos(signature["inputs"]), _infos(signature["outputs"]), preprocess)


class Session:
    """A loaded model (see the module docstring); made by :func:`load`."""

    def __init__(self, vm, inputs, outputs, preprocess=None):
        self._vm = vm
        self.inputs: tuple[TensorInfo, ...] = tuple(inputs)
        self.outputs: tuple[TensorInfo, ...] = tuple(outputs)
        #: how ``run_images`` turns a file into the input (None: no ``preprocess.json``)
        self.preprocess = preprocess
        firsts = {i.shape[0] if i.shape else None for i in self.inputs}
        #: the number of rows one call of the library takes (None: no shared batch axis)
        self.batch: int | None = firsts.pop() if len(firsts) == 1 else None
        self._widths: dict[int, WidthChooser] = {}  # per pool width the caller set

    def __repr__(self) -> str:
        return (
            f"Session(inputs=[{', '.join(map(str, self.inputs))}], "
            f"outputs=[{', '.join(map(str, self.outputs))}])"
        )

    def run(self, feeds) -> dict[str, np.ndarray]:
        """``{output name: ndarray}`` for ``feeds`` = ``{input name: array}`` (a bare array
        for a model with one input); see the module docstring for batches."""
        arrays = self._checked(feeds)
        rows = {a.shape[0] for a in arrays}
        if self.batch is None or rows == {self.batch}:
            return self._call(arrays)
        n = rows.pop()
        if any(o.shape[:1] != (self.batch,) for o in self.outputs):
            raise InputError(
                f"the inputs have {n} rows; the library was built for batch {self.batch} and "
                f"its outputs ({', '.join(map(str, self.outputs))}) have no batch axis to "
                f"run them in chunks: quantize with --batch {n}"
            )
        chunks = []
        for start in range(0, n, self.batch):
            part = [a[start : start + self.batch] for a in arrays]
            short = self.batch - part[0].shape[0]
            if short:
                part = [np.concatenate([p, np.zeros((short, *p.shape[1:]), p.dtype)]) for p in part]
            out = self._call(part)
            chunks.append({k: v[: self.batch - short] for k, v in out.items()})
        return {o.name: np.concatenate([c[o.name] for c in chunks]) for o in self.outputs}

    def run_images(self, paths: Sequence[str | Path]) -> dict[str, np.ndarray]:
        """The outputs for the image files ``paths`` (one row each, in order), preprocessed
        by :attr:`preprocess` (the folder's ``preprocess.json``)."""
        if self.preprocess is None:
            raise InputError(
                "this model folder has no preprocess.json (it was not calibrated on a folder "
                "of images): preprocess the images yourself and call run({name: array})"
            )
        if len(self.inputs) != 1:
            names = ", ".join(i.name for i in self.inputs)
            raise InputError(f"run_images feeds a model with one input; this one has {names}")
        if isinstance(paths, str | Path):
            paths = [paths]
        if not paths:
            raise InputError("run_images: no image files given")
        images = [self.preprocess.read(p) for p in paths]
        if self.preprocess.layout.startswith("N"):
            return self.run({self.inputs[0].name: np.concatenate(images)})
        outs = [self.run({self.inputs[0].name: x}) for x in images]
        return {k: np.stack([o[k] for o in outs]) for k in outs[0]}

    def _checked(self, feeds) -> list[np.ndarray]:
        """The inputs in order as arrays; an :class:`InputError` naming the first bad one."""
        if not isinstance(feeds, Mapping):
            if len(self.inputs) != 1:
                raise InputError(
                    "pass {input name: array} for a model with several inputs: "
                    + ", ".join(map(str, self.inputs))
                )
            feeds = {self.inputs[0].name: feeds}
        unknown = [k for k in feeds if k not in {i.name for i in self.inputs}]
        if unknown:
            raise InputError(
                f"unknown input {unknown[0]!r}; the model takes " + ", ".join(map(str, self.inputs))
            )
        arrays = []
        for info in self.inputs:
            if info.name not in feeds:
                raise InputError(f"input {info.name!r} is missing: the model takes {info}")
            arrays.append(_checked_array(info, feeds[info.name], self.batch))
        rows = {a.shape[0] for a in arrays} if self.batch is not None else set()
        if len(rows) > 1:
            given = ", ".join(
                f"{i.name}: {a.shape[0]}" for i, a in zip(self.inputs, arrays, strict=True)
            )
            raise InputError(f"the inputs have different numbers of rows ({given})")
        return arrays

    def _call(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        import tvm

        out = self._main([tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays])
        flat = _flat(out)
        return {o.name: v for o, v in zip(self.outputs, flat, strict=True)}

    def _main(self, args: list):
        """The library's ``main`` on the calling thread's pool or on one thread, whichever
        this session's recent calls found faster (:class:`WidthChooser`); the pool's width
        is as before after the call."""
        from autoq.threads import configure_pool, pool_threads, use_machine_cores

        use_machine_cores()  # a thread of the caller's own: its pool sized by autoq
        pool = pool_threads()
        if pool == 1:
            return self._vm["main"](*args)
        if pool not in self._widths:
            self._widths[pool] = WidthChooser((1, pool))
        chooser = self._widths[pool]
        n = chooser.next()
        if n != pool:
            configure_pool(n)
        try:
            start = perf_counter()
            out = self._vm["main"](*args)
            chooser.record(n, perf_counter() - start)
            return out
        finally:
            if n != pool:
                configure_pool(pool)


def _checked_array(info: TensorInfo, value, batch: int | None) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype != np.dtype(info.dtype):
        raise InputError(
            f"input {info.name!r} is {a.dtype}, the model takes {info.dtype}: pass "
            f"it as array.astype({info.dtype!r})"
        )
    want = info.shape
    fits = len(a.shape) == len(want) and all(
        w is None or g == w or (k == 0 and batch is not None)
        for k, (g, w) in enumerate(zip(a.shape, want, strict=False))
    )
    if not fits:
        any_rows = " (any number of rows)" if batch is not None else ""
        raise InputError(
            f"input {info.name!r} has shape {tuple(a.shape)}, the model takes {info}{any_rows}"
        )
    return a


def _flat(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [t for v in value for t in _flat(v)]
