"""The rules that cut chosen activation ranges, as one table: each row cuts, in place, the
qparams of its slots in a whole result (slot -> QParam) when its ``Config.rules`` entry is
on. The fp32 calibration modes (in-process and distributed) apply them all with
:func:`cut_ranges`; a new cut is one row here.

>>> [f.__name__ for f in RANGE_CUTS]
['cut_lut_inputs', 'cut_softmax_inputs']
"""

from __future__ import annotations

from autoq.rules.lut_ranges import cut_lut_inputs
from autoq.rules.softmax_ranges import cut_softmax_inputs

__all__ = ["RANGE_CUTS", "cut_ranges"]

#: the cuts, in order (a softmax input's cut reads its operands' final qparams)
RANGE_CUTS = (cut_lut_inputs, cut_softmax_inputs)


def cut_ranges(sim, result: dict, config) -> None:
    """Every cut of :data:`RANGE_CUTS` on ``result`` (in place) for ``config``'s rules."""
    for cut in RANGE_CUTS:
        cut(sim, result, config)
