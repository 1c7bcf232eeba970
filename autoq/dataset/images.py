"""Images of a folder as calibration samples: read with Pillow, turned upright, resized,
cropped or letterboxed, normalized and laid out like the model's input
(:class:`ImagePreprocessing`, saved with a quantized model as ``preprocess.json``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from autoq.dataset.contract import DatasetError
from autoq.json_document import JsonDocument, check_keys

__all__ = [
    "CROPS",
    "IMAGE_EXTENSIONS",
    "INTERPOLATIONS",
    "LETTERBOX_FILL",
    "ImageFolder",
    "ImagePreprocessing",
    "from_image_folder",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")
_COLORS = ("RGB", "BGR", "L")
_LAYOUTS = ("NCHW", "NHWC", "CHW", "HWC")


class ImageFolder:
    """Images of a folder as samples, read again on every pass (see :func:`from_image_folder`)."""

    def __init__(self, files: list[Path], load: Callable[[Path], np.ndarray], input_name):
        self.files = files
        self._load = load
        self.input_name = input_name
        #: how each file becomes an input (None with a ``transform``)
        self.preprocessing: ImagePreprocessing | None = None

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
    interpolation: str = "bilinear",
    color: str = "RGB",
    scale: float = 1 / 255,
    dtype: str = "float32",
    transform: Callable | None = None,
    input_name: str | None = None,
    recursive: bool = False,
    limit: int | None = None,
) -> ImageFolder:
    """Images in ``path`` (sorted by name) as model inputs.

    Each image is turned upright by its EXIF orientation tag, converted to ``color``
    (``"RGB"``, ``"BGR"`` or ``"L"`` for one channel), resized (``interpolation``), cropped or
    letterboxed, then normalized as ``(pixel * scale - mean) / std`` per channel and laid out
    as ``layout`` (``NCHW``, ``NHWC``, ``CHW`` or ``HWC``): see :class:`ImagePreprocessing`,
    which holds these choices (``ImageFolder.preprocessing``) and is saved with a quantized
    model as ``preprocess.json``.

    ``transform``: a callable ``PIL.Image -> np.ndarray`` that replaces resizing, cropping and
    normalization (it gets the upright image converted to ``color``; ``"BGR"`` images are
    handed over as RGB). ``input_name``: yield ``{input name: array}`` instead of arrays.
    Requires Pillow (installed with autoq).
    """
    _pillow()
    files = _image_files(Path(path), recursive, limit)
    prep = ImagePreprocessing(
        size, mean, std, layout, resize=resize, crop=crop, interpolation=interpolation,
        color=color, scale=scale, dtype=dtype,
    )  # fmt: skip
    folder = ImageFolder(files, partial(prep.read, transform=transform), input_name)
    folder.preprocessing = prep if transform is None else None
    return folder


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "reading images needs Pillow, a dependency of autoq: pip install pillow"
        ) from None
    return Image


def _image_files(root: Path, recursive: bool, limit: int | None) -> list[Path]:
    """The image files of ``root`` sorted by name (at most ``limit``); none is an error."""
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
    return files


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int | np.integer):
        return int(v), int(v)
    if isinstance(v, Sequence) and len(v) == 2 and all(isinstance(d, int | np.integer) for d in v):
        return int(v[0]), int(v[1])
    raise ValueError(f"{what} must be an int or a (height, width) pair, got {v!r}")


#: Pillow's resampling filters by name (``ImagePreprocessing.interpolation``)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
#: ``ImagePreprocessing.crop``: after ``resize``, cut the center; or fit inside ``size`` with
#: the aspect ratio kept and pad the rest with gray (pixel value :data:`LETTERBOX_FILL`)
CROPS = ("center", "letterbox")
LETTERBOX_FILL = 114


def _normalization(mean, std, channels: int, color: str) -> tuple[tuple[float, ...], ...]:
    """``mean`` and ``std`` as tuples of 1 or ``channels`` floats, ``std`` non-zero."""
    out = []
    for what, v in (("mean", mean), ("std", std)):
        a = np.asarray(v, dtype=np.float64).reshape(-1)
        if a.size not in (1, channels):
            raise ValueError(f"{what} must have 1 or {channels} values for color={color!r}")
        out.append(tuple(float(x) for x in a))
    if 0.0 in out[1]:
        raise ValueError("std must not contain zeros")
    return out[0], out[1]


def _resample(name: str):
    return getattr(_pillow().Resampling, name.upper())


def _letterbox(img, size: tuple[int, int], interpolation: str):
    """``img`` fitted inside ``size`` (aspect kept, centered), the rest gray."""
    out_h, out_w = size
    w, h = img.size
    r = min(out_w / w, out_h / h)
    new = (max(1, round(w * r)), max(1, round(h * r)))
    img = img.resize(new, _resample(interpolation))
    fill = LETTERBOX_FILL if img.mode in ("L", "RGB") else float(LETTERBOX_FILL)
    canvas = _pillow().new(img.mode, (out_w, out_h), fill if img.mode != "RGB" else (fill,) * 3)
    canvas.paste(img, ((out_w - new[0]) // 2, (out_h - new[1]) // 2))
    return canvas


def _resize_and_crop(img, size: tuple[int, int], resize, interpolation: str):
    """Resize to ``size``, or resize per ``resize`` and center-crop to ``size``."""
    out_h, out_w = size
    if resize is None:
        return img.resize((out_w, out_h), _resample(interpolation))
    if isinstance(resize, int):
        w, h = img.size
        if w <= h:
            new = (resize, max(1, round(h * resize / w)))
        else:
            new = (max(1, round(w * resize / h)), resize)
    else:
        new = (resize[1], resize[0])
    img = img.resize(new, _resample(interpolation))
    w, h = img.size
    if w < out_w or h < out_h:
        raise DatasetError(f"resize gives {h}x{w}, smaller than the crop size {out_h}x{out_w}")
    left, top = (w - out_w) // 2, (h - out_h) // 2
    return img.crop((left, top, left + out_w, top + out_h))


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _to_8bit_range(im, color: str, file: Path):
    """``im`` in ``color`` with pixel values on the 8-bit scale [0, 255] (so ``scale``,
    ``mean`` and ``std`` mean the same for every file): palette and other 8-bit modes are
    converted by Pillow; 16-bit images are divided by 257 (65535 -> 255) into a float
    image instead of being clipped at 255; float or 32-bit images are refused.

    A 16-bit gray image stays one channel (the caller repeats it for RGB/BGR)."""
    if im.mode in _SIXTEEN_BIT:
        a = np.asarray(im, dtype=np.float64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise DatasetError(
                f"image {str(file)!r} has 32-bit pixel values (range {a.min():g} to {a.max():g}); "
                "only 8- and 16-bit images are read: convert it, or pass transform="
            )
        return _pillow().fromarray((a / 257.0).astype(np.float32))
    if im.mode == "F":
        raise DatasetError(
            f"image {str(file)!r} holds floating-point pixels (mode F): their scale is unknown; "
            "convert it to 8 or 16 bits, or pass transform="
        )
    return im.convert("L" if color == "L" else "RGB")


def _upright(im):
    """``im`` turned by its EXIF orientation tag (a phone photo shot in portrait)."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(im)


@dataclass(frozen=True)
class ImagePreprocessing(JsonDocument):
    """How an image file becomes a model input; saved with a quantized model as
    ``preprocess.json`` (:meth:`dumps` / :meth:`loads`) and applied by
    ``autoq.load(folder).run_images`` the same way as to the calibration images.

    In order: the image is turned upright (EXIF orientation), converted to ``color``
    (``"RGB"``, ``"BGR"`` or ``"L"``), brought to ``size`` = (height, width), normalized as
    ``(pixel * scale - mean) / std`` per channel (pixels on the 8-bit scale 0..255) and laid
    out as ``layout`` (``NCHW``, ``NHWC``, ``CHW``, ``HWC``) in ``dtype``.

    Geometry (resampling with ``interpolation``, one of :data:`INTERPOLATIONS`): with
    ``resize=None`` and ``crop=None`` the image is resized to ``size`` (aspect not kept);
    with ``resize=(h, w)`` it is resized to that, with ``resize=S`` its shorter side to S
    (aspect kept), then center-cropped to ``size`` (``crop="center"``, the default then);
    ``crop="letterbox"`` (without ``resize``) fits it inside ``size`` with its aspect kept and
    pads the rest with gray (:data:`LETTERBOX_FILL`).

    >>> p = ImagePreprocessing(size=224, resize=256, mean=(0.485, 0.456, 0.406))
    >>> p.size, p.crop, p.std
    ((224, 224), 'center', (1.0,))
    >>> ImagePreprocessing.loads(p.dumps()) == p
    True
    >>> ImagePreprocessing(size=224, resize=256, crop="letterbox")
    Traceback (most recent call last):
    ValueError: crop='letterbox' fits the whole image inside size: it takes no resize (got resize=256)
    """

    size: int | tuple[int, int]
    mean: Sequence[float] = (0.0,)
    std: Sequence[float] = (1.0,)
    layout: str = "NCHW"
    resize: int | tuple[int, int] | None = None
    crop: str | None = None
    interpolation: str = "bilinear"
    color: str = "RGB"
    scale: float = 1 / 255
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.color not in _COLORS:
            raise ValueError(f"color must be 'RGB', 'BGR' or 'L', got {self.color!r}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be NCHW, NHWC, CHW or HWC, got {self.layout!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {', '.join(INTERPOLATIONS)}, "
                f"got {self.interpolation!r}"
            )
        if self.crop not in (None, *CROPS):
            raise ValueError(f"crop must be 'center', 'letterbox' or None, got {self.crop!r}")
        if self.crop == "letterbox" and self.resize is not None:
            raise ValueError(
                "crop='letterbox' fits the whole image inside size: it takes no resize "
                f"(got resize={self.resize!r})"
            )
        resize = self.resize
        if resize is not None:
            if isinstance(resize, Sequence) and len(resize) == 1:
                resize = resize[0]
            resize = (
                int(resize) if isinstance(resize, int | np.integer) else _pair(resize, "resize")
            )
        mean, std = _normalization(self.mean, self.std, 1 if self.color == "L" else 3, self.color)
        if not isinstance(self.scale, int | float) or not np.isfinite(self.scale):
            raise ValueError(f"scale must be a finite number, got {self.scale!r}")
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"dtype must be a numpy dtype name, got {self.dtype!r}") from None
        size = (
            self.size[0] if isinstance(self.size, Sequence) and len(self.size) == 1 else self.size
        )
        set_ = object.__setattr__
        set_(self, "size", _pair(size, "size"))
        set_(self, "resize", resize)
        set_(self, "crop", "center" if resize is not None and self.crop is None else self.crop)
        set_(self, "mean", mean)
        set_(self, "std", std)
        set_(self, "scale", float(self.scale))
        set_(self, "dtype", str(np.dtype(self.dtype)))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> ImagePreprocessing:
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object of image preprocessing fields, got {d!r}")
        check_keys(cls, d)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def read(self, file: str | Path, transform: Callable | None = None) -> np.ndarray:
        """The model input for the image ``file`` (``transform``: see
        :func:`from_image_folder`)."""
        try:
            with _pillow().open(file) as im:
                img = _to_8bit_range(_upright(im), self.color, Path(file))
        except DatasetError:
            raise
        except Exception as e:
            raise DatasetError(f"cannot read image {str(file)!r}: {e}") from e
        if transform is not None:
            return transform(img)
        if self.crop == "letterbox":
            img = _letterbox(img, self.size, self.interpolation)
        else:
            img = _resize_and_crop(img, self.size, self.resize, self.interpolation)
        arr = np.asarray(img, dtype=np.float64)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.shape[2] == 1 and self.color != "L":
            arr = np.repeat(arr, 3, axis=2)  # a 16-bit gray image read as RGB
        if self.color == "BGR":
            arr = arr[:, :, ::-1]
        arr = (arr * self.scale - np.asarray(self.mean)) / np.asarray(self.std)
        if self.layout in ("NCHW", "CHW"):
            arr = arr.transpose(2, 0, 1)
        if self.layout.startswith("N"):
            arr = arr[None]
        return np.ascontiguousarray(arr.astype(self.dtype))
