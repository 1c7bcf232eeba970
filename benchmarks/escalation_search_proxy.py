"""Which int16 escalation search uses its budget best on all-MiniLM-L6-v2? One calibration, many searches.

The issue-16 all-integer configuration (dense layers dynamic per token + GPTQ, the rest static
int8, ``rounding="half_even"``, ``residual_per_channel``) is calibrated once by the pipeline
(16 sentences, the last ``--holdout`` held out, as ``AutoFallback`` does); its
:class:`autoq.fallback.escalation.EscalationGraph` is compiled once; then each search variant
(``--variants``: ``AutoFallback`` fields, e.g. ``search=eliminate,trial_samples=0``) runs
:func:`autoq.fallback.escalation.escalate_search` on it, and its chosen tensors are scored on the eval
set and two disjoint 64-sentence sets with the switched graph (the simulated graph the realized
module is checked against: realized cos within 0.00004 of it, session 10). No variant is
chosen on these sets: they only report; a fourth disjoint 64-sentence set (``--select-from``,
column "select") is the one to choose a variant on.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/escalation_search_proxy.py \\
        --variants "search=greedy;search=eliminate;search=eliminate,trial_samples=0"
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common
import transformer_int16


class Captured(Exception):
    """Raised by the patched search once it has the calibrated graph's inputs."""


def calibrated_graph(info, config, calib, per_channel=(False,)):
    """([EscalationGraph for each ``per_channel`` value of its ``int16_per_channel``],
    AutoFallback, held-out samples) of ``config`` on ``calib``: the pipeline up to its int16
    search, which is replaced by a capture."""
    import autoq
    import autoq.pipeline as pipeline
    from autoq import frontends
    from autoq.fallback.escalation import EscalationGraph, search_setup
    from autoq.simulation import simulate

    seen = {}

    def capture(model, _params, samples, cfg, qparams, target=None, fan_out=None):
        seen.update(model=model, samples=samples, config=cfg, qparams=qparams, target=target)
        raise Captured

    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    real = pipeline.SEARCHES["int16_tensors"]
    pipeline.SEARCHES["int16_tensors"] = capture
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autoq.Quantizer(config).run(mod, params, calib)
    except Captured:
        pass
    finally:
        pipeline.SEARCHES["int16_tensors"] = real
    fb, target, base_cfg, cal, held = search_setup(
        seen["config"], "int16_tensors", seen["samples"], seen["target"], None
    )
    sim = simulate(seen["model"], None, base_cfg)
    egs = [
        EscalationGraph(sim, seen["qparams"], cal, target, base_cfg.token_mask, pc)
        for pc in per_channel
    ]
    return egs, fb, held


def variant(fb, text: str):
    """``fb`` with the ``k=v,k=v`` fields of ``text`` (ints where they parse)."""
    fields = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        fields[k] = int(v) if v.isdigit() else v
    return dataclasses.replace(fb, **fields)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="search=greedy;search=eliminate")
    p.add_argument("--holdout", type=int, default=4, help="held-out calibration sentences")
    p.add_argument("--calib", type=int, default=16, help="calibration sentences")
    p.add_argument("--sets", type=int, default=3, help="evaluation sets (1-3)")
    p.add_argument("--select-from", type=int, default=192, help="selection set's start")
    p.add_argument(
        "--int16-per-channel", default="0",
        help="EscalationGraph(int16_per_channel=...) arms: 0, 1 or 0,1",
    )  # fmt: skip
    args = p.parse_args(argv)
    from autoq import Config, Override, QuantSpec

    info, calib, evalset, ref = common.embedding_setup("minilm", args.calib, 64)
    session = common.ort_session(info.path, 2, False)
    sel = common.second_sentence_set(info, 64, args.calib, skip=args.select_from)
    sets = [("select", sel, common.ort_outputs(session, sel)), ("eval", evalset, ref)]
    for k, skip in enumerate((0, 64)[: args.sets - 1]):
        s = common.second_sentence_set(info, 64, args.calib, skip=skip)
        sets.append((f"set {k + 2}", s, common.ort_outputs(session, s)))
    targs = transformer_int16.parse_args(["--holdout", str(args.holdout)])
    dyn = (Override("pattern:dense*", activation=QuantSpec(dynamic=True, granularity="token")),)
    cfg = Config(progress=False, check_scales=False, overrides=dyn, dynamic_gptq=True,
                 rounding="half_even", residual_per_channel=True,
                 fallback=transformer_int16.escalation(targs, 0.2))  # fmt: skip
    print(f"load average at start: {os.getloadavg()}", flush=True)
    t0 = time.perf_counter()
    arms = [bool(int(x)) for x in args.int16_per_channel.split(",")]
    egs, fb, held = calibrated_graph(info, cfg, list(calib), arms)
    print(f"calibrated + compiled in {time.perf_counter() - t0:.0f} s; {len(egs[0].candidates)} "
          f"candidates of {egs[0].n_activation_slots}; {len(held)} held out", flush=True)  # fmt: skip
    for eg in egs:
        print(f"int16 per channel: {eg.int16_per_channel}", flush=True)
        run_variants(eg, fb, held, args.variants, sets)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


def run_variants(eg, fb, held, variants: str, sets) -> None:
    """Each search variant on ``eg``, its tensors scored on ``sets``."""
    from autoq.fallback.escalation import escalate_search

    def score(tensors, label):
        cells = []
        for name, samples, r in sets:
            f = common.fidelity("embedding", r, eg.run(tensors, samples))
            cells.append(f"{name} {f['agree']:.1%} {f['cos']:.5f}")
        print(f"  {label:44s} {len(tensors):2d}/82  " + "  ".join(cells), flush=True)

    score([], "all int8")
    for text in variants.split(";"):
        fbv = variant(fb, text)
        t0 = time.perf_counter()
        found = escalate_search(eg, fbv, eg.run_fp32, held)
        kinds = Counter(t["kind"] for t in found["trials"])
        print(f"{text}: {time.perf_counter() - t0:.0f} s, trials {dict(kinds)}, trial metric "
              f"{found['metric']:.2f} dB; kept {found['tensors']}", flush=True)  # fmt: skip
        score(found["tensors"], text)
        before = sorted(r["layer"] for r in found["ranking"])
        if fbv.search == "eliminate" and before != sorted(found["tensors"]):
            score(before, "  (before the held-out check)")


if __name__ == "__main__":
    raise SystemExit(main())
