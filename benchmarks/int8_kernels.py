"""autoq's packed int8 CPU kernels (``autoq.compile(cpu_kernels=True)``, no tuning) against
autoq's generic lowering and ONNX Runtime, on ResNet-50 (open_nsfw) and on single ops.

Rows (median latency in ms, 1 thread and 2 threads, measured in this run):

* ResNet-50 (and ``--models ppocr_det,minilm``): ONNX Runtime fp32 and int8 (``quantize_static`` QDQ, per-channel int8 weights,
  uint8 activations = u8s8, MinMax, graph optimizations on, idle threads not spinning),
  autoq int8 (default config) with and without the kernels (the two must agree bit for bit),
  and the ratio to ORT int8; ORT fp32, ORT int8 and autoq with kernels run interleaved
  (one call each per round, medians), so that load changes on a shared box hit all alike;
  then both ORT models again with ORT's default spinning threads, alone (faster with 2
  threads, unfair to an interleaved peer); the ratios are to the faster ORT int8 row;
* single ops: conv 3x3 256->256 14x14 (autoq ``qnn.conv2d`` vs ORT ``QLinearConv`` u8s8) and
  GEMM 196x2304x256 (autoq ``qnn.dense`` vs ORT ``MatMulInteger`` u8s8).

Run:  python benchmarks/int8_kernels.py [--calib 16] [--repeats 20] [--skip-model]
      [--models resnet50,ppocr_det,minilm] [--blocked] [--avx2]
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

THREADS = (1, 2)


def interleaved(fns: dict, repeats: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """(median, min) ms of each callable, the callables run in turn (one call each per
    round): a change of the machine's load hits all of them alike (the box is shared)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: (float(np.median(ts) * 1e3), float(np.min(ts) * 1e3)) for key, ts in times.items()}


def _tvm_latency(vm, args, threads: int, repeats: int) -> float:
    common.TvmRunner.set_threads(threads)
    return common.median_ms(lambda: vm["main"](*args), repeats)


def _ort_latency(path, feed, threads: int, repeats: int) -> float:
    sess = common.ort_session(path, threads=threads, optimize=True)
    return common.median_ms(lambda: sess.run(None, feed), repeats)


def vs_ort(fp32_path, int8_path, sample, tvm_fns: dict, threads: int, repeats: int, times, log):
    """ORT fp32, ORT int8 (graph optimizations on, idle threads not spinning) and the
    ``tvm_fns`` callables, interleaved at ``threads`` threads, then both ORT models with
    ORT's default spinning threads, alone; medians into ``times[key][threads]``."""
    common.TvmRunner.set_threads(threads)
    sessions = {
        "ORT fp32": common.ort_session(fp32_path, threads, True, spinning=False),
        "ORT int8 u8s8": common.ort_session(int8_path, threads, True, spinning=False),
    }
    fns = {key: functools.partial(sess.run, None, sample) for key, sess in sessions.items()}
    fns.update(tvm_fns)
    for key, (median, least) in interleaved(fns, repeats).items():
        times.setdefault(key, {})[threads] = median
        log(f"{threads} thread(s) {key}: median {median:.2f} ms, min {least:.2f} ms")
    # ORT's own default lets idle threads spin, which is faster with 2+ threads but steals
    # cores from an interleaved peer: measured alone, after the interleaved rounds
    for key, path in (("ORT fp32", fp32_path), ("ORT int8 u8s8", int8_path)):
        sess = common.ort_session(path, threads, True, spinning=True)
        median = common.median_ms(functools.partial(sess.run, None, sample), repeats)
        times.setdefault(f"{key} (spinning, alone)", {})[threads] = median
        log(f"{threads} thread(s) {key} (spinning, alone): median {median:.2f} ms")


def latency_row(name, times, ref=None):
    cells = [name] + [f"{times[t]:.2f}" for t in THREADS]
    if ref is not None:
        cells += [f"{times[t] / ref[t]:.2f}x" for t in THREADS]
    else:
        cells += ["", ""]
    return cells


def print_latency_table(title, rows, ref_name):
    print(f"\n### {title}\n")
    heads = ["runtime", *(f"ms {t}T" for t in THREADS), *(f"vs {ref_name} {t}T" for t in THREADS)]
    print("| " + " | ".join(heads) + " |")
    print("|" + " --- |" * len(heads))
    for r in rows:
        print("| " + " | ".join(r) + " |")


# ------------------------------------------------------------------------------ ResNet-50


def bench_model(
    name: str,
    calib_n: int,
    repeats: int,
    log,
    skip_generic: bool = False,
    avx2: bool = False,
    blocked: bool = False,
) -> None:
    import tvm
    from tvm import relax

    import autoq
    from autoq.cpu.isa import kernel_isa

    info = common.find_model(name)
    calib = common.make_dataset(info, "calib", calib_n)
    sample = common.make_dataset(info, "eval", 2)[0]
    target = autoq.default_target()
    with tempfile.TemporaryDirectory(prefix="autoq-kernels-") as tmp:
        ort_int8 = Path(tmp) / "int8.onnx"
        common.ort_quantize(info, calib.samples, "minmax", ort_int8)
        t0 = time.perf_counter()
        mod, params = autoq.from_onnx(info.path, input_shapes=dict(info.input_shapes))
        qmod = autoq.quantize(mod, params, calib.samples, autoq.Config())
        log(f"autoq quantize ({calib_n} samples): {time.perf_counter() - t0:.1f} s")
        vms = {}
        for use in (True,) if skip_generic else (True, False):
            t0 = time.perf_counter()
            vms[use] = relax.VirtualMachine(autoq.compile(qmod, target, cpu_kernels=use), tvm.cpu())
            log(f"compile cpu_kernels={use}: {time.perf_counter() - t0:.1f} s")
        no_amx = _without_amx(target)
        if no_amx is not None:
            vms["no amx"] = relax.VirtualMachine(autoq.compile(qmod, no_amx), tvm.cpu())
        if avx2:
            vms["avx2"] = relax.VirtualMachine(autoq.compile(qmod, AVX2_TARGET), tvm.cpu())
        # the blocked layout the target does not use by default (VNNI: on, AVX2: off)
        other = not kernel_isa(target).blocked if kernel_isa(target) else True
        if blocked:
            ex = autoq.compile(qmod, target, blocked_layout=other)
            vms["blocked"] = relax.VirtualMachine(ex, tvm.cpu())
        names = [p.name for p in qmod["main"].params]
        args = [tvm.runtime.tensor(sample[n]) for n in names]
        if avx2:
            same = np.array_equal(
                first_output(vms[True]["main"](*args)), first_output(vms["avx2"]["main"](*args))
            )
            log(f"autoq int8 outputs of the AVX2 kernels identical: {same}")
        if blocked:
            same = np.array_equal(
                first_output(vms[True]["main"](*args)), first_output(vms["blocked"]["main"](*args))
            )
            log(f"autoq int8 outputs with blocked_layout={other} identical: {same}")
        if "no amx" in vms:
            same = np.array_equal(
                first_output(vms[True]["main"](*args)), first_output(vms["no amx"]["main"](*args))
            )
            log(f"autoq int8 outputs with and without AMX identical: {same}")
        if not skip_generic:
            same = np.array_equal(
                first_output(vms[True]["main"](*args)), first_output(vms[False]["main"](*args))
            )
            log(f"autoq int8 outputs with and without kernels identical: {same}")
        times: dict[str, dict[int, float]] = {}
        for t in THREADS:
            tvm_fns = {"autoq int8, kernels": functools.partial(vms[True]["main"], *args)}
            if "no amx" in vms:
                tvm_fns["autoq int8, kernels without AMX"] = functools.partial(
                    vms["no amx"]["main"], *args
                )
            if blocked:
                tvm_fns[f"autoq int8, kernels, blocked_layout={other}"] = functools.partial(
                    vms["blocked"]["main"], *args
                )
            if avx2:
                tvm_fns[f"autoq int8, AVX2 kernels (mcpu={AVX2_TARGET['mcpu']})"] = (
                    functools.partial(vms["avx2"]["main"], *args)
                )
            vs_ort(info.path, ort_int8, sample, tvm_fns, t, repeats, times, log)
            if not skip_generic:
                times.setdefault("autoq int8, generic lowering", {})[t] = common.median_ms(
                    functools.partial(vms[False]["main"], *args), 2, warmup=1
                )
        log(f"load average after the timings: {os.getloadavg()}")
    # the reference: ORT int8's faster configuration at each thread count
    spin = times["ORT int8 u8s8 (spinning, alone)"]
    ref = {t: min(v, spin[t]) for t, v in times["ORT int8 u8s8"].items()}
    rows = [latency_row(key, v, ref) for key, v in times.items()]
    title = common.MODEL_TITLES.get(name, name)
    print_latency_table(
        f"{title}, batch 1, target mcpu={common.target_mcpu(target)}", rows, "best ORT int8"
    )


# an AVX2-only target (no AVX-512) that runs on any x86-64 CPU with AVX2 + FMA: the kernel
# path of Zen 3 machines, measurable on an AVX-512 machine (ORT keeps its own best kernels)
AVX2_TARGET = {"kind": "llvm", "mcpu": "haswell"}


def _without_amx(target):
    """``target`` without its AMX ``mattr`` (VNNI dense kernels), None if it has no AMX."""
    import tvm

    from autoq.cpu.amx import target_has_amx

    if not target_has_amx(target):
        return None
    mattr = [str(a) for a in (target.attrs.get("mattr") or ()) if "amx" not in str(a)]
    spec = {"kind": "llvm", "mcpu": str(target.attrs["mcpu"])}
    return tvm.target.Target({**spec, "mattr": mattr} if mattr else spec)


def first_output(out) -> np.ndarray:
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


# ------------------------------------------------------------------------------- single ops


def _onnx_model(nodes, inputs, outputs, inits):
    from onnx import helper

    graph = helper.make_graph(nodes, "op", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _ort_qlinearconv(w: np.ndarray, x_shape):
    from onnx import TensorProto, helper, numpy_helper

    oc = w.shape[0]
    inits = [
        numpy_helper.from_array(np.float32(0.02), "xs"),
        numpy_helper.from_array(np.uint8(131), "xz"),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.full(oc, 0.01, np.float32), "ws"),
        numpy_helper.from_array(np.zeros(oc, np.int8), "wz"),
        numpy_helper.from_array(np.float32(0.5), "ys"),
        numpy_helper.from_array(np.uint8(128), "yz"),
    ]
    node = helper.make_node(
        "QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"], pads=[1, 1, 1, 1]
    )
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, None)
    return _onnx_model([node], [x], [y], inits)


def _ort_matmulinteger(w_kn: np.ndarray, m: int):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(w_kn, "b"), numpy_helper.from_array(np.uint8(131), "az")]
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    a = helper.make_tensor_value_info("a", TensorProto.UINT8, [m, w_kn.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, None)
    return _onnx_model([node], [a], [y], inits)


def _qnn_module(op, x_shape, w: np.ndarray, **attrs):
    """main(x: int8) = qnn.<op>(x, const w) (int32), per-channel weight scales, zp 3."""
    import tvm
    from tvm import relax

    from autoq import qnn

    x = relax.Var("x", relax.TensorType(x_shape, "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            call = getattr(qnn, op)(
                x,
                relax.const(w),
                relax.const(np.float32(0.02)),
                relax.const(np.int32(3)),
                relax.const(np.full(w.shape[0], 0.01, np.float32)),
                relax.const(np.zeros(w.shape[0], np.int32)),
                **attrs,
            )
            out = bb.emit_output(call)
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def bench_ops(repeats: int) -> None:
    import tvm
    from tvm import relax

    import autoq

    rng = np.random.default_rng(0)
    target = autoq.default_target()
    w_conv = rng.integers(-128, 128, (256, 256, 3, 3)).astype(np.int8)
    w_dense = rng.integers(-128, 128, (256, 2304)).astype(np.int8)
    cases = [
        (
            "conv 3x3 256->256 14x14",
            _qnn_module("conv2d", (1, 256, 14, 14), w_conv, padding=(1, 1, 1, 1)),
            (1, 256, 14, 14),
            _ort_qlinearconv(w_conv, (1, 256, 14, 14)),
            "x",
            "ORT QLinearConv u8s8",
        ),
        (
            "GEMM 196x2304x256",
            _qnn_module("dense", (196, 2304), w_dense),
            (196, 2304),
            _ort_matmulinteger(np.ascontiguousarray(w_dense.T), 196),
            "a",
            "ORT MatMulInteger u8s8",
        ),
    ]
    tmp = tempfile.TemporaryDirectory(prefix="autoq-kernels-ops-")
    for title, mod, shape, onnx_model, feed_name, ort_name in cases:
        onnx_path = Path(tmp.name) / f"{feed_name}.onnx"
        onnx_path.write_bytes(onnx_model.SerializeToString())
        x8 = rng.integers(-128, 128, shape).astype(np.int8)
        args = [tvm.runtime.tensor(x8)]
        vms = {
            use: relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=use), tvm.cpu())
            for use in (True, False)
        }
        no_amx = _without_amx(target)
        if no_amx is not None:
            vms["no amx"] = relax.VirtualMachine(autoq.compile(mod, no_amx), tvm.cpu())
        same = np.array_equal(vms[True]["main"](*args).numpy(), vms[False]["main"](*args).numpy())
        feed = {feed_name: (x8.astype(np.int16) + 128).astype(np.uint8)}
        times = {ort_name: {}, "autoq kernels": {}, "autoq generic lowering": {}}
        for t in THREADS:
            times[ort_name][t] = _ort_latency(onnx_path, feed, t, repeats)
            times["autoq kernels"][t] = _tvm_latency(vms[True], args, t, repeats)
            times["autoq generic lowering"][t] = _tvm_latency(vms[False], args, t, 3)
            if "no amx" in vms:
                key = "autoq kernels without AMX"
                times.setdefault(key, {})[t] = _tvm_latency(vms["no amx"], args, t, repeats)
        rows = [latency_row(name, v, times[ort_name]) for name, v in times.items()]
        print_latency_table(f"{title} (kernels == generic lowering: {same})", rows, "ORT")
    tmp.cleanup()


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=16, help="calibration samples (ResNet-50)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per row (median)")
    p.add_argument("--skip-model", action="store_true", help="single ops only")
    p.add_argument("--skip-ops", action="store_true", help="models only")
    p.add_argument(
        "--skip-generic", action="store_true", help="no rows for autoq's generic lowering"
    )
    p.add_argument(
        "--avx2",
        action="store_true",
        help=f"add a row for autoq's AVX2 kernels (mcpu={AVX2_TARGET['mcpu']}) on this CPU",
    )
    p.add_argument(
        "--blocked",
        action="store_true",
        help="add a row for the kernels with the blocked layout the target does not default to",
    )
    p.add_argument(
        "--models", default="resnet50", help=f"comma-separated, of {','.join(common.MODEL_NAMES)}"
    )
    common.add_page_option(p)
    args = p.parse_args(argv)

    def log(msg):
        print(f"# {msg}", flush=True)

    print("## autoq int8 CPU kernels (no tuning) vs ONNX Runtime\n")
    print(common.machine_summary())
    import autoq
    from autoq.cpu.isa import kernel_isa

    target = autoq.default_target()
    isa = kernel_isa(target)
    mattr = ",".join(str(a) for a in (target.attrs.get("mattr") or ()))
    kernels = (
        f"{isa.name}{' + AMX dense/conv' if isa and isa.amx else ''}" if isa else "none (generic)"
    )
    print(f"\ntarget mcpu={common.target_mcpu(target)} mattr=[{mattr}], kernels: {kernels}")
    if not args.skip_ops:
        bench_ops(args.repeats)
    if not args.skip_model:
        for name in args.models.split(","):
            bench_model(
                name, args.calib, args.repeats, log, args.skip_generic, args.avx2, args.blocked
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
