"""all-MiniLM-L6-v2 (static int8, int16 escalation, the static + dynamic hybrid and the
transformer recipe) against ONNX Runtime, in one run.

Rows (fidelity against ONNX Runtime fp32 with graph optimizations off, on held-out pydoc
sentences; the same prepared ONNX model and samples as benchmarks/vs_onnxruntime.py):

* autoq static default (``check_scales`` keeps layers whose int8 scale collapses most of
  their values in fp32);
* autoq static, every layer int8 (``check_scales=False``);
* autoq ``AutoFallback(precision="int16_tensors", max_int16_fraction=F)`` (every layer
  quantized; the search of :mod:`autoq.fallback.escalation` picks the int16 tensors, with
  ``holdout`` held-out calibration sentences), for each ``--fractions`` and each
  ``--rounding`` (weight rounding); ``--search eliminate``: ``AutoFallback.search``;
* the transformer recipe (every dense layer dynamic per token, the rest static int8,
  SmoothQuant 0.5, ``rounding="half_even"``, residual stream and GELU lookups per channel);
* with ``--smooth a,b``: the all-int8 and escalation rows again with ``Config(smooth_quant=a)``;
* autoq dynamic per token (no data), for reference;
* with ``--hybrid``: the static + dynamic hybrid (:mod:`autoq.rules.hybrid`): every dense layer
  (``--dense-rule``) quantizes its input per token at run time, the attention matmuls and
  every other layer static int8 (row "rest static"), the same with only the attention
  matmuls static and the other non-MatMul layers fp32 (row "attention static"), and the
  first with the int16 escalation (<= each ``--fractions``); options of the hybrid rows:
  ``--hybrid-smooth``, ``--rounding-mode`` (``Config.rounding``), ``--residual-per-channel``,
  ``--lut-per-channel``, ``--max-calibrator RULE`` (those layers calibrated by min / max),
  ``--hybrid-int16 RULE`` / ``--int16-slots a,b`` (those layers' / tensors int16, alone and
  with the escalation; ``--int16-headroom``: ranges widened like the escalation's),
  ``--hybrid-fp32 PATTERN`` (a ``Fallback`` pattern row);
* with ``--second n``: every row also on ``n`` other sentences of the calibration topic pool
  (``common.second_sentence_set``: disjoint from the calibration and evaluation sentences),
  columns "NN@1 2nd" / "cos 2nd"; ``--second-from k``: that set starts at position ``k`` of
  the pool's permutation (``--second 64 --second-from 64``: a third set);
* ``--more-calib n``: ``n`` more calibration-pool sentences (after every evaluation set)
  inserted before the held-out ones;
* ONNX Runtime ``quantize_static`` (QDQ, minmax, per-channel weights, MatMul/Gemm only: what
  keeps it usable on this model, see vs_onnxruntime.md) and ``quantize_dynamic``
  (per-channel), in the same run.

Columns: NN@1 (nearest-neighbour agreement within the eval set), cosine mean/min, the
activation tensors in int16 (count / all activation tensors), layers left in fp32, the
quantize wall time (load average printed).

Run:  python benchmarks/transformer_int16.py [--calib 16 --eval 64] [--second 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common
import dynamic_quantization

HEADERS = ["runtime", "NN@1", "cos mean", "cos min", "int16 tensors", "fp32 layers", "quantize s"]
SECOND = ["NN@1 2nd", "cos 2nd"]


def autoq_row(info, config, calib, evalset, label, log, second=()) -> dict:
    res, quant_s, runner = common.autoq_quantize(info, config, calib)
    outs = [runner.run(s) for s in evalset]
    outs2 = [runner.run(s) for s in second]
    acts = [s for s, i in res.qparams.slots.items() if i.kind == "activation"]
    wide = [s for s in acts if res.qparams[s].dtype == "int16"]
    log(f"  {label}: {len(res.int8_layers)} quantized layers, {len(res.fp32_layers)} fp32, "
        f"int16 tensors {wide}, {quant_s:.1f} s")  # fmt: skip
    per_ch = [s for s in acts if res.qparams[s].axis is not None]
    if per_ch:
        log(f"    {len(per_ch)} per-channel activation slots: {per_ch}")
    pattern = {m.layer: m.pattern.name for m in res.matched.matches}
    dyn = [x for x in res.int8_layers
           if res.config.layer_spec("activation", x, pattern.get(x)).dynamic]  # fmt: skip
    if dyn:
        static = [x for x in res.int8_layers if x not in dyn]
        log(f"    {len(dyn)} dynamic layers, {len(static)} static integer layers: {static}")
    if res.decision is not None:
        log("    " + res.decision.summary().replace("\n", "\n    "))
    return {
        "label": label,
        "outputs": outs,
        "outputs2": outs2,
        "int16": f"{len(wide)}/{len(acts)} ({100 * len(wide) / max(len(acts), 1):.0f}%)",
        "fp32": str(len(res.fp32_layers)),
        "quant_s": quant_s,
    }


def ort_rows(info, calib, evalset, log) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoq-int16-") as tmp:
        out = Path(tmp) / "static.onnx"
        r = common.ort_quantize(info, calib, "minmax", out, op_types=["MatMul", "Gemm"])
        outs = common.ort_outputs(common.ort_session(out, 2, False), evalset)
        rows.append({"label": "ORT quantize_static minmax [MatMul,Gemm]", "outputs": outs,
                     "int16": "", "fp32": "", "quant_s": r["calib_s"]})  # fmt: skip
    dyn = dynamic_quantization.ort_dynamic_row(info, evalset, True, log)
    rows.append(dict(dyn, int16="", fp32=""))
    log("  ORT rows done")
    return rows


def escalation(args, fraction: float):
    """The escalation rows' ``AutoFallback`` with at most ``fraction`` int16 tensors."""
    from autoq import AutoFallback

    return AutoFallback(
        precision="int16_tensors", max_int16_fraction=fraction, holdout=args.holdout,
        min_sqnr=args.min_sqnr, search=args.search,
    )  # fmt: skip


def configs(args):
    from autoq import Config, QuantSpec

    rows = [
        ("autoq default (recipe auto)", Config()),
        ("autoq cnn recipe (static; the default before recipes)", Config(recipe="cnn")),
        ("autoq static, all layers int8", Config(recipe="cnn", check_scales=False)),
    ]
    for f in args.fractions:
        for rounding in args.rounding:
            fb = escalation(args, f)
            cfg = Config(recipe="cnn", check_scales=False, fallback=fb, weight_rounding=rounding)
            rows.append((f"autoq int16 escalation (<= {f:.0%}), {rounding}", cfg))
    for alpha in args.smooth:
        sq = f"SmoothQuant {alpha:g}"
        rows.append((f"autoq static, all layers int8, {sq}",
                     Config(recipe="cnn", check_scales=False, smooth_quant=alpha)))  # fmt: skip
        for f in args.fractions:
            fb = escalation(args, f)
            cfg = Config(recipe="cnn", check_scales=False, fallback=fb, smooth_quant=alpha, weight_rounding=args.rounding[0])  # fmt: skip
            rows.append((f"autoq int16 escalation (<= {f:.0%}), {args.rounding[0]}, {sq}", cfg))
    rows.append(("autoq transformer recipe", transformer_recipe()))
    rows += hybrid_rows(args)
    dyn = Config(recipe="cnn", activation=QuantSpec(dynamic=True, granularity="token"))
    rows.append(("autoq dynamic (token), no data", dyn))
    return rows


def transformer_recipe():
    """autoq's transformer recipe: every dense layer dynamic per token, the rest static int8,
    SmoothQuant 0.5, ``rounding="half_even"``, ``check_scales`` off, residual stream and GELU
    lookups per channel (docs/recipes.md)."""
    from autoq import Config

    return Config(recipe="transformer")


#: the pattern names of MiniLM's layers that are no MatMul (kept fp32 in the "attention
#: static" hybrid row)
NOT_MATMUL = ("add", "add_const", "gelu", "multiply", "multiply_const")


def hybrid_rows(args) -> list:
    """``--hybrid``: the dense layers dynamic per token (``Override(args.dense_rule, ...)``),
    the rest static (:mod:`autoq.rules.hybrid`), for each ``--hybrid-smooth`` alpha."""
    from dataclasses import replace

    from autoq import Config, Fallback, Override, QuantSpec

    if not args.hybrid:
        return []
    dyn = (Override(args.dense_rule, activation=QuantSpec(dynamic=True, granularity="token")),)
    if args.max_calibrator:  # those layers' slots calibrated by min / max (default: MSE)
        dyn += (Override(args.max_calibrator, activation=QuantSpec(calibrator="max")),)
    rows = []
    for alpha in args.hybrid_smooth:
        base = Config(recipe="cnn", check_scales=False, overrides=dyn, smooth_quant=alpha, rounding=args.rounding_mode, rules=() + (("residual_per_channel",) if args.residual_per_channel else ()) + (("lookup_per_channel",) if args.lut_per_channel else ()))  # fmt: skip
        name = "autoq hybrid: dense dynamic (token), " + ("" if alpha == 0.5 else f"SQ {alpha}, ")
        name += "residual per channel, " if args.residual_per_channel else ""
        name += "GELU per channel, " if args.lut_per_channel else ""
        name += f"max calibrator: {args.max_calibrator}, " if args.max_calibrator else ""
        name += f"rounding {args.rounding_mode}, " if args.rounding_mode != "float" else ""
        rows += [
            (name + "rest static int8", base),
            (name + "attention matmuls static int8, rest fp32",
             base.replace(fallback=Fallback(op_types=NOT_MATMUL))),
        ]  # fmt: skip
        if args.hybrid_int16 or args.int16_slots:
            rows += int16_rows(args, base, name)
        if args.hybrid_fp32:
            fp32 = (args.hybrid_fp32,)
            label = name + f"fp32: {args.hybrid_fp32}, rest static int8"
            rows.append((label, base.replace(fallback=Fallback(patterns=fp32))))
            rows += [(f"{label}, escalation (<= {f:.0%})",
                      base.replace(fallback=replace(escalation(args, f), patterns=fp32)))
                     for f in args.fractions]  # fmt: skip
        tag = "" if args.search == "greedy" else f", {args.search} search"
        rows += [(name + f"rest static int8, escalation (<= {f:.0%}){tag}",
                  base.replace(fallback=escalation(args, f))) for f in args.fractions]  # fmt: skip
    return rows


def int16_rows(args, base, name: str) -> list:
    """``--hybrid-int16 RULE`` / ``--int16-slots``: the hybrid with the layers ``RULE`` names
    int16 (``Override(RULE, activation=QuantSpec(dtype="int16"))``: their input and output
    slots) and the ``--int16-slots`` tensors int16 (``Config.int16_tensors``), the rest static
    int8; then the same with the escalation, whose budget counts those tensors (at most each
    ``--fractions`` of all activation tensors)."""
    from dataclasses import replace

    from autoq import Override

    wide = base.activation.as_int16()
    if args.int16_headroom:
        wide = replace(wide, calibrator=int16_range)
    rules = (Override(args.hybrid_int16, activation=wide),) if args.hybrid_int16 else ()
    cfg = base.replace(overrides=base.overrides + rules, int16_tensors=tuple(args.int16_slots))
    what = [f"layers {args.hybrid_int16}"] if args.hybrid_int16 else []
    what += [f"{len(args.int16_slots)} tensors"] if args.int16_slots else []
    label = name + f"int16: {' + '.join(what)}, rest static int8"
    rows = [(label, cfg)]
    rows += [(f"{label}, escalation (<= {f:.0%})", cfg.replace(fallback=escalation(args, f)))
             for f in args.fractions]  # fmt: skip
    if args.hybrid_fp32:  # the same escalation with that rule fp32 instead (same run)
        fp32 = (args.hybrid_fp32,)
        rows += [(name + f"fp32: {args.hybrid_fp32}, rest static int8, escalation (<= {f:.0%})",
                  base.replace(fallback=replace(escalation(args, f), patterns=fp32)))
                 for f in args.fractions]  # fmt: skip
    return rows


def int16_range(batch) -> tuple[float, float]:
    """``--int16-headroom``: a batch's range widened around 0 by the escalation's
    ``INT16_HEADROOM`` (what its searched int16 tensors get), for the ``--hybrid-int16``
    layers (calibrator function: the batches' ranges merge by min / max)."""
    from autoq.fallback.escalation import INT16_HEADROOM

    lo, hi = float(np.min(batch)), float(np.max(batch))
    return min(lo, 0.0) * INT16_HEADROOM, max(hi, 0.0) * INT16_HEADROOM


def with_more_calibration(info, calib, args, log) -> list:
    """``calib`` with ``--more-calib`` sentences inserted before its last ``--holdout``
    (the search's held-out sentences; its trial sentences are the first ones). They come
    after every evaluation set of the pool (``common.EVALUATION_POOL``): before, they started
    right after this run's second set, i.e. on the third set's sentences."""
    skip = max(common.EVALUATION_POOL, args.second_from + args.second)
    extra = common.second_sentence_set(info, args.more_calib, args.calib, skip=skip)
    head = list(calib)[: len(calib) - args.holdout]
    log(f"calibration: + {extra.description}")
    return head + list(extra) + list(calib)[len(calib) - args.holdout :]


def table_rows(rows, ref, ref2) -> list[list[str]]:
    """One table row per result; with a second set (``ref2``) its NN@1 and cosine too."""
    table = []
    for r in rows:
        f = common.fidelity("embedding", ref, r["outputs"])
        row = [r["label"], f"{f['agree'] * 100:.1f}%", f"{f['cos']:.5f}", f"{f['cos_min']:.5f}",
               r["int16"], r["fp32"], f"{r['quant_s']:.1f}"]  # fmt: skip
        if ref2:
            f2 = common.fidelity("embedding", ref2, r["outputs2"]) if r.get("outputs2") else None
            row += [f"{f2['agree'] * 100:.1f}%", f"{f2['cos']:.5f}"] if f2 else ["", ""]
        table.append(row)
    return table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=16, help="calibration sentences")
    p.add_argument("--holdout", type=int, default=4, help="of which held out by the search")
    p.add_argument("--eval", type=int, default=64, help="evaluation sentences (disjoint)")
    p.add_argument("--fractions", default="0.2", help="escalation budgets, comma-separated")
    p.add_argument("--rounding", default="gptq", help="weight_rounding of the escalation rows")
    p.add_argument(
        "--smooth", default="", help="SmoothQuant alphas for extra rows (comma-separated)"
    )
    p.add_argument("--second", type=int, default=0, help="second evaluation set (sentences)")
    p.add_argument("--second-from", type=int, default=0, help="its start (disjoint sets)")
    p.add_argument("--search", default="greedy", help="AutoFallback.search (greedy, eliminate)")
    p.add_argument("--hybrid", action="store_true", help="static + dynamic hybrid rows")
    p.add_argument(
        "--dense-rule", default="re:.*MatMul.*", help="the hybrid's dynamic layers (Override.match)"
    )
    p.add_argument("--hybrid-smooth", default="0.5", help="smooth_quant of the hybrid rows (none)")
    p.add_argument("--hybrid-fp32", default="", help="a hybrid row with this Fallback pattern")
    p.add_argument("--hybrid-int16", default="", help="hybrid rows with these layers int16")
    p.add_argument("--int16-slots", default="", help="hybrid rows with these tensors int16")
    p.add_argument("--rounding-mode", default="float", help="Config.rounding (hybrid rows)")
    p.add_argument(
        "--residual-per-channel", action="store_true", help="Config.residual_per_channel (hybrid)"
    )
    p.add_argument("--max-calibrator", default="", help="hybrid: these layers calibrated by max")
    p.add_argument("--lut-per-channel", action="store_true", help="Config.lut_input_per_channel")
    p.add_argument("--int16-headroom", action="store_true", help="--hybrid-int16 range x4")
    p.add_argument("--more-calib", type=int, default=0, help="calibration sentences added")
    p.add_argument("--min-sqnr", type=float, default=40.0, help="search stops above (dB)")
    p.add_argument("--skip", default="", help="row labels to skip (substrings, comma-separated)")
    p.add_argument("--only", default="autoq", help="run only rows containing one of these")
    common.add_page_option(p)
    args = p.parse_args(argv)
    args.fractions = [float(v) for v in args.fractions.split(",") if v.strip()]
    args.smooth = [float(v) for v in args.smooth.split(",") if v.strip()]
    args.rounding = [v for v in args.rounding.split(",") if v.strip()]
    args.hybrid_smooth = [None if v == "none" else float(v) for v in args.hybrid_smooth.split(",")]
    args.int16_slots = [v for v in args.int16_slots.split(",") if v]
    args.only = [v for v in args.only.split(",") if v]
    args.skip = [v for v in args.skip.split(",") if v]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    info, calib, evalset, ref = common.embedding_setup("minilm", args.calib, args.eval, log)
    second, ref2 = [], []
    if args.second:
        second = common.second_sentence_set(info, args.second, args.calib, skip=args.second_from)
        ref2 = common.ort_outputs(common.ort_session(info.path, 2, False), second)
        log(f"second evaluation set: {second.description}")
    if args.more_calib:
        calib = with_more_calibration(info, calib, args, log)
    log(f"load average at start: {os.getloadavg()}")
    rows = []
    for label, cfg in configs(args):
        if any(s in label for s in args.skip) or not any(s in label for s in args.only):
            continue
        data = None if cfg.activation.dynamic else list(calib)
        rows.append(autoq_row(info, cfg, data, evalset, label, log, second))
        f = common.fidelity("embedding", ref, rows[-1]["outputs"])  # logged now: a later
        log(f"    NN@1 {f['agree']:.1%}, cos {f['cos']:.5f} (min {f['cos_min']:.5f})")  # crash
        if second:
            f2 = common.fidelity("embedding", ref2, rows[-1]["outputs2"])
            log(f"    second set: NN@1 {f2['agree']:.1%}, cos {f2['cos']:.5f}")
    if not any("ORT" in s for s in args.skip):
        rows += ort_rows(info, list(calib), evalset, log)
    log(common.markdown_table(HEADERS + (SECOND if second else []), table_rows(rows, ref, ref2)))
    log(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
