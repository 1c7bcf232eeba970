"""A ``LANES`` x ``LANES`` float32 tile transposed in registers, for kernels whose rows'
index-order sums run interleaved (one chain per row of a block): the transposed tile's
vector ``k`` holds column ``k`` of the block's rows, so those chains become vector adds
in the same order (row-strided scalar reads: LLVM emits gathers on Zen 4). Four rounds of
two-vector shuffles (``tirx.Shuffle`` with constant indices: LLVM picks unpack / shuffle /
``vpermt2ps`` instructions), each swapping one bit of the vector index with the same bit
of the lane index (:func:`transpose_indices`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

__all__ = ["LANES", "TILE", "transpose_indices", "transposed_tile"]

LANES = 16  # float32 lanes of an AVX-512 register
TILE = 2 * LANES * LANES  # floats of a tile buffer: the tile and the rounds' other half


def transpose_indices(stage: int) -> tuple[list[int], list[int]]:
    """The shuffle indices (into the pair's ``2 LANES`` lanes, first vector first) of the
    two vectors of a pair after round ``stage`` (0-3) of a ``LANES`` x ``LANES`` transpose:
    the pair's vectors differ in bit ``stage`` of their index, and the round swaps that bit
    of the vector index with the same bit of the lane index.

    >>> import numpy as np
    >>> def transposed(m):
    ...     vectors = list(m)
    ...     for stage in range(4):
    ...         low, high = transpose_indices(stage)
    ...         for v in range(LANES):
    ...             if not v >> stage & 1:
    ...                 pair = np.concatenate([vectors[v], vectors[v | 1 << stage]])
    ...                 vectors[v], vectors[v | 1 << stage] = pair[low], pair[high]
    ...     return np.stack(vectors)
    >>> m = np.arange(LANES * LANES).reshape(LANES, LANES)
    >>> bool((transposed(m) == m.T).all())
    True
    """
    step = 1 << stage
    low = [lane + (LANES - step if lane & step else 0) for lane in range(LANES)]
    high = [lane + (LANES if lane & step else step) for lane in range(LANES)]
    return low, high


def _round_vector(tile, src, v, stage: int, which: int):
    """Vector ``v + which * 2**stage`` of ``tile`` (offset ``src``) after round ``stage``."""
    first = tile[tirx.Ramp(src + v * LANES, 1, LANES)]
    second = tile[tirx.Ramp(src + (v + (1 << stage)) * LANES, 1, LANES)]
    indices = transpose_indices(stage)[which]
    return tirx.Shuffle([first, second], [tirx.IntImm("int32", i) for i in indices])


@T.macro
def _transpose_round(tile, src, dst, stage):
    """Round ``stage`` of :func:`transpose_indices` on the ``LANES`` vectors of ``tile`` at
    offset ``src``, written at ``dst``."""
    for pair in T.unroll(LANES // 2):  # the vectors v, v + 2**stage, bit stage of v clear
        v = (pair >> stage << stage + 1) | (pair & (1 << stage) - 1)
        tile[T.Ramp(dst + v * LANES, 1, LANES)] = _round_vector(tile, src, v, stage, 0)
        tile[T.Ramp(dst + (v + (1 << stage)) * LANES, 1, LANES)] = _round_vector(
            tile, src, v, stage, 1
        )


@T.macro
def transposed_tile(tile, src, base, stride):
    """``tile`` (float32, ``TILE``) with the transpose of the ``LANES`` x ``LANES`` tile of
    ``src`` (flat) at ``base`` (rows ``stride`` apart) in its first ``LANES * LANES``: its
    vector ``c`` (``tile[c * LANES : (c + 1) * LANES]``) is column ``c``."""
    for r in T.unroll(LANES):
        tile[T.Ramp(r * LANES, 1, LANES)] = src[T.Ramp(base + r * stride, 1, LANES)]
    _transpose_round(tile, 0, LANES * LANES, 0)
    _transpose_round(tile, LANES * LANES, 0, 1)
    _transpose_round(tile, 0, LANES * LANES, 2)
    _transpose_round(tile, LANES * LANES, 0, 3)
