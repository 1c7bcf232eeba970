"""What the integer-only layers cost or gain on the README's benchmark models.

For each model (``common.MODEL_NAMES``: ResNet-50 open_nsfw, PP-OCRv4 det, all-MiniLM-L6-v2)
and each row of ``ROWS`` (a set of patterns switched off), autoq's default quantization
(``mse``, topological) is run on the calibration samples and measured on a disjoint
evaluation set:

* fidelity against the fp32 model in ONNX Runtime (graph optimizations off), as in
  ``vs_onnxruntime.py`` (top-1 / IoU@0.3 of the DB maps / NN@1, cosines);
* whether the realized integers are what the simulated graph predicts (``autoq.fallback.fidelity
  .compare``: slot integers differing, over every activation slot and evaluation sample);
* how many ops of the realized graph run in float32 between the input quantize and the
  output dequantize.

Rows: ``default`` (every default pattern); ``no elementwise const`` (``x+c``, ``x-c``,
``x*c``, ``x/c`` in fp32); ``fp32 activations`` (also the table-lookup activations,
sigmoid/hardswish/..., in fp32 between dequantize and quantize: how autoq realized them
before ``qnn.lut``).

Run:  python benchmarks/integer_activations.py [--models ppocr_det] [--calib 16 --eval 16]
Numbers only.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

CONST = ("add_const", "subtract_const", "multiply_const")
LUT = ("sigmoid", "tanh", "hardswish", "hardsigmoid", "silu", "gelu", "gelu_tanh")
#: row label -> pattern names switched off
ROWS = {"default": (), "no elementwise const": CONST, "fp32 activations": CONST + LUT}


def float_ops(mod) -> int:
    """Float32 ops of ``main`` other than the edge quantize/dequantize (and the fp32 ops
    they feed or read at the model's inputs and outputs)."""
    from autoq.ir.toolkit import bindings, dtype_of, op_name

    counts = Counter()
    for _, v in bindings(mod["main"]):
        name = op_name(v)
        if name and not name.startswith("qnn.") and dtype_of(v) == "float32":
            counts[name] += 1
    return sum(counts.values())


def measure(info, mod, params, calib, evals, ref, off: tuple[str, ...]) -> dict:
    import autoq
    from autoq.calibration import samples_for
    from autoq.fallback.fidelity import compare
    from autoq.ir.registry import ordered_patterns

    names = tuple(p.name for p in ordered_patterns() if p.name not in off)
    cfg = autoq.Config(patterns=names)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = autoq.Quantizer(cfg).run(mod, params, calib)
    secs = time.perf_counter() - t0
    inputs = list(info.input_shapes)
    runner = common.TvmRunner(res.module, inputs)
    f = common.fidelity(info.kind, ref, [runner.run(s) for s in evals])
    sim = autoq.simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(list(evals), sim.graph.inputs))
    n, d = sum(rep.elements.values()), sum(rep.differing.values())
    return {
        "fidelity": f,
        "layers": len(res.int8_layers),
        "float_ops": float_ops(res.module),
        "differing": f"{d} of {n}",
        "max_lsb": max(rep.max_lsb.values(), default=0),
        "secs": secs,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(common.MODEL_NAMES))
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=16)
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    import autoq

    print(common.machine_summary())
    table = []
    for name in args.models.split(","):
        info = common.find_model(name)
        mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
        calib = list(common.make_dataset(info, "calib", args.calib))
        evals = list(common.make_dataset(info, "eval", args.eval))
        ref = common.ort_outputs(common.ort_session(info.path, threads=2), evals)
        for row in args.rows:
            r = measure(info, mod, params, calib, evals, ref, ROWS[row])
            print(f"  {name} / {row}: {r}", flush=True)
            table.append(
                [
                    common.MODEL_TITLES.get(name, name), row, *common.format_fidelity(r["fidelity"]),
                    str(r["layers"]), str(r["float_ops"]), r["differing"], str(r["max_lsb"]),
                    f"{r['secs']:.0f}",
                ]
            )  # fmt: skip
    print()
    headers = ["model", "row", "agreement", "cos mean", "cos min", "max abs diff", "int8 layers"]
    headers += ["fp32 ops", "slot integers != simulation", "max LSB", "quantize s"]
    print(common.markdown_table(headers, table, align="llrrrrrrrrr"))
    print(f"\n{args.calib} calibration / {args.eval} evaluation samples (disjoint).")


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
