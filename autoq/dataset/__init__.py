"""Calibration data: the dataset contract, validation, and loaders.

**Contract.** A dataset is a source of *samples*; a sample is one call of the model: a dict
``{input name: np.ndarray}`` with exactly the model's data inputs, or, for a single-input
model, just the array. Arrays must have the input's shape and dtype (a missing leading batch
axis of size 1 is added: ``(3, 224, 224)`` is accepted for ``(1, 3, 224, 224)``; nothing else
is converted or cast). Accepted sources:

* any re-iterable (``list``, ``tuple``, a ``torch`` ``DataLoader`` yielding dicts, an
  :class:`ImageFolder`, any object whose ``__iter__`` starts over): iterated again for every
  pass, nothing is kept in memory;
* a zero-argument callable returning an iterable (e.g. a generator function): called once per
  pass, nothing kept;
* a one-shot iterator (a generator object, ``iter(...)``): it cannot be rewound, so the
  samples it yields are kept in memory as they are consumed, and later passes replay them
  (then continue where the iterator stopped, if a pass ended early). This is the only case
  that holds samples in RAM; pass ``cache=False`` to forbid it (a second pass then raises),
  or pass a generator *function* instead of a generator to stream every pass;
* stacked arrays: an :class:`ArrayDataset` (:func:`from_npz`, :func:`from_npy`), a dict
  ``{input name: array}`` or a bare array (single input). Each array is split along axis 0:
  an array of exactly the input's shape is one sample; ``(k * B, ...)`` for an input of
  batch ``B`` is ``k`` samples; ``(k, *shape)`` is ``k`` samples of ``shape``.

**Validation before any work.** :func:`as_dataset` (which the calibration driver calls
before compiling anything) checks the dataset against the model's :class:`InputSpec` list
and raises :class:`DatasetError` naming the problem: an empty dataset; unknown, missing or
extra input names (listing the expected ones); the wrong shape or dtype (input name, expected
vs given); NaN or Inf values (input name and sample index). In-memory datasets (lists,
tuples, stacked arrays) are checked entirely up front; streamed ones have their first sample
checked up front and every later sample checked as it arrives, before the model sees it.

**Loaders.** :func:`from_image_folder` (Pillow: the most common imaging library, and the
one real preprocessing pipelines such as the ONNX model packages use; its choices are an
:class:`ImagePreprocessing`, saved with a quantized model), :func:`from_npz`, :func:`from_npy`.

**Modules.** :mod:`.contract` (input specs, per-sample validation, :class:`DatasetError`),
:mod:`.arrays` (stacked arrays, ``.npz``/``.npy``), :mod:`.images` (image folders) and
:mod:`.calibration` (:class:`CalibrationDataset`, :func:`as_dataset`: the repeatable view the
calibration driver iterates) and :mod:`.shards` (sources the workers of a distributed
calibration read themselves: :class:`NpzShards`, :class:`ImageFolderShards`,
:class:`CallableShards`).
"""

from __future__ import annotations

from autoq.dataset.arrays import ArrayDataset, from_npy, from_npz
from autoq.dataset.calibration import CalibrationDataset, as_dataset
from autoq.dataset.contract import (
    DatasetError,
    InputSpec,
    index_bounds,
    input_specs,
    validate_sample,
)
from autoq.dataset.images import (
    IMAGE_EXTENSIONS,
    ImageFolder,
    ImagePreprocessing,
    from_image_folder,
)
from autoq.dataset.shards import (
    CallableShards,
    ImageFolderShards,
    NpzShards,
    ShardSource,
    is_shard_source,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArrayDataset",
    "CalibrationDataset",
    "CallableShards",
    "DatasetError",
    "ImageFolder",
    "ImageFolderShards",
    "ImagePreprocessing",
    "InputSpec",
    "NpzShards",
    "ShardSource",
    "as_dataset",
    "from_image_folder",
    "from_npy",
    "from_npz",
    "index_bounds",
    "input_specs",
    "is_shard_source",
    "validate_sample",
]
