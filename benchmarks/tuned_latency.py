"""Latency after ``autoq tune``: autoq int8 with the packed kernels, untuned and tuned with a
stated MetaSchedule budget, against ONNX Runtime int8 and fp32, in one run.

Steps, on one model (ResNet-50 open_nsfw by default):

1. ``autoq.quantize`` (default config, ``--calib`` samples) and ORT ``quantize_static``
   (QDQ u8s8, MinMax) on the same samples;
2. ``autoq.tune(qmod, trials=--trials, database=--database)``: the wall time and what it
   tuned (the packed int8 conv/dense kernels keep their fixed schedules and are not tasks:
   the tasks are the kernels around them). An existing database is reused (no new trials);
   the wall time includes measuring each tuned kernel against autoq's default schedule
   (records that do not beat it are not applied);
3. compile with and without the database; outputs compared;
4. interleaved latency (one call each per round, medians; idle ORT threads not spinning)
   of ORT fp32, ORT int8, autoq untuned and autoq tuned, 1 and 2 threads;
5. per-kernel profile of both modules at 1 thread (a timer around each VM call; the
   minimum of ``--profile-runs`` runs per kernel): where the time goes, split into autoq's
   packed kernels (``autoq_*``, not tuning tasks) and the rest.

Run:  python benchmarks/tuned_latency.py [--model resnet50|minilm|ppocr_det] [--trials 256]
      [--trials-per-task N] [--database DIR] [--calib 16] [--repeats 30]
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
import int8_kernels


def profile_calls(vm, args, runs: int) -> list[tuple[str, float, int]]:
    """(function, min-over-runs total us per inference, calls per inference) of every call
    the Relax VM makes (a timer around each call, ``vm.set_instrument``; the 0.27 VM has no
    profiler).

    Each timed call also measures the instrument's own round trip (the Python callback's
    return into the VM and its re-entry after the call): about 0.4 us per call, which would
    overstate every small kernel. That floor is estimated as the fastest single call seen in
    the profile (a view reshape or tuple builtin doing almost no work) and subtracted from
    every call, clamped at zero, so the rows add up to kernel time rather than timer time.
    """
    runs_us: list[dict[str, float]] = []
    calls: dict[str, int] = {}
    started: dict[str, float] = {}
    fastest = [float("inf")]

    def instrument(_func, name, before, _ret, *_args):
        now = time.perf_counter()
        if before:
            started[name] = now
        else:
            us = runs_us[-1]
            took = (now - started.pop(name, now)) * 1e6
            fastest[0] = min(fastest[0], took)
            us[name] = us.get(name, 0.0) + took
            if len(runs_us) == 1:
                calls[name] = calls.get(name, 0) + 1
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    for _ in range(runs):
        runs_us.append({})
        vm["main"](*args)
    floor = fastest[0] if calls else 0.0
    best = {
        n: max(0.0, min(r.get(n, float("inf")) for r in runs_us) - floor * calls[n]) for n in calls
    }
    print(f"(per-call timer floor {floor:.2f} us subtracted from every VM call)")
    return sorted(((n, best[n], calls[n]) for n in best), key=lambda r: -r[1])


def _print_profile(rows, top: int, label: str) -> None:
    total = sum(us for _, us, _ in rows)
    packed = sum(us for n, us, _ in rows if n.startswith("autoq_") or "autoq_" in n)
    print(
        f"\nper-kernel profile, {label}, 1 thread (min of runs): total {total / 1e3:.2f} ms,"
        f" autoq packed kernels {packed / 1e3:.2f} ms ({100 * packed / max(total, 1e-9):.0f}%),"
        f" the rest {(total - packed) / 1e3:.2f} ms\n"
    )
    print("| kernel | calls | ms | share |")
    print("| --- | ---: | ---: | ---: |")
    for name, us, n in rows[:top]:
        print(f"| `{name[:70]}` | {n} | {us / 1e3:.3f} | {100 * us / total:.1f}% |")


def _load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def run(args, log) -> None:
    import tvm
    from tvm import relax

    import autoq

    info = common.find_model(args.model)
    calib = common.make_dataset(info, "calib", args.calib)
    sample = common.make_dataset(info, "eval", 2)[0]
    target = autoq.default_target()
    db = Path(
        args.database or common.CACHE_DIR / f"tuning-{args.model}-{common.target_mcpu(target)}"
    )
    with tempfile.TemporaryDirectory(prefix="autoq-tuned-") as tmp:
        ort_int8 = Path(tmp) / "int8.onnx"
        common.ort_quantize(info, calib.samples, "minmax", ort_int8)
        mod, params = autoq.from_onnx(info.path, input_shapes=dict(info.input_shapes))
        qmod = autoq.quantize(mod, params, calib.samples, autoq.Config())
        load_before = os.getloadavg()
        log(f"tuning into {db} with a budget of {args.trials} trials, load {load_before}")
        t0 = time.perf_counter()
        res = autoq.tune(
            qmod,
            target,
            trials=args.trials,
            database=db,
            trials_per_task=args.trials_per_task,
            progress=False,
        )
        tune_s = time.perf_counter() - t0
        load_tuned = os.getloadavg()
        log(f"tune: {res.summary()} (wall {tune_s:.0f} s, load {load_tuned})")
        vms = {
            "autoq int8 untuned": relax.VirtualMachine(autoq.compile(qmod, target), tvm.cpu()),
            "autoq int8 tuned": relax.VirtualMachine(
                autoq.compile(qmod, target, database=db), tvm.cpu()
            ),
        }
        names = [p.name for p in qmod["main"].params]
        targs = [tvm.runtime.tensor(sample[n]) for n in names]
        outs = {k: int8_kernels.first_output(vm["main"](*targs)) for k, vm in vms.items()}
        a, b = outs.values()
        log(f"tuned == untuned outputs: {np.array_equal(a, b)} (max |diff| {np.abs(a - b).max()})")
        times: dict[str, dict[int, float]] = {}
        fns = {k: functools.partial(vm["main"], *targs) for k, vm in vms.items()}
        for t in int8_kernels.THREADS:
            int8_kernels.vs_ort(info.path, ort_int8, sample, fns, t, args.repeats, times, log)
        load = os.getloadavg()
        common.TvmRunner.set_threads(1)
        prof = {k: profile_calls(vm, targs, args.profile_runs) for k, vm in vms.items()}
    title = common.MODEL_TITLES.get(args.model, args.model)
    cap = f", at most {args.trials_per_task} per kernel" if args.trials_per_task else ""
    print(f"## {title}: autoq int8 after `autoq tune` ({args.trials} trials{cap})\n")
    print(common.machine_summary())
    print(f"target mcpu={common.target_mcpu(target)}; load average after the timings: {load}")
    print(
        f"tuning: {res.summary()}; wall {tune_s:.0f} s on this machine (load average before"
        f" {_load(load_before)}, after {_load(load_tuned)})"
    )
    print(f"tuned == untuned outputs: {np.array_equal(a, b)}")
    rows = [int8_kernels.latency_row(k, v, times["ORT int8 u8s8"]) for k, v in times.items()]
    int8_kernels.print_latency_table(f"{title}, batch 1, interleaved medians", rows, "ORT int8")
    for key, rows in prof.items():
        _print_profile(rows, args.top, key)


def main(argv=None) -> int:
    common.use_all_cores()  # the 2-thread rows really run 2 TVM threads
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--trials", type=int, default=256, help="autoq.tune budget (all kernels)")
    p.add_argument("--trials-per-task", type=int, default=None, help="cap per kernel")
    p.add_argument("--database", default=None, help="tuning database folder (reused)")
    p.add_argument("--calib", type=int, default=16, help="calibration samples")
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds per thread count")
    p.add_argument("--profile-runs", type=int, default=5)
    p.add_argument("--top", type=int, default=15, help="kernels listed in the profile")
    common.add_page_option(p)
    args = p.parse_args(argv)
    run(args, lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
