"""Distributed calibration on Dask (issue 18): ResNet-50 (open_nsfw) on 1 and 2 local workers
vs in-process, and a model of scaling to N machines.

Each configuration runs in its own measured process (the coordinator; its peak RSS is its
VmHWM, see ``common.run_measured``; with ``--workers`` it starts a ``LocalCluster`` whose
scheduler runs in it and whose workers are separate processes). The samples are real image
crops (``common.make_dataset``) written as ``.npz`` shards that the workers read themselves
(``autoq.dataset.NpzShards``): the coordinator never holds them. Printed, measured in the
same run:

* calibration wall time (topological, ``--method``), of which compile, shard start (loading
  the library and the weights into each worker, prologue), the coordinator loop over the
  segments, and per shard: graph runs and calibrators (s); peak RSS of the coordinator and
  of each worker (MB); the qparams are checked bit-identical to the in-process ones;
* coordinator peak RSS for two sample counts with 2 workers (it must not grow with them);
* a model of N machines from the measured numbers: ``T(N) = compile + start + S * o + C / N``
  with ``C`` the shards' total compute (graph runs + calibrators), ``S`` the segments and
  ``o`` the measured coordination cost per segment (the loop's time not spent in the slowest
  shard's compute: round trips, merging the states, choosing the qparams).

Run: python benchmarks/dask_calibration.py [--samples 32] [--method percentile]
(256 samples take ~4 min of graph runs per pass on one core of a 2-core machine; the
design and the measured numbers: docs/distributed.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

MODEL = "resnet50"
FILES = 8  # .npz shards written (each worker reads files i, i + n, ...)


def calibrate_child(folder: str, method: str, workers: int) -> dict:
    """In a fresh process: calibrate ResNet-50 in-process (``workers=0``, samples loaded
    here) or on a local cluster of ``workers`` (samples read by the workers)."""
    import autoq
    from autoq import frontends
    from autoq.dataset import NpzShards, from_npz
    from autoq.distributed import calibrate_distributed, open_client

    info = common.find_model(MODEL)
    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    cfg = autoq.Config(activation=autoq.QuantSpec(calibrator=method))
    sim = autoq.simulate(mod, params, cfg)
    files = sorted(str(p) for p in Path(folder).glob("*.npz"))
    out: dict = {}
    t0 = time.perf_counter()
    if workers == 0:
        samples = [s for f in files for s in from_npz(f)]
        qp = autoq.calibrate(sim, params, samples, cfg)
    else:
        dist = autoq.Distributed(workers=workers)
        with open_client(dist) as client:
            out["cluster_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            qp = calibrate_distributed(sim, NpzShards(files), cfg, autoq.default_target(), client)
    out["calibrate_s"] = time.perf_counter() - t0
    out["qparams"] = {s: qp[s].to_json() for s in qp.params}
    return {**out, **qp.meta["stats"], "samples": qp.meta["samples"]}


def write_shards(n: int, folder: Path) -> None:
    import numpy as np

    info = common.find_model(MODEL)
    ds = common.make_dataset(info, "calib", n)
    name = next(iter(ds.samples[0]))
    for k in range(FILES):
        part = [s[name] for s in ds.samples[k::FILES]]
        if part:
            np.savez(folder / f"part{k:02d}.npz", **{name: np.concatenate(part)})


def shard_cols(r: dict, workers: int) -> tuple[str, str, str]:
    if workers == 0:
        return (common.fmt(r.get("run_s")), common.fmt(r.get("observe_s")), "")
    runs = [r[f"shard{i}_run_s"] for i in range(workers)]
    obs = [r[f"shard{i}_observe_s"] for i in range(workers)]
    rss = [r[f"shard{i}_peak_rss_mb"] for i in range(workers)]
    return (
        " / ".join(common.fmt(x) for x in runs),
        " / ".join(common.fmt(x) for x in obs),
        " / ".join(common.fmt(x, 4) for x in rss),
    )


def scaling_model(r: dict, workers: int) -> list[list]:
    """Rows of T(N) for N machines (one worker each) from a measured run."""
    compute = [r[f"shard{i}_run_s"] + r[f"shard{i}_observe_s"] for i in range(workers)]
    total = sum(compute)
    overhead = max(0.0, r["run_plan_s"] - max(compute)) / r["segments"]
    start = r["start_s"] + r["load_s"]
    rows = []
    for n in (1, 2, 4, 8, 16, 32):
        t = r["compile_s"] + start + r["segments"] * overhead + total / n
        rows.append([n, common.fmt(t), common.fmt(total / n), f"{total / n / t:.0%}"])
    note = (
        f"C = {total:.1f} s of shard compute for {r['samples']} samples, S = {r['segments']} "
        f"segments, o = {overhead * 1e3:.1f} ms per segment, compile {r['compile_s']:.1f} s, "
        f"start + load {start:.1f} s (measured with {workers} workers)"
    )
    return rows, note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32, help="calibration samples (issue: 256)")
    p.add_argument("--method", default="percentile", help="activation calibrator")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    common.add_page_option(p)
    args = p.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="autoq-bench-dask-") as tmp:
        sizes = sorted({args.samples // 2, args.samples})
        folders = {}
        for n in sizes:
            folders[n] = Path(tmp) / f"n{n}"
            folders[n].mkdir()
            write_shards(n, folders[n])
        plan = [(args.samples, 0)] + [(args.samples, w) for w in args.workers]
        plan += [(n, max(args.workers)) for n in sizes if n != args.samples]
        for n, w in plan:
            kw = {"folder": str(folders[n]), "method": args.method, "workers": w}
            r = common.run_measured("dask_calibration:calibrate_child", kw)
            results[(n, w)] = r
            same = (
                r["qparams"] == results[(args.samples, 0)]["qparams"] if n == args.samples else ""
            )
            label = "in-process" if w == 0 else f"dask, {w} worker{'s' * (w > 1)}"
            rows.append(
                [
                    label,
                    n,
                    common.fmt(r["calibrate_s"]),
                    common.fmt(r["compile_s"]),
                    common.fmt(r.get("start_s")),
                    common.fmt(r.get("run_plan_s")),
                    *shard_cols(r, w),
                    common.fmt(r["peak_rss_mb"], 4),
                    same if same == "" else ("yes" if same else "NO"),
                ]
            )
            log(f"  {rows[-1]}")
    print(f"## Distributed calibration: ResNet-50 (open_nsfw), {args.method}, topological\n")
    print(common.machine_summary())
    print(
        "\nlocal cluster on this machine (workers share its cores with the coordinator); "
        "per-shard columns list shard 1 / shard 2. Worker RSS includes TVM and the weights.\n"
    )
    head = ["run", "samples", "calibrate s", "compile s", "start s", "segment loop s"]
    head += ["graph runs s (per shard)", "calibrators s", "worker peak RSS MB"]
    head += ["coordinator peak RSS MB", "qparams == in-process"]
    print(common.markdown_table(head, rows))
    w = max(args.workers)
    model_rows, note = scaling_model(results[(args.samples, w)], w)
    print(f"\n### Model of N machines (one worker each)\n\n{note}\n")
    print(common.markdown_table(["N", "T(N) s", "compute C/N s", "compute share"], model_rows))
    print(f"\ntotal run time: {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
