"""Running Relax graphs on this CPU outside the final build: the cheap compile that
calibration, SmoothQuant and the fallback searches use, and the per-sample runner of a
compiled float graph. No quantization policy and no CPU int8 kernels here."""

from __future__ import annotations

import numpy as np
import tvm

from autoq.ir.float_ops import rewrite_float_ops
from autoq.ir.loop_schedule import pipeline_with_loop_schedule
from autoq.ir.toolkit import as_list

__all__ = ["calibration_pipeline", "fp32_runner"]


def calibration_pipeline(target):
    """The simulated graph's kernels with a cheap default schedule (vectorized, parallel;
    bit-identical results, see :mod:`autoq.ir.loop_schedule`); float ops rewritten as in the
    built module (:mod:`autoq.ir.float_ops`)."""
    if isinstance(target, dict | str):
        target = tvm.target.Target(target)
    inner = pipeline_with_loop_schedule(target)

    @tvm.transform.module_pass(opt_level=0, name="autoq.CalibrationPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return inner(rewrite_float_ops(mod))

    return _pipeline


def fp32_runner(vm, input_names: list[str], weights: list[np.ndarray], function="main", pick=None):
    """``run(samples)`` over a compiled float graph ``function(*inputs, *weights)`` (e.g.
    :func:`autoq.calibration.fp32_slot_functions`): for each sample, the
    slots' fp32 values (``pick``: only the outputs at these indices)."""
    weights = [tvm.runtime.tensor(np.ascontiguousarray(w)) for w in weights]

    def run(samples):
        for sample in samples:
            feeds = [tvm.runtime.tensor(np.ascontiguousarray(sample[n])) for n in input_names]
            outs = as_list(vm[function](*feeds, *weights))
            yield [o.numpy() for o in (outs if pick is None else [outs[i] for i in pick])]

    return run
