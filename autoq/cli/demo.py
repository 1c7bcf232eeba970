"""``autoq demo``: quantize a small bundled CNN and compare it with fp32, offline.

The model (``data/digits_cnn.onnx``, 4 convolutions with a residual add, global average
pool, a dense layer; 61k weights) was trained once by ``scripts/train_digits.py`` on
scikit-learn's 8x8 handwritten digits. ``data/digits.npz`` holds the 1797 images (uint8,
0..16), their labels, the training/held-out split used in training (1197 / 600) and the
preprocessing constants. The demo

1. imports the ONNX file with :func:`autoq.frontends.from_onnx`,
2. calibrates on the first ``calib_samples`` training images (default 100),
3. realizes the int8 module and compiles fp32 and int8 for the same target,
4. evaluates both on the held-out images (images the network never saw in training),
5. prints fp32 vs int8 accuracy, weight bytes and batch-1 latency.

Data: the test set of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin, C. Kaynak, 1998), as distributed with scikit-learn (BSD-3-Clause) as
``sklearn.datasets.load_digits``; scikit-learn is not needed at run time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "DATA_FILE",
    "MODEL_FILE",
    "DemoResult",
    "Digits",
    "calibration_images",
    "evaluate",
    "latency_ms",
    "load_digits",
    "load_model",
    "run",
]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"  # autoq/data
MODEL_FILE = DATA_DIR / "digits_cnn.onnx"
DATA_FILE = DATA_DIR / "digits.npz"
INPUT = "image"


@dataclass(frozen=True)
class Digits:
    """The bundled digits, preprocessed: ``x`` (N, 1, 8, 8) float32, ``labels`` (N,),
    ``train`` (N,) bool (the training split; the rest is held out)."""

    x: np.ndarray
    labels: np.ndarray
    train: np.ndarray

    @property
    def train_x(self) -> np.ndarray:
        return self.x[self.train]

    @property
    def test_x(self) -> np.ndarray:
        return self.x[~self.train]

    @property
    def test_labels(self) -> np.ndarray:
        return self.labels[~self.train]


def load_digits() -> Digits:
    """The bundled digits with the model's preprocessing ``(pixels * scale - mean) / std``."""
    if not DATA_FILE.is_file():
        raise FileNotFoundError(
            f"the demo data {DATA_FILE} is missing: the package was installed without its "
            "data files (reinstall autoq, or run scripts/train_digits.py)"
        )
    with np.load(DATA_FILE, allow_pickle=False) as d:
        images, labels, train = d["images"], d["labels"], d["train"]
        scale, mean, std = (np.float32(d[k]) for k in ("pixel_scale", "mean", "std"))
    x = ((images.astype(np.float32) * scale - mean) / std)[:, None].astype(np.float32)
    return Digits(x, labels.astype(np.int64), train.astype(bool))


def calibration_images(n: int = 100, digits: Digits | None = None) -> list[np.ndarray]:
    """The first ``n`` training images as samples of shape (1, 1, 8, 8)."""
    digits = digits or load_digits()
    xs = digits.train_x[:n]
    return [xs[i : i + 1] for i in range(len(xs))]


def load_model():
    """``(mod, params)`` of the bundled CNN, imported with :func:`autoq.frontends.from_onnx`.

    The file is already constant-folded (the exporter folded the batch norms), so ONNX
    Runtime is not needed: ``optimize=False``."""
    from autoq.frontends import from_onnx

    if not MODEL_FILE.is_file():
        raise FileNotFoundError(
            f"the demo model {MODEL_FILE} is missing: the package was installed without its "
            "data files (reinstall autoq, or run scripts/train_digits.py)"
        )
    return from_onnx(MODEL_FILE, optimize=False)


def evaluate(vm, x: np.ndarray) -> np.ndarray:
    """Predicted classes of ``vm`` (a VirtualMachine whose main takes one image) on ``x``."""
    import tvm

    f = vm["main"]
    return np.array(
        [int(f(tvm.runtime.tensor(x[i : i + 1])).numpy().argmax()) for i in range(len(x))]
    )


def latency_ms(vm, sample: np.ndarray, number: int = 50, repeat: int = 5) -> float:
    """Median over ``repeat`` runs of the mean time of ``number`` calls of main, in ms."""
    import tvm

    timer = vm.time_evaluator("main", tvm.cpu(), number=number, repeat=repeat)
    return float(timer(tvm.runtime.tensor(sample)).median * 1e3)


@dataclass
class DemoResult:
    calib_samples: int
    eval_samples: int
    accuracy_fp32: float
    accuracy_int8: float
    agreement: float  # fraction of images where int8 predicts the fp32 class
    bytes_fp32: dict[str, int]
    bytes_int8: dict[str, int]
    layers_int8: list[str]
    latency_fp32_ms: float | None = None
    latency_int8_ms: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def _compare(mod, params, qmod, target, test, latency: bool, seconds: dict):
    """Compile both models, evaluate them on ``test`` and (``latency``) time them."""
    import tvm
    from tvm import relax

    from autoq.build import compile as autoq_compile
    from autoq.build import weight_bytes

    test_x, test_y = test
    t = time.perf_counter()
    fmod = relax.transform.BindParams("main", params)(mod)
    dev = tvm.cpu()
    vm32 = relax.VirtualMachine(autoq_compile(fmod, target), dev)
    vm8 = relax.VirtualMachine(autoq_compile(qmod, target), dev)
    seconds["compile"] = time.perf_counter() - t
    t = time.perf_counter()
    p32, p8 = evaluate(vm32, test_x), evaluate(vm8, test_x)
    seconds["evaluate"] = time.perf_counter() - t
    acc32, acc8 = float(np.mean(p32 == test_y)), float(np.mean(p8 == test_y))
    lat32 = lat8 = None
    if latency:
        t = time.perf_counter()
        lat32, lat8 = latency_ms(vm32, test_x[:1]), latency_ms(vm8, test_x[:1])
        seconds["latency"] = time.perf_counter() - t
    agree = float(np.mean(p32 == p8))
    return acc32, acc8, agree, weight_bytes(fmod), weight_bytes(qmod), lat32, lat8


def _print_table(say, accuracy, sizes, latencies) -> None:
    from autoq.cli.summary import fmt_bytes

    acc32, acc8, agree, n = accuracy
    (b32, b8), (lat32, lat8) = sizes, latencies
    total32, total8 = sum(b32.values()), sum(b8.values())
    say("")
    say(f"{'':24}{'fp32':>14}{'int8':>14}")
    say(
        f"{'accuracy':24}{100 * acc32:>13.2f}%{100 * acc8:>13.2f}%   "
        f"({n} held-out images; int8 = fp32 prediction on {100 * agree:.1f}%)"
    )
    say(f"{'weights (bytes)':24}{total32:>14,}{total8:>14,}   ({total32 / total8:.2f}x smaller)")
    say(f"{'':24}int8 module: {fmt_bytes(b8)}")
    if lat32 is not None:
        say(
            f"{'latency (ms, batch 1)':24}{lat32:>14.3f}{lat8:>14.3f}   "
            f"({lat32 / lat8:.1f}x; median of 5 x 50 runs)"
        )


def run(
    calib_samples: int = 100,
    eval_samples: int | None = None,
    *,
    method: str | None = None,
    target=None,
    latency: bool = True,
    progress: bool | None = None,
    echo: Callable[[str], None] | None = print,
) -> DemoResult:
    """The demo (see the module docstring). ``eval_samples``: the first N held-out images
    (default all 600). ``method``: activation calibrator (default: ``Config()``'s).
    ``target``: compile target for both models (default: this CPU). ``echo``: where lines
    go (None: silent)."""
    import tvm

    import autoq
    from autoq.cli.summary import target_str
    from autoq.ir.target import default_target

    say = echo or (lambda _s: None)
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    target = target or default_target()
    if isinstance(target, dict):
        target = tvm.target.Target(target)

    say("autoq demo: int8 post-training quantization of a small CNN on 8x8 handwritten digits")
    say(
        "  data: UCI optdigits (Alpaydin & Kaynak 1998) via scikit-learn's load_digits; "
        "model: scripts/train_digits.py"
    )
    t = time.perf_counter()
    digits = load_digits()
    mod, params = load_model()
    seconds["import"] = time.perf_counter() - t
    n_weights = sum(int(np.prod(a.shape)) for a in params.values())
    calib = calibration_images(calib_samples, digits)
    test_x, test_y = digits.test_x, digits.test_labels
    if eval_samples is not None:
        test_x, test_y = test_x[:eval_samples], test_y[:eval_samples]
    say(f"  model: {MODEL_FILE.name}, {n_weights:,} weights, input {INPUT!r} (1, 1, 8, 8)")
    say(f"  target: {target_str(target)}")

    config = autoq.Config(activation=None if method is None else autoq.QuantSpec(calibrator=method))

    t = time.perf_counter()
    result = autoq.Quantizer(config, target=target, progress=progress).run(mod, params, calib)
    act = result.config.activation.calibrator
    cal_name = f"{getattr(act, 'name', act)}, recipe {result.recipe[0]}"
    qmod = result.module
    seconds["quantize"] = time.perf_counter() - t
    say(
        f"quantized with {len(calib)} training images ({cal_name}) in {seconds['quantize']:.1f} s; "
        f"int8 layers: {', '.join(result.int8_layers)}"
    )

    acc32, acc8, agree, b32, b8, lat32, lat8 = _compare(
        mod, params, qmod, target, (test_x, test_y), latency, seconds
    )
    _print_table(say, (acc32, acc8, agree, len(test_y)), (b32, b8), (lat32, lat8))
    seconds["total"] = time.perf_counter() - t0
    say("")
    say("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    say("next: 'autoq quantize digits --out digits_int8' writes the .so, qparams and a report")
    return DemoResult(
        calib_samples=len(calib),
        eval_samples=len(test_y),
        accuracy_fp32=acc32,
        accuracy_int8=acc8,
        agreement=agree,
        bytes_fp32=b32,
        bytes_int8=b8,
        layers_int8=list(result.int8_layers),
        latency_fp32_ms=lat32,
        latency_int8_ms=lat8,
        seconds=seconds,
    )
