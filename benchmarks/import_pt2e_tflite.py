"""Pre-quantized PyTorch (PT2E) and TFLite models imported by ``autoq.import_quantized``.

Rows (one per model):

* **PT2E**: the ResNet-style and MobileNet-style CNNs of tests/pt2e_models.py (64x64
  inputs here), quantized by torchao's ``prepare_pt2e -> calibrate (16 skimage crops) ->
  convert_pt2e`` with ``X86InductorQuantizer`` and the XNNPACK quantizer;
* **TFLite**: tests/data/tiny_cnn_int8.tflite and one_conv_int8.tflite
  (scripts/make_tflite_model.py) on their committed int8 inputs.

Columns: import wall time (``import_quantized``, including TVM's import of the float graph),
TVM latency of the imported module (``autoq.compile`` for this CPU, untuned; median of
``--repeats`` runs of one sample; TVM, torch and LiteRT all on one thread), the source runtime's latency (torch eager on the ``convert_pt2e``
module; LiteRT with reference kernels, its optimized builtin kernels, and its default XNNPACK
delegate), and agreement with
the source runtime on held-out inputs: the fraction of output values equal and the largest
difference in LSB of the output scale (PT2E X86 models have a float output: the difference
is then shown in units of the classifier's input scale x max row sum of |W|, what one LSB of
every classifier input can move an output by). Numbers only.

Run: python benchmarks/import_pt2e_tflite.py [--repeats 20] [--eval 8]
Needs torch, torchao, scikit-image (PT2E rows), tflite and ai-edge-litert (TFLite rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

ROOT = Path(__file__).resolve().parent.parent


def _vm(mod):
    import tvm
    from tvm import relax

    import autoq

    return relax.VirtualMachine(autoq.compile(mod), tvm.cpu())


def _agreement(got: np.ndarray, ref: np.ndarray, lsb: float) -> tuple[float, float]:
    d = np.abs(got.astype(np.float64) - ref.astype(np.float64)) / lsb
    return float((d < 1e-3).mean()), float(d.max())


def pt2e_row(name: str, kind: str, size: int, n_eval: int, repeats: int) -> dict:
    import torch
    import tvm
    from pt2e_models import images, make_model, pt2e

    import autoq

    calib, test = images(16, size=size, seed=0), images(n_eval, size=size, seed=1)
    gm = pt2e(make_model(name), kind, calib)
    x0 = torch.from_numpy(test[:1])
    t0 = time.perf_counter()
    mod, _, report = autoq.import_quantized(gm, example_inputs=(x0,))
    import_s = time.perf_counter() - t0
    vm = _vm(mod)
    out_node = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    if "dequantize" in str(out_node.target):
        lsb = float(out_node.args[1])
    else:
        linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
        lsb = float(linear.args[0].args[1]) * float(
            np.abs(report.params["fc.weight"]).sum(axis=-1).max()
        )
    got, ref = [], []
    with torch.no_grad():
        for x in test:
            ref.append(gm(torch.from_numpy(x[None])).numpy())
            got.append(vm["main"](tvm.runtime.tensor(x[None])).numpy())
    equal, worst = _agreement(np.concatenate(got), np.concatenate(ref), lsb)
    if "dequantize" not in str(out_node.target):
        equal = None  # a float output: only the bound is meaningful
    xt = tvm.runtime.tensor(test[:1])
    with torch.no_grad():
        src_ms = common.median_ms(lambda: gm(x0), repeats)
    return {
        "model": f"PT2E {name} {kind} {size}x{size}",
        "layers": f"{len(report.layers)} int / {len(report.fallback)} fp32",
        "import_s": import_s,
        "tvm_ms": common.median_ms(lambda: vm["main"](xt), repeats),
        "source": "torch eager",
        "source_ms": src_ms,
        "equal": equal,
        "max_lsb": worst,
    }


def tflite_row(name: str, repeats: int) -> list[dict]:
    import tvm
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    import autoq

    path = ROOT / "tests" / "data" / f"{name}_int8.tflite"
    xs = np.load(ROOT / "tests" / "data" / "tiny_cnn_int8_inputs.npz")["x"]
    if name == "one_conv":
        xs = xs[:2]
    else:  # the 8 committed crops and 8 random int8 images (as tests/test_import_tflite.py)
        rand = np.random.default_rng(5).integers(-128, 128, (8, 32, 32, 3)).astype(np.int8)
        xs = np.concatenate([xs, rand])
    t0 = time.perf_counter()
    mod, _, report = autoq.import_quantized(str(path))
    import_s = time.perf_counter() - t0
    vm = _vm(mod)
    got = np.concatenate([vm["main"](tvm.runtime.tensor(x[None])).numpy() for x in xs])
    xt = tvm.runtime.tensor(xs[:1])
    tvm_ms = common.median_ms(lambda: vm["main"](xt), repeats)
    rows = []
    for label, resolver in (
        ("LiteRT ref", OpResolverType.BUILTIN_REF),
        ("LiteRT optimized", OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES),
        ("LiteRT xnnpack", OpResolverType.AUTO),
    ):
        it = Interpreter(
            model_path=str(path), experimental_op_resolver_type=resolver, num_threads=1
        )
        it.allocate_tensors()
        i_in, i_out = it.get_input_details()[0]["index"], it.get_output_details()[0]["index"]
        ref = []
        for x in xs:
            it.set_tensor(i_in, x[None])
            it.invoke()
            ref.append(it.get_tensor(i_out).copy())
        equal, worst = _agreement(got, np.concatenate(ref), 1.0)
        it.set_tensor(i_in, xs[:1])
        rows.append(
            {
                "model": f"TFLite {name}",
                "layers": f"{len(report.layers)} int / {len(report.fallback)} fp32",
                "import_s": import_s,
                "tvm_ms": tvm_ms,
                "source": label,
                "source_ms": common.median_ms(it.invoke, repeats),
                "equal": equal,
                "max_lsb": worst,
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "float output" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--eval", type=int, default=8, help="held-out images per PT2E model")
    ap.add_argument("--size", type=int, default=64, help="PT2E input height/width")
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", "1")  # one thread everywhere (shared machines)
    import torch
    import tvm

    torch.set_num_threads(1)

    print(f"LLVM cpu: {tvm.target.codegen.llvm_get_system_cpu()}, TVM untuned, 1 sample, 1 thread")
    rows = []
    for name in ("resnet", "mobilenet"):
        for kind in ("x86", "xnnpack"):
            rows.append(pt2e_row(name, kind, args.size, args.eval, args.repeats))
    for name in ("one_conv", "tiny_cnn"):
        rows += tflite_row(name, args.repeats)
    heads = ["model", "layers", "import s", "TVM ms", "source runtime", "source ms"]
    heads += ["TVM vs source", "outputs equal", "max diff (LSB)"]
    cells = [
        [r["model"], r["layers"], f"{r['import_s']:.2f}", f"{r['tvm_ms']:.2f}", r["source"],
         f"{r['source_ms']:.2f}", f"{r['tvm_ms'] / r['source_ms']:.2f}x", _pct(r["equal"]),
         f"{r['max_lsb']:.2f}"]
        for r in rows
    ]  # fmt: skip
    print()
    print(common.markdown_table(heads, cells, align="llrrlrrrr"))


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
