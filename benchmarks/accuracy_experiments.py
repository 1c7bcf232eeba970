"""Offline experiments for the accuracy primitives on EfficientNet-Lite0 (issue 16), before
they are wired into the pipeline. Numbers, not assertions.

* **GPTQ / scale search / bias correction** (:mod:`autoq.accuracy.gptq`, :mod:`autoq.scale_search`,
  :mod:`autoq.accuracy.bias_correction`): each Conv/Gemm's input is captured in fp32 with ONNX
  Runtime on the calibration crops and streamed into :class:`autoq.accuracy.hessian.Hessian`. The
  integer weights (and int32 biases) then go into ``QParams.values`` of one default autoq
  calibration and are realized; the scales (searched or max) replace the weight slots'.
  Also as weight-only rows (float model with the int8 weights, activations fp32).
* **Cross-layer equalization + high-bias absorption** (:mod:`autoq.equalize`): the ONNX
  weights are rewritten before ``autoq.quantize``. Chains ``conv -> ReLU6 -> conv`` are
  equalized; each ReLU6 becomes ``Relu`` + ``Min`` with per-channel bounds ``6 / s`` (the
  exact form); biases of depthwise layers feeding a 1x1 projection are absorbed with
  ``c = max(0, mean - 3 std)`` capped by the observed minimum (calibration crops).

    python benchmarks/accuracy_experiments.py            # 64 calib / 160 eval, ~25 min
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy as A
import common

#: a layer gets GPTQ only with at least this many input rows per weight column (the fc
#: layer sees one row per image: 64 rows for 1280 columns would just fit the calibration set)
MIN_ROWS_PER_COLUMN = 4


@dataclass
class OnnxLayer:
    node: object
    weight: str
    bias: str | None
    geom: object  # ConvGeometry, or None for Gemm


def onnx_layers(model) -> list[OnnxLayer]:
    import onnx

    from autoq.accuracy.hessian import ConvGeometry

    inits = {i.name for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or node.input[1] not in inits:
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        geom = None
        if node.op_type == "Conv":
            t, l, b, r = a.get("pads", [0, 0, 0, 0])
            geom = ConvGeometry(
                kernel=a["kernel_shape"],
                strides=a.get("strides", [1, 1]),
                padding=(t, l, b, r),
                dilation=a.get("dilations", [1, 1]),
                groups=a.get("group", 1),
            )
        bias = node.input[2] if len(node.input) > 2 else None
        out.append(OnnxLayer(node, node.input[1], bias, geom))
    return out


def capture(path, tensors: list[str], samples):
    """Yield, per sample, the fp32 values of ``tensors`` (ONNX Runtime, extra outputs)."""
    import onnx

    model = onnx.load(str(path))
    have = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in have:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "capture.onnx"
        onnx.save(model, str(p))
        sess = common.ort_session(p, threads=2, optimize=False)
        for s in samples:
            yield dict(zip(tensors, sess.run(tensors, s), strict=True))


def hessians(path, layers: list[OnnxLayer], calib, max_rows: int | None = None):
    from autoq.accuracy.hessian import Hessian

    inits = A.conv_weights(path)
    hs = {}
    for ly in layers:
        w = inits[ly.weight][0]
        hs[ly.weight] = (
            Hessian.dense(w.shape[1])
            if ly.geom is None
            else Hessian.conv2d(ly.geom, w.shape[1] * ly.geom.groups, max_rows)
        )
    for outs in capture(path, [ly.node.input[0] for ly in layers], calib):
        for ly in layers:
            hs[ly.weight].update(outs[ly.node.input[0]])
    return hs


def round_layer(w, groups, h, scale, method: str):
    """OIHW/(out,in) int weights by ``rtn`` or ``gptq``/``gptq_act`` (RTN when H is too
    poorly sampled)."""
    from autoq.accuracy.gptq import gptq, rtn

    wf = w.reshape(groups, w.shape[0] // groups, -1)
    if method == "rtn" or h.rows < MIN_ROWS_PER_COLUMN * wf.shape[2]:
        return rtn(w.reshape(w.shape[0], -1), scale).reshape(w.shape)
    return gptq(wf, h.matrix(), scale, act_order=method == "gptq_act").q.reshape(w.shape)


VARIANTS = ("rtn", "search", "gptq", "gptq_act", "search+gptq_act")


def weight_variants(path, layers, hs, names=VARIANTS):
    """name -> {weight name: (int weights, scale)} for the weight-rounding variants."""
    from autoq.scale_search import search_scales

    ws = A.conv_weights(path)
    searched = {}
    t_search = time.perf_counter()
    for ly in layers:
        w, g = ws[ly.weight]
        searched[ly.weight] = search_scales(
            w.reshape(g, w.shape[0] // g, -1), hs[ly.weight].matrix()
        ).scale
    variants = {}
    timings = {"search": time.perf_counter() - t_search}
    for name, method, scales in [
        ("rtn", "rtn", None),
        ("search", "rtn", searched),
        ("gptq", "gptq", None),
        ("gptq_act", "gptq_act", None),
        ("search+gptq_act", "gptq_act", searched),
    ]:
        if name not in names:
            continue
        t0 = time.perf_counter()
        out = {}
        for ly in layers:
            w, g = ws[ly.weight]
            s = A.max_scales(w) if scales is None else scales[ly.weight]
            out[ly.weight] = (round_layer(w, g, hs[ly.weight], s, method), s)
        variants[name] = out
        timings[name] = time.perf_counter() - t0 + (timings["search"] if scales else 0.0)
    return variants, timings


def bias_corrected(path, layers, hs, ints, input_scales) -> dict[str, np.ndarray]:
    """int32 biases that cancel the mean output shift of the integer weights (fp32 inputs:
    ``(W - W~) E[patch]``, DFQ's bias correction with an empirical input mean)."""
    from autoq import primitives as P
    from autoq.accuracy.bias_correction import correct_bias

    ws = A.conv_weights(path)
    biases = dict(A.initializers(path))
    out = {}
    for ly in layers:
        w, g = ws[ly.weight]
        q, s = ints[ly.weight]
        b = biases[ly.bias] if ly.bias else np.zeros(w.shape[0], np.float32)
        s_x = input_scales.get(ly.weight)
        if s_x is None:
            continue
        m = hs[ly.weight].mean()  # (G, K)
        wf = w.reshape(g, w.shape[0] // g, -1).astype(np.float64)
        wq = A.dequantized(q, s).reshape(wf.shape).astype(np.float64)
        bq = P.quantize_bias(b, s_x, s)
        mean_fp = np.einsum("gok,gk->go", wf, m).reshape(-1) + b
        mean_q = np.einsum("gok,gk->go", wq, m).reshape(-1) + bq.values * bq.scale
        out[ly.bias or ly.weight] = correct_bias(mean_fp, mean_q, bq.scale, bq.values).values
    return out


def _keep_widened(q, s, calibrated, w):
    """Channels whose scale calibration widened (dead filters with a large bias, see
    ``calibrate.fit_bias_scales``) keep that scale, rounded to nearest."""
    from autoq.accuracy.gptq import rtn

    wide = calibrated > A.max_scales(w) * np.float32(1.000001)
    if not np.any(wide):
        return q, s
    s = np.where(wide, calibrated, s).astype(np.float32)
    q = q.copy()
    q[wide] = rtn(w[wide].reshape(int(wide.sum()), -1), s[wide]).reshape(q[wide].shape)
    return q, s


def int8_rows(info, mod, params, calib, evals, ref, layers, hs, variants, timings):
    """One default calibration; each variant's ints (and scales) realized in it."""
    import autoq
    from autoq.qparams import QParam, QParams
    from autoq.ir.registry import slot_id_of

    cfg = autoq.Config(progress=False)
    t0 = time.perf_counter()
    sim = autoq.simulate(mod, params, cfg)
    qp = autoq.calibrate(sim, params, calib, cfg)
    calib_s = time.perf_counter() - t0
    sid = slot_id_of(sim.graph, sim.matches)
    input_scales = {}
    for m in sim.matches:
        if f"{m.layer}.weight" in qp and "data" in m.nodes:
            input_scales[f"{m.layer}.weight"] = qp[sid(m["data"])].scale
    weights = A.conv_weights(info.path)
    rows = []
    for name, ints in variants.items():
        ints = {k: _keep_widened(q, s, qp[k].scale, weights[k][0]) for k, (q, s) in ints.items()}
        for bc in (False, True):
            params_new = dict(qp.params)
            values = {}
            for wname, (q, s) in ints.items():
                old = qp[wname]
                params_new[wname] = QParam(s, old.zero_point, old.dtype, old.axis)
                # values are in the layout of the prepared graph's weight, which may be
                # transposed (a Gemm's weight folds to (in, out))
                shape = sim.plan.weights[wname][0].shape
                values[wname] = (q if q.shape == shape else q.T).astype(np.int8)
            if bc:
                for bname, v in bias_corrected(info.path, layers, hs, ints, input_scales).items():
                    values[bname] = v
            q2 = QParams(params_new, dict(qp.slots), dict(qp.meta), values)
            qmod = autoq.realize(mod, params, q2, cfg)
            label = f"int8 {name}" + (" + bias corr." if bc else "")
            secs = timings.get(name, 0.0)
            rows.append(
                A.Row(label, A.agreement(ref, A.run_tvm(qmod, evals)), secs, "default a int8 mse")
            )
            print(f"  {label}: {rows[-1].metrics}", flush=True)
    return rows, calib_s


# ------------------------------------------------------------------------- equalization


def _consumers(model):
    out: dict[str, list] = {}
    for node in model.graph.node:
        for t in node.input:
            out.setdefault(t, []).append(node)
    return out


def _chains(model, layers: list[OnnxLayer]):
    """Maximal chains of Conv layers linked by ``[Clip(0, 6)] ->`` with single consumers."""
    by_node = {ly.node.name: ly for ly in layers if ly.geom is not None}
    cons = _consumers(model)
    link = {}
    for ly in by_node.values():
        users = cons.get(ly.node.output[0], [])
        if len(users) != 1:
            continue
        nxt, clip = users[0], None
        if nxt.op_type == "Clip":
            clip = nxt
            users = cons.get(nxt.output[0], [])
            if len(users) != 1:
                continue
            nxt = users[0]
        if nxt.name in by_node and nxt.input[0] == (clip or ly.node).output[0]:
            link[ly.node.name] = (by_node[nxt.name], clip)
    heads = set(link) - {v[0].node.name for v in link.values()}
    chains = []
    for h in heads:
        chain, clips = [by_node[h]], []
        while chain[-1].node.name in link:
            nxt, clip = link[chain[-1].node.name]
            chain.append(nxt)
            clips.append(clip)
        chains.append((chain, clips))
    return chains


def equalized_model(
    info, calib, out_path: Path, absorb: bool = True, relu: bool = False
) -> tuple[Path, dict]:
    """CLE over every chain, ReLU6 -> Relu + Min(6/s) (``relu``: plain Relu, DFQ's change
    of the model), then high-bias absorption into 1x1 projections. Returns the new file and
    counts."""
    import onnx

    from autoq import equalize as E

    model = onnx.load(str(info.path))
    layers = onnx_layers(model)
    arrays = dict(A.initializers(info.path))
    chains = _chains(model, layers)
    bounds: dict[str, np.ndarray] = {}  # clip node name -> per-channel upper bound
    stats = {"chains": len(chains), "pairs": 0, "absorbed": 0}
    for chain, clips in chains:
        ws = [arrays[ly.weight] for ly in chain]
        bs = [arrays.get(ly.bias) if ly.bias else None for ly in chain]
        groups = [ly.geom.groups for ly in chain]
        ws, bs, scales = E.equalize_chain(ws, bs, groups)
        for ly, w, b in zip(chain, ws, bs, strict=True):
            arrays[ly.weight] = w
            if ly.bias:
                arrays[ly.bias] = b
        for clip, s in zip(clips, scales, strict=True):
            if clip is not None:
                hi = np.inf if relu else 6.0
                bounds[clip.name] = E.scaled_bounds(0.0, hi, s)[1]
        stats["pairs"] += len(clips)
    if absorb:
        pairs = []
        for chain, clips in chains:
            for a, b, clip in zip(chain[:-1], chain[1:], clips, strict=True):
                one_by_one = b.geom.kernel == (1, 1) and not any(b.geom.padding)
                if clip is not None and one_by_one and a.bias and b.bias:
                    pairs.append((a, b, clip))
        tmp = out_path.with_suffix(".eq.onnx")
        _write(model, _changed(arrays, layers), bounds, tmp)
        sums = {a.node.output[0]: [0.0, 0.0, None, 0] for a, _, _ in pairs}
        for outs in capture(tmp, list(sums), calib):
            for t, z in outs.items():
                zc = z.transpose(1, 0, 2, 3).reshape(z.shape[1], -1).astype(np.float64)
                acc = sums[t]
                acc[0] = acc[0] + zc.sum(1)
                acc[1] = acc[1] + (zc**2).sum(1)
                acc[2] = zc.min(1) if acc[2] is None else np.minimum(acc[2], zc.min(1))
                acc[3] += zc.shape[1]
        tmp.unlink()
        for a, b, clip in pairs:
            s1, s2, mn, n = sums[a.node.output[0]]
            mean = s1 / n
            std = np.sqrt(np.maximum(s2 / n - mean**2, 0))
            c = E.high_bias_amount(mean, std, 3.0, minimum=mn)
            arrays[a.bias], arrays[b.bias] = E.absorb_high_bias(
                arrays[a.bias], arrays[b.weight], arrays[b.bias], c, b.geom.groups
            )
            bounds[clip.name] = bounds.get(clip.name, np.full(c.shape, 6.0)) - c
            stats["absorbed"] += int(np.count_nonzero(c))
    _write(model, _changed(arrays, layers), bounds, out_path)
    return out_path, stats


def _changed(arrays, layers) -> dict:
    """The conv weights and biases (the only initializers the transforms rewrite)."""
    names = {ly.weight for ly in layers} | {ly.bias for ly in layers if ly.bias}
    return {k: v for k, v in arrays.items() if k in names}


def _write(model, arrays, bounds, path: Path) -> None:
    """The model with new initializers and each bounded Clip as Relu -> Min(bound)."""
    import copy

    import onnx
    from onnx import helper, numpy_helper

    m = copy.deepcopy(model)
    for init in m.graph.initializer:
        if init.name in arrays:
            init.CopyFrom(
                numpy_helper.from_array(np.asarray(arrays[init.name], np.float32), init.name)
            )
    nodes = []
    for node in m.graph.node:
        if node.op_type == "Clip" and node.name in bounds:
            bname = f"{node.name}.bound"
            bound = np.asarray(bounds[node.name], np.float32).reshape(1, -1, 1, 1)
            m.graph.initializer.append(numpy_helper.from_array(bound, bname))
            mid = f"{node.output[0]}.relu"
            if np.all(np.isinf(bound)):
                nodes.append(helper.make_node("Relu", [node.input[0]], list(node.output)))
                continue
            nodes.append(helper.make_node("Relu", [node.input[0]], [mid], name=f"{node.name}.relu"))
            nodes.append(
                helper.make_node("Min", [mid, bname], list(node.output), name=f"{node.name}.min")
            )
        else:
            nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save(m, str(path))


def main(argv=None) -> None:
    import autoq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--eval", type=int, default=160)
    ap.add_argument("--skip", nargs="*", default=[], choices=["weights", "int8", "cle"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--relu", action="store_true", help="also CLE with ReLU6 -> ReLU (DFQ)")
    ap.add_argument("--max-rows", type=int, help="Hessian rows kept per image and layer")
    ap.add_argument(
        "--weight-per-tensor", action="store_true", help="CLE rows with per-tensor int8 weights"
    )
    args = ap.parse_args(argv)
    print(common.machine_summary())
    info, mod, params, calib, evals, ref = A.load(args.calib, args.eval)
    rows: list[A.Row] = []
    if "weights" not in args.skip or "int8" not in args.skip:
        import onnx

        layers = onnx_layers(onnx.load(str(info.path)))
        t0 = time.perf_counter()
        hs = hessians(info.path, layers, calib, args.max_rows)
        h_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        A.ort_outputs(info.path, calib)
        ort_pass = time.perf_counter() - t0
        variants, timings = weight_variants(info.path, layers, hs, args.variants)
        print(
            f"Hessians: {h_s:.1f} s ({len(layers)} layers, {len(calib)} samples; one ORT fp32 pass {ort_pass:.1f} s);"
            f" rounding: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}",
            flush=True,
        )
        if "weights" not in args.skip:
            for name, ints in variants.items():
                lookup = {k: v[0] for k, v in ints.items()}
                scales = {k: v[1] for k, v in ints.items()}
                row = A.weight_only_row(
                    info,
                    evals,
                    ref,
                    lambda n, w, g, lookup=lookup: lookup[n],
                    name=f"w8 only {name}",
                    scales=scales,
                )
                rows.append(row)
                print(f"  {row.name}: {row.metrics}", flush=True)
        if "int8" not in args.skip:
            r, calib_s = int8_rows(
                info, mod, params, calib, evals, ref, layers, hs, variants, timings
            )
            print(f"autoq calibration (default, topological): {calib_s:.1f} s", flush=True)
            rows += r
    if "cle" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = autoq.Config(progress=False)
            if args.weight_per_tensor:
                cfg = cfg.replace(weight=autoq.QuantSpec(symmetric=True, narrow_range=True))
                rows.append(
                    A.quantize_row("int8 per-tensor w", mod, params, calib, evals, ref, cfg, "")
                )
            cases = [(False, False), (True, False)]
            cases += [(False, True), (True, True)] if args.relu else []
            for absorb, relu in cases:
                t0 = time.perf_counter()
                path, stats = equalized_model(
                    info, calib, Path(tmp) / "cle.onnx", absorb=absorb, relu=relu
                )
                secs = time.perf_counter() - t0
                label = "CLE" + (" + high-bias absorption" if absorb else "")
                label += " (ReLU6 -> ReLU)" if relu else ""
                fp = A.agreement(ref, A.ort_outputs(path, evals))
                rows.append(
                    A.Row(f"fp32 {label}", fp, secs, f"float model after the transform: {stats}")
                )
                m2, p2 = autoq.from_onnx(str(path), {A.INPUT: A.SHAPE})
                label += " per-tensor w" if args.weight_per_tensor else ""
                row = A.quantize_row(f"int8 {label}", m2, p2, calib, evals, ref, cfg, "")
                rows.append(row)
                for r in rows[-2:]:
                    print(f"  {r.name}: {r.metrics}", flush=True)
    print()
    print(A.table(rows, len(calib), len(evals)))


if __name__ == "__main__":
    main()
