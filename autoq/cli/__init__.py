"""The ``autoq`` command: ``autoq quantize``, ``autoq run``, ``autoq inspect``, ``autoq demo``,
``autoq tune``.

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

import gc
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

from autoq.cli.args import METHODS, ROUNDINGS, build_parser
from autoq.cli.console import LOGGER, console
from autoq.cli.inputs import (
    BUNDLED,
    UserError,
    fallback_rules,
    load_calibration,
    one_line,
    resolve_model,
    target_of,
)
from autoq.cli.interrupts import MESSAGE, cleanup_on_signals, exit_code, received
from autoq.cli.output_dir import FolderLock, OutputDir
from autoq.errors import AutoqError

__all__ = ["BUNDLED", "METHODS", "ROUNDINGS", "UserError", "main"]

# files written by ``autoq quantize`` into --out
LIBRARY, ONNX_FILE, QPARAMS, SCRIPT, REPORT, CONFIG, MODULE, PREPROCESS = (
    "model.so",
    "model.onnx",
    "qparams.json",
    "model.py",
    "report.txt",
    "config.json",
    "module.json",
    "preprocess.json",
)
#: the tuning database folder ``autoq tune`` writes next to the model
TUNING = "tuning"


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


def _batched(model_path: Path, batch: int):
    """The ONNX model with every data input's first dimension set to ``batch`` (the
    outputs' and intermediate shapes left to be inferred again)."""
    import onnx

    model = onnx.load(str(model_path))
    weights = {t.name for t in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.name in weights or not dims:
            continue
        dims[0].Clear()
        if value in model.graph.input:
            dims[0].dim_value = batch
        else:
            dims[0].dim_param = "batch"
    del model.graph.value_info[:]
    return model


def _import(
    model_path: Path,
    input_shapes: dict,
    optimize: bool,
    constant_inputs: dict,
    batch: int | None = None,
):
    import importlib.util

    from autoq.frontends import FrontendError, from_onnx

    if optimize and importlib.util.find_spec("onnxruntime") is None:
        LOGGER.warning(
            "onnxruntime is not installed, importing the model without constant folding "
            "(pip install onnxruntime if the import fails)"
        )
        optimize = False
    if batch is not None:
        input_shapes = {k: (batch, *v[1:]) for k, v in input_shapes.items()}
    try:
        from google.protobuf.message import DecodeError
    except ImportError:  # pragma: no cover (onnx depends on protobuf)
        DecodeError = ValueError
    try:
        model = model_path if batch is None else _batched(model_path, batch)
        return from_onnx(
            model, input_shapes or None, optimize=optimize, constant_inputs=constant_inputs
        )
    except DecodeError:
        raise UserError(f"{str(model_path)!r} is not a valid ONNX file") from None
    except (FrontendError, FileNotFoundError, ImportError, ValueError) as e:
        msg = one_line(e)  # an error that names the file already says where
        if batch is not None:
            raise UserError(
                f"--batch {batch}: {model_path} does not import at batch {batch}: {msg}"
            ) from None
        raise UserError(
            msg if str(model_path) in msg else f"cannot import {str(model_path)!r}: {msg}"
        ) from None


def _output_names(model_path: Path) -> list[str]:
    import onnx

    try:
        return [o.name for o in onnx.load(str(model_path), load_external_data=False).graph.output]
    except Exception:  # the import read it already; names are a nicety
        return []


def _dataset(args, specs, image_options: dict):
    """(validated dataset, description, image preprocessing or None) for --calib (or the
    bundled digits images)."""
    from autoq import dataset as D

    if args.calib is None:
        from autoq.cli.demo import calibration_images

        data, name = calibration_images(args.samples or 100), "bundled digits training images"
    else:
        data, name = load_calibration(args, specs, image_options)
    try:
        return (
            D.as_dataset(data, specs, limit=args.samples),
            name,
            getattr(data, "preprocessing", None),
        )
    except D.DatasetError as e:
        raise UserError(f"calibration data {args.calib or name}: {one_line(e)}") from None


def _resources(args) -> dict:
    """The ``Quantizer`` keywords the options describe (what the run may use)."""
    from autoq.config import Distributed, Resources

    try:
        dist = Distributed(args.scheduler, args.workers) if args.scheduler or args.workers else None
        r = Resources(args.memory_budget, args.cache_dir, False if _no_bars(args) else None, dist)
    except (TypeError, ValueError) as e:
        raise UserError(one_line(e)) from None
    return {f: getattr(r, f) for f in ("memory_budget_mb", "cache_dir", "progress", "distributed")}


def _no_bars(args) -> bool:
    """``--no-progress`` or ``--quiet``: no live progress even on a terminal."""
    return args.no_progress or getattr(args, "quiet", False)


def _shows_progress(args) -> bool:
    """Whether this command draws live progress (standard error a terminal, not turned off)."""
    from autoq.config import Resources

    return Resources(progress=False if _no_bars(args) else None).show_progress


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
        LOGGER.warning(one_line(w))
    return result


def _database_in(folder: Path) -> Path | None:
    from autoq.build.tuning_database import RECORD_FILE

    return folder / TUNING if (folder / TUNING / RECORD_FILE).is_file() else None


def _write_onnx(out: Path, result, fmt: str, names: list[str]) -> list[str]:
    """``model.onnx`` (``--format onnx`` / ``both``). With ``both``, a model the export
    cannot write gets a warning and the library alone; with ``onnx`` it is the error."""
    from autoq.errors import ExportError
    from autoq.export import export_onnx

    n_out = len(getattr(result.module["main"].body.body.ty, "fields", [None]))
    try:
        export_onnx(result, out / ONNX_FILE, names if names and len(names) == n_out else None)
    except ExportError as err:
        if fmt == "onnx":
            raise
        LOGGER.warning(f"{ONNX_FILE} not written: {err}")
        return []
    return [ONNX_FILE]


def _write(
    out: Path,
    result,
    config,
    target,
    database: Path | None,
    extra=None,
    fmt: str = "both",
    show: bool = False,
) -> tuple[list[str], float]:
    """Write the result into the folder ``out``: the library (compiled with the tuning
    ``database``, which is copied along) and / or the ONNX file as ``fmt`` says;
    ``extra``: (output names, image preprocessing); ``show``: the compile's live status.
    Returns the files written and the compile time."""
    import shutil

    import tvm

    from autoq.build import export_library
    from autoq.config.progress import status
    from autoq.json_document import write_atomic

    output_names, preprocessing = extra or ([], None)
    files, t_compile = [], 0.0
    if fmt in ("so", "both"):
        t = time.perf_counter()
        LOGGER.debug("compile ...")
        with status("compile", show):
            export_library(result.module, out / LIBRARY, target=target, database=database,
                           output_names=output_names)  # fmt: skip
        t_compile = time.perf_counter() - t
        LOGGER.info("%-14s %6.1f s  %s", "compile", t_compile, LIBRARY)
        files += [LIBRARY, LIBRARY + ".autoq.json"]
        if database is not None:
            shutil.copytree(database, out / TUNING, symlinks=True)
            files.append(TUNING)
    if fmt in ("onnx", "both"):
        files += _write_onnx(out, result, fmt, output_names)
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
    if preprocessing is not None:
        (out / PREPROCESS).write_text(preprocessing.dumps())
        files.append(PREPROCESS)
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
    with OutputDir(out, args.force) as staging:  # checked and locked first
        return _quantize_into(args, staging, model_path, input_shapes, image_options, bundled,
                              target, config, t_start)  # fmt: skip


def _quantize_into(
    args, staging, model_path, input_shapes, image_options, bundled, target, config, t_start
) -> int:
    from autoq import dataset as D
    from autoq.cli.summary import quantize_report
    from autoq.config.progress import status

    out = staging.out
    t = time.perf_counter()
    with status("import", _shows_progress(args)):
        mod, params = _import(
            model_path, input_shapes, args.onnx_optimize and not bundled, dict(args.constant_input)
        )
    t_import = time.perf_counter() - t
    specs = D.input_specs(mod, params)
    LOGGER.info(f"model       {model_path} ({', '.join(str(s) for s in specs)})")
    dataset, data_name, preprocessing = _dataset(args, specs, image_options)
    LOGGER.info(f"calibrating on {data_name} ...")
    result = _run_pipeline(
        config, target, args.report, mod, params, dataset, data_name, _resources(args)
    )
    if args.batch is not None and [s.shape[:1] for s in specs] != [(args.batch,)] * len(specs):
        result = _rebatched(result, args, model_path, specs, bundled)
    # a tuning database left by 'autoq tune' in --out is used and kept
    database = _database_in(staging.target)
    extra = (_output_names(model_path), preprocessing)
    files, t_compile = _write(
        staging.path, result, result.config, target, database, extra, args.format,
        _shows_progress(args),
    )  # fmt: skip
    text = quantize_report(
        result, model_path, specs, args.calib or data_name, result.config, target, skip=args.skip,
        times={"import": t_import, **result.timings, "compile": t_compile},
        files=(out, files), report_asked=args.report, fp32_model=(mod, params),
    )  # fmt: skip
    (staging.path / REPORT).write_text(text)
    staging.commit(files)
    if staging.removed:
        shown = ", ".join(staging.removed[:10]) + (", ..." if len(staging.removed) > 10 else "")
        print(f"autoq: note: --force removed {len(staging.removed)} entries autoq had not "
              f"written from {str(out)!r}: {shown}", file=sys.stderr)  # fmt: skip
    LOGGER.info("")
    LOGGER.info(text.rstrip("\n"))
    LOGGER.info(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


def _rebatched(result, args, model_path, specs, bundled):
    """``result`` with its module realized on the model imported at ``--batch`` (the same
    qparams: they do not depend on the batch)."""
    import dataclasses

    from autoq.pipeline import realize_like

    shapes = {s.name: s.shape for s in specs}
    t = time.perf_counter()
    mod, params = _import(
        model_path,
        shapes,
        args.onnx_optimize and not bundled,
        dict(args.constant_input),
        args.batch,
    )
    module = realize_like(result, mod, params)
    LOGGER.info("%-14s %6.1f s  batch %d", "batch", time.perf_counter() - t, args.batch)
    return dataclasses.replace(result, module=module)


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
    import contextlib
    import os

    t_start = time.perf_counter()
    mod, folder = _tuned_module(args.model)
    rebuild = (folder / LIBRARY).is_file() or args.model.is_dir()
    # the folder's --out lock for the whole run (the database and the library are written
    # into it): an 'autoq quantize --out' on it meanwhile is refused, and vice versa
    lock = FolderLock(Path(os.path.realpath(folder)), repr(str(folder)))
    with lock if rebuild else contextlib.nullcontext():
        _tune_folder(args, mod, folder, rebuild)
    LOGGER.info(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


def _tune_folder(args, mod, folder: Path, rebuild: bool) -> None:
    from autoq.build import export_library
    from autoq.config.progress import status
    from autoq.tuning import TuningError, tune

    target = target_of(args.target)
    database = args.database or folder / TUNING
    LOGGER.info(f"tuning the kernels of {folder} into {database} ({args.trials} trials) ...")
    try:
        result = tune(
            mod,
            target,
            trials=args.trials,
            database=database,
            rpc=args.rpc,
            trials_per_task=args.trials_per_task,
            progress=not _no_bars(args),
        )
    except ImportError as e:
        raise UserError(one_line(e)) from None
    except TuningError as e:
        raise UserError(f"tuning failed: {one_line(e)}") from None
    LOGGER.info(result.summary())
    if rebuild:
        with status("compile", _shows_progress(args)):
            export_library(mod, folder / LIBRARY, target=target, database=database,
                           output_names=_recorded_outputs(folder / LIBRARY))  # fmt: skip
        LOGGER.info(f"rebuilt {folder / LIBRARY} with the tuned kernels")


def _recorded_outputs(library: Path) -> list[str]:
    from autoq.ir.library_file import read_signature

    signature = read_signature(library)
    return [o["name"] for o in signature["outputs"]] if signature else []


def cmd_run(args) -> int:
    from autoq.cli.summary import format_outputs
    from autoq.session import load

    sess = load(args.folder)
    files = list(args.inputs)
    if len(files) == 1 and files[0].suffix.lower() == ".npz":
        import numpy as np

        if not files[0].is_file():
            raise UserError(f"no such file: {str(files[0])!r}")
        with np.load(files[0]) as z:
            outputs = sess.run({k: z[k] for k in z.files})
        names = [f"{files[0].name}[{i}]" for i in range(len(next(iter(outputs.values()))))]
    else:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"no such image file: {missing[0]!r}")
        outputs = sess.run_images(files)
        names = [f.name for f in files]
    LOGGER.info(format_outputs(outputs, names, args.top))
    if args.save is not None:
        _save_npz(args.save, outputs)
        LOGGER.info(f"outputs written to {args.save}")
    return 0


def _save_npz(path: Path, arrays: dict) -> None:
    """``arrays`` into ``path`` whole or not at all."""
    import io

    import numpy as np

    from autoq.json_document import write_atomic

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buf.getvalue())


COMMANDS = {
    "quantize": cmd_quantize,
    "run": cmd_run,
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
        code = exit_code(e)
    # the interrupt freed first (a TVM BlockBuilder left mid-function in its frames logs a
    # warning when freed), so that the interrupt line is the last one printed
    gc.collect()
    print(MESSAGE, file=sys.stderr)
    return code


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
        from autoq.threads import requested_threads

        with console(getattr(args, "quiet", False), getattr(args, "verbose", False)):
            requested_threads()  # a bad TVM_NUM_THREADS: refused before any work
            return COMMANDS[args.command](args)
    except (UserError, AutoqError) as e:
        if received() is not None:  # a KeyboardInterrupt that TVM turned into an error
            raise received() from None
        print(f"autoq: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if received() is not None:
            raise received() from None
        traceback.print_exc()
        print(
            f"autoq: internal error: {type(e).__name__}: {one_line(e)} (this is a bug in "
            "autoq; please report it with the traceback above)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
