"""Plain-text summaries of a quantization: weight bytes, the qparams table, the target, and
the report ``autoq quantize`` prints and writes (shared by the CLI and the demo)."""

from __future__ import annotations

import json
import textwrap

import numpy as np

from autoq.build import weight_bytes

__all__ = [
    "fmt_bytes",
    "format_outputs",
    "format_qparams",
    "quantize_report",
    "target_str",
    "wrap",
]


def fmt_bytes(by_dtype: dict[str, int]) -> str:
    total = sum(by_dtype.values())
    parts = ", ".join(f"{k} {v:,}" for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
    return f"{total:,} bytes ({parts})" if len(by_dtype) > 1 else f"{total:,} bytes"


def wrap(label: str, text: str, width: int = 100) -> str:
    """``label`` padded to 13 columns, then ``text`` wrapped with the same indent."""
    return textwrap.fill(
        text,
        width=width,
        initial_indent=label.ljust(13),
        subsequent_indent=" " * 13,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _num(v: float) -> str:
    return f"{v:.6g}"


def _range_str(lo, hi) -> str:
    return f"[{_num(lo)}, {_num(hi)}]"


def format_qparams(qp, source: str = "") -> str:
    """The qparams table printed by ``autoq inspect``."""
    header = ("slot", "kind", "layer", "dtype", "scale", "zero point", "range")
    rows = []
    for sid, p in qp.params.items():
        info = qp.slots.get(sid)
        kind = info.kind if info else "?"
        layer = (info.layer if info else "") or "-"
        s = np.asarray(p.scale).reshape(-1)
        z = np.asarray(p.zero_point).reshape(-1)
        if p.per_axis:
            scale = f"{_num(s.min())}..{_num(s.max())} (x{s.size}, axis {p.axis})"
            zp = str(int(z[0])) if np.all(z == z[0]) else f"{int(z.min())}..{int(z.max())}"
        else:
            scale, zp = _num(float(s[0])), str(int(z[0]))
        if p.rmin is not None and p.rmax is not None:
            rng = _range_str(float(np.min(p.rmin)), float(np.max(p.rmax)))
        else:  # the range the integer grid covers
            lo, hi = p.grid_range()
            rng = _range_str(float(np.min(lo)), float(np.max(hi)))
        rows.append((sid, kind, layer, p.dtype, scale, zp, rng))
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    n_act = sum(1 for r in rows if r[1] == "activation")
    n_w = sum(1 for r in rows if r[1] == "weight")
    meta = qp.meta or {}
    title = f"{len(rows)} slots ({n_act} activation, {n_w} weight)"
    if source:
        title = f"{source}: {title}"
    extra = [f"{k} {meta[k]}" for k in ("calibration", "samples") if k in meta]
    if extra:
        title += "; " + ", ".join(extra)
    out = [title, "", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append("")
    out.append("range: the real interval the calibrator chose (per-channel: over all channels)")
    return "\n".join(out)


def target_str(target) -> str:
    try:
        d = {k: str(v) for k, v in target.export().items() if k in ("kind", "mcpu", "opt-level")}
        return json.dumps(d)
    except Exception:
        return str(target)


def _fp32_line(result, skip) -> str:
    """The fp32 layers grouped by why: ``fc (--skip f*), add_0 (unbounded activations)``."""
    groups: dict[str, list[str]] = {}
    for layer, why in result.fp32_layers.items():
        groups.setdefault(why, []).append(layer)
    label = {
        "fallback rule": f"--skip {' '.join(skip)}" if skip else "fallback rule",
        "unbounded activations (guard)": "unbounded activations: masking constants?",
    }
    parts = []
    for why, layers in groups.items():
        note = label.get(why, why)
        parts.append(", ".join(layers) + (f" ({note})" if note else ""))
    return ", ".join(parts) or "-"


def quantize_report(
    result, model_path, specs, calib: str, config, target, *, skip, times, files,
    report_asked: bool, fp32_model,
) -> str:  # fmt: skip
    """The text of ``report.txt`` (and what ``autoq quantize`` prints) for a
    :class:`autoq.QuantizeResult`."""
    fp32_bytes = weight_bytes(*fp32_model)
    int8_bytes = weight_bytes(result.module)
    total32, total8 = sum(fp32_bytes.values()), sum(int8_bytes.values())
    ratio = f"{total32 / total8:.2f}x smaller" if total8 else "-"
    act = config.activation.calibrator
    int16 = [] if result.decision is None or result.decision.precision != "int16" else (
        result.decision.layers
    )  # fmt: skip
    stage = {"match": "match", "guard": "guard", "calibrate": "calibration",
             "auto_fallback": "automatic fallback", "realize": "realize", "report": "analysis",
             "compile": "compile", "import": "import"}  # fmt: skip
    order = ("import", "match", "guard", "calibrate", "auto_fallback", "realize", "report")
    when = [f"{stage[k]} {times[k]:.2f} s" for k in (*order, "compile") if k in times]
    lines = [
        "autoq quantize report",
        f"model        {model_path}",
        f"inputs       {', '.join(str(s) for s in specs)}",
        f"recipe       {result.recipe[0]} ({result.recipe[1]})",
        f"calibration  {result.samples} samples from {calib}; activations: "
        f"{getattr(act, 'name', act)} ({config.calibration}), weights: "
        f"{'per-channel' if config.weight.per_channel else 'per-tensor'} max; rounding "
        f"{config.rounding}",
        f"time         {', '.join(when)}",
        f"target       {target_str(target)}",
        f"layers       {len(result.int8_layers)} quantized to int8, "
        f"{len(result.fp32_layers)} kept in fp32",
        wrap("  int8:", ", ".join(result.int8_layers) or "-"),
        wrap("  fp32:", _fp32_line(result, skip)),
    ]
    if int16:
        lines.append(wrap("  int16:", ", ".join(int16) + " (int16 activations, automatic)"))
    if result.decision is not None:
        first = result.decision.summary().splitlines()[0]
        lines.append(wrap("fallback", f"automatic: {first} (fallback.json)"))
    lines += [
        f"weights      fp32 {fmt_bytes(fp32_bytes)}",
        f"             int8 module {fmt_bytes(int8_bytes)}",
        f"             {ratio}",
    ]
    if report_asked:
        lines.append(_analysis_line(result.report))
    out, names = files
    lines.append(f"files        {out}/: {', '.join(names)}")
    return "\n".join(lines) + "\n"


def _analysis_line(report) -> str:
    if report is None:
        return "analysis     per-layer report not computed"
    sq = report.output_sqnr
    if sq is not None and np.isfinite(sq):
        return f"analysis     model output SQNR {sq:.2f} dB (see analysis.txt)"
    return "analysis     see analysis.txt"


def format_outputs(outputs: dict, rows: list[str], top: int = 5) -> str:
    """``autoq run``'s table: per row (image) and output, its shape and its ``top`` largest
    values with their indices (flattened within the row).

    >>> print(format_outputs({"y": np.array([[0.1, 0.7, 0.2]], np.float32)}, ["a.jpg"], 2))
    a.jpg  y (3,): [1] 0.7, [2] 0.2
    """
    lines = []
    for r, name in enumerate(rows):
        for out, value in outputs.items():
            row = np.asarray(value[r]) if np.ndim(value) else np.asarray(value)
            flat = row.reshape(-1)
            best = np.argsort(-flat, kind="stable")[:top]
            vals = ", ".join(f"[{i}] {flat[i]:.4g}" for i in best)
            lines.append(f"{name}  {out} {tuple(row.shape)}: {vals}")
    return "\n".join(lines)
