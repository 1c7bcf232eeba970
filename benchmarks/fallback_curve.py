"""Fidelity vs number of fp32 layers, and the time of the automatic fallback search.

For each model (PP-OCRv4 detector, ResNet-50 open_nsfw) this

1. imports the ONNX file with ``autoq.frontends.from_onnx`` and runs the pipeline
   (``autoq.Quantizer``) with ``Config(fallback=AutoFallback(min_sqnr=--min-sqnr))`` on
   ``--calib`` real samples (``common.make_dataset``): calibration, then the analysis
   (``autoq.Analysis``: one compile of the fp32 graph, the switched simulated graph and one
   small function per layer) with its per-layer report (printed sorted by damage, written
   as JSON and, with matplotlib, a PNG), then the automatic search, each timed;
4. prints the curve: for ``k = 0 .. --max-k`` most sensitive layers kept in fp32 (the
   search's ranking), the output SQNR on the calibration samples (what the search sees) and,
   on the disjoint ``--eval`` samples, SQNR, cosine and the task agreement of
   ``common.fidelity`` (top-1 for ResNet-50, IoU of the text maps for the detector). Each
   point is a run of the already compiled switched simulated graph (the realized int8 graph
   computes the same up to float32 rounding in the fp32 layers; ``--realize`` checks the
   pipeline's realized module).

Run:  python benchmarks/fallback_curve.py [--models ppocr_det,resnet50]
      [--calib 8] [--eval 8] [--det-size 320] [--max-k 10] [--min-sqnr 30] [--realize]
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

MODELS = ("ppocr_det", "resnet50")
OUT_DIR = common.CACHE_DIR / "fallback"  # report JSON and PNG (git-ignored)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--calib", type=int, default=8, help="calibration samples")
    p.add_argument("--eval", type=int, default=8, help="held-out evaluation samples")
    p.add_argument("--det-size", type=int, default=320, help="detector input side (x32)")
    p.add_argument("--max-k", type=int, default=10, help="curve: every k from 0 to this")
    p.add_argument(
        "--extra-k",
        default="20,40,all",
        help="curve: further points (comma-separated numbers of fp32 layers, 'all')",
    )
    p.add_argument("--min-sqnr", type=float, default=30.0, help="AutoFallback budget (dB)")
    p.add_argument("--max-fp32", type=int, default=10, help="AutoFallback.max_fp32_layers")
    p.add_argument(
        "--ranking",
        choices=("local", "revert"),
        default="local",
        help="AutoFallback.ranking (revert: one trial per layer)",
    )
    p.add_argument("--realize", action="store_true", help="also realize the chosen point")
    p.add_argument("--opt0", action="store_true", help="compile at LLVM opt-level 0")
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    common.add_page_option(p)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    return args


def _first(o):
    return o[0] if isinstance(o, list) else o


def bench(name: str, args) -> dict:
    import autoq
    from autoq.frontends import from_onnx
    from autoq.metrics import sqnr_db

    log = lambda msg: print(f"[{name}] {msg}", flush=True)  # noqa: E731
    target = common.tvm_target()
    if args.opt0:
        import tvm

        target = tvm.target.Target({"kind": "llvm", "opt-level": 0})
    info = common.find_model(name, det_size=args.det_size)
    calib = common.make_dataset(info, "calib", args.calib)
    evalset = common.make_dataset(info, "eval", args.eval)
    thresh = info.extra.get("thresh", 0.3)
    t0 = time.perf_counter()
    mod, params = from_onnx(str(info.path), dict(info.input_shapes))
    t_import = time.perf_counter() - t0
    # ---- the pipeline with the automatic search (what autoq.quantize runs)
    fb = autoq.AutoFallback(
        min_sqnr=args.min_sqnr, max_fp32_layers=args.max_fp32, ranking=args.ranking
    )
    cfg = autoq.Config(fallback=fb)
    res = autoq.Quantizer(cfg, target=target).run(mod, params, calib.samples)
    an, report, decision = res.analysis, res.report, res.decision
    t_calib = res.timings["calibrate"]
    t_build = an.timings["build_s"] + an.timings["compile_s"]
    t_report = an.timings["report_s"]
    t_search = decision.seconds
    log(f"import {t_import:.1f} s, calibrate {t_calib:.1f} s, {len(res.matched.layers)} layers")
    log(f"analysis: build+compile {t_build:.1f} s, report {t_report:.1f} s")
    print(report.table())
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report.save(OUT_DIR / f"report_{name}.json")  # Report.loads(...) reads it back
    png = report.plot(OUT_DIR / f"sqnr_{name}.png", title=f"{common.MODEL_TITLES[name]}")
    if png:
        log(f"plot: {png}")
    log(f"search: {t_search:.1f} s, {decision.evaluations} runs over the calibration data")
    print(decision.summary())

    # ---- the curve along the ranking
    order = [r["layer"] for r in decision.ranking]
    ref_cal = an.run_fp32()
    ref_eval = an.run_fp32(evalset.samples)
    ref_eval_1 = [_first(o) for o in ref_eval]  # the first output, what common.fidelity reads
    rows, raw = [], []
    ks = list(range(min(args.max_k, len(order)) + 1))
    for e in args.extra_k.split(","):
        e = e.strip()
        if e:
            k = len(order) if e == "all" else min(int(e), len(order))
            if k not in ks:
                ks.append(k)
    for k in ks:
        t0 = time.perf_counter()
        out_cal = an.run(order[:k])
        t_trial = time.perf_counter() - t0
        out_eval = an.run(order[:k], evalset.samples)
        fid = common.fidelity(info.kind, ref_eval_1, [_first(o) for o in out_eval], thresh)
        s_cal, s_eval = sqnr_db(ref_cal, out_cal), sqnr_db(ref_eval, out_eval)
        rows.append(
            [
                k,
                ("(all int8)" if not k else order[k - 1] if k <= args.max_k else "...")
                + (" (all fp32)" if k == len(order) else ""),
                f"{s_cal:.2f}",
                f"{s_eval:.2f}",
                f"{fid['cos']:.5f}",
                f"{fid['agree_name']} {100 * fid['agree']:.1f}%",
                f"{t_trial:.2f}",
            ]
        )
        raw.append({"k": k, "layers": order[:k], "sqnr_calib": s_cal, "sqnr_eval": s_eval, **fid})
    print()
    print(
        common.markdown_table(
            ["k fp32", "+ layer", "SQNR calib dB", "SQNR eval dB", "cos eval", "agree", "trial s"],
            rows,
        )
    )
    result = {
        "model": name,
        "layers": len(order),
        "ranking": args.ranking,
        "calib": calib.description,
        "eval": evalset.description,
        "seconds": {
            "import": t_import,
            "calibrate": t_calib,
            "analysis_build_compile": t_build,
            "report": t_report,
            "search": t_search,
        },
        "decision": decision.to_json(),
        "curve": raw,
    }
    if args.realize:  # the pipeline's own int8 module with the chosen fallback
        t0 = time.perf_counter()
        runner = common.TvmRunner(res.module, list(info.input_shapes), target)
        outs = [runner.run(s) for s in evalset.samples]
        fid = common.fidelity(info.kind, ref_eval_1, outs, thresh)
        s = sqnr_db(ref_eval_1, outs)
        log(
            f"realized (k={len(decision.layers)}): SQNR eval {s:.2f} dB, cos {fid['cos']:.5f}, "
            f"{fid['agree_name']} {100 * fid['agree']:.1f}% ({time.perf_counter() - t0:.1f} s)"
        )
        result["realized"] = {"sqnr_eval": s, **fid}
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    print(common.machine_summary())
    results = []
    for name in args.models:
        results.append(bench(name, args))
    print("\nsummary (seconds)")
    rows = []
    for r in results:
        s, d = r["seconds"], r["decision"]
        rows.append(
            [
                r["model"],
                r["layers"],
                r["ranking"],
                f"{s['calibrate']:.1f}",
                f"{s['analysis_build_compile']:.1f}",
                f"{s['report']:.1f}",
                f"{s['search']:.1f}",
                d["evaluations"],
                f"{len(d['layers'])} ({', '.join(d['layers'][:4])}{'...' if len(d['layers']) > 4 else ''})",
                "met" if d["met"] else "not met",
            ]
        )
    print(
        common.markdown_table(
            ["model", "layers", "ranking", "calib", "analysis compile", "report", "search", "runs",
             "fp32 layers chosen", "budget"],
            rows,
        )
    )  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    raise SystemExit(common.run_benchmark(main, __file__))
