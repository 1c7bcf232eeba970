"""autoq.session.pool_width.WidthChooser (issue 35): a session keeps the width (threads per
call) whose recent calls were faster, and re-times the other one at a backing-off interval.
Measured on a 2-vCPU machine (ResNet-50 int8): with a CPU to itself 2 threads took 4.5 ms
and 1 thread 7.1; with another process busy on CPU 1, 2 threads took 672 ms and 1 thread 32.
The times below are those figures, fed by hand: the chooser only compares them."""

from __future__ import annotations

import itertools

import pytest

from autoq.session.pool_width import WidthChooser

IDLE = {1: 7.1, 2: 4.5}
BUSY = {1: 32.0, 2: 672.0}


def calls(chooser: WidthChooser, times: dict, n: int) -> list[int]:
    """The widths of ``n`` calls, each recorded with ``times[width]``."""
    seen = []
    for _ in range(n):
        w = chooser.next()
        chooser.record(w, times[w])
        seen.append(w)
    return seen


def test_each_width_is_timed_in_turn_then_the_faster_one_kept():
    c = WidthChooser((2, 1))
    assert calls(c, IDLE, 6) == [1, 2, 1, 2, 1, 2]
    assert calls(c, IDLE, 7) == [2] * 7  # the probe comes after FIRST_INTERVAL calls


def test_a_busy_cpu_moves_to_one_thread_within_two_calls_and_probes_back_off():
    c = WidthChooser((1, 2))
    calls(c, IDLE, 6)
    seen = calls(c, BUSY, 4200)
    assert seen[:2] == [2, 2] and seen[2] == 1  # the median of 3 turns after 2 slow calls
    probes = [i for i, w in enumerate(seen[2:]) if w == 2]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    # 8 calls, then 16, 32, ... up to MAX_INTERVAL: a busy machine pays one slow call in 1024
    assert gaps[:4] == [17, 33, 65, 129] and max(gaps) == WidthChooser.MAX_INTERVAL + 1
    assert len(probes) < 15


def test_an_idle_machine_again_gets_two_threads_at_the_next_probe():
    c = WidthChooser((1, 2))
    calls(c, IDLE, 6)
    calls(c, BUSY, 100)
    seen = calls(c, IDLE, WidthChooser.MAX_INTERVAL + 2)
    first = seen.index(2)  # the probe: faster than one thread's median, so kept
    assert seen[first : first + 3] == [2, 2, 2]
    later = calls(c, IDLE, 2000)  # one thread now probed, at the backing-off interval
    assert later.count(1) < 10 and later[-8:] == [2] * 8


def test_one_width_is_always_that_width_and_a_bad_width_is_an_error():
    assert calls(WidthChooser((1,)), IDLE, 20) == [1] * 20
    with pytest.raises(ValueError, match="thread counts >= 1"):
        WidthChooser((0, 2))


def test_the_worked_example_in_the_docstring():
    import doctest

    from autoq.session import pool_width

    assert doctest.testmod(pool_width).failed == 0
