"""Fidelity vs the number of layers above int8 for ``AutoFallback(precision="int16_first")``
(:mod:`autoq.fallback.int16_first`: each ranked layer int16 first, fp32 only if int16 does not help,
each step kept only if it raises the held-out output SQNR).

One calibration (autoq's defaults) on ``--calib`` samples minus ``--holdout`` held out, one
compiled switched graph, one search with ``--max-layers``; then for every step the search
kept, the task agreement and cosine on the disjoint ``--eval`` samples against the fp32 model
in ONNX Runtime (``common.fidelity``: IoU@0.3 of the text maps for the detector), from the
switched graph; the last step with at most ``--budget`` layers is also realized
(``autoq.realization``) and measured the same way. Numbers only, no assertions.

    python benchmarks/int16_first_curve.py --model ppocr_det --calib 40 --holdout 8 --eval 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def _first(o):
    return o[0] if isinstance(o, list) else o


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ppocr_det", choices=common.MODEL_NAMES)
    ap.add_argument("--calib", type=int, default=40, help="samples, held-out ones included")
    ap.add_argument("--holdout", type=int, default=8)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--det-size", type=int, default=common.DEFAULT_DET_SIZE)
    ap.add_argument("--max-layers", type=int, default=10)
    ap.add_argument("--budget", type=int, default=3, help="realize the last step within this")
    ap.add_argument("--ranking", choices=("local", "revert"), default="revert")
    ap.add_argument(
        "--empirical-bias-correction", action="store_true", help="Config option of that name"
    )
    args = ap.parse_args(argv)
    import autoq
    from autoq.calibration import calibrate
    from autoq.fallback.escalation import EscalationGraph
    from autoq.fallback.int16_first import apply_decision, int16_first_search
    from autoq.simulation import simulate

    print(common.machine_summary(), flush=True)
    info = common.find_model(args.model, det_size=args.det_size)
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    data = list(common.make_dataset(info, "calib", args.calib))
    calib, held = data[: len(data) - args.holdout], data[len(data) - args.holdout :]
    evals = list(common.make_dataset(info, "eval", args.eval))
    ref = common.ort_outputs(common.ort_session(info.path, threads=2), evals)
    thresh = info.extra.get("thresh", 0.3)
    target = common.tvm_target()
    cfg = autoq.Config(progress=False, empirical_bias_correction=args.empirical_bias_correction)
    t0 = time.perf_counter()
    qp = calibrate(simulate(mod, params, cfg), params, calib, cfg, target=target)
    t_cal = time.perf_counter() - t0
    sim = simulate(mod, params, cfg, switches=True)
    eg = EscalationGraph(sim, qp, calib, target)
    fb = autoq.AutoFallback(
        min_sqnr=99.0, max_fp32_layers=args.max_layers, holdout=args.holdout,
        precision="int16_first", ranking=args.ranking,
    )  # fmt: skip
    d = int16_first_search(eg, fb, held)
    print(f"calibrate {t_cal:.0f} s, compile {eg.compile_s:.0f} s, search {d.seconds:.0f} s "
          f"({d.evaluations} runs)", flush=True)  # fmt: skip
    print(d.summary())
    steps = [t for t in d.trials if t["kind"] == "base" or t.get("kept", not held)]
    rows, within = [], None
    for t in steps:
        sel = [s for x in t["int16_layers"] for s in layer_slots(eg)[x]]
        outs = [_first(o) for o in eg.run(sel, evals, disabled=t["layers"])]
        f = common.fidelity(info.kind, ref, outs, thresh)
        what = ", ".join(
            [f"{x} int16" for x in t["int16_layers"]] + [f"{x} fp32" for x in t["layers"]]
        )
        rows.append([t["k"], what or "(all int8)", f"{t['metric']:.2f}",
                     f"{t.get('held_out_sqnr', float('nan')):.2f}",
                     f"{f['agree_name']} {100 * f['agree']:.1f}%", f"{f['cos']:.5f}"])  # fmt: skip
        if t["k"] <= args.budget:
            within = t
    print(common.markdown_table(
        ["layers above int8", "which", "SQNR calib dB", "SQNR held-out dB", "agreement", "cos"],
        rows, align="rlrrrr"))  # fmt: skip
    if within is not None:
        d.layers, d.int16_layers = list(within["layers"]), list(within["int16_layers"])
        out = apply_decision(eg, d, mod, params, cfg)
        runner = common.TvmRunner(
            autoq.realize(mod, params, out.qparams, out.config), list(info.input_shapes)
        )
        f = common.fidelity(info.kind, ref, [runner.run(s) for s in evals], thresh)
        print(f"\nrealized, {within['k']} layers above int8: {f['agree_name']} "
              f"{100 * f['agree']:.1f}%, cos {f['cos']:.5f}, cos_min {f['cos_min']:.5f}")  # fmt: skip
    print(f"\n{info.name}: {len(calib)} calibration + {len(held)} held-out / {len(evals)} "
          f"evaluation samples (disjoint), {args.det_size}x{args.det_size}; {cfg}")  # fmt: skip


def layer_slots(eg):
    from autoq.fallback.int16_first import layer_int16_slots

    return layer_int16_slots(eg)


if __name__ == "__main__":
    main()
