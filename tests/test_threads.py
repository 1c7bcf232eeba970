"""autoq.threads. set_threads: TVM sizes its thread pool once per process (TVM_NUM_THREADS, or half
the logical CPUs on x86), so a request above the pool is an error naming the fix instead
of a silently smaller pool (on a 2-vCPU machine TVM's default pool holds one thread, and
"2 threads" used to run on one)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import autoq
from autoq.threads import one_thread, physical_cores, pool_threads, use_machine_cores


def test_more_threads_than_the_pool_is_an_error_naming_the_variable():
    cpus = len(os.sched_getaffinity(0))
    if int(os.environ["TVM_NUM_THREADS"]) < cpus:
        with pytest.raises(ValueError, match=rf"TVM_NUM_THREADS={cpus} before"):
            autoq.set_threads(cpus)
    with pytest.raises(ValueError, match=rf"may use {cpus} CPU\(s\); ask for at most"):
        autoq.set_threads(4096)
    # the failed request left the whole pool in use (sized from the variable conftest set)
    assert pool_threads() == int(os.environ["TVM_NUM_THREADS"])
    with pytest.raises(ValueError, match="n must be >= 1"):
        autoq.set_threads(0)


def python_prints(code: str, tvm_threads: int) -> list[str]:
    """The words ``code`` prints in a fresh Python with ``TVM_NUM_THREADS=tvm_threads``."""
    env = {**os.environ, "TVM_NUM_THREADS": str(tvm_threads)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_set_threads_takes_effect_within_the_pool():
    code = (
        "import tvm, autoq\n"
        "n = lambda: int(tvm.get_global_func('runtime.NumThreads')())\n"
        "autoq.set_threads(2); a = n()\n"
        "autoq.set_threads(1); b = n()\n"
        "print(a, b)\n"
    )
    assert python_prints(code, tvm_threads=2) == ["2", "1"]


_THREADS_A_KERNEL_RUNS_ON = (
    "import numpy as np, tvm\n"
    "from tvm.script import tirx as T\n"
    "@T.prim_func\n"
    "def who(out: T.Buffer((8,), 'int64')):\n"
    "    for i in T.parallel(8):\n"
    "        out[i] = T.call_extern('int64', 'pthread_self')\n"
    "kernel = tvm.compile(tvm.IRModule({'main': who}), target='llvm')\n"
    "def used():\n"
    "    ids = tvm.runtime.tensor(np.zeros(8, 'int64'))\n"
    "    kernel(ids)\n"
    "    return len(set(ids.numpy().tolist()))\n"
)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed on 2+ CPUs",
)
def test_a_parallel_kernel_runs_on_every_thread_asked_for(tmp_path):
    """Each parallel iteration records the thread it ran on. TVM 0.27 runs a parallel kernel
    serially when the calling thread's "max concurrency" is 1, which without a CPU list
    falls back to TVM_NUM_THREADS read at launch: with the variable unset, the pool that
    use_machine_cores and set_threads(2) made held 2 threads and NumThreads said 2, but
    every kernel ran on one (ResNet-50: CPU time per call equal to wall time)."""
    code = _THREADS_A_KERNEL_RUNS_ON + (
        "import autoq\n"
        "from autoq.threads import one_thread, use_machine_cores\n"
        "use_machine_cores(); seen = [used()]\n"
        "autoq.set_threads(1); seen.append(used())\n"
        "autoq.set_threads(2); seen.append(used())\n"
        "with one_thread():\n"
        "    seen.append(used())\n"
        "seen.append(used())\n"
        "print(*seen)\n"
    )
    script = tmp_path / "threads.py"  # a file: TVMScript reads the kernel's source
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    cores = min(physical_cores(), 8)
    assert out.stdout.split() == [str(cores), "1", "2", "1", "2"]


def _topology(root, pairs):
    for cpu, (package, core) in enumerate(pairs):
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")


def test_physical_cores_counts_distinct_package_core_pairs(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    _topology(tmp_path / "smt", [(0, 0), (0, 0), (0, 1), (0, 1)])  # 2 cores x 2 SMT threads
    assert physical_cores(tmp_path / "smt") == 2
    _topology(tmp_path / "vm", [(0, 0), (0, 1), (0, 2), (0, 3)])  # 4 vCPUs, no SMT
    assert physical_cores(tmp_path / "vm") == 4
    _topology(tmp_path / "two", [(0, 0), (1, 0), (0, 1), (1, 1)])  # same core ids, 2 packages
    assert physical_cores(tmp_path / "two") == 4
    assert physical_cores(tmp_path / "missing") == 4  # unreadable: the usable CPUs


def _in_a_new_thread(f):
    """``f()`` in a fresh thread (a fresh TVM pool, sized when it first runs)."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(f()))
    t.start()
    t.join()
    return out[0]


def test_machine_cores_without_touching_the_environment(monkeypatch):
    """Without TVM_NUM_THREADS a new thread's pool gets the physical cores (TVM alone: half
    the logical CPUs), and the variable is not left in the environment; a value the user
    set wins."""

    def pool():
        use_machine_cores()
        return pool_threads(), dict(os.environ)

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    before = dict(os.environ)
    threads, env = _in_a_new_thread(pool)
    assert threads == physical_cores() and env == before
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    threads, env = _in_a_new_thread(pool)
    assert threads == 1 and env["TVM_NUM_THREADS"] == "1"


def test_one_thread_restores_the_pool():
    before = pool_threads()
    with one_thread():
        assert pool_threads() == 1
    assert pool_threads() == before


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed on 2+ CPUs (TVM pins a one-thread pool's caller to one)",
)
def test_a_one_thread_pool_leaves_the_threads_on_every_cpu():
    """With a pool of one thread, TVM's resize pins the calling thread to the first CPU
    (and every thread it starts inherits that): the suite's two test processes, each with
    TVM_NUM_THREADS=1, ran on one core. set_threads and one_thread (also in a thread of its
    own, as the calibration's segment VMs run) keep each thread's CPU affinity."""
    code = (
        "import os, threading\n"
        "import tvm, autoq\n"
        "from autoq.threads import one_thread\n"
        "every = os.sched_getaffinity(0)\n"
        "autoq.set_threads(1)\n"
        "seen = [os.sched_getaffinity(0) == every]\n"
        "tvm.get_global_func('runtime.config_threadpool')(1, 1)\n"
        "seen.append(os.sched_getaffinity(0) == every)\n"  # TVM alone: pinned
        "os.sched_setaffinity(0, every)\n"
        "def segment():\n"
        "    with one_thread():\n"
        "        seen.append(os.sched_getaffinity(0) == every)\n"
        "    seen.append(os.sched_getaffinity(0) == every)\n"
        "t = threading.Thread(target=segment); t.start(); t.join()\n"
        "print(*seen)\n"
    )
    assert python_prints(code, tvm_threads=1) == ["True", "False", "True", "True"]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed on 2+ CPUs",
)
def test_no_thread_of_a_two_thread_pool_is_bound_to_one_cpu():
    """TVM's resize in mode 1 ("big cores") binds worker i to CPU i: with another process
    busy on CPU 1, ResNet-50 on 2 threads took 384 ms per call against 28 ms on 1 (the
    worker waits behind the busy process at each of the ~170 kernels). Every thread that
    of the process may run on each of the pool's CPUs, after the pool is made and after a
    round trip through one thread (at one thread TVM binds the idle workers to the first CPU;
    kernels then run on the calling thread alone, which keeps its affinity)."""
    code = (
        "import os\n"
        "import autoq\n"
        "from autoq.threads import use_machine_cores\n"
        "cpus = set(sorted(os.sched_getaffinity(0))[:2])\n"
        "def free():\n"
        "    tids = [int(t) for t in os.listdir('/proc/self/task')]\n"
        "    return len(tids) > 1 and all(os.sched_getaffinity(t) >= cpus for t in tids)\n"
        "use_machine_cores(); seen = [free()]\n"
        "autoq.set_threads(1); autoq.set_threads(2); seen.append(free())\n"
        "print(*seen)\n"
    )
    assert python_prints(code, tvm_threads=2) == ["True", "True"]


# --------------------------------------------- TVM_NUM_THREADS checked (issue 38, item 8)

_CLI_THEN_THREADS = (
    "import os, sys\n"
    "import autoq.cli\n"
    "code = autoq.cli.main(sys.argv[1:])\n"
    "print('threads', len(os.listdir('/proc/self/task')), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_too_many_threads_are_capped_with_a_warning(tmp_path):
    """TVM_NUM_THREADS=512 on a 2-CPU machine: TVM alone starts 512 threads per pool (1027
    in a quantization), which spun for minutes after the result was written."""
    from test_cli import tiny_onnx

    model = tiny_onnx(tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(4, 1, 3, 8, 8)).astype("f4"))
    argv = ["quantize", model, "--calib", tmp_path / "x.npy", "--out", tmp_path / "out"]
    env = {**os.environ, "TVM_NUM_THREADS": "512"}
    r = subprocess.run(
        [sys.executable, "-c", _CLI_THEN_THREADS, *map(str, argv), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "model.so").is_file()
    cpus = len(os.sched_getaffinity(0))
    assert f"autoq: warning: TVM_NUM_THREADS=512 is above the {cpus} CPU(s)" in r.stderr
    threads = int(r.stderr.split("threads ")[-1].split()[0])
    assert threads < 16 + 4 * cpus, r.stderr  # a few pools of `cpus` threads, not 2 x 512


@pytest.mark.parametrize("value", ["0", "-2", "abc", ""])
def test_a_bad_value_is_a_one_line_error_in_the_cli(value, tmp_path, capsys, monkeypatch):
    from test_cli import assert_user_error, run

    monkeypatch.setenv("TVM_NUM_THREADS", value)
    code, _, err = run(capsys, "quantize", tmp_path / "m.onnx", "--out", tmp_path / "out")
    assert_user_error(code, err, f"TVM_NUM_THREADS={value!r}", "whole number from 1 to")
    assert not (tmp_path / "out").exists()


def test_a_bad_value_is_an_input_error_in_the_api(monkeypatch):
    """In a new thread (its pool is not made yet, as in a fresh process): the API call
    fails before any work, naming the variable."""
    from models import TARGET, mlp

    mod, params, data = mlp()
    monkeypatch.setenv("TVM_NUM_THREADS", "abc")
    monkeypatch.setattr("autoq.pipeline.match", lambda *a, **k: pytest.fail("ran"))

    def run():
        try:
            autoq.quantize(mod, params, data(2), target=TARGET)
        except autoq.InputError as e:
            return str(e)

    msg = _in_a_new_thread(run)
    assert msg.startswith("TVM_NUM_THREADS='abc' is not a number of threads: set it to a whole")


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed on 2+ CPUs",
)
def test_quantization_runs_tvm_kernels_on_one_thread_then_gives_the_pool_back(monkeypatch):
    """Calibration parallelizes over samples with threads of its own (a twin VM, the cache
    copier, the observers); a 2-thread TVM pool under them oversubscribed 2 vCPUs (PP-OCRv4
    det quantize, warm cache: 104.2 CPU s against 85.9 on one thread). Inside Quantizer.run the calling thread's pool is one
    thread; after it, the whole pool again."""
    from models import TARGET, mlp

    mod, params, data = mlp()
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    seen = []

    def match(*args, **kwargs):
        seen.append(pool_threads())
        raise RuntimeError("stop after the first stage")

    monkeypatch.setattr("autoq.pipeline.match", match)

    def run():
        use_machine_cores()
        before = pool_threads()
        with pytest.raises(RuntimeError, match="stop after"):
            autoq.quantize(mod, params, data(2), target=TARGET)
        return before, pool_threads()

    assert _in_a_new_thread(run) == (2, 2)
    assert seen == [1]
