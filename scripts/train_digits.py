"""Train the small CNN that ``autoq demo`` quantizes, and write the files bundled with autoq.

Run once (the outputs are committed; the demo never trains):

    /work/venv/bin/python scripts/train_digits.py          # writes autoq/data/digits_cnn.onnx
                                                            #    and autoq/data/digits.npz

Needs ``torch`` and ``scikit-learn`` (not runtime dependencies of autoq).

Data: scikit-learn's ``load_digits`` (1797 grey 8x8 images of handwritten digits, pixel
values 0..16). They are the test set of the "Optical Recognition of Handwritten Digits" data
set of the UCI Machine Learning Repository (E. Alpaydin, C. Kaynak, Bogazici University,
1998), as shipped inside scikit-learn (BSD-3-Clause). The images are split once, stratified,
into 1197 training and 600 held-out test images; ``digits.npz`` stores all of them with
that split, so the demo calibrates on training images and measures accuracy on images the
network never saw.

Model (``DigitsCNN``): conv3x3(1->16)+BN+ReLU, conv3x3(16->32)+BN+ReLU, maxpool 2,
conv3x3(32->64)+BN+ReLU, a residual conv3x3(64->64)+BN added back, ReLU, global average
pool, linear(64->10). Exported with the TorchScript ONNX exporter (batch norms folded into
the convolutions by its constant folding), opset 17, input ``image`` (1, 1, 8, 8) float32,
output ``logits`` (1, 10), IR version 8 (ONNX Runtime accepts <= 13).

Preprocessing (also written into ``digits.npz`` as ``pixel_scale``/``mean``/``std``):
``x = (pixels / 16 - mean) / std``, as float32 of shape (N, 1, 8, 8).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "autoq" / "data"
SEED = 0
N_TEST = 600
MEAN, STD = 0.3, 0.4  # roughly the mean / std of pixels / 16 over the digits
IR_VERSION = 8
OPSET = 17


def split(labels: np.ndarray, n_test: int, seed: int) -> np.ndarray:
    """A boolean mask of training images: a stratified random split with ``n_test`` held out."""
    rng = np.random.default_rng(seed)
    train = np.ones(len(labels), bool)
    classes = np.unique(labels)
    # take the same fraction of every class, rounding so that the total is n_test
    per_class = {c: (labels == c).sum() for c in classes}
    quota = {c: round(int(n_test * per_class[c]) / len(labels)) for c in classes}
    diff = n_test - sum(quota.values())
    for c in list(classes)[: abs(diff)]:
        quota[c] += int(np.sign(diff))
    for c in classes:
        idx = np.flatnonzero(labels == c)
        train[rng.choice(idx, size=quota[c], replace=False)] = False
    return train


def preprocess(images: np.ndarray) -> np.ndarray:
    x = images.astype(np.float32) / 16.0
    return ((x - MEAN) / STD)[:, None].astype(np.float32)


def build_model():
    import torch
    from torch import nn

    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    class DigitsCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = block(1, 16)
            self.conv2 = block(16, 32)
            self.pool = nn.MaxPool2d(2)
            self.conv3 = block(32, 64)
            self.res = nn.Sequential(
                nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64)
            )
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            x = self.pool(self.conv2(self.conv1(x)))
            x = self.conv3(x)
            x = torch.relu(x + self.res(x))
            x = x.mean(dim=(2, 3))
            return self.fc(x)

    return DigitsCNN()


def train(model, x, y, epochs: int, seed: int):
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(xt), generator=gen)
        total = 0.0
        for i in range(0, len(xt), 64):
            b = order[i : i + 64]
            # light augmentation: shift by up to one pixel
            xb = torch.roll(
                xt[b], shifts=tuple(int(v) for v in rng.integers(-1, 2, size=2)), dims=(2, 3)
            )
            loss = torch.nn.functional.cross_entropy(model(xb), yt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(b)
        sched.step()
        if epoch % 10 == 9 or epoch == epochs - 1:
            print(f"epoch {epoch + 1:3d}  loss {total / len(xt):.4f}")
    return model.eval()


def accuracy(model, x, y) -> float:
    import torch

    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    return float((pred == y).mean())


def name_conv_weights(m) -> None:
    """The exporter names the batch-norm-folded convolution weights ``onnx::Conv_44``; name
    them after their module (``conv1.weight``, ``conv1.bias``) so that autoq's layer ids read
    ``conv1``, ``conv2``, ... (node ``/conv1/conv1.0/Conv`` belongs to module ``conv1``)."""
    renames = {}
    for node in m.graph.node:
        if node.op_type == "Conv":
            module = node.name.strip("/").split("/")[0]
            for inp, kind in zip(node.input[1:], ("weight", "bias"), strict=False):
                renames[inp] = f"{module}.{kind}"
    for t in m.graph.initializer:
        t.name = renames.get(t.name, t.name)
    for node in m.graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]


def export(model, path: Path) -> None:
    import onnx
    import torch

    tmp = path.with_suffix(".tmp.onnx")
    torch.onnx.export(
        model,
        (torch.zeros(1, 1, 8, 8),),
        str(tmp),
        input_names=["image"],
        output_names=["logits"],
        opset_version=OPSET,
        do_constant_folding=True,
        dynamo=False,
    )
    m = onnx.load(str(tmp))
    tmp.unlink()
    name_conv_weights(m)
    m.ir_version = IR_VERSION
    m.producer_name = "autoq scripts/train_digits.py"
    m.doc_string = "Small CNN on scikit-learn's 8x8 digits (UCI optdigits); autoq demo model"
    onnx.checker.check_model(m)
    onnx.save(m, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    digits = load_digits()
    images = digits.images.astype(np.uint8)  # (1797, 8, 8), 0..16
    labels = digits.target.astype(np.uint8)
    is_train = split(labels, N_TEST, SEED)
    x = preprocess(images)

    model = train(build_model(), x[is_train], labels[is_train], args.epochs, SEED)
    acc_train = accuracy(model, x[is_train], labels[is_train])
    acc_test = accuracy(model, x[~is_train], labels[~is_train])
    print(f"accuracy: train {acc_train:.4f}, held-out test {acc_test:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    export(model, args.out / "digits_cnn.onnx")
    np.savez_compressed(
        args.out / "digits.npz",
        images=images,
        labels=labels,
        train=is_train,
        pixel_scale=np.float32(1 / 16),
        mean=np.float32(MEAN),
        std=np.float32(STD),
    )
    import onnxruntime as ort

    sess = ort.InferenceSession(str(args.out / "digits_cnn.onnx"))
    test = x[~is_train]
    pred = np.array(
        [sess.run(None, {"image": test[i : i + 1]})[0].argmax() for i in range(len(test))]
    )
    print(f"ONNX Runtime held-out accuracy: {float((pred == labels[~is_train]).mean()):.4f}")
    for f in ("digits_cnn.onnx", "digits.npz"):
        print(f"wrote {args.out / f} ({(args.out / f).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
