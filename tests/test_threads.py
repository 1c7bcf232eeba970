"""autoq.set_threads: TVM sizes its thread pool once per process (TVM_NUM_THREADS, or half
the logical CPUs on x86), so a request above the pool is an error naming the fix instead
of a silently smaller pool (on a 2-vCPU machine TVM's default pool holds one thread, and
"2 threads" used to run on one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tvm

import autoq


def _used() -> int:
    return int(tvm.get_global_func("runtime.NumThreads")())


def test_more_threads_than_the_pool_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"TVM_NUM_THREADS=4096 before"):
        autoq.set_threads(4096)
    assert _used() >= 1  # the failed request left the whole pool in use
    with pytest.raises(ValueError, match="n must be >= 1"):
        autoq.set_threads(0)


def test_set_threads_takes_effect_within_the_pool():
    code = (
        "import tvm, autoq\n"
        "n = lambda: int(tvm.get_global_func('runtime.NumThreads')())\n"
        "autoq.set_threads(3); a = n()\n"
        "autoq.set_threads(1); b = n()\n"
        "print(a, b)\n"
    )
    env = {**os.environ, "TVM_NUM_THREADS": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "1"]
