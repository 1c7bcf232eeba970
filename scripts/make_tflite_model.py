"""Write the small full-integer int8 TFLite models that autoq's TFLite import is tested on.

Run once with TensorFlow (not a dependency of autoq or of its tests; the outputs are
committed, tests need only the files and ``ai-edge-litert``'s interpreter):

    python -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 ai-edge-litert==2.3.0 scikit-image
    /tmp/tfvenv/bin/python scripts/make_tflite_model.py       # writes tests/data/*.tflite, *.npz

Outputs (``tests/data``):

* ``tiny_cnn_int8.tflite``: input ``(1, 32, 32, 3)`` int8 (NHWC), output ``(1, 10)`` int8.
  conv3x3 s2 (3->16) + ReLU6, depthwise conv3x3 (16) + ReLU6, conv1x1 (16->16), residual
  ADD with the first conv's output, average pool 2x2, conv1x1 (16->32) + ReLU, mean over
  H, W, fully connected (32->10), no softmax. Per-channel int8 weights (symmetric), int32
  biases with scale ``input_scale * weight_scale``, asymmetric int8 activations.
* ``one_conv_int8.tflite``: one conv3x3 (3->8, stride 1, SAME) with bias and no activation,
  int8 in/out: the smallest model that isolates TFLite's per-channel requantization.
* ``tiny_cnn_int8_inputs.npz``: ``x`` (8, 32, 32, 3) int8 samples of real images
  (``skimage.data``) quantized with the model's input scale / zero point (TFLite's QUANTIZE
  rounding: half away from zero), and LiteRT's int8 outputs of both models on them as
  recorded when the files were written (``one_conv``: the first two samples), per op resolver: ``<model>_ref`` (reference kernels,
  ``BUILTIN_REF``: the TFLite spec, gemmlowp double rounding), ``<model>_builtin``
  (optimized kernels without delegates: ruy, whose second rounding breaks ties upward) and
  ``<model>_xnnpack`` (the interpreter's default, XNNPACK delegate: fp32 requantization).
  They differ from each other by 1 LSB in a fraction of a percent of the elements; tests
  should compare against the interpreter run live and name the resolver.

Why int8 input and output (``inference_input_type=tf.int8``) rather than float I/O with
QUANTIZE/DEQUANTIZE at the edges: the whole graph is then integer, so a bit-exact test
compares integers with integers and no float rounding at the boundary (TFLite's QUANTIZE
rounds half away from zero) gets in the way; the qparams of the input/output are in the
file for a caller that has float data.

Weights are deterministic (numpy seed) and not trained: the model only has to exercise the
int8 kernels on realistic activation ranges. The representative data set is 64 crops of
``skimage.data`` images (astronaut, coffee, chelsea, rocket, ...), scaled to [-1, 1].
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data"
SEED = 0
SIZE = 32
IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "cat", "immunohistochemistry")


def crops(n: int, seed: int) -> np.ndarray:
    """``n`` random square crops of skimage images, resized to SIZE, float32 NHWC in [-1, 1]."""
    import skimage.data

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        img = np.asarray(getattr(skimage.data, IMAGES[i % len(IMAGES)])())[..., :3]
        h, w = img.shape[:2]
        c = int(rng.integers(48, min(h, w)))
        y0, x0 = int(rng.integers(0, h - c + 1)), int(rng.integers(0, w - c + 1))
        idx = (np.arange(SIZE) * c / SIZE).astype(int)
        crop = img[y0 : y0 + c, x0 : x0 + c][idx][:, idx].astype(np.float32)
        out.append(crop / 127.5 - 1.0)
    return np.stack(out).astype(np.float32)


def he(rng, shape, fan_in):
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def tiny_cnn(tf, rng):
    """A tf.Module computing the tiny CNN with tf.nn ops (no Keras: stable conversion)."""
    w = {
        "c1": he(rng, (3, 3, 3, 16), 27),
        "b1": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "dw": he(rng, (3, 3, 16, 1), 9),
        "bdw": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "pw": he(rng, (1, 1, 16, 16), 16),
        "bpw": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "c3": he(rng, (1, 1, 16, 32), 16),
        "b3": (rng.standard_normal(32) * 0.1).astype(np.float32),
        "fc": he(rng, (32, 10), 32),
        "bfc": (rng.standard_normal(10) * 0.1).astype(np.float32),
    }

    class TinyCNN(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = {k: tf.constant(a) for k, a in w.items()}

        @tf.function(input_signature=[tf.TensorSpec((1, SIZE, SIZE, 3), tf.float32)])
        def __call__(self, x):
            v = self.v
            y = tf.nn.relu6(tf.nn.conv2d(x, v["c1"], 2, "SAME") + v["b1"])
            z = tf.nn.relu6(tf.nn.depthwise_conv2d(y, v["dw"], [1, 1, 1, 1], "SAME") + v["bdw"])
            z = tf.nn.conv2d(z, v["pw"], 1, "SAME") + v["bpw"]
            y = tf.add(y, z)
            y = tf.nn.avg_pool2d(y, 2, 2, "VALID")
            y = tf.nn.relu(tf.nn.conv2d(y, v["c3"], 1, "SAME") + v["b3"])
            y = tf.reduce_mean(y, axis=[1, 2])
            return tf.matmul(y, v["fc"]) + v["bfc"]

    return TinyCNN()


def one_conv(tf, rng):
    w = he(rng, (3, 3, 3, 8), 27)
    b = (rng.standard_normal(8) * 0.1).astype(np.float32)

    class OneConv(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec((1, SIZE, SIZE, 3), tf.float32)])
        def __call__(self, x):
            return tf.nn.conv2d(x, w, 1, "SAME") + b

    return OneConv()


def convert(tf, module, calib: np.ndarray) -> bytes:
    """Full-integer int8 conversion (int8 I/O) with ``calib`` as the representative data."""
    fn = module.__call__.get_concrete_function()
    conv = tf.lite.TFLiteConverter.from_concrete_functions([fn], module)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]

    def representative():
        for i in range(len(calib)):
            yield [calib[i : i + 1]]

    conv.representative_dataset = representative
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = tf.int8
    conv.inference_output_type = tf.int8
    return conv.convert()


RESOLVERS = {
    "ref": "BUILTIN_REF",
    "builtin": "BUILTIN_WITHOUT_DEFAULT_DELEGATES",
    "xnnpack": "AUTO",
}


def run_litert(path: Path, xs: np.ndarray, resolver: str = "ref") -> np.ndarray:
    """LiteRT's outputs for each int8 sample of ``xs`` (batch 1 each) with the op resolver
    ``resolver`` (a key of RESOLVERS)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kind = getattr(OpResolverType, RESOLVERS[resolver])
    interp = Interpreter(model_path=str(path), experimental_op_resolver_type=kind)
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    ys = []
    for x in xs:
        interp.set_tensor(inp["index"], x[None])
        interp.invoke()
        ys.append(interp.get_tensor(out["index"])[0].copy())
    return np.stack(ys)


def input_qparams(path: Path) -> tuple[float, int]:
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    scale, zp = interp.get_input_details()[0]["quantization"]
    return float(scale), int(zp)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    import tensorflow as tf

    tf.random.set_seed(SEED)
    rng = np.random.default_rng(SEED)
    calib = crops(64, seed=SEED)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, build in (("tiny_cnn", tiny_cnn), ("one_conv", one_conv)):
        path = args.out / f"{name}_int8.tflite"
        path.write_bytes(convert(tf, build(tf, rng), calib))
        paths[name] = path
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    samples = crops(8, seed=SEED + 1)
    scale, zp = input_qparams(paths["tiny_cnn"])
    assert input_qparams(paths["one_conv"]) == (scale, zp), "both models share the input range"
    # the input as TFLite's QUANTIZE would make it: round half away from zero, then clamp
    q = np.clip(np.sign(samples / scale) * np.floor(np.abs(samples / scale) + 0.5) + zp, -128, 127)
    x = q.astype(np.int8)
    npz = args.out / "tiny_cnn_int8_inputs.npz"
    # one_conv's outputs are large (32x32x8 per sample): record the first two samples only
    n_rec = {"tiny_cnn": len(x), "one_conv": 2}
    outputs = {
        f"{name}_{r}": run_litert(path, x[: n_rec[name]], r)
        for name, path in paths.items()
        for r in RESOLVERS
    }
    np.savez_compressed(
        npz, x=x, input_scale=np.float32(scale), input_zero_point=np.int32(zp), **outputs
    )
    print(f"wrote {npz} ({npz.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
