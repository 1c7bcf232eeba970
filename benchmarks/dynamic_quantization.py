"""Dynamic quantization on all-MiniLM-L6-v2: autoq against ONNX Runtime ``quantize_dynamic``.

Rows (fidelity against ONNX Runtime fp32 with graph optimizations off, on held-out
pydoc sentences; the same prepared ONNX model and samples as benchmarks/vs_onnxruntime.py):

* autoq static (default config, mse calibrator), for reference (``--skip-static``: none);
* autoq dynamic, ``granularity="tensor"`` and ``"token"`` (no calibration data);
* ONNX Runtime ``quantize_dynamic`` (its defaults: MatMul/Gemm/Attention..., uint8
  activations, int8 weights per tensor) and with ``per_channel=True``, in the same run.

Latency: median ms of the first eval sample at 1 thread, autoq's modules compiled by
``autoq.compile`` (CPU kernels, untuned) against ORT (graph optimizations on); the ratio
column divides by ORT ``quantize_dynamic`` (per tensor) of the same run. Numbers only;
nothing asserts a timing.

Run:  python benchmarks/dynamic_quantization.py [--calib 32 --eval 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common

HEADERS = ["runtime", "NN@1", "cos mean", "cos min", "fp32 layers", "quantize s", "ms 1T"]
HEADERS += ["1T vs ORT dynamic"]
ORT_PEER = "ORT quantize_dynamic"  # the ratio column's denominator


def autoq_row(info, config, calib, evalset, label, log) -> dict:
    res, quant_s, runner = common.autoq_quantize(info, config, calib, kernels=True)
    outs = [runner.run(s) for s in evalset]
    common.TvmRunner.set_threads(1)
    ms = common.median_ms(lambda: runner.run(evalset[0]), repeats=5, warmup=1)
    common.TvmRunner.set_threads(2)
    n_fp32 = len(res.fp32_layers)
    log(f"  {label}: {len(res.int8_layers)} int8 layers, {n_fp32} fp32, {quant_s:.1f} s")
    return {"label": label, "outputs": outs, "fp32": n_fp32, "quant_s": quant_s, "ms": ms}


def ort_dynamic_row(info, evalset, per_channel: bool, log) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="autoq-dyn-") as tmp:
        out = Path(tmp) / "dyn.onnx"
        t0 = time.perf_counter()
        quantize_dynamic(
            str(info.path), str(out), weight_type=QuantType.QInt8, per_channel=per_channel
        )
        quant_s = time.perf_counter() - t0
        outs = common.ort_outputs(common.ort_session(out, 2, True), evalset)
        ms = common.ort_latency_ms(out, evalset[0], 1, True, 10)
    label = "ORT quantize_dynamic" + (" per-channel" if per_channel else "")
    log(f"  {label}: {quant_s:.1f} s")
    return {"label": label, "outputs": outs, "fp32": None, "quant_s": quant_s, "ms": ms}


def configs(args):
    from autoq import Config, QuantSpec

    rows = [("autoq static (default)", Config(recipe="cnn"), True)]
    for gran in ("tensor", "token"):
        dyn = Config(recipe="cnn", activation=QuantSpec(dynamic=True, granularity=gran))
        rows.append((f"autoq dynamic ({gran})", dyn, False))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=32, help="calibration sentences (static rows)")
    p.add_argument("--eval", type=int, default=64, help="held-out evaluation sentences")
    p.add_argument("--skip-static", action="store_true", help="no static autoq rows")
    p.add_argument("--skip-dynamic", action="store_true", help="no dynamic rows (autoq, ORT)")
    common.add_page_option(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    args = parse_args(argv)
    log = print
    info, calib, evalset, ref = common.embedding_setup("minilm", args.calib, args.eval, log)
    rows = []
    for label, cfg, static in configs(args):
        if (static and args.skip_static) or (not static and args.skip_dynamic):
            continue
        rows.append(autoq_row(info, cfg, calib if static else None, evalset, label, log))
    for per_channel in () if args.skip_dynamic else (False, True):
        rows.append(ort_dynamic_row(info, evalset, per_channel, log))
    peer = next((r["ms"] for r in rows if r["label"] == ORT_PEER), None)
    table = []
    for r in rows:
        f = common.fidelity("embedding", ref, r["outputs"])
        table.append(
            [
                r["label"],
                f"{f['agree'] * 100:.1f}%",
                f"{f['cos']:.5f}",
                f"{f['cos_min']:.5f}",
                "" if r["fp32"] is None else str(r["fp32"]),
                f"{r['quant_s']:.1f}",
                f"{r['ms']:.1f}",
                f"{r['ms'] / peer:.2f}x" if peer else "",
            ]
        )
    log(common.markdown_table(HEADERS, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
