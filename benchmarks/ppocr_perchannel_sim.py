"""Would per-channel activation scales move PP-OCRv4 det's text map? A simulation on the
ONNX graph, before building any realize support (issue 16).

An independent fake-quantized copy of the fp32 ONNX model run by ONNX Runtime (graph
optimizations off, so QuantizeLinear -> DequantizeLinear pairs compute in float exactly as
written): every Conv / ConvTranspose weight rounded to int8 per output channel (symmetric,
round to nearest; biases float), and an int8 QuantizeLinear/DequantizeLinear pair on the
tensors autoq quantizes (the model input and every operator output that is not only read by
an affine with constants, a bias add, a BatchNormalization or a Relu, which autoq fuses into
the producing layer; the inside of a hardswish, ``Add 3 -> Clip -> Mul -> Div 6``, is one
table lookup). Activation ranges: the ``--percentile`` (99.99) two-sided percentile of the
calibration crops' values, per tensor or per channel (axis 1), from histograms.

Arms (the per-channel set; everything else per tensor):

* ``tensor``: none (autoq today, up to GPTQ / bias correction, which both arms lack);
* ``hs_inputs``: the inputs of the hardswish tables whose producer is a conv (a per-channel
  requantize output scale and one table per channel);
* ``dw_inputs``: the tensors depthwise convs read (a per-channel input scale the depthwise
  weights absorb; per-channel table outputs where a hardswish writes them);
* ``chain``: both (the conv -> hardswish -> depthwise chains);
* ``conv_inputs``: ``chain`` plus every tensor read only by convs (foldable into the weights
  as in cross-layer equalization, the zero points into the bias);
* ``all``: every quantized tensor (an upper bound; not realizable with per-tensor adds).

IoU@0.3 of the maps > 0.3 against ONNX Runtime fp32 on the evaluation crops (all, without
image ``--image``, that image) and on the search crops (16 crops of the calibration photos,
seed 11). Numbers only.

    python benchmarks/ppocr_perchannel_sim.py --calib 40 --eval 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import ppocr_budget

TMP = Path("/tmp/ppocr_perchannel_sim")
FUSED = ("Relu", "BatchNormalization")  # autoq folds these into the producing layer
ARMS = ("tensor", "hs_inputs", "dw_inputs", "chain", "conv_inputs", "all")


def hardswish_groups(nodes, inits) -> tuple[set, dict]:
    """Internal tensors of the ``Add 3 -> Clip -> Mul(x, .) -> Div 6`` hardswish groups and
    {node index: group input} for the nodes in them."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    internal, member = set(), {}
    for i, n in enumerate(nodes):
        if n.op_type != "Clip" or n.input[0] not in producer:
            continue
        add = nodes[producer[n.input[0]]]
        x = [t for t in add.input if t not in inits]
        if add.op_type != "Add" or len(x) != 1:
            continue
        muls = [j for j, m in enumerate(nodes) if m.op_type == "Mul" and n.output[0] in m.input]
        divs = [
            j
            for j, d in enumerate(nodes)
            if muls and d.op_type == "Div" and nodes[muls[0]].output[0] in d.input
        ]
        if len(muls) != 1 or len(divs) != 1 or x[0] not in nodes[muls[0]].input:
            continue
        group = [producer[n.input[0]], i, muls[0]]
        internal.update(nodes[j].output[0] for j in group)
        member.update({j: x[0] for j in [*group, divs[0]]})
    return internal, member


def quant_points(model) -> tuple[list[str], dict[str, set]]:
    """The tensors to fake-quantize (graph input first) and the per-channel sets of the arms."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    nodes = list(g.node)
    internal, member = hardswish_groups(nodes, inits)
    consumers: dict[str, list] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            consumers.setdefault(t, []).append(i)

    def fused(j: int) -> bool:
        n = nodes[j]
        if j in member:
            return False
        if n.op_type in FUSED:
            return True
        return n.op_type in ("Mul", "Add") and any(t in inits for t in n.input)

    outputs = {o.name for o in g.output}
    points = [i.name for i in g.input if i.name not in inits]
    for n in nodes:
        for t in n.output:
            readers = consumers.get(t, [])
            if t in internal or t in outputs or not readers or all(fused(j) for j in readers):
                continue
            points.append(t)

    def depthwise(j: int) -> bool:
        n = nodes[j]
        grp = [a.i for a in n.attribute if a.name == "group"]
        return n.op_type == "Conv" and bool(grp) and grp[0] > 1

    hs_inputs = set(member.values())
    hs_in = {t for t in points if t in hs_inputs and _from_conv(t, nodes, inits)}
    dw_in = {t for t in points if any(depthwise(j) for j in consumers.get(t, []))}
    chain = hs_in | dw_in
    conv_only = {
        t
        for t in points
        if all(nodes[j].op_type in ("Conv", "ConvTranspose") for j in consumers.get(t, []))
    }
    sets = {
        "tensor": set(),
        "hs_inputs": hs_in,
        "dw_inputs": dw_in,
        "chain": chain,
        "conv_inputs": chain | conv_only,
        "all": set(points),
    }
    return points, sets


def _from_conv(t: str, nodes, inits) -> bool:
    """``t`` is a conv's output, possibly through affines with constants."""
    producer = {o: n for n in nodes for o in n.output}
    while t in producer:
        n = producer[t]
        if n.op_type in ("Conv", "ConvTranspose"):
            return True
        data = [i for i in n.input if i not in inits]
        if n.op_type not in ("Mul", "Add") or len(data) != 1:
            return False
        t = data[0]
    return False


def with_outputs(model, names):
    """A copy of ``model`` that also returns the tensors ``names``."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for t in names:
        if t not in have:
            m.graph.output.append(
                onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
            )
    return m


class Ranges:
    """Streaming two-sided percentiles per channel and per tensor (two passes: min/max,
    then histograms of ``bins`` bins over it)."""

    def __init__(self, bins: int = 2048):
        self.bins, self.lo, self.hi, self.hist, self.thist = bins, {}, {}, {}, {}

    def see_range(self, t: str, x: np.ndarray) -> None:
        c = x.swapaxes(0, 1).reshape(x.shape[1], -1)
        lo, hi = c.min(1), c.max(1)
        self.lo[t] = np.minimum(self.lo.get(t, lo), lo)
        self.hi[t] = np.maximum(self.hi.get(t, hi), hi)

    def see_values(self, t: str, x: np.ndarray) -> None:
        c = x.swapaxes(0, 1).reshape(x.shape[1], -1).astype(np.float64)
        lo, hi, b = self.lo[t][:, None], self.hi[t][:, None], self.bins
        idx = np.clip(((c - lo) / np.maximum(hi - lo, 1e-12) * b).astype(np.int64), 0, b - 1)
        idx += np.arange(c.shape[0])[:, None] * b
        h = np.bincount(idx.ravel(), minlength=c.shape[0] * b).reshape(c.shape[0], b)
        self.hist[t] = self.hist.get(t, 0) + h
        tlo, thi = self.lo[t].min(), self.hi[t].max()
        ti = np.clip(((c - tlo) / max(thi - tlo, 1e-12) * b).astype(np.int64), 0, b - 1)
        self.thist[t] = self.thist.get(t, 0) + np.bincount(ti.ravel(), minlength=b)

    @staticmethod
    def _cut(h: np.ndarray, lo: float, hi: float, p: float) -> tuple[float, float]:
        cum = np.cumsum(h) / max(h.sum(), 1)
        edges = np.linspace(lo, hi, len(h) + 1)
        a = edges[int(np.searchsorted(cum, 1 - p))]
        z = edges[min(int(np.searchsorted(cum, p)) + 1, len(h))]
        return min(a, 0.0), max(z, 0.0)

    def tensor(self, t: str, p: float) -> tuple[float, float]:
        return self._cut(self.thist[t], self.lo[t].min(), self.hi[t].max(), p)

    def channels(self, t: str, p: float) -> tuple[np.ndarray, np.ndarray]:
        cuts = [
            self._cut(h, lo, hi, p)
            for h, lo, hi in zip(self.hist[t], self.lo[t], self.hi[t], strict=True)
        ]
        return np.array([c[0] for c in cuts]), np.array([c[1] for c in cuts])


def int8_qparams(lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric int8 scale and zero point covering [lo, hi] (lo <= 0 <= hi)."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    scale = np.maximum(hi - lo, 1e-8) / 255.0
    zp = np.clip(np.round(-128 - lo / scale), -128, 127)
    return scale.astype(np.float32), zp.astype(np.int8)


def fake_quant_model(model, points, per_channel: set, ranges: Ranges, p: float):
    """The QDQ copy of ``model``: int8 weights per output channel, a Q/DQ pair on every
    point (per channel on axis 1 for the ``per_channel`` ones)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    weights = {}
    for n in g.node:
        if n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1:
            weights[n.input[1]] = 1 if n.op_type == "ConvTranspose" else 0
    for init in g.initializer:
        if init.name in weights:
            w = numpy_helper.to_array(init).astype(np.float32)
            ax = weights[init.name]
            wc = np.moveaxis(w, ax, 0).reshape(w.shape[ax], -1)
            s = np.maximum(np.abs(wc).max(1), 1e-12) / 127.0
            q = np.clip(np.round(wc / s[:, None]), -127, 127) * s[:, None]
            w = np.moveaxis(q.reshape(np.moveaxis(w, ax, 0).shape), 0, ax)
            init.CopyFrom(numpy_helper.from_array(w.astype(np.float32), init.name))
    new_nodes = []
    renamed = {}
    for t in points:
        if t in per_channel:
            s, z = int8_qparams(*ranges.channels(t, p))
            attrs = {"axis": 1}
        else:
            s, z = int8_qparams(*ranges.tensor(t, p))
            attrs = {}
        sn, zn, qn, dn = f"{t}.qs", f"{t}.qz", f"{t}.q", f"{t}.dq"
        g.initializer.extend([numpy_helper.from_array(s, sn), numpy_helper.from_array(z, zn)])
        new_nodes.append((t, [
            onnx.helper.make_node("QuantizeLinear", [t, sn, zn], [qn], **attrs),
            onnx.helper.make_node("DequantizeLinear", [qn, sn, zn], [dn], **attrs),
        ]))  # fmt: skip
        renamed[t] = dn
    for n in g.node:
        for k, t in enumerate(n.input):
            if t in renamed:
                n.input[k] = renamed[t]
    order = []
    pending = dict(new_nodes)
    for t in [i.name for i in g.input]:
        order += pending.pop(t, [])
    for n in g.node:
        order.append(n)
        for t in n.output:
            order += pending.pop(t, [])
    del g.node[:]
    g.node.extend(order)
    return m


def channel_means(sess, names, samples) -> dict[str, np.ndarray]:
    """Per-channel (axis 1) means of the tensors ``names`` over ``samples``."""
    tot: dict[str, np.ndarray] = {}
    for s in samples:
        for t, x in zip(names, sess.run(names, s), strict=True):
            tot[t] = tot.get(t, 0) + x.mean(axis=(0, 2, 3), dtype=np.float64)
    return {t: v / len(samples) for t, v in tot.items()}


def conv_outputs(model) -> list[str]:
    return [n.output[0] for n in model.graph.node if n.op_type == "Conv"]


def bias_corrected(qmodel, fp_means: dict, samples, per_block: int, name: str):
    """``qmodel`` with every Conv's bias lowered by its output's mean error (fake-quantized
    minus fp32 ``fp_means``, per channel, over ``samples``): an empirical bias correction,
    in topological order. The convs are cut into groups of ``per_block`` consecutive ones;
    one pass per group measures that group's errors with every earlier group already
    corrected (one pass for all of them at once diverges: each conv would also undo the
    errors its corrected producers no longer make)."""
    from onnx import numpy_helper

    g = qmodel.graph
    convs = {n.output[0]: n for n in g.node if n.op_type == "Conv"}
    shapes = {i.name: tuple(i.dims) for i in g.initializer}
    for t, n in convs.items():
        if len(n.input) < 3 or not n.input[2]:
            bname = f"{t}.ebc_bias"
            zeros = np.zeros(shapes[n.input[1]][0], np.float32)
            g.initializer.append(numpy_helper.from_array(zeros, bname))
            if len(n.input) < 3:
                n.input.append(bname)
            else:
                n.input[2] = bname
    inits = {i.name: i for i in g.initializer}
    order = list(convs)
    for k in range(0, len(order), max(1, per_block)):
        names = order[k : k + max(1, per_block)]
        means = channel_means(session(with_outputs(qmodel, names), name), names, samples)
        for t in names:
            b = inits[convs[t].input[2]]
            arr = numpy_helper.to_array(b).astype(np.float64) - (means[t] - fp_means[t])
            b.CopyFrom(numpy_helper.from_array(arr.astype(np.float32), b.name))
    return qmodel


def session(model, name: str):
    """An ONNX Runtime session (graph optimizations off, 2 threads) of ``model``."""
    import onnx

    TMP.mkdir(exist_ok=True)
    path = TMP / f"{name}.onnx"
    onnx.save(model, str(path))
    return common.ort_session(path, threads=2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.ppocr_data_args(ap)
    ap.add_argument("--percentile", type=float, default=99.99)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--skip", nargs="*", default=[], help="tensors left in float (diagnosis)")
    ap.add_argument("--fp", type=int, default=4, help="false-positive crops (ppocr_budget rule)")
    ap.add_argument("--ebc-crops", type=int, default=16, help="first N calibration crops")
    ap.add_argument(
        "--ebc", type=int, default=0, help="empirical bias correction, N convs a pass (0: none)"
    )
    args = ap.parse_args(argv)
    import onnx

    t0 = time.perf_counter()
    print(
        common.machine_summary(), "; commit", ppocr_budget.commit(), "; load", ppocr_budget.load()
    )
    info = common.find_model("ppocr_det", det_size=args.det_size)
    model = onnx.load(str(info.path))
    points, sets = quant_points(model)
    unknown = [t for t in args.skip if t not in points]
    if unknown:
        raise SystemExit(f"--skip: {unknown} are not quantized tensors; first ones: {points[:8]}")
    points = [t for t in points if t not in args.skip]
    sets = {k: v - set(args.skip) for k, v in sets.items()}
    print(
        f"{len(points)} quantized tensors; per-channel sets:", {k: len(v) for k, v in sets.items()}
    )
    calib = common.make_dataset(info, "calib", args.calib, seed=args.calib_seed)
    evals = list(common.make_dataset(info, "eval", args.eval))
    search = list(common.make_dataset(info, "calib", args.search, seed=11))
    fp32 = common.ort_session(info.path, threads=2)
    fp, lines = ppocr_budget.false_positive_crops(info, fp32, 80, args.fp, 300)
    print(f"false-positive crops: {len(fp)} of {len(lines)} qualifying", flush=True)
    search_sets = {"search crops": search, "false-positive crops": fp}
    refs = {k: common.ort_outputs(fp32, v) for k, v in search_sets.items() if v}
    ref = common.ort_outputs(fp32, evals)
    probe = session(with_outputs(model, points), "probe")
    ranges = Ranges()
    for see in (ranges.see_range, ranges.see_values):
        for s in calib:
            for t, x in zip(points, probe.run(points, s), strict=True):
                see(t, x)
    print(f"ranges of {len(calib)} crops: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.ebc:
        convs = conv_outputs(model)
        ebc_data = list(calib)[: args.ebc_crops]
        fp_means = channel_means(session(with_outputs(model, convs), "probe"), convs, ebc_data)
    p, i = args.percentile / 100.0, args.image
    for arm in args.arms:
        qmodel = fake_quant_model(model, points, sets[arm], ranges, p)
        if args.ebc:
            qmodel = bias_corrected(qmodel, fp_means, ebc_data, args.ebc, arm)
            arm = f"{arm}+ebc"
        sess = session(qmodel, arm)
        n_pc = len(sets[arm.split("+")[0]])
        outs = common.ort_outputs(sess, evals)
        f = common.fidelity("detector", ref, outs)
        rest = common.fidelity("detector", ref[:i] + ref[i + 1 :], outs[:i] + outs[i + 1 :])
        one = common.fidelity("detector", [ref[i]], [outs[i]])
        more = []
        for k, r in refs.items():
            o = common.ort_outputs(sess, search_sets[k])
            per = [
                round(common.fidelity("detector", [a], [b])["agree"], 3)
                for a, b in zip(r, o, strict=True)
            ]
            more.append(f"{k} {100 * common.fidelity('detector', r, o)['agree']:.1f}% {per}")
        print(
            f"ARM {arm} ({n_pc} tensors per channel): IoU@0.3 {100 * f['agree']:.1f}% "
            f"cos {f['cos']:.4f}; without image {i} {100 * rest['agree']:.1f}%; image {i} "
            f"{one['agree']:.3f}; {'; '.join(more)}; {time.perf_counter() - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
