"""Weight packing for the int8 CPU kernels (pure numpy, done once at compile time).

The dot-product intrinsics read a ``lanes x k`` block of weights (``lanes`` output channels,
``k`` consecutive reduction elements) from contiguous memory, so weights are stored blocked:

- conv2d ``[OC, IC, KH, KW]`` -> ``[OC/lanes, IC/ic_block, KH, KW, ic_block/k, lanes, k]``
- dense ``[N, K]`` -> ``[N/lanes, K/k, lanes, k]``

Channel counts that are not multiples of the block are zero-padded (a zero weight adds
nothing, whatever the padded activation holds).
"""

from __future__ import annotations

import numpy as np

__all__ = ["compensation", "pack_conv_weight", "pack_dense_weight", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n.

    >>> round_up(3, 4), round_up(16, 16), round_up(17, 16)
    (4, 16, 32)
    """
    return -(-n // multiple) * multiple


def _pad_to(w: np.ndarray, shape) -> np.ndarray:
    out = np.zeros(shape, w.dtype)
    out[tuple(slice(0, d) for d in w.shape)] = w
    return out


def pack_conv_weight(
    w: np.ndarray, lanes: int, k: int, ic_block: int, dtype: str, oc_padded: int | None = None
) -> np.ndarray:
    """OIHW weights blocked as ``[OC/lanes, IC/ic_block, KH, KW, ic_block/k, lanes, k]``,
    output channels zero-padded to ``oc_padded`` (default: a multiple of ``lanes``).

    >>> w = np.arange(2 * 4 * 1 * 1).reshape(2, 4, 1, 1).astype(np.int8)
    >>> p = pack_conv_weight(w, lanes=4, k=2, ic_block=4, dtype="int8")
    >>> p.shape
    (1, 1, 1, 1, 2, 4, 2)
    >>> p[0, 0, 0, 0, 1, :, 0].tolist()  # input channel 2 of output channels 0..3
    [2, 6, 0, 0]
    """
    oc, ic, kh, kw = w.shape
    ocp, icp = oc_padded or round_up(oc, lanes), round_up(ic, ic_block)
    wp = _pad_to(w, (ocp, icp, kh, kw))
    wp = wp.reshape(ocp // lanes, lanes, icp // ic_block, ic_block // k, k, kh, kw)
    return np.ascontiguousarray(wp.transpose(0, 2, 5, 6, 3, 1, 4)).astype(dtype)


def pack_dense_weight(
    w: np.ndarray,
    lanes: int,
    k: int,
    dtype: str,
    n_padded: int | None = None,
    k_padded: int | None = None,
) -> np.ndarray:
    """``[N, K]`` weights blocked as ``[N/lanes, K/k, lanes, k]``, N zero-padded to
    ``n_padded`` (default: a multiple of ``lanes``), K to ``k_padded`` (default: of ``k``).

    >>> w = np.arange(3 * 4).reshape(3, 4).astype(np.int8)
    >>> p = pack_dense_weight(w, lanes=2, k=2, dtype="int8")
    >>> p.shape
    (2, 2, 2, 2)
    >>> p[0, 1].tolist()  # rows 0..1, columns 2..3
    [[2, 3], [6, 7]]
    """
    n, kk = w.shape
    np_, kp = n_padded or round_up(n, lanes), k_padded or round_up(kk, k)
    wp = _pad_to(w, (np_, kp)).reshape(np_ // lanes, lanes, kp // k, k)
    return np.ascontiguousarray(wp.transpose(0, 2, 1, 3)).astype(dtype)


def pack_depthwise_weight(w: np.ndarray, lanes: int) -> np.ndarray:
    """``[C, 1, KH, KW]`` depthwise weights as int16 ``[C/lanes, KH, KW, lanes]``, channels
    zero-padded to a multiple of ``lanes``.

    >>> w = np.arange(3 * 1 * 1 * 2).reshape(3, 1, 1, 2).astype(np.int8)
    >>> p = pack_depthwise_weight(w, lanes=2)
    >>> p.shape
    (2, 1, 2, 2)
    >>> p[:, 0, 1].tolist()  # tap (0, 1) of channels 0..3
    [[1, 3], [5, 0]]
    """
    c, _, kh, kw = w.shape
    wp = _pad_to(w[:, 0], (round_up(c, lanes), kh, kw)).reshape(-1, lanes, kh, kw)
    return np.ascontiguousarray(wp.transpose(0, 2, 3, 1)).astype(np.int16)


def compensation(w: np.ndarray, zero_point: int, padded: int) -> np.ndarray:
    """int32 ``zero_point * sum(w)`` per output channel (axis 0), zero-padded to ``padded``.

    It turns an accumulation over shifted activations back into one over centered ones:
    ``sum((x + s) * w) - (z + s) * sum(w) = sum((x - z) * w)``.

    >>> compensation(np.array([[1, 2], [3, -4]], np.int8), 5, 4).tolist()
    [15, -5, 0, 0]
    """
    sums = w.reshape(w.shape[0], -1).astype(np.int64).sum(axis=1) * zero_point
    return _pad_to(sums.astype(np.int32), (padded,))
