"""The ``autoq`` command: ``autoq quantize``, ``autoq inspect``, ``autoq demo``, ``autoq tune``.

Exit codes: 0 success; 2 bad input (a missing file, an unknown option value, a ``--skip``
rule that matches no layer, calibration data that does not fit the model, a missing optional
dependency), reported as one line ``autoq: error: ...`` without a traceback; 1 an internal
error (a bug: the traceback is printed, then ``autoq: internal error: ...``); 130 when
interrupted.

The command only parses arguments (:mod:`autoq.cli.args`, :mod:`autoq.cli.inputs`), runs
the same pipeline as ``autoq.quantize`` (:class:`autoq.Quantizer`: guard, automatic
fallback, calibration, realize) and prints (:mod:`autoq.cli.summary`); it adds the output folder
and the report. :func:`main` takes ``argv`` and returns the exit code, so it can be called
in-process.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

from autoq.cli.args import METHODS, ROUNDINGS, build_parser
from autoq.cli.inputs import (
    BUNDLED,
    UserError,
    fallback_rules,
    load_calibration,
    one_line,
    resolve_model,
    target_of,
)
from autoq.cli.interrupts import MESSAGE, cleanup_on_signals, exit_code
from autoq.cli.output_dir import OutputDir
from autoq.errors import AutoqError

__all__ = ["BUNDLED", "METHODS", "ROUNDINGS", "UserError", "main"]

# files written by ``autoq quantize`` into --out
LIBRARY, ONNX_FILE, QPARAMS, SCRIPT, REPORT, CONFIG, MODULE = (
    "model.so",
    "model.onnx",
    "qparams.json",
    "model.py",
    "report.txt",
    "config.json",
    "module.json",
)
#: the tuning database folder ``autoq tune`` writes next to the model
TUNING = "tuning"
OUTPUT_FILES = (LIBRARY, LIBRARY + ".autoq.json", ONNX_FILE, QPARAMS, SCRIPT, MODULE, REPORT, CONFIG, TUNING,
                "analysis.txt", "analysis.json", "fallback.json")  # fmt: skip


# --------------------------------------------------------------------------- quantize


def _config(args):
    """The Config the options describe (bad combinations fail before any model work)."""
    import dataclasses

    from autoq.config import AutoFallback, Config, QuantSpec

    fb = fallback_rules(args.skip)
    try:
        if args.auto_fallback:
            fb = AutoFallback(
                ids=fb.ids,
                patterns=fb.patterns,
                min_sqnr=args.min_sqnr,
                max_fp32_layers=args.max_fallback_layers,
                ranking=args.fallback_ranking,
                precision=args.fallback_precision,
            )
        weight = Config().weight
        return Config(
            recipe=args.recipe,
            activation=QuantSpec(calibrator=args.method) if args.method else None,
            weight=dataclasses.replace(weight, per_channel=args.per_channel),
            rounding=args.rounding,
            calibration=args.calibration,
            fallback=fb,
        )
    except (TypeError, ValueError) as e:
        raise UserError(one_line(e)) from None


def _import(model_path: Path, input_shapes: dict, optimize: bool):
    import importlib.util

    from autoq.frontends import FrontendError, from_onnx

    if optimize and importlib.util.find_spec("onnxruntime") is None:
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
        return from_onnx(model_path, input_shapes or None, optimize=optimize)
    except DecodeError:
        raise UserError(f"{str(model_path)!r} is not a valid ONNX file") from None
    except (FrontendError, FileNotFoundError, ImportError, ValueError) as e:
        msg = one_line(e)  # an error that names the file already says where
        raise UserError(
            msg if str(model_path) in msg else f"cannot import {str(model_path)!r}: {msg}"
        ) from None


def _dataset(args, specs, image_options: dict):
    """(validated dataset, description) for --calib (or the bundled digits images)."""
    from autoq import dataset as D

    if args.calib is None:
        from autoq.cli.demo import calibration_images

        data, name = calibration_images(args.samples or 100), "bundled digits training images"
    else:
        data, name = load_calibration(args, specs, image_options)
    try:
        return D.as_dataset(data, specs, limit=args.samples), name
    except D.DatasetError as e:
        raise UserError(f"calibration data {args.calib or name}: {one_line(e)}") from None


def _resources(args) -> dict:
    """The ``Quantizer`` keywords the options describe (what the run may use)."""
    from autoq.config import Distributed, Resources

    try:
        dist = Distributed(args.scheduler, args.workers) if args.scheduler or args.workers else None
        r = Resources(args.memory_budget, args.cache_dir, False if args.no_progress else None, dist)
    except (TypeError, ValueError) as e:
        raise UserError(one_line(e)) from None
    return {f: getattr(r, f) for f in ("memory_budget_mb", "cache_dir", "progress", "distributed")}


def _run_pipeline(config, target, report: bool, mod, params, dataset, data_name: str, res: dict):
    import autoq
    from autoq.dataset import DatasetError

    try:
        with warnings.catch_warnings(record=True):  # printed below, one line each
            warnings.simplefilter("always")
            q = autoq.Quantizer(config, target=target, report=report, **res)
            result = q.run(mod, params, dataset)
    except DatasetError as e:
        raise UserError(f"calibration data {data_name}: {one_line(e)}") from None
    except ValueError as e:  # a --skip rule that matches nothing, a bad model
        raise UserError(one_line(e)) from None
    for w in result.warnings:
        print(f"autoq: warning: {one_line(w)}", file=sys.stderr)
    return result


def _database_in(folder: Path) -> Path | None:
    from autoq.build.tuning_database import RECORD_FILE

    return folder / TUNING if (folder / TUNING / RECORD_FILE).is_file() else None


def _onnx_output_names(model_path: Path) -> list[str] | None:
    """The output names of an ONNX model file (kept by the exported model), else None."""
    if model_path.suffix != ".onnx":
        return None
    import onnx

    return [o.name for o in onnx.load(str(model_path), load_external_data=False).graph.output]


def _write_onnx(out: Path, result, fmt: str, model_path: Path) -> list[str]:
    """``model.onnx`` (``--format onnx`` / ``both``). With ``both``, a model the export
    cannot write gets a warning and the library alone; with ``onnx`` it is the error."""
    from autoq.errors import ExportError
    from autoq.export import export_onnx

    names = _onnx_output_names(model_path)
    n_out = len(getattr(result.module["main"].body.body.ty, "fields", [None]))
    try:
        export_onnx(result, out / ONNX_FILE, names if names and len(names) == n_out else None)
    except ExportError as err:
        if fmt == "onnx":
            raise
        print(f"warning: {ONNX_FILE} not written: {err}", file=sys.stderr)
        return []
    return [ONNX_FILE]


def _write(
    out: Path, result, config, target, fmt: str = "both", model_path: Path = Path("model")
) -> tuple[list[str], float]:
    import tvm

    from autoq.build import export_library
    from autoq.json_document import write_atomic

    files, t_compile = [], 0.0
    if fmt in ("so", "both"):
        t = time.perf_counter()
        # a tuning database left by 'autoq tune' in this folder is reused
        export_library(result.module, out / LIBRARY, target=target, database=_database_in(out))
        t_compile = time.perf_counter() - t
        files += [LIBRARY, LIBRARY + ".autoq.json"]
    if fmt in ("onnx", "both"):
        files += _write_onnx(out, result, fmt, model_path)
    result.qparams.save(out / QPARAMS)
    (out / SCRIPT).write_text(result.module.script())
    write_atomic(out / MODULE, tvm.ir.save_json(result.module))
    (out / CONFIG).write_text(config.dumps())
    files += [QPARAMS, SCRIPT, MODULE, CONFIG, REPORT]
    if result.report is not None:
        (out / "analysis.txt").write_text(result.report.table() + "\n")
        (out / "analysis.json").write_text(result.report.dumps())
        files += ["analysis.txt", "analysis.json"]
    if result.decision is not None:
        (out / "fallback.json").write_text(result.decision.dumps())
        files.append("fallback.json")
    return files, t_compile


def cmd_quantize(args) -> int:
    t_start = time.perf_counter()
    model_path, input_shapes, image_options, bundled = resolve_model(args.model)
    input_shapes.update(dict(args.input_shape))
    if args.calib is None and not bundled:
        raise UserError(
            "--calib DATA is required: a folder of images, an .npz or an .npy file "
            "(see 'autoq quantize --help')"
        )
    out = args.out or Path(f"{model_path.stem}_int8")
    target = target_of(args.target)
    config = _config(args)
    with OutputDir(out, args.force, OUTPUT_FILES) as staging:  # checked and locked first
        return _quantize_into(args, staging, model_path, input_shapes, image_options, bundled,
                              target, config, t_start)  # fmt: skip


def _quantize_into(
    args, staging, model_path, input_shapes, image_options, bundled, target, config, t_start
) -> int:
    from autoq import dataset as D
    from autoq.cli.summary import quantize_report

    out = staging.out
    t = time.perf_counter()
    mod, params = _import(model_path, input_shapes, args.onnx_optimize and not bundled)
    t_import = time.perf_counter() - t
    specs = D.input_specs(mod, params)
    print(f"model       {model_path} ({', '.join(str(s) for s in specs)})")
    dataset, data_name = _dataset(args, specs, image_options)
    print(f"calibrating on {data_name} ...")
    result = _run_pipeline(
        config, target, args.report, mod, params, dataset, data_name, _resources(args)
    )
    files, t_compile = _write(staging.path, result, result.config, target, args.format, model_path)
    text = quantize_report(
        result, model_path, specs, args.calib or data_name, result.config, target, skip=args.skip,
        times={"import": t_import, **result.timings, "compile": t_compile},
        files=(out, files), report_asked=args.report, fp32_model=(mod, params),
    )  # fmt: skip
    (staging.path / REPORT).write_text(text)
    staging.commit(files)
    print("")
    print(text, end="")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


# --------------------------------------------------------------------------- inspect, demo


def cmd_inspect(args) -> int:
    import json

    from autoq.cli.summary import format_qparams
    from autoq.qparams import load_qparams

    path: Path = args.qparams
    if not path.is_file():
        raise UserError(f"no such file: {str(path)!r}")
    try:
        qp = load_qparams(path)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a valid qparams file: {one_line(e)}") from None
    print(format_qparams(qp, str(path)))
    return 0


def cmd_demo(args) -> int:
    from autoq.cli.demo import run

    run(
        calib_samples=args.calib_samples,
        eval_samples=args.eval_samples,
        method=args.method,
        target=target_of(args.target),
        latency=not args.no_latency,
        progress=False if args.no_progress else None,
    )
    return 0


def _tuned_module(path: Path):
    """(module, folder it came from) for ``autoq tune MODEL``."""
    import tvm

    import autoq.qnn  # noqa: F401  (registers the qnn.* ops the module uses)

    file = path / MODULE if path.is_dir() else path
    if not file.is_file():
        hint = (
            f"{str(path)!r} has no {MODULE}: re-run 'autoq quantize --out {path}'"
            if path.is_dir()
            else f"no such file: {str(path)!r}"
        )
        raise UserError(hint)
    try:
        mod = tvm.ir.load_json(file.read_text())
    except Exception as e:
        raise UserError(
            f"{file} is not a module saved by tvm.ir.save_json: {one_line(e)}"
        ) from None
    if not isinstance(mod, tvm.IRModule) or "main" not in [
        g.name_hint for g in mod.get_global_vars()
    ]:
        raise UserError(f"{file} holds no IRModule with a 'main' function")
    return mod, file.parent


def cmd_tune(args) -> int:
    from autoq.build import export_library
    from autoq.tuning import TuningError, tune

    t_start = time.perf_counter()
    mod, folder = _tuned_module(args.model)
    target = target_of(args.target)
    database = args.database or folder / TUNING
    print(f"tuning the kernels of {folder} into {database} ({args.trials} trials) ...")
    try:
        result = tune(
            mod,
            target,
            trials=args.trials,
            database=database,
            rpc=args.rpc,
            trials_per_task=args.trials_per_task,
            progress=not args.no_progress,
        )
    except ImportError as e:
        raise UserError(one_line(e)) from None
    except TuningError as e:
        raise UserError(f"tuning failed: {one_line(e)}") from None
    print(result.summary())
    if (folder / LIBRARY).is_file() or args.model.is_dir():
        export_library(mod, folder / LIBRARY, target=target, database=database)
        print(f"rebuilt {folder / LIBRARY} with the tuned kernels")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


COMMANDS = {
    "quantize": cmd_quantize,
    "inspect": cmd_inspect,
    "demo": cmd_demo,
    "tune": cmd_tune,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    cleanup_on_signals()
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: clean-up ran in the finally blocks
        print(MESSAGE, file=sys.stderr)
        return exit_code(e)


def _main(argv: Sequence[str] | None) -> int:
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
    except (UserError, AutoqError) as e:
        print(f"autoq: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        traceback.print_exc()
        print(
            f"autoq: internal error: {type(e).__name__}: {one_line(e)} (this is a bug in "
            "autoq; please report it with the traceback above)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
