"""Where does PP-OCRv4 det lose its text map? Per-tensor diagnosis of one calibration
(issue 16): one compiled simulated graph (qparams, weight values and per-layer switches
are runtime inputs, so any calibration of the same config is evaluated without a new
compile) plus the fp32 graph returning every activation slot's tensor.

* ``--image i``: for evaluation image ``i``, every activation slot in topological order:
  its fp32 range on that image against the calibrated range, the fraction of its fp32
  values outside the grid, and the SQNR of the quantized graph's value (everything
  upstream quantized) against fp32, next to the median SQNR over the other images; the
  first slots where the image falls far below the others are the collapse.
* ``--prefix``: the image's IoU with only the first k layers quantized (the rest fp32),
  bisected: the layer whose quantization makes it collapse.
* the fp32 map's margin at the 0.3 threshold (how many text pixels lie in [0.3, 0.35]).

Numbers only, no assertions.

    python benchmarks/ppocr_diagnose.py --calib 40 --eval 32 --image 18
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

CACHE = Path("/tmp/ppocr_diag")


def _first(o):
    return o[0] if isinstance(o, list | tuple) else o


class SimHarness:
    """The simulated graph of ``matched`` under ``config`` with switches, compiled once:
    ``outputs(qparams, samples, disabled)`` and ``slot_values(qparams, sample)``."""

    def __init__(self, matched, config, target):
        import tvm

        from autoq.simulation import simulate
        from autoq.ir.toolkit import bindings, compile_vm, make_function, output_fields

        t0 = time.perf_counter()
        sim = self.sim = simulate(matched, None, config, switches=True)
        g = sim.graph
        func = sim.mod["main"]
        pairs = bindings(func)
        value_of = dict(pairs)
        self.slots = sim.activation_slots()
        outs = output_fields(func.body.body)
        self.n_out = len(outs)
        pre = [value_of[sim.sq_vars[s]].args[0] for s in self.slots if s in sim.sq_vars]
        self.pre_slots = [s for s in self.slots if s in sim.sq_vars]
        fp_tensors = [sim.plan.tensors[s] for s in self.pre_slots]
        params = list(func.params)
        self.params = params
        functions = {
            "out": make_function("out", params, pairs, outs),
            "diag": make_function("diag", params, pairs, outs + pre),
            "fp32": make_function(
                "fp32",
                list(g.inputs) + list(g.weight_params),
                g.bindings,
                output_fields(g.output) + fp_tensors,
            ),
        }
        self.vm = compile_vm(functions, target, sim.mod)
        self.weights = {
            p.name: tvm.runtime.tensor(np.ascontiguousarray(g.params[p.name]))
            for p in g.weight_params
        }
        self.inputs = [v.name for v in g.inputs]
        self.layers = [m.layer for m in sim.matches]
        self.on = tvm.runtime.tensor(np.float32(1.0))
        self.off = tvm.runtime.tensor(np.float32(0.0))
        self.compile_s = time.perf_counter() - t0

    def _args(self, qvals, sample, disabled):
        import tvm

        args = []
        for p in self.params:
            n = p.name
            if n in self.inputs:
                args.append(tvm.runtime.tensor(np.ascontiguousarray(sample[n])))
            elif n in self.weights:
                args.append(self.weights[n])
            elif n in qvals:
                args.append(qvals[n])
            elif n.endswith(".enable"):
                args.append(self.off if n[: -len(".enable")] in disabled else self.on)
            else:
                raise KeyError(n)
        return args

    def qvals(self, qparams):
        import tvm

        return {k: tvm.runtime.tensor(v) for k, v in self.sim.input_values(qparams).items()}

    def outputs(self, qparams, samples, disabled=()):
        from autoq.ir.toolkit import as_list

        qv = self.qvals(qparams)
        dis = set(disabled)
        f = self.vm["out"]
        return [as_list(f(*self._args(qv, s, dis)))[0].numpy() for s in samples]

    def diag(self, qparams, sample, disabled=()):
        """(output, {slot: simulated pre-quantize value})"""
        from autoq.ir.toolkit import as_list

        qv = self.qvals(qparams)
        r = as_list(self.vm["diag"](*self._args(qv, sample, set(disabled))))
        vals = [x.numpy() for x in r]
        return vals[0], dict(zip(self.pre_slots, vals[self.n_out :], strict=True))

    def fp32(self, sample):
        from autoq.ir.toolkit import as_list

        ins = [self._tensor(sample[n]) for n in self.inputs]
        r = as_list(self.vm["fp32"](*ins, *[self.weights[p] for p in self.weights]))
        vals = [x.numpy() for x in r]
        return vals[0], dict(zip(self.pre_slots, vals[self.n_out :], strict=True))

    @staticmethod
    def _tensor(a):
        import tvm

        return tvm.runtime.tensor(np.ascontiguousarray(a))


def sqnr(ref, q) -> float:
    ref = ref.astype(np.float64)
    err = np.sum((ref - q.astype(np.float64)) ** 2)
    sig = np.sum(ref**2)
    return float("inf") if err == 0 else 10 * np.log10(max(sig, 1e-30) / err)


def iou(ref, test, thresh=0.3):
    r, t = ref > thresh, test > thresh
    u = int(np.sum(r | t))
    return (int(np.sum(r & t)) / u if u else 1.0), int(np.sum(r)), int(np.sum(t))


def setup(n_calib, n_eval, size):
    import autoq

    info = common.find_model("ppocr_det", det_size=size)
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    calib = list(common.make_dataset(info, "calib", n_calib))
    evals = list(common.make_dataset(info, "eval", n_eval))
    ref = common.ort_outputs(common.ort_session(info.path, threads=2), evals)
    return info, mod, params, calib, evals, ref


def margin(ref_map, thresh=0.3):
    m = ref_map.ravel()
    text = m > thresh
    return {
        "text_px": int(text.sum()),
        "in_0.3-0.35": int(np.sum(text & (m < 0.35))),
        "in_0.3-0.5": int(np.sum(text & (m < 0.5))),
        "median_text_p": float(np.median(m[text])) if text.any() else None,
        "below_0.3_above_0.25": int(np.sum((m <= thresh) & (m > 0.25))),
    }


ROWS = {
    "default": ({}, "autoq defaults (mse, GPTQ)"),
    "ebc": ({"empirical_bias_correction": True}, "+ empirical bias correction"),
    "percentile": ({"calibrator": "percentile"}, "percentile calibrator (99.99)"),
    "max": ({"calibrator": "max"}, "max calibrator"),
    "calib+": ({"extra_images": True}, "calibration crops of 5 more photos"),
    "calib+ebc": ({"extra_images": True, "empirical_bias_correction": True}, "both"),
    "stem16": ({"int16": ("conv2d_0.w_0",)}, "the stem conv's output int16 (1 layer above int8)"),
    "stem16+ebc": (
        {"int16": ("conv2d_0.w_0",), "empirical_bias_correction": True},
        "stem conv output int16 + EBC",
    ),
    "dw16+ebc": (
        {"int16": ("autoq.hardswish_1",), "empirical_bias_correction": True},
        "the first depthwise conv's input int16 + EBC (1 layer above int8)",
    ),
    "percentile+ebc": (
        {"calibrator": "percentile", "empirical_bias_correction": True},
        "percentile + EBC",
    ),
    "calib+percentile+ebc": (
        {"extra_images": True, "calibrator": "percentile", "empirical_bias_correction": True},
        "80 calibration crops + percentile + EBC",
    ),
    "pe": (
        {"calibrator": "percentile", "empirical_bias_correction": True, "lut_input_ranges": True},
        "the PP-OCR recipe: percentile + EBC + lookup-input cuts",
    ),
    "pe_stem16": (
        {
            "calibrator": "percentile",
            "empirical_bias_correction": True,
            "lut_input_ranges": True,
            "int16": ("conv2d_0.w_0",),
        },
        "the recipe + the stem conv's output int16",
    ),
    "three": ({"unfused": True}, "without the activation_affine patterns (old default)"),
    "three+ebc": ({"unfused": True, "empirical_bias_correction": True}, "old default + EBC"),
}


def row_config(name):
    import autoq
    from autoq.ir.registry import PATTERNS, load_patterns

    load_patterns()
    opts = dict(ROWS[name][0])
    opts.pop("extra_images", None)
    if opts.pop("unfused", None):
        opts["patterns"] = tuple(n for n, p in PATTERNS.items() if p.default and "_affine" not in n)
    if "int16" in opts:
        opts["int16_tensors"] = opts.pop("int16")
    cal = opts.pop("calibrator", None)
    cfg = autoq.Config(progress=False, **opts)
    if cal is not None:
        cfg = cfg.replace(activation=autoq.QuantSpec(dtype="int8", calibrator=cal))
    return cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", type=int, default=40)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--det-size", type=int, default=480)
    ap.add_argument("--image", type=int, default=18)
    ap.add_argument("--rows", nargs="*", default=["default"], choices=list(ROWS))
    ap.add_argument("--diagnose", action="store_true", help="per-slot table of --image")
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument(
        "--ebc-drop",
        action="store_true",
        help="image --image with the first row's bias corrections dropped, by layer prefix",
    )
    ap.add_argument(
        "--posthoc", help="row whose saved qparams get the lookup-input cuts (no calibration)"
    )
    args = ap.parse_args(argv)
    import autoq
    from autoq.ir.matching import as_matched

    print(common.machine_summary(), flush=True)
    info, mod, params, calib, evals, ref = setup(args.calib, args.eval, args.det_size)
    i = args.image
    print("fp32 map margin, image", i, json.dumps(margin(ref[i])))
    CACHE.mkdir(exist_ok=True)
    if args.posthoc:
        return posthoc_cut(args.posthoc, mod, params, evals, ref, i)
    harness = {}
    extra = None
    for name in args.rows:
        cfg = row_config(name)
        key = (cfg.patterns, cfg.int16_tensors)
        if key not in harness:
            matched = as_matched(mod, params, cfg)
            harness[key] = SimHarness(matched, cfg, common.tvm_target())
            n_slots = len(harness[key].slots)
            print(f"compile {harness[key].compile_s:.0f} s, {n_slots} slots", flush=True)
        h = harness[key]
        matched = h.sim.matched
        data = calib
        if ROWS[name][0].get("extra_images"):
            if extra is None:
                extra = list(common.make_dataset(info, "calib", args.calib, extra=True))
            data = calib + extra
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qp = autoq.calibrate(autoq.simulate(matched, None, cfg), None, data, cfg)
        secs = time.perf_counter() - t0
        (CACHE / f"{name}_qparams.json").write_text(qp.dumps())
        outs = h.outputs(qp, evals)
        report_row(name, ref, outs, i, secs, len(data), qp.meta.get("scale_problems"))
        if args.diagnose and name == args.rows[0]:
            diagnose_image(h, qp, evals, i)
        if args.prefix and name == args.rows[0]:
            bisect_prefix(h, qp, evals[i], ref[i])
        if args.ebc_drop and name == args.rows[0]:
            drop_corrections(h, qp, evals, ref, i)


def posthoc_cut(name, mod, params, evals, ref, i):
    """The saved qparams of row ``name`` with every lookup-table input slot cut to its
    activation's live interval (:mod:`autoq.rules.lut_ranges`), everything else unchanged."""
    import autoq
    from autoq.rules.lut_ranges import cut, lut_input_bounds
    from autoq.ir.matching import as_matched

    cfg = row_config(name)
    h = SimHarness(as_matched(mod, params, cfg), cfg, common.tvm_target())
    qp = autoq.QParams.loads((CACHE / f"{name}_qparams.json").read_text())
    report_row(name, ref, h.outputs(qp, evals), i, 0, 0, None)
    bounds = lut_input_bounds(h.sim)
    new = {s: cut(qp[s], b, h.sim.plan.specs[s]) for s, b in bounds.items()}
    changed = {s: (float(qp[s].scale), float(q.scale)) for s, q in new.items() if q != qp[s]}
    print(f"cut {len(changed)} of {len(bounds)} lookup inputs: {changed}", flush=True)
    report_row(name + "+cut", ref, h.outputs(qp.replace(**new), evals), i, 0, 0, None)


def report_row(name, ref, outs, i, secs, n_calib, problems):
    f = common.fidelity("detector", ref, outs)
    rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], outs[:i] + outs[i + 1 :])
    v, a, b = iou(ref[i], outs[i])
    print(
        f"ROW {name}: IoU@0.3 {100 * f['agree']:.1f}% cos {f['cos']:.4f} cos_min "
        f"{f['cos_min']:.4f}; without image {i}: {100 * rest['agree']:.1f}%; image {i}: IoU "
        f"{v:.3f} ({b} px vs {a}); {n_calib} calibration samples, calibrate {secs:.0f} s; "
        f"scale problems: {problems or 'none'}",
        flush=True,
    )
    per = [round(iou(r, o)[0], 3) for r, o in zip(ref, outs, strict=True)]
    print(f"  per image IoU: {per}", flush=True)


def diagnose_image(h, qparams, evals, i, others=7):
    """Per slot: image ``i`` against the first ``others`` other evaluation images."""
    rows = {}
    pick = [k for k in range(len(evals)) if k != i][:others]
    evals = [evals[i]] + [evals[k] for k in pick]
    i = 0
    for s in evals:
        _, fp = h.fp32(s)
        _, q = h.diag(qparams, s)
        for sid in h.pre_slots:
            qp = qparams[sid]
            s_, z_ = float(qp.scale), int(qp.zero_point)
            lo, hi = (qp.qmin - z_) * s_, (qp.qmax - z_) * s_
            x = fp[sid]
            r = rows.setdefault(sid, {"sqnr": [], "clip": [], "lo": [], "hi": []})
            r["sqnr"].append(sqnr(x, q[sid]))
            r["clip"].append(float(np.mean((x < lo) | (x > hi))))
            r["lo"].append(float(x.min()))
            r["hi"].append(float(x.max()))
            r["range"] = (lo, hi)
    print("\nper slot, the image vs the other images (median)")
    print("slot | calib range | img range | others' max hi | clip img | SQNR img | SQNR others")
    for sid, r in rows.items():
        others = [v for k, v in enumerate(r["sqnr"]) if k != i]
        ohi = max(v for k, v in enumerate(r["hi"]) if k != i)
        print(
            f"{sid} | [{r['range'][0]:.3g}, {r['range'][1]:.3g}] | [{r['lo'][i]:.3g}, "
            f"{r['hi'][i]:.3g}] | {ohi:.3g} | {r['clip'][i]:.4f} | {r['sqnr'][i]:.2f} | "
            f"{np.median(others):.2f}"
        )
    np.save(CACHE / "slot_sqnr.npy", {k: v for k, v in rows.items()}, allow_pickle=True)


def drop_corrections(h, qparams, evals, ref, i, singles=8):
    """Which layer's bias correction changes image ``i``: its IoU (and the whole set's)
    with the corrections (``QParams.values`` ``<layer>.bias``) of the first k corrected
    layers dropped (the model's float bias back; the tuned weights stay), then with each
    of the first ``singles`` corrected layers' dropped alone. Diagnosis only: choosing
    layers by this would fit the evaluation image."""
    import autoq

    corrected = [x for x in h.layers if f"{x}.bias" in qparams.values]

    def without(layers):
        drop = {f"{x}.bias" for x in layers}
        values = {k: v for k, v in qparams.values.items() if k not in drop}
        return autoq.QParams(dict(qparams.params), dict(qparams.slots), qparams.meta, values)

    def show(label, layers, everything=False):
        qp = without(layers)
        v, _, b = iou(ref[i], h.outputs(qp, [evals[i]])[0])
        line = f"  {label}: image {i} IoU {v:.3f} ({b} px)"
        if everything:
            f = common.fidelity("detector", ref, h.outputs(qp, evals))
            line += f"; all {100 * f['agree']:.1f}%"
        print(line, flush=True)

    n = len(corrected)
    print(f"{n} corrected layers; first: {corrected[:singles]}", flush=True)
    for k in sorted({0, 1, 2, 3, 4, 6, 8, n // 8, n // 4, n // 2, n}):
        show(f"corrections of the first {k} dropped", corrected[:k], everything=k in (1, 2, n))
    for x in corrected[:singles]:
        show(f"only {x}'s dropped", [x])


def bisect_prefix(h, qparams, sample, ref):
    """The image's IoU with only the first k layers quantized (the rest fp32): a coarse
    curve, then the smallest k whose IoU falls below half of the all-fp32 one (binary
    search), then the IoU with each layer around it alone left in fp32."""
    n = len(h.layers)

    def score(k=None, only=None):
        dis = h.layers[k:] if only is None else [only]
        return iou(ref, h.outputs(qparams, [sample], disabled=dis)[0])

    for k in (0, n // 8, n // 4, 3 * n // 8, n // 2, 5 * n // 8, 3 * n // 4, 7 * n // 8, n):
        v, _, b = score(k)
        print(f"  first {k} layers quantized: IoU {v:.3f} ({b} px)", flush=True)
    lo, hi = 0, n  # score(lo) good, score(hi) bad
    if score(n)[0] >= 0.5:
        return
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if score(mid)[0] >= 0.5:
            lo = mid
        else:
            hi = mid
    print(f"  collapse when layer {hi - 1} ({h.layers[hi - 1]}) is quantized too", flush=True)
    for j in range(max(0, hi - 6), min(n, hi + 3)):
        v, _, b = score(only=h.layers[j])
        print(f"  all int8 but {h.layers[j]} fp32: IoU {v:.3f} ({b} px)", flush=True)


if __name__ == "__main__":
    main()
