"""Milliseconds per tensor of each registered calibrator (default options, 2048 bins).

    python benchmarks/calibrator_speed.py [--repeat N] [--best]

For an activation (1x64x56x56 float32, per-tensor) and a conv weight (64x64x3x3, per output
channel), prints the median (or, with ``--best``, the minimum) time of ``observer.update`` on
one batch, of ``compute`` and their sum. Histogram calibrators also need the driver's min/max pass over the data, timed
separately as "range pass".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def median_ms(fn, repeat: int, best: bool = False) -> float:
    """Median wall time in ms (the minimum of ``repeat`` with ``best``)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.min(times) if best else np.median(times))


def bench(name: str, x: np.ndarray, axis: int | None, spec, repeat: int, best: bool = False):
    from autoq import calibrators as cal

    c = cal.get(name)
    if axis is None:
        data_range = (float(x.min()), float(x.max())) if c.needs_range else None
    else:
        rows = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
        data_range = (rows.min(1), rows.max(1)) if c.needs_range else None
    obs = c.observer(axis, data_range)
    update = median_ms(lambda: c.observer(axis, data_range).update(x), repeat, best)
    obs.update(x)
    compute = median_ms(lambda: obs.compute(spec), repeat, best)
    return update, compute


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--best", action="store_true", help="best of N instead of the median")
    common.add_page_option(parser)
    args = parser.parse_args(argv)
    from autoq import calibrators as cal
    from autoq.config import QuantSpec

    rng = np.random.default_rng(0)
    cases = [
        (
            "activation 1x64x56x56, per-tensor, int8 asymmetric",
            np.maximum(rng.standard_normal((1, 64, 56, 56)), -0.5).astype(np.float32),
            None,
            QuantSpec(),
        ),
        (
            "weight 64x64x3x3, per-channel (axis 0), int8 symmetric narrow",
            (0.05 * rng.standard_normal((64, 64, 3, 3))).astype(np.float32),
            0,
            QuantSpec(symmetric=True, narrow_range=True),
        ),
    ]
    stat = "minimum" if args.best else "median"
    for title, x, axis, spec in cases:
        minmax = median_ms(lambda x=x: (x.min(), x.max()), args.repeat, args.best)
        print(f"\n### {title}\n\nrange pass: {minmax:.2f} ms ({stat} of {args.repeat})\n")
        rows = []
        for name in sorted(cal.REGISTRY):
            update, compute = bench(name, x, axis, spec, args.repeat, args.best)
            rows.append([name, f"{update:.2f}", f"{compute:.2f}", f"{update + compute:.2f}"])
        print(common.markdown_table(["calibrator", "update ms", "compute ms", "total ms"], rows))


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
