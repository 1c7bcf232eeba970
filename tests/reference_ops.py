"""Plain-loop numpy references shared by the tests of the numeric primitives (no im2col, no
vectorized tricks: slow, small inputs only)."""

from __future__ import annotations

import numpy as np


def conv2d_loops(x, w, b=None, strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1):
    """NCHW x OIHW convolution by explicit loops; ``padding`` is (top, left, bottom, right)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    top, left, bottom, right = padding
    xp = np.zeros((n, c, h + top + bottom, wd + left + right))
    xp[:, :, top : top + h, left : left + wd] = x
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    og = o // groups
    y = np.zeros((n, o, oh, ow))
    for oc in range(o):
        g = oc // og
        for i in range(oh):
            for j in range(ow):
                acc = np.zeros(n)
                for ci in range(cg):
                    for a in range(kh):
                        for bb in range(kw):
                            r = i * strides[0] + a * dilation[0]
                            s = j * strides[1] + bb * dilation[1]
                            acc += xp[:, g * cg + ci, r, s] * w[oc, ci, a, bb]
                y[:, oc, i, j] = acc
    if b is not None:
        y += np.asarray(b, np.float64).reshape(1, -1, 1, 1)
    return y
