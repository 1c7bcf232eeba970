"""Blocked int8 activations between packed convs (``autoq.compile(blocked_layout=True)``)
against NCHW between the kernels (``blocked_layout=False``), with and without the residual
epilogue (``residual_epilogue``: residual adds in the conv kernel, plain int8 adds on
blocked tensors), same process, interleaved.

Per model (ResNet-50 open_nsfw, PP-OCRv4 det by default; ``efficientnet_lite0`` with the
packages of ``benchmarks/accuracy.py``):

1. structure: conv kernel calls, how many read a blocked tensor (their pack is gone or is a
   pad of the blocked tensor), conv kernels with a pack stage, residual conv kernels, the
   other calls, in each build;
2. outputs of the two builds compared bit for bit;
3. per-call profile at 1 thread (a timer around each VM call, the minimum of
   ``--profile-runs`` runs per function): total, conv kernels (``autoq_conv2d*``), the rest;
4. interleaved latency (one call of each build per round, medians) at 1 and 2 threads,
   with the load average and the commit; ratios against the blocked build without the
   residual epilogue (``BEFORE``).

Run:  python benchmarks/blocked_layout.py [--models resnet50,ppocr_det] [--calib 8]
      [--repeats 30] [--profile-runs 5] [--top 6] [--avx2] [--builds all|residual]
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import int8_kernels
import tuned_latency

# build name -> autoq.compile options
BUILDS = {
    "NCHW between kernels": {"blocked_layout": False, "residual_epilogue": False},
    "NCHW + residual epilogue": {"blocked_layout": False, "residual_epilogue": True},
    "blocked, residual adds as edges": {"blocked_layout": True, "residual_epilogue": False},
    "blocked + residual epilogue": {"blocked_layout": True, "residual_epilogue": True},
}
BEFORE = "blocked, residual adds as edges"
EFFNET = "efficientnet_lite0"  # from benchmarks/accuracy.py (needs its extra packages)
RESIDUAL_BUILDS = (BEFORE, "blocked + residual epilogue")


def structure(qmod, target, options: dict) -> dict[str, int]:
    """Conv kernel calls, those reading a blocked (5-D) tensor, kernels with a pack stage,
    residual conv kernels, and the other calls of the lowered ``main``."""
    import tvm

    from autoq.cpu.lowering import lower_to_cpu_kernels
    from autoq.ir.toolkit import bindings, is_call, shape_of

    lowered = lower_to_cpu_kernels(qmod, tvm.target.Target(target), **options)
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    convs = [c for c in calls if c.args[0].name_hint.startswith("autoq_conv2d")]
    packs = sum(
        "autoq_pack" in lowered[c.args[0]].script(show_meta=False)
        for c in convs  # one function per call
    )
    reads = sum(len(shape_of(c.args[1][0])) == 5 for c in convs)
    return {
        "conv calls": len(convs),
        "read blocked": reads,
        "with a pack stage": packs,
        "residual": sum("residual" in c.args[0].name_hint for c in convs),
        "other calls (before fusion)": len(calls) - len(convs),
    }


def _split(rows) -> tuple[float, float, float]:
    total = sum(us for _, us, _ in rows)
    conv = sum(us for n, us, _ in rows if "autoq_conv2d" in n)
    return total / 1e3, conv / 1e3, (total - conv) / 1e3


def commit() -> str:
    here = Path(__file__).resolve().parent
    cmd = ["git", "-C", str(here), "rev-parse", "--short", "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()


def _model(name: str, n_calib: int):
    """(ModelInfo, calibration samples, one evaluation sample) of ``name``."""
    if name == EFFNET:
        import accuracy

        return (
            accuracy.find_model(),
            accuracy.make_data("calib", n_calib),
            accuracy.make_data("eval", 1)[0],
        )
    info = common.find_model(name)
    calib = common.make_dataset(info, "calib", n_calib)
    return info, calib.samples, common.make_dataset(info, "eval", 2)[0]


def bench(name: str, args, log) -> None:
    import tvm
    from tvm import relax

    import autoq

    info, samples, sample = _model(name, args.calib)
    target = tvm.target.Target(int8_kernels.AVX2_TARGET) if args.avx2 else autoq.default_target()
    mod, params = autoq.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    qmod = autoq.quantize(mod, params, samples, autoq.Config())
    title = common.MODEL_TITLES.get(name, "EfficientNet-Lite0" if name == EFFNET else name)
    print(f"\n### {title}, batch 1, target mcpu={common.target_mcpu(target)}, commit {commit()}\n")
    builds = {k: v for k, v in BUILDS.items() if args.builds == "all" or k in RESIDUAL_BUILDS}
    for key, options in builds.items():
        print(f"- {key}: {structure(qmod, target, options)}")
    vms = {
        key: relax.VirtualMachine(autoq.compile(qmod, target, **options), tvm.cpu())
        for key, options in builds.items()
    }
    names = [p.name for p in qmod["main"].params]
    targs = [tvm.runtime.tensor(sample[n]) for n in names]
    outs = [int8_kernels.first_output(vm["main"](*targs)) for vm in vms.values()]
    print(f"- outputs identical: {all(np.array_equal(outs[0], o) for o in outs[1:])}")
    common.TvmRunner.set_threads(1)
    print(
        f"- per-call profile, 1 thread, min of {args.profile_runs} runs (load {os.getloadavg()}):"
    )
    for key, vm in vms.items():
        rows = tuned_latency.profile_calls(vm, targs, args.profile_runs)
        total, conv, rest = _split(rows)
        print(f"  - {key}: total {total:.2f} ms, conv kernels {conv:.2f} ms, rest {rest:.2f} ms")
        top = ", ".join(f"`{n}` x{c} {us / 1e3:.2f}" for n, us, c in rows[: args.top])
        print(f"    top: {top}")
    print(
        "\n| build | ms 1T | ms 2T | vs before 1T | vs before 2T |\n"
        "| --- | ---: | ---: | ---: | ---: |"
    )
    times: dict[str, dict[int, float]] = {key: {} for key in vms}
    lows: dict[str, dict[int, float]] = {key: {} for key in vms}
    for t in int8_kernels.THREADS:
        common.TvmRunner.set_threads(t)
        fns = {key: functools.partial(vm["main"], *targs) for key, vm in vms.items()}
        for key, (median, least) in int8_kernels.interleaved(fns, args.repeats).items():
            times[key][t], lows[key][t] = median, least
            log(f"{name} {t}T {key}: median {median:.2f} ms, min {least:.2f} ms")
    ref = times[BEFORE]
    for key, ts in times.items():
        cells = [f"{ts[t]:.2f} (min {lows[key][t]:.2f})" for t in int8_kernels.THREADS]
        cells += [f"{ts[t] / ref[t]:.3f}x" for t in int8_kernels.THREADS]
        print(f"| {key} | " + " | ".join(cells) + " |")
    print(f"\nload average after the timings: {os.getloadavg()}")


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,ppocr_det")
    p.add_argument("--calib", type=int, default=8, help="calibration samples")
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds per thread count")
    p.add_argument("--profile-runs", type=int, default=5)
    p.add_argument("--top", type=int, default=6, help="functions listed per profile")
    p.add_argument(
        "--avx2",
        action="store_true",
        help=f"the AVX2 kernels (mcpu={int8_kernels.AVX2_TARGET['mcpu']}) instead of the host's",
    )
    p.add_argument(
        "--builds",
        choices=("all", "residual"),
        default="all",
        help=f"all four builds, or only {' vs '.join(RESIDUAL_BUILDS)}",
    )
    common.add_page_option(p)
    args = p.parse_args(argv)
    print("## Blocked int8 activations and residual epilogues, same process\n")
    print(f"(ratios against '{BEFORE}')\n")
    print(common.machine_summary())
    for name in args.models.split(","):
        bench(name, args, lambda m: print(f"# {m}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
