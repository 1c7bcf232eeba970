"""A BYOC pattern table for autoq's realized int8 graphs.

:func:`pattern_table` returns one entry ``(name, pattern, annotations, check)`` per canonical
layer shape that :func:`autoq.realization` emits (``docs/ops.md``), ready for::

    import autoq.byoc
    mod = relax.transform.FuseOpsByPattern(
        autoq.byoc.pattern_table("my_npu"), bind_constants=True, annotate_codegen=True
    )(mod)
    mod = relax.transform.MergeCompositeFunctions()(mod)   # one function per offloaded region
    mod = relax.transform.RunCodegen()(mod)                # calls relax.ext.my_npu

Every layer of a realized graph is one composite: the int32 accumulating op with its bias,
residual and ``qnn.requantize`` (a ``qnn.dequantize`` when the model output reads the
accumulator), an elementwise ``qnn.add``/``subtract``/``multiply``, a ``qnn.lut`` activation,
a standalone ``qnn.requantize`` (concat inputs, merged dequantize/quantize pairs), the
allow-list ops that run on int8 (relu/clip as ``maximum``/``minimum`` with a constant,
max pool, pad, concat, reshape and the other data-movement ops) and the ``qnn.quantize`` /
``qnn.dequantize`` at the model's edges. The shapes are data, :data:`SHAPES`; a backend
that supports fewer takes ``pattern_table(prefix, names=...)``.

Every check (:func:`integer_only`) rejects a match that
* computes anything in float: every tensor the composite binds, and every tensor it reads,
  is int8/uint8/int16/uint16/int32, except the float32 input of an edge ``qnn.quantize``
  and the float32 result of an edge ``qnn.dequantize``;
* leaks an intermediate value (a binding inside the match read outside it: the composite
  would have to return it, and the graph around it would not be what the pattern says).

Weights, biases, lookup tables and every scale and zero point are matched with
``is_const()``: a backend reads them off the composite function (``bind_constants=True``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, is_tuple, wildcard

__all__ = ["INT_DTYPES", "SHAPES", "LayerShape", "integer_only", "pattern_table"]

#: dtypes a composite may compute in (activations, accumulators)
INT_DTYPES = frozenset({"int8", "uint8", "int16", "uint16", "int32"})

_MOVES = ("reshape", "permute_dims", "squeeze", "expand_dims", "flatten", "strided_slice")
_MAX_CONCAT = 8


@dataclass(frozen=True)
class LayerShape:
    """One canonical shape: ``build() -> (pattern, annotations)``; ``float_input``: the
    annotated ``data`` is float32 (an edge quantize); ``float_output``: the root is float32
    (an edge dequantize)."""

    name: str
    build: Callable[[], tuple[DFPattern, dict[str, DFPattern]]]
    float_input: bool = False
    float_output: bool = False
    doc: str = ""
    #: a further condition on the match (``PatternCheckContext -> bool``), e.g. the
    #: all-ones kernel that tells a realized average pool from a convolution
    extra: Callable | None = None

    def __post_init__(self) -> None:
        if not self.name or "." in self.name:
            raise ValueError(
                f"LayerShape.name must be a non-empty name without '.', got {self.name!r}"
            )


def _qnn(op: str, *args) -> DFPattern:
    return is_op(f"qnn.{op}")(*args)


def _consts(n: int) -> list[DFPattern]:
    return [is_const() for _ in range(n)]


def _requantize(x: DFPattern) -> DFPattern:
    """``qnn.requantize`` with constant qparams, and with the constant int32 multiplier and
    shift that integer rounding modes carry (``autoq.qnn.with_multipliers``)."""
    return _qnn("requantize", x, *_consts(4)) | _qnn("requantize", x, *_consts(6))


def _standalone_requantize(tail: str) -> Callable:
    def build():
        data = wildcard()
        root = _clip_tail(_requantize(data), tail)
        return root, {"data": data, "root": root}

    return build


def _clip_tail(x: DFPattern, tail: str) -> DFPattern:
    """relu/clip on the int8 grid (``autoq.ir.allow_list``): maximum(q, zp), minimum(q, hi),
    maximum(minimum(q, hi), lo)."""
    if tail in ("min", "minmax"):
        x = is_op("relax.minimum")(x, is_const())
    if tail in ("max", "minmax"):
        x = is_op("relax.maximum")(x, is_const())
    return x


_TAILS = {"": "", "_relu": "max", "_min": "min", "_clip": "minmax"}
_TAIL_DOCS = {
    "max": "maximum(q, c) (relu)",
    "min": "minimum(q, c)",
    "minmax": "maximum(minimum(q, hi), lo) (clip)",
}
_STANDALONE_CLIPS = {"relu": "max", "minimum": "min", "clip": "minmax"}


def _accumulating(core: str, bias: bool, residual: bool, end: str, tail: str) -> Callable:
    def build():
        data = wildcard()
        named = {"data": data}
        if core == "matmul":
            rhs = wildcard()
            acc = _qnn("matmul", data, rhs, *_consts(4))
            named["rhs"] = rhs
        elif core == "sum":
            acc = _qnn("sum", data, *_consts(2))
        else:
            weight = is_const()
            acc = _qnn(core, data, weight, *_consts(4))
            named["weight"] = weight
        named["core"] = acc
        if bias:
            b = is_const()
            acc = is_op("relax.add")(acc, b)
            named["bias"] = b
        if residual:
            r = wildcard()
            acc = is_op("relax.add")(acc, _requantize(r))
            named["residual"] = r
        if end == "dequantize":
            root = _qnn("dequantize", acc, *_consts(2))
        else:
            root = _clip_tail(_requantize(acc), tail)
        named["root"] = root
        return root, named

    return build


def _single(op: str, n_consts: int, tail: str = "", extra: int = 0) -> Callable:
    """``op(data, <extra wildcards>, <n_consts constants>)`` [-> relu/clip tail]."""

    def build():
        data = wildcard()
        rest = [wildcard() for _ in range(extra)]
        root = _clip_tail(is_op(op)(data, *rest, *_consts(n_consts)), tail)
        return root, {"data": data, "root": root}

    return build


def _elementwise(op: str, tail: str) -> Callable:
    def build():
        lhs, rhs = wildcard(), wildcard()
        root = _clip_tail(_qnn(op, lhs, rhs, *_consts(6)), tail)
        return root, {"data": lhs, "rhs": rhs, "root": root}

    return build


def _concat(n: int) -> Callable:
    def build():
        fields = [wildcard() for _ in range(n)]
        root = is_op("relax.concat")(is_tuple(fields))
        return root, {"data": fields[0], "root": root}

    return build


def _clip_only(tail: str) -> Callable:
    def build():
        data = wildcard()
        root = _clip_tail(data, tail)
        return root, {"data": data, "root": root}

    return build


def _const_value(expr):
    return expr.value.numpy() if isinstance(expr, tvm.ir.GenericConst) else None


def _is_avg_pool(ctx) -> bool:
    """``qnn.conv2d`` with an all-ones depthwise kernel, weight scale 1 and zero point 0:
    the window sum of a realized ``avg_pool2d`` (``patterns/avg_pool2d.py``)."""
    core = ctx.annotated_expr["core"]
    w, ws, wz = (_const_value(core.args[i]) for i in (1, 4, 5))
    if w is None or ws is None or wz is None or w.ndim != 4 or w.shape[1] != 1:
        return False
    groups = int(core.attrs["groups"])
    return bool(groups == w.shape[0] and (w == 1).all() and (ws == 1).all() and (wz == 0).all())


def _tail_doc(tail: str) -> str:
    return f" -> {_TAIL_DOCS[tail]}" if tail else ""


def _accumulating_shapes() -> list[LayerShape]:
    """Average pool (before the convolutions it looks like), then every accumulating layer."""
    out: list[LayerShape] = []
    for suffix, tail in _TAILS.items():
        out.append(
            LayerShape(
                f"avg_pool2d_requantize{suffix}",
                _accumulating("conv2d", False, False, "requantize", tail),
                doc="average pool: qnn.conv2d with an all-ones depthwise kernel (window sum)"
                " -> qnn.requantize with scale s_x / N",
                extra=_is_avg_pool,
            )
        )
    for core in ("conv2d", "dense", "matmul", "sum"):
        options = [(b, r) for b in (True, False) for r in (True, False)]
        if core in ("matmul", "sum"):
            options = [(False, False)]
        for bias, residual in options:
            stem = core + ("_bias" if bias else "") + ("_add" if residual else "")
            what = f"qnn.{core}" + (" + int32 bias" if bias else "")
            what += " + residual requantized to int32" if residual else ""
            for suffix, tail in _TAILS.items():
                out.append(
                    LayerShape(
                        f"{stem}_requantize{suffix}",
                        _accumulating(core, bias, residual, "requantize", tail),
                        doc=f"{what} -> qnn.requantize to int8" + _tail_doc(tail),
                    )
                )
            out.append(
                LayerShape(
                    f"{stem}_dequantize",
                    _accumulating(core, bias, residual, "dequantize", ""),
                    float_output=True,
                    doc=f"{what} -> qnn.dequantize (a model output read as the accumulator)",
                )
            )
    return out


def _shapes() -> list[LayerShape]:
    """The table, longest patterns first (FuseOpsByPattern tries entries in order)."""
    out = _accumulating_shapes()
    for op in ("add", "subtract", "multiply"):
        for suffix, tail in _TAILS.items():
            out.append(
                LayerShape(
                    f"{op}{suffix}",
                    _elementwise(op, tail),
                    doc=f"qnn.{op} of two int8 tensors, own output qparams" + _tail_doc(tail),
                )
            )
    for suffix, tail in _TAILS.items():
        out.append(
            LayerShape(
                f"requantize{suffix}",
                _standalone_requantize(tail),
                doc="qnn.requantize int8 -> int8 (concat inputs, merged dequantize/quantize)"
                + _tail_doc(tail),
            )
        )
    out.append(LayerShape("lut", _single("qnn.lut", 1), doc="qnn.lut: 8-bit table lookup"))
    for name, tail in _STANDALONE_CLIPS.items():
        out.append(LayerShape(name, _clip_only(tail), doc=_TAIL_DOCS[tail] + " on int8"))
    out.append(LayerShape("max_pool2d", _single("relax.nn.max_pool2d", 0), doc="max pool on int8"))
    out.append(LayerShape("pad", _single("relax.nn.pad", 0), doc="pad with Q(value) on int8"))
    for n in range(_MAX_CONCAT, 1, -1):
        out.append(LayerShape(f"concat{n}", _concat(n), doc=f"concat of {n} int8 tensors"))
    for op in _MOVES:
        extra = 1 if op == "reshape" else 0
        out.append(LayerShape(op, _single(f"relax.{op}", 0, extra=extra), doc="data movement"))
    out.append(
        LayerShape(
            "quantize",
            _single("qnn.quantize", 2),
            float_input=True,
            doc="qnn.quantize of a model input",
        )
    )
    out.append(
        LayerShape(
            "dequantize",
            _single("qnn.dequantize", 2),
            float_output=True,
            doc="qnn.dequantize to a model output",
        )
    )
    return out


#: every canonical layer shape, in matching priority order
SHAPES: tuple[LayerShape, ...] = tuple(_shapes())


def _dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def _tensors(expr) -> list:
    if isinstance(expr, relax.Tuple):
        return [t for f in expr.fields for t in _tensors(f)]
    return [expr]


def integer_only(shape: LayerShape) -> Callable:
    """The check of ``shape``'s entry (module doc): integer dtypes only, no leaks."""

    def check(ctx) -> bool:
        bound = dict(ctx.matched_bindings)
        root = ctx.matched_expr
        for var, value in bound.items():
            is_root = value.same_as(root)
            allowed = {"float32"} if is_root and shape.float_output else INT_DTYPES
            if _dtype(var) not in allowed:
                return False
            if not is_root:
                users = ctx.var_usages.get(var, [])
                if any(u not in bound for u in users):
                    return False
        for key, expr in ctx.annotated_expr.items():
            if key in ("root", "core") or isinstance(expr, tvm.ir.GenericConst):
                continue
            allowed = {"float32"} if key == "data" and shape.float_input else INT_DTYPES
            if any(_dtype(t) not in allowed for t in _tensors(expr)):
                return False
        if _dtype(root) not in (("float32",) if shape.float_output else INT_DTYPES):
            return False
        return shape.extra is None or bool(shape.extra(ctx))

    return check


def pattern_table(prefix: str = "autoq", names=None) -> list[tuple]:
    """``[(f"{prefix}.{shape}", pattern, annotations, check), ...]`` for every
    :data:`SHAPES` row (or those in ``names``), in priority order, for
    ``relax.transform.FuseOpsByPattern``. ``prefix`` is the codegen name that
    ``annotate_codegen=True`` / ``MergeCompositeFunctions`` put on the offloaded functions
    (``relax.ext.<prefix>`` must be registered for ``RunCodegen``)."""
    if not prefix or "." in prefix:
        raise ValueError(
            f"pattern_table: prefix must be a codegen name without '.', got {prefix!r}"
        )
    known = {s.name for s in SHAPES}
    wanted = known if names is None else set(names)
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(f"pattern_table: unknown layer shapes {unknown}; known: {sorted(known)}")
    table = []
    for shape in SHAPES:
        if shape.name in wanted:
            pattern, annotations = shape.build()
            table.append((f"{prefix}.{shape.name}", pattern, annotations, integer_only(shape)))
    return table
