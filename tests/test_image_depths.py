"""Image folders read 16-bit and palette images correctly (issue 17, item 4): a 16-bit
image was clipped at 255 (every value above 255/65535 of full scale became white). The
references are the pixel arrays written, scaled with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from autoq.dataset import DatasetError, from_image_folder

Image = pytest.importorskip("PIL.Image")


def _read(folder, color="L"):
    c = 1 if color == "L" else 3
    loader = from_image_folder(folder, (8, 8), (0.0,) * c, (1.0,) * c, "HWC", color=color)
    (arr,) = list(loader)
    return arr


def test_16_bit_gray_scaled_to_unit_range(tmp_path):
    a = (np.arange(64).reshape(8, 8) * 1000 + 7).astype(np.uint16)  # up to 63007
    Image.fromarray(a).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I;16")
    np.testing.assert_allclose(_read(tmp_path)[:, :, 0], a / 65535, atol=1e-6)
    rgb = _read(tmp_path, "RGB")
    assert rgb.shape == (8, 8, 3)
    np.testing.assert_allclose(rgb, np.repeat((a / 65535)[:, :, None], 3, axis=2), atol=1e-6)


def test_palette_image_read_through_its_palette(tmp_path):
    idx = (np.arange(64).reshape(8, 8) % 4).astype(np.uint8)
    palette = np.array([[255, 0, 0], [0, 128, 0], [10, 20, 30], [200, 200, 0]], np.uint8)
    im = Image.fromarray(idx).convert("P")
    im.putpalette(palette.reshape(-1).tolist() + [0] * (768 - 12))
    im.save(tmp_path / "pal.png")
    assert Image.open(tmp_path / "pal.png").mode == "P"
    np.testing.assert_allclose(_read(tmp_path, "RGB"), palette[idx] / 255, atol=1e-6)


def test_float_image_is_refused_naming_the_file(tmp_path):
    Image.fromarray(np.full((8, 8), 3.5, np.float32)).save(tmp_path / "f.tif")
    with pytest.raises(DatasetError, match=r"f.tif.*floating-point pixels"):
        _read(tmp_path)
