"""Cross-layer equalization and high-bias absorption (Nagel, van Baalen, Blankevoort,
Welling 2019, "Data-Free Quantization Through Weight Equalization and Bias Correction",
ICCV; "DFQ"), the numpy math. Both rewrite the weights of a float model into an equivalent
one that quantizes better, before calibration.

**Equalization.** Two layers ``y = W2 f(W1 x + b1) + b2`` with ``f`` positively homogeneous
per channel (identity, ReLU; zero padding too) compute the same function after
``W1[i] /= s_i``, ``b1[i] /= s_i``, ``W2[:, i] *= s_i`` for any ``s_i > 0``:
``f(z / s) = f(z) / s``. With ``r1_i`` = range of output channel ``i`` of ``W1`` and
``r2_i`` = range of input channel ``i`` of ``W2``, DFQ's choice (their eq. 10)

    ``s_i = sqrt(r1_i * r2_i) / r2_i``

makes both ranges ``sqrt(r1_i r2_i)``: per-tensor (and even per-channel) int8 grids then fit
every channel about equally. Depthwise layers (a channel's range is set by 9 or 25 weights)
are where it matters most. A bounded activation ``clip(z, lo, hi)`` (ReLU6) stays exact
only with per-channel bounds ``lo/s_i``, ``hi/s_i`` (:func:`scaled_bounds`); DFQ instead
replaced ReLU6 by ReLU in MobileNetV2, which changes the float model.

**High-bias absorption** (DFQ sec. 4.1). After equalization some channels have large
biases, so the activation after ``f`` = ReLU sits far from 0 and widens its quantization
range. When the pre-activation ``z_i`` is always ``>= c_i >= 0``,
``relu(z_i) = relu(z_i - c_i) + c_i``, so ``b1_i -= c_i`` and the constant moves into the
next layer: ``b2 += W2 @ c`` (each kernel tap of input channel ``i`` adds ``c_i``). DFQ
takes ``c = max(0, beta - 3 gamma)`` from the batch norm; without one, the same rule on the
observed mean and standard deviation of ``z`` (:func:`high_bias_amount`), optionally capped
by the observed minimum so that it is exact on the data. The absorbed constant is exact
only where ``W2`` reads no *padding* (1x1 convolutions, dense layers): a zero-padded border
would have carried ``c`` too.

Layouts: ``W1`` has its output channels on axis 0 (OIHW kernels, ``(out, in)`` dense
weights); ``W2`` its input channels on axis 1, with ``groups2`` groups (depthwise: groups =
channels, ``W2`` ``(C, 1, kh, kw)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "absorb_high_bias",
    "apply_equalization",
    "equalization_scales",
    "equalize_chain",
    "high_bias_amount",
    "input_channel_ranges",
    "output_channel_ranges",
    "scaled_bounds",
]


def output_channel_ranges(w1) -> np.ndarray:
    """``max |W1[i, ...]|`` per output channel ``i`` (axis 0)."""
    w1 = np.asarray(w1)
    return np.abs(w1.reshape(w1.shape[0], -1)).max(axis=1)


def _input_view(w2, groups: int) -> np.ndarray:
    """``W2`` as ``(G, O/G, C/G, rest)``: input channel ``g*C/G + j`` is ``[:, :, j]`` of
    group ``g``."""
    w2 = np.asarray(w2)
    if w2.ndim < 2 or w2.shape[0] % groups:
        raise ValueError(f"W2 {w2.shape} does not split into {groups} groups on axis 0")
    return w2.reshape(groups, w2.shape[0] // groups, w2.shape[1], -1)


def input_channel_ranges(w2, groups: int = 1) -> np.ndarray:
    """``max |W2[:, i, ...]|`` per input channel ``i`` (over the rows that read it).

    >>> input_channel_ranges(np.array([[1.0, -3.0], [2.0, 0.5]]))
    array([2., 3.])
    >>> input_channel_ranges(np.array([[[[1.0, -4.0]]], [[[2.0, 0.5]]]]), groups=2)
    array([4., 2.])
    """
    v = np.abs(_input_view(w2, groups))
    return v.max(axis=(1, 3)).reshape(-1)


def equalization_scales(r1, r2) -> np.ndarray:
    """DFQ's ``s_i = sqrt(r1_i * r2_i) / r2_i``; 1 where either range is 0 (a dead channel
    has nothing to equalize).

    >>> equalization_scales(np.array([4.0, 1.0, 0.0]), np.array([1.0, 4.0, 2.0]))
    array([2. , 0.5, 1. ])
    """
    r1 = np.asarray(r1, np.float64)
    r2 = np.asarray(r2, np.float64)
    ok = (r1 > 0) & (r2 > 0)
    return np.where(ok, np.sqrt(np.where(ok, r1 * r2, 1.0)) / np.where(ok, r2, 1.0), 1.0)


def apply_equalization(w1, b1, w2, s, groups2: int = 1):
    """``(W1 / s, b1 / s, W2 * s)`` along W1's output and W2's input channels (dtypes kept;
    ``b1`` may be None). The ranges become equal:

    >>> w1, w2 = np.array([[4.0], [1.0]]), np.array([[1.0, 4.0]])
    >>> s = equalization_scales(output_channel_ranges(w1), input_channel_ranges(w2))
    >>> w1e, b1e, w2e = apply_equalization(w1, np.array([2.0, 2.0]), w2, s)
    >>> w1e.ravel().tolist(), b1e.tolist(), w2e.ravel().tolist()
    ([2.0, 2.0], [1.0, 4.0], [2.0, 2.0])
    """
    s = np.asarray(s, np.float64).reshape(-1)
    w1 = np.asarray(w1)
    if s.size != w1.shape[0]:
        raise ValueError(f"{s.size} scales for {w1.shape[0]} output channels of W1")
    shape1 = (-1,) + (1,) * (w1.ndim - 1)
    w1e = (w1 / s.reshape(shape1)).astype(w1.dtype)
    b1e = None if b1 is None else (np.asarray(b1) / s).astype(np.asarray(b1).dtype)
    v = _input_view(w2, groups2)
    if s.size != v.shape[0] * v.shape[2]:
        raise ValueError(f"{s.size} scales for {v.shape[0] * v.shape[2]} input channels of W2")
    w2e = (v * s.reshape(v.shape[0], 1, v.shape[2], 1)).reshape(np.shape(w2))
    return w1e, b1e, w2e.astype(np.asarray(w2).dtype)


def scaled_bounds(lo: float, hi: float, s) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel bounds that keep ``clip(z, lo, hi)`` exact after ``z /= s``:
    ``clip(z / s, lo / s, hi / s) == clip(z, lo, hi) / s``.

    >>> scaled_bounds(0.0, 6.0, np.array([2.0, 0.5]))
    (array([0., 0.]), array([ 3., 12.]))
    """
    s = np.asarray(s, np.float64)
    return np.full(s.shape, lo) / s, np.full(s.shape, hi) / s


def equalize_chain(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray | None],
    groups: Sequence[int],
    iterations: int = 20,
    tol: float = 1e-6,
):
    """Equalize every consecutive pair of a chain ``L0 -> f -> L1 -> f -> ...`` repeatedly
    (DFQ iterates until the scales stop changing: a depthwise layer's channels are both the
    output of one pair and the input of the next).

    Returns ``(weights, biases, scales)``: ``scales[k]`` is the cumulative ``s`` of the
    activation between layers ``k`` and ``k+1`` (it was divided by it: bounds of a clip
    there become :func:`scaled_bounds` with it). ``groups[k]`` are layer k's groups.
    """
    ws = [np.asarray(w) for w in weights]
    bs = [None if b is None else np.asarray(b) for b in biases]
    if not (len(ws) == len(bs) == len(groups)) or len(ws) < 2:
        raise ValueError("need at least two layers, with one bias (or None) and groups each")
    total = [np.ones(w.shape[0]) for w in ws[:-1]]
    for _ in range(max(1, iterations)):
        change = 0.0
        for k in range(len(ws) - 1):
            s = equalization_scales(
                output_channel_ranges(ws[k]), input_channel_ranges(ws[k + 1], groups[k + 1])
            )
            ws[k], bs[k], ws[k + 1] = apply_equalization(ws[k], bs[k], ws[k + 1], s, groups[k + 1])
            total[k] = total[k] * s
            change = max(change, float(np.abs(np.log(s)).max(initial=0.0)))
        if change < tol:
            break
    return ws, bs, total


def high_bias_amount(mean, std, n_std: float = 3.0, minimum=None) -> np.ndarray:
    """DFQ's ``c = max(0, mean - n_std * std)`` per channel of the pre-activation (from a
    batch norm's beta/gamma or from observed statistics), capped at ``max(0, minimum)``
    when the observed minimum is given (then ``z >= c`` holds on all the data seen).

    >>> high_bias_amount(np.array([5.0, 1.0, 9.0]), np.array([1.0, 1.0, 1.0]), minimum=[4, 0, 3])
    array([2., 0., 3.])
    """
    c = np.maximum(0.0, np.asarray(mean, np.float64) - n_std * np.asarray(std, np.float64))
    if minimum is not None:
        c = np.minimum(c, np.maximum(0.0, np.asarray(minimum, np.float64)))
    return c


def absorb_high_bias(b1, w2, b2, c, groups2: int = 1):
    """``(b1 - c, b2 + W2 @ c)``: the constant ``c`` (per channel of the activation between
    the layers) leaves layer 1's bias and enters layer 2's, every kernel tap of input
    channel ``i`` contributing ``W2[o, i, tap] * c_i``. Exact when ``z >= c`` before a ReLU
    (a ``clip(., 0, hi)`` becomes ``clip(., 0, hi - c)``) and layer 2 reads no padding.
    ``b2`` None means zeros.

    >>> absorb_high_bias(np.array([5.0, 1.0]), np.array([[1.0, 2.0], [3.0, 4.0]]), None,
    ...                  np.array([2.0, 0.0]))
    (array([3., 1.]), array([2., 6.]))
    """
    c = np.asarray(c, np.float64).reshape(-1)
    v = _input_view(w2, groups2).astype(np.float64)  # (G, O/G, C/G, taps)
    if c.size != v.shape[0] * v.shape[2]:
        raise ValueError(f"{c.size} constants for {v.shape[0] * v.shape[2]} input channels")
    shift = np.einsum("goit,gi->go", v, c.reshape(v.shape[0], v.shape[2])).reshape(-1)
    b1 = np.asarray(b1)
    b2v = np.zeros(shift.shape) if b2 is None else np.asarray(b2, np.float64)
    out_dtype = b1.dtype if b2 is None else np.asarray(b2).dtype
    return (b1 - c).astype(b1.dtype), (b2v + shift).astype(out_dtype)
