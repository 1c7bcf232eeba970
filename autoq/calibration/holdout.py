"""Held-out samples: the last ``n`` samples of a dataset kept out of a fit and used only to
check it (``AutoFallback.holdout``: :mod:`autoq.fallback.auto_fallback`;
``BiasCorrection.holdout``: :mod:`autoq.accuracy.bias_gate`)."""

from __future__ import annotations

__all__ = ["split_holdout"]


def split_holdout(dataset, n: int, option: str = "AutoFallback.holdout") -> tuple:
    """(fit part, held-out part): the last ``n`` samples held out (0: none, the dataset as it
    is). ``option`` names the setting in the error when nothing would be left to fit on.

    >>> split_holdout([1, 2, 3], 1)
    ([1, 2], [3])
    """
    if not n:
        return dataset, []
    items = list(dataset)
    if len(items) <= n:
        raise ValueError(
            f"{option}={n} leaves no calibration samples: the dataset has "
            f"{len(items)}; lower {option.rsplit('.', 1)[-1]} or give more samples"
        )
    return items[:-n], items[-n:]
