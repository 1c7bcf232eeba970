"""Hostile inputs through ``autoq`` (issue 17; the API half is ``test_bad_inputs.py``):
each is exit code 2 with one ``autoq: error:`` line naming the file, option, slot or input,
no traceback, and nothing written (no --out, no staging folder). In-process
(``autoq.cli.main``)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_bad_inputs import _onnx_files, qparams_doc
from test_cli import TARGET, assert_user_error, run, tiny_onnx


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = _onnx_files(tmp_path_factory.mktemp("bad_cli"))
    np.savez(d / "calib.npz", x=np.random.default_rng(1).normal(size=(3, 3, 8, 8)).astype("f4"))
    np.savez(d / "zeros.npz", x=np.zeros((3, 3, 8, 8), np.float32))
    model = onnx.load(str(tiny_onnx(d / "dyn.onnx")))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    onnx.save(model, str(d / "dyn.onnx"))
    return d


def quantize(capsys, d, model, out, *extra, calib="calib.npz"):
    argv = ["quantize", d / model, "--calib", d / calib, "--out", out, "--target", TARGET]
    return run(capsys, *argv, "--no-progress", *extra)


def assert_nothing_written(parent, out):
    assert not out.exists()
    assert [p.name for p in parent.iterdir() if "autoq-tmp" in p.name] == []


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("truncated.onnx", "is not an ONNX model"),
        ("empty.onnx", "is empty (0 bytes)"),
        ("text.onnx", "is not an ONNX model"),
        ("external.onnx", "external data file"),
        ("missing.onnx", "no such file"),
    ],
)
def test_model_file(d, tmp_path, capsys, model, needle):
    code, _, err = quantize(capsys, d, model, tmp_path / "out")
    assert_user_error(code, err, model, needle)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_dynamic_input_suggests_the_option_not_the_keyword(d, tmp_path, capsys):
    code, _, err = quantize(capsys, d, "dyn.onnx", tmp_path / "out", "--no-onnx-optimize")
    assert_user_error(code, err, "'x'", "--input-shape")
    assert "input_shapes" not in err
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_constant_calibration_data(d, tmp_path, capsys):
    code, _, err = quantize(capsys, d, "tiny.onnx", tmp_path / "out", calib="zeros.npz")
    assert_user_error(code, err, "zeros.npz", "input 'x' holds the same value")
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("where", ["file", "under_a_file", "proc", "foreign"])
def test_out(d, tmp_path, capsys, where):
    (tmp_path / "f").write_text("mine")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "config.json").write_text("{}")
    (tmp_path / "theirs" / "photo.jpg").write_text("")
    out, needle = {
        "file": (tmp_path / "f", "is not a folder"),
        "under_a_file": (tmp_path / "f" / "sub", "cannot be written"),
        "proc": ("/proc/autoq_out", "cannot be written"),
        "foreign": (tmp_path / "theirs", "not empty and was not written by autoq"),
    }[where]
    code, _, err = quantize(capsys, d, "tiny.onnx", out)
    assert_user_error(code, err, "--out", str(out), needle)
    assert (tmp_path / "f").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == ["config.json", "photo.jpg"]
    assert [p.name for p in tmp_path.iterdir() if "autoq-tmp" in p.name] == []


@pytest.mark.parametrize(
    ("slot", "edit", "needle"),
    [
        ("x", {"zero_point": 3.5}, "zero_point must be integers"),
        ("fc1.weight", {"scale": [0.1] * 3, "zero_point": [0] * 3}, "3 scale(s) for 4 channels"),
        ("x", {"scale": 0.0}, "scale must be positive"),
    ],
)
def test_inspect_bad_qparams(tmp_path, capsys, slot, edit, needle):
    doc = qparams_doc()
    doc["qparams"][slot].update(edit)
    (tmp_path / "q.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "inspect", tmp_path / "q.json")
    assert_user_error(code, err, "q.json", f"qparams slot {slot!r}", needle)


# ------------------------------------------------- issue 38, item 12b: exit 2, not exit 1


def test_inspect_qparams_nested_100000_deep(tmp_path, capsys):
    (tmp_path / "q.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, "inspect", tmp_path / "q.json")
    assert_user_error(code, err, "q.json", "nested too deeply")


def test_inspect_qparams_scale_1e_45_names_the_slot(tmp_path, capsys):
    doc = qparams_doc()
    doc["qparams"]["x"]["scale"] = 1e-45
    (tmp_path / "q.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "inspect", tmp_path / "q.json")
    assert_user_error(code, err, "q.json", "qparams slot 'x'", "scale must be at least")


def test_npz_member_declaring_2_8_tib(d, tmp_path, capsys):
    from test_bad_inputs import _npz_declaring

    _npz_declaring(tmp_path / "huge.npz", (750_000, 1024, 1024))
    code, _, err = quantize(capsys, d, "tiny.onnx", tmp_path / "out", calib=tmp_path / "huge.npz")
    assert_user_error(code, err, "huge.npz", "member 'x' declares shape", "2.9 TiB")
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_overlong_skip_rule(d, tmp_path, capsys):
    code, _, err = quantize(capsys, d, "tiny.onnx", tmp_path / "out", "--skip", "[" * 100_000)
    assert_user_error(code, err, "--skip", "a rule of 100000 characters", "1024")
    assert len(err) < 500
    assert_nothing_written(tmp_path, tmp_path / "out")
