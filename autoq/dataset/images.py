"""Images of a folder as calibration samples: read with Pillow, resized, cropped, normalized
and laid out like the model's input (optional extra ``autoq[images]``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoq.dataset.contract import DatasetError

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "from_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")
_COLORS = ("RGB", "BGR", "L")
_LAYOUTS = ("NCHW", "NHWC", "CHW", "HWC")


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
    as RGB). ``input_name``: yield ``{input name: array}`` instead of arrays. Requires Pillow
    (``pip install pillow`` or ``autoq[images]``).
    """
    _pillow()
    files = _image_files(Path(path), recursive, limit)
    if color not in _COLORS:
        raise ValueError(f"color must be 'RGB', 'BGR' or 'L', got {color!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be NCHW, NHWC, CHW or HWC, got {layout!r}")
    out_size = _pair(size, "size")
    mean_a, std_a = _normalization(mean, std, 1 if color == "L" else 3, color)
    if crop not in (None, "center"):
        raise ValueError(f"crop must be 'center' or None, got {crop!r}")
    load = _Preprocess(out_size, resize, mean_a, std_a, layout, color, scale, dtype, transform)
    return ImageFolder(files, load, input_name)


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "from_image_folder needs Pillow: pip install pillow (or autoq[images])"
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


def _normalization(mean, std, channels: int, color: str) -> tuple[np.ndarray, np.ndarray]:
    """``mean`` and ``std`` as float64 vectors of 1 or ``channels`` values, ``std`` non-zero."""
    mean_a = np.asarray(mean, dtype=np.float64).reshape(-1)
    std_a = np.asarray(std, dtype=np.float64).reshape(-1)
    for what, a in (("mean", mean_a), ("std", std_a)):
        if a.size not in (1, channels):
            raise ValueError(f"{what} must have 1 or {channels} values for color={color!r}")
    if np.any(std_a == 0):
        raise ValueError("std must not contain zeros")
    return mean_a, std_a


def _resize_and_crop(img, size: tuple[int, int], resize):
    """Resize to ``size``, or resize per ``resize`` and center-crop to ``size``."""
    Image = _pillow()
    out_h, out_w = size
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


@dataclass(frozen=True, eq=False)
class _Preprocess:
    """Reads one image file and turns it into a model input (see :func:`from_image_folder`)."""

    size: tuple[int, int]
    resize: int | tuple[int, int] | None
    mean: np.ndarray
    std: np.ndarray
    layout: str
    color: str
    scale: float
    dtype: str
    transform: Callable | None

    def __call__(self, file: Path) -> np.ndarray:
        try:
            with _pillow().open(file) as im:
                img = _to_8bit_range(im, self.color, file)
        except DatasetError:
            raise
        except Exception as e:
            raise DatasetError(f"cannot read image {str(file)!r}: {e}") from e
        if self.transform is not None:
            return self.transform(img)
        arr = np.asarray(_resize_and_crop(img, self.size, self.resize), dtype=np.float64)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.shape[2] == 1 and self.color != "L":
            arr = np.repeat(arr, 3, axis=2)  # a 16-bit gray image read as RGB
        if self.color == "BGR":
            arr = arr[:, :, ::-1]
        arr = (arr * self.scale - self.mean) / self.std
        if self.layout in ("NCHW", "CHW"):
            arr = arr.transpose(2, 0, 1)
        if self.layout.startswith("N"):
            arr = arr[None]
        return np.ascontiguousarray(arr.astype(self.dtype))
