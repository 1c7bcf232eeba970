"""Would per-channel scales on MiniLM's residual stream help? A simulation, before realizing.

The issue-16 all-integer row (session 9: dense layers dynamic per token + GPTQ, the rest
static int8, ``rounding="half_even"``, int16 escalation <= 20% of the activation slots)
with and without ``Config.residual_per_channel`` (:mod:`autoq.rules.residual_channels`), scored on
the *simulated* graph of the final config and qparams (:class:`autoq.fallback.escalation.EscalationGraph`
with nothing switched: the calibrated simulation realize is checked against) instead of the
realized module. Rows: all int8 (no escalation) and the escalation, for each arm, on the eval
set and two disjoint 64-sentence sets (``common.second_sentence_set``, from 0 and from 64).
Arms ``tensor-max`` / ``channel-max``: the residual adds' slots (``RESIDUAL_ADDS``: their
inputs and outputs, the residual stream's) calibrated by min / max instead of the default
MSE search. Arm ``channel-lut``: also ``Config.lut_input_per_channel`` (the FFN GELU
lookups' inputs and outputs per channel on the last axis); ``channel-lutin``: their inputs
only (the ``lookup`` writer left out of ``autoq.rules.residual_channels.SERVABLE``).
``--headrooms 1,1.25``: one row per ``autoq.rules.residual_channels.HEADROOM`` (each last-axis
channel's calibrated range widened by it); ``--dev``: a fourth 64-sentence set (pool
positions 256-319) to choose such a setting on.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/residual_channels_proxy.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common
import transformer_int16

#: MiniLM's residual-stream add layers (the embedding sums, the 6 FFN residual adds; the
#: attention residual adds are inside the dynamic dense layers), as in session 9's int16 rule
RESIDUAL_ADDS = "re:^(add_(2|12|21|30|39|48|57)|/bert/.*)$"


def simulated_row(info, config, calib, sets, log) -> list[dict]:
    """Quantize (realize skipped) and score the final simulated graph on ``sets``."""
    import autoq
    import autoq.pipeline as pipeline
    from autoq import frontends
    from autoq.fallback.escalation import EscalationGraph
    from autoq.simulation import simulate

    seen = {}

    def no_realize(matched, params, qparams, config):
        seen.update(matched=matched, qparams=qparams, config=config)
        return matched.graph.module

    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    t0, real = time.perf_counter(), pipeline.realize
    pipeline.realize = no_realize
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = autoq.Quantizer(config).run(mod, params, calib)
    finally:
        pipeline.realize = real
    sim = simulate(seen["matched"], None, seen["config"])
    qp = seen["qparams"]
    eg = EscalationGraph(sim, qp, list(calib)[:1], common.tvm_target())
    acts = sim.activation_slots()
    wide = [s for s in acts if qp[s].dtype == "int16"]
    per_ch = [s for s in acts if qp[s].axis is not None]
    log(f"    {time.perf_counter() - t0:.0f} s; int16 {len(wide)}/{len(acts)} {wide}; "
        f"per-channel {len(per_ch)}: {per_ch}")  # fmt: skip
    if res.decision is not None:
        log("    " + res.decision.summary().replace("\n", "\n    "))
    out = []
    for name, samples, ref in sets:
        f = common.fidelity("embedding", ref, eg.run([], samples))
        out.append(f)
        log(f"    {name}: NN@1 {f['agree']:.1%}, cos {f['cos']:.5f} (min {f['cos_min']:.5f})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--arms", default="tensor,channel",
        help="tensor, channel (residual_per_channel), tensor-max / channel-max (the add "
        "layers' slots calibrated by max instead of MSE), channel-lut / channel-lutin (also "
        "lut_input_per_channel: GELU inputs and outputs / inputs only per channel)",
    )  # fmt: skip
    p.add_argument("--rows", default="int8,escalation", help="all int8 / escalation <= 20%")
    p.add_argument("--sets", type=int, default=3, help="evaluation sets (1-3)")
    p.add_argument(
        "--dev", action="store_true", help="also a 4th set (from 256) to choose settings on"
    )
    p.add_argument("--int16", default="", help="Config.int16_tensors of every row (slot ids)")
    p.add_argument(
        "--headrooms", default="1", help="autoq.rules.residual_channels.HEADROOM values (each a row)"
    )
    args = p.parse_args(argv)
    from autoq import Config, Override, QuantSpec
    from autoq.rules import residual_channels

    servable = residual_channels.SERVABLE

    info, calib, evalset, ref = common.embedding_setup("minilm", 16, 64)
    sets = [("eval", evalset, ref)]
    session = common.ort_session(info.path, 2, False)
    for k, skip in enumerate((0, 64)[: args.sets - 1]):
        s = common.second_sentence_set(info, 64, 16, skip=skip)
        sets.append((f"set {k + 2}", s, common.ort_outputs(session, s)))
    if args.dev:  # choose on this one, never on the three evaluation sets
        s = common.second_sentence_set(info, 64, 16, skip=256)
        sets.append(("dev", s, common.ort_outputs(session, s)))
    targs = transformer_int16.parse_args([])
    dyn = (Override("pattern:dense*", activation=QuantSpec(dynamic=True, granularity="token")),)
    base = Config(progress=False, check_scales=False, overrides=dyn, dynamic_gptq=True,
                  rounding="half_even", int16_tensors=tuple(x for x in args.int16.split(",") if x))  # fmt: skip
    print(f"load average at start: {os.getloadavg()}", flush=True)
    maxed = Override(RESIDUAL_ADDS, activation=QuantSpec(calibrator="max"))
    for arm, row, headroom in itertools.product(
        args.arms.split(","), args.rows.split(","), args.headrooms.split(",")
    ):
        residual_channels.HEADROOM = float(headroom)
        cfg = base.replace(residual_per_channel=arm.startswith("channel"),
                           lut_input_per_channel=arm.startswith("channel-lut"))  # fmt: skip
        residual_channels.SERVABLE = servable
        if arm == "channel-lutin":  # lookup outputs stay per tensor
            residual_channels.SERVABLE = {(w, r) for w, r in servable if w != "lookup"}
        if arm.endswith("-max"):  # the adds' slots calibrated by min / max, not MSE
            cfg = cfg.replace(overrides=(*cfg.overrides, maxed))
        if row == "escalation":
            cfg = cfg.replace(fallback=transformer_int16.escalation(targs, 0.2))
        print(f"{arm} / {row} / headroom {headroom}:", flush=True)
        simulated_row(info, cfg, list(calib), sets, print)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
