"""PP-OCRv4 det under issue 16's budget (text-map IoU@0.3 >= 97% with at most 3 layers
above int8): the depthwise_cnn recipe and its parts, realized, against ONNX Runtime.

Every row is the *realized* module (``autoq.Quantizer`` -> int8 Relax module compiled by
TVM) against ONNX Runtime fp32 (graph optimizations off) on the evaluation crops, with and
without evaluation image ``--image`` (18: a text-free crop whose confident fp32
false-positive blob every int8 model tends to erase, which alone costs ~1.6 IoU points).

Data: ``--calib`` calibration crops (the photos of ``common.CALIB_IMAGES``, ``--calib-seed``;
draw another seed to see how much a row owes to one draw), and crops of the *same
calibration photos* with other seeds that calibration never sees: ``--gate`` crops for the
empirical bias correction's held-out gate (``BiasCorrection.holdout``, seed 7) and
``--search`` crops (seed 11) on which the automatic fallback rows choose their layers
(``MapIoU``: IoU@0.3 against ONNX Runtime's fp32 maps of those crops; the held-out
output-SQNR check of ``AutoFallback.holdout`` runs on them too). The evaluation crops (other
photos) choose nothing.

Rows (``--rows``; default ``default p_lut_pcdw``):

* ``default``: autoq's defaults;
* ``p_lut``: percentile (99.99) activation ranges + lookup-input range cuts
  (rule ``lookup_input_ranges``); ``p_lut_pclut``: + the lookups' inputs per channel
  (``lookup_per_channel``); ``p_lut_pcdw``: + the depthwise convs' inputs per
  channel (``depthwise_per_channel``): **the depthwise_cnn recipe**;
* ``pe``: ``p_lut`` + empirical bias correction (``pe_pclut``, ``pe_pcdw`` the same ladder;
  ``pe_gate``: with its held-out gate on the ``--gate`` crops; ``pe_p99.9`` /
  ``pe_p99.999``: other percentiles);
* ``pe_first3`` / ``pe_tensors3``: ``pe`` + ``AutoFallback`` (``int16_first`` with the local
  ranking / ``int16_tensors``), at most 3 layers / tensors above int8, chosen by ``MapIoU``
  on the search crops.

``--latency N``: after the rows, each row's module compiled with the CPU kernels and timed
N times, the rows in turn (ratios against the first ONNX Runtime row when there is one,
else the first row).

``--ort minmax percentile ...``: ONNX Runtime ``quantize_static`` rows in the same run (the
peer: QDQ, per-channel int8 weights, uint8 activations, on the same calibration crops),
scored on the same evaluation crops with ORT's integer kernels (graph optimizations on, 2
threads); with ``--latency`` they are timed in turn with the autoq rows (idle ORT threads
sleep, so they take no core from the row timed next).

    python benchmarks/ppocr_budget.py                                  # ~10 min
    python benchmarks/ppocr_budget.py --rows default p_lut_pcdw --ort minmax --latency 20
    python benchmarks/ppocr_budget.py --calib-seed 3 --rows p_lut_pcdw pe pe_gate pe_first3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


class MapIoU:
    """``AutoFallback.metric``: IoU@``thresh`` of the maps ``run(samples)`` returns against
    ``reference`` (ONNX Runtime fp32 maps of the same samples), intersections and unions
    summed over the set (``common.fidelity``'s detector metric)."""

    def __init__(self, samples, reference, thresh: float = 0.3):
        self.samples, self.reference, self.thresh = list(samples), list(reference), thresh
        self.__name__ = f"IoU@{thresh:g} on {len(self.samples)} search crops"

    def __call__(self, run) -> float:
        outs = [o[0] if isinstance(o, list | tuple) else o for o in run(self.samples)]
        return common.fidelity("detector", self.reference, outs, self.thresh)["agree"]


CUTS = ("lookup_input_ranges",)
PCLUT = (*CUTS, "lookup_per_channel")
PCDW = (*PCLUT, "depthwise_per_channel")


def recipe(percentile: float = 99.99, ebc: bool = True, rules=CUTS, holdout: int = 0, **changes):
    """Variants of the PP-OCRv4 det recipe: percentile activation ranges, the ``rules``
    (default: lookup-input range cuts), empirical bias correction (``ebc``, gated on
    ``holdout`` held-out crops). ``recipe(ebc=False, rules=PCDW)`` is autoq's
    ``depthwise_cnn`` recipe with the percentile calibrator instead of mse."""
    import autoq
    from autoq.calibrators.percentile import Percentile

    act = autoq.QuantSpec(dtype="int8", calibrator=Percentile(percentile=percentile))
    bc = autoq.BiasCorrection(holdout=holdout) if ebc else None
    return autoq.Config(recipe="cnn", activation=act, rules=rules, bias_correction=bc, **changes)


def rows(metrics: dict, n_extra: dict) -> dict:
    """Row name -> (Config, extra data: None / "gate" / "search", what). ``metrics``: the
    MapIoU of the "search" set; ``n_extra``: the sizes of the extra sets."""
    import autoq

    def auto(precision, **kw):
        fb = autoq.AutoFallback(
            metric=metrics["search"], max_drop=0.0, max_fp32_layers=3,
            holdout=n_extra["search"], precision=precision, **kw,
        )  # fmt: skip
        return recipe(fallback=fb)

    return {
        "default": (autoq.Config(), None, "autoq's default (recipe auto: depthwise_cnn here)"),
        "cnn": (
            autoq.Config(recipe="cnn"),
            None,
            "the cnn recipe (autoq's default before recipes)",
        ),
        "p_lut": (recipe(ebc=False), None, "percentile + lookup-input cuts"),
        "p_lut_pclut": (recipe(ebc=False, rules=PCLUT), None, "p_lut + per-channel lookup inputs"),
        "p_lut_pcdw": (
            recipe(ebc=False, rules=PCDW),
            None,
            "p_lut_pclut + per-channel depthwise inputs",
        ),
        "depthwise_cnn": (
            autoq.Config(recipe="depthwise_cnn"),
            None,
            "the depthwise_cnn recipe: p_lut_pcdw with the mse calibrator",
        ),
        "pe": (recipe(), None, "percentile + EBC + lookup-input cuts"),
        "pe_pclut": (recipe(rules=PCLUT), None, "pe + per-channel lookup inputs"),
        "pe_pcdw": (recipe(rules=PCDW), None, "pe_pclut + per-channel depthwise inputs"),
        "pe_gate": (
            recipe(holdout=8),
            "gate",
            "pe + EBC held-out gate (8 more crops of the calibration photos)",
        ),
        "pe_p99.9": (recipe(99.9), None, "pe with percentile 99.9"),
        "pe_p99.999": (recipe(99.999), None, "pe with percentile 99.999"),
        "pe_first3": (
            auto("int16_first", ranking="local"),
            "search",
            "pe + AutoFallback int16_first (local ranking), <= 3 layers, MapIoU on search crops",
        ),
        "pe_tensors3": (
            auto("int16_tensors", max_int16_fraction=3.5 / 127),  # 3 of the 127 tensors
            "search",
            "pe + AutoFallback int16_tensors, <= 3 tensors, MapIoU on search crops",
        ),
    }


def above_int8(res) -> list[str]:
    """The layers / tensors the realized config keeps above int8 (fp32 layers, int16
    tensors, layers with int16 activation overrides)."""
    out = [f"{k} (fp32: {v})" for k, v in sorted(res.fp32_layers.items())]
    out += [f"{t} (int16 tensor)" for t in res.config.int16_tensors]
    out += [
        f"{o.match} (int16 activations)"
        for o in res.config.overrides
        if o.activation is not None and o.activation.dtype == "int16"
    ]
    return out


load = common.load_average


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.ppocr_data_args(ap)
    ap.add_argument("--gate", type=int, default=8)
    ap.add_argument("--rows", nargs="*", default=["default", "cnn", "p_lut_pcdw"])
    ap.add_argument(
        "--latency",
        type=int,
        default=0,
        help="timed runs per row (autoq.compile with the CPU kernels, rows interleaved)",
    )
    ap.add_argument(
        "--ort",
        nargs="*",
        default=[],
        choices=common.ORT_METHODS,
        help="ONNX Runtime quantize_static rows (QDQ, per-channel int8 weights, uint8 "
        "activations) on the same calibration crops, scored on the same evaluation crops",
    )
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    import autoq

    print(common.machine_summary(), flush=True)
    info = common.find_model("ppocr_det", det_size=args.det_size)
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    calib = list(common.make_dataset(info, "calib", args.calib, seed=args.calib_seed))
    evals = list(common.make_dataset(info, "eval", args.eval))
    sess = common.ort_session(info.path, threads=2)
    ref = common.ort_outputs(sess, evals)
    extra = {
        "gate": list(common.make_dataset(info, "calib", args.gate, seed=7)),
        "search": list(common.make_dataset(info, "calib", args.search, seed=11)),
    }
    metrics = {k: MapIoU(v, common.ort_outputs(sess, v)) for k, v in extra.items() if v}
    table = rows(metrics, {k: len(v) for k, v in extra.items()})
    unknown = [r for r in args.rows if r not in table]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(table)}")
    modules, summary = {}, []
    for name in args.rows:
        modules[name], cells = run_row(
            name, table[name], (mod, params), calib, extra, (evals, ref, metrics), info, args.image
        )
        summary.append(cells)
    with tempfile.TemporaryDirectory(prefix="ppocr-ort-") as tmp:
        for method in args.ort:
            path = Path(tmp) / f"ort_{method}.onnx"
            try:
                modules[f"ORT {method}"], cells = ort_row(
                    method, info, calib, path, (evals, ref), args.image
                )
                summary.append(cells)
            except common.SubprocessFailed as err:  # e.g. ORT's histograms above the RSS limit
                print(f"ROW ORT {method}: FAILED: {err}", flush=True)
                summary.append([f"ORT {method}", f"FAILED: {err}", *[""] * 6])
        i = args.image
        print(f"\n### PP-OCRv4 det {args.det_size}x{args.det_size}, realized rows\n")
        print(
            common.markdown_table(
                ["row", "IoU@0.3", "cos", f"without eval image {i}", f"image {i}",
                 "search crops", "above int8", "quantize s"],
                summary,
            )
        )  # fmt: skip
        print(
            f"\n{len(calib)} calibration crops (seed {args.calib_seed}) / {len(evals)} evaluation "
            f"crops (other photos); search crops: {len(extra['search'])} held-out crops of the "
            "calibration photos; IoU@0.3 of the text maps against ONNX Runtime fp32 (graph "
            "optimizations off); ORT rows: quantize_static QDQ, per-channel int8 weights, uint8 "
            "activations, run with graph optimizations on."
        )
        if args.latency:
            interleaved_latency(modules, evals[0], args.latency)


def interleaved_latency(modules: dict, sample: dict, runs: int) -> None:
    """Median ms of each row's int8 module (``autoq.compile``, CPU kernels, all cores),
    the rows run in turn ``runs`` times (load shifts hit every row alike); ratios against
    the first ONNX Runtime row of the run if there is one, else the first row."""
    import tvm
    from tvm import relax

    import autoq

    calls = {}
    for name, mod in modules.items():
        if isinstance(mod, Path):  # an ORT int8 model: 2 threads, fused, idle threads sleep
            sess = common.ort_session(mod, threads=2, optimize=True, spinning=False)
            calls[name] = lambda sess=sess: sess.run(None, sample)
        else:
            vm = relax.VirtualMachine(autoq.compile(mod, autoq.build.default_target()), tvm.cpu())
            args = [tvm.runtime.tensor(np.ascontiguousarray(v)) for v in sample.values()]
            calls[name] = lambda vm=vm, args=args: vm["main"](*args)
        calls[name]()  # warm-up
    times: dict = {name: [] for name in calls}
    l0 = load()
    for _ in range(runs):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(1e3 * (time.perf_counter() - t0))
    ref = next((name for name in times if name.startswith("ORT ")), next(iter(times)))
    first = float(np.median(times[ref]))
    print(f"\n### Latency, batch 1, {runs} interleaved runs (load {l0} -> {load()})\n")
    cells = []
    for name, ts in times.items():
        med = float(np.median(ts))
        cells.append([name, f"{med:.2f}", f"{min(ts):.2f}", f"{med / first:.3f}x"])
    print(common.markdown_table(["row", "median ms", "min ms", f"vs {ref}"], cells))


def ort_row(method: str, info, calib, path: Path, evaluation, i: int) -> tuple[Path, list]:
    """ONNX Runtime's ``quantize_static`` (``method``) on the calibration crops, its int8
    model (graph optimizations on: ORT's integer kernels, 2 threads) scored like a row:
    (the model's path, the summary table's cells)."""
    l0 = load()
    res = common.ort_quantize(info, calib, method, path)
    evals, ref = evaluation
    outs = common.ort_outputs(common.ort_session(path, threads=2, optimize=True), evals)
    f = common.fidelity("detector", ref, outs)
    rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], outs[:i] + outs[i + 1 :])
    one = common.fidelity("detector", [ref[i]], [outs[i]])
    print(
        f"ROW ORT {method} (quantize_static QDQ, per-channel int8 weights, uint8 activations, "
        f"graph optimizations on): IoU@0.3 {100 * f['agree']:.1f}% cos {f['cos']:.4f}; "
        f"without image {i}: {100 * rest['agree']:.1f}%; image {i}: {one['agree']:.3f}; "
        f"quantize {res['calib_s']:.0f} s; load {l0} -> {load()}; {len(calib)} samples",
        flush=True,
    )
    cells = [f"ORT {method}", f"{100 * f['agree']:.1f}%", f"{f['cos']:.4f}",
             f"{100 * rest['agree']:.1f}%", f"{one['agree']:.3f}", "", "", f"{res['calib_s']:.0f}"]  # fmt: skip
    return path, cells


def run_row(name, row, model, calib, extra, evaluation, info, i) -> tuple[object, list]:
    """Quantize, realize and score one row: (its int8 module, the summary table's cells)."""
    import autoq

    cfg, more, what = row
    data = calib + (extra[more] if more else [])
    l0, t0 = load(), time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = autoq.Quantizer(cfg).run(*model, data)
    secs = time.perf_counter() - t0
    evals, ref, metrics = evaluation
    runner = common.TvmRunner(res.module, list(info.input_shapes))
    outs = [runner.run(s) for s in evals]
    searched = metrics["search"](lambda samples: [runner.run(s) for s in samples])
    f = common.fidelity("detector", ref, outs)
    rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], outs[:i] + outs[i + 1 :])
    one = common.fidelity("detector", [ref[i]], [outs[i]])
    up = above_int8(res)
    print(
        f"ROW {name} ({what}): realized IoU@0.3 {100 * f['agree']:.1f}% cos {f['cos']:.4f}; "
        f"without image {i}: {100 * rest['agree']:.1f}%; image {i}: {one['agree']:.3f}; "
        f"search crops (held-out calibration photos) {100 * searched:.1f}%; "
        f"{len(up)} above int8: {up or '-'}; quantize {secs:.0f} s; load {l0} -> {load()}; "
        f"{len(data)} samples",
        flush=True,
    )
    if res.decision is not None:
        print("  decision:", res.decision.summary().replace("\n", "\n  "), flush=True)
    tuning = res.qparams.meta.get("weight_tuning") or {}
    print(f"  weight tuning: { {k: v for k, v in tuning.items() if 'errors' not in k} }")
    per = [
        round(common.fidelity("detector", [r], [o])["agree"], 3)
        for r, o in zip(ref, outs, strict=True)
    ]
    print(f"  per image IoU: {per}", flush=True)
    for w in caught:
        print(f"  warning: {str(w.message)[:300]}")
    cells = [name, f"{100 * f['agree']:.1f}%", f"{f['cos']:.4f}", f"{100 * rest['agree']:.1f}%",
             f"{one['agree']:.3f}", f"{100 * searched:.1f}%", "; ".join(up) or "0",
             f"{secs:.0f}"]  # fmt: skip
    return res.module, cells


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
