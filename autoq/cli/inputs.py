"""What the command line's arguments name: the model file, the calibration data, the
``--skip`` rules and the target, each turned into autoq objects or a :class:`UserError`
(one line, exit code 2) that says what to pass instead."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "BUNDLED",
    "UserError",
    "fallback_rules",
    "load_calibration",
    "one_line",
    "resolve_model",
    "target_of",
]

#: the bundled demo model's name as a MODEL argument
BUNDLED = "digits"


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


#: the API's fixes, as the command line spells them (an error shown by ``autoq`` never
#: suggests a Python keyword): (pattern, replacement) applied in order
CLI_FIXES = (
    (r"[Pp]ass input_shapes=\{[^}]*\}", "pass --input-shape NAME=DIMS for each input"),
    (r"input_shapes=", "--input-shape "),
    (r"input_shapes\[('[^']*')\]", r"--input-shape \1"),
    (r"input_shapes (gives|names)", r"--input-shape \1"),
    (
        r"pass constant_inputs=\{name: value\} \(CLI: --constant-input name=value\)",
        "pass --constant-input NAME=VALUE",
    ),
    (r"constant_inputs\[('[^']*')\]", r"--constant-input \1"),
    (r"constant_inputs names", "--constant-input names"),
    (r"[Pp]ass optimize=False", "pass --no-onnx-optimize"),
    (r"\(optimize=False\)", "(--no-onnx-optimize)"),
    (r"try optimize=True", "try without --no-onnx-optimize"),
    (
        r"from_onnx\(\.\.\., allow_quantized=True\)",
        "the Python API from_onnx(allow_quantized=True)",
    ),
)


def one_line(e: BaseException | str) -> str:
    """An exception's message on one line (``; `` between its lines), with the API's fixes
    translated into command-line options (:data:`CLI_FIXES`)."""
    import re

    text = str(e) if not isinstance(e, KeyError) else str(e.args[0] if e.args else e)
    parts = [p.strip() for p in str(text).strip().splitlines() if p.strip()]
    line = "; ".join(parts) or type(e).__name__
    for pattern, repl in CLI_FIXES:
        line = re.sub(pattern, repl, line)
    return line


def resolve_model(name: str):
    """(onnx path, input shapes, image options, bundled?) for the MODEL argument."""
    from autoq import models

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
        from autoq.cli.demo import MODEL_FILE

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
            raise UserError(one_line(e)) from None
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


def load_calibration(args, specs, image_options: dict):
    """The calibration data named by --calib (not yet checked against the model)."""
    from autoq import dataset as D

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
            "interpolation": args.image_interpolation,
            "crop": "letterbox" if args.image_letterbox else None,
        }
        opts.update({k: v for k, v in given.items() if v is not None})
        if isinstance(opts.get("resize"), tuple) and len(opts["resize"]) == 1:
            opts["resize"] = opts["resize"][0]
        if isinstance(opts.get("size"), tuple) and len(opts["size"]) == 1:
            opts["size"] = opts["size"][0]
        if args.image_letterbox and args.image_resize is not None:
            raise UserError("--image-letterbox fits the whole image: it takes no --image-resize")
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
            raise UserError(one_line(e)) from None
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"--calib {args.calib}: {one_line(e)}") from None
    if path.is_file():
        suffix = path.suffix.lower()
        try:
            if suffix == ".npz":
                return D.from_npz(path), str(path)
            if suffix == ".npy":
                return D.from_npy(path), str(path)
        except (ValueError, OSError) as e:
            raise UserError(f"--calib {args.calib}: cannot read it: {one_line(e)}") from None
        raise UserError(
            f"--calib {args.calib!r}: expected a folder of images, an .npz or an .npy file"
        )
    raise UserError(f"--calib: no such file or folder: {args.calib!r}")


def fallback_rules(rules: Sequence[str]):
    from autoq.config import Fallback

    ids = tuple(r for r in rules if not (r.startswith("re:") or any(c in r for c in "*?[")))
    patterns = tuple(r for r in rules if r not in ids)
    try:
        return Fallback(ids=ids, patterns=patterns)
    except (TypeError, ValueError) as e:
        raise UserError(f"--skip: {one_line(e)}") from None


def target_of(spec):
    from autoq.ir.target import default_target

    if spec is None:
        return default_target()
    import tvm

    try:
        return tvm.target.Target(spec)
    except Exception as e:
        raise UserError(f"--target: {one_line(e)}") from None
