"""The dataset contract: a model's data inputs (:class:`InputSpec`) and the check of one
sample against them, raising :class:`DatasetError` that names the sample, the input, what
was expected and what was given (see :mod:`autoq.dataset`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoq.errors import DatasetError

__all__ = [
    "DatasetError",
    "InputSpec",
    "check_names",
    "describe_inputs",
    "format_shape",
    "index_bounds",
    "input_specs",
    "validate_sample",
]


@dataclass(frozen=True)
class InputSpec:
    """One data input of a model: name, shape (``None`` for a symbolic dim), dtype.
    ``index``: for an integer input that indexes a table (token ids into an embedding),
    ``(table name, low, rows)``: every value must lie in ``[low, rows)``, ``low`` 0 or
    ``-rows`` where the model wraps negative ids as ONNX Gather does (see
    :func:`index_bounds`).
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    index: tuple[str, int, int] | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.name!r} {format_shape(self.shape)} {self.dtype}"

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            d is None or d == s for d, s in zip(self.shape, shape, strict=True)
        )


def input_specs(mod, params=None, func_name: str = "main") -> list[InputSpec]:
    """The data inputs of a Relax function: its parameters that are not in ``params``.

    ``mod`` is an ``IRModule`` (``mod[func_name]`` is used) or a ``relax.Function``;
    ``params`` a dict of weights or any collection of weight names.
    """
    import tvm
    from tvm import relax

    func = mod[func_name] if isinstance(mod, tvm.IRModule) else mod
    if not isinstance(func, relax.Function):
        raise TypeError(f"expected an IRModule or a relax.Function, got {type(mod).__name__}")
    weights = set(params or ())
    bounds = index_bounds(func)
    specs = []
    for p in func.params:
        if p.name in weights:
            continue
        ty = p.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise DatasetError(f"input {p.name!r} is not a tensor of known rank ({ty})")
        dims = []
        for d in ty.shape.values:
            try:
                dims.append(int(d))
            except (TypeError, ValueError):
                dims.append(None)
        specs.append(InputSpec(p.name, tuple(dims), str(ty.dtype), bounds.get(p.name)))
    return specs


#: ops that pass an integer tensor's values through unchanged (for :func:`index_bounds`)
_SAME_VALUES = ("relax.reshape", "relax.astype", "relax.expand_dims", "relax.squeeze",
                "relax.permute_dims", "relax.flatten")  # fmt: skip


def index_bounds(func) -> dict[str, tuple[str, int, int]]:
    """Integer inputs of ``func`` used as the indices of a ``take`` (ONNX Gather, an
    embedding lookup), directly or through reshapes/casts: input name -> (table name,
    lowest valid id, number of rows along the take's axis). Out-of-range ids would read
    outside the table (TVM's gather does not check; a large id crashes the process). The
    lowest id is 0, or ``-rows`` where the ids pass ONNX Gather's negative-index wrap
    (``where(less(x, 0), add(x, n), x)``, what TVM's ONNX importer emits)."""
    import tvm
    from tvm import relax

    origin = {p: (p.name, 0) for p in func.params}  # var -> (input, lowest valid id)
    names = {p: p.name for p in func.params}
    calls: dict = {}  # var -> the op call bound to it
    out: dict[str, tuple[str, int, int]] = {}
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    for block in blocks:
        for b in block.bindings:
            v = b.value
            if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op):
                continue
            op = v.op.name
            calls[b.var] = v
            if op in _SAME_VALUES and v.args[0] in origin:
                origin[b.var] = origin[v.args[0]]
            elif op == "relax.where" and _wraps_negative(v, calls) and v.args[2] in origin:
                origin[b.var] = (origin[v.args[2]][0], -1)
            elif op == "relax.take" and v.args[1] in origin:
                table, shape = v.args[0], v.args[0].ty.shape
                axis = int(v.attrs.axis) if v.attrs.axis is not None else 0
                try:
                    rows = int(shape.values[axis])
                except (AttributeError, TypeError, ValueError, IndexError):
                    continue
                name = names.get(table, getattr(table, "name_hint", "a constant table"))
                source, low = origin[v.args[1]]
                prev = out.get(source)
                if prev is None or rows < prev[2]:
                    out[source] = (str(name), -rows if low else 0, rows)
    return out


def _wraps_negative(where, calls) -> bool:
    """``where(less(x, 0), add(x, n), x)``: negative ids counted from the table's end."""
    cond, wrapped, x = calls.get(where.args[0]), calls.get(where.args[1]), where.args[2]
    return all(
        c is not None and c.op.name == name and c.args[0].same_as(x)
        for c, name in ((cond, "relax.less"), (wrapped, "relax.add"))
    )


def describe_inputs(specs: Sequence[InputSpec]) -> str:
    return ", ".join(str(s) for s in specs)


def _to_array(value, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
        return value.detach().cpu().numpy()
    if hasattr(value, "numpy") and callable(value.numpy):  # tvm.runtime.Tensor
        return np.asarray(value.numpy())
    if isinstance(value, np.generic):
        return np.asarray(value)
    raise DatasetError(f"{where}: expected a numpy array, got {type(value).__name__}")


def _check_array(arr: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    shape = tuple(arr.shape)
    if not spec.matches(shape):
        if len(spec.shape) >= 1 and spec.shape[0] == 1 and spec.matches((1, *shape)):
            arr = arr.reshape((1, *shape))
        else:
            raise DatasetError(
                f"{where}: expected shape {format_shape(spec.shape)}, got {format_shape(shape)}"
            )
    if str(arr.dtype) != spec.dtype:
        raise DatasetError(
            f"{where}: expected dtype {spec.dtype}, got {arr.dtype} "
            f"(convert it with .astype(np.{spec.dtype}))"
        )
    if spec.index is not None and arr.size:
        table, low, rows = spec.index
        bad = (arr < low) | (arr >= rows)
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise DatasetError(
                f"{where}: {int(bad.sum())} value(s) outside [{low}, {rows}) (e.g. {arr[pos]} at "
                f"index {list(pos)}), but the input indexes table {table!r} of {rows} rows "
                f"(range {arr.min()}..{arr.max()}): fix the ids or the tokenizer/vocabulary"
            )
    if np.issubdtype(arr.dtype, np.inexact):
        finite = np.isfinite(arr)
        if not finite.all():
            n_nan = int(np.isnan(arr).sum())
            n_inf = int(arr.size - finite.sum()) - n_nan
            raise DatasetError(f"{where}: contains {n_nan} NaN and {n_inf} Inf value(s)")
    return np.ascontiguousarray(arr)


def format_shape(shape) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def check_names(keys: list, specs: Sequence[InputSpec], where: str) -> None:
    """Unknown or missing input names are an error listing the model's inputs."""
    names = [s.name for s in specs]
    unknown = [k for k in keys if k not in names]
    missing = [n for n in names if n not in keys]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown input name(s) {unknown}")
        if missing:
            parts.append(f"missing input(s) {missing}")
        raise DatasetError(
            f"{where}: {' and '.join(parts)}; the model's inputs are: {describe_inputs(specs)}"
        )


def validate_sample(sample, index: int, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """Check one sample against ``specs``; return it as ``{name: contiguous array}``."""
    if isinstance(sample, Mapping):
        check_names(list(sample.keys()), specs, f"sample {index}")
        return {
            s.name: _check_array(
                _to_array(sample[s.name], f"sample {index}, input {s.name!r}"),
                s,
                f"sample {index}, input {s.name!r}",
            )
            for s in specs
        }
    is_array = isinstance(sample, np.ndarray | np.generic) or (
        hasattr(sample, "numpy") and not isinstance(sample, list | tuple | str | bytes)
    )
    if not is_array:
        raise DatasetError(
            f"sample {index} is a {type(sample).__name__}; a sample must be a dict "
            f"{{input name: array}} or, for a single-input model, an array. "
            f"The model's inputs are: {describe_inputs(specs)}"
        )
    if len(specs) != 1:
        raise DatasetError(
            f"sample {index} is a single array but the model has {len(specs)} inputs "
            f"({describe_inputs(specs)}): yield dicts {{input name: array}}"
        )
    spec = specs[0]
    where = f"sample {index}, input {spec.name!r}"
    return {spec.name: _check_array(_to_array(sample, where), spec, where)}
