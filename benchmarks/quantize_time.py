"""Quantize time: the whole job as ``autoq quantize`` runs it (``Quantizer.run`` then
``export_library``), with a cold and a warm compile cache, against ``nncf.quantize`` and
ONNX Runtime ``quantize_static`` on the same calibration samples.

Each row is a fresh process (``common.run_measured``, the children of ``peers.py``): CPU
seconds (user + system, all threads) of the quantize call alone (autoq: quantize +
export), its wall seconds and the process's peak RSS. autoq runs twice on one fresh
compile-cache folder (``AUTOQ_COMPILE_CACHE``): **cold** (everything compiled and stored)
then **warm** (the same model again: the libraries loaded, nothing compiled); the cache's
hits and misses are printed. The machine is shared: CPU seconds are the fair measure, and
the load average is printed next to every row.

    python benchmarks/quantize_time.py                         # five models, 64 samples
    python benchmarks/quantize_time.py --models resnet50 --samples 64

Extras: those of ``peers.py``. Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import peers

MODELS = ("resnet50", "mobilenetv2", "efficientnet_lite0", "ppocr_det", "minilm")


def _autoq_child(**kwargs) -> dict:
    """``peers._autoq_child`` plus this process's compile-cache hits and misses."""
    from autoq.ir import compile_cache

    out = peers._autoq_child(**kwargs)
    return {**out, **compile_cache.counts()}


def bench_model(name: str, n: int, log) -> list[list]:
    info, calib, _, desc = peers.load_model(name, n, 1)
    log(f"== {name}: {desc}")
    pre, _ = peers.pre_processed(info)
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoq-qtime-") as tmp:
        npz = Path(tmp) / "calib.npz"
        common.save_samples(calib, npz)
        shapes = {k: list(v) for k, v in info.input_shapes.items()}
        autoq_args = {"model": str(info.path), "samples": str(npz), "shapes": shapes,
                      "library": str(Path(tmp) / "autoq.so"), "recipe": "auto"}  # fmt: skip
        jobs = [
            ("ORT quantize_static", "peers:_ort_child",
             {"model": str(pre), "output": str(Path(tmp) / "ort.onnx"), "samples": str(npz),
              "per_channel": False}),
            ("nncf.quantize", "peers:_nncf_child",
             {"model": str(pre), "output": str(Path(tmp) / "ov.xml"), "samples": str(npz),
              "transformer": info.kind == "embedding"}),
            ("autoq, cold cache", "quantize_time:_autoq_child", autoq_args),
            ("autoq, warm cache", "quantize_time:_autoq_child", autoq_args),
        ]  # fmt: skip
        os.environ["AUTOQ_COMPILE_CACHE"] = str(Path(tmp) / "compiled")  # fresh, for both
        res = {}
        for key, target, kwargs in jobs:
            load = common.load_average()
            try:
                r = common.run_measured(target, kwargs, rss_limit_mb=common.rss_limit_mb())
            except common.SubprocessFailed as err:
                log(f"{name} {key}: FAILED: {err}")
                rows.append([peers.TITLES.get(name, name), key, "failed", "", "", "", "", load])
                continue
            res[key] = r
            log(
                f"{name} {key}: {r['cpu_s']:.1f} CPU s, {r['quant_wall_s']:.1f} s wall; load {load}"
            )
            cache = f"{r['hits']} hits / {r['misses']} misses" if "hits" in r else ""
            split = ""
            if "quantize_cpu_s" in r:
                split = f"{r['quantize_cpu_s']:.1f} + {r['compile_cpu_s']:.1f}"
            rows.append([peers.TITLES.get(name, name), key, common.fmt(r["cpu_s"]), split,
                         common.fmt(r["quant_wall_s"]), f"{r['peak_rss_mb']:.0f}", cache, load])  # fmt: skip
        nncf = res.get("nncf.quantize", {}).get("cpu_s")
        for row in rows:
            cpu = res.get(row[1], {}).get("cpu_s")
            row.insert(3, f"{cpu / nncf:.2f}x" if cpu and nncf else "")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--samples", type=int, default=64)
    common.add_page_option(p)
    args = p.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = []
    for name in args.models:
        rows += bench_model(name, args.samples, log)
    print(f"## Quantize time: {args.samples} calibration samples\n")
    print(common.machine_summary() + "\n")
    head = ["model", "", "CPU s", "vs nncf CPU", "autoq: quantize + export CPU s", "wall s",
            "peak RSS MB", "compile cache", "load (1/5/15 min)"]  # fmt: skip
    print(common.markdown_table(head, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
