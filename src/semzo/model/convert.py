"""``semzo convert gguf IN.gguf OUTDIR``: a GGUF file as a Hugging Face model folder.

The folder holds ``config.json``, ``model.safetensors`` (float32, or the ``dtype`` asked),
``generation_config.json`` (when the file names bos/eos ids), ``tokenizer.json`` (built with
the ``tokenizers`` library, :mod:`semzo.model.gguf_tokenizer`), ``tokenizer_config.json`` (chat
template and special tokens) and ``semzo_convert.json`` (source file, its SHA-256, dtype: the
stamp ``make setup`` compares to skip a second conversion).

Everything is validated before anything is written; the folder is written under a temporary
name next to ``OUTDIR`` and renamed into place at the end, so an error leaves nothing behind.
Tensors are dequantized and written one at a time (memory does not grow with the model).
Runs on one process (no MPI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np

from semzo.model.gguf import GGUFModel
from semzo.model.gguf_tokenizer import build_tokenizer
from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
STAMP = "semzo_convert.json"


def to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN kept quiet."""
    n = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    r = ((n.astype(np.uint64) + 0x7FFF + ((n >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((n >> 16) | 0x40).astype(np.uint16), r)


def _cast(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(a.astype(np.float16))
    return to_bfloat16_bits(a)


def write_safetensors_streamed(path: Path, entries: list[tuple[str, tuple[int, ...]]],
                               produce, dtype: str, metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor.

    ``entries``: ``(name, shape)`` in file order; ``produce(name)`` returns that float32 array
    (called once per name, in order); every tensor is stored as ``dtype`` (``DTYPES``).
    """
    item = 4 if dtype == "float32" else 2
    header: dict = {"__metadata__": metadata}
    off = 0
    for name, shape in entries:
        n = int(np.prod(shape, dtype=np.int64)) * item
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in entries:
            arr = _cast(produce(name), dtype)
            if arr.shape != tuple(shape):  # pragma: no cover - plan() checked the shapes
                raise RuntimeError(f"{name}: shape {arr.shape} != {shape}")
            f.write(arr.tobytes())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(src: str | Path, outdir: str | Path, *, dtype: str = "float32",
                 force: bool = False) -> dict:
    """Convert ``src`` (GGUF) into the Hugging Face folder ``outdir``; returns a summary dict
    (``tensors``, ``parameters``, ``seconds``, ``types``: tensor count per GGUF type).

    ``force``: replace an existing ``outdir`` (only after the new folder is complete).
    Raises :class:`SemzoError` (one line naming the file) on any bad input; nothing is
    written then.
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise SemzoError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    src, out = Path(src), Path(outdir)
    if out.exists() and not force:
        raise SemzoError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise SemzoError(f"{out}: exists and is not a folder")
    g = GGUFModel(src)
    cfg = g.hf_config()
    plan = g.plan(cfg)
    tok, tok_cfg = build_tokenizer(g, cfg)
    cfg["torch_dtype"] = dtype
    parent = out.resolve().parent
    if not parent.is_dir():
        raise SemzoError(f"{out}: parent folder {parent} does not exist")
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        by_hf = {hf: gname for hf, gname, _ in plan}
        write_safetensors_streamed(
            tmp / "model.safetensors", [(hf, shape) for hf, _, shape in plan],
            lambda hf: g.hf_tensor(by_hf[hf], cfg), dtype, {"format": "pt"})
        _write_json(tmp / "config.json", cfg)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if cfg.get(k) is not None}
        if gen:
            _write_json(tmp / "generation_config.json", gen)
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tok_cfg)
        types: dict[str, int] = {}
        for t in g.tensors.values():
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        summary = {"source": str(src.resolve()), "sha256": sha256_file(src), "dtype": dtype,
                   "tensors": len(plan), "types": types,
                   "parameters": int(sum(np.prod(s, dtype=np.int64) for _, _, s in plan))}
        _write_json(tmp / STAMP, summary)
        if out.exists():
            old = parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["seconds"] = time.perf_counter() - t0
    log.info("converted %s -> %s: %d tensors, %d parameters, %.1f s", src, out,
             summary["tensors"], summary["parameters"], summary["seconds"])
    return summary


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
