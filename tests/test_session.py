"""``autoq.load(folder)`` (issue 37, items 2 and 3): the session runs the folder's library as
the compiled VM does, within int8 tolerance of the fp32 model (ONNX Runtime); bad inputs are
errors naming the input; any number of rows runs on a library built for one batch (and
``--batch N`` builds one for N with the same qparams); ``run_images`` applies the folder's
``preprocess.json`` (letterbox, interpolation, EXIF orientation) as calibration did."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from test_cli import TARGET, assert_user_error, run, tiny_onnx

import autoq
from autoq import cli
from autoq.dataset import ImagePreprocessing
from autoq.errors import InputError, LibraryError

RNG = np.random.default_rng(7)


def _photo(h: int, w: int) -> Image.Image:
    """A smooth RGB image (little JPEG loss), different in every region."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * x / w, 255 * y / h, 128 + 0 * x], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(tmp, model, batch-1 folder, batch-4 folder), both calibrated on the same images."""
    d = tmp_path_factory.mktemp("session")
    model = tiny_onnx(d / "tiny.onnx")
    imgs = d / "imgs"
    imgs.mkdir()
    for i in range(4):
        Image.fromarray(RNG.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(imgs / f"{i}.png")
    argv = ["quantize", model, "--calib", imgs, "--target", TARGET, "--no-progress", "-q",
            "--image-letterbox", "--image-interpolation", "nearest"]  # fmt: skip
    one, four = d / "b1", d / "b4"
    assert cli.main([str(a) for a in [*argv, "--out", one]]) == 0
    assert cli.main([str(a) for a in [*argv, "--out", four, "--batch", "4"]]) == 0
    return d, model, one, four


def test_run_matches_the_compiled_library_and_the_fp32_model(folders):
    _, model, one, _ = folders
    sess = autoq.load(one)
    assert [(i.name, i.shape, i.dtype) for i in sess.inputs] == [("x", (1, 3, 8, 8), "float32")]
    assert [(o.name, o.shape, o.dtype) for o in sess.outputs] == [("y", (1, 5), "float32")]
    x = RNG.uniform(0, 1, size=(1, 3, 8, 8)).astype(np.float32)
    got = sess.run({"x": x})
    assert list(got) == ["y"]
    import tvm

    vm = autoq.load_library(one / "model.so")
    np.testing.assert_array_equal(got["y"], vm["main"](tvm.runtime.tensor(x)).numpy())
    ref = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    err = np.abs(got["y"] - ref).max()
    assert err <= 0.05 * np.abs(ref).max(), (err, ref)


def test_any_number_of_rows_runs_in_chunks_and_batch_n_gives_the_same_rows(folders):
    _, _, one, four = folders
    s1, s4 = autoq.load(one), autoq.load(four)
    assert s1.batch == 1 and s4.batch == 4
    assert s4.inputs[0].shape == (4, 3, 8, 8) and s4.outputs[0].shape == (4, 5)
    q1, q4 = (json.loads((f / "qparams.json").read_text()) for f in (one, four))
    assert {k: v for k, v in q1.items() if k != "meta"} == {
        k: v for k, v in q4.items() if k != "meta"
    }  # the same scales (meta: times)
    x = RNG.uniform(0, 1, size=(6, 3, 8, 8)).astype(np.float32)
    rows = np.concatenate([s1.run({"x": x[i : i + 1]})["y"] for i in range(6)])
    np.testing.assert_array_equal(s1.run({"x": x})["y"], rows)
    np.testing.assert_allclose(s4.run({"x": x})["y"], rows, rtol=0, atol=1e-6)  # 4 + 2 padded
    np.testing.assert_allclose(s4.run(x[:4])["y"], rows[:4], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("feeds", "needles"),
    [
        ({"x": np.zeros((1, 3, 8, 8), np.float64)}, ["'x'", "float64", "float32", "astype"]),
        ({"x": np.zeros((1, 3, 8, 7), np.float32)}, ["'x'", "(1, 3, 8, 7)", "(1, 3, 8, 8)"]),
        ({"x": np.zeros((3, 8, 8), np.float32)}, ["'x'", "(3, 8, 8)"]),
        ({"image": np.zeros((1, 3, 8, 8), np.float32)}, ["'image'", "x (1, 3, 8, 8) float32"]),
        ({}, ["'x'", "missing"]),
    ],
)
def test_a_bad_input_is_an_error_naming_it(folders, feeds, needles):
    sess = autoq.load(folders[2])
    with pytest.raises(InputError) as e:
        sess.run(feeds)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_run_images_applies_the_saved_preprocessing(folders):
    d, _, one, four = folders
    prep = ImagePreprocessing.loads((one / "preprocess.json").read_text())
    assert (prep.size, prep.crop, prep.interpolation, prep.layout) == (
        (8, 8), "letterbox", "nearest", "NCHW",
    )  # fmt: skip
    # a 4x16 image of one colour: letterboxed into 8x8 it is 2 rows of colour in gray (114)
    Image.new("RGB", (16, 4), (10, 200, 30)).save(d / "wide.png")
    want = np.full((1, 3, 8, 8), 114.0)
    want[0, :, 3:5, :] = np.array([10, 200, 30])[:, None, None]
    want = (want / 255).astype(np.float32)
    sess = autoq.load(one)
    np.testing.assert_allclose(prep.read(d / "wide.png"), want, rtol=0, atol=1e-7)
    got = sess.run_images([d / "wide.png", d / "wide.png", d / "wide.png"])
    one_row = sess.run({"x": want})["y"]
    np.testing.assert_array_equal(got["y"], np.concatenate([one_row] * 3))
    np.testing.assert_allclose(autoq.load(four).run_images([d / "wide.png"])["y"], one_row,
                               rtol=0, atol=1e-6)  # fmt: skip


def test_run_images_turns_a_photo_upright_by_its_exif_orientation(folders):
    d, _, one, _ = folders
    upright = _photo(8, 8)
    upright.save(d / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the stored pixels are to be turned 90 degrees clockwise
    upright.rotate(90).save(d / "rotated.jpg", quality=100, subsampling=0, exif=exif.tobytes())
    prep = autoq.load(one).preprocess
    turned, ref = prep.read(d / "rotated.jpg"), prep.read(d / "upright.png")
    assert np.abs(turned - ref).max() < 0.05  # JPEG loss only
    with Image.open(d / "rotated.jpg") as stored:
        assert np.abs(np.asarray(stored, np.float32) / 255 - ref[0].transpose(1, 2, 0)).max() > 0.5


def test_folders_without_a_signature_or_with_a_bad_preprocess_file(folders, tmp_path):
    import shutil

    _, _, one, _ = folders
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    (copy / "preprocess.json").write_text(json.dumps({"size": [8, 8], "colour": "RGB"}))
    with pytest.raises(InputError, match=r"preprocess\.json.*colour"):
        autoq.load(copy)
    (copy / "preprocess.json").unlink()
    with pytest.raises(InputError, match=r"no preprocess\.json"):
        autoq.load(copy).run_images([tmp_path / "a.png"])
    stamp = copy / "model.so.autoq.json"
    doc = json.loads(stamp.read_text())
    del doc["inputs"], doc["outputs"]
    stamp.write_text(json.dumps(doc))
    with pytest.raises(LibraryError, match="records no inputs and outputs"):
        autoq.load(copy)
    with pytest.raises(LibraryError, match="no model folder"):
        autoq.load(tmp_path / "nope")


def test_autoq_run_prints_and_saves_the_outputs_of_images_and_of_an_npz(folders, capsys):
    d, _, one, _ = folders
    img = d / "imgs" / "1.png"
    code, out, err = run(capsys, "run", one, img, img, "--save", d / "out.npz", "--top", "2")
    assert (code, err) == (0, "")
    want = autoq.load(one).run_images([img, img])["y"]
    with np.load(d / "out.npz") as z:
        np.testing.assert_array_equal(z["y"], want)
    best = np.argsort(-want[0])[:2]
    assert (
        out.splitlines()[0]
        == f"1.png  y (5,): [{best[0]}] {want[0, best[0]]:.4g}, [{best[1]}] {want[0, best[1]]:.4g}"
    )
    x = RNG.uniform(0, 1, size=(3, 3, 8, 8)).astype(np.float32)
    np.savez(d / "x.npz", x=x)
    code, out, err = run(capsys, "run", one, d / "x.npz", "--save", d / "y.npz", "-q")
    assert (code, out, err) == (0, "", "")
    with np.load(d / "y.npz") as z:
        np.testing.assert_array_equal(z["y"], autoq.load(one).run({"x": x})["y"])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["{one}", "{d}/missing.jpg"], "no such image file: '{d}/missing.jpg'"),
        (["{d}/nowhere", "{d}/imgs/0.png"], "no model folder or library at '{d}/nowhere'"),
        (["{one}", "{d}/tiny.onnx"], "cannot read image '{d}/tiny.onnx'"),
    ],
)
def test_autoq_run_bad_input_is_one_line(folders, capsys, argv, needle):
    d, _, one, _ = folders
    code, _, err = run(capsys, "run", *[a.format(d=d, one=one) for a in argv])
    assert_user_error(code, err, needle.format(d=d))


_RUN_ON_EITHER_WIDTH = """
import sys, numpy as np, autoq
from autoq.threads import pool_threads
sess = autoq.load(sys.argv[1])
x = np.random.default_rng(7).uniform(0, 1, size=(1, 3, 8, 8)).astype(np.float32)
outs, pools = [], set()
for _ in range(8):
    outs.append(sess.run({"x": x})["y"])
    pools.add(pool_threads())
print(sorted(pools), all(np.array_equal(o, outs[0]) for o in outs))
"""


def test_calls_on_one_or_two_threads_give_the_same_outputs_and_leave_the_pool(folders):
    """The session runs its first calls on 1 and on the pool's 2 threads in turn
    (autoq.session.pool_width): the outputs do not depend on it, and the pool's width is 2
    after every call."""
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process allowed on 2+ CPUs")
    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", _RUN_ON_EITHER_WIDTH, str(folders[2])],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[2]", "True"]
