"""Which precision change recovers PP-OCRv4 det evaluation image 18? A *diagnosis* on one
evaluation image (issue 16): nothing here chooses a default or a recipe.

Every int8 row erases the confident fp32 false-positive blob of evaluation image 18 (a
text-free crop; see benchmarks/results/ppocr_budget.md), which alone keeps issue 16's 97%
out of reach. This script calibrates the PP-OCR recipe (``ppocr_budget.recipe()``, row
``pe``; ``--pclut``: with ``Config.lut_input_per_channel``, row ``pe_pclut``; ``--no-ebc``:
without the empirical bias correction, rows ``p_lut*``) on the
calibration crops of ``--calib-seed``, builds one :class:`autoq.fallback.escalation.EscalationGraph`
on the graph simulated *with layer switches* (one compile: any set of activation tensors
int16 and any set of layers fp32 is one run, the calibrated qparams and bias corrections
unchanged, so an int16 tensor's readers keep the correction calibrated for its int8 error,
while a layer switched to fp32 reads the model's own weight and bias; the int16 qparams are
the escalation's, observed range x ``INT16_HEADROOM``),
and searches, in topological order:

* the smallest set of activation tensors whose int16 makes image 18's IoU@0.3 reach
  ``--good`` (:func:`minimal_set`), then
* the smallest set of layers whose fp32 (``Fallback``) does,

and reports each set's IoU on all evaluation crops, without image 18, on the held-out
search crops and on the false-positive crops (text-free crops of the calibration photos,
``ppocr_budget.false_positive_crops``). Simulated, not realized: the realized rows are
``ppocr_budget.py --rows pe_img18_*``.

    python benchmarks/ppocr_img18.py --calib-seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import ppocr_budget


def minimal_set(items: Sequence, good: Callable[[list], bool]) -> tuple[list, int]:
    """A subset of ``items`` (in their order) for which ``good`` holds and from which no
    single element can be dropped, assuming ``good(items)``: repeatedly the shortest prefix
    of the remaining items that, added to the elements found so far, is good (binary
    search); its last element is kept and the items after it dropped; then every kept
    element is tried without. Returns (the set, the number of distinct sets ``good`` was
    called on).

    >>> minimal_set(range(10), lambda s: {2, 7} <= set(s))
    ([2, 7], 11)
    """
    items, seen = list(items), {}

    def ok(sel):
        key = frozenset(sel)
        if key not in seen:
            seen[key] = bool(good(sorted(sel, key=items.index)))
        return seen[key]

    if not ok(items):
        raise ValueError("good(items) is false: no subset to look for")
    found, rest = [], items
    while not ok(found):
        lo, hi = 0, len(rest)  # ok(found + rest[:hi]) holds, ok(found + rest[:lo]) not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(found + rest[:mid]) else (mid, hi)
        found.append(rest[hi - 1])
        rest = rest[: hi - 1]
    for x in list(found):
        if len(found) > 1 and ok([y for y in found if y != x]):
            found.remove(x)
    return sorted(found, key=items.index), len(seen)


def setup(args):
    """Model, calibration / evaluation / search / false-positive crops and their fp32 maps."""
    import autoq

    info = common.find_model("ppocr_det", det_size=args.det_size)
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    sess = common.ort_session(info.path, threads=2)
    sets = {
        "calib": list(common.make_dataset(info, "calib", args.calib, seed=args.calib_seed)),
        "eval": list(common.make_dataset(info, "eval", args.eval)),
        "search": list(common.make_dataset(info, "calib", args.search, seed=11)),
    }
    sets["fp"], _ = ppocr_budget.false_positive_crops(info, sess, args.fp_pool, args.fp, 300)
    refs = {k: common.ort_outputs(sess, v) for k, v in sets.items() if k != "calib"}
    return mod, params, sets, refs


def graph(mod, params, calib, cfg):
    """The recipe calibrated on ``calib`` and its escalation graph with layer switches."""
    import autoq
    from autoq.fallback.escalation import EscalationGraph
    from autoq.ir.matching import as_matched

    target = common.tvm_target()
    matched = as_matched(mod, params, cfg)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp = autoq.calibrate(autoq.simulate(matched, None, cfg), None, calib, cfg, target=target)
    t1 = time.perf_counter()
    eg = EscalationGraph(autoq.simulate(matched, None, cfg, switches=True), qp, calib, target)
    print(f"calibrate {t1 - t0:.0f} s, escalation graph {time.perf_counter() - t1:.0f} s")
    return eg


class Scores:
    """IoU@0.3 of the escalation graph's maps against fp32 on the crop sets."""

    def __init__(self, eg, sets, refs, image):
        self.eg, self.sets, self.refs, self.i = eg, sets, refs, image
        self.calls = 0

    def image(self, int16=(), fp32=()) -> float:
        self.calls += 1
        out = self.eg.run(int16, [self.sets["eval"][self.i]], fp32)
        return common.fidelity("detector", [self.refs["eval"][self.i]], out)["agree"]

    def report(self, label, int16=(), fp32=()) -> None:
        i, eg = self.i, self.eg
        outs = {k: eg.run(int16, self.sets[k], fp32) for k in ("eval", "search", "fp")}
        ref, ev = self.refs["eval"], outs["eval"]
        f = common.fidelity("detector", ref, ev)
        rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], ev[:i] + ev[i + 1 :])
        one = common.fidelity("detector", [ref[i]], [ev[i]])["agree"]
        s = common.fidelity("detector", self.refs["search"], outs["search"])["agree"]
        fp = common.fidelity("detector", self.refs["fp"], outs["fp"])["agree"]
        per = [
            round(common.fidelity("detector", [r], [o])["agree"], 3)
            for r, o in zip(ref, ev, strict=True)
        ]
        print(
            f"SET {label}: simulated IoU@0.3 {100 * f['agree']:.1f}% cos {f['cos']:.4f}; "
            f"without image {i}: {100 * rest['agree']:.1f}%; image {i}: {one:.3f}; search "
            f"crops {100 * s:.1f}%; false-positive crops {100 * fp:.1f}%; int16 {list(int16)}; "
            f"fp32 {list(fp32)}; load {ppocr_budget.load()}; code of commit {COMMIT}",
            flush=True,
        )
        print(f"  per image IoU: {per}", flush=True)


COMMIT = "?"


def search(sc: Scores, kind: str, items: list, good: float):
    """The minimal set of ``items`` (tensors to int16 / layers to fp32) recovering the image."""

    def run(sel):
        return sc.image(int16=sel) if kind == "int16" else sc.image(fp32=sel)

    whole = run(items)
    print(f"all {len(items)} {kind}: image {sc.i} IoU {whole:.3f}", flush=True)
    if whole < good:
        return None
    t0 = time.perf_counter()
    found, calls = minimal_set(items, lambda sel: run(sel) >= good)
    secs = time.perf_counter() - t0
    print(f"MINIMAL {kind} set ({len(found)}, {calls} runs, {secs:.0f} s): {found}", flush=True)
    for k in range(1, len(found)):
        print(f"  first {k} of it: image IoU {run(found[:k]):.3f}", flush=True)
    return found


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.ppocr_data_args(ap)
    ap.add_argument("--fp", type=int, default=4)
    ap.add_argument("--fp-pool", type=int, default=80)
    ap.add_argument("--good", type=float, default=0.5, help="image IoU that counts as recovered")
    ap.add_argument("--pclut", action="store_true", help="recipe + lut_input_per_channel")
    ap.add_argument("--no-ebc", action="store_true", help="recipe without bias correction")
    ap.add_argument("--kinds", nargs="*", default=["int16", "fp32"], choices=["int16", "fp32"])
    args = ap.parse_args(argv)
    global COMMIT
    COMMIT = ppocr_budget.commit()
    print(common.machine_summary(), "; commit", COMMIT, "; args", vars(args), flush=True)
    mod, params, sets, refs = setup(args)
    cfg = ppocr_budget.recipe(
        lut_input_per_channel=args.pclut, empirical_bias_correction=not args.no_ebc
    )
    eg = graph(mod, params, sets["calib"], cfg)
    sc = Scores(eg, sets, refs, args.image)
    sc.report("none (recipe, all int8)")
    layers = [x for x in eg.sim.layers if x in set(eg.switchable)]
    for kind in args.kinds:
        items = eg.candidates if kind == "int16" else layers
        found = search(sc, kind, items, args.good)
        if found:
            rank = [items.index(x) for x in found]
            print(f"  topological positions (of {len(items)}): {rank}", flush=True)
            if kind == "int16":
                print(f"  own int8 SQNR dB: {[round(eg.local_sqnr[x], 1) for x in found]}")
            sc.report(f"minimal {kind}", **{kind: found})
    print(f"{sc.calls} image runs; load {ppocr_budget.load()}", flush=True)


if __name__ == "__main__":
    main()
