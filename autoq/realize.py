"""Stage 3, realize: the integer graph.

1. Every match is emitted by its pattern's ``realize`` callback: ``qnn.quantize`` on
   activations entering affine space, int8 weight and int32 bias *constants* (computed in
   numpy here, never at run time; or taken unchanged from ``qparams.values`` when a
   pre-quantized source fixed them, see :func:`autoq.import_quantized`), the ``qnn.*`` op,
   and ``qnn.dequantize`` leaving it.
2. :func:`propagate` moves ``qnn.quantize`` up and ``qnn.dequantize`` down through the
   ``commute`` ops of the allow-list (relu -> ``max(q, zp)``, clip in the integer domain,
   max-pool, reshape, ...), every move exact, then merges each ``qnn.dequantize ->
   qnn.quantize`` pair into ``qnn.requantize`` (dropped when the qparams are equal).
3. Remaining fp32 parameters (of layers left in float) are bound as constants and unused
   bindings are removed: the result's ``main`` takes only the model's inputs.

In the default rounding mode the realized graph computes exactly what the calibrated
simulated graph computes (see docs/design.md, "Fidelity").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from . import primitives as P
from . import qnn
from .config import Config
from .graph import Graph, dtype_of, op_name, prepare, remap_expr, with_main
from .qparams import QParam, QParams
from .registry import ALLOW_LIST, Match, find_matches, slot_id_of
from .simulate import build_function

__all__ = ["RealizeContext", "propagate", "realize"]


def _const(a, dtype=None) -> relax.Expr:
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(dtype)
    return relax.const(a, str(a.dtype))


class RealQ:
    """A quantized tensor of the realized graph: int values ``q`` and numpy qparams."""

    def __init__(self, ctx, q, qp: QParam):
        self._ctx, self.q, self.qparam = ctx, q, qp
        self.scale = qp.scale
        self.zero_point = qp.zero_point
        self.dtype = qp.dtype
        self.scale_c = _const(qp.scale, "float32")
        self.zero_point_c = _const(qp.zero_point, "int32")
        self._real = None

    @property
    def real(self) -> relax.Expr:
        if self._real is None:
            ax = -1 if self.qparam.axis is None else self.qparam.axis
            self._real = self._ctx.emit(
                qnn.dequantize(self.q, self.scale_c, self.zero_point_c, axis=ax)
            )
        return self._real


class RealizeContext:
    """What a pattern's ``realize`` callback can ask for (see autoq.registry)."""

    def __init__(self, g: Graph, config: Config, qparams: QParams, matches: list[Match]):
        self.g, self.config, self.qparams = g, config, qparams
        self.rounding = config.rounding
        self.bb = relax.BlockBuilder()
        self.vmap: dict = {}
        self.match: Match | None = None
        self.tensor_id = slot_id_of(g, matches)
        self._acts: dict[str, RealQ] = {}
        self.warnings: list[str] = []

    def emit(self, expr, name: str | None = None) -> relax.Var:
        return self.bb.emit(expr, name_hint=name or "")

    def value(self, expr) -> relax.Expr:
        return remap_expr(expr, self.vmap)

    @property
    def layer(self) -> str:
        return self.match.layer if self.match is not None else ""

    def _qparam(self, sid: str) -> QParam:
        if sid not in self.qparams:
            raise KeyError(
                f"no qparams for slot {sid!r} (layer {self.layer}); the qparams do not belong to "
                "this model/config: calibrate again or add the slot"
            )
        return self.qparams[sid]

    def activation(self, expr) -> RealQ:
        sid = self.tensor_id(expr)
        if sid not in self._acts:
            qp = self._qparam(sid)
            if qp.per_axis:
                raise ValueError(
                    f"activation slot {sid!r} has per-axis qparams; activations are per-tensor"
                )
            q = self.emit(
                qnn.quantize(
                    self.value(expr),
                    _const(qp.scale, "float32"),
                    _const(qp.zero_point, "int32"),
                    out_dtype=qp.dtype,
                ),
                f"{sid}.q",
            )
            self._acts[sid] = RealQ(self, q, qp)
        return self._acts[sid]

    def weight(self, expr, axis: int, transpose: tuple[int, ...] | None = None) -> RealQ:
        """int8 weight constant (quantized here in numpy, or taken as it is from
        ``qparams.values`` when the source fixed it); ``transpose`` re-lays it out."""
        sid = f"{self.layer}.weight"
        qp = self._qparam(sid)
        arr = np.asarray(self.g.weight_of(expr).array, np.float32)
        q = self._given(sid, arr.shape, (qp.dtype,))
        if q is None:
            q = P.quantize(arr, qp.scale, qp.zero_point, qp.dtype, qp.axis)
        if transpose is not None:
            q = np.ascontiguousarray(np.transpose(q, transpose))
            new_axis = None if qp.axis is None else list(transpose).index(qp.axis)
            qp = QParam(qp.scale, qp.zero_point, qp.dtype, new_axis, qp.rmin, qp.rmax)
        return RealQ(self, _const(q), qp)

    def bias(
        self, expr, acc_scale: np.ndarray, out_shape: list[int], channel_axis: int
    ) -> relax.Expr:
        """int32 bias constant with scale ``acc_scale`` (= input scale * weight scale)."""
        arr = np.asarray(self.g.weight_of(expr).array, np.float32).reshape(-1)
        values = self._given(f"{self.layer}.bias", arr.shape, ("int32",))
        if values is None:
            # acc_scale is already the float32 product; quantize_bias recomputes it the same way
            r = P.quantize_bias(arr, np.float32(1.0), acc_scale)
            if r.saturated:
                msg = f"{self.layer}: {r.saturated} bias values saturate int32 (scale too small for the bias)"
                self.warnings.append(msg)
                warnings.warn(msg, stacklevel=2)
            values = r.values
        shape = [1] * len(out_shape)
        shape[channel_axis] = arr.size
        return _const(values.reshape(shape), "int32")

    def _given(self, key: str, shape: tuple[int, ...], dtypes: tuple[str, ...]):
        """The integer tensor ``qparams.values[key]`` fixed by the source (a pre-quantized
        file), checked against the float tensor it replaces; None when there is none."""
        values = getattr(self.qparams, "values", None) or {}
        if key not in values:
            return None
        v = np.asarray(values[key])
        if tuple(v.shape) != tuple(shape) or str(v.dtype) not in dtypes:
            raise ValueError(
                f"qparams.values[{key!r}] is {v.dtype} {tuple(v.shape)}; the model needs "
                f"{' or '.join(dtypes)} {tuple(shape)}"
            )
        return v

    def output_qparam(self) -> RealQ:
        sid = self.match.layer
        return RealQ(self, None, self._qparam(sid))

    def output(self, y) -> relax.Expr:
        """Register the int result of the current match as its root tensor's quantized
        value and return its dequantized (float) form for the other consumers."""
        sid = self.match.layer
        qp = self._qparam(sid)
        yv = self.emit(y, f"{sid}.q")
        self._acts[sid] = RealQ(self, yv, qp)
        return qnn.dequantize(yv, _const(qp.scale, "float32"), _const(qp.zero_point, "int32"))


# --------------------------------------------------------------------------- propagation


def _is(value, name: str) -> bool:
    return isinstance(value, tvm.ir.Call) and op_name(value) == name


def _scalar(e) -> np.ndarray | None:
    if isinstance(e, tvm.ir.GenericConst) and isinstance(e.value, tvm.runtime.Tensor):
        return e.value.numpy()
    return None


def _qattrs(call):
    a = call.attrs
    return {k: a[k] for k in a.keys()} if a is not None else {}


@dataclass
class _Q:
    """A per-tensor quantize's parameters (constants)."""

    scale: relax.Expr
    zp: relax.Expr
    dtype: str

    def q(self, x):
        return qnn.quantize(x, self.scale, self.zp, out_dtype=self.dtype)

    def of(self, real: float) -> int:
        lo, hi = P.qrange(self.dtype)
        v = np.rint(np.float32(real) / _scalar(self.scale)) + int(_scalar(self.zp))
        return int(np.clip(v, lo, hi))


def _int_op(op: str, call, x, qz: int, dtype: str, quant: _Q | None):
    """The integer version of a commute op applied to ``x`` (zero point ``qz``)."""
    if op == "relax.nn.relu":
        return relax.op.maximum(x, _const(np.array(qz), dtype))
    if op == "relax.clip":
        lo, hi = float(call.args[1].value), float(call.args[2].value)
        return relax.op.maximum(
            relax.op.minimum(x, _const(np.array(quant.of(hi)), dtype)),
            _const(np.array(quant.of(lo)), dtype),
        )
    if op == "relax.nn.pad":
        a = call.attrs
        if str(a.pad_mode) != "constant":
            return None
        pv = float(a.pad_value)
        value = qz if pv == 0.0 else (quant.of(pv) if quant is not None else None)
        if value is None:
            return None
        return relax.op.nn.pad(x, [int(v) for v in a.pad_width], "constant", float(value))
    return tvm.ir.Call(call.op, [x, *call.args[1:]], call.attrs, list(call.ty_args))


def _per_tensor(e) -> bool:
    v = _scalar(e)
    return v is not None and v.ndim == 0


def propagate(mod: tvm.IRModule, rounding: str = "float", max_rounds: int = 1000) -> tvm.IRModule:
    """Push quantize/dequantize through allow-listed ops and merge them (module doc)."""
    func = mod["main"]
    for phase in ("up", "down"):
        for _ in range(max_rounds):
            func, changed = _rewrite_round(func, phase, rounding)
            if not changed:
                break
    return with_main(mod, func)


def _rewrite_round(func: relax.Function, phase: str, rounding: str):
    bb = relax.BlockBuilder()
    vmap: dict = {}
    new_value: dict = {}
    changed = False
    bindings = [(b.var, b.value) for block in func.body.blocks for b in block.bindings]
    bb._begin_dataflow_block()

    def emit(expr, name=""):
        v = bb.emit(expr, name_hint=name)
        new_value[v] = bb.lookup_binding(v) if hasattr(bb, "lookup_binding") else expr
        return v

    def val(e):
        return new_value.get(e, e) if isinstance(e, relax.Var) else e

    for var, value in bindings:
        value = remap_expr(value, vmap)
        out = None
        if _is(value, "qnn.quantize") and _per_tensor(value.args[1]):
            src = val(value.args[0])
            quant = _Q(value.args[1], value.args[2], str(value.attrs["out_dtype"]))
            qz = int(_scalar(quant.zp))
            if _is(src, "qnn.dequantize"):
                w, s1, z1 = src.args
                same = (
                    _per_tensor(s1) and _per_tensor(z1) and dtype_of(w) == quant.dtype
                    and float(_scalar(s1)) == float(_scalar(quant.scale)) and int(_scalar(z1)) == qz
                )  # fmt: skip
                if same:
                    out = w
                else:
                    out = qnn.requantize(
                        w,
                        s1,
                        z1,
                        quant.scale,
                        quant.zp,
                        axis=int(src.attrs["axis"]),
                        out_dtype=quant.dtype,
                        rounding=rounding,
                    )
            elif phase == "up" and isinstance(src, tvm.ir.Call) and op_name(src) in ALLOW_LIST:
                op = op_name(src)
                if ALLOW_LIST[op].kind == "commute":
                    # an integer op that is the identity is not emitted: the quantize takes
                    # the binding's place (and its name, a slot's "<slot>.q")
                    if op == "relax.nn.relu" and qz <= P.qrange(quant.dtype)[0]:
                        out = quant.q(src.args[0])
                    elif op == "relax.concat":
                        fields = val(src.args[0])
                        if isinstance(fields, relax.Tuple):
                            qf = [emit(quant.q(f)) for f in fields.fields]
                            out = relax.op.concat(qf, axis=int(src.attrs.axis))
                    elif op != "relax.split":
                        qi = emit(quant.q(src.args[0]))
                        out = _int_op(op, src, qi, qz, quant.dtype, quant)
            elif phase == "up" and isinstance(src, relax.TupleGetItem):
                tup = val(src.tuple_value)
                if _is(tup, "relax.split"):
                    qi = emit(quant.q(tup.args[0]))
                    sp = emit(tvm.ir.Call(tup.op, [qi], tup.attrs))
                    out = relax.TupleGetItem(sp, src.index)
        elif (
            phase == "down"
            and isinstance(value, tvm.ir.Call)
            and op_name(value) in ALLOW_LIST
            and value.args
        ):
            op = op_name(value)
            rule = ALLOW_LIST[op]
            src = val(value.args[0])
            if rule.kind == "commute" and rule.dequantize and _is(src, "qnn.dequantize"):
                w, s, z = src.args
                zv = _scalar(z)
                per_tensor = _per_tensor(s) and zv is not None and zv.ndim == 0
                uniform_zp = zv is not None and np.all(zv == zv.reshape(-1)[0])
                if (per_tensor or (rule.per_axis_ok and uniform_zp)) and zv is not None:
                    qz = int(zv.reshape(-1)[0])
                    iv = _int_op(op, value, w, qz, dtype_of(w), None)
                    if iv is not None:
                        wi = emit(iv)
                        out = qnn.dequantize(wi, s, z, axis=int(src.attrs["axis"]))
        if out is not None:
            changed = True
            nv = out if isinstance(out, relax.Var) else emit(out, var.name)
        else:
            nv = emit(value, var.name)
        vmap[var] = nv
    ret = bb.emit_output(remap_expr(func.body.body, vmap))
    block = bb._end_block()
    new = relax.Function(func.params, relax.SeqExpr([block], ret), ret.ty, attrs=func.attrs)
    new = relax.analysis.remove_all_unused(new)
    return new, changed


# ------------------------------------------------------------------------------ realize


def realize(
    mod: tvm.IRModule,
    params: dict | None,
    qparams: QParams,
    config: Config | None = None,
) -> tvm.IRModule:
    """The int8 module for ``mod`` with ``qparams`` (from :func:`autoq.calibrate` or
    :func:`autoq.load_qparams`), using the same patterns and fallback as ``config``."""
    config = config or Config()
    g = prepare(mod, params)
    matches = find_matches(g, config)
    ctx = RealizeContext(g, config, qparams, matches)
    func = build_function(g, ctx, matches, "realize", [])
    out = propagate(with_main(mod, func), config.rounding)
    func = out["main"]
    if g.weight_params:
        bind = {p.name: tvm.runtime.tensor(g.params[p.name]) for p in g.weight_params}
        func = func.bind_params(bind)
        func = relax.Function(list(g.inputs), func.body, func.ret_ty, attrs=func.attrs)
    func = relax.analysis.remove_all_unused(func)
    result = with_main(mod, func.with_attr("global_symbol", "main"))
    result = relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(result))
    return result
