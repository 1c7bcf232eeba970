"""docs/ops.md's table of canonical quantized patterns matches the realized graphs.

Each row names patterns, the layer's ops in binding order and its BYOC shape. For every
pattern of every row a small fp32 model with that layer (followed by ``add(y, y)`` so the
layer exits as int8 into another integer layer) is quantized with the default config,
partitioned with ``autoq.byoc.pattern_table()`` alone (``FuseOpsByPattern``), and the
composites are read back: one of them must be the row's shape with exactly the row's ops.
The rows are parsed from the document, so an edit of the table is checked too.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_realize import cfg, quantize_all
from tvm import relax

import autoq.byoc
from autoq.ir.toolkit import bindings, op_name
from models import Builder, conv

DOC = Path(__file__).resolve().parents[1] / "docs" / "ops.md"


def table_rows() -> list[tuple[list[str], list[str], str]]:
    """(pattern names, ops, BYOC shape) of each row of the canonical-pattern table."""
    text = DOC.read_text()
    start = text.index("| pattern (`patterns/`) | ops | realized form | BYOC shape |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`(\w+)`", cells[0].split("(")[0])
        ops = [o.strip() for o in cells[1].strip("`").split("->")]
        rows.append((names, ops, cells[3].strip("`")))
    return rows


def _op(name: str) -> str:
    """The elementwise op a pattern realizes (``add_const`` -> ``add``)."""
    return name.removesuffix("_const")


C, HW = 4, 6


def _layer(b: Builder, x, name: str):
    """``x`` through one layer that the pattern ``name`` matches."""
    emit = b.emit
    if name.startswith("conv2d"):
        y = conv(b, x, "c", C, C, bias="bias" in name)
        return emit(relax.op.add(y, x)) if name.endswith("_add") else y
    if name.startswith("dense"):
        flat = emit(relax.op.reshape(x, [1, C * HW * HW]))
        w = b.randw("fc.weight", (C * HW * HW, C * HW * HW))
        y = emit(relax.op.matmul(flat, relax.op.permute_dims(w, [1, 0])))
        if "bias" in name:
            y = emit(relax.op.add(y, b.weight("fc.bias", b.rng.normal(size=(C * HW * HW,)))))
        return emit(relax.op.add(y, flat)) if name.endswith("_add") else y
    if name == "matmul":
        return emit(relax.op.matmul(x, emit(relax.op.permute_dims(x, [0, 1, 3, 2]))))
    if name == "mean":
        return emit(relax.op.mean(x, axis=[2, 3], keepdims=True))
    if name == "adaptive_avg_pool2d":
        return emit(relax.op.nn.adaptive_avg_pool2d(x, output_size=[1, 1]))
    if name == "avg_pool2d":
        return emit(relax.op.nn.avg_pool2d(x, pool_size=2, strides=2))
    if name in ("add", "subtract", "multiply"):
        y = emit(relax.op.nn.relu(x))  # a second activation
        return emit(getattr(relax.op, name)(x, y))
    if name.endswith("_affine"):  # f(x) * a + b, one-element constants
        y = _layer(b, x, name.removesuffix("_affine"))
        y = emit(relax.op.multiply(y, relax.const(np.array([0.8], np.float32))))
        return emit(relax.op.add(y, relax.const(np.array([0.3], np.float32))))
    if name.endswith("_const"):
        c = np.linspace(0.5, 2.0, C, dtype=np.float32).reshape(1, C, 1, 1)
        return emit(getattr(relax.op, _op(name))(x, relax.const(c)))
    fn = {
        "sigmoid": relax.op.sigmoid, "tanh": relax.op.tanh, "silu": relax.op.nn.silu,
        "gelu": relax.op.nn.gelu, "gelu_tanh": relax.op.nn.gelu_tanh,
        "hardswish": autoq.ir.canonicalize.hardswish, "hardsigmoid": autoq.ir.canonicalize.hardsigmoid,
    }[name]  # fmt: skip
    return emit(fn(x))


def _model(name: str):
    b = Builder(5)
    x = b.input("x", (1, C, HW, HW))

    def body(b):
        y = _layer(b, x, name)
        return b.emit(relax.op.add(y, y))

    return b.build(body)


def composites(mod) -> list[tuple[str, list[str]]]:
    """(shape name without the prefix, ops in binding order) of every composite function
    ``FuseOpsByPattern(autoq.byoc.pattern_table())`` makes of ``mod``."""
    fused = relax.transform.FuseOpsByPattern(
        autoq.byoc.pattern_table("t"), bind_constants=False, annotate_codegen=False
    )(mod)
    out = []
    for _, f in fused.functions_items():
        if isinstance(f, relax.Function) and f.attrs is not None and "Composite" in f.attrs:
            ops = [op_name(v).removeprefix("relax.") for _, v in bindings(f)]
            out.append((str(f.attrs["Composite"]).removeprefix("t."), ops))
    return out


CASES = [
    (name, [o.replace("<op>", _op(name)) for o in ops], shape.replace("<op>", _op(name)))
    for names, ops, shape in table_rows()
    for name in names
]


def test_the_table_names_every_default_pattern_and_real_shapes():
    from autoq.ir.registry import ordered_patterns

    assert {c[0] for c in CASES} == {p.name for p in ordered_patterns()}
    shapes = {s.name for s in autoq.byoc.SHAPES}
    assert {c[2] for c in CASES} <= shapes


@pytest.mark.parametrize("name,ops,shape", CASES, ids=[c[0] for c in CASES])
def test_the_realized_layer_is_the_table_row(name, ops, shape):
    mod, params = _model(name)
    data = [np.random.default_rng(i).normal(size=(1, C, HW, HW)).astype(np.float32) for i in (0, 1)]
    _, _, real = quantize_all(mod, params, data, cfg())
    found = composites(real)
    assert (shape, ops) in found, found
