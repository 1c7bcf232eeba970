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

A ``TVM_NUM_THREADS`` that is not a whole number >= 1 is an error (TVM alone ignores it
silently); one above the CPUs the process may use is capped to them with a warning (TVM
alone starts that many spinning threads per pool: with 512 on 2 CPUs a quantization
finished, then its 1027 threads kept the process from exiting for minutes).

Resizing a pool to one thread makes TVM pin the calling thread to the first CPU
(measured, TVM 0.27: with ``TVM_NUM_THREADS=1``, ``set_threads(1)`` left the thread on CPU 0
only, and every thread it started after inherited that; two test processes then shared one
core). autoq keeps the thread's CPU affinity across every resize (:func:`keep_affinity`).

Each parallel kernel decides when it launches whether to use the pool at all: TVM 0.27 runs
it serially in the calling thread when the thread's "max concurrency" is 1, and that number
is the length of the CPU list last given to ``runtime.config_threadpool`` in the thread or,
without one, ``TVM_NUM_THREADS`` read at that moment, else half the logical CPUs. With the
variable gone after the pool was made, a 2-thread pool on a 2-vCPU machine ran every kernel
on one thread (measured: ResNet-50 CPU time per call equal to its wall time, 10.4 ms, with
``runtime.NumThreads`` reporting 2). So every resize passes a list of ``n`` CPUs
(:func:`configure_pool`), also when :func:`use_machine_cores` makes the pool.

A resize in TVM's mode 1 ("big cores") binds worker ``i`` to CPU ``i``; :func:`configure_pool`
uses mode -3 (every thread of the pool may run on all of the list's CPUs), so a worker is
not held on a CPU another process keeps busy. That alone does not make two threads robust
on a shared machine: TVM splits each parallel kernel into one fixed part per thread and
its idle workers wait by spinning on ``sched_yield``, so with another process busy on one
of two CPUs every kernel waits for the thread that shares it. Measured (ResNet-50 int8,
2-vCPU Xeon with AMX, processes interleaved in one run, median ms per call, load 4.5):
with a busy process pinned to CPU 1, 1 thread 32, 2 threads bound 672, unbound 384, and
36-40 with ``TVM_THREAD_POOL_SPIN_COUNT=0`` (workers sleep at once); but without the busy
process (load 3.4) that spin count took the second thread's gain away (best call 7.7 ms on
2 threads as on 1, against 4.5 with spinning workers), so TVM's spin count is left as is. :class:`autoq.Session` picks the
width per call instead (:mod:`autoq.session.pool_width`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path

import tvm

from autoq.errors import InputError

__all__ = [
    "configure_pool",
    "keep_affinity",
    "one_thread",
    "physical_cores",
    "pool_size",
    "pool_threads",
    "requested_threads",
    "set_threads",
    "usable_cpus",
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


def usable_cpus() -> int:
    """The logical CPUs this process may run on.

    >>> usable_cpus() >= physical_cores()
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def requested_threads(environ=os.environ) -> int | None:
    """``TVM_NUM_THREADS`` (of ``environ``) as a number of threads, ``None`` unset;
    anything but a whole number >= 1 is an ``InputError`` naming it.

    >>> requested_threads({"TVM_NUM_THREADS": " 3"}), requested_threads({})
    (3, None)
    >>> requested_threads({"TVM_NUM_THREADS": "abc"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoq.errors.InputError: TVM_NUM_THREADS='abc' is not a number of threads: set it to ...
    """
    raw = environ.get("TVM_NUM_THREADS")
    if raw is None:
        return None
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise InputError(
            f"TVM_NUM_THREADS={raw!r} is not a number of threads: set it to a whole number "
            f"from 1 to {usable_cpus()} (the CPUs this process may use), or unset it (autoq "
            f"then uses the {physical_cores()} physical core(s))"
        )
    return n


_capped_warned = []  # the TVM_NUM_THREADS values already warned about (once per process)


def pool_size(environ=os.environ) -> int:
    """The threads of a new TVM pool: :func:`requested_threads`, at most the usable CPUs
    (above them: a warning, once per value, then the cap); without it the physical cores.

    >>> pool_size({"TVM_NUM_THREADS": "1"}), pool_size({}) == physical_cores()
    (1, True)
    """
    n = requested_threads(environ)
    if n is None:
        return physical_cores()
    cpus = usable_cpus()
    if n > cpus:
        if n not in _capped_warned:
            _capped_warned.append(n)
            warnings.warn(
                f"TVM_NUM_THREADS={n} is above the {cpus} CPU(s) this process may use: "
                f"TVM's thread pools get {cpus} thread(s) (more would only spin and slow the "
                "run and its exit)",
                stacklevel=2,
            )
        return cpus
    return n


_pool_made = threading.local()


def use_machine_cores() -> None:
    """Give the calling thread's TVM pool :func:`pool_size` threads (the physical cores, or
    ``TVM_NUM_THREADS`` checked and capped), if this thread has no pool yet; the environment
    is left as it was. A no-op after the first call in a thread."""
    if getattr(_pool_made, "done", False):
        return
    size = pool_size()  # an invalid TVM_NUM_THREADS: an error, before any pool exists
    _pool_made.done = True
    name = "TVM_NUM_THREADS"
    user = os.environ.get(name)
    os.environ[name] = str(size)
    try:
        pool_threads()  # the pool is sized now, from the variable
    finally:
        if user is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = user
    configure_pool(size)  # and its kernels launch on all of it, the variable gone or not


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
    """Resize the calling thread's TVM pool to ``n`` threads, each free to run on any of the
    first ``n`` CPUs this process may use (no worker bound to one CPU), keeping the calling
    thread's CPU affinity.

    >>> keep, size = os.sched_getaffinity(0), pool_threads()
    >>> configure_pool(1)
    >>> os.sched_getaffinity(0) == keep
    True
    >>> configure_pool(size)
    """
    # mode -3, kSpecifyThreadShareAllCore: every thread of the pool may run on all the CPUs
    # of the list (mode 1, "big cores", binds worker i to CPU i); the list's length becomes
    # the thread's launch width (see the module docstring)
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = [str(c) for c in (usable[: int(n)] if len(usable) >= int(n) else range(int(n)))]
    with keep_affinity():
        tvm.get_global_func("runtime.config_threadpool")(-3, int(n), cpus)


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
    if int(n) > usable_cpus():
        raise ValueError(
            f"set_threads({n}): this process may use {usable_cpus()} CPU(s); ask for at most "
            "that many threads"
        )
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
    use_machine_cores()  # a new thread's pool: sized by autoq, not TVM's raw variable
    before = pool_threads()
    set_threads(1)
    try:
        yield
    finally:
        configure_pool(before)
