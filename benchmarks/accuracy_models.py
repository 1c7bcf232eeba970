"""The weight-tuning rows of ``accuracy.py`` on the README's benchmark models
(``common.MODEL_NAMES``: ResNet-50 open_nsfw, PP-OCRv4 det, all-MiniLM-L6-v2): fidelity of
autoq's int8 module against the fp32 model in ONNX Runtime (graph optimizations off) on a
disjoint evaluation set, per configuration row. Numbers, not assertions.

    python benchmarks/accuracy_models.py --model resnet50 --rows nearest gptq+bc
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy as A
import common


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", choices=common.MODEL_NAMES)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--eval", type=int, default=32)
    configs = A.baseline_configs()
    ap.add_argument("--rows", nargs="*", default=["nearest", "gptq+bc"], choices=list(configs))
    args = ap.parse_args(argv)
    import autoq

    print(common.machine_summary())
    info = common.find_model(args.model)
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    calib = list(common.make_dataset(info, "calib", args.calib))
    evals = list(common.make_dataset(info, "eval", args.eval))
    ref = common.ort_outputs(common.ort_session(info.path, threads=2), evals)
    inputs = list(info.input_shapes)
    rows = []
    for name in args.rows:
        cfg, note = configs[name]
        t0 = time.perf_counter()
        res = autoq.Quantizer(cfg).run(mod, params, calib)
        secs = time.perf_counter() - t0
        runner = common.TvmRunner(res.module, inputs)
        f = common.fidelity(info.kind, ref, [runner.run(s) for s in evals])
        t = res.timings
        cost = f"calibrate {t.get('calibrate', 0):.1f} s"
        cost += A.tuning_cost(res) + A.equalization_note(res)
        cost += f"; {len(res.fp32_layers)} layer(s) above int8 {sorted(res.fp32_layers)}"
        rows.append([name, *common.format_fidelity(f), f"{secs:.0f}", f"{note}; {cost}"])
        print(f"  {name}: {f}", flush=True)
    print()
    print(
        common.markdown_table(
            ["row", "agreement", "cos mean", "cos min", "max abs diff", "quantize s", "what"],
            rows,
            align="lrrrrrl",
        )
    )
    print(f"\n{info.name}: {len(calib)} calibration / {len(evals)} evaluation samples (disjoint).")


if __name__ == "__main__":
    main()
