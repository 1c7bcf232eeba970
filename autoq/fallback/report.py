"""The per-layer report model: what :func:`autoq.analyze` returns, its JSON, table and plot.

:class:`Report` holds one :class:`LayerStats` per layer and one :class:`SlotStats` per
quantized tensor (SQNR / cosine "alone" and "upstream", range, scale, zero point, clipped
fraction, accumulator headroom; see :mod:`autoq.fallback.analysis` for how they are measured).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from autoq.json_document import JsonDocument

__all__ = [
    "EXACT_LIMIT",
    "LayerStats",
    "Report",
    "SlotStats",
    "fmt_db",
    "json_float",
    "json_num",
    "sort_key",
]

#: below this |accumulator| the simulated graph (float32 integers) is exact
EXACT_LIMIT = 2**24


def sort_key(v: float) -> float:
    return float("inf") if v != v else v


def fmt_db(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else str(v)


def json_num(v):
    """JSON-safe float (inf / nan as strings) and back."""
    if v is None:
        return None
    if isinstance(v, str):
        return float(v)
    v = float(v)
    return v if math.isfinite(v) else str(v)


def _nums(v):
    if v is None:
        return None
    if isinstance(v, list | tuple | np.ndarray):
        return [json_num(x) for x in np.asarray(v).ravel().tolist()]
    return json_num(v)


def json_float(v):
    if v is None:
        return None
    if isinstance(v, list):
        return [float(x) for x in v]
    return float(v)


@dataclass
class SlotStats:
    """One quantized tensor. ``scale`` / ``zero_point`` / ``rmin`` / ``rmax``: floats
    (per-tensor) or lists (per-channel). ``clipped``: fraction of the values (upstream run)
    outside the integer range. Weights have equal alone and upstream numbers."""

    slot: str
    kind: str
    layer: str
    dtype: str
    scale: Any
    zero_point: Any
    rmin: Any
    rmax: Any
    elements: int
    sqnr_alone: float
    cos_alone: float
    sqnr_upstream: float
    cos_upstream: float
    clipped: float

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("scale", "rmin", "rmax", "sqnr_alone", "cos_alone", "sqnr_upstream"):
            d[k] = _nums(d[k])
        d["cos_upstream"] = json_num(d["cos_upstream"])
        d["clipped"] = json_num(d["clipped"])
        return d

    @classmethod
    def from_json(cls, d: dict) -> SlotStats:
        d = dict(d)
        for k in ("scale", "rmin", "rmax", "sqnr_alone", "cos_alone", "sqnr_upstream"):
            d[k] = json_float(d[k])
        d["cos_upstream"] = json_float(d["cos_upstream"])
        d["clipped"] = json_float(d["clipped"])
        return cls(**d)


@dataclass
class LayerStats:
    """One layer: SQNR / cosine of its output, alone and upstream; ``acc_max`` is the
    largest |int32 accumulator| seen (upstream run; None for layers that do not
    accumulate), ``acc_overflow`` how many accumulator values fall outside the narrower
    ``Report.accumulator`` dtype, of ``acc_elements``."""

    layer: str
    pattern: str
    index: int
    slots: list[str]
    elements: int
    sqnr_alone: float
    cos_alone: float
    sqnr_upstream: float
    cos_upstream: float
    acc_max: float | None = None
    acc_overflow: int | None = None
    acc_elements: int | None = None

    @property
    def exact(self) -> bool:
        """The simulated graph predicts this layer bit for bit (|acc| < 2**24)."""
        return self.acc_max is None or self.acc_max < EXACT_LIMIT

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("sqnr_alone", "cos_alone", "sqnr_upstream", "cos_upstream", "acc_max"):
            d[k] = json_num(d[k])
        return d

    @classmethod
    def from_json(cls, d: dict) -> LayerStats:
        d = dict(d)
        for k in ("sqnr_alone", "cos_alone", "sqnr_upstream", "cos_upstream", "acc_max"):
            d[k] = json_float(d[k])
        return cls(**d)


@dataclass
class Report(JsonDocument):
    """The result of :func:`analyze`: ``layers`` in topological order, ``slots`` in slot
    order, the model output's SQNR / cosine (everything quantized), the narrow accumulator
    dtype the overflow counts refer to, and the number of samples."""

    layers: list[LayerStats]
    slots: list[SlotStats]
    output_sqnr: float
    output_cos: float
    accumulator: str = "int16"
    samples: int = 0
    meta: dict = field(default_factory=dict)

    def layer(self, name: str) -> LayerStats:
        for s in self.layers:
            if s.layer == name:
                return s
        raise KeyError(f"no layer {name!r}; layers: {[s.layer for s in self.layers]}")

    def slot(self, name: str) -> SlotStats:
        for s in self.slots:
            if s.slot == name:
                return s
        raise KeyError(f"no slot {name!r}")

    def ranked(self) -> list[LayerStats]:
        """Layers by damage: lowest "alone" SQNR first (the error the layer itself adds);
        ties by upstream SQNR, then topological order."""
        return sorted(
            self.layers, key=lambda s: (sort_key(s.sqnr_alone), sort_key(s.sqnr_upstream), s.index)
        )

    def table(self, sort: str = "damage") -> str:
        """A text table of the layers (``sort``: ``"damage"`` or ``"topological"``)."""
        rows = self.ranked() if sort == "damage" else list(self.layers)
        head = (
            f"{'#':>3} {'layer':<32} {'pattern':<16} {'SQNR alone':>10} {'cos alone':>9} "
            f"{'SQNR up':>8} {'cos up':>8} {'in clip%':>8} {'max|acc|':>10} "
            f"{'>' + self.accumulator:>9}"
        )
        lines = [head, "-" * len(head)]
        slot_by = {s.slot: s for s in self.slots}
        for r in rows:
            ins = [slot_by[s] for s in r.slots if s in slot_by and slot_by[s].kind == "activation"]
            clip = max((s.clipped for s in ins), default=0.0)
            acc = "" if r.acc_max is None else f"{r.acc_max:.0f}" + ("" if r.exact else "!")
            ovf = "" if r.acc_overflow is None else str(r.acc_overflow)
            lines.append(
                f"{r.index:>3} {r.layer[:32]:<32} {r.pattern[:16]:<16} {fmt_db(r.sqnr_alone):>10} "
                f"{r.cos_alone:>9.5f} {fmt_db(r.sqnr_upstream):>8} {r.cos_upstream:>8.5f} "
                f"{100 * clip:>8.3f} {acc:>10} {ovf:>9}"
            )
        lines.append(
            f"model output: SQNR {fmt_db(self.output_sqnr)} dB, cos {self.output_cos:.6f} "
            f"({self.samples} samples; '!' = |acc| >= 2**24, the simulated graph is not exact)"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> dict:
        return {
            "format": "autoq.fallback.report",
            "version": 1,
            "accumulator": self.accumulator,
            "samples": self.samples,
            "output_sqnr": json_num(self.output_sqnr),
            "output_cos": json_num(self.output_cos),
            "layers": [s.to_json() for s in self.layers],
            "slots": [s.to_json() for s in self.slots],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict) -> Report:
        if d.get("format") != "autoq.fallback.report":
            raise ValueError("not an autoq report (format != 'autoq.fallback.report')")
        return cls(
            layers=[LayerStats.from_json(x) for x in d["layers"]],
            slots=[SlotStats.from_json(x) for x in d["slots"]],
            output_sqnr=json_float(d["output_sqnr"]),
            output_cos=json_float(d["output_cos"]),
            accumulator=d.get("accumulator", "int16"),
            samples=int(d.get("samples", 0)),
            meta=dict(d.get("meta", {})),
        )

    def plot(self, path: str | Path, title: str | None = None) -> Path | None:
        """PNG of the SQNR per layer in topological order (alone and upstream). Needs
        matplotlib (``pip install autoq[plot]``); without it, warns and returns None."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn(
                "Report.plot needs matplotlib (pip install 'autoq[plot]'); no PNG written",
                stacklevel=2,
            )
            return None
        path = Path(path)
        xs = np.arange(len(self.layers))
        cap = 100.0

        def clipv(v):
            return min(v, cap) if math.isfinite(v) or v > 0 else 0.0

        fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(xs) + 2), 4.2))
        ax.plot(xs, [clipv(s.sqnr_alone) for s in self.layers], "o-", ms=3, label="alone")
        ax.plot(xs, [clipv(s.sqnr_upstream) for s in self.layers], "s-", ms=3, label="upstream")
        ax.set_xticks(xs)
        ax.set_xticklabels([s.layer for s in self.layers], rotation=90, fontsize=6)
        ax.set_ylabel("SQNR (dB)")
        ax.set_title(title or f"per-layer SQNR (output {fmt_db(self.output_sqnr)} dB)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
