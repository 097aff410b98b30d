"""Read GGUF files (llama.cpp's format) as Hugging Face tensors and config, without torch.

The file is memory-mapped with ``gguf.GGUFReader``; nothing is dequantized until a tensor is
asked for, one at a time (:meth:`GGUFModel.hf_tensor`), so converting a model needs the parsed
metadata plus the temporaries of its largest tensor, not the memory of the model.

What is supported, and refused by name otherwise (:class:`SemzoError`, one line, exit 2):

- tensor types :data:`SUPPORTED_TYPES` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
  Q5_K, Q6_K), dequantized to float32 by ``gguf.quants.dequantize``; any other type, a
  truncated file, a file that is not GGUF or a big-endian GGUF is refused;
- architectures :data:`ARCHS`: ``llama`` (Llama 2/3 without ``rope_freqs``, SmolLM/SmolLM2,
  Mistral written as llama) -> ``LlamaForCausalLM``; ``qwen2`` -> ``Qwen2ForCausalLM`` (q/k/v
  biases). Every ``<arch>.*`` metadata key is either mapped onto the config or refused.

llama.cpp stores the rows of the llama q/k projections permuted for its rotary layout
(``convert_hf_to_gguf.py``: ``LlamaModel.permute``); :func:`unpermute_qk` undoes it, exactly
as transformers' ``LlamaTensorProcessor`` does. Qwen2 is written unpermuted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from semzo.runtime import SemzoError

GGUF_MAGIC = b"GGUF"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SemzoError("reading GGUF needs the package gguf (pip install gguf; make setup "
                         "installs it)") from None
    return gguf


SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K",
                   "Q5_K", "Q6_K")


@dataclass(frozen=True)
class Arch:
    """How one llama.cpp architecture maps onto a transformers class."""

    model_type: str
    hf_class: str
    permute_qk: bool   # llama.cpp permuted the q/k rows (llama's convert step)
    qkv_bias: bool     # q/k/v projections carry biases (Qwen2)


ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", permute_qk=True, qkv_bias=False),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", permute_qk=False, qkv_bias=True),
}

# per-block GGUF tensor -> Hugging Face module (model.layers.N.<module>)
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}

# <arch>.* metadata keys and the config field each one sets (None: read elsewhere)
_ARCH_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "rope.dimension_count": None,
    "attention.key_length": None,
    "attention.value_length": None,
    "rope.scaling.type": None,
    "rope.scaling.factor": None,
}
_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length",
                  "attention.head_count", "attention.layer_norm_rms_epsilon", "context_length")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (``convert_hf_to_gguf.py``), for tests and writers.

    ``w``: (n_head * head_dim, ...) in Hugging Face order -> the same shape in GGUF order.
    ``n_head``: the heads of this projection (KV heads for k).
    """
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF row order -> Hugging Face row order."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFModel:
    """A validated GGUF file: metadata, tensor table, Hugging Face names; lazy tensors.

    Opening checks the magic, the header, the endianness, that every tensor's bytes lie inside
    the file and that every tensor type is supported; :meth:`hf_config` and :meth:`plan`
    check the architecture, its metadata and the tensor names and shapes. Each failure is a
    :class:`SemzoError` naming the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_types()
        arch = self.value("general.architecture", None)
        if arch is None:
            raise self.error("no general.architecture key")
        if arch not in ARCHS:
            raise self.error(f"general.architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHS)})")
        self.arch_name: str = arch
        self.arch = ARCHS[arch]

    def error(self, msg: str) -> SemzoError:
        return SemzoError(f"{self.path}: {msg}")

    # ---- metadata -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default=...):
        """A scalar or string metadata value (``default`` when absent; absent and no default:
        error naming the key). Arrays: :meth:`array`."""
        f = self.reader.fields.get(key)
        if f is None:
            if default is ...:
                raise self.error(f"missing metadata key {key!r}")
            return default
        gv = _gguf().GGUFValueType
        if f.types[0] == gv.ARRAY:
            raise self.error(f"metadata key {key!r}: expected a scalar, found an array")
        if f.types[0] == gv.STRING:
            return self._text(f.parts[-1], key)
        return f.parts[-1][0].item()

    def array(self, key: str) -> list | None:
        """An array metadata value as a Python list (strings decoded), None when absent."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        gv = _gguf().GGUFValueType
        if f.types[0] != gv.ARRAY:
            raise self.error(f"metadata key {key!r}: expected an array")
        if len(f.types) > 1 and f.types[1] == gv.STRING:
            return [self._text(f.parts[i], key) for i in f.data]
        if not f.data:
            return []
        return np.concatenate([f.parts[i] for i in f.data]).tolist()

    def _text(self, part, key: str) -> str:
        try:
            return bytes(part).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"metadata key {key!r}: not UTF-8 ({exc.reason})") from None

    def _int(self, key: str, default=...) -> int:
        v = self.value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v or v < 0:
            raise self.error(f"metadata key {key!r}: expected a non-negative integer, got {v!r}")
        return int(v)

    # ---- config ---------------------------------------------------------------------------
    def hf_config(self) -> dict:
        """A transformers ``config.json`` dict for this file's architecture.

        Every ``<arch>.*`` key is mapped (table ``_ARCH_KEYS``) or refused by name; a ``llama``
        file with a ``rope_freqs`` tensor (Llama 3.1 rope scaling) is refused, since its
        parameters are not recoverable from the file.
        """
        a = self.arch_name
        for key in self.reader.fields:
            if key.startswith(a + ".") and key[len(a) + 1:] not in _ARCH_KEYS:
                raise self.error(f"metadata key {key!r} is not supported by semzo's GGUF "
                                 f"reader (it would change the computation)")
        for k in _REQUIRED_KEYS:
            self.value(f"{a}.{k}")  # present, or one line naming it
        hidden = self._int(f"{a}.embedding_length")
        heads = self._int(f"{a}.attention.head_count")
        kv = self._int(f"{a}.attention.head_count_kv", heads)
        if heads == 0 or kv == 0 or heads % kv:
            raise self.error(f"{a}.attention.head_count_kv: {kv} does not divide the "
                             f"{heads} attention heads")
        head_dim = self._int(f"{a}.attention.key_length", hidden // heads if heads else 0)
        if self._int(f"{a}.attention.value_length", head_dim) != head_dim:
            raise self.error(f"{a}.attention.value_length: differs from the key length "
                             f"{head_dim} (not supported)")
        if head_dim == 0 or head_dim % 2:
            raise self.error(f"{a}.attention.key_length: head dimension {head_dim} must be even")
        rot = self._int(f"{a}.rope.dimension_count", head_dim)
        if rot != head_dim:
            raise self.error(f"{a}.rope.dimension_count: partial rotary ({rot} of {head_dim} "
                             f"dimensions) is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise self.error("tensor 'rope_freqs.weight' (llama3 rope scaling): not supported")
        rope_scaling = None
        kind = self.value(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            rope_scaling = {"rope_type": "linear",
                            "factor": float(self.value(f"{a}.rope.scaling.factor"))}
        elif kind != "none":
            raise self.error(f"{a}.rope.scaling.type: {kind!r} is not supported "
                             f"(none or linear)")
        embd = self.tensors.get("token_embd.weight")
        n_vocab = self._int(f"{a}.vocab_size", int(embd.shape[-1]) if embd is not None else 0)
        eps = self.value(f"{a}.attention.layer_norm_rms_epsilon")
        cfg = {
            "architectures": [self.arch.hf_class],
            "model_type": self.arch.model_type,
            "hidden_size": hidden,
            "intermediate_size": self._int(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._int(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "max_position_embeddings": self._int(f"{a}.context_length"),
            "rms_norm_eps": float(np.float32(eps)),
            "rope_theta": float(self.value(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": rope_scaling,
            "vocab_size": n_vocab,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.arch.model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        else:
            cfg.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg["num_hidden_layers"])
        for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                          ("pad_token_id", "padding")):
            v = self.value(f"tokenizer.ggml.{key}_token_id", None)
            if v is not None and not 0 <= int(v) < n_vocab:
                raise self.error(f"tokenizer.ggml.{key}_token_id: {v} outside the vocabulary "
                                 f"of {n_vocab}")
            cfg[name] = None if v is None else int(v)
        return cfg

    # ---- tensors --------------------------------------------------------------------------
    def plan(self, cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(hf_name, gguf_name, shape)`` for every tensor, in Hugging Face module order.

        Refuses unknown and missing tensors, and shapes that disagree with ``cfg``.
        """
        h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        hq = cfg["num_attention_heads"] * cfg["head_dim"]
        hk = cfg["num_key_value_heads"] * cfg["head_dim"]
        block = {"attn_norm.weight": (h,), "attn_q.weight": (hq, h), "attn_k.weight": (hk, h),
                 "attn_v.weight": (hk, h), "attn_output.weight": (h, hq),
                 "ffn_norm.weight": (h,), "ffn_gate.weight": (f, h), "ffn_up.weight": (f, h),
                 "ffn_down.weight": (h, f)}
        if self.arch.qkv_bias:
            block.update({"attn_q.bias": (hq,), "attn_k.bias": (hk,), "attn_v.bias": (hk,)})
        want: dict[str, tuple[str, tuple[int, ...]]] = {
            "token_embd.weight": ("model.embed_tokens.weight", (v, h))}
        for i in range(cfg["num_hidden_layers"]):
            for g, shape in sorted(block.items(), key=lambda kv: _hf_order(kv[0])):
                stem, kind = g.split(".")
                want[f"blk.{i}.{g}"] = (f"model.layers.{i}.{BLOCK_NAMES[stem]}.{kind}", shape)
        want["output_norm.weight"] = ("model.norm.weight", (h,))
        if not cfg["tie_word_embeddings"]:
            want["output.weight"] = ("lm_head.weight", (v, h))
        for name in self.tensors:
            if name not in want:
                raise self.error(f"tensor {name!r} is not part of a {self.arch_name} model "
                                 f"semzo can convert")
        out = []
        for g, (hf, shape) in want.items():
            t = self.tensors.get(g)
            if t is None:
                raise self.error(f"missing tensor {g!r}")
            got = tuple(int(d) for d in reversed(t.shape.tolist()))
            if got != shape:
                raise self.error(f"tensor {g!r} has shape {got}, the metadata implies {shape}")
            out.append((hf, g, shape))
        return out

    def dequantize(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32 in NumPy (row-major, Hugging Face) shape, in GGUF row order."""
        t = self.tensors[gguf_name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type.name == "F32":
            arr = np.array(t.data, dtype=np.float32)
        else:
            arr = _gguf().quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)

    def hf_tensor(self, gguf_name: str, cfg: dict) -> np.ndarray:
        """:meth:`dequantize` plus the llama q/k un-permutation: the Hugging Face tensor."""
        arr = self.dequantize(gguf_name)
        if self.arch.permute_qk:
            if ".attn_q." in gguf_name:
                arr = unpermute_qk(arr, cfg["num_attention_heads"])
            elif ".attn_k." in gguf_name:
                arr = unpermute_qk(arr, cfg["num_key_value_heads"])
        return np.ascontiguousarray(arr)

    def _check_types(self) -> None:
        ok = set(SUPPORTED_TYPES)
        for t in self.reader.tensors:
            if t.tensor_type.name not in ok:
                raise self.error(f"tensor {t.name!r} has type {t.tensor_type.name}, which semzo "
                                 f"does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")


def _hf_order(gguf_suffix: str) -> tuple[int, int]:
    """Order of a block's tensors as transformers lists them (attention, MLP, norms)."""
    order = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "attn_norm", "ffn_norm"]
    stem, kind = gguf_suffix.split(".")
    return order.index(stem), 0 if kind == "weight" else 1


def _open_reader(path: Path):
    """``GGUFReader`` after checks that turn every malformed file into one line."""
    if not path.is_file():
        raise SemzoError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head[:4] != GGUF_MAGIC:
        what = "empty file" if size == 0 else f"starts with {head[:4]!r}"
        raise SemzoError(f"{path}: not a GGUF file ({what}, expected magic b'GGUF')")
    if len(head) < 8:
        raise SemzoError(f"{path}: truncated GGUF file ({size} bytes, no header)")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(os.fspath(path), "r")
    except Exception as exc:  # noqa: BLE001 - any parse failure of a GGUF-tagged file
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, ValueError) and "is not a valid GGMLQuantizationType" in msg:
            raise SemzoError(f"{path}: unknown tensor type ({msg}); semzo dequantizes "
                             f"{', '.join(SUPPORTED_TYPES)}") from None
        raise SemzoError(f"{path}: truncated or corrupt GGUF file ({type(exc).__name__}: "
                         f"{msg})") from None
    if reader.byte_order != "I":
        raise SemzoError(f"{path}: big-endian GGUF files are not supported")
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise SemzoError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                             f"{end}, the file has {size}")
    return reader
