"""Write a model as a Hugging Face folder that ``transformers.AutoModel.from_pretrained`` loads.

Files: ``config.json`` (the source config, dtype updated), ``model.safetensors`` (every tensor
of the checkpoint under its original name, plus non-float buffers; bit-identical to the model's
current arrays), tokenizer files copied from ``tokenizer_folder`` (and the sentence-transformers
files, so ``SentenceTransformer(outdir)`` works too), and, when the model has a classification
head, ``semzo_head.safetensors`` (``classifier.weight``/``classifier.bias``; :func:`load_model`
restores it). LoRA deltas are merged into their base weights (``W + scale * B @ A``), so the
exported model computes what the adapted model computes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from semzo.model.base import TransformerBase
from semzo.model.loader import HEAD_FILE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json",
                   "modules.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")
TOKENIZER_DIRS = ("1_Pooling", "2_Normalize")


def _host(a) -> np.ndarray:
    return np.ascontiguousarray(a.get() if hasattr(a, "get") else a)


def merged_weights(model: TransformerBase) -> dict[str, np.ndarray]:
    """Host copies of the checkpoint tensors with LoRA deltas merged (no adapters, no head)."""
    added = {s.a for s in model.lora.values()} | {s.b for s in model.lora.values()}
    added |= {"classifier.weight", "classifier.bias"}
    out = {n: _host(a) for n, a in model.params.items() if n not in added}
    for module, spec in model.lora.items():
        a = _host(model.params[spec.a]).astype(np.float64)
        b = _host(model.params[spec.b]).astype(np.float64)
        delta = spec.scale * (b @ a)                      # (out, in)
        name = f"{module}.weight"
        w = out[name]
        if model.layout == "in_out":
            delta = delta.T
        out[name] = (w.astype(np.float64) + delta).astype(w.dtype)
    return out


def export_hf(model: TransformerBase, outdir: str | Path,
              tokenizer_folder: str | Path | None = None,
              label_names: list[str] | None = None) -> Path:
    """Write ``model`` to ``outdir`` as a Hugging Face folder; returns the folder.

    ``tokenizer_folder`` defaults to the folder the model was loaded from. ``label_names``
    (one per class of the head) go to config.json as ``id2label`` / ``label2id`` and to the
    head file's metadata as a JSON list.
    """
    from safetensors.numpy import save_file
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = merged_weights(model)
    tensors.update({n: np.ascontiguousarray(b) for n, b in model.buffers.items()})
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")

    cfg = dict(model.config.raw)
    dname = str(model.dtype)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "torch_dtype":
            cfg[key] = dname
    labels = None
    if model.head is not None and label_names is not None:
        labels = [str(x) for x in label_names]
        if len(labels) != model.head.n_classes:
            raise ValueError(f"{len(labels)} label names for a head of "
                             f"{model.head.n_classes} classes")
        cfg["id2label"] = {str(i): n for i, n in enumerate(labels)}
        cfg["label2id"] = {n: i for i, n in enumerate(labels)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")

    if model.head is not None:
        head = {"classifier.weight": _host(model.params["classifier.weight"]),
                "classifier.bias": _host(model.params["classifier.bias"])}
        meta = {"format": "semzo", "n_classes": str(model.head.n_classes),
                "normalize": "true" if model.head.normalize else "false", "pooling": "mean"}
        if labels is not None:
            meta["label_names"] = json.dumps(labels)
        save_file(head, str(out / HEAD_FILE), metadata=meta)

    src = Path(tokenizer_folder) if tokenizer_folder is not None else model.source
    if src is not None and src.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        for name in TOKENIZER_DIRS:
            if (src / name).is_dir():
                shutil.copytree(src / name, out / name, dirs_exist_ok=True)
    return out
