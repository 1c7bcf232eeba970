"""autoq vs ONNX Runtime ``quantize_static`` on three real models.

For each model (ResNet-50 open_nsfw, PP-OCRv4 text detector, all-MiniLM-L6-v2) this prints
one markdown table row per runtime configuration:

* ORT fp32 with graph optimizations off (the fp32 reference every fidelity number is
  measured against) and on;
* TVM fp32, untuned (``tvm.relax.frontend.onnx.from_onnx`` + ``tvm.compile``);
* ORT int8 (QDQ, per-channel int8 weights, asymmetric uint8/int8 activations) calibrated with
  MinMax, Entropy and Percentile on the same calibration samples, run with graph
  optimizations off (the QDQ graph as written) and on (ORT fuses it into integer kernels);
* OpenVINO int8: NNCF's defaults on the same calibration samples, run by OpenVINO's CPU
  plugin (``benchmarks/peers.py``'s quantize and runner; skipped with ``--no-openvino`` or
  when nncf / openvino are not installed);
* autoq int8 (``AUTOQ_CONFIGS``: per-channel int8 weights, int8 activations with the mse
  (default) and percentile calibrators in topological calibration and KL on fp32
  statistics), compiled by TVM, untuned.

Run:  python benchmarks/vs_onnxruntime.py [--quick] [--models a,b] ...
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

HEADERS = [
    "model",
    "runtime",
    "graph opt",
    "agreement",
    "cos mean",
    "cos min",
    "max abs diff",
    "calib s",
    "peak RSS MB",
    "ms 1T",
    "ms 2T",
    "speed vs ORT fp32 1T",
]


# ORT op types to quantize, per model: (label suffix, op_types_to_quantize); None = ORT's
# default (every op type its QDQ quantizer supports). For MiniLM the default also quantizes the
# attention-mask Add, whose output holds finfo(float32).min: its range (and scale ~1e36) wipes
# out the softmax inputs, so the usual transformer recipe (MatMul/Gemm only) gets its own rows.
ORT_OP_SETS = {
    "resnet50": [("", None)],
    "ppocr_det": [("", None)],
    "minilm": [("", None), (" [MatMul,Gemm]", ("MatMul", "Gemm"))],
}


def ort_op_sets(name: str, spec: str) -> list[tuple[str, tuple[str, ...] | None]]:
    if spec == "auto":
        return ORT_OP_SETS[name]
    if spec == "all":
        return [("", None)]
    ops = tuple(o.strip() for o in spec.split(",") if o.strip())
    return [(f" [{','.join(ops)}]", ops)]


#: autoq configurations benchmarked per model: (label, activation calibrator, calibration mode)
AUTOQ_CONFIGS = [
    ("autoq int8 mse (default)", "mse", "topological"),
    ("autoq int8 percentile", "percentile", "topological"),
    # KL needs continuous (fp32) statistics: see calibrators/kl.py
    ("autoq int8 kl, fp32 stats", "kl", "fp32"),
]

TVM_FP32_REPEATS_1T = 3  # TVM fp32 at 1 thread (its 2-thread number is the median of its pass)
AUTOQ_REPEATS = 5  # autoq int8 latency repeats at 1 and at 2 threads


def autoq_quantize_child(model: str, calib_path: str, out_dir: str, method: str, mode: str) -> dict:
    """Runs in a measured subprocess: import the prepared ONNX file, quantize it with autoq on
    the calibration samples, and write the int8 library and the qparams to ``out_dir``."""
    import warnings

    import autoq
    from autoq import frontends

    info = common.find_model(model)
    samples = common.load_samples(Path(calib_path))
    t0 = time.perf_counter()
    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    t1 = time.perf_counter()
    cfg = autoq.Config(activation=autoq.QuantSpec(calibrator=method), calibration=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kept in res.warnings
        res = autoq.Quantizer(cfg).run(mod, params, samples)
    t4 = time.perf_counter()
    out = Path(out_dir)
    res.qparams.save(out / "qparams.json")
    autoq.export_library(res.module, out / "model.so")
    t5 = time.perf_counter()
    return {
        "calib_s": res.timings["calibrate"],
        "import_s": t1 - t0,
        "guard_s": res.timings.get("guard", 0.0),
        "realize_s": res.timings["realize"],
        "compile_s": t5 - t4,
        "layers": len(res.matched.layers),
        "fp32_layers": list(res.fp32_layers),
        "warnings": [w[:200] for w in res.warnings],
        "input_names": [v.name for v in res.matched.graph.inputs],
    }


def run_autoq(model_name: str, calib: common.Dataset, evalset: common.Dataset, log=print) -> dict:
    """autoq's rows: each configuration of ``AUTOQ_CONFIGS`` calibrated in a measured child
    process (wall time of ``autoq.calibration`` alone, and the child's peak RSS including
    import, compile and export), then the exported int8 library run here on ``evalset``."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoq-bench-autoq-") as tmp:
        calib_path = Path(tmp) / "calib.npz"
        common.save_samples(calib.samples, calib_path)
        for k, (label, method, mode) in enumerate(AUTOQ_CONFIGS):
            out_dir = Path(tmp) / f"cfg{k}"
            out_dir.mkdir()
            try:
                res = common.run_measured(
                    "vs_onnxruntime:autoq_quantize_child",
                    {
                        "model": model_name,
                        "calib_path": str(calib_path),
                        "out_dir": str(out_dir),
                        "method": method,
                        "mode": mode,
                    },
                )
            except common.SubprocessFailed as err:
                log(f"  {model_name}: {label} FAILED ({err})")
                continue
            runner = common.TvmRunner.from_library(out_dir / "model.so", res["input_names"])
            outputs = [runner.run(s) for s in evalset]
            common.TvmRunner.set_threads(1)
            ms1 = common.median_ms(
                lambda r=runner: r.run(evalset[0]), repeats=AUTOQ_REPEATS, warmup=1
            )
            common.TvmRunner.set_threads(2)
            ms2 = common.median_ms(
                lambda r=runner: r.run(evalset[0]), repeats=AUTOQ_REPEATS, warmup=1
            )
            skipped = f", {len(res['fp32_layers'])} layers kept fp32" if res["fp32_layers"] else ""
            log(
                f"  {model_name}: {label}: {res['layers']} layers{skipped}; import "
                f"{res['import_s']:.1f} s, calibrate {res['calib_s']:.1f} s, realize "
                f"{res['realize_s']:.1f} s, compile+export {res['compile_s']:.1f} s, peak RSS "
                f"{res['peak_rss_mb']:.0f} MB"
            )
            rows.append(
                {
                    "label": label + (f" ({len(res['fp32_layers'])} fp32)" if skipped else ""),
                    "outputs": outputs,
                    "calib_s": res["calib_s"],
                    "peak_rss_mb": res["peak_rss_mb"],
                    "ms_1t": ms1,
                    "ms_2t": ms2,
                }
            )
    return {"rows": rows}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(common.MODEL_NAMES), help="comma-separated")
    p.add_argument("--calib", type=int, default=None, help="calibration samples (default 64)")
    p.add_argument("--eval", type=int, default=None, help="evaluation samples (default 64)")
    p.add_argument("--quick", action="store_true", help="16/16 samples, fewer repeats, MinMax only")
    p.add_argument(
        "--methods",
        default=None,
        help=f"ORT calibration methods, comma-separated from {','.join(common.ORT_METHODS)}",
    )
    p.add_argument("--act", choices=("uint8", "int8"), default="uint8", help="activation type")
    p.add_argument(
        "--ort-ops",
        default="auto",
        help="ORT op types to quantize: auto (per model, see ORT_OP_SETS), all (ORT default), "
        "or a comma-separated list such as MatMul,Gemm,Conv",
    )
    p.add_argument("--repeats", type=int, default=None, help="ORT latency repeats (30; quick 10)")
    p.add_argument(
        "--det-size", type=int, default=common.DEFAULT_DET_SIZE, help="detector input side"
    )
    p.add_argument(
        "--rss-limit-gb",
        type=float,
        default=common.DEFAULT_RSS_LIMIT_MB / 1024,
        help="kill a calibration process above this RSS (reported as FAILED); lowered to the "
        f"memory available at that moment minus {common.RSS_RESERVE_MB / 1024:g} GB",
    )
    p.add_argument("--no-tvm", action="store_true", help="skip the TVM fp32 baseline")
    p.add_argument("--no-openvino", action="store_true", help="skip the OpenVINO int8 row")
    p.add_argument(
        "--tvm-eval",
        type=int,
        default=None,
        help="TVM fp32 pass over the first N eval samples (default 16, quick 4; 0 = all): "
        "untuned TVM takes 1-3 s per sample",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    common.add_page_option(p)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in common.MODEL_NAMES:
            p.error(f"unknown model {m!r}; choose from {', '.join(common.MODEL_NAMES)}")
    if args.calib is None:
        args.calib = 16 if args.quick else 64
    if args.eval is None:
        args.eval = 16 if args.quick else 64
    if args.tvm_eval is None:
        args.tvm_eval = 4 if args.quick else 16
    if args.repeats is None:
        args.repeats = 10 if args.quick else 30
    if args.methods is None:
        args.methods = "minmax" if args.quick else ",".join(common.ORT_METHODS)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in common.ORT_METHODS:
            p.error(f"unknown method {m!r}")
    return args


def _row(model, runtime, opt, fid=None, calib_s=None, rss=None, ms1=None, ms2=None, ref1=None):
    speed = f"{ref1 / ms1:.2f}x" if (ms1 and ref1) else ""
    return [
        model,
        runtime,
        opt,
        *common.format_fidelity(fid),
        common.fmt(calib_s),
        common.fmt(rss, 4) if rss is not None else "",
        common.fmt(ms1),
        common.fmt(ms2),
        speed,
    ]


def _latencies(path, sample, repeats) -> dict[tuple[int, bool], float]:
    return {
        (threads, opt): common.ort_latency_ms(path, sample, threads, opt, repeats)
        for threads in (1, 2)
        for opt in (False, True)
    }


def openvino_int8(info, calib: common.Dataset, evalset: common.Dataset, repeats: int) -> dict:
    """NNCF + OpenVINO int8 (``peers.py``'s child process and runner) on the prepared model
    after ``quant_pre_process``: its outputs on ``evalset``, quantize CPU seconds, peak RSS
    and the median ms at 1 and 2 threads."""
    import peers

    model, _ = peers.pre_processed(info)
    with tempfile.TemporaryDirectory(prefix="autoq-openvino-int8-") as tmp:
        samples, xml = Path(tmp) / "calib.npz", Path(tmp) / "int8.xml"
        common.save_samples(calib.samples, samples)
        transformer = info.kind == "embedding"
        q = peers.measured("_nncf_child", {"model": str(model), "output": str(xml),
                                           "samples": str(samples), "transformer": transformer})  # fmt: skip
        ov = peers.OpenVinoRunner(xml, (1, 2), "default")
        outs = [ov.run(x, 2) for x in evalset]
        ms = {n: common.median_ms(ov.call(evalset[0], n), repeats) for n in (1, 2)}
    return {"outputs": outs, "calib_s": q["cpu_s"], "peak_rss_mb": q["peak_rss_mb"],
            "ms_1t": ms[1], "ms_2t": ms[2], "precision": ov.precision}  # fmt: skip


def bench_model(name: str, args, log) -> tuple[list[list[str]], dict]:
    t_model = time.perf_counter()
    info = common.find_model(name, det_size=args.det_size)
    title = common.MODEL_TITLES[name]
    calib = common.make_dataset(info, "calib", args.calib)
    evalset = common.make_dataset(info, "eval", args.eval)
    raw: dict = {
        "model": name,
        "source": str(info.source),
        "prepared": str(info.path),
        "notes": list(info.notes),
        "calib": calib.description,
        "eval": evalset.description,
        "rows": [],
    }
    thresh = info.extra.get("thresh", 0.3)
    rows = []

    def add(runtime, opt, fid=None, calib_s=None, rss=None, ms1=None, ms2=None, ref1=None):
        rows.append(_row(title, runtime, opt, fid, calib_s, rss, ms1, ms2, ref1))
        raw["rows"].append(
            {
                "runtime": runtime,
                "opt": opt,
                "fidelity": fid,
                "calib_s": calib_s,
                "peak_rss_mb": rss,
                "ms_1t": ms1,
                "ms_2t": ms2,
            }
        )

    # fp32 reference: ORT, no graph optimization
    ref = common.ort_outputs(common.ort_session(info.path, 2, False), evalset)
    fp32_on = common.ort_outputs(common.ort_session(info.path, 2, True), evalset)
    shipped = common.ort_outputs(common.ort_session(info.source, 2, False), evalset)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, shipped, strict=True))
    raw["notes"].append(f"prepared vs shipped model (ORT fp32): max abs diff {diff:.2g}")
    if info.kind == "detector":
        frac = np.mean([np.mean(r > thresh) for r in ref])
        raw["notes"].append(f"fp32 map > {thresh:g} on {frac * 100:.1f}% of eval pixels")
    if info.kind == "classifier":
        top = np.array([np.argmax(r) for r in ref])
        raw["notes"].append(f"fp32 top-1 class histogram on eval: {np.bincount(top).tolist()}")
    lat = _latencies(info.path, evalset[0], args.repeats)
    ref1 = {False: lat[(1, False)], True: lat[(1, True)]}
    add("ORT fp32", "off", None, ms1=lat[(1, False)], ms2=lat[(2, False)])
    rows[-1][3] = "(reference)"
    fid = common.fidelity(info.kind, ref, fp32_on, thresh)
    add("ORT fp32", "on", fid, ms1=lat[(1, True)], ms2=lat[(2, True)])
    log(f"  {name}: ORT fp32 done ({time.perf_counter() - t_model:.0f} s)")

    # TVM fp32, untuned
    if not args.no_tvm:
        t0 = time.perf_counter()
        mod = common.tvm_import_onnx(info)
        t_import = time.perf_counter() - t0
        runner = common.TvmRunner(mod, list(info.input_shapes))
        n = len(evalset) if args.tvm_eval <= 0 else min(args.tvm_eval, len(evalset))
        outs, times = runner.run_timed(evalset.samples[:n])
        fid = common.fidelity(info.kind, ref[:n], outs, thresh)
        ms2 = float(np.median(times))
        common.TvmRunner.set_threads(1)
        ms1 = common.median_ms(
            lambda: runner.run(evalset[0]), repeats=TVM_FP32_REPEATS_1T, warmup=1
        )
        common.TvmRunner.set_threads(2)  # back to the pool size the pass above used
        add("TVM fp32 (untuned)", "default", fid, ms1=ms1, ms2=ms2, ref1=ref1[True])
        raw["notes"].append(
            f"TVM: from_onnx {t_import:.1f} s, compile {runner.compile_s:.1f} s, "
            f"pass over {n} eval samples {sum(times) / 1e3:.1f} s"
        )
        log(f"  {name}: TVM fp32 done ({time.perf_counter() - t_model:.0f} s)")

    # ORT int8
    configs = [
        (suffix, ops, method)
        for suffix, ops in ort_op_sets(name, args.ort_ops)
        for method in args.methods
    ]
    with tempfile.TemporaryDirectory(prefix="autoq-ort-int8-") as tmp:
        for k, (suffix, ops, method) in enumerate(configs):
            label = f"ORT int8 {method}{suffix}"
            qpath = Path(tmp) / f"{name}.{k}.int8.onnx"
            try:
                q = common.ort_quantize(
                    info,
                    calib.samples,
                    method,
                    qpath,
                    args.act,
                    op_types=ops,
                    rss_limit_mb=common.rss_limit_mb(args.rss_limit_gb * 1024),
                )
            except common.SubprocessFailed as err:
                res = err.result
                killed = "killed" in res.get("error", "")
                rows.append(_row(title, label, "—"))
                error = res.get("error", str(err))
                short = error.split(" after ")[0] if killed else error.split(":")[0]
                rows[-1][3] = f"FAILED ({short})"
                if res.get("elapsed_s") is not None:  # until the failure / the kill
                    rows[-1][7] = (">" if killed else "") + common.fmt(res["elapsed_s"])
                if res.get("peak_rss_mb"):
                    rows[-1][8] = (">" if killed else "") + common.fmt(res["peak_rss_mb"], 4)
                raw["rows"].append({"runtime": label, "error": str(err), **res})
                raw["notes"].append(f"{label}: FAILED: {error}")
                log(f"  {name}: {label} FAILED ({err})")
                continue
            lat = _latencies(qpath, evalset[0], args.repeats)
            scale, tensor = common.largest_activation_scale(qpath)
            if scale > 1e3:
                raw["notes"].append(
                    f"{label}: activation scale {scale:.2g} on `{tensor}` (range blown up)"
                )
            for opt in (False, True):
                outs = common.ort_outputs(common.ort_session(qpath, 2, opt), evalset)
                fid = common.fidelity(info.kind, ref, outs, thresh)
                add(
                    label,
                    "on" if opt else "off",
                    fid,
                    calib_s=q["calib_s"],
                    rss=q["peak_rss_mb"],
                    ms1=lat[(1, opt)],
                    ms2=lat[(2, opt)],
                    ref1=ref1[opt],
                )
            raw["notes"].append(
                f"{label}: calibration process RSS {q['base_rss_mb']:.0f} MB before "
                f"quantize_static, peak {q['peak_rss_mb']:.0f} MB"
            )
            log(f"  {name}: {label} done ({time.perf_counter() - t_model:.0f} s)")

    if not args.no_openvino:
        try:
            ov = openvino_int8(info, calib, evalset, args.repeats)
        except (ImportError, common.SubprocessFailed) as err:
            raw["notes"].append(f"OpenVINO int8: not run ({type(err).__name__}: {err})")
        else:
            fid = common.fidelity(info.kind, ref, ov["outputs"], thresh)
            add("OpenVINO int8 (NNCF)", "default", fid, ov["calib_s"], ov["peak_rss_mb"],
                ov["ms_1t"], ov["ms_2t"], ref1[True])  # fmt: skip
            raw["notes"].append(f"OpenVINO int8: inference precision {ov['precision']}")
            log(f"  {name}: OpenVINO int8 done ({time.perf_counter() - t_model:.0f} s)")

    # autoq (hook)
    try:
        res = run_autoq(name, calib, evalset, log)
    except NotImplementedError as err:
        rows.append([title, "autoq int8", "—", f"TODO: {err}", *[""] * (len(HEADERS) - 4)])
        raw["rows"].append({"runtime": "autoq int8", "todo": str(err)})
    else:
        for r in res.get("rows", [res]):
            fid = common.fidelity(info.kind, ref, r["outputs"], thresh)
            add(
                r.get("label", "autoq int8"),
                "—",
                fid,
                calib_s=r.get("calib_s"),
                rss=r.get("peak_rss_mb"),
                ms1=r.get("ms_1t"),
                ms2=r.get("ms_2t"),
                ref1=ref1[True],
            )
    raw["seconds"] = time.perf_counter() - t_model
    return rows, raw


def peer_ratios(raws: list[dict]) -> list[list[str]]:
    """autoq's rows against ONNX Runtime int8 of the same run, per model: latency at 1 and 2
    threads / the fastest ORT int8 row (graph optimizations on, any calibration method);
    calibration time and peak RSS / ORT ``quantize_static`` MinMax (else the first ORT int8
    row that completed)."""

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else ""

    out = []
    for raw in raws:
        rows = [r for r in raw["rows"] if "error" not in r and "todo" not in r]
        ort = [r for r in rows if r["runtime"].startswith("ORT int8")]
        fast = [r for r in ort if r["opt"] == "on"]
        best1 = min((r["ms_1t"] for r in fast if r["ms_1t"]), default=None)
        best2 = min((r["ms_2t"] for r in fast if r["ms_2t"]), default=None)
        cal = next((r for r in ort if r["runtime"] == "ORT int8 minmax"), ort[0] if ort else None)
        for r in rows:
            if not r["runtime"].startswith("autoq"):
                continue
            out.append(
                [
                    common.MODEL_TITLES[raw["model"]],
                    r["runtime"],
                    ratio(r["ms_1t"], best1),
                    ratio(r["ms_2t"], best2),
                    ratio(r["calib_s"], cal and cal["calib_s"]),
                    ratio(r["peak_rss_mb"], cal and cal["peak_rss_mb"]),
                ]
            )
    return out


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    all_rows, raws = [], []
    for name in args.models:
        log(f"{name} ...")
        rows, raw = bench_model(name, args, log)
        all_rows.extend(rows)
        raws.append(raw)

    print("## autoq vs ONNX Runtime quantize_static\n")
    print(f"machine: {common.machine_summary()}")
    load_end = os.getloadavg()
    print(
        f"load average (1 min) at start / end: {load_start[0]:.1f} / {load_end[0]:.1f} "
        f"(other processes on these {os.cpu_count()} cores make latencies noisy)"
    )
    print(
        f"settings: calib {args.calib} / eval {args.eval} samples (disjoint sources), "
        f"ORT QDQ, per-channel int8 weights, {args.act} asymmetric activations, "
        f"ORT default options per calibration method; latency = median of {args.repeats} "
        f"runs of one sample (TVM fp32: median over its pass on the first "
        f"{args.tvm_eval if args.tvm_eval > 0 else args.eval} eval samples at 2 threads, "
        f"{TVM_FP32_REPEATS_1T} runs at 1 thread; its fidelity is over those samples; autoq "
        f"int8: {AUTOQ_REPEATS} runs); calibration processes killed above "
        f"{args.rss_limit_gb:g} GB RSS (or available memory - "
        f"{common.RSS_RESERVE_MB / 1024:g} GB)\n"
    )
    for raw in raws:
        print(f"- **{common.MODEL_TITLES[raw['model']]}** (`{raw['model']}`): {raw['source']}")
        print(f"  - calib: {raw['calib']}; eval: {raw['eval']}")
        for note in raw["notes"]:
            print(f"  - {note}")
    print()
    print(common.markdown_table(HEADERS, all_rows, align="lllrrrrrrrrr"))
    print()
    print(
        "agreement: top-1 agreement with fp32 (classifier), IoU of the fp32 and test "
        "probability maps thresholded at the DB threshold (detector), nearest-neighbour "
        "agreement within the eval set (embeddings). cos: mean / min per-sample cosine of the "
        "output with the ORT fp32 output (opt off); detector: cosine of all maps concatenated "
        "/ min over maps with text. graph opt: ORT_DISABLE_ALL (off) / "
        "ORT_ENABLE_ALL (on). calib s: quantize_static wall time (calibration + QDQ "
        "rewrite; autoq: autoq.calibrate alone) in a fresh process; peak RSS: that "
        "process's VmHWM (autoq: including import, compile and export). 1T/2T: "
        "intra-op threads. speed: ORT fp32 ms (same graph opt; opt on for TVM/autoq) / "
        "row ms, both at 1 thread."
    )
    ratios = peer_ratios(raws)
    if ratios:
        print("\n### autoq against ONNX Runtime int8, same run\n")
        heads = ["model", "autoq row", "ms 1T vs fastest ORT int8", "ms 2T vs fastest ORT int8"]
        heads += ["calib s vs ORT MinMax", "peak RSS vs ORT MinMax"]
        print(common.markdown_table(heads, ratios, align="llrrrr"))
        print(
            "\nBelow 1.00x: autoq faster / smaller. Fastest ORT int8: the quickest ORT int8 row "
            "with graph optimizations on at that thread count; calibration: autoq.calibrate "
            "alone vs quantize_static (calibration + QDQ rewrite); peak RSS of each "
            "calibration process (autoq's includes import, compile and export)."
        )
    total = time.perf_counter() - t_start
    print(f"\ntotal run time: {total:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "models": raws}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
