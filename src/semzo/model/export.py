"""Write a model as a Hugging Face folder that ``transformers.AutoModel.from_pretrained`` loads.

Files: ``config.json`` (the source config, dtype updated), ``model.safetensors`` (every tensor
of the checkpoint under its original name, plus non-float buffers; bit-identical to the model's
current arrays: a bfloat16 model's tensors are written as ``BF16``, its bits unchanged), tokenizer files copied from ``tokenizer_folder`` (and the sentence-transformers
files, so ``SentenceTransformer(outdir)`` works too), and, when the model has a classification
head, ``semzo_head.safetensors`` (``classifier.weight``/``classifier.bias``; :func:`load_model`
restores it; float32, the exact values of a float16 or bfloat16 head). LoRA deltas are merged into their base weights (``W + scale * B @ A``), so the
exported model computes what the adapted model computes (rounded once to the storage dtype:
bfloat16 from float32, to nearest even). Every file gets the mode the process umask gives a
new file (``0o666 & ~umask``; safetensors alone would create its files 0600).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from semzo.model.base import TransformerBase
from semzo.model.loader import HEAD_FILE
from semzo.model.storage import BF16, to_bits, to_float32

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json",
                   "modules.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")
TOKENIZER_DIRS = ("1_Pooling", "2_Normalize")


def _host(a) -> np.ndarray:
    return np.ascontiguousarray(a.get() if hasattr(a, "get") else a)


_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "uint16": "BF16",
          "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
          "bool": "BOOL"}


def save_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray],
                          metadata: dict[str, str]) -> None:
    """Write a safetensors file whose uint16 arrays are bfloat16 bits (dtype ``BF16``; NumPy
    has no bfloat16, so ``safetensors.numpy`` cannot write them). Other arrays keep their
    dtype; tensors sorted by name, as ``safetensors`` writes them."""
    header: dict = {"__metadata__": metadata}
    off, order = 0, sorted(tensors)
    for name in order:
        a = tensors[name]
        code = _CODES.get(a.dtype.name)
        if code is None:
            raise ValueError(f"{name}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": code, "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).astype(
                tensors[name].dtype.newbyteorder("<"), copy=False).tobytes())


def _umask_mode() -> int:
    """``0o666`` less the process umask: the mode ``open()`` gives a new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str],
                      bf16: bool = False) -> None:
    """Write ``path`` whole (``path.tmp``, then a rename) with the mode of the other files of
    the folder (``safetensors`` creates its files 0600, whatever the umask)."""

    tmp = path.with_name(path.name + ".tmp")
    if bf16:
        save_bf16_safetensors(tmp, tensors, metadata)
    else:
        save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, _umask_mode())
    os.replace(tmp, path)


def merged_weights(model: TransformerBase) -> dict[str, np.ndarray]:
    """Host copies of the checkpoint tensors with LoRA deltas merged (no adapters, no head)."""
    added = {s.a for s in model.lora.values()} | {s.b for s in model.lora.values()}
    added |= {"classifier.weight", "classifier.bias"}
    out = {n: _host(a) for n, a in model.params.items() if n not in added}
    for module, spec in model.lora.items():
        a = to_float32(_host(model.params[spec.a])).astype(np.float64)
        b = to_float32(_host(model.params[spec.b])).astype(np.float64)
        delta = spec.scale * (b @ a)                      # (out, in)
        name = f"{module}.weight"
        w = out[name]
        if model.layout == "in_out":
            delta = delta.T
        if w.dtype == BF16:
            out[name] = to_bits((to_float32(w).astype(np.float64) + delta).astype(np.float32))
        else:
            out[name] = (w.astype(np.float64) + delta).astype(w.dtype)
    return out


def _as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """A float tensor (float32, float16 or bfloat16 bits) in the storage ``dtype``: upcast
    exactly to float32, then rounded once to nearest even (float16, bfloat16)."""
    f = to_float32(a)
    if dtype == "float32":
        return np.ascontiguousarray(f, np.float32)
    if dtype == "float16":
        return f.astype(np.float16)
    return to_bits(f)


def export_hf(model: TransformerBase, outdir: str | Path,
              tokenizer_folder: str | Path | None = None,
              label_names: list[str] | None = None, dtype: str | None = None) -> Path:
    """Write ``model`` to ``outdir`` as a Hugging Face folder; returns the folder.

    ``tokenizer_folder`` defaults to the folder the model was loaded from. ``label_names``
    (one per class of the head) go to config.json as ``id2label`` / ``label2id`` and to the
    head file's metadata as a JSON list. ``dtype`` ("float32", "float16", "bfloat16"; None:
    the model's storage) is the weights' dtype in model.safetensors.
    """
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    dname = dtype or model.storage
    if dname not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unknown export dtype {dname!r}")
    tensors = merged_weights(model)
    if dname != model.storage:
        tensors = {n: _as_dtype(a, dname) if a.dtype in (np.float32, np.float16, BF16) else a
                   for n, a in tensors.items()}
    tensors.update({n: np.ascontiguousarray(b) for n, b in model.buffers.items()})
    _save_safetensors(tensors, out / "model.safetensors", {"format": "pt"},
                      bf16=dname == "bfloat16")

    cfg = dict(model.config.raw)
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
        head = {n: np.ascontiguousarray(to_float32(_host(model.params[n])))
                for n in ("classifier.weight", "classifier.bias")}
        meta = {"format": "semzo", "n_classes": str(model.head.n_classes),
                "normalize": "true" if model.head.normalize else "false", "pooling": "mean"}
        if labels is not None:
            meta["label_names"] = json.dumps(labels)
        _save_safetensors(head, out / HEAD_FILE, meta)

    src = Path(tokenizer_folder) if tokenizer_folder is not None else model.source
    if src is not None and src.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        for name in TOKENIZER_DIRS:
            if (src / name).is_dir():
                shutil.copytree(src / name, out / name, dirs_exist_ok=True,
                                copy_function=shutil.copyfile)     # new files: the umask
    return out
