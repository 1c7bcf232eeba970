"""Probe torchao's PT2E flow: what the exported graph holds, and how torch's reference rounds.

    .venv/bin/python scripts/probe_pt2e.py --graphs out/       # compact graph of each model
    .venv/bin/python scripts/probe_pt2e.py                     # per-layer numerics table

Needs ``torch``, ``torchao`` (0.18.0 with torch 2.13) and ``scikit-image`` (real images).
Not used by autoq or its tests: it records the facts the PT2E importer is designed on.

Models (tests/pt2e_models.py): ``ResNetStyle`` (conv-bn-relu stem, maxpool, two basic blocks with a residual add,
the second with a strided 1x1 projection, adaptive average pool, linear) and
``MobileNetStyle`` (hardswish stem, inverted residuals with depthwise 3x3 and ReLU6, one
with hardswish and a squeeze-excitation sigmoid multiply, 1x1 head, pool, linear). Batch
norms get random statistics (seeded) so that folding them matters. Quantizers:
``X86InductorQuantizer`` with ``get_default_x86_inductor_quantization_config()`` (uint8
asymmetric activations, int8 per-channel symmetric weights) and the XNNPACK quantizer
torchao keeps for its tests (``torchao.testing.pt2e._xnnpack_quantizer``, int8 asymmetric
activations, int8 per-channel weights in [-127, 127]).

Numerics: for every quantized conv/linear whose output is quantized (through relu /
hardtanh), the exact integer accumulator of the layer's own int8 input and weights is
requantized with each autoq rounding mode (int32 bias = round(b / (sx * sw))) and compared
with the int8 tensor torch's reference produced; ``torch_formula`` applies torch's own
float formula to the exact accumulator (float32 bias added after scaling, then
``* float32(1 / sy)``) to show where the differences come from.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pt2e_models import MODELS, images, make_model, pt2e

from autoq import primitives as P


def _short(a) -> str:
    if isinstance(a, torch.fx.Node):
        return "%" + a.name
    if isinstance(a, float):
        return f"{a:.6g}"
    if isinstance(a, list | tuple):
        return "[" + ",".join(_short(x) for x in a) + "]"
    return str(a).replace("torch.", "")


def compact_graph(ep) -> str:
    """One line per node of an ExportedProgram; lifted tensors with kind, shape, dtype."""
    tensors = {**ep.state_dict, **(ep.constants or {})}
    kinds = {s.arg.name: (s.kind.name, s.target) for s in ep.graph_signature.input_specs}
    lines = []
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            kind, target = kinds[n.name]
            t = tensors.get(target)
            if t is None:
                lines.append(f"  {n.name}: {kind}")
            elif n.users:
                dt = str(t.dtype).replace("torch.", "")
                lines.append(f"  {n.name}: {kind} {tuple(t.shape)} {dt}")
        elif n.op == "output":
            lines.append(f"  return {_short(n.args[0])}")
        else:
            tgt = str(n.target).replace("quantized_decomposed.", "qd.").replace("aten.", "")
            lines.append(f"  %{n.name} = {tgt}({', '.join(_short(a) for a in n.args)})")
    return "\n".join(lines)


# ---------------------------------------------------------------- per-layer numerics

_QD = torch.ops.quantized_decomposed
_ATEN = torch.ops.aten
ACTS = (_ATEN.relu.default, _ATEN.hardtanh.default)
MODES = ("float", "half_even", "half_away", "half_up", "tflite", "torch_formula")


def record(gm, x) -> dict:
    """Every node's value when ``gm`` runs on ``x``."""

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            vals[n] = super().run_node(n)
            return vals[n]

    vals = {}
    with torch.no_grad():
        Rec(gm).run(x)
    return vals


def quantized_layers(gm) -> list:
    """(conv/linear node, [relu/hardtanh], quantize node) with int8 input and weight."""
    out = []
    for n in gm.graph.nodes:
        if n.target not in (_ATEN.conv2d.default, _ATEN.linear.default):
            continue
        x, w = n.args[0], n.args[1]
        if x.target != _QD.dequantize_per_tensor.default:
            continue
        if w.target != _QD.dequantize_per_channel.default:
            continue
        chain, cur = [], n
        while len(cur.users) == 1:
            (u,) = cur.users
            if u.target in ACTS:
                chain.append(u)
                cur = u
                continue
            if u.target == _QD.quantize_per_tensor.default:
                out.append((n, chain, u))
            break
    return out


def accumulate(xq, zx, wq, n) -> np.ndarray:
    """The exact integer accumulator (torch in float64: exact for these sizes)."""
    xi = torch.from_numpy((xq.astype(np.int64) - zx).astype(np.float64))
    wi = torch.from_numpy(wq.astype(np.float64))
    if n.target == _ATEN.linear.default:
        return torch.nn.functional.linear(xi, wi).numpy().round().astype(np.int64)
    a = [*n.args, None, None, None, None][:7]
    stride, pad, dil, groups = a[3] or [1, 1], a[4] or [0, 0], a[5] or [1, 1], a[6] or 1
    y = torch.nn.functional.conv2d(xi, wi, None, stride, pad, dil, groups)
    return y.numpy().round().astype(np.int64)


def _apply_chain(y, chain):
    for c in chain:
        y = np.maximum(y, 0) if c.target == _ATEN.relu.default else np.clip(y, c.args[1], c.args[2])
    return y


def _layer_modes(vals, n, chain, qn) -> dict[str, np.ndarray]:
    dqx, w = n.args[0], n.args[1]
    xq, sx, zx = vals[dqx.args[0]].numpy(), float(dqx.args[1]), int(dqx.args[2])
    wq = vals[w.args[0]].numpy()
    sw = vals[w.args[1]].detach().numpy().astype(np.float32)
    b = n.args[2]
    bias = (
        vals[b].detach().numpy().astype(np.float32)
        if b is not None
        else np.zeros(len(sw), np.float32)
    )
    sy, zy, qmin, qmax = float(qn.args[1]), int(qn.args[2]), qn.args[3], qn.args[4]
    dtype = str(qn.args[5]).replace("torch.", "")
    acc = accumulate(xq, zx, wq, n)
    shp = (1, -1) + (1,) * (acc.ndim - 2)
    acc_b = acc + P.quantize_bias(bias, sx, sw).values.astype(np.int64).reshape(shp)
    sacc = (np.float32(sx) * sw).astype(np.float32)
    # the activation as a clamp of the integer output (relu: zero point; hardtanh: its bounds)
    lo = np.float32(_apply_chain(np.float32(-1e30), chain))
    hi = np.float32(_apply_chain(np.float32(1e30), chain))
    lo_q = max(qmin, zy + int(np.rint(lo / sy))) if lo > -1e30 else qmin
    hi_q = min(qmax, zy + int(np.rint(hi / sy))) if hi < 1e30 else qmax
    out = {}
    for mode in MODES:
        if mode == "torch_formula":
            y = _apply_chain(acc.astype(np.float32) * sacc.reshape(shp) + bias.reshape(shp), chain)
            out[mode] = np.clip(np.rint(y * np.float32(1.0 / sy)) + zy, qmin, qmax)
        else:
            y = P.requantize(acc_b.astype(np.int32), sacc, 0, sy, zy, dtype, rounding=mode, axis=1)
            out[mode] = np.clip(y.astype(np.int64), lo_q, hi_q)
    return out


def layer_numerics(gm, xs: np.ndarray) -> dict[str, collections.Counter]:
    """Per rounding mode: elements, elements off by 1, off by more (vs torch's reference)."""
    stats = collections.defaultdict(collections.Counter)
    layers = quantized_layers(gm)
    for x in xs:
        vals = record(gm, torch.from_numpy(x[None]))
        for n, chain, qn in layers:
            ref = vals[qn].numpy().astype(np.int64)
            for mode, got in _layer_modes(vals, n, chain, qn).items():
                d = np.abs(got - ref)
                stats[mode].update(n=d.size, off1=int((d == 1).sum()), more=int((d > 1).sum()))
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=Path, help="write <model>_<quantizer>.txt graphs here")
    ap.add_argument("--images", type=int, default=16, help="test images for the numerics")
    args = ap.parse_args(argv)
    calib, test = images(16, seed=0), images(args.images, seed=1)
    for name in MODELS:
        for kind in ("x86", "xnnpack"):
            gm = pt2e(make_model(name), kind, calib)
            if args.graphs:
                ep = torch.export.export(gm, (torch.from_numpy(test[:1]),))
                args.graphs.mkdir(parents=True, exist_ok=True)
                (args.graphs / f"{name}_{kind}.txt").write_text(compact_graph(ep) + "\n")
                continue
            stats = layer_numerics(gm, test)
            print(f"{name} {kind}: {len(quantized_layers(gm))} layers, {len(test)} images")
            for mode in MODES:
                c = stats[mode]
                pct = 100 * c["off1"] / c["n"]
                print(
                    f"  {mode:14s} {c['n']:8d} elements, {c['off1']:5d} off by 1 ({pct:.3f}%), {c['more']} more"
                )


if __name__ == "__main__":
    main()
