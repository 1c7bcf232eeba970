"""Every sample of the user's dataset reaches calibration exactly once (issue 17, item 1):
generators of 1, 2 and 10 samples, and loaders whose ``__iter__`` does not start over,
calibrate to exactly the qparams of the same samples given as a list, and the number of
samples the calibration runner loaded is the number given."""

from __future__ import annotations

import pytest

import autoq
from models import TARGET, mlp


def _run(dataset):
    return autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(*MODEL, dataset)


MODEL = mlp()[:2]
SAMPLES = mlp()[2](10)


class SharedIterator:
    """A loader whose ``__iter__`` returns the same iterator every time."""

    def __init__(self, xs):
        self.it = iter(xs)

    def __iter__(self):
        return self.it


class ContinuingGenerator:
    """A loader whose ``__iter__`` is a fresh generator over one shared stream."""

    def __init__(self, xs):
        self.it = iter(xs)

    def __iter__(self):
        yield from self.it


@pytest.fixture(scope="module")
def reference():
    return {n: _run(SAMPLES[:n]).qparams.params for n in (1, 2, 10)}


@pytest.mark.parametrize("n", [1, 2, 10])
def test_generator_of_n_samples(n, reference):
    r = _run(s for s in SAMPLES[:n])
    assert r.samples == n
    assert r.qparams.meta["stats"]["samples"] == n  # what the calibration runner loaded
    assert r.qparams.params == reference[n]


@pytest.mark.parametrize("loader", [SharedIterator, ContinuingGenerator])
def test_loader_that_does_not_restart(loader, reference):
    with pytest.warns(UserWarning, match="does not start over"):
        r = _run(loader(SAMPLES))
    assert r.qparams.meta["stats"]["samples"] == 10
    assert r.qparams.params == reference[10]


def test_restarting_loader_streams_without_warning(reference, recwarn):
    class Restarting:
        def __iter__(self):
            return iter(SAMPLES)

    r = _run(Restarting())
    assert r.qparams.meta["stats"]["samples"] == 10
    assert r.qparams.params == reference[10]
    assert not [w for w in recwarn if "start over" in str(w.message)]


def test_pass_with_a_different_count_is_an_error():
    """A loader that restarts but yields fewer samples on a later pass."""
    from autoq.dataset import as_dataset, input_specs

    class Shrinking:
        calls = 0

        def __iter__(self):
            Shrinking.calls += 1
            return iter(SAMPLES if Shrinking.calls <= 3 else SAMPLES[:4])

    ds = as_dataset(Shrinking(), input_specs(*MODEL))
    assert len(list(ds)) == 10
    with pytest.raises(autoq.DatasetError, match="10 samples on its first pass and 4"):
        list(ds)
