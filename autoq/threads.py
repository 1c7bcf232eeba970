"""TVM's CPU thread pools: how many threads autoq's kernels run on.

TVM gives every calling thread its own pool, sized once, when the thread first runs a
kernel, from ``TVM_NUM_THREADS`` or, without it, from half the logical CPUs on x86 (it
assumes two SMT threads per core). On machines without SMT that halves the cores a model
runs on (one thread on a 2-vCPU machine). So when autoq compiles, loads or calibrates a
model it first gives the calling thread a pool of the machine's physical cores
(:func:`use_machine_cores`; ``TVM_NUM_THREADS`` set by the user wins), setting
``TVM_NUM_THREADS`` only for the moment the pool is created: importing autoq changes
nothing, and the environment is the same after the call. :func:`set_threads` resizes the
calling thread's pool within that size.

Resizing a pool to one thread makes TVM pin the calling thread to the first CPU
(measured, TVM 0.27: with ``TVM_NUM_THREADS=1``, ``set_threads(1)`` left the thread on CPU 0
only, and every thread it started after inherited that; two test processes then shared one
core). autoq keeps the thread's CPU affinity across every resize (:func:`keep_affinity`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import tvm

__all__ = [
    "configure_pool",
    "keep_affinity",
    "one_thread",
    "physical_cores",
    "pool_threads",
    "set_threads",
    "use_machine_cores",
]


def physical_cores(sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores among the CPUs this process may run on: distinct (package, core)
    pairs of Linux's CPU topology; the number of usable CPUs where it is unreadable.

    >>> physical_cores() >= 1
    True
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    try:
        for c in cpus:
            topo = sys_cpu / f"cpu{c}" / "topology"
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
    except OSError:
        cores = set()
    return len(cores) or len(cpus) or os.cpu_count() or 1


_pool_made = threading.local()


def use_machine_cores() -> None:
    """Give the calling thread's TVM pool the physical cores (or ``TVM_NUM_THREADS`` when
    the environment sets it), if this thread has no pool yet; the environment is left as
    it was. A no-op after the first call in a thread."""
    if getattr(_pool_made, "done", False):
        return
    _pool_made.done = True
    name = "TVM_NUM_THREADS"
    if name in os.environ:
        pool_threads()
        return
    os.environ[name] = str(physical_cores())
    try:
        pool_threads()  # the pool is sized now, from the variable
    finally:
        os.environ.pop(name, None)


@contextlib.contextmanager
def keep_affinity():
    """The calling thread's CPU affinity as it was before the block (TVM calls that create
    or resize a one-thread pool pin the thread to the first CPU).

    >>> with keep_affinity():
    ...     pass
    """
    keep = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if keep is not None and os.sched_getaffinity(0) != keep:
            os.sched_setaffinity(0, keep)


def configure_pool(n: int) -> None:
    """Resize the calling thread's TVM pool to ``n`` threads (mode 1, the "big" cores: all
    cores on a homogeneous CPU), keeping the thread's CPU affinity.

    >>> keep, size = os.sched_getaffinity(0), pool_threads()
    >>> configure_pool(1)
    >>> os.sched_getaffinity(0) == keep
    True
    >>> configure_pool(size)
    """
    with keep_affinity():
        tvm.get_global_func("runtime.config_threadpool")(1, int(n))


def pool_threads() -> int:
    """The threads of the calling thread's TVM pool (the first call in a thread creates
    its pool: the thread's CPU affinity is kept)."""
    with keep_affinity():
        return int(tvm.get_global_func("runtime.NumThreads")())


def set_threads(n: int) -> None:
    """Run the calling thread's TVM kernels on ``n`` threads; ``n`` above the pool's size
    (``TVM_NUM_THREADS`` when the pool started) is an error naming the fix, not a silently
    smaller pool.

    >>> set_threads(1)
    """
    if int(n) < 1:
        raise ValueError(f"set_threads: n must be >= 1 thread, got {n}")
    use_machine_cores()
    configure_pool(n)
    got = pool_threads()
    if got != int(n):
        raise ValueError(
            f"set_threads({n}): TVM's thread pool in this process has {got} thread(s) (sized "
            f"when it started, from TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')!r} or "
            "half the logical CPUs on x86); set the environment variable "
            f"TVM_NUM_THREADS={n} before the process runs its first TVM kernel"
        )


@contextlib.contextmanager
def one_thread(active: bool = True):
    """The calling thread's TVM kernels on one thread inside the block (callers that run
    VMs on several threads of their own), its previous size restored after."""
    if not active:
        yield
        return
    before = pool_threads()
    set_threads(1)
    try:
        yield
    finally:
        configure_pool(before)
