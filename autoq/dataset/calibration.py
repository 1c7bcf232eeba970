"""The object the calibration driver iterates: a validated, repeatable view of the user's
dataset, whatever its kind (see :mod:`autoq.dataset` for the contract)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from autoq.dataset.arrays import ArrayDataset
from autoq.dataset.contract import DatasetError, InputSpec, input_specs, validate_sample

__all__ = ["CalibrationDataset", "as_dataset"]


def _is_one_shot(obj) -> bool:
    """An iterator (it has ``__next__``): iterating it again does not start over."""
    return isinstance(obj, Iterator)


def _same_sample(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class CalibrationDataset:
    """A validated, repeatable view of a user's dataset (build it with :func:`as_dataset`).

    Iterating yields ``{input name: np.ndarray}`` dicts in the specs' order, every sample
    checked; each ``for`` loop is one pass. ``num_samples`` is known after the first full
    pass (or at once for in-memory datasets).
    """

    def __init__(
        self,
        dataset,
        specs: Sequence[InputSpec],
        *,
        limit: int | None = None,
        cache: bool | str = "auto",
    ):
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        if cache not in ("auto", True, False):
            raise ValueError(f"cache must be 'auto', True or False, got {cache!r}")
        self.specs = list(specs)
        if not self.specs:
            raise DatasetError("the model has no data inputs to calibrate")
        self.limit = limit
        self.num_samples: int | None = None
        self._samples: list | None = None  # validated, when everything is in memory
        self._factory: Callable[[], Iterable] | None = None
        self._iterator: Iterator | None = None  # one-shot source
        self._buffer: list[dict] = []  # what the one-shot source has yielded so far
        self._exhausted = False
        self._keep = cache is not False
        self._streamed = False

        if dataset is None or isinstance(dataset, str | bytes):
            raise DatasetError(
                f"a dataset must be an iterable of samples, got {type(dataset).__name__}"
            )
        if isinstance(dataset, ArrayDataset | np.ndarray) or (
            isinstance(dataset, Mapping) and all(hasattr(v, "shape") for v in dataset.values())
        ):
            if isinstance(dataset, np.ndarray):
                dataset = ArrayDataset({None: dataset})
            elif isinstance(dataset, Mapping):
                dataset = ArrayDataset(dataset)
            self._set_samples(dataset.samples(self.specs))
        elif isinstance(dataset, list | tuple):
            self._set_samples(dataset)
        elif _is_one_shot(dataset):
            self._iterator = dataset
            self._peek_one_shot()
        elif callable(dataset) and not hasattr(dataset, "__iter__"):
            self._factory = dataset
            self._peek(self._factory())
        elif hasattr(dataset, "__iter__"):
            self._factory = lambda: dataset
            if cache is True:
                self._iterator = iter(dataset)
                self._peek_one_shot()
                self._factory = None
            else:
                self._peek_restart(dataset)
        else:
            raise DatasetError(
                f"a dataset must be an iterable of samples or a function returning one, "
                f"got {type(dataset).__name__}"
            )

    def _set_samples(self, samples: Sequence) -> None:
        """An in-memory dataset: every sample is checked now."""
        if self.limit is not None:
            samples = samples[: self.limit]
        if not len(samples):
            raise DatasetError("the calibration dataset is empty: it yielded no samples")
        samples = [validate_sample(s, i, self.specs) for i, s in enumerate(samples)]
        self._samples = samples
        self.num_samples = len(samples)

    def _peek(self, iterable) -> None:
        for raw in iterable:
            validate_sample(raw, 0, self.specs)
            return
        raise DatasetError("the calibration dataset is empty: it yielded no samples")

    def _peek_restart(self, dataset) -> None:
        """Check the first sample, and that ``iter(dataset)`` starts over: a second iterator
        must begin with the same sample. A loader whose ``__iter__`` continues where the
        last one stopped (or returns the same iterator) would otherwise lose the samples
        each stage peeks at; it is read once instead, its samples kept and replayed (with
        a warning)."""
        first_it = iter(dataset)
        first = next(first_it, None)
        if first is None:
            raise DatasetError("the calibration dataset is empty: it yielded no samples")
        first = validate_sample(first, 0, self.specs)
        again = iter(dataset)
        second = None if again is first_it else next(again, None)
        if second is not None:
            second = validate_sample(second, 1, self.specs)
            if _same_sample(first, second):
                return  # it restarts: stream every pass
        import warnings

        warnings.warn(
            f"the dataset's __iter__ ({type(dataset).__name__}) does not start over (a second "
            "iterator did not begin with the first sample): its samples are read once, kept "
            "in memory and replayed, so every stage sees the same samples. Pass a list or a "
            "function returning a fresh iterator to stream instead.",
            stacklevel=4,
        )
        self._factory = None
        self._keep = True
        self._iterator = again
        self._buffer = ([first] if second is None else [first, second])[: self.limit]
        if second is None and again is not first_it:
            self._exhausted = True
            self.num_samples = 1

    def _peek_one_shot(self) -> None:
        if self._pull() is None:
            raise DatasetError("the calibration dataset is empty: it yielded no samples")

    def _pull(self) -> dict | None:
        """Next sample of the one-shot source, validated and kept in the buffer."""
        if self._exhausted or (self.limit is not None and len(self._buffer) >= self.limit):
            self._exhausted = True
            return None
        try:
            raw = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            self.num_samples = len(self._buffer)
            return None
        sample = validate_sample(raw, len(self._buffer), self.specs)
        self._buffer.append(sample)
        return sample

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._samples is not None:
            return iter(self._samples)
        if self._iterator is not None:
            return self._iter_one_shot()
        return self._iter_factory()

    def _iter_one_shot(self):
        if not self._keep:
            # streaming without keeping: only the peeked sample is held, and only one pass
            if self._streamed:
                raise DatasetError(
                    "the dataset is a one-shot iterator (e.g. a generator object) that was "
                    "already consumed and cache=False; pass a list, a re-iterable, or a "
                    "function returning a fresh iterator"
                )
            self._streamed = True
            yield from self._buffer
            self._buffer = []
            k = 1
            for raw in self._iterator:
                if self.limit is not None and k >= self.limit:
                    break
                yield validate_sample(raw, k, self.specs)
                k += 1
            self.num_samples = k
            return
        i = 0
        while i < len(self._buffer) or self._pull() is not None:
            yield self._buffer[i]
            i += 1
        # the source is exhausted (or the limit reached): from now on replay the buffer
        self.num_samples = len(self._buffer)
        self._samples = self._buffer

    def _iter_factory(self):
        k = 0
        for raw in self._factory():
            if self.limit is not None and k >= self.limit:
                break
            yield validate_sample(raw, k, self.specs)
            k += 1
        if k == 0:
            raise DatasetError("the calibration dataset is empty: this pass yielded no samples")
        if self.num_samples is None:
            self.num_samples = k
        elif k != self.num_samples:
            raise DatasetError(
                f"the dataset yielded {self.num_samples} samples on its first pass and {k} on "
                "a later one: every stage must see the same samples; pass a list, or a "
                "function returning a fresh iterator over the same samples"
            )


def as_dataset(
    dataset,
    model,
    params=None,
    *,
    limit: int | None = None,
    cache: bool | str = "auto",
) -> CalibrationDataset:
    """Check ``dataset`` against a model's inputs and return a repeatable view of it.

    ``model`` is an ``IRModule`` or ``relax.Function`` (its data inputs are the parameters
    not in ``params``) or a list of :class:`InputSpec`. ``limit`` caps the samples per pass.
    ``cache``: ``"auto"`` keeps the samples of one-shot iterators (only those) so that they
    can be replayed; ``True`` keeps every sample (for expensive loaders); ``False`` never keeps
    samples (one pass only over a one-shot iterator). Raises :class:`DatasetError` before any
    model work if the data does not fit (see the module docstring).
    """
    if isinstance(model, list | tuple) and all(isinstance(s, InputSpec) for s in model):
        specs = list(model)
    else:
        specs = input_specs(model, params)
    if isinstance(dataset, CalibrationDataset) and dataset.specs == specs and limit is None:
        return dataset  # already validated for these inputs: every stage shares one view
    return CalibrationDataset(dataset, specs, limit=limit, cache=cache)
