"""Does the simulated graph predict the realized integers, per requantize rounding mode?

autoq's default rounding is ``"float"`` (``quantize(dequantize(q))`` in float32, what the
simulated graph computes). This script measures, on the bundled digits CNN (4 convolutions,
residual add, global average pool, dense; ``autoq.cli.demo``) calibrated on 100 training
images and evaluated on 64 test images, how many integers of every activation slot of the
realized graph differ from the simulated graph's prediction (``autoq.fallback.fidelity.compare``),
and the digit accuracy of each realized module, for every mode of
``autoq.primitives.ROUNDING_MODES``.

Run:  python benchmarks/rounding_modes.py [--eval 64]
Numbers only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", type=int, default=64)
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    import tvm
    from tvm import relax

    import autoq
    from autoq import primitives as P
    from autoq.calibration import samples_for
    from autoq.cli.demo import MODEL_FILE, calibration_images, load_digits
    from autoq.fallback.fidelity import compare

    target = autoq.default_target()
    digits = load_digits()
    mod, params = autoq.from_onnx(MODEL_FILE)
    base = autoq.Config()
    sim = autoq.simulate(mod, params, base)
    qp = autoq.calibrate(sim, params, calibration_images(100, digits), base, target=target)
    xs = [x[None] for x in digits.test_x[: args.eval]]
    labels = digits.test_labels[: args.eval]
    print(f"digits CNN, {len(xs)} test images, LLVM cpu {target.attrs.get('mcpu', '')}\n")
    rows = []
    for mode in P.ROUNDING_MODES:
        real = autoq.realize(mod, params, qp, base.replace(rounding=mode))
        rep = compare(sim, real, qp, samples_for(xs, sim.graph.inputs), target=target)
        n, d = sum(rep.elements.values()), sum(rep.differing.values())
        vm = relax.VirtualMachine(tvm.compile(real, target), tvm.cpu())
        pred = [int(np.argmax(vm["main"](tvm.runtime.tensor(x)).numpy())) for x in xs]
        acc = float(np.mean(np.asarray(pred) == labels))
        lsb = max(rep.max_lsb.values(), default=0)
        rows.append([mode, n, f"{d} ({100 * d / max(n, 1):.3f}%)", lsb, f"{acc:.3f}"])
    heads = ["rounding", "slot integers", "differing from simulation", "max LSB", "accuracy"]
    print(common.markdown_table(heads, rows, align="lrrrr"))


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
