"""autoq.tune: MetaSchedule into a JSON database that compiles reuse (bit-exact with the
untuned module), no new trials for kernels already tuned, measurement through an RPC
tracker with two servers on 127.0.0.1, and the VNNI intrinsic fix.

The tuning tests use one tiny int8 conv (two kernels: quantize+pad, conv+requantize) and
one trial per kernel with the random cost model: they check the plumbing (records written,
found, applied, outputs unchanged), not the speed (benchmarks/ measure that). Most of
their time is MetaSchedule's builder and runner worker processes starting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config
from autoq.build.tuning_database import RECORD_FILE, WORKLOAD_FILE, tuned_kernels
from autoq.build.tuning_defaults import DEFAULTS_FILE, DefaultSchedules
from autoq.errors import InputError
from autoq.tuning import Tracker, TuningError, tune
from models import Builder, conv, image_data

TUNE_DEPS = ("psutil", "xgboost", "cloudpickle")
needs_tune_deps = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in TUNE_DEPS),
    reason="autoq.tune needs psutil, xgboost, cloudpickle (pip install 'autoq[tune]')",
)
needs_tornado = pytest.mark.skipif(
    importlib.util.find_spec("tornado") is None,
    reason="TVM's RPC tracker needs tornado (pip install 'autoq[tune]')",
)


@pytest.fixture(scope="module")
def one_conv():
    """An int8 conv 4->8, 3x3, with bias (realized by autoq.quantize) and two samples; one
    per file (the tests tune copies of it, never change it)."""
    b = Builder(5)
    x = b.input("x", (1, 4, 8, 8))
    mod, params = b.build(lambda b: conv(b, x, "c", 4, 8))
    q = autoq.quantize(mod, params, image_data((1, 4, 8, 8), 1, 8), Config(recipe="cnn"))
    return q, image_data((1, 4, 8, 8), 9, 2)


def outputs(qmod, samples, database=None, cpu_kernels=False):
    vm = relax.VirtualMachine(
        autoq.compile(qmod, database=database, cpu_kernels=cpu_kernels), tvm.cpu()
    )
    return [vm["main"](tvm.runtime.tensor(x)).numpy() for x in samples]


def check_tuned(qmod, samples, folder, kept_default: int = 0, cpu_kernels: bool = False):
    """Every kernel of the lowering (``cpu_kernels`` as in autoq.compile; with autoq's CPU
    kernels the conv keeps its own schedule and is not among them) tuned but
    ``kept_default`` of them (their default schedule measured faster); outputs unchanged
    from the untuned generic lowering."""
    done, kernels = tuned_kernels(qmod, autoq.default_target(), folder, cpu_kernels=cpu_kernels)
    assert len(kernels) == 2 and len(done) == 2 - kept_default, (done, kernels)
    assert set(done) <= set(kernels)
    assert not any(k.startswith("autoq_") for k in kernels), kernels
    tuned = outputs(qmod, samples, folder, cpu_kernels=cpu_kernels)
    for got, ref in zip(tuned, outputs(qmod, samples), strict=True):
        assert got.dtype == ref.dtype and np.array_equal(got, ref)


def test_tracker_parse_and_json():
    t = Tracker.parse("127.0.0.1:9190/rk3399")
    assert (t.host, t.port, t.key) == ("127.0.0.1", 9190, "rk3399")
    assert Tracker.loads(t.dumps()) == t
    with pytest.raises(ValueError, match="HOST:PORT/KEY"):
        Tracker.parse("127.0.0.1/rk3399")
    with pytest.raises(ValueError, match="port"):
        Tracker("h", 70000, "k")
    with pytest.raises(ValueError, match="--key"):
        Tracker("h", 9190, "")


def test_bad_arguments_name_the_option(tmp_path):
    q = tvm.IRModule()
    with pytest.raises(ValueError, match="database=FOLDER"):
        tune(q, trials=1)
    with pytest.raises(ValueError, match="trials"):
        tune(q, trials=0, database=tmp_path)
    with pytest.raises(ValueError, match="cost_model"):
        tune(q, trials=1, database=tmp_path, cost_model="gbdt")
    with pytest.raises(FileNotFoundError, match="autoq tune"):
        autoq.compile(q, database=tmp_path / "missing")


def measured(default_s: float, tuned_s: float, calls: list | None = None):
    """A stand-in for autoq.tuning.measure_schedules: every default schedule takes
    ``default_s``, every tuned one ``tuned_s`` (the modules come as default, tuned pairs)."""

    def measure(mods, target, workers):
        if calls is not None:
            calls.append(mods)
        return [default_s if i % 2 == 0 else tuned_s for i in range(len(mods))]

    return measure


def tune_module():
    return importlib.import_module("autoq.tuning")


@pytest.mark.tuning
@needs_tune_deps
def test_tune_database_reuse_and_default_schedules(tmp_path, monkeypatch, one_conv):
    """A limited tuning run (one trial per kernel) of the generic lowering writes a database
    that compiles reuse, bit-exact with the untuned module; the same shapes again run no
    trial. Records that measure slower than autoq's default schedule must not replace it:
    the decision comes from the measured seconds (measured for real first, then injected),
    is stored next to the database and honoured by every compile; a faster record is used.
    (One test: the real tuning run, whose worker processes take most of the time, is
    shared. The default lowering, autoq's CPU kernels, is tuned in the RPC test.)"""
    qmod, samples = one_conv
    folder = tmp_path / "tuning"
    args = dict(trials=2, trials_per_task=1, database=folder, cost_model="random", seed=0)
    r = tune(qmod, cpu_kernels=False, **args)
    assert (r.tasks, r.reused, r.trials, r.failed) == (2, 0, 2, 0), r
    assert (folder / WORKLOAD_FILE).is_file() and (folder / RECORD_FILE).is_file()
    side = DefaultSchedules.load(folder)
    assert len(side.kernels) == 2 and all(k.default_s and k.tuned_s for k in side.kernels)
    assert r.kept_default == len(side.default_wins()), (r, side)
    check_tuned(qmod, samples, folder, r.kept_default)
    # the same shapes again: nothing left to tune, no trial measured
    again = tune(qmod, trials=8, database=folder, cost_model="random", cpu_kernels=False)
    assert (again.tasks, again.reused, again.trials) == (2, 2, 0), again
    assert "no new trials" in again.summary()

    # the records measure 1000x slower than the defaults: no kernel takes its record
    calls: list = []
    (folder / DEFAULTS_FILE).unlink()
    monkeypatch.setattr(tune_module(), "measure_schedules", measured(1e-6, 1e-3, calls))
    again = tune(qmod, cpu_kernels=False, **args)
    assert (again.trials, again.kept_default) == (0, 2), again
    (mods,) = calls  # one batch: (default, tuned) per kernel
    scheduled = [bool(m["main"].attrs and m["main"].attrs.get("tirx.is_scheduled")) for m in mods]
    assert scheduled == [False, True, False, True], scheduled
    side = DefaultSchedules.load(folder)
    assert side.default_wins() == set(side.measured()), side
    check_tuned(qmod, samples, folder, kept_default=2)
    # measured once: tuning again measures nothing
    assert tune(qmod, cpu_kernels=False, **args).kept_default == 2 and len(calls) == 1
    # autoq's default schedule changed since (another hash): measured again
    stale = DefaultSchedules.load(folder)
    stale = [dataclasses.replace(k, default_hash="0") for k in stale.kernels]
    DefaultSchedules(tuple(stale)).save_to(folder)
    assert tune(qmod, cpu_kernels=False, **args).kept_default == 2 and len(calls) == 2

    # the records 10% faster: every kernel takes its record
    (folder / DEFAULTS_FILE).unlink()
    monkeypatch.setattr(tune_module(), "measure_schedules", measured(1e-3, 0.9e-3))
    assert tune(qmod, cpu_kernels=False, **args).kept_default == 0
    check_tuned(qmod, samples, folder, kept_default=0)

    (folder / DEFAULTS_FILE).write_text('{"format": "autoq.default_schedules", "kernels": 3')
    with pytest.raises(InputError, match=DEFAULTS_FILE):
        autoq.compile(qmod, database=folder, cpu_kernels=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_servers(procs, port: int, key: str, count: int, logs, timeout: float = 120.0) -> None:
    from tvm import rpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            i = dead[0]
            raise RuntimeError(f"RPC process {procs[i].args} exited: {logs[i].read_text()[-2000:]}")
        try:
            summary = rpc.connect_tracker("127.0.0.1", port).summary()
            free = [q for k, q in summary.get("queue_info", {}).items() if k == key]
            if free and free[0].get("free", 0) >= count:
                return
        except (RuntimeError, ConnectionError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{count} RPC servers with key {key!r} did not register in {timeout} s")


def _start_rpc(folder, port: int, key: str) -> list:
    """A tracker on ``port`` and two servers registered with it (their logs in ``folder``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    python = [sys.executable, "-m"]
    tracker = ["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port)]
    tracker += ["--port-end", str(port + 1)]
    server = ["tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}", "--key", key]
    server += ["--host", "127.0.0.1"]
    logs = [folder / "tracker.log", folder / "server1.log", folder / "server2.log"]
    procs = []
    for i, cmd in enumerate([tracker, server, server]):
        if i == 1:
            time.sleep(1.0)
        with open(logs[i], "w") as log:
            # a session of its own: _stop ends the server's popen workers with it
            procs.append(
                subprocess.Popen(
                    [*python, *cmd], env=env, stdout=subprocess.DEVNULL, stderr=log,
                    start_new_session=True,
                )
            )  # fmt: skip
    try:
        _wait_for_servers(procs, port, key, 2, logs)
    except RuntimeError:
        _stop(procs)
        raise
    return procs


def _stop(procs) -> None:
    """End each RPC process and its children (an RPC server's popen workers outlived the
    server, and the test run, when only the server was terminated)."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
        _signal_group(p, signal.SIGKILL)  # children that ignored SIGTERM


def _signal_group(p, sig) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


@pytest.fixture
def rpc_tracker(tmp_path):
    """A TVM RPC tracker and two servers (key autoq-test) on 127.0.0.1; a start that dies
    (a port taken between choosing and binding it) is retried on new ports."""
    key = "autoq-test"
    for attempt in range(3):
        port = _free_port()
        try:
            procs = _start_rpc(tmp_path, port, key)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield Tracker("127.0.0.1", port, key)
    finally:
        _stop(procs)


@needs_tune_deps
@needs_tornado
def test_tune_measures_through_an_rpc_tracker(tmp_path, rpc_tracker, monkeypatch, one_conv):
    """The default lowering (autoq's CPU kernels: the conv keeps its own packed schedule,
    so the tasks are the kernels around it) tuned with every candidate, default and
    tuned schedule measured through the tracker; its compiles apply the records."""
    qmod, samples = one_conv
    folder = tmp_path / "tuning"
    args = dict(trials=2, trials_per_task=1, database=folder, cost_model="random", seed=0)
    r = tune(qmod, rpc=rpc_tracker, **args)
    assert (r.tasks, r.reused, r.trials, r.failed) == (2, 0, 2, 0), r
    # both kernels' default and tuned schedules were measured through the tracker too
    side = json.loads((folder / DEFAULTS_FILE).read_text())["kernels"]
    assert len(side) == 2 and all(k["default_s"] and k["tuned_s"] for k in side), side
    check_tuned(qmod, samples, folder, r.kept_default, cpu_kernels=True)
    # the records 10% faster: every kernel's record is applied with autoq's CPU kernels
    (folder / DEFAULTS_FILE).unlink()
    monkeypatch.setattr(tune_module(), "measure_schedules", measured(1e-3, 0.9e-3))
    assert tune(qmod, rpc=rpc_tracker, **args).kept_default == 0
    check_tuned(qmod, samples, folder, kept_default=0, cpu_kernels=True)


@pytest.mark.tuning
def test_all_failed_trials_raise(tmp_path, monkeypatch, one_conv):
    """A tuning run whose every candidate fails raises with the error (MetaSchedule itself
    would return an untuned database silently)."""
    if any(importlib.util.find_spec(m) is None for m in TUNE_DEPS):
        pytest.skip("autoq.tune needs psutil, xgboost, cloudpickle")

    def broken_build(mod, target, _params=None):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(tune_module(), "build_candidate", broken_build)
    qmod, _ = one_conv
    with pytest.raises(TuningError, match="compiler exploded"):
        tune(qmod, trials=1, trials_per_task=1, database=tmp_path, cost_model="random")


def _cpu_has_vnni() -> bool:
    try:
        return "avx512_vnni" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.tuning
@pytest.mark.skipif(not _cpu_has_vnni(), reason="this CPU has no AVX-512 VNNI (vpdpbusd)")
def test_vnni_intrinsic_compiles_and_matches_numpy():
    """TVM's stock dot_16x4_vnni does not compile with the wheel's LLVM 22; ours does and
    gives the exact u8 x s8 -> s32 dot products."""
    from tvm.script import tirx as T

    from autoq.cpu.x86_intrinsics import VNNI_INTRIN, register_vnni, target_has_vnni

    @T.prim_func(s_tir=True)
    def dot(
        A: T.Buffer((3, 8), "uint8"), B: T.Buffer((2, 16, 4), "int8"), C: T.Buffer((3, 16), "int32")
    ):
        for m, ko, n, ki in T.grid(3, 2, 16, 4):
            with T.sblock("C"):
                vm, vn, vko, vki = T.axis.remap("SSRR", [m, n, ko, ki])
                with T.init():
                    C[vm, vn] = 0
                C[vm, vn] = C[vm, vn] + T.Cast("int32", A[vm, vko * 4 + vki]) * T.Cast(
                    "int32", B[vko, vn, vki]
                )

    target = autoq.default_target()
    assert target_has_vnni(target)
    assert not target_has_vnni(tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}))
    register_vnni()
    sch = tvm.s_tir.Schedule(dot)
    block = sch.get_sblock("C")
    _, ko, n, _ = sch.get_loops(block)
    sch.decompose_reduction(block, ko)
    sch.tensorize(n, VNNI_INTRIN)
    lib = tvm.compile(sch.mod, target)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 8)).astype("uint8")
    b = rng.integers(-128, 128, (2, 16, 4)).astype("int8")
    c = tvm.runtime.tensor(np.zeros((3, 16), "int32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    ref = np.einsum("mok,onk->mn", a.reshape(3, 2, 4).astype(np.int64), b.astype(np.int64))
    assert np.array_equal(c.numpy(), ref)
