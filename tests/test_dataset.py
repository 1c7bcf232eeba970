"""autoq.dataset: the calibration data contract, its error messages, and the loaders."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq.dataset import (
    ArrayDataset,
    DatasetError,
    InputSpec,
    as_dataset,
    from_image_folder,
    from_npy,
    from_npz,
    input_specs,
)

IMG = InputSpec("image", (1, 3, 4, 4), "float32")
TWO = [InputSpec("ids", (1, 6), "int64"), InputSpec("mask", (1, 6), "int64")]
RNG = np.random.default_rng(0)


def img(k=0):
    return np.full((1, 3, 4, 4), k, dtype=np.float32)


def two(k=0):
    return {"ids": np.full((1, 6), k, np.int64), "mask": np.ones((1, 6), np.int64)}


def _relax_func():
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), "float32"))
    n = relax.Var("n", relax.TensorType((tvm.tirx.Var("batch", "int64"), 5), "int32"))
    w = relax.Var("conv.weight", relax.TensorType((4, 3, 1, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, n, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.conv2d(x, w))
        bb.emit_func_output(y)
    return bb.get()


# --------------------------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------------------------


def test_input_specs_are_the_parameters_not_in_params():
    mod = _relax_func()
    specs = input_specs(mod, {"conv.weight": np.zeros((4, 3, 1, 1), np.float32)})
    assert specs == [
        InputSpec("x", (1, 3, 8, 8), "float32"),
        InputSpec("n", (None, 5), "int32"),
    ]
    assert input_specs(mod["main"], ["conv.weight"]) == specs
    assert str(specs[1]) == "'n' (?, 5) int32"
    # with a symbolic dim, any size fits that dim
    ds = as_dataset(
        [{"x": np.zeros((1, 3, 8, 8), np.float32), "n": np.zeros((7, 5), np.int32)}],
        mod,
        ["conv.weight"],
    )
    assert [s["n"].shape for s in ds] == [(7, 5)]


# --------------------------------------------------------------------------------------------
# validation errors, before any work
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], (), iter([]), lambda: iter([])])
def test_empty_dataset(empty):
    with pytest.raises(DatasetError, match="empty"):
        as_dataset(empty, [IMG])


def test_empty_generator_function_and_empty_arrays():
    def gen():
        yield from []

    with pytest.raises(DatasetError, match="empty"):
        as_dataset(gen, [IMG])
    with pytest.raises(DatasetError, match="0 samples"):
        as_dataset(np.zeros((0, 3, 4, 4), np.float32), [IMG])


def test_unknown_name_lists_expected_inputs():
    with pytest.raises(DatasetError) as e:
        as_dataset([{"imgs": img()}], [IMG])
    msg = str(e.value)
    assert "sample 0" in msg and "unknown input name(s) ['imgs']" in msg
    assert "missing input(s) ['image']" in msg
    assert "'image' (1, 3, 4, 4) float32" in msg


def test_missing_and_extra_names():
    with pytest.raises(DatasetError, match=r"sample 1: missing input\(s\) \['mask'\]"):
        as_dataset([two(), {"ids": two()["ids"]}], TWO)
    with pytest.raises(DatasetError, match=r"sample 0: unknown input name\(s\) \['labels'\]"):
        as_dataset([{**two(), "labels": np.zeros(1)}], TWO)


def test_single_array_for_multi_input_model():
    with pytest.raises(DatasetError, match="single array but the model has 2 inputs"):
        as_dataset([np.zeros((1, 6), np.int64)], TWO)


def test_wrong_sample_type():
    with pytest.raises(DatasetError, match=r"sample 0 is a tuple.*must be a dict"):
        as_dataset([(img(), 3)], [IMG])
    with pytest.raises(
        DatasetError, match=r"sample 0, input 'image': expected a numpy array, got list"
    ):
        as_dataset([{"image": [[1.0]]}], [IMG])
    with pytest.raises(DatasetError, match="iterable"):
        as_dataset(42, [IMG])
    with pytest.raises(DatasetError, match="iterable"):
        as_dataset("images/", [IMG])


def test_wrong_shape_names_input_expected_and_given():
    bad = np.zeros((1, 3, 5, 4), np.float32)
    with pytest.raises(
        DatasetError,
        match=r"sample 2, input 'image': expected shape \(1, 3, 4, 4\), got \(1, 3, 5, 4\)",
    ):
        as_dataset([img(), img(), bad], [IMG])


def test_missing_batch_axis_is_added():
    ds = as_dataset([np.zeros((3, 4, 4), np.float32)], [IMG])
    assert [s["image"].shape for s in ds] == [(1, 3, 4, 4)]


def test_wrong_dtype_names_input_expected_and_given():
    with pytest.raises(
        DatasetError, match=r"sample 0, input 'image': expected dtype float32, got float64"
    ):
        as_dataset([img().astype(np.float64)], [IMG])
    with pytest.raises(DatasetError, match=r"input 'mask': expected dtype int64, got int32"):
        as_dataset([{"ids": two()["ids"], "mask": np.ones((1, 6), np.int32)}], TWO)


def test_nan_and_inf_name_input_and_sample_index():
    x = img()
    x[0, 0, 0, 0] = np.nan
    x[0, 1, 0, 0] = np.inf
    x[0, 2, 0, 0] = -np.inf
    with pytest.raises(
        DatasetError, match=r"sample 3, input 'image': contains 1 NaN and 2 Inf value\(s\)"
    ):
        as_dataset([img(), img(), img(), x], [IMG])


def test_streamed_dataset_checks_first_sample_up_front_and_the_rest_on_arrival():
    calls = []

    def gen():
        calls.append(1)
        yield img(0)
        yield img(1).astype(np.float16)

    with pytest.raises(DatasetError, match="sample 0, input 'image': expected dtype float32"):
        as_dataset(lambda: iter([img().astype(np.float64)]), [IMG])
    ds = as_dataset(gen, [IMG])  # first sample fine: accepted
    with pytest.raises(
        DatasetError, match="sample 1, input 'image': expected dtype float32, got float16"
    ):
        list(ds)


# --------------------------------------------------------------------------------------------
# passes: generators, re-iterables, factories
# --------------------------------------------------------------------------------------------


def _values(ds):
    return [float(s["image"][0, 0, 0, 0]) for s in ds]


def test_generator_object_is_replayed_from_memory():
    consumed = []

    def gen():
        for k in range(4):
            consumed.append(k)
            yield img(k)

    ds = as_dataset(gen(), [IMG])
    assert consumed == [0]  # only the first sample was read up front
    assert _values(ds) == [0, 1, 2, 3]
    assert _values(ds) == [0, 1, 2, 3]
    assert consumed == [0, 1, 2, 3]  # read once
    assert ds.num_samples == 4


def test_generator_pass_that_stops_early_resumes_later():
    ds = as_dataset((img(k) for k in range(5)), [IMG])
    it = iter(ds)
    assert [float(next(it)["image"][0, 0, 0, 0]) for _ in range(2)] == [0, 1]
    assert _values(ds) == [0, 1, 2, 3, 4]
    assert _values(ds) == [0, 1, 2, 3, 4]


def test_generator_without_cache_allows_a_single_pass():
    ds = as_dataset((img(k) for k in range(3)), [IMG], cache=False)
    assert _values(ds) == [0, 1, 2]
    with pytest.raises(DatasetError, match=r"one-shot iterator.*already consumed"):
        list(ds)


def test_generator_function_streams_every_pass():
    calls = []

    def gen():
        calls.append(1)
        for k in range(3):
            yield img(k)

    ds = as_dataset(gen, [IMG])
    assert _values(ds) == [0, 1, 2]
    assert _values(ds) == [0, 1, 2]
    assert len(calls) == 3  # one peek up front, then one per pass
    assert ds.num_samples == 3


def test_reiterable_object_is_iterated_again():
    class Loader:
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter([{"image": img(1)}, {"image": img(2)}])

    loader = Loader()
    ds = as_dataset(loader, [IMG])
    assert _values(ds) == [1, 2] and _values(ds) == [1, 2]
    assert loader.passes == 4  # two up front (does it start over?), then one per pass


def test_limit_caps_every_kind_of_source():
    assert _values(as_dataset([img(k) for k in range(5)], [IMG], limit=2)) == [0, 1]
    ds = as_dataset((img(k) for k in range(5)), [IMG], limit=3)
    assert _values(ds) == [0, 1, 2] and _values(ds) == [0, 1, 2]
    ds = as_dataset((img(k) for k in range(5)), [IMG], limit=3, cache=False)
    assert _values(ds) == [0, 1, 2]
    assert _values(as_dataset(lambda: (img(k) for k in range(5)), [IMG], limit=2)) == [0, 1]
    with pytest.raises(ValueError, match="limit"):
        as_dataset([img()], [IMG], limit=0)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    ds = as_dataset([{"image": torch.zeros(1, 3, 4, 4)}], [IMG])
    assert isinstance(next(iter(ds))["image"], np.ndarray)


# --------------------------------------------------------------------------------------------
# stacked arrays, npz, npy
# --------------------------------------------------------------------------------------------


def test_stacked_arrays_are_split_per_the_input_shape():
    stacked = np.stack([img(k)[0] for k in range(4)])  # (4, 3, 4, 4): batch axis of 1
    assert _values(as_dataset(stacked, [IMG])) == [0, 1, 2, 3]
    rows = np.stack([img(k) for k in range(3)])  # (3, 1, 3, 4, 4)
    assert _values(as_dataset(rows, [IMG])) == [0, 1, 2]
    assert _values(as_dataset(img(7), [IMG])) == [7]
    assert _values(as_dataset(img(7)[0], [IMG])) == [7]
    batch2 = InputSpec("image", (2, 3, 4, 4), "float32")
    ds = as_dataset(np.zeros((6, 3, 4, 4), np.float32), [batch2])
    assert [s["image"].shape for s in ds] == [(2, 3, 4, 4)] * 3
    with pytest.raises(DatasetError, match=r"array for input 'image' has shape \(5, 3, 4, 4\)"):
        as_dataset(np.zeros((5, 3, 4, 4), np.float32), [batch2])


def test_dict_of_arrays_and_count_mismatch():
    ds = as_dataset({"ids": np.zeros((4, 6), np.int64), "mask": np.ones((4, 6), np.int64)}, TWO)
    assert ds.num_samples == 4
    with pytest.raises(DatasetError, match="different numbers of samples"):
        as_dataset({"ids": np.zeros((4, 6), np.int64), "mask": np.ones((3, 6), np.int64)}, TWO)
    with pytest.raises(DatasetError, match=r"unknown input name\(s\) \['ids2'\]"):
        as_dataset({"ids2": np.zeros((4, 6), np.int64), "mask": np.ones((4, 6), np.int64)}, TWO)


def test_npz_one_array_per_input(tmp_path):
    path = tmp_path / "calib.npz"
    ids = RNG.integers(0, 100, (5, 6)).astype(np.int64)
    np.savez(path, ids=ids, mask=np.ones((5, 6), np.int64))
    ds = as_dataset(from_npz(path), TWO)
    samples = list(ds)
    assert len(samples) == 5
    np.testing.assert_array_equal(samples[3]["ids"], ids[3:4])
    # positional (arr_0) array for a single-input model
    np.savez(tmp_path / "one.npz", np.stack([img(k)[0] for k in range(3)]))
    assert _values(as_dataset(from_npz(tmp_path / "one.npz"), [IMG])) == [0, 1, 2]
    with pytest.raises(DatasetError, match="unnamed array cannot feed a model with 2 inputs"):
        as_dataset(ArrayDataset({None: ids}), TWO)
    with pytest.raises(FileNotFoundError):
        from_npz(tmp_path / "nope.npz")


def test_npy_is_memory_mapped_and_split(tmp_path):
    path = tmp_path / "x.npy"
    data = np.stack([img(k)[0] for k in range(3)])
    np.save(path, data)
    arrays = from_npy(path)
    assert isinstance(next(iter(arrays.arrays.values())), np.memmap)
    assert len(arrays) == 3
    assert _values(as_dataset(arrays, [IMG])) == [0, 1, 2]
    named = from_npy(path, input_name="image")
    assert _values(as_dataset(named, [IMG])) == [0, 1, 2]
    with pytest.raises(DatasetError, match=r"unknown input name\(s\) \['pixels'\]"):
        as_dataset(from_npy(path, input_name="pixels"), [IMG])


def test_npy_with_nan_is_rejected(tmp_path):
    data = np.stack([img(k)[0] for k in range(3)])
    data[2, 0, 0, 0] = np.nan
    np.save(tmp_path / "x.npy", data)
    with pytest.raises(DatasetError, match="sample 2, input 'image': contains 1 NaN"):
        as_dataset(from_npy(tmp_path / "x.npy"), [IMG])


# --------------------------------------------------------------------------------------------
# image folder
# --------------------------------------------------------------------------------------------


@pytest.fixture
def image_dir(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    a = np.zeros((6, 8, 3), np.uint8)
    a[..., 0] = 200  # red
    a[..., 2] = 50
    Image.fromarray(a).save(tmp_path / "b_red.png")
    g = np.zeros((10, 10, 3), np.uint8)
    g[..., 1] = 100  # green
    Image.fromarray(g).save(tmp_path / "a_green.png")
    (tmp_path / "notes.txt").write_text("not an image")
    return tmp_path


def test_image_folder_nchw_normalized(image_dir):
    spec = InputSpec("image", (1, 3, 4, 4), "float32")
    folder = from_image_folder(image_dir, 4, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert [f.name for f in folder.files] == ["a_green.png", "b_red.png"]  # sorted, no .txt
    samples = list(as_dataset(folder, [spec]))
    assert len(samples) == 2
    green = samples[0]["image"]
    assert green.shape == (1, 3, 4, 4) and green.dtype == np.float32
    np.testing.assert_allclose(
        green[0, :, 0, 0], [(0 - 0.5) / 0.25, (100 / 255 - 0.5) / 0.25, -2.0], rtol=1e-6
    )
    red = samples[1]["image"]
    np.testing.assert_allclose(
        red[0, :, 1, 1], [(200 / 255 - 0.5) / 0.25, -2.0, (50 / 255 - 0.5) / 0.25], rtol=1e-6
    )


def test_image_folder_bgr_nhwc_crop_and_name(image_dir):
    folder = from_image_folder(
        image_dir,
        size=4,
        resize=(6, 6),
        color="BGR",
        scale=1.0,
        mean=(104.0, 117.0, 123.0),
        layout="NHWC",
        input_name="input_0",
    )
    spec = InputSpec("input_0", (1, 4, 4, 3), "float32")
    samples = list(as_dataset(folder, [spec]))
    red = samples[1]["input_0"]
    np.testing.assert_allclose(red[0, 0, 0], [50 - 104.0, 0 - 117.0, 200 - 123.0])


def test_image_folder_shorter_side_resize_and_grayscale(image_dir):
    folder = from_image_folder(
        image_dir, size=(4, 4), resize=4, color="L", mean=0.0, std=1.0, layout="CHW"
    )
    out = list(folder)
    assert [a.shape for a in out] == [(1, 4, 4), (1, 4, 4)]
    spec = InputSpec("gray", (1, 1, 4, 4), "float32")
    assert len(list(as_dataset(folder, [spec]))) == 2  # missing batch axis added


def test_image_folder_user_transform(image_dir):
    folder = from_image_folder(
        image_dir, size=4, transform=lambda im: np.asarray(im.resize((2, 2)), np.float32)[None]
    )
    assert [a.shape for a in folder] == [(1, 2, 2, 3)] * 2


def test_image_folder_errors(tmp_path, image_dir):
    pytest.importorskip("PIL.Image")
    with pytest.raises(DatasetError, match="no images in"):
        from_image_folder(_empty(tmp_path), 4)
    with pytest.raises(FileNotFoundError):
        from_image_folder(tmp_path / "missing", 4)
    with pytest.raises(ValueError, match="layout"):
        from_image_folder(image_dir, 4, layout="NCWH")
    with pytest.raises(ValueError, match="mean must have 1 or 3 values"):
        from_image_folder(image_dir, 4, mean=(1.0, 2.0))
    with pytest.raises(DatasetError, match="smaller than the crop size"):
        list(from_image_folder(image_dir, 8, resize=(6, 6)))
    spec = InputSpec("image", (1, 3, 5, 5), "float32")
    with pytest.raises(DatasetError, match=r"expected shape \(1, 3, 5, 5\), got \(1, 3, 4, 4\)"):
        as_dataset(from_image_folder(image_dir, 4), [spec])


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d
