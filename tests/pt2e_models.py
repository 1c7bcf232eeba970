"""Tiny torch models quantized with torchao's PT2E flow, shared by tests/test_import_pt2e.py,
scripts/probe_pt2e.py and benchmarks/import_pt2e_tflite.py (torch, torchao and scikit-image
are imported by the callers first: this module needs them).

``ResNetStyle``: conv-bn-relu stem, maxpool, two basic blocks with a residual add, the second
with a strided 1x1 projection, adaptive average pool, linear. ``MobileNetStyle``: hardswish
stem, inverted residuals with depthwise 3x3 and ReLU6, one with hardswish and a
squeeze-excitation sigmoid multiply, 1x1 head, pool, linear. Batch norms get random statistics
(seeded) so that folding them matters. Quantizers: ``X86InductorQuantizer`` with its default
config (uint8 asymmetric activations, int8 per-channel symmetric weights) and the XNNPACK
quantizer torchao keeps for its tests (int8 asymmetric activations, int8 per-channel weights
in [-127, 127]).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

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
