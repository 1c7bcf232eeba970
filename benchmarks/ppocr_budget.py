"""PP-OCRv4 det under issue 16's budget (text-map IoU@0.3 >= 97% with at most 3 layers
above int8): every row is the *realized* module (``autoq.Quantizer`` -> int8 Relax module
compiled by TVM) against ONNX Runtime fp32 (graph optimizations off) on the evaluation
crops, with and without evaluation image 18 (a text-free crop whose confident fp32
false-positive blob the int8 stem erases; see benchmarks/results/ppocr_det_diagnosis.md).

Data: ``--calib`` calibration crops (the photos of ``common.CALIB_IMAGES``, seed 0), and
crops of the *same calibration photos* with other seeds that calibration never sees:
``--gate`` crops for ``Config.bias_correction_holdout`` (seed 7) and ``--search`` crops
(seed 11) on which the automatic escalation rows choose their layers (``MapIoU``: IoU@0.3
against ONNX Runtime's fp32 maps of those crops; the held-out output-SQNR check of
``AutoFallback.holdout`` runs on them too). The evaluation crops (other photos) choose
nothing.

``--fp K`` (rows ``*_fp``): the search crops plus up to K *text-free* crops of the
calibration photos on which the fp32 model marks text anyway (a false positive like the one
of evaluation image 18, which the int8 stem tends to erase), so a search can see that
failure mode. Selection (:func:`false_positive_crops`, fp32 output only, no quantized model
and no evaluation crop involved): ``--fp-pool`` crops of the calibration photos (seed 13)
with no rendered text; photos that show real print (``page``, ``logo``, ``clock``,
``FP_EXCLUDED``) are skipped; a crop qualifies when its ONNX Runtime fp32 map has at least
``--fp-min-pixels`` pixels above 0.3 whose median probability is >= 0.9 (a confident blob,
not a borderline speck); the K with the most such pixels are taken. Row ``pe_calfp``
calibrates on K more such crops, chosen by the same rule from another pool (seed 17).

Rows ``p_lut_first3_fp`` / ``p_lut_pclut_first3_fp``: bias correction off, the int16
escalation on the search + false-positive crops with ``AutoFallback.first_tensors=3`` (the
model input, the stem output and the next tensor join the lowest-own-SQNR shortlist; a
rule fixed before any run, no evaluation crop involved), at most 3 tensors int16. Rows
``p_lut_effect_fp`` / ``p_lut_pclut_effect_fp``: the same with
``AutoFallback.shortlist="effect"`` instead (every tensor screened alone int16 by the
search metric; 127 more trials).

``--int16 T..`` / ``--fp32 L..`` (rows ``pe_int16`` / ``pe_fp32``, and ``pe_pclut_int16``,
``p_lut_int16``, ``p_lut_pclut_int16``):
the recipe with those activation tensors int16 / layers fp32, for the sets
``benchmarks/ppocr_img18.py`` finds on evaluation image 18: a diagnosis, never a recipe.

``--latency N``: after the rows, each row's module compiled with the CPU kernels and timed
N times, the rows in turn (ratios against the first row).

``--ort minmax percentile ...``: ONNX Runtime ``quantize_static`` rows in the same run (the
peer: QDQ, per-channel int8 weights, uint8 activations, on the same calibration crops),
scored on the same evaluation crops with ORT's integer kernels (graph optimizations on, 2
threads); with ``--latency`` they are timed in turn with the autoq rows (idle ORT threads
sleep, so they take no core from the row timed next).

    python benchmarks/ppocr_budget.py --rows pe pe_gate pe_first3
    python benchmarks/ppocr_budget.py --rows pe pe_pclut --latency 20
    python benchmarks/ppocr_budget.py --rows p_lut_pclut p_lut_pcdw --latency 20
    python benchmarks/ppocr_budget.py --rows p_lut_pcdw --ort minmax percentile --latency 20
    python benchmarks/ppocr_budget.py --fp 4 --rows pe_first3_fp pe_tensors3_fp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

STEM_OUT = "conv2d_0.w_0"  # the stem conv's output slot (and the stem conv's layer id)
STEM_READER = "conv2d_394.w_0"  # the layer that reads it
FP_EXCLUDED = ("page", "logo", "clock")  # calibration photos with real print on them
FP_SEED = 13  # seed of the candidate text-free crops (calibration 0.., gate 7, search 11)
FP_CALIB_SEED = 17  # another pool: false-positive crops added to the calibration crops
EARLY3 = ("conv2d_0.w_0", "conv2d_394.w_0", "autoq.hardswish_0")  # first 3 after the input


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


#: the 24 convs of PP-OCRv4 det whose output only a hardswish table reads (the slots
#: Config.lut_input_per_channel makes per channel; printed by autoq.simulate at 480x480)
PCLUT_CONVS = tuple(
    f"conv2d_{k}.w_0"
    for k in (394, 395, 397, 398, 399, 401, 402, 403, *range(405, 414), *range(415, 422))
)


def recipe(percentile: float = 99.99, **changes):
    """The PP-OCRv4 det recipe (a per-model Config, not autoq's default): percentile
    (99.99) activation ranges, empirical bias correction, lookup-input range cuts."""
    import autoq
    from autoq.calibrators.percentile import Percentile

    base = autoq.Config(
        progress=False,
        activation=autoq.QuantSpec(dtype="int8", calibrator=Percentile(percentile=percentile)),
        empirical_bias_correction=True,
        lut_input_ranges=True,
    )
    return base.replace(**changes)


def false_positive_crops(
    info, sess, pool: int, k: int, min_pixels: int, seed: int = FP_SEED
) -> tuple[list, list]:
    """Up to ``k`` text-free crops of the calibration photos on which the fp32 model
    (``sess``) marks a confident blob: the selection rule of the module docstring. Returns
    (samples, one description line per candidate that qualified, the chosen ones first)."""
    cands = common.make_dataset(info, "calib", pool, seed=seed, text=False)
    maps = common.ort_outputs(sess, cands)
    scored = []
    for i, m in enumerate(maps):
        photo = common.CALIB_IMAGES[i % len(common.CALIB_IMAGES)]
        marked = m[m > 0.3]
        if photo in FP_EXCLUDED or marked.size < min_pixels or np.median(marked) < 0.9:
            continue
        scored.append((marked.size, i, photo, float(np.median(marked))))
    scored.sort(reverse=True)
    lines = [f"candidate {i} ({p}): {n} px > 0.3, median {med:.4f}" for n, i, p, med in scored]
    return [cands[i] for _, i, _, _ in scored[:k]], lines


def rows(metrics: dict, n_extra: dict, int16=(), fp32=()) -> dict:
    """Row name -> (Config, extra data: None / "gate" / "search" / "search_fp", what).
    ``metrics``: the MapIoU of the "search" and "search_fp" sets; ``n_extra``: their sizes;
    ``int16`` / ``fp32``: the tensors / layers of the diagnosis rows (``--int16``, ``--fp32``)."""
    import autoq

    fixed = autoq.Fallback(ids=tuple(fp32))

    def auto(precision, on="search", ebc=True, pclut=False, **kw):
        fb = autoq.AutoFallback(
            metric=metrics[on], max_drop=0.0, max_fp32_layers=3, holdout=n_extra[on],
            precision=precision, **kw,
        )  # fmt: skip
        return recipe(fallback=fb, empirical_bias_correction=ebc, lut_input_per_channel=pclut)

    budget3 = {"max_int16_fraction": 3.5 / 127}  # 3 of PP-OCR det's 127 activation tensors
    first3 = {**budget3, "first_tensors": 3}

    return {
        "default": (autoq.Config(progress=False), None, "autoq defaults"),
        "pe": (recipe(), None, "percentile + EBC + lookup-input cuts"),
        "pe_pclut": (
            recipe(lut_input_per_channel=True),
            None,
            "pe + per-channel lookup inputs (Config.lut_input_per_channel)",
        ),
        "p_lut": (
            recipe(empirical_bias_correction=False),
            None,
            "percentile + lookup-input cuts (pe without bias correction)",
        ),
        "p_lut_pclut": (
            recipe(empirical_bias_correction=False, lut_input_per_channel=True),
            None,
            "p_lut + per-channel lookup inputs",
        ),
        "p_lut_pcdw": (
            recipe(
                empirical_bias_correction=False,
                lut_input_per_channel=True,
                depthwise_input_per_channel=True,
            ),
            None,
            "p_lut_pclut + per-channel depthwise inputs (Config.depthwise_input_per_channel)",
        ),
        "pe_pcdw": (
            recipe(lut_input_per_channel=True, depthwise_input_per_channel=True),
            None,
            "pe_pclut + per-channel depthwise inputs (Config.depthwise_input_per_channel)",
        ),
        "pe_gate_pclut": (
            recipe(bias_correction_holdout=8, lut_input_per_channel=True),
            "gate",
            "pe_gate + per-channel lookup inputs",
        ),
        "pe_pclut_skip": (
            recipe(lut_input_per_channel=True, bias_correction_skip=PCLUT_CONVS),
            None,
            "pe_pclut, no bias correction on the 24 convs writing a per-channel lookup input",
        ),
        "pe_int16": (
            recipe(int16_tensors=tuple(int16)),
            None,
            "pe + the --int16 tensors int16 (diagnosis of evaluation image 18)",
        ),
        "pe_pclut_int16": (
            recipe(int16_tensors=tuple(int16), lut_input_per_channel=True),
            None,
            "pe_pclut + the --int16 tensors int16 (diagnosis of evaluation image 18)",
        ),
        "p_lut_int16": (
            recipe(int16_tensors=tuple(int16), empirical_bias_correction=False),
            None,
            "p_lut + the --int16 tensors int16 (diagnosis of evaluation image 18)",
        ),
        "p_lut_pclut_int16": (
            recipe(
                int16_tensors=tuple(int16),
                empirical_bias_correction=False,
                lut_input_per_channel=True,
            ),
            None,
            "p_lut_pclut + the --int16 tensors int16 (diagnosis of evaluation image 18)",
        ),
        "pe_fp32": (
            recipe(fallback=fixed),
            None,
            "pe + the --fp32 layers fp32 (diagnosis of evaluation image 18)",
        ),
        "pe_p99.9": (recipe(99.9), None, "pe with percentile 99.9"),
        "pe_p99.999": (recipe(99.999), None, "pe with percentile 99.999"),
        "pe_gate": (
            recipe(bias_correction_holdout=8),
            "gate",
            "pe + EBC held-out gate (8 more crops of the calibration photos)",
        ),
        "pe_stem16": (recipe(int16_tensors=(STEM_OUT,)), None, "pe + stem output int16"),
        "pe_stem16_skip": (
            recipe(int16_tensors=(STEM_OUT,), bias_correction_skip=(STEM_OUT, STEM_READER)),
            None,
            "pe + stem output int16, no bias correction on its writer and reader",
        ),
        "pe_first3": (
            auto("int16_first", ranking="local"),
            "search",
            "pe + AutoFallback int16_first (local ranking), <= 3 layers, MapIoU on search crops",
        ),
        "pe_tensors3": (
            auto("int16_tensors", max_int16_fraction=3.5 / 127),
            "search",
            "pe + AutoFallback int16_tensors, <= 3 tensors, MapIoU on search crops",
        ),
        "pe_calfp": (
            recipe(),
            "calib_fp",
            "pe calibrated on the calibration crops + false-positive crops of another pool",
        ),
        "pe_early3": (
            recipe(int16_tensors=EARLY3),
            None,
            "pe + the first three tensors after the input int16 (stem, depthwise, hardswish)",
        ),
        "p_lut_tensors3_fp": (
            auto("int16_tensors", on="search_fp", ebc=False, max_int16_fraction=3.5 / 127),
            "search_fp",
            "p_lut + AutoFallback int16_tensors, <= 3 tensors, on search + false-positive crops",
        ),
        "p_lut_first3_fp": (
            auto("int16_tensors", on="search_fp", ebc=False, **first3),
            "search_fp",
            "p_lut_tensors3_fp + AutoFallback.first_tensors=3 (the first three tensors join "
            "the shortlist)",
        ),
        "p_lut_pclut_first3_fp": (
            auto("int16_tensors", on="search_fp", ebc=False, pclut=True, **first3),
            "search_fp",
            "p_lut_first3_fp + per-channel lookup inputs (their slots escalable too)",
        ),
        "p_lut_effect_fp": (
            auto("int16_tensors", on="search_fp", ebc=False, shortlist="effect", **budget3),
            "search_fp",
            "p_lut_tensors3_fp with AutoFallback.shortlist='effect' (every tensor screened "
            "alone int16 on the search + false-positive crops)",
        ),
        "p_lut_pclut_effect_fp": (
            auto(
                "int16_tensors",
                on="search_fp",
                ebc=False,
                pclut=True,
                shortlist="effect",
                **budget3,
            ),
            "search_fp",
            "p_lut_effect_fp + per-channel lookup inputs",
        ),
        "p_lut_pclut_tensors3_fp": (
            auto(
                "int16_tensors", on="search_fp", ebc=False, pclut=True, max_int16_fraction=3.5 / 127
            ),
            "search_fp",
            "p_lut_pclut_first3_fp without first_tensors (control)",
        ),
        "pe_first3_fp": (
            auto("int16_first", on="search_fp", ranking="local"),
            "search_fp",
            "pe_first3, searched on the search crops + the false-positive crops",
        ),
        "pe_tensors3_fp": (
            auto("int16_tensors", on="search_fp", max_int16_fraction=3.5 / 127),
            "search_fp",
            "pe_tensors3, searched on the search crops + the false-positive crops",
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


def commit() -> str:
    here = Path(__file__).resolve().parent
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=here, capture_output=True)
    return rev.stdout.decode().strip() + ("+dirty" if dirty.stdout.strip() else "")


START_COMMIT = "?"


def load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.ppocr_data_args(ap)
    ap.add_argument("--gate", type=int, default=8)
    ap.add_argument("--rows", nargs="*", default=["pe"])
    ap.add_argument("--fp", type=int, default=4, help="false-positive crops (rows *_fp)")
    ap.add_argument("--fp-pool", type=int, default=80, help="text-free candidate crops")
    ap.add_argument("--fp-min-pixels", type=int, default=300)
    ap.add_argument("--int16", nargs="*", default=[], help="tensors int16 in row pe_int16")
    ap.add_argument("--fp32", nargs="*", default=[], help="layers fp32 in row pe_fp32")
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
    args = ap.parse_args(argv)
    import autoq

    global START_COMMIT
    START_COMMIT = commit()  # the code this process runs (later commits do not change it)
    print(common.machine_summary(), "; commit", START_COMMIT, flush=True)
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
    fp, lines = false_positive_crops(info, sess, args.fp_pool, args.fp, args.fp_min_pixels)
    print(f"false-positive crops: {len(fp)} of {len(lines)} qualifying", flush=True)
    for line in lines:
        print("  " + line, flush=True)
    extra["fp"] = fp
    extra["search_fp"] = extra["search"] + fp
    extra["calib_fp"], lines = false_positive_crops(
        info, sess, args.fp_pool, args.fp, args.fp_min_pixels, FP_CALIB_SEED
    )
    print(f"false-positive calibration crops (seed {FP_CALIB_SEED}): {lines[: args.fp]}")
    metrics = {k: MapIoU(v, common.ort_outputs(sess, v)) for k, v in extra.items() if v}
    table = rows(metrics, {k: len(v) for k, v in extra.items()}, args.int16, args.fp32)
    unknown = [r for r in args.rows if r not in table]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(table)}")
    modules = {}
    for name in args.rows:
        modules[name] = run_row(
            name, table[name], (mod, params), calib, extra, (evals, ref, metrics), info, args.image
        )
    with tempfile.TemporaryDirectory(prefix="ppocr-ort-") as tmp:
        for method in args.ort:
            path = Path(tmp) / f"ort_{method}.onnx"
            try:
                modules[f"ORT {method}"] = ort_row(
                    method, info, calib, path, (evals, ref), args.image
                )
            except common.SubprocessFailed as err:  # e.g. ORT's histograms above the RSS limit
                print(f"ROW ORT {method}: FAILED: {err}", flush=True)
        if args.latency:
            interleaved_latency(modules, evals[0], args.latency)


def interleaved_latency(modules: dict, sample: dict, runs: int) -> None:
    """Median ms of each row's int8 module (``autoq.compile``, CPU kernels, all cores),
    the rows run in turn ``runs`` times (load shifts hit every row alike); ratios against
    the first row."""
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
    first = float(np.median(next(iter(times.values()))))
    for name, ts in times.items():
        med = float(np.median(ts))
        print(
            f"LATENCY {name}: median {med:.2f} ms, min {min(ts):.2f} ms, "
            f"{med / first:.3f}x of {next(iter(times))}; {runs} interleaved runs; "
            f"load {l0} -> {load()}; code of commit {START_COMMIT}",
            flush=True,
        )


def ort_row(method: str, info, calib, path: Path, evaluation, i: int) -> Path:
    """ONNX Runtime's ``quantize_static`` (``method``) on the calibration crops, its int8
    model (graph optimizations on: ORT's integer kernels, 2 threads) scored like a row."""
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
    return path


def run_row(name, row, model, calib, extra, evaluation, info, i) -> None:
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
    fp = metrics["fp"](lambda samples: [runner.run(s) for s in samples]) if extra["fp"] else 0
    f = common.fidelity("detector", ref, outs)
    rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], outs[:i] + outs[i + 1 :])
    one = common.fidelity("detector", [ref[i]], [outs[i]])
    up = above_int8(res)
    print(
        f"ROW {name} ({what}): realized IoU@0.3 {100 * f['agree']:.1f}% cos {f['cos']:.4f}; "
        f"without image {i}: {100 * rest['agree']:.1f}%; image {i}: {one['agree']:.3f}; "
        f"search crops (held-out calibration photos) {100 * searched:.1f}%; "
        f"false-positive crops {100 * fp:.1f}%; "
        f"{len(up)} above int8: {up or '-'}; quantize {secs:.0f} s; load {l0} -> {load()}; "
        f"code of commit {START_COMMIT}; {len(data)} samples",
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
    return res.module


if __name__ == "__main__":
    main()
