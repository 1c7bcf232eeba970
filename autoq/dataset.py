"""Calibration data: the dataset contract, validation, and loaders.

**Contract.** A dataset is a source of *samples*; a sample is one call of the model: a dict
``{input name: np.ndarray}`` with exactly the model's data inputs, or, for a single-input
model, just the array. Arrays must have the input's shape and dtype (a missing leading batch
axis of size 1 is added: ``(3, 224, 224)`` is accepted for ``(1, 3, 224, 224)``; nothing else
is converted or cast). Accepted sources:

* any re-iterable (``list``, ``tuple``, a ``torch`` ``DataLoader`` yielding dicts, an
  :class:`ImageFolder`, any object whose ``__iter__`` starts over): iterated again for every
  pass, nothing is kept in memory;
* a zero-argument callable returning an iterable (e.g. a generator function): called once per
  pass, nothing kept;
* a one-shot iterator (a generator object, ``iter(...)``): it cannot be rewound, so the
  samples it yields are kept in memory as they are consumed, and later passes replay them
  (then continue where the iterator stopped, if a pass ended early). This is the only case
  that holds samples in RAM; pass ``cache=False`` to forbid it (a second pass then raises),
  or pass a generator *function* instead of a generator to stream every pass;
* stacked arrays: an :class:`ArrayDataset` (:func:`from_npz`, :func:`from_npy`), a dict
  ``{input name: array}`` or a bare array (single input). Each array is split along axis 0:
  an array of exactly the input's shape is one sample; ``(k * B, ...)`` for an input of
  batch ``B`` is ``k`` samples; ``(k, *shape)`` is ``k`` samples of ``shape``.

**Validation before any work.** :func:`as_dataset` (which the calibration driver calls
before compiling anything) checks the dataset against the model's :class:`InputSpec` list
and raises :class:`DatasetError` naming the problem: an empty dataset; unknown, missing or
extra input names (listing the expected ones); the wrong shape or dtype (input name, expected
vs given); NaN or Inf values (input name and sample index). In-memory datasets (lists,
tuples, stacked arrays) are checked entirely up front; streamed ones have their first sample
checked up front and every later sample checked as it arrives, before the model sees it.

**Loaders.** :func:`from_image_folder` (Pillow, optional extra ``autoq[images]``: the most
common imaging library, and the one real preprocessing pipelines such as the ONNX model
packages use), :func:`from_npz`, :func:`from_npy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArrayDataset",
    "CalibrationDataset",
    "DatasetError",
    "ImageFolder",
    "InputSpec",
    "as_dataset",
    "from_image_folder",
    "from_npy",
    "from_npz",
    "input_specs",
    "validate_sample",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


class DatasetError(ValueError):
    """The calibration data does not fit the model (the message says where and how)."""


@dataclass(frozen=True)
class InputSpec:
    """One data input of a model: name, shape (``None`` for a symbolic dim), dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.name!r} {_fmt(self.shape)} {self.dtype}"

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            d is None or d == s for d, s in zip(self.shape, shape, strict=True)
        )


def input_specs(mod, params=None, func_name: str = "main") -> list[InputSpec]:
    """The data inputs of a Relax function: its parameters that are not in ``params``.

    ``mod`` is an ``IRModule`` (``mod[func_name]`` is used) or a ``relax.Function``;
    ``params`` a dict of weights or any collection of weight names.
    """
    import tvm
    from tvm import relax

    func = mod[func_name] if isinstance(mod, tvm.IRModule) else mod
    if not isinstance(func, relax.Function):
        raise TypeError(f"expected an IRModule or a relax.Function, got {type(mod).__name__}")
    weights = set(params or ())
    specs = []
    for p in func.params:
        if p.name in weights:
            continue
        ty = p.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise DatasetError(f"input {p.name!r} is not a tensor of known rank ({ty})")
        dims = []
        for d in ty.shape.values:
            try:
                dims.append(int(d))
            except (TypeError, ValueError):
                dims.append(None)
        specs.append(InputSpec(p.name, tuple(dims), str(ty.dtype)))
    return specs


def _listing(specs: Sequence[InputSpec]) -> str:
    return ", ".join(str(s) for s in specs)


# --------------------------------------------------------------------------------------------
# per-sample validation
# --------------------------------------------------------------------------------------------


def _to_array(value, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
        return value.detach().cpu().numpy()
    if hasattr(value, "numpy") and callable(value.numpy):  # tvm.runtime.Tensor
        return np.asarray(value.numpy())
    if isinstance(value, np.generic):
        return np.asarray(value)
    raise DatasetError(f"{where}: expected a numpy array, got {type(value).__name__}")


def _check_array(arr: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    shape = tuple(arr.shape)
    if not spec.matches(shape):
        if len(spec.shape) >= 1 and spec.shape[0] == 1 and spec.matches((1, *shape)):
            arr = arr.reshape((1, *shape))
        else:
            raise DatasetError(f"{where}: expected shape {_fmt(spec.shape)}, got {_fmt(shape)}")
    if str(arr.dtype) != spec.dtype:
        raise DatasetError(
            f"{where}: expected dtype {spec.dtype}, got {arr.dtype} "
            f"(convert it with .astype(np.{spec.dtype}))"
        )
    if np.issubdtype(arr.dtype, np.inexact):
        finite = np.isfinite(arr)
        if not finite.all():
            n_nan = int(np.isnan(arr).sum())
            n_inf = int(arr.size - finite.sum()) - n_nan
            raise DatasetError(f"{where}: contains {n_nan} NaN and {n_inf} Inf value(s)")
    return np.ascontiguousarray(arr)


def _fmt(shape) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def _check_names(keys: list, specs: Sequence[InputSpec], where: str) -> None:
    """Unknown or missing input names are an error listing the model's inputs."""
    names = [s.name for s in specs]
    unknown = [k for k in keys if k not in names]
    missing = [n for n in names if n not in keys]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown input name(s) {unknown}")
        if missing:
            parts.append(f"missing input(s) {missing}")
        raise DatasetError(
            f"{where}: {' and '.join(parts)}; the model's inputs are: {_listing(specs)}"
        )


def validate_sample(sample, index: int, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """Check one sample against ``specs``; return it as ``{name: contiguous array}``."""
    if isinstance(sample, Mapping):
        _check_names(list(sample.keys()), specs, f"sample {index}")
        return {
            s.name: _check_array(
                _to_array(sample[s.name], f"sample {index}, input {s.name!r}"),
                s,
                f"sample {index}, input {s.name!r}",
            )
            for s in specs
        }
    is_array = isinstance(sample, np.ndarray | np.generic) or (
        hasattr(sample, "numpy") and not isinstance(sample, list | tuple | str | bytes)
    )
    if not is_array:
        raise DatasetError(
            f"sample {index} is a {type(sample).__name__}; a sample must be a dict "
            f"{{input name: array}} or, for a single-input model, an array. "
            f"The model's inputs are: {_listing(specs)}"
        )
    if len(specs) != 1:
        raise DatasetError(
            f"sample {index} is a single array but the model has {len(specs)} inputs "
            f"({_listing(specs)}): yield dicts {{input name: array}}"
        )
    spec = specs[0]
    where = f"sample {index}, input {spec.name!r}"
    return {spec.name: _check_array(_to_array(sample, where), spec, where)}


# --------------------------------------------------------------------------------------------
# stacked arrays
# --------------------------------------------------------------------------------------------


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
        return len(self._split(None))

    def __iter__(self) -> Iterator[dict | np.ndarray]:
        return iter(self._split(None))

    def _bind(self, specs: Sequence[InputSpec] | None) -> dict[str, np.ndarray]:
        if specs is None:
            return dict(self.arrays)
        keys = list(self.arrays)
        if len(keys) == 1 and len(specs) == 1 and keys[0] in (None, "arr_0"):
            return {specs[0].name: self.arrays[keys[0]]}
        if None in keys:
            raise DatasetError(
                f"an unnamed array cannot feed a model with {len(specs)} inputs "
                f"({_listing(specs)}): name each array after its input"
            )
        _check_names(keys, specs, "arrays")
        return {s.name: self.arrays[s.name] for s in specs}

    def _split(self, specs: Sequence[InputSpec] | None) -> list:
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
                    f"array for input {name!r} has shape {_fmt(shape)}; expected the input's "
                    f"shape {_fmt(spec.shape)}, samples stacked along axis 0 "
                    f"(k * {spec.shape[0]}, ...), or (k, *{_fmt(spec.shape)})"
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
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return ArrayDataset(arrays)


def from_npy(path: str | Path, input_name: str | None = None) -> ArrayDataset:
    """One ``.npy`` array: the only input's samples (or name it with ``input_name``).

    The file is memory-mapped, so only the samples in use are read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no .npy file at {str(path)!r}")
    return ArrayDataset({input_name: np.load(path, mmap_mode="r", allow_pickle=False)})


# --------------------------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------------------------


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int | np.integer):
        return int(v), int(v)
    if isinstance(v, Sequence) and len(v) == 2 and all(isinstance(d, int | np.integer) for d in v):
        return int(v[0]), int(v[1])
    raise ValueError(f"{what} must be an int or a (height, width) pair, got {v!r}")


class ImageFolder:
    """Images of a folder as samples, read again on every pass (see :func:`from_image_folder`)."""

    def __init__(self, files: list[Path], load: Callable[[Path], np.ndarray], input_name):
        self.files = files
        self._load = load
        self.input_name = input_name

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self):
        for f in self.files:
            arr = self._load(f)
            yield {self.input_name: arr} if self.input_name is not None else arr


def from_image_folder(
    path: str | Path,
    size: int | tuple[int, int],
    mean: Sequence[float] = (0.0, 0.0, 0.0),
    std: Sequence[float] = (1.0, 1.0, 1.0),
    layout: str = "NCHW",
    *,
    resize: int | tuple[int, int] | None = None,
    crop: str | None = None,
    color: str = "RGB",
    scale: float = 1 / 255,
    dtype: str = "float32",
    transform: Callable | None = None,
    input_name: str | None = None,
    recursive: bool = False,
    limit: int | None = None,
) -> ImageFolder:
    """Images in ``path`` (sorted by name) as model inputs.

    Each image is converted to ``color`` (``"RGB"``, ``"BGR"`` or ``"L"`` for one channel),
    resized (bilinear), cropped, then normalized as ``(pixel * scale - mean) / std`` per
    channel and laid out as ``layout`` (``NCHW``, ``NHWC``, ``CHW`` or ``HWC``).

    Geometry: ``size`` is the final (height, width). With ``resize=None`` the image is resized
    to ``size`` directly (aspect ratio not kept). With ``resize=(h, w)`` it is resized to that
    and then cropped to ``size``; with ``resize=int`` its shorter side is resized to that
    (aspect kept) and then cropped. ``crop`` is ``"center"`` (the default when ``resize`` is
    given) or ``None``.

    ``transform``: a callable ``PIL.Image -> np.ndarray`` that replaces resizing, cropping and
    normalization (it gets the image converted to ``color``; ``"BGR"`` images are handed over
    as RGB). ``input_name``: yield ``{input_name: array}`` instead of arrays. Requires Pillow
    (``pip install pillow`` or ``autoq[images]``).
    """
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "from_image_folder needs Pillow: pip install pillow (or autoq[images])"
        ) from None
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder at {str(root)!r}")
    pattern = "**/*" if recursive else "*"
    files = sorted(
        p for p in root.glob(pattern) if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if limit is not None:
        files = files[:limit]
    if not files:
        raise DatasetError(
            f"no images in {str(root)!r} (extensions {', '.join(IMAGE_EXTENSIONS)}"
            f"{'' if recursive else '; subfolders not searched, pass recursive=True'})"
        )
    if color not in ("RGB", "BGR", "L"):
        raise ValueError(f"color must be 'RGB', 'BGR' or 'L', got {color!r}")
    if layout not in ("NCHW", "NHWC", "CHW", "HWC"):
        raise ValueError(f"layout must be NCHW, NHWC, CHW or HWC, got {layout!r}")
    out_h, out_w = _pair(size, "size")
    channels = 1 if color == "L" else 3
    mean_a = np.asarray(mean, dtype=np.float64).reshape(-1)
    std_a = np.asarray(std, dtype=np.float64).reshape(-1)
    for what, a in (("mean", mean_a), ("std", std_a)):
        if a.size not in (1, channels):
            raise ValueError(f"{what} must have 1 or {channels} values for color={color!r}")
    if np.any(std_a == 0):
        raise ValueError("std must not contain zeros")
    if crop not in (None, "center"):
        raise ValueError(f"crop must be 'center' or None, got {crop!r}")
    if resize is not None and crop is None:
        crop = "center"
    mode = "L" if color == "L" else "RGB"

    def geometry(img):
        if resize is None:
            return img.resize((out_w, out_h), Image.BILINEAR)
        if isinstance(resize, int | np.integer):
            w, h = img.size
            short = int(resize)
            if w <= h:
                new = (short, max(1, round(h * short / w)))
            else:
                new = (max(1, round(w * short / h)), short)
        else:
            rh, rw = _pair(resize, "resize")
            new = (rw, rh)
        img = img.resize(new, Image.BILINEAR)
        w, h = img.size
        if w < out_w or h < out_h:
            raise DatasetError(f"resize gives {h}x{w}, smaller than the crop size {out_h}x{out_w}")
        left, top = (w - out_w) // 2, (h - out_h) // 2
        return img.crop((left, top, left + out_w, top + out_h))

    def load(file: Path) -> np.ndarray:
        try:
            with Image.open(file) as im:
                img = im.convert(mode)
        except Exception as e:
            raise DatasetError(f"cannot read image {str(file)!r}: {e}") from e
        if transform is not None:
            return transform(img)
        arr = np.asarray(geometry(img), dtype=np.float64)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if color == "BGR":
            arr = arr[:, :, ::-1]
        arr = (arr * scale - mean_a) / std_a
        if layout in ("NCHW", "CHW"):
            arr = arr.transpose(2, 0, 1)
        if layout.startswith("N"):
            arr = arr[None]
        return np.ascontiguousarray(arr.astype(dtype))

    return ImageFolder(files, load, input_name)


# --------------------------------------------------------------------------------------------
# the object the calibration driver iterates
# --------------------------------------------------------------------------------------------


def _is_one_shot(obj) -> bool:
    """An iterator (it has ``__next__``): iterating it again does not start over."""
    return isinstance(obj, Iterator)


class CalibrationDataset:
    """A validated, repeatable view of a user's dataset (build it with :func:`as_dataset`).

    Iterating yields ``{input name: np.ndarray}`` dicts in the specs' order, every sample
    checked; each ``for`` loop is one pass. ``num_samples`` is known after the first full
    pass (or at once for in-memory datasets).
    """

    def __init__(
        self,
        dataset,
        specs: Sequence[InputSpec],
        *,
        limit: int | None = None,
        cache: bool | str = "auto",
    ):
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        if cache not in ("auto", True, False):
            raise ValueError(f"cache must be 'auto', True or False, got {cache!r}")
        self.specs = list(specs)
        if not self.specs:
            raise DatasetError("the model has no data inputs to calibrate")
        self.limit = limit
        self.num_samples: int | None = None
        self._samples: list | None = None  # validated, when everything is in memory
        self._factory: Callable[[], Iterable] | None = None
        self._iterator: Iterator | None = None  # one-shot source
        self._buffer: list[dict] = []  # what the one-shot source has yielded so far
        self._exhausted = False
        self._keep = cache is not False
        self._streamed = False

        if dataset is None or isinstance(dataset, str | bytes):
            raise DatasetError(
                f"a dataset must be an iterable of samples, got {type(dataset).__name__}"
            )
        if isinstance(dataset, ArrayDataset | np.ndarray) or (
            isinstance(dataset, Mapping) and all(hasattr(v, "shape") for v in dataset.values())
        ):
            if isinstance(dataset, np.ndarray):
                dataset = ArrayDataset({None: dataset})
            elif isinstance(dataset, Mapping):
                dataset = ArrayDataset(dataset)
            self._set_samples(dataset._split(self.specs))
        elif isinstance(dataset, list | tuple):
            self._set_samples(dataset)
        elif _is_one_shot(dataset):
            self._iterator = dataset
            self._peek_one_shot()
        elif callable(dataset) and not hasattr(dataset, "__iter__"):
            self._factory = dataset
            self._peek(self._factory())
        elif hasattr(dataset, "__iter__"):
            self._factory = lambda: dataset
            if cache is True:
                self._iterator = iter(dataset)
                self._peek_one_shot()
                self._factory = None
            else:
                self._peek(dataset)
        else:
            raise DatasetError(
                f"a dataset must be an iterable of samples or a function returning one, "
                f"got {type(dataset).__name__}"
            )

    def _set_samples(self, samples: Sequence) -> None:
        """An in-memory dataset: every sample is checked now."""
        if self.limit is not None:
            samples = samples[: self.limit]
        if not len(samples):
            raise DatasetError("the calibration dataset is empty: it yielded no samples")
        samples = [validate_sample(s, i, self.specs) for i, s in enumerate(samples)]
        self._samples = samples
        self.num_samples = len(samples)

    def _peek(self, iterable) -> None:
        for raw in iterable:
            validate_sample(raw, 0, self.specs)
            return
        raise DatasetError("the calibration dataset is empty: it yielded no samples")

    def _peek_one_shot(self) -> None:
        if self._pull() is None:
            raise DatasetError("the calibration dataset is empty: it yielded no samples")

    def _pull(self) -> dict | None:
        """Next sample of the one-shot source, validated and kept in the buffer."""
        if self._exhausted or (self.limit is not None and len(self._buffer) >= self.limit):
            self._exhausted = True
            return None
        try:
            raw = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            self.num_samples = len(self._buffer)
            return None
        sample = validate_sample(raw, len(self._buffer), self.specs)
        self._buffer.append(sample)
        return sample

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._samples is not None:
            return iter(self._samples)
        if self._iterator is not None:
            return self._iter_one_shot()
        return self._iter_factory()

    def _iter_one_shot(self):
        if not self._keep:
            # streaming without keeping: only the peeked sample is held, and only one pass
            if self._streamed:
                raise DatasetError(
                    "the dataset is a one-shot iterator (e.g. a generator object) that was "
                    "already consumed and cache=False; pass a list, a re-iterable, or a "
                    "function returning a fresh iterator"
                )
            self._streamed = True
            yield from self._buffer
            self._buffer = []
            k = 1
            for raw in self._iterator:
                if self.limit is not None and k >= self.limit:
                    break
                yield validate_sample(raw, k, self.specs)
                k += 1
            self.num_samples = k
            return
        i = 0
        while i < len(self._buffer) or self._pull() is not None:
            yield self._buffer[i]
            i += 1
        # the source is exhausted (or the limit reached): from now on replay the buffer
        self.num_samples = len(self._buffer)
        self._samples = self._buffer

    def _iter_factory(self):
        k = 0
        for raw in self._factory():
            if self.limit is not None and k >= self.limit:
                break
            yield validate_sample(raw, k, self.specs)
            k += 1
        if k == 0:
            raise DatasetError("the calibration dataset is empty: this pass yielded no samples")
        if self.num_samples is None:
            self.num_samples = k


def as_dataset(
    dataset,
    model,
    params=None,
    *,
    limit: int | None = None,
    cache: bool | str = "auto",
) -> CalibrationDataset:
    """Check ``dataset`` against a model's inputs and return a repeatable view of it.

    ``model`` is an ``IRModule`` or ``relax.Function`` (its data inputs are the parameters
    not in ``params``) or a list of :class:`InputSpec`. ``limit`` caps the samples per pass.
    ``cache``: ``"auto"`` keeps the samples of one-shot iterators (only those) so that they
    can be replayed; ``True`` keeps every sample (for expensive loaders); ``False`` never keeps
    samples (one pass only over a one-shot iterator). Raises :class:`DatasetError` before any
    model work if the data does not fit (see the module docstring).
    """
    if isinstance(model, list | tuple) and all(isinstance(s, InputSpec) for s in model):
        specs = list(model)
    else:
        specs = input_specs(model, params)
    if isinstance(dataset, CalibrationDataset) and dataset.specs == specs and limit is None:
        return dataset  # already validated for these inputs: every stage shares one view
    return CalibrationDataset(dataset, specs, limit=limit, cache=cache)
