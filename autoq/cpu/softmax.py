"""float32 softmax over the last axis as one row-parallel PrimFunc, with denormal
probabilities flushed to zero.

TVM's legalized softmax is four separate loop nests, and its ``exp`` is inlined into both the
sum and the normalization (every exponential computed twice). Worse, a transformer's
attention mask (``-100`` after autoq's attention-mask rewrite, :mod:`autoq.attention_mask`)
puts most probabilities of a padded sequence below the smallest normal float32
(``exp(-100)`` = 3.7e-44): x86 CPUs compute with such denormal numbers through microcode,
~100-500x slower (the ``probabilities @ V`` matmul of all-MiniLM-L6-v2: 55 ms on denormal
input, 0.1 ms on normal input, measured). Here a row is: max, ``e = exp(x - max)`` computed
once -- set to 0 where ``x - max < log(smallest normal)``, i.e. where it would be denormal
(the exp of such an argument is not even computed: libm's exp takes a slow path for denormal
results) --, its sum in index order, ``e / sum``. Every other probability is the same float as TVM's own
softmax bit for bit (same operations in the same order); flushed ones were below 1.2e-38.

>>> import numpy as np
>>> LOG_SMALLEST_NORMAL == float(np.log(np.float32(np.finfo(np.float32).tiny)))
True
"""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.s_tir import Schedule

from .injective import KERNEL_ATTR
from .tiling import i64

__all__ = ["LOG_SMALLEST_NORMAL", "softmax_kernel"]

LOG_SMALLEST_NORMAL = float(np.log(np.float32(np.finfo(np.float32).tiny)))


def _compute(shape: tuple[int, ...]):
    n = shape[-1]
    lead = shape[:-1]
    x = te.placeholder(i64(*shape), "float32", name="data")
    k = te.reduce_axis((0, n), "k")
    mx = te.compute(i64(*lead), lambda *i: te.max(x[(*i, k)], axis=k), name="autoq_max")

    def exp(*i):
        # the exp of a clamped argument: no exp ever takes its (slow) denormal-result path
        d = x[i] - mx[i[:-1]]
        low = tirx.const(LOG_SMALLEST_NORMAL, "float32")
        e = te.exp(tirx.max(d, low))
        return tirx.Select(d >= low, e, tirx.const(0.0, "float32"))

    e = te.compute(i64(*shape), exp, name="autoq_exp")
    k2 = te.reduce_axis((0, n), "k2")
    s = te.compute(i64(*lead), lambda *i: te.sum(e[(*i, k2)], axis=k2), name="autoq_sum")
    out = te.compute(i64(*shape), lambda *i: e[i] / s[i[:-1]], name="autoq_softmax")
    return [x, out]


def softmax_kernel(shape: tuple[int, ...]):
    """The scheduled PrimFunc ``(data, out)`` of float32 softmax over the last axis of a
    static ``shape``: parallel over the rows (all leading axes fused), each row's max, exps,
    sum and division computed inside its iteration, the division vectorized."""
    sch = Schedule(te.create_prim_func(_compute(tuple(int(d) for d in shape))))
    out = sch.get_sblock("autoq_softmax")
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    if len(loops) > 1:
        for name in ("autoq_sum", "autoq_exp", "autoq_max"):
            sch.compute_at(sch.get_sblock(name), row)
        if math.prod(shape[:-1]) > 1:
            sch.parallel(row)
        last = sch.get_loops(out)[-1]
        if shape[-1] % 16 == 0:
            last = sch.split(last, [None, 16])[-1]
        sch.vectorize(last)
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
