"""Exact merging of calibrator statistics (the contract in ``autoq.calibrators``).

For every built-in calibrator: batches split at random into shards (some empty), each shard
observed in a random order by its own observer, states pickled (as they would cross a process
boundary) and merged in a random tree must give *bit for bit* the qparams (scale, zero point,
rmin, rmax) of one observer fed every batch in order. The range pass of the histogram
calibrators is sharded and merged the same way. The reference is the one-pass observer, whose
own correctness ``tests/test_calibrators.py`` checks against plain numpy references.
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import dataclass
from typing import ClassVar

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoq import calibrators as cal
from autoq.calibrators.kl import KL
from autoq.calibrators.max import Max
from autoq.calibrators.moving_average import MovingAverage
from autoq.calibrators.mse import MSE
from autoq.calibrators.percentile import Percentile
from autoq.config import QuantSpec

# small bins keep the searches fast; KL keeps candidates to search (int8: 128 levels < 256)
CALIBRATORS = [Max(), MovingAverage(), Percentile(99.0, bins=64), KL(bins=256), MSE(bins=64)]
IDS = [c.name for c in CALIBRATORS]

SPECS = [
    QuantSpec(dtype=d, symmetric=s, narrow_range=n, reduce_range=r)
    for d, s, n, r in itertools.product(["int8", "uint8", "int16"], *[[False, True]] * 3)
]

F32 = np.finfo(np.float32)
# values that stress exactness: signed zeros, subnormals, the float32 extremes
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, F32.tiny, F32.max, -F32.max, F32.max / 3, 1.0, -1.0]
ELEMENTS = {
    "random": st.floats(-1e4, 1e4, allow_nan=False, width=32),
    "extreme": st.floats(allow_nan=False, allow_infinity=False, width=32),
    "special": st.sampled_from(SPECIAL),
    "zeros": st.sampled_from([0.0, -0.0]),
}


@st.composite
def datasets(draw):
    """(axis, batches): 1 to 8 batches of 1 to 12 values per channel (single elements
    included), per-tensor 1-D or per-channel (C, n) / (n, C); random, extreme, special-value,
    all-zero or constant data."""
    axis = draw(st.sampled_from([None, 0, 1]))
    channels = draw(st.integers(1, 3))
    kind = draw(st.sampled_from([*ELEMENTS, "constant"]))
    if kind == "constant":
        elements = st.just(draw(ELEMENTS["extreme"]))
    else:
        elements = ELEMENTS[kind]
    batches = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 12))
        shape = (n,) if axis is None else (channels, n) if axis == 0 else (n, channels)
        batches.append(draw(hnp.arrays(np.float32, shape, elements=elements)))
    return axis, batches


def bits(q) -> tuple:
    """Everything a QParam holds, as bytes: equal means bit-identical (-0.0 != 0.0)."""
    arrays = (q.scale, q.zero_point, q.rmin, q.rmax)
    return (q.dtype, q.axis, *((a.dtype.str, a.shape, a.tobytes()) for a in arrays))


def range_bits(data_range) -> tuple:
    return tuple(np.asarray(v).dtype.str + np.asarray(v).tobytes().hex() for v in data_range)


def feed(obs, batches):
    for b in batches:
        obs.update(b)
    return obs


def wire(state):
    """A state as another process receives it."""
    return pickle.loads(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))


def shard_and_merge(make, batches, rnd, k):
    """Observers from ``make()``, one per shard (a random assignment of the batches, each
    shard in a random order), merged in a random binary tree; returns the root."""
    shards = [[] for _ in range(k)]
    for b in batches:
        shards[rnd.randrange(k)].append(b)
    pool = []
    for shard in shards:
        rnd.shuffle(shard)
        pool.append(feed(make(), shard))
    while len(pool) > 1:
        a = pool.pop(rnd.randrange(len(pool)))
        b = pool.pop(rnd.randrange(len(pool)))
        if rnd.random() < 0.5:
            a.merge(b)  # in-process
        else:
            a.merge_state(wire(b.state()))  # across a process boundary
        pool.append(a)
    return pool[0]


PROPERTY = settings(max_examples=40, deadline=None)
# extreme data must not produce NaN or overflow inside the statistics
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@PROPERTY
@given(
    data=datasets(),
    spec=st.sampled_from(SPECS),
    k=st.integers(1, 5),
    rnd=st.randoms(use_true_random=False),
)
def test_sharded_merge_is_bit_identical_to_one_pass(calibrator, data, spec, k, rnd):
    axis, batches = data
    data_range = None
    if calibrator.needs_range:
        data_range = feed(cal.range_observer(axis), batches).data_range()
        merged = shard_and_merge(lambda: cal.range_observer(axis), batches, rnd, k)
        assert range_bits(merged.data_range()) == range_bits(data_range)
    one_pass = feed(calibrator.observer(axis, data_range), batches).compute(spec)
    sharded = shard_and_merge(lambda: calibrator.observer(axis, data_range), batches, rnd, k)
    assert bits(sharded.compute(spec)) == bits(one_pass)


@pytest.mark.parametrize("calibrator", [c for c in CALIBRATORS if c.name != "moving_average"])
@PROPERTY
@given(data=datasets(), spec=st.sampled_from(SPECS), rnd=st.randoms(use_true_random=False))
def test_rebatching_changes_nothing(calibrator, data, spec, rnd):
    """The same values cut into other batches give the same qparams: min/max and histogram
    counts depend on each value alone. (``moving_average`` is the mean of per-batch ranges:
    its batches are part of its definition, and the drivers make one batch per sample.)"""
    axis, batches = data
    along = 0 if axis in (None, 1) else 1
    everything = np.concatenate(batches, axis=along)
    n = everything.shape[along]
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(0, n - 1))) if n > 1 else []
    rebatched = np.split(everything, cuts, axis=along)
    ranges = [feed(cal.range_observer(axis), b).data_range() for b in (batches, rebatched)]
    assert range_bits(ranges[0]) == range_bits(ranges[1])
    rng = ranges[0] if calibrator.needs_range else None
    a = feed(calibrator.observer(axis, rng), batches).compute(spec)
    b = feed(calibrator.observer(axis, rng), rebatched).compute(spec)
    assert bits(a) == bits(b)


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@settings(max_examples=15, deadline=None)
@given(data=datasets())
def test_state_is_plain_numpy_and_round_trips(calibrator, data):
    """A state is a dict of numeric numpy arrays (no Python objects), survives pickling and
    ``np.savez``, and an empty observer's state merges as a no-op."""
    axis, batches = data
    rng = feed(cal.range_observer(axis), batches).data_range() if calibrator.needs_range else None
    obs = feed(calibrator.observer(axis, rng), batches)
    state = obs.state()
    assert isinstance(state, dict) and state
    assert all(isinstance(v, np.ndarray) and v.dtype.kind in "iuf" for v in state.values())
    back = wire(state)
    assert back.keys() == state.keys()
    assert all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items())
    fresh = calibrator.observer(axis, rng)
    fresh.merge_state(calibrator.observer(axis, rng).state())  # empty shard
    fresh.merge_state(back)
    spec = QuantSpec()
    assert bits(fresh.compute(spec)) == bits(obs.compute(spec))
    assert bits(cal.merge_states(calibrator, [state], axis, rng).compute(spec)) == bits(
        obs.compute(spec)
    )
    # the state does not alias the observer: updating one leaves the other alone
    before = {k: v.copy() for k, v in state.items()}
    obs.update(batches[0])
    assert all(np.array_equal(before[k], state[k]) for k in state)


def test_moving_average_state_keeps_exact_sums():
    """Per-batch minima 1e16, 1 and -1e16: their float64 sum depends on the order
    ((1e16 + 1) - 1e16 == 0, (1e16 - 1e16) + 1 == 1); the exact state, sharded and sent over
    the wire, gives the correctly rounded mean 1/3 whatever the split."""
    batches = [np.array([1e16, 2e16]), np.array([1.0, 2.0]), np.array([-1e16, 5.0])]
    for split in ([0, 2], [1]), ([0], [1, 2]), ([2], [0, 1]):
        a, b = MovingAverage().observer(), MovingAverage().observer()
        feed(a, [batches[i] for i in split[0]])
        feed(b, [batches[i] for i in split[1]])
        a.merge_state(wire(b.state()))
        q = a.compute(QuantSpec(dtype="int16"))
        assert float(q.rmin) == np.float32(1 / 3), split
    assert a.state()["sum_lo"].dtype == np.uint8 and a.state()["count"] == 3


def test_states_of_another_calibrator_or_range_are_refused():
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    rng = (-1.0, 1.0)
    pct = feed(Percentile(bins=64).observer(None, rng), [x])
    with pytest.raises(ValueError, match=r"HistogramObserver\.merge_state: expected"):
        MSE(bins=64).observer(None, rng).merge_state(pct.state())
    with pytest.raises(ValueError, match="64 bins"):
        Percentile(bins=64).observer(None, rng).merge_state(
            feed(Percentile(bins=32).observer(None, rng), [x]).state()
        )
    with pytest.raises(ValueError, match="different data ranges"):
        Percentile(bins=64).observer(None, (-2.0, 1.0)).merge_state(pct.state())
    with pytest.raises(ValueError, match=r"MaxObserver\.merge_state"):
        Max().observer().merge_state(pct.state())
    with pytest.raises(TypeError, match="numeric numpy"):
        Max().observer().merge_state({"lo": [1.0], "hi": [2.0]})
    # statistics do not depend on the method's options: a 99.9 % state merges into 99 %
    p99 = Percentile(99.0, bins=64).observer(None, rng)
    p99.merge_state(pct.state())
    want = feed(Percentile(99.0, bins=64).observer(None, rng), [x]).compute(QuantSpec())
    assert bits(p99.compute(QuantSpec())) == bits(want)


@dataclass(frozen=True)
class NoStateCalibrator:
    """A user calibrator whose observer merges in-process only (no state/merge_state)."""

    name: ClassVar[str] = "halfmax"
    needs_range: ClassVar[bool] = False

    def observer(self, axis=None, data_range=None):
        return _NoStateObserver()


class _NoStateObserver:
    def update(self, x):
        pass

    def merge(self, other):
        pass

    def compute(self, spec):
        raise NotImplementedError


def clip_range(batch):
    return float(batch.min()), float(batch.max())


def test_check_mergeable_names_the_calibrator_and_the_missing_methods():
    for c in CALIBRATORS:
        cal.check_mergeable(c)
        cal.check_mergeable(c, axis=0)
    cal.check_mergeable(cal.get(clip_range))  # user range functions merge by union
    with pytest.raises(TypeError) as e:
        cal.check_mergeable(NoStateCalibrator())
    msg = str(e.value)
    assert "'halfmax'" in msg and "NoStateCalibrator" in msg
    assert "no state and no merge_state method" in msg and "in-process" in msg


@settings(max_examples=25, deadline=None)
@given(data=datasets(), rnd=st.randoms(use_true_random=False), k=st.integers(1, 4))
def test_user_range_function_merges_exactly(data, rnd, k):
    axis, batches = data
    c = cal.get(clip_range)
    spec = QuantSpec()
    one_pass = feed(c.observer(axis), batches).compute(spec)
    sharded = shard_and_merge(lambda: c.observer(axis), batches, rnd, k)
    assert bits(sharded.compute(spec)) == bits(one_pass)
