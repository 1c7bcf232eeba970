"""GPTQ: weight rounding that sees the data (Frantar, Ashkboos, Hoefler, Alistarh 2022,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
arXiv:2210.17323; the Optimal Brain Quantizer of Frantar & Alistarh 2022 made fast).

Round-to-nearest (RTN) rounds every weight on its own. GPTQ rounds the columns (input
features) of ``W (out, in)`` one after the other and, after each, moves the not yet rounded
columns to compensate the error just made, so that the layer *output* on the calibration
inputs ``X`` stays close: it minimizes ``||X W^T - X Q^T||^2`` greedily, using only
``H = 2 X^T X / n`` (:class:`autoq.accuracy.hessian.Hessian`). The scales and zero points are fixed
before (per output channel, e.g. by :func:`autoq.primitives.choose_qparams`): GPTQ only picks the integers, so the result
drops into ``QParams.values[<layer>.weight]`` with the calibrated ``QParams``.

The algorithm (their Algorithm 1), per group ``g`` of a grouped convolution (one group for
dense layers; a depthwise layer is C independent one-row problems with 9x9 or 25x25 ``H``):

1. dead inputs (``H_ii = 0``, never non-zero in the data) get ``H_ii = 1`` (they keep RTN);
   dampening ``H += damp * mean(diag H) * I``;
2. optionally *act-order*: columns sorted by decreasing ``H_ii`` (the most active inputs are
   rounded first, while there is most freedom left to compensate them); the permutation is
   undone at the end;
3. ``U`` = upper Cholesky factor of ``H^-1``;
4. for each column ``i``: ``q = round(w_i)``, ``e = (w_i - q) / U_ii``,
   ``W[:, j] -= e * U_ij`` for ``j > i``. In blocks of ``block_size`` columns the updates
   of the later blocks are deferred and applied as one matrix product (the "lazy batch":
   the same numbers, fewer passes over W).

With ``H = I`` no column influences another and GPTQ is exactly round-to-nearest. Cost:
one Cholesky per group plus ``O * K^2`` multiply-adds: milliseconds for a conv layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GPTQResult", "gptq", "rtn"]


@dataclass(frozen=True)
class GPTQResult:
    """``q``: integer weights (int32, the shape of the input ``w``); ``loss``: GPTQ's own
    estimate of the output error it left, ``sum (w - q)^2 / (2 U_ii^2)`` per group."""

    q: np.ndarray
    loss: np.ndarray


def _as_groups(w, h, scale, zero_point):
    w = np.array(w, np.float64)  # a copy: the columns are updated in place
    h = np.asarray(h, np.float64)
    squeeze = w.ndim == 2
    if squeeze:
        w, h = w[None], h[None] if h.ndim == 2 else h
    if w.ndim != 3 or h.shape != (w.shape[0], w.shape[2], w.shape[2]):
        raise ValueError(
            f"w must be (out, in) or (groups, out, in) and h (groups, in, in); got w "
            f"{w.shape}, h {h.shape}"
        )
    scale = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (w.shape[0] * w.shape[1],))
    zp = np.broadcast_to(np.asarray(zero_point, np.int64).reshape(-1), scale.shape)
    if not np.all(scale > 0):
        raise ValueError("scales must be positive")
    return w, h, scale.reshape(w.shape[:2]), zp.reshape(w.shape[:2]), squeeze


def _round_column(w, scale, zp, qmin, qmax):
    """``autoq.primitives.quantize``'s arithmetic (float32 division, ties to even), any range."""
    q = np.rint(w.astype(np.float32) / scale).astype(np.int64) + zp
    return np.clip(q, qmin, qmax)


def _round_offset(w, scale, lo, hi):
    """:func:`_round_column` minus the zero point, as float32 integers: ``rint(w / scale)``
    clipped to ``[lo, hi] = [qmin - zp, qmax - zp]`` (the same integers: adding ``zp`` is
    exact below 2**24 and both sides saturate beyond)."""
    v = np.rint(w.astype(np.float32) / scale)
    np.maximum(v, lo, out=v)
    return np.minimum(v, hi, out=v)


def rtn(w, scale, zero_point=0, qmin: int = -127, qmax: int = 127) -> np.ndarray:
    """Round-to-nearest with per-row ``scale``/``zero_point`` (the baseline GPTQ beats):

    >>> rtn(np.array([[0.26, -0.74], [3.0, 0.1]]), np.array([0.5, 1.0]), qmin=-1, qmax=1)
    array([[ 1, -1],
           [ 1,  0]], dtype=int32)
    """
    w = np.asarray(w, np.float64)
    s = np.asarray(scale, np.float32).reshape((*w.shape[:-1], 1)) if np.ndim(scale) else scale
    z = np.asarray(zero_point, np.int64)
    z = z.reshape((*w.shape[:-1], 1)) if z.ndim else z
    return _round_column(w, s, z, qmin, qmax).astype(np.int32)


def _upper_inverse(r: np.ndarray) -> np.ndarray:
    """Inverses of upper-triangular ``(G, K, K)`` matrices (LAPACK ``trtri`` for one big
    matrix, batched ``inv`` for many small ones, e.g. the 9x9 of a depthwise layer)."""
    if r.shape[0] > 1 or r.shape[-1] < 64:
        return np.linalg.inv(r)
    from scipy.linalg import lapack

    inv, info = lapack.dtrtri(r[0], lower=0)
    if info:
        raise np.linalg.LinAlgError(f"trtri failed (info {info})")
    return inv[None]  # its lower part is r's, zeros


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper ``U`` with ``H^-1 = U^T U``, without forming ``H^-1``: with ``J`` the reversal
    permutation and ``J H J = L L^T``, ``R = J L J`` is upper and ``H = R R^T``, so
    ``H^-1 = R^-T R^-1`` and ``U = R^-1`` (the Cholesky factor is unique). One Cholesky and
    one triangular inverse: ``2/3 K^3`` multiply-adds."""
    h = h.copy()
    k = h.shape[-1]
    diag = np.einsum("gkk->gk", h)  # a view: writing it writes h's diagonal
    diag[diag == 0] = 1.0
    diag += damp * diag.mean(axis=1, keepdims=True)
    try:
        low = np.linalg.cholesky(h[:, ::-1, ::-1])
    except np.linalg.LinAlgError as err:
        raise np.linalg.LinAlgError(
            f"H ({k}x{k}) is not positive definite after dampening {damp}: raise damp"
        ) from err
    return _upper_inverse(np.ascontiguousarray(low[:, ::-1, ::-1]))


def gptq(
    w,
    h,
    scale,
    zero_point=0,
    qmin: int = -127,
    qmax: int = 127,
    *,
    block_size: int = 128,
    act_order: bool = False,
    damp: float = 0.01,
) -> GPTQResult:
    """Integer weights for ``w`` rounded by GPTQ (module docstring).

    ``w``: ``(out, in)`` with ``h`` ``(in, in)``, or ``(G, out, in)`` with ``h``
    ``(G, in, in)`` (conv groups; see :func:`autoq.accuracy.hessian.flatten_conv_weight`).
    ``scale``/``zero_point``: per output row (``out`` or ``G*out`` values) or scalars;
    ``[qmin, qmax]``: the integer range (default int8 narrow range, autoq's weights).

    Two inputs that always carry the same value x (``H`` all ones), weights 0.35 and 0.35
    (output 0.7 x), scale 0.5. RTN rounds both up (1.0 x); GPTQ rounds the first up
    (+0.15), moves that error onto the second (0.35 - 0.15 = 0.2, rounds to 0): 0.5 x.

    >>> h = np.ones((2, 2))
    >>> w = np.array([[0.35, 0.35]])
    >>> gptq(w, h, scale=0.5, qmin=-2, qmax=2).q, rtn(w, 0.5, qmin=-2, qmax=2)
    (array([[1, 0]], dtype=int32), array([[1, 1]], dtype=int32))
    """
    w, h, scale, zp, squeeze = _as_groups(w, h, scale, zero_point)
    g, o, k = w.shape
    perm = np.tile(np.arange(k), (g, 1))
    if act_order:
        perm = np.argsort(-np.einsum("gkk->gk", h), axis=1, kind="stable")
        w = np.take_along_axis(w, perm[:, None, :], axis=2)
        h = np.take_along_axis(np.take_along_axis(h, perm[:, :, None], 1), perm[:, None, :], 2)
    u = _inverse_cholesky(h, damp)
    # the column loop works on float integers relative to the zero point: r = q - zp, clipped
    # to [qmin - zp, qmax - zp] (exact in float32), on blocks laid out (G, column, out) so
    # that one column is a few contiguous vector ops
    s32, s64 = scale, scale.astype(np.float64)
    lo, hi = (qmin - zp).astype(np.float32), (qmax - zp).astype(np.float32)
    r = np.zeros((g, k, o), np.float32)
    loss = np.zeros(g)
    step = max(1, int(block_size))
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1 = np.ascontiguousarray(w[:, :, i1:i2].transpose(0, 2, 1))  # (G, B, O)
        err1 = np.zeros_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        d = np.einsum("gii->gi", u1)[:, :, None]  # (G, B, 1): the diagonal of U
        for i in range(i2 - i1):
            ri = r[:, i1 + i]
            ri[...] = _round_offset(w1[:, i], s32, lo, hi)
            e = err1[:, i]
            np.subtract(w1[:, i], ri * s64, out=e)
            e /= d[:, i]
            w1[:, i + 1 :] -= u1[:, i, i + 1 :, None] * e[:, None, :]
        loss += 0.5 * np.einsum("gko,gko->g", err1, err1)
        err1 = np.ascontiguousarray(err1.transpose(0, 2, 1))  # (G, O, B), as w
        w[:, :, i2:] -= np.matmul(err1, u[:, i1:i2, i2:])
    q = r.transpose(0, 2, 1).astype(np.int64) + zp[:, :, None]
    if act_order:
        out = np.empty_like(q)
        np.put_along_axis(out, perm[:, None, :], q, axis=2)
        q = out
    q = q.astype(np.int32)
    return GPTQResult(q[0] if squeeze else q, loss)
