"""Calibration statistics over real tokens only (``Config(token_mask=TokenMask("attention_mask"))``).

Transformer inputs are padded to a fixed sequence length; the padded positions are masked
out of attention and of the pooling, so what the model computes there never reaches its
output, yet without a mask they feed every statistic calibration takes (all-MiniLM-L6-v2
padded to 128: 71% of the 16 calibration sentences' positions are padding). With a
:class:`TokenMask` naming the model's ``(batch, seq)`` mask input (non-zero = real token),
the values at padded positions are dropped from:

* every activation observer / calibrator and the scale-health check
  (:class:`autoq.shard_runner.ShardRunner`, also on a cluster's workers; ``calibration="fp32"``
  likewise);
* the weight-tuning statistics (GPTQ Hessians, bias-correction means, the fp32 means of
  empirical bias correction: :mod:`autoq.weight_tuning`);
* SmoothQuant's channel maxima (:mod:`autoq.smooth_quant`);
* the int16 escalation's ranges and per-tensor SQNR shortlist (:mod:`autoq.escalation`);
  its output metric is the model output as it is (a pooled embedding already ignores
  padding).

Which tensors: those whose shape starts with the mask's ``(batch, seq)`` (``"tokens"``:
``(B, S, ...)``) or with ``batch * seq`` (``"rows"``: the flattened ``(B*S, ...)`` a dense
layer reads), see :func:`token_layout`; attention score/probability tensors
``(B, heads, S, S)`` and everything else keep all their values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .errors import DatasetError, InputError
from .json_document import check_keys
from .toolkit import shape_of

__all__ = [
    "TokenMask",
    "keep_of",
    "masked_outputs",
    "real_tokens",
    "token_layout",
    "token_layouts",
]


@dataclass(frozen=True)
class TokenMask:
    """``input``: the name of the model input holding the padding mask, shape
    ``(batch, seq)``, non-zero at real tokens (a Hugging Face ``attention_mask``).

    >>> TokenMask.from_json(TokenMask("attention_mask").to_json())
    TokenMask(input='attention_mask')
    """

    input: str

    def __post_init__(self) -> None:
        if not isinstance(self.input, str) or not self.input:
            raise InputError(
                f"Config.token_mask.input must be the name of the model's (batch, seq) mask "
                f"input, e.g. TokenMask('attention_mask'); got {self.input!r}"
            )

    def to_json(self) -> dict:
        return {"input": self.input}

    @classmethod
    def from_json(cls, d: dict) -> TokenMask:
        check_keys(cls, d)
        return cls(**d)


def token_layout(shape: tuple[int, ...] | None, mask_shape: tuple[int, int]) -> str | None:
    """How a tensor of ``shape`` holds tokens of a ``(batch, seq)`` mask: ``"tokens"``
    (leading axes ``(batch, seq)``), ``"rows"`` (leading axis ``batch * seq``, at least 2-D)
    or None (not per token: kept whole).

    >>> token_layout((1, 128, 384), (1, 128)), token_layout((128, 1536), (1, 128))
    ('tokens', 'rows')
    >>> token_layout((1, 12, 128, 128), (1, 128)), token_layout((1, 384), (1, 128))
    (None, None)
    """
    if shape is None:
        return None
    b, s = mask_shape
    if len(shape) >= 2 and tuple(shape[:2]) == (b, s):
        return "tokens"
    if len(shape) >= 2 and shape[0] == b * s:
        return "rows"
    return None


def real_tokens(x: np.ndarray, keep: np.ndarray, layout: str | None) -> np.ndarray:
    """The values of ``x`` at real tokens (``keep``: bool ``(batch, seq)``), as
    ``(n_real, *rest)``; ``x`` itself when ``layout`` is None.

    >>> x = np.arange(12.0).reshape(1, 3, 4)
    >>> keep = np.array([[True, True, False]])
    >>> real_tokens(x, keep, "tokens")
    array([[0., 1., 2., 3.],
           [4., 5., 6., 7.]])
    >>> real_tokens(x.reshape(3, 4), keep, "rows").shape
    (2, 4)
    """
    if layout is None:
        return x
    x = np.asarray(x)
    if layout == "tokens":
        return x[keep]
    return x[keep.reshape(-1)]


def keep_of(sample: dict, mask: TokenMask) -> np.ndarray:
    """The bool ``(batch, seq)`` real-token mask of one sample."""
    return np.asarray(sample[mask.input]) != 0


def token_layouts(
    mask: TokenMask | None, inputs: Iterable, tensors: dict[str, tuple | None]
) -> dict[str, str]:
    """slot -> layout (:func:`token_layout`) of the ``tensors`` (slot -> shape) holding
    tokens, for the model ``inputs`` (Relax Vars); {} without a mask. The mask input is
    checked: it must exist and be ``(batch, seq)``."""
    if mask is None:
        return {}
    shape = mask_shape(mask, inputs)
    out = {sid: token_layout(shp, shape) for sid, shp in tensors.items()}
    return {sid: lay for sid, lay in out.items() if lay is not None}


def mask_shape(mask: TokenMask, inputs: Iterable) -> tuple[int, int]:
    """The ``(batch, seq)`` shape of the mask input among the model ``inputs`` (Vars);
    InputError naming ``Config.token_mask.input`` when it is missing or not 2-D."""
    shapes = {v.name: shape_of(v) for v in inputs}
    if mask.input not in shapes:
        raise InputError(
            f"Config.token_mask.input = {mask.input!r} is not an input of the model; its "
            f"inputs are {sorted(shapes)}: name the (batch, seq) padding-mask input"
        )
    shp = shapes[mask.input]
    if shp is None or len(shp) != 2:
        raise InputError(
            f"Config.token_mask.input = {mask.input!r} has shape {shp}, not (batch, seq) with "
            "static sizes: name the padding-mask input (non-zero = real token)"
        )
    return (int(shp[0]), int(shp[1]))


def check_real_tokens(mask: TokenMask | None, samples: Iterable[dict]) -> None:
    """DatasetError when no calibration sample has a real token in ``mask``'s input."""
    if mask is not None and not any(keep_of(s, mask).any() for s in samples):
        raise DatasetError(
            f"Config.token_mask: the mask input {mask.input!r} is 0 everywhere in every "
            "calibration sample, so there is no real token to calibrate on: check the input "
            "named (non-zero must mark real tokens) or set token_mask=None"
        )


def masked_outputs(
    outputs: Iterable[list], samples: Iterable[dict], mask: TokenMask | None, layouts: list
) -> Iterable[list]:
    """Per-sample lists of tensors (``outputs``, e.g. of :func:`autoq.calibrate.fp32_runner`
    over ``samples``) with each tensor reduced to its real tokens (``layouts``: one
    :func:`token_layout` per position, None = whole); unchanged without a mask."""
    if mask is None:
        yield from outputs
        return
    for outs, sample in zip(outputs, samples, strict=True):
        keep = keep_of(sample, mask)
        yield [real_tokens(x, keep, lay) for x, lay in zip(outs, layouts, strict=True)]
