"""The ``autoq`` command end to end on a tiny ONNX model in a temporary folder, ``autoq
inspect``, and every bad-input path (exit code 2, one ``autoq: error:`` line, no traceback).

The CLI runs in-process (``autoq.cli.main(argv)`` returns the exit code; the installed
``autoq`` entry point runs in tests/test_console.py). References are independent of
autoq: ONNX Runtime for the model's fp32 output, the ONNX initializers for the fp32 weight
bytes, numpy for the preprocessed image range.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autoq
from autoq import cli

# LLVM opt-level 0 (tests/models.TARGET) as the CLI's --target JSON
TARGET = json.dumps({"kind": "llvm", "opt-level": 0})


def tiny_onnx(path: Path, seed: int = 0) -> Path:
    """x (1, 3, 8, 8) -> Conv 3->4 (3x3, pad 1, bias) -> Relu -> Flatten -> Gemm 256->5."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(
            rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * 0.3, "conv.weight"
        ),
        numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32) * 0.1, "conv.bias"),
        numpy_helper.from_array(rng.normal(size=(5, 256)).astype(np.float32) * 0.06, "fc.weight"),
        numpy_helper.from_array(rng.normal(size=(5,)).astype(np.float32) * 0.1, "fc.bias"),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["x", "conv.weight", "conv.bias"], ["c"], name="conv", pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model = tiny_onnx(d / "tiny.onnx")
    rng = np.random.default_rng(1)
    np.savez(d / "calib.npz", x=rng.normal(size=(6, 3, 8, 8)).astype(np.float32))
    np.save(d / "calib.npy", rng.normal(size=(5, 3, 8, 8)).astype(np.float32))
    return d, model


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, *needles):
    """Exit 2, exactly one line on stderr, ``autoq: error:`` first, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autoq: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def onnx_weight_bytes(path: Path) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer)


# ------------------------------------------------------------------------------ success


def test_quantize_writes_library_qparams_script_and_report(files, capsys):
    d, model = files
    out = d / "out"
    code, stdout, err = run(
        capsys, "quantize", model, "--calib", d / "calib.npz", "--out", out,
        "--method", "max", "--no-progress", "--target", TARGET,
    )  # fmt: skip
    assert code == 0, err
    for name in ("model.so", "qparams.json", "model.py", "report.txt", "config.json"):
        assert (out / name).is_file(), name

    # the library runs and agrees with ONNX Runtime's fp32 output up to int8 error
    import onnxruntime as ort

    x = np.random.default_rng(7).normal(size=(1, 3, 8, 8)).astype(np.float32)
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]
    import tvm

    got = autoq.load_library(out / "model.so")["main"](tvm.runtime.tensor(x)).numpy()
    assert got.shape == ref.shape
    # module.json (for 'autoq tune OUT'; the TVMScript omits the constants) is the same model
    from tvm import relax

    saved = tvm.ir.load_json((out / "module.json").read_text())
    vm = relax.VirtualMachine(
        autoq.compile(saved, tvm.target.Target(json.loads(TARGET))), tvm.cpu()
    )
    assert np.array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), got)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05

    qp = autoq.load_qparams(out / "qparams.json")
    assert {"x", "conv.weight", "fc.weight"} <= set(qp)
    assert qp["conv.weight"].per_axis and qp["conv.weight"].scale.shape == (4,)
    assert qp.meta["samples"] == 6
    assert "qnn.conv2d" in (out / "model.py").read_text()
    assert autoq.Config.loads((out / "config.json").read_text()).activation.calibrator.name == "max"

    report = (out / "report.txt").read_text()
    assert report in stdout
    assert "\n  int8:      conv, fc\n  fp32:      -\n" in report
    assert "2 quantized to int8, 0 kept in fp32" in report
    assert f"fp32 {onnx_weight_bytes(model):,} bytes" in report
    # int8 module: the int8 weights are 4*27 + 5*256 bytes (plus int32 biases and zero
    # points, float32 scales)
    assert f"(int8 {4 * 27 + 5 * 256:,}, int32 " in report
    assert "calibration  6 samples" in report


def test_skip_per_tensor_rounding_and_npy(files, capsys):
    d, model = files
    out = d / "skip"
    code, _, err = run(
        capsys, "quantize", model, "--calib", d / "calib.npy", "--out", out, "--skip", "f*",
        "--per-tensor", "--rounding", "tflite", "--samples", "3", "--no-progress",
        "--no-onnx-optimize", "--target", TARGET,
    )  # fmt: skip
    assert code == 0, err
    qp = autoq.load_qparams(out / "qparams.json")
    assert "fc.weight" not in qp and not qp["conv.weight"].per_axis
    assert qp.meta["samples"] == 3
    report = (out / "report.txt").read_text()
    assert "1 quantized to int8, 1 kept in fp32" in report
    assert "\n  int8:      conv\n  fp32:      fc (--skip f*)\n" in report
    cfg = autoq.Config.loads((out / "config.json").read_text())
    assert cfg.rounding == "tflite" and cfg.weight.per_channel is False


def test_image_folder_preprocessing_flags(files, capsys):
    """Two images, all 0 and all 255: with scale 1/255, mean 0.5, std 0.25 the input is -2
    and +2 everywhere, so the max calibrator's input range is exactly [-2, 2]."""
    from PIL import Image

    d, model = files
    imgs = d / "imgs"
    imgs.mkdir()
    Image.new("RGB", (20, 12), (0, 0, 0)).save(imgs / "a.png")
    Image.new("RGB", (20, 12), (255, 255, 255)).save(imgs / "b.png")
    (imgs / "notes.txt").write_text("not an image")
    out = d / "img_out"
    code, _, err = run(
        capsys, "quantize", model, "--calib", imgs, "--out", out, "--method", "max",
        "--image-mean", "0.5,0.5,0.5", "--image-std", "0.25", "--image-scale", "1/255",
        "--no-progress", "--target", TARGET,
    )  # fmt: skip
    assert code == 0, err
    x = autoq.load_qparams(out / "qparams.json")["x"]
    assert (float(x.rmin), float(x.rmax)) == (-2.0, 2.0)
    assert autoq.load_qparams(out / "qparams.json").meta["samples"] == 2


def test_bundled_model_without_calib(tmp_path, capsys):
    code, _, err = run(
        capsys, "quantize", "digits", "--samples", "4", "--out", tmp_path / "d",
        "--no-progress", "--target", TARGET,
    )  # fmt: skip
    assert code == 0, err
    report = (tmp_path / "d" / "report.txt").read_text()
    assert "4 samples from bundled digits training images" in report
    assert "\n  int8:      conv1, conv2, conv3, res, mean_0, fc\n" in report


def test_report_writes_the_per_layer_analysis(files, capsys):
    d, model = files
    code, _stdout, err = run(
        capsys, "quantize", model, "--calib", d / "calib.npz", "--out", d / "rep1", "--report",
        "--no-progress", "--target", TARGET,
    )  # fmt: skip
    assert code == 0, err
    text = (d / "rep1" / "analysis.txt").read_text()
    assert "conv" in text and "fc" in text


def test_inspect_table(files, capsys):
    d, model = files
    out = d / "insp"
    assert run(
        capsys, "quantize", model, "--calib", d / "calib.npz", "--out", out, "--no-progress",
        "--target", TARGET,
    )[0] == 0  # fmt: skip
    qp = json.loads((out / "qparams.json").read_text())
    code, stdout, err = run(capsys, "inspect", out / "qparams.json")
    assert code == 0, err
    rows = {ln.split()[0]: ln.split() for ln in stdout.splitlines() if ln.strip()}
    assert set(qp["qparams"]) <= set(rows)
    # x, the relu output feeding fc (flatten commutes), and the two weights
    assert "4 slots (2 activation, 2 weight)" in stdout
    # per-tensor activation: kind, layer, dtype, scale, zero point, range as in the JSON
    x = qp["qparams"]["x"]
    assert rows["x"][1:4] == ["activation", "conv", "int8"]
    assert float(rows["x"][4]) == pytest.approx(x["scale"], rel=1e-5)
    assert int(rows["x"][5]) == x["zero_point"]
    assert float(rows["x"][6].strip("[,")) == pytest.approx(x["rmin"], rel=1e-5, abs=1e-6)
    # per-channel weight: min..max of the scales and the channel count
    w = qp["qparams"]["conv.weight"]
    lo, hi = rows["conv.weight"][4].split("..")
    assert (float(lo), float(hi)) == pytest.approx((min(w["scale"]), max(w["scale"])), rel=1e-5)
    assert rows["conv.weight"][5:8] == ["(x4,", "axis", "0)"]
    assert rows["conv.weight"][8] == "0"


def test_help_has_an_example(capsys):
    code, stdout, _ = run(capsys, "quantize", "--help")
    assert code == 0
    assert "examples:" in stdout and "autoq quantize" in stdout and "--calib" in stdout
    code, stdout, _ = run(capsys, "--help")
    assert code == 0 and "autoq demo" in stdout


def test_cli_choices_match_autoq():
    from autoq import calibrators, primitives

    calibrators._load_all()
    assert set(cli.METHODS) == set(calibrators.REGISTRY)
    assert cli.ROUNDINGS == primitives.ROUNDING_MODES


# ------------------------------------------------------------------------------ bad input


def test_no_command_prints_usage(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: autoq" in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["quantize", "{d}/missing.onnx", "--calib", "{d}/calib.npz"], ["no such file", "missing.onnx"]),
        (["quantize", "{model}", "--calib", "{d}/nothere.npz"], ["--calib", "no such file", "nothere.npz"]),
        (["quantize", "{model}"], ["--calib DATA is required"]),
        (["quantize", "{d}/calib.npz", "--calib", "{d}/calib.npz"], ["not an .onnx file"]),
        (["quantize", "{d}/garbage.onnx", "--calib", "{d}/calib.npz"], ["garbage.onnx", "is not an ONNX model"]),
        (["quantize", "{model}", "--calib", "{d}/notes.txt"], ["expected a folder of images, an .npz or an .npy"]),
        (["quantize", "{model}", "--calib", "{d}/calib.npz", "--skip", "conv9"],
         ["fallback id 'conv9' matches no layer", "closest layer ids: conv"]),
        (["quantize", "{model}", "--calib", "{d}/calib.npz", "--skip", "head.*"],
         ["fallback pattern 'head.*' matches no layer"]),
        (["quantize", "{model}", "--calib", "{d}/shape.npz"],
         ["input 'x'", "(4, 3, 4, 4)", "(1, 3, 8, 8)"]),
        (["quantize", "{model}", "--calib", "{d}/name.npz"], ["unknown input name(s) ['image']", "'x'"]),
        (["quantize", "{model}", "--calib", "{d}/nan.npz"], ["NaN"]),
        (["quantize", "{model}", "--calib", "{d}/empty_imgs"], ["no images"]),
        (["quantize", "{model}", "--calib", "{d}/calib.npz", "--input-shape", "y=1,3,8,8"], ["'y'"]),
        (["quantize", "{model}", "--calib", "{d}/calib.npz", "--target", '{{"kind": "nosuch"}}'], ["--target"]),
        (["inspect", "{d}/missing.json"], ["no such file"]),
        (["inspect", "{d}/garbage.onnx"], ["is not JSON"]),
        (["inspect", "{d}/other.json"], ["not a valid qparams file"]),
        (["tune", "{d}/missing.json"], ["no such file", "missing.json"]),
        (["tune", "{d}/empty_imgs"], ["has no module.json", "autoq quantize --out"]),
        (["tune", "{d}/garbage.onnx"], ["not a module saved by tvm.ir.save_json"]),
    ],
)  # fmt: skip
def test_user_errors(files, capsys, argv, needles):
    d, model = files
    (d / "garbage.onnx").write_bytes(b"\x00not a model")
    (d / "notes.txt").write_text("hello")
    (d / "other.json").write_text('{"format": "something else"}')
    (d / "empty_imgs").mkdir(exist_ok=True)
    np.savez(d / "shape.npz", x=np.zeros((4, 3, 4, 4), np.float32))
    np.savez(d / "name.npz", image=np.zeros((2, 3, 8, 8), np.float32))
    nan = np.zeros((2, 3, 8, 8), np.float32)
    nan[1, 0, 0, 0] = np.nan
    np.savez(d / "nan.npz", x=nan)
    code, _, err = run(capsys, *[a.format(d=d, model=model) for a in argv])
    assert_user_error(code, err, *needles)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["quantize", "m.onnx", "--calib", "c.npz", "--method", "minmax"],
            "invalid choice: 'minmax'",
        ),
        (["quantize", "m.onnx", "--calib", "c.npz", "--rounding", "up"], "invalid choice: 'up'"),
        (["quantize", "m.onnx", "--input-shape", "x"], "expected NAME=DIMS"),
        (["quantize", "m.onnx", "--input-shape", "x=1,a"], "expected integers"),
        (["quantize", "m.onnx", "--samples", "0"], "positive integer"),
        (["quantize", "m.onnx", "--per-channel", "--per-tensor"], "not allowed with"),
        (["quantize", "m.onnx", "--target", "llvm -mcpu=x"], "JSON object"),
        (["frobnicate"], "invalid choice"),
        (["tune", "out", "--rpc", "localhost"], "HOST:PORT/KEY"),
        (["tune", "out", "--trials", "0"], "positive integer"),
    ],
)
def test_usage_errors(capsys, argv, needle):
    """argparse's errors: usage line + one error line, exit 2."""
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err.strip().splitlines()[-1]
    assert "Traceback" not in err


def test_internal_error_exit_1(files, capsys, monkeypatch):
    d, model = files

    def boom(*a, **k):
        raise RuntimeError("realize exploded")

    monkeypatch.setattr(autoq.pipeline, "realize", boom)  # the stage the pipeline runs
    code, _, err = run(
        capsys, "quantize", model, "--calib", d / "calib.npz", "--out", d / "boom",
        "--no-progress", "--target", TARGET,
    )  # fmt: skip
    assert code == 1
    assert "Traceback" in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("autoq: internal error: RuntimeError: realize exploded")
    )
