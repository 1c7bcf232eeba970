"""Data-aware weights inside topological calibration (``Config.weight_rounding``,
``Config.bias_correction``).

Topological calibration (:mod:`autoq.calibration`) chooses an activation slot's qparams just
before the segment that starts at its quantize runs; the conv/dense layers that read that
slot compute inside that segment or a later one. :class:`WeightTuner` hooks in between:
for every such layer it

1. streams the slot's cached input, quantized with the qparams just chosen (what the layer
   really reads, carrying every upstream rounding), into the layer's
   :class:`autoq.accuracy.hessian.CodeHessian` ``H = 2 X^T X / n`` and mean input row (im2col patches for
   a convolution, at most :data:`MAX_ROWS` output pixels per sample);
2. with ``weight_rounding="gptq"``: rounds the weights by GPTQ (:func:`autoq.accuracy.gptq.gptq`) on
   that ``H`` (round-to-nearest when there are fewer than :data:`MIN_ROWS_PER_COLUMN` rows
   per weight column: ``H`` would be too poorly sampled, e.g. a classifier seeing one row
   per image);
3. with ``Config.bias_correction`` (empirical): adds the whole mean shift to the fp32
   model, ``W E[x_fp32] - W_q E[x~]``, to the float bias (layers without a bias are left
   as they are; exact mean patches, :class:`autoq.accuracy.bias_correction.PatchMean`:
   ``E[x~]`` of the quantized input streamed here, ``E[x_fp32]`` from one fp32 pass before
   calibration, :meth:`WeightTuner.observe_fp32`); with ``BiasCorrection.holdout`` each
   layer's correction kept only if it lowers the layer's output error on held-out samples
   (:mod:`autoq.accuracy.bias_gate`);

and hands the new weight (the chosen integers, dequantized: they quantize back to the same
integers exactly), bias and weight qparams to the runners, so the segments that follow (the
layer's output slot and everything downstream) are calibrated on the tuned layer. In the
end :meth:`WeightTuner.values` turns them into the integers ``QParams.values`` carries
(after ``fit_bias_scales``), which realize uses as they are and
:meth:`autoq.simulation.SimResult.input_values` dequantizes for the simulated graph.

Statistics merge exactly across shards, like the calibrators' observers: the Hessians sum
the input's integer codes in int64 (:class:`autoq.accuracy.hessian.CodeHessian`), so any split of
the samples and any merge order give the same bits, and a distributed run
(:mod:`autoq.distributed`) tunes the same weights as one process. Cost: one pass over each layer's cached input (no extra run of the
graph) plus the GPTQ arithmetic; reported in ``QParams.meta["weight_tuning"]``.

The arithmetic runs with single-threaded BLAS (:func:`single_threaded_blas`): GPTQ's column
loop alternates small vector ops with BLAS calls, after which multi-threaded OpenBLAS keeps
its workers spinning; with more runnable threads than cores they take the core from the
loop. Measured on ResNet-50 (2 cores, load ~11): weight tuning 38 s single-threaded vs
90 s with OpenBLAS's default 2 threads, same bits (the Hessians are exact integer sums;
GPTQ's float64 results were identical for both thread counts on every layer).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from autoq import primitives as P
from autoq.accuracy.bias_correction import PatchMean
from autoq.accuracy.bias_gate import HeldRows, decide, follower_activation, layer_output
from autoq.accuracy.gptq import gptq, rtn
from autoq.accuracy.hessian import CodeHessian, ConvGeometry, flatten_conv_weight
from autoq.config import Config
from autoq.ir.registry import slot_id_of
from autoq.ir.toolkit import op_name, shape_of
from autoq.qparams import QParam
from autoq.rules import depthwise_channels

__all__ = [
    "MAX_ROWS",
    "MIN_ROWS_PER_COLUMN",
    "LayerTask",
    "WeightTuner",
    "distinct_values",
    "layer_tasks",
    "quantize_offset",
    "single_threaded_blas",
]

#: Hessian rows (output pixels) kept per sample, evenly spaced: bounds the cost of early,
#: high-resolution layers (GPTQ quality on EfficientNet-Lite0 unchanged at 256)
MAX_ROWS = 256
#: GPTQ needs at least this many input rows per weight column, else round-to-nearest
MIN_ROWS_PER_COLUMN = 4


@dataclass(frozen=True)
class LayerTask:
    """One conv/dense layer whose weights are tuned: its slots, its float weight (layout
    of the fp32 graph: OIHW, or ``(in, out)`` for dense) and its conv geometry (None:
    dense)."""

    layer: str
    weight_slot: str
    input_slot: str
    weight: np.ndarray
    geom: ConvGeometry | None
    has_bias: bool

    def hessian(
        self, scale: float, max_rows: int | None = MAX_ROWS, products: bool = True
    ) -> CodeHessian:
        """The exact Hessian of the layer's input codes quantized with ``scale``
        (``products=False``: their row sums only, see :class:`autoq.accuracy.hessian.CodeHessian`)."""
        kw = {"scale": scale, "products": products}
        if self.geom is None:
            return CodeHessian.dense(self.weight.shape[0], max_rows, **kw)
        return CodeHessian.conv2d(
            self.geom, self.weight.shape[1] * self.geom.groups, max_rows, **kw
        )

    def rows_bound(self, shape, samples: int) -> int | None:
        """At most how many rows its Hessian gets from ``samples`` inputs of ``shape``
        (static; None when unknown): all of each sample's rows (tokens), at most
        :data:`MAX_ROWS` of them."""
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        h = self.hessian(1.0)
        return h.rows_size(tuple(shape)) // (h.shape[0] * h.shape[1]) * samples

    def input_key(self) -> tuple:
        """Equal for layers whose Hessians of the same input are equal (geometry, width)."""
        if self.geom is None:
            return (None, self.weight.shape[0])
        return (self.geom, self.weight.shape[1] * self.geom.groups)

    def flat(self, w: np.ndarray) -> np.ndarray:
        """``(G, O, K)`` rows of output channels (the matrices :class:`Hessian` fits)."""
        if self.geom is None:
            return np.asarray(w).T[None]
        return flatten_conv_weight(w, self.geom.groups)

    def unflat(self, wf: np.ndarray) -> np.ndarray:
        if self.geom is None:
            return np.ascontiguousarray(wf[0].T)
        return np.asarray(wf).reshape(self.weight.shape)


def _geometry(core, weight: np.ndarray) -> ConvGeometry:
    a = core.attrs
    return ConvGeometry(
        kernel=tuple(weight.shape[2:]),
        strides=[int(v) for v in a.strides],
        padding=[int(v) for v in a.padding],
        dilation=[int(v) for v in a.dilation],
        groups=int(a.groups),
    )


def layer_tasks(sim) -> dict[str, list[LayerTask]]:
    """Input slot -> the conv2d/dense layers with a weight slot that read it (not the
    dynamic layers: they round their weights to nearest, :mod:`autoq.rules.hybrid`)."""
    tensor_id = slot_id_of(sim.graph, sim.matches)
    out: dict[str, list[LayerTask]] = {}
    for m in sim.matches:
        sid = f"{m.layer}.weight"
        if sid not in sim.plan.weights or "core" not in m.nodes or m.layer in sim.plan.dynamic:
            continue  # (a dynamic layer has no input slot: autoq.rules.hybrid)
        core = sim.graph.value.get(m["core"])
        kind = op_name(core) if core is not None else ""
        w = sim.plan.weights[sid][0]
        if kind == "relax.nn.conv2d" and w.ndim == 4:
            geom = _geometry(core, w)
        elif kind == "relax.matmul" and w.ndim == 2:
            geom = None
        else:
            continue
        x_sid = tensor_id(m["data"])
        task = LayerTask(m.layer, sid, x_sid, w, geom, m.layer in sim.plan.biases)
        out.setdefault(x_sid, []).append(task)
    return out


def quantize_offset(x, scale, zero_point, dtype: str = "int8") -> np.ndarray:
    """``autoq.primitives.quantize(x, scale, zero_point, dtype) - zero_point`` (per tensor) as float32
    integers, in three passes over one float32 buffer: ``clip(rint(float32(x) / scale),
    qmin - zero_point, qmax - zero_point)`` (the integer codes weight tuning sums).

    The same integers as :func:`autoq.primitives.quantize`: with ``v = rint(x / scale)``, ``v + zero_point``
    is exact in float32 while ``|v| < 2**24 - 2**16``, so clipping it to ``[qmin, qmax]``
    is clipping ``v`` to ``[qmin - zp, qmax - zp]``; a larger ``|v|`` saturates on the same
    side in both. Ranges up to 16 bits (``zero_point`` inside the range); nan stays nan.

    >>> quantize_offset(np.array([0.25, 0.75, 1.25, -0.25, 100.0, -100.0]), 0.5, 1)
    array([   0.,    2.,    2.,   -0.,  126., -129.], dtype=float32)
    """
    qmin, qmax = P.qrange(dtype)
    scale, zp = np.asarray(scale), np.asarray(zero_point)
    if scale.size != 1 or zp.size != 1:
        raise ValueError(f"quantize_offset is per tensor, got {scale.size} scales")
    z = int(zp.reshape(-1)[0])
    if max(-qmin, qmax) > 2**16 or not qmin <= z <= qmax:
        raise ValueError(
            f"quantize_offset takes ranges up to 16 bits and a zero point inside them, got "
            f"{dtype} with zero point {z}"
        )
    v = np.divide(
        np.asarray(x, np.float32), np.asarray(scale, np.float32).reshape(())
    )  # a new float32 buffer
    np.rint(v, out=v)
    return np.clip(v, qmin - z, qmax - z, out=v)


def single_threaded_blas():
    """A context in which numpy's and scipy's BLAS/LAPACK use one thread (threadpoolctl;
    a no-op context where it is not installed)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency of autoq
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


class InputStats:
    """The Hessians of the layers reading one slot, fed that slot's *quantized* values
    (as integer codes: :class:`autoq.accuracy.hessian.CodeHessian`, exact whatever the split of the
    samples into shards and the order they merge in)."""

    def __init__(
        self,
        tasks: list[LayerTask],
        qp: QParam,
        patch_means: bool = False,
        products: frozenset[str] | None = None,
    ):
        """``products``: the layers whose Hessian needs its products (None: every layer);
        the others sum only their rows (``CodeHessian(products=False)``)."""
        scale = np.asarray(qp.scale).reshape(-1)
        if scale.size != 1 and not all(t.geom is not None for t in tasks):
            raise ValueError(
                f"weight tuning needs a per-tensor input scale for {[t.layer for t in tasks]}, "
                f"got {scale.size} scales"
            )
        self.qp = qp
        #: codes -> reals of each group: the scale, or [G, 1] per channel (a depthwise input,
        #: whose Hessians stay in codes: GPTQ and the scale search ignore a factor per group)
        self.group_scale = float(np.float32(scale[0]))
        if scale.size != 1:
            for t in tasks:
                self.group_scale = depthwise_channels.group_scales(qp.scale, t.geom.groups)
            scale = np.ones(1)
        # layers reading the slot with the same geometry (e.g. a residual block's first 1x1
        # conv and its projection shortcut) see the same patches: one Hessian for them
        need = {t.input_key() for t in tasks if products is None or t.layer in products}
        shared: dict[tuple, CodeHessian] = {}
        for t in tasks:
            if t.input_key() not in shared:
                shared[t.input_key()] = t.hessian(float(scale[0]), products=t.input_key() in need)
        self.hessians = {t.layer: shared[t.input_key()] for t in tasks}
        # one layer per distinct Hessian (layer -> Hessian): what update/merge feed, once
        self.distinct = dict(_distinct_items(self.hessians))
        #: with ``patch_means``: layer -> exact mean patch of the quantized input's integer
        #: codes (shared like the Hessians; ``distinct_means`` as ``distinct``); times the
        #: scale in :meth:`input_mean`
        self.means = patch_mean_table(tasks) if patch_means else {}
        self.distinct_means = dict(_distinct_items(self.means))

    def update(self, x: np.ndarray) -> None:
        """Add one batch of the slot's float values: each Hessian gets the integer codes of
        its rows, quantized after gathering them when that is fewer values (the kept
        patches of a large image) and gathered from the quantized batch otherwise: the
        same integers (:func:`quantize_offset`); the mean patches take
        the whole batch's codes."""
        qp = self.qp
        if qp.per_axis or P.qrange(qp.dtype)[1] > 2**16:
            ax = qp.axis if qp.per_axis else None  # (per channel: autoq.rules.depthwise_channels)
            q = P.quantize(x, qp.scale, qp.zero_point, qp.dtype, ax).astype(np.int32)
            zp = np.asarray(qp.zero_point, np.int32)
            codes = q - (
                zp if ax is None else zp.reshape([-1 if i == ax else 1 for i in range(q.ndim)])
            )
            for h in self.distinct.values():
                h.update(codes)
            for m in self.distinct_means.values():
                m.update(codes)
            return
        x = np.asarray(x)
        codes = None  # the whole batch's, computed once if some Hessian or mean needs it
        qmin, qmax = P.qrange(qp.dtype)
        z = int(np.asarray(qp.zero_point).reshape(-1)[0])
        bound = max(z - qmin, qmax - z)  # (quantize_offset clips the codes to its range)

        def offset(v):
            return quantize_offset(v, qp.scale, qp.zero_point, qp.dtype)

        for h in self.distinct.values():
            if h.rows_size(x.shape) < x.size:
                rows = offset(h.rows_of(x, np.float32))
            else:
                codes = offset(x) if codes is None else codes
                rows = h.rows_of(codes, np.float32)
            h.update_rows(rows.transpose(0, 2, 1), bound)
        if self.distinct_means:  # (integers of at most bound: PatchMean sums them exactly)
            whole = offset(x) if codes is None else codes
            for m in self.distinct_means.values():
                m.update(whole, bound)

    def flush(self) -> None:
        """Sum the rows the Hessians still buffer (:meth:`autoq.accuracy.hessian.CodeHessian.flush`)."""
        for h in self.distinct.values():
            h.flush()

    def merge(self, other: InputStats) -> None:
        other = other.resolve()
        for k, h in self.distinct.items():
            h.merge(other.hessians[k])
        for k, m in self.distinct_means.items():
            m.merge(other.means[k])

    def input_mean(self, layer: str) -> np.ndarray:
        """The exact mean patch of ``layer``'s quantized input (codes x scale)."""
        return self.means[layer].mean() * self.group_scale

    def resolve(self) -> InputStats:
        """Itself (a shard's statistics computed elsewhere resolve to one of these)."""
        return self


def patch_mean_table(tasks: list[LayerTask]) -> dict[str, PatchMean]:
    """layer -> its :class:`PatchMean`, one shared by the layers whose patches are equal; the
    layers with a bias only (the others have no bias to correct: their means are never read)."""
    shared: dict[tuple, PatchMean] = {}
    return {
        t.layer: shared.setdefault(t.input_key(), PatchMean(t.geom)) for t in tasks if t.has_bias
    }


def _distinct_items(table: dict) -> list[tuple[str, object]]:
    """The first ``(key, value)`` of each distinct value object (shared ones once)."""
    seen: dict[int, tuple] = {}
    for k, v in table.items():
        seen.setdefault(id(v), (k, v))
    return list(seen.values())


def distinct_values(table: dict) -> list:
    """The distinct value objects of ``table`` (shared ones once), in first-key order."""
    return [v for _, v in _distinct_items(table)]


class WeightTuner:
    """The calibration hook (module docstring). ``weight_qp``: the weight slots' qparams."""

    def __init__(self, sim, config: Config, weight_qp: dict[str, QParam], plan):
        self.sim, self.config, self.weight_qp, self.plan = sim, config, weight_qp, plan
        self.tasks = layer_tasks(sim)
        #: weight slot -> tuned float weight; layer -> corrected float bias
        self.weights: dict[str, np.ndarray] = {}
        self.biases: dict[str, np.ndarray] = {}
        self.stats = {"tune_s": 0.0, "gptq": 0, "nearest": 0, "bias_corrected": 0}
        #: ``Config.bias_correction``: layer -> mean patch of its fp32 input
        self.fp32_means: dict[str, PatchMean] = {}
        #: ``BiasCorrection.holdout``: layer -> its fp32 output on the held-out rows
        self.held_fp32: dict[str, np.ndarray | None] = {}
        #: layer -> the activation that alone reads its output (the gate's error after it)
        gated = config.bias_holdout
        self.followers = (
            {m.layer: follower_activation(sim.graph, m) for m in sim.matches} if gated else {}
        )
        self.dropped: list[str] = []
        #: layer -> the gate's relative held-out error without / with its correction
        self.gate_errors: dict[str, list] = {}

    def fp32_slots(self) -> list[str]:
        """The activation slots whose fp32 values :meth:`observe_fp32` needs: those read by a
        layer with a bias to correct (none unless ``Config.bias_correction``)."""
        if not self.config.corrects_bias:
            return []
        return [sid for sid, tasks in self.tasks.items() if any(t.has_bias for t in tasks)]

    def fp32_tables(self) -> dict[str, dict[str, PatchMean]]:
        """Slot of :meth:`fp32_slots` -> layer -> an empty mean patch of its fp32 input
        (shared by the layers whose patches are equal), to fill and give :meth:`use_fp32`."""
        return {sid: patch_mean_table(self.tasks[sid]) for sid in self.fp32_slots()}

    def held_sinks(self) -> dict[str, HeldRows]:
        """Slot -> an empty sink of the fp32 held-out rows (none without the gate)."""
        gated = self.config.bias_holdout
        return {sid: self._held_rows(sid) for sid in self.fp32_slots()} if gated else {}

    def observe_fp32(self, outputs, held=()) -> None:
        """Feed the fp32 model's values of :meth:`fp32_slots` (one list per sample, in that
        order) into the layers' fp32 mean patches; those of the ``held`` samples (same form)
        give the layers' fp32 outputs on the held-out rows (:mod:`autoq.accuracy.bias_gate`)."""
        t0 = time.perf_counter()
        tables, sinks = self.fp32_tables(), self.held_sinks()
        for outs in outputs:
            for table, x in zip(tables.values(), outs, strict=True):
                for m in distinct_values(table):
                    m.update(x)
        for outs in held:
            for sink, x in zip(sinks.values(), outs, strict=True):
                sink.update(x)
        self.use_fp32(tables, sinks)
        self.stats["fp32_pass_s"] = time.perf_counter() - t0

    def use_fp32(self, tables: dict[str, dict[str, PatchMean]], sinks: dict[str, HeldRows]):
        """Take the filled :meth:`fp32_tables` and :meth:`held_sinks`."""
        for table in tables.values():
            self.fp32_means.update(table)
        for sid, sink in sinks.items():
            for t in self.tasks[sid]:
                rows = sink.rows(t.layer)
                if t.has_bias and rows is not None:
                    b = self.sim.plan.biases[t.layer][0]
                    self.held_fp32[t.layer] = layer_output(t.flat(t.weight), rows, b)

    def _held_rows(self, sid: str, qp: QParam | None = None) -> HeldRows:
        return HeldRows({t.layer: t.geom for t in self.tasks[sid]}, qp)

    def step(
        self, heads: list[str], act_qp: dict[str, QParam], runners: list, held: list = ()
    ) -> None:
        """Tune the layers reading any of ``heads`` (their qparams in ``act_qp``) before
        the segment starting at them runs on ``runners`` (and on the ``held`` runners of the
        held-out samples, which only the bias-correction gate reads)."""
        tasks = [(sid, self.tasks[sid]) for sid in heads if sid in self.tasks]
        if not tasks:
            return
        t0 = time.perf_counter()
        updates: dict[int, np.ndarray] = {}
        with single_threaded_blas():
            for sid, group in tasks:
                empirical = self.config.corrects_bias and bool(self.fp32_means)
                products = self._product_layers(sid, group, sum(r.n for r in runners))
                sinks = self._sinks(group, act_qp[sid], empirical, products)
                shards = [r.feed(sid, *sinks) for r in runners]
                merged = shards[0].resolve()
                for other in shards[1:]:
                    merged.merge(other)
                rows = self._held_rows(sid, act_qp[sid])
                for r in held if empirical and self.config.bias_holdout else ():
                    rows = r.feed(sid, rows).resolve()  # (a remote shard returns a copy)
                for task in group:
                    updates.update(self._tune(task, merged.hessians[task.layer], merged, rows))
        for r in [*runners, *held]:
            r.update_static(updates)
        self.stats["tune_s"] += time.perf_counter() - t0

    def _product_layers(self, sid: str, group: list[LayerTask], samples: int) -> frozenset[str]:
        """The layers of ``group`` whose tuning may read ``H`` itself: GPTQ, unless the slot's static shape bounds the rows below its minimum
        (:data:`MIN_ROWS_PER_COLUMN` per column: such a layer is rounded to nearest, e.g.
        ResNet-50's last 3x3 convs, 3136 rows of 2304 columns, whose products were the
        largest part of weight tuning). The others' Hessians sum only their rows."""
        cfg = self.config
        shape = shape_of(self.sim.plan.tensors[sid]) if sid in self.sim.plan.tensors else None
        out = set()
        for t in group:
            bound = t.rows_bound(shape, samples)
            k = t.flat(t.weight).shape[2]
            gptq_may = cfg.weight_rounding == "gptq" and (
                bound is None or bound >= MIN_ROWS_PER_COLUMN * k
            )
            if gptq_may:
                out.add(t.layer)
        return frozenset(out)

    @staticmethod
    def _sinks(group: list[LayerTask], qp: QParam, empirical: bool, products) -> tuple:
        """The statistics a shard feeds for ``group``: two (the second fed from another
        thread and merged, :meth:`autoq.calibration.shard_runner.ShardRunner.feed`) when their sums are
        exact; one with the mean patches of the empirical correction (float sums in sample
        order)."""
        sinks = [InputStats(group, qp, empirical, products) for _ in range(1 + (not empirical))]
        return tuple(sinks)

    def _tune(
        self, task: LayerTask, h: CodeHessian, stats: InputStats, held: HeldRows
    ) -> dict[int, np.ndarray]:
        cfg, spec = self.config, self.sim.plan.specs[task.weight_slot]
        qmin, qmax = spec.qrange
        qp = self.weight_qp[task.weight_slot]
        wf = task.flat(task.weight).astype(np.float64)
        g, o, k = wf.shape
        out: dict[int, np.ndarray] = {}
        scale = np.broadcast_to(qp.scale, (g * o,)).reshape(g, o)
        zp = np.broadcast_to(qp.zero_point, (g * o,)).reshape(g, o)
        rounded = cfg.weight_rounding == "gptq" and h.rows >= MIN_ROWS_PER_COLUMN * k
        if rounded:
            q = gptq(wf, h.matrix(), scale, zp, qmin, qmax).q
        else:
            q = rtn(wf, scale, zp, qmin, qmax)
        self.stats["gptq" if rounded else "nearest"] += 1
        wq = (q - zp[..., None]).astype(np.float32) * scale[..., None]  # P.dequantize's math
        if rounded:
            self.weights[task.weight_slot] = task.unflat(wq)
            out[self.plan.value_keys[task.weight_slot]] = self.weights[task.weight_slot]
        if task.has_bias and task.layer in stats.means:  # to the fp32 model's mean output
            b = self.sim.plan.biases[task.layer][0]
            m_fp, m_q = self.fp32_means[task.layer].mean(), stats.input_mean(task.layer)
            shift = np.einsum("gok,gk->go", wf, m_fp) - np.einsum("gok,gk->go", wq, m_q)
            if not self._gate(task, wq, b, shift.reshape(-1), held):
                return out
            self.biases[task.layer] = (b + shift.reshape(-1)).astype(np.float32)
            out[self.plan.value_keys[f"{task.layer}.bias"]] = self.biases[task.layer]
            self.stats["bias_corrected"] += 1
        return out

    def _gate(self, task: LayerTask, wq, b, shift, held: HeldRows) -> bool:
        """Whether ``task``'s empirical correction ``shift`` is kept (always without
        ``BiasCorrection.holdout``; else :func:`autoq.accuracy.bias_gate.decide` on ``held``)."""
        if not self.config.bias_holdout:
            return True
        rows = held.rows(task.layer)
        y_q = None if rows is None else layer_output(wq, rows, b)
        d = decide(self.held_fp32.get(task.layer), y_q, shift, self.followers.get(task.layer))
        key = "bias_kept" if d.kept else "bias_unmeasured" if not d.rows else "bias_dropped"
        self.stats[key] = self.stats.get(key, 0) + 1
        if not d.kept:
            self.dropped.append(task.layer)
        self.gate_errors[task.layer] = [
            None if np.isnan(v) else float(f"{v:.6g}") for v in (d.error, d.corrected)
        ]
        return d.kept

    def values(self, qparams: dict[str, QParam]) -> dict[str, np.ndarray]:
        """The integers to realize (``QParams.values``) for the final ``qparams``."""
        out = {}
        for sid, w in self.weights.items():
            qp = qparams[sid]
            out[sid] = P.quantize(w, qp.scale, qp.zero_point, qp.dtype, qp.axis)
        for layer, b in self.biases.items():
            _, x_sid, w_sid = self.sim.plan.biases[layer]
            out[f"{layer}.bias"] = P.quantize_bias(
                b, qparams[x_sid].scale, qparams[w_sid].scale
            ).values
        return out

    def summary(self) -> dict:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.stats.items()}
        if self.config.bias_holdout:
            out["bias_gate_dropped"] = list(self.dropped)
            out["bias_gate_errors"] = dict(self.gate_errors)
        return out
