"""The float-op rewrites every compile of a Relax graph goes through, as one table.

The simulated graph (:func:`autoq.ir.run.calibration_pipeline`), the built module
(:func:`autoq.build.compile`) and the tuning task list (:func:`autoq.tuning.tune`,
:func:`autoq.build.tuning_database.tuned_kernels`) all call :func:`rewrite_float_ops`, so a
float op computes the same bits in calibration and in the result and tuning sees the
kernels the build will have. Adding a rewrite is one row of :data:`FLOAT_REWRITES`.

>>> from tvm.script import relax as R
>>> @R.function
... def f(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
...     return R.nn.gelu(x)
>>> import tvm
>>> sorted(gv.name_hint for gv, _ in rewrite_float_ops(tvm.IRModule({"main": f})).functions_items())
['fast_gelu', 'main']
"""

from __future__ import annotations

from collections.abc import Callable

import tvm

from autoq.ir.fast_gelu import fast_gelu

__all__ = ["FLOAT_REWRITES", "rewrite_float_ops"]

#: (the op it replaces, module -> module): each leaves modules without that op unchanged
FLOAT_REWRITES: tuple[tuple[str, Callable[[tvm.IRModule], tvm.IRModule]], ...] = (
    ("relax.nn.gelu", fast_gelu),  # float32 GELU through a vectorizable erf
)


def rewrite_float_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every rewrite of :data:`FLOAT_REWRITES` applied, in order."""
    for _, rewrite in FLOAT_REWRITES:
        mod = rewrite(mod)
    return mod
