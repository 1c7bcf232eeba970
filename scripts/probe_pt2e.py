"""Probe torchao's PT2E flow: what the exported graph holds, and how torch's reference rounds.

    .venv/bin/python scripts/probe_pt2e.py --graphs out/       # compact graph of each model
    .venv/bin/python scripts/probe_pt2e.py                     # per-layer numerics table

Needs ``torch``, ``torchao`` (0.18.0 with torch 2.13) and ``scikit-image`` (real images).
Not used by autoq or its tests: it records the facts the PT2E importer is designed on.

Models: ``ResNetStyle`` (conv-bn-relu stem, maxpool, two basic blocks with a residual add,
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
from pathlib import Path

import numpy as np
import torch
from torch import nn

from autoq import primitives as P

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNetStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.l1, self.l2 = Block(16, 16, 1), Block(16, 32, 2)
        self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x):
        x = self.l2(self.l1(self.pool(self.stem(x))))
        return self.fc(torch.flatten(self.gap(x), 1))


class SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.f1, self.f2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.f2(torch.relu(self.f1(self.gap(x)))))


class InvRes(nn.Module):
    def __init__(self, cin, cout, expand, stride, act, se):
        super().__init__()
        h = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, h, 1, bias=False), nn.BatchNorm2d(h), act())
        self.dw = nn.Sequential(
            nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), act()
        )
        self.se = SE(h) if se else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(h, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.res = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.res else y


class MobileNetStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()
        )
        self.b1 = InvRes(16, 16, 2, 1, nn.ReLU6, False)
        self.b2 = InvRes(16, 24, 3, 2, nn.ReLU6, False)
        self.b3 = InvRes(24, 24, 3, 1, nn.Hardswish, True)
        self.head = nn.Sequential(
            nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64), nn.Hardswish()
        )
        self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(64, 10)

    def forward(self, x):
        x = self.head(self.b3(self.b2(self.b1(self.stem(x)))))
        return self.fc(torch.flatten(self.gap(x), 1))


MODELS = {"resnet": ResNetStyle, "mobilenet": MobileNetStyle}


def make_model(name: str, seed: int = 0) -> nn.Module:
    """A seeded model in eval mode whose batch norms hold non-trivial statistics."""
    torch.manual_seed(seed)
    m = MODELS[name]()
    g = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            n = mod.num_features
            mod.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            mod.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.5)
            mod.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            mod.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    return m.eval()


def images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    """``n`` random crops of skimage images, ImageNet-normalized, float32 NCHW."""
    import skimage.data as d

    rng = np.random.default_rng(seed)
    srcs = [d.astronaut(), d.coffee(), d.chelsea(), d.rocket()]
    out = []
    for i in range(n):
        img = srcs[i % len(srcs)]
        h, w = img.shape[:2]
        c = int(rng.integers(64, min(h, w)))
        y0, x0 = int(rng.integers(0, h - c + 1)), int(rng.integers(0, w - c + 1))
        idx = (np.arange(size) * c / size).astype(int)
        crop = img[y0 : y0 + c, x0 : x0 + c][idx][:, idx].astype(np.float32) / 255.0
        out.append(((crop - MEAN) / STD).transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


def quantizer(kind: str):
    if kind == "x86":
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

        q = xiq.X86InductorQuantizer()
        return q.set_global(xiq.get_default_x86_inductor_quantization_config())
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))


def pt2e(model: nn.Module, kind: str, calib: np.ndarray) -> torch.fx.GraphModule:
    """prepare_pt2e -> calibrate on ``calib`` (batch 1) -> convert_pt2e (fold_quantize)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(model, (torch.from_numpy(calib[:1]),)).module()
    prepared = prepare_pt2e(exported, quantizer(kind))
    with torch.no_grad():
        for i in range(len(calib)):
            prepared(torch.from_numpy(calib[i : i + 1]))
    return convert_pt2e(prepared)


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
