"""The convs of a depthwise-separable network that stay on the VNNI kernel on AMX targets.

The depthwise kernel (:mod:`autoq.cpu.depthwise`) reads and writes the blocked layout of
:mod:`autoq.cpu.blocked`; an AMX conv (:mod:`autoq.cpu.amx_conv2d`) reads and writes NCHW,
so a 1x1 conv on AMX between two depthwise convs makes both of its edges NCHW: the depthwise
kernels around it then pack and unpack their planes, and the 1x1 convs stop at the small
sizes these networks have (e.g. 96 x 40 x 40). On VNNI the whole chain flows blocked.
Measured on a shared 2-vCPU Sapphire Rapids (1 thread, load 10-16): MobileNetV2 160x160
3.22 -> 2.36 ms (median of 30 interleaved runs); sums of the per-function minimums of 20 runs:
MobileNetV2 3.35 -> 2.10 ms (every conv on VNNI: 2.29), EfficientNet-Lite0 7.22 -> 5.27 ms,
PP-OCRv4 det 24.1 -> 24.5 ms (unchanged within the noise; every conv on VNNI: 26.7).

:func:`depthwise_neighbours` finds the convs (groups 1) that read a depthwise conv's output
or feed a depthwise conv's input through elementwise ops only (bias add, requantize, a
lookup: one variable operand, the shape unchanged); :func:`weight_key` names a conv by its
weights, the key :class:`autoq.cpu.isa.IsaChoice` looks up (the calls themselves are
rebuilt by the passes in between).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from autoq.ir.toolkit import bindings, const_array, is_call, shape_of
from autoq.qnn.accumulate import depthwise_shape

__all__ = ["depthwise_neighbours", "weight_key"]


def weight_key(w: np.ndarray) -> bytes:
    """The key of a conv with the constant weights ``w``: its shape and its bytes."""
    return repr(w.shape).encode() + w.tobytes()


def _depthwise(call) -> bool:
    w = const_array(call.args[1])
    data = shape_of(call.args[0])
    channels = None if data is None or len(data) != 4 else data[1]
    return w is not None and depthwise_shape(channels, w.shape, int(call.attrs["groups"]))


def _elementwise_input(e) -> relax.Var | None:
    """The one variable operand of an elementwise call (others constants, the shape of
    that operand unchanged), else None."""
    if not is_call(e) or is_call(e, "qnn.conv2d"):
        return None
    vars_ = [a for a in e.args if isinstance(a, relax.Var)]
    if len(vars_) != 1 or any(
        not isinstance(a, relax.Var) and const_array(a) is None for a in e.args
    ):
        return None
    shape = shape_of(e)
    return vars_[0] if shape is not None and shape == shape_of(vars_[0]) else None


def depthwise_neighbours(mod: tvm.IRModule) -> frozenset[bytes]:
    """:func:`weight_key` of every conv (groups 1, constant weights) of ``mod``'s Relax
    functions that reads a depthwise conv's output or produces its input through
    elementwise calls only."""
    keys = set()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        pairs = bindings(func)
        value_of = {var: e for var, e in pairs}
        users: dict = {}
        for var, e in pairs:
            if is_call(e):
                for a in e.args:
                    if isinstance(a, relax.Var):
                        users.setdefault(a, []).append((var, e))
        for var, e in pairs:
            if not is_call(e, "qnn.conv2d") or not _depthwise(e):
                continue
            keys.update(_producer_keys(e.args[0], value_of))
            keys.update(_consumer_keys(var, users))
    return frozenset(keys)


def _key(call) -> bytes | None:
    """The key of a groups-1 conv with constant weights, else None."""
    if int(call.attrs["groups"]) != 1 or (w := const_array(call.args[1])) is None:
        return None
    return weight_key(w)


def _producer_keys(data, value_of: dict) -> list[bytes]:
    while isinstance(data, relax.Var) and data in value_of:
        e = value_of[data]
        if is_call(e, "qnn.conv2d"):
            key = _key(e)
            return [] if key is None else [key]
        data = _elementwise_input(e)
    return []


def _consumer_keys(var, users: dict) -> list[bytes]:
    keys, todo, seen = [], [var], set()
    while todo:
        v = todo.pop()
        for user, e in users.get(v, []):
            if is_call(e, "qnn.conv2d"):
                if e.args[0].same_as(v) and (key := _key(e)) is not None:
                    keys.append(key)
            elif _elementwise_input(e) is not None and user not in seen:
                seen.add(user)
                todo.append(user)
    return keys
