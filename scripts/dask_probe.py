"""Probe Dask for distributed calibration, and show the pattern autoq will use.

Run (needs the optional extra: ``pip install "dask[distributed]"``; not a test, it prints
numbers measured on this machine, noisy on 2 shared cores):

    .venv/bin/python scripts/dask_probe.py [--samples 24] [--skip-kill] [--skip-tvm]

The pattern (issue 18): the dataset is split into shards, one **actor** per worker holds its
shard's per-sample tensors (in calibration: the cached activations, kept in the worker's own
memory). For each slot the coordinator asks every actor for the *state* of an observer fed
its shard (``observer.state()``: plain numpy, see ``autoq.calibrators``), merges the states,
computes the qparams once, and would broadcast them before the next segment. With the exact
merge contract the qparams are bit-identical to one in-process pass, checked here for every
built-in calibrator, per-tensor and per-channel.

It then measures what the design depends on:

1. the time to start a ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
   host="127.0.0.1")`` (with nannies) and to create actors;
2. the round-trip latency of an actor method call, and moving a 1 MB array to and from an
   actor;
3. TVM inside a worker: ``import tvm`` time in a spawned worker, compiling a tiny Relax
   function there, and loading a library exported by the coordinator (by path, and by
   shipping the ``.so`` bytes as for a remote worker), with outputs compared to the
   coordinator's;
4. what the coordinator sees when a worker process is killed (``os.kill(pid, SIGKILL)``):
   which exception, after how long, and what the nanny does.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import tempfile
import time

import numpy as np

from autoq import calibrators as cal
from autoq.config import QuantSpec

CALIBRATORS = ["max", "moving_average", "percentile", "kl", "mse"]


class ShardActor:
    """One shard of per-sample tensors, kept in the worker's memory between calls."""

    def __init__(self, name: str, samples: list[np.ndarray]):
        self.name = name
        self.samples = samples
        self.blob = None

    def ping(self) -> str:
        return self.name

    def range_state(self, axis):
        """State of the min/max pass (histogram calibrators need the global range)."""
        obs = cal.range_observer(axis)
        for x in self.samples:
            obs.update(x)
        return obs.state()

    def observe(self, calibrator_json: dict, axis, data_range) -> dict:
        """State of ``calibrator``'s observer fed this shard (one batch per sample)."""
        obs = cal.from_json(calibrator_json).observer(axis=axis, data_range=data_range)
        for x in self.samples:
            obs.update(x)
        return obs.state()

    def put(self, blob: np.ndarray) -> int:
        self.blob = blob
        return blob.nbytes

    def get(self) -> np.ndarray:
        return self.blob

    def pid(self) -> int:
        return os.getpid()

    def work(self, seconds: float) -> str:
        """Stands for a long segment run (to kill the worker in the middle of it)."""
        time.sleep(seconds)
        return self.name

    def tvm_probe(self, lib_path: str | None, lib_bytes: bytes | None, x: np.ndarray) -> dict:
        """Import tvm, compile a tiny function here, and run a library built elsewhere."""
        t0 = time.perf_counter()
        import tvm
        from tvm import relax

        out = {"import_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        vm_here = relax.VirtualMachine(tvm.compile(_tiny_module(), _target()), tvm.cpu())
        out["compile_s"] = time.perf_counter() - t0
        out["here"] = vm_here["main"](tvm.runtime.tensor(x)).numpy()
        if lib_bytes is not None:  # a remote worker: write the shipped bytes locally
            fd, lib_path = tempfile.mkstemp(suffix=".so")
            with os.fdopen(fd, "wb") as f:
                f.write(lib_bytes)
        t0 = time.perf_counter()
        vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), tvm.cpu())
        out["load_s"] = time.perf_counter() - t0
        out["shipped"] = vm["main"](tvm.runtime.tensor(x)).numpy()
        return out


def _target():
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _tiny_module():
    """y = relu(x @ w + 1) with a fixed w: enough to exercise compile, export and load."""
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    w = np.arange(64, dtype=np.float32).reshape(8, 8) / 64 - 0.5

    @tvm.script.ir_module
    class Tiny:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                y = R.nn.relu(R.add(R.matmul(x, R.const(w)), R.const(1.0, "float32")))
                R.output(y)
            return y

    return relax.transform.LegalizeOps()(Tiny)


def make_data(n: int, seed: int = 0) -> list[np.ndarray]:
    """Activation-like samples (1, 4, 6, 6): a skewed ReLU-ish distribution with outliers."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32) * 2 + 0.5
        x[x < -1] = 0
        x.flat[rng.integers(x.size)] *= 8
        out.append(x)
    return out


def shards_of(samples: list, k: int) -> list[tuple[str, list]]:
    """Contiguous shards, named by the samples they hold."""
    bounds = np.linspace(0, len(samples), k + 1).astype(int)
    return [
        (f"shard {i + 1}/{k} (samples {a}..{b - 1})", samples[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def distributed_qparams(actors, calibrator, spec, axis):
    """The coordinator's side of one slot: range pass, observe pass, merge, compute."""
    data_range = None
    if calibrator.needs_range:
        states = [a.range_state(axis) for a in actors]  # all actors work in parallel
        data_range = cal.merge_states(cal.get("max"), [s.result() for s in states], axis)
        data_range = data_range.data_range()
    states = [a.observe(cal.to_json(calibrator), axis, data_range) for a in actors]
    merged = cal.merge_states(calibrator, [s.result() for s in states], axis, data_range)
    return merged.compute(spec)


def in_process_qparams(samples, calibrator, spec, axis):
    data_range = None
    if calibrator.needs_range:
        first = cal.range_observer(axis)
        for x in samples:
            first.update(x)
        data_range = first.data_range()
    obs = calibrator.observer(axis=axis, data_range=data_range)
    for x in samples:
        obs.update(x)
    return obs.compute(spec)


def same_bits(a, b) -> bool:
    fields = ("scale", "zero_point", "rmin", "rmax")
    return all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in fields)


def check_merge(actors, samples) -> None:
    spec = QuantSpec()
    for name in CALIBRATORS:
        c = cal.get(name)
        for axis in (None, 1):
            t0 = time.perf_counter()
            got = distributed_qparams(actors, c, spec, axis)
            dt = time.perf_counter() - t0
            want = in_process_qparams(samples, c, spec, axis)
            print(
                f"  {name:15s} axis={axis!s:4s} bit-identical={same_bits(got, want)} "
                f"({dt * 1e3:.1f} ms distributed)"
            )


def measure_latency(actors) -> None:
    a = actors[0]
    a.ping().result()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        a.ping().result()
        times.append(time.perf_counter() - t0)
    print(
        f"  actor call round trip: median {statistics.median(times) * 1e3:.2f} ms, "
        f"p90 {sorted(times)[180] * 1e3:.2f} ms (200 calls)"
    )
    blob = np.random.default_rng(1).standard_normal(2**17)  # 1 MiB of float64
    for label, call in (("to actor", lambda: a.put(blob)), ("from actor", lambda: a.get())):
        call().result()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            call().result()
            times.append(time.perf_counter() - t0)
        print(f"  1 MiB {label}: median {statistics.median(times) * 1e3:.2f} ms (20 calls)")
    assert np.array_equal(a.get().result(), blob)


def probe_tvm(actors) -> None:
    import tvm

    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tiny.so")
        t0 = time.perf_counter()
        tvm.compile(_tiny_module(), _target()).export_library(path)
        print(f"  coordinator compile+export: {time.perf_counter() - t0:.2f} s")
        vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
        want = vm["main"](tvm.runtime.tensor(x)).numpy()
        raw = open(path, "rb").read()
        print(f"  exported library: {len(raw)} bytes")
        for label, kw in (("by path", (path, None)), ("as bytes", (None, raw))):
            t0 = time.perf_counter()
            r = actors[1].tvm_probe(*kw, x).result()
            print(
                f"  worker, library {label}: import tvm {r['import_s']:.2f} s, compile "
                f"{r['compile_s']:.2f} s, load {r['load_s'] * 1e3:.1f} ms, call total "
                f"{time.perf_counter() - t0:.2f} s; bit-identical to coordinator: "
                f"compiled here {np.array_equal(r['here'], want)}, "
                f"shipped {np.array_equal(r['shipped'], want)}"
            )


def probe_kill(client, actors, shard_names) -> None:
    """Kill worker 0 while it is busy in a call (as in the middle of a segment), then call
    it again; the other worker must be unaffected."""
    victim = 0
    pid = actors[victim].pid().result()
    busy = actors[victim].work(5.0)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    for label, fut in (("in-flight call", busy), ("next call", None)):
        t0 = time.perf_counter()
        try:
            (fut or actors[victim].ping()).result(timeout=60)
            print(f"  {label}: no error after the kill (unexpected)")
        except Exception as e:
            print(
                f"  {label} on killed worker pid {pid} holding {shard_names[victim]}: "
                f"{type(e).__module__}.{type(e).__name__}: {str(e)[:120]!r} "
                f"after {time.perf_counter() - t0:.2f} s"
            )
    try:
        print(f"  the other actor still answers: {actors[1].ping().result(timeout=10)!r}")
    except Exception as e:
        print(f"  the other actor failed too: {type(e).__name__}: {e}")
    t0 = time.perf_counter()
    while len(client.scheduler_info(n_workers=-1)["workers"]) < 2 and time.perf_counter() - t0 < 30:
        time.sleep(0.1)
    n = len(client.scheduler_info(n_workers=-1)["workers"])
    print(
        f"  {n} workers {time.perf_counter() - t0:.1f} s later: the nanny restarts the process, "
        "the actor and its shard are gone (a new actor must be created)"
    )


def worker_imports() -> dict:
    """Run in a fresh worker: is tvm already imported (spawn re-imports the parent's
    ``__main__`` module), and how long importing it takes there."""
    import sys
    import time as _time

    loaded = "tvm" in sys.modules
    t0 = _time.perf_counter()
    import tvm  # noqa: F401

    return {"tvm_loaded_at_start": loaded, "import_s": _time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--skip-tvm", action="store_true")
    ap.add_argument("--mp-method", choices=["spawn", "forkserver", "fork"], default="spawn")
    ap.add_argument(
        "--connect-timeout", default="30s", help="distributed.comm.timeouts.connect (dask: 30s)"
    )
    args = ap.parse_args()
    import dask
    import distributed
    from distributed import Client, LocalCluster

    dask.config.set(
        {
            "distributed.worker.multiprocessing-method": args.mp_method,
            "distributed.comm.timeouts.connect": args.connect_timeout,
        }
    )
    print(f"dask {dask.__version__}, distributed {distributed.__version__}, {args.mp_method}")
    t0 = time.perf_counter()
    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
    )
    client = Client(cluster)
    print(f"LocalCluster of 2 workers up in {time.perf_counter() - t0:.2f} s")
    try:
        for addr, r in client.run(worker_imports).items():
            print(f"  worker {addr}: {r}")
        samples = make_data(args.samples)
        shards = shards_of(samples, 2)
        workers = sorted(client.scheduler_info()["workers"])
        t0 = time.perf_counter()
        actors = [
            client.submit(ShardActor, name, part, actor=True, workers=[w]).result()
            for (name, part), w in zip(shards, workers, strict=True)
        ]
        print(f"2 actors created in {time.perf_counter() - t0:.2f} s")
        print("merge of shard states == in-process, per calibrator:")
        check_merge(actors, samples)
        print("latency:")
        measure_latency(actors)
        if not args.skip_tvm:
            print("tvm in a worker:")
            probe_tvm(actors)
        if not args.skip_kill:
            print("killing a worker:")
            probe_kill(client, actors, [n for n, _ in shards])
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
