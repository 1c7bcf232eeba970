"""Integer-only activations: one table of elementwise functions and the 256-entry lookup
table that replaces each of them on an 8-bit grid.

An activation ``f`` between an input slot ``(s_in, zp_in)`` and an output slot
``(s_out, zp_out)`` maps each of the 256 input integers to one output integer:

    table[q - qmin] = quantize(f(dequantize(q, s_in, zp_in)), s_out, zp_out)

so the realized graph computes it with ``qnn.lut`` (an indexed load) and no float at all, and
the simulated graph uses the *same* table (computed here, in numpy, once the two slots'
qparams are chosen: see :mod:`autoq.calibration`), so they agree bit for bit whatever code TVM
generates for ``f``. ``f`` is evaluated in float64 on the float32 dequantized value; the
result is rounded to float32 and quantized like ``qnn.quantize`` (division, round half to
even, clip).

:data:`ACTIVATIONS` is the table: Relax op name -> :class:`Activation`. Adding an activation
is one row (its numpy definition); ``patterns/activation.py`` registers a pattern for each.

    >>> import numpy as np
    >>> t = lut_table("sigmoid", 0.05, 0, "int8", 1 / 256, -128, "int8")
    >>> t.shape, t.dtype, int(t[128]), int(t[0]), int(t[255])   # q = 0, -128, 127
    ((256,), dtype('int8'), 0, -128, 127)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoq.primitives import qrange

__all__ = ["ACTIVATIONS", "LUT_DTYPES", "Activation", "Affine", "affine", "lut_table"]

#: input/output dtypes a lookup table covers (256 entries)
LUT_DTYPES = ("int8", "uint8")


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + exp(-x)), without overflow


@dataclass(frozen=True)
class Activation:
    """One row: ``name`` (its pattern's name) and ``f``, the float64 numpy definition."""

    name: str
    f: Callable[[np.ndarray], np.ndarray]
    doc: str = ""


ACTIVATIONS: dict[str, Activation] = {
    "relax.sigmoid": Activation("sigmoid", _sigmoid, "1 / (1 + exp(-x))"),
    "relax.tanh": Activation("tanh", np.tanh, "tanh(x)"),
    "autoq.hardswish": Activation(
        "hardswish", lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0, "x * relu6(x + 3) / 6"
    ),
    "autoq.hardsigmoid": Activation(
        "hardsigmoid", lambda x: np.clip(x + 3.0, 0.0, 6.0) / 6.0, "relu6(x + 3) / 6"
    ),
    "relax.nn.silu": Activation("silu", lambda x: x * _sigmoid(x), "x * sigmoid(x)"),
    "relax.nn.gelu": Activation(
        "gelu", lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))), "x * Phi(x), erf form"
    ),
    "relax.nn.gelu_tanh": Activation(
        "gelu_tanh",
        lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
        "x * Phi(x), tanh approximation",
    ),
}


@dataclass(frozen=True)
class Affine:
    """``scale * f(x) + shift`` for the activation named ``base`` (a picklable callable: the
    ``f`` of an :func:`affine` row)."""

    base: str
    scale: float
    shift: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.scale * _by_name(self.base).f(x) + self.shift


def affine(name: str, scale: float, shift: float) -> Activation:
    """The activation ``name`` followed by a per-tensor ``x * scale + shift`` as one row:
    its table rounds once, where the three ops rounded three times.

    >>> t = lut_table(affine("hardswish", 2.0, 0.5), 0.1, 0, "int8", 0.1, 0, "int8")
    >>> int(t[128 + 10])   # x = 1: 2 * hardswish(1) + 0.5 = 1.8333
    18
    """
    base = _by_name(name)
    return Activation(
        f"{name}_affine", Affine(name, float(scale), float(shift)), f"{base.doc} * a + b"
    )


def lut_table(
    activation: str | Activation,
    s_in,
    zp_in,
    in_dtype: str,
    s_out,
    zp_out,
    out_dtype: str,
) -> np.ndarray:
    """The ``qnn.lut`` table of ``activation`` (a row of :data:`ACTIVATIONS`, by pattern
    name or as the row) from the input grid to the output grid: index ``q - qmin(in_dtype)``.

    >>> lut_table("tanh", 1.0, 0, "int8", 1 / 127, 0, "int8")[128 + np.array([-2, 0, 1])]
    array([-122,    0,   97], dtype=int8)
    """
    act = activation if isinstance(activation, Activation) else _by_name(activation)
    if in_dtype not in LUT_DTYPES or out_dtype not in LUT_DTYPES:
        raise ValueError(
            f"a lookup table maps {' or '.join(LUT_DTYPES)} to {' or '.join(LUT_DTYPES)}, "
            f"got {in_dtype} -> {out_dtype}"
        )
    lo, hi = qrange(in_dtype)
    q = np.arange(lo, hi + 1, dtype=np.int64)
    x = ((q - int(zp_in)).astype(np.float32) * np.float32(s_in)).astype(np.float32)
    y = np.asarray(act.f(x.astype(np.float64)), np.float64).astype(np.float32)
    olo, ohi = qrange(out_dtype)
    v = np.rint(y / np.float32(s_out)) + int(zp_out)
    return np.clip(v, olo, ohi).astype(out_dtype)


def _by_name(name: str) -> Activation:
    for act in ACTIVATIONS.values():
        if act.name == name:
            return act
    raise KeyError(
        f"no activation {name!r}; known: {', '.join(a.name for a in ACTIVATIONS.values())}"
    )
