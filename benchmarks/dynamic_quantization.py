"""Dynamic quantization and the attention-mask rewrite on all-MiniLM-L6-v2.

Rows (fidelity against ONNX Runtime fp32 with graph optimizations off, on held-out
pydoc sentences; the same prepared ONNX model and samples as benchmarks/vs_onnxruntime.py):

* autoq static (default config, mse calibrator) **without** the finfo.min mask rewrite: the
  guard keeps the mask adds in fp32 (what autoq did before autoq.ir.attention_mask). The
  rewrite is a canonicalization rule; this row runs with its rows removed from
  ``autoq.ir.canonicalize.RULES`` (benchmark only);
* autoq static with the mask rewrite at each ``--mask-values`` (the library default is
  ``autoq.ir.attention_mask.MASK_VALUE``);
* autoq dynamic, ``granularity="tensor"`` and ``"token"`` (no calibration data);
* ONNX Runtime ``quantize_dynamic`` (its defaults: MatMul/Gemm/Attention..., uint8
  activations, int8 weights per tensor) and with ``per_channel=True``, in the same run.

Latency: median ms over the first eval sample, 1 thread, untuned TVM vs ORT (graph
optimizations on). Numbers only; nothing asserts a timing.

Run:  HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/dynamic_quantization.py [--calib 32 --eval 64]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common

HEADERS = ["runtime", "NN@1", "cos mean", "cos min", "fp32 layers", "quantize s", "ms 1T"]


@contextlib.contextmanager
def mask_rewrite(value: float | None):
    """The attention-mask rows of the canonicalization table off (None) or at ``value``."""
    import autoq.ir.attention_mask as am
    import autoq.ir.canonicalize as canon

    saved_rules, saved_value = list(canon.RULES), am.MASK_VALUE
    try:
        if value is None:
            canon.RULES[:] = [r for r in canon.RULES if not r.name.startswith("attention_mask")]
        else:
            am.MASK_VALUE = value
        yield
    finally:
        canon.RULES[:] = saved_rules
        am.MASK_VALUE = saved_value


def autoq_row(info, config, calib, evalset, label, mask_value, log) -> dict:
    with mask_rewrite(mask_value):
        res, quant_s, runner = common.autoq_quantize(info, config, calib)
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
    import autoq
    from autoq import Config, QuantSpec

    base = Config(progress=False)
    rows = [("autoq static, no mask rewrite (guard: mask adds fp32)", base, True, None)]
    for v in args.mask_values:
        rows.append((f"autoq static, mask rewrite {v:g}", base, True, v))
    for gran in ("tensor", "token"):
        dyn = Config(activation=QuantSpec(dynamic=True, granularity=gran), progress=False)
        rows.append((f"autoq dynamic ({gran})", dyn, False, autoq.ir.attention_mask.MASK_VALUE))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=32, help="calibration sentences (static rows)")
    p.add_argument("--eval", type=int, default=64, help="held-out evaluation sentences")
    p.add_argument(
        "--mask-values",
        default="-10000,-100,-50",
        help="mask constants for the static rows with the rewrite, comma-separated",
    )
    p.add_argument("--skip-static", action="store_true", help="no static autoq rows")
    p.add_argument("--skip-dynamic", action="store_true", help="no dynamic rows (autoq, ORT)")
    args = p.parse_args(argv)
    args.mask_values = [float(v) for v in args.mask_values.split(",") if v.strip()]
    return args


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    args = parse_args(argv)
    log = print
    info, calib, evalset, ref = common.embedding_setup("minilm", args.calib, args.eval, log)
    rows = []
    for label, cfg, static, mask_value in configs(args):
        if (static and args.skip_static) or (not static and args.skip_dynamic):
            continue
        rows.append(
            autoq_row(info, cfg, calib if static else None, evalset, label, mask_value, log)
        )
    for per_channel in () if args.skip_dynamic else (False, True):
        rows.append(ort_dynamic_row(info, evalset, per_channel, log))
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
            ]
        )
    log(common.markdown_table(HEADERS, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
