"""Read GGUF files (llama.cpp's format) as Hugging Face tensors and config, without torch.

The file is memory-mapped and parsed by semzo's own reader (:func:`_read_gguf`: metadata as
Python values, string arrays decoded in one pass -- ``gguf.GGUFReader`` takes 10 CPU seconds
on Gemma 3's 262k-token vocabulary); nothing is dequantized until a tensor is asked for, one at a time (:meth:`GGUFModel.hf_tensor`), so converting a model needs the parsed
metadata plus the temporaries of its largest tensor, not the memory of the model.

What is supported, and refused by name otherwise (:class:`SemzoError`, one line, exit 2):

- one file, or a model split into shards (``PREFIX-00001-of-0000N.gguf``, llama.cpp's
  ``gguf-split``), opened from the first (:meth:`GGUFModel._join_shards`);
- tensor types :data:`SUPPORTED_TYPES` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
  Q5_K, Q6_K), dequantized to float32 by ``gguf.quants.dequantize``; any other type, a
  truncated file, a file that is not GGUF or a big-endian GGUF is refused;
- architectures :data:`ARCHS`: ``llama`` (Llama 2, Llama 3.x with llama3 rope scaling, SmolLM/SmolLM2,
  Mistral written as llama) -> ``LlamaForCausalLM``; ``qwen2`` -> ``Qwen2ForCausalLM`` (q/k/v
  biases); ``qwen3`` -> ``Qwen3ForCausalLM`` (q/k norms, no biases); ``gemma2`` ->
  ``Gemma2ForCausalLM`` (soft-capping, sliding windows); ``gemma3`` (text) ->
  ``Gemma3ForCausalLM``. Every ``<arch>.*`` metadata key is
  either mapped onto the config or refused.

llama.cpp stores Gemma's RMSNorm weights as ``1 + w`` (``convert_hf_to_gguf.py`` adds 1 to
every ``*norm.weight``, q/k norms included); the Hugging Face folder gets ``w`` back (the
GGUF value minus 1 in float32, as transformers' ``Gemma2TensorProcessor`` does).

llama.cpp stores the rows of the llama q/k projections permuted for its rotary layout
(``convert_hf_to_gguf.py``: ``LlamaModel.permute``); :func:`unpermute_qk` undoes it, exactly
as transformers' ``LlamaTensorProcessor`` does. Qwen2 and Qwen3 are written unpermuted.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from semzo.model.spec import llama3_from_factors
from semzo.runtime import SemzoError

GGUF_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"     # llama3 rope scaling's frequency divisors (llama.cpp)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SemzoError("reading GGUF needs the package gguf (pip install gguf; make setup "
                         "installs it)") from None
    return gguf


SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K",
                   "Q5_K", "Q6_K")


# per-block GGUF tensor -> Hugging Face module (model.layers.N.<module>), Llama/Qwen2
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
# Gemma 3: four norms per block and the per-head q/k norms; llama.cpp's ``ffn_norm`` is the
# pre-feed-forward norm there, ``post_attention_norm`` the norm after attention
GEMMA3_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 2: Gemma 3's block without the q/k norms
GEMMA2_BLOCK_NAMES = {k: v for k, v in GEMMA3_BLOCK_NAMES.items()
                      if k not in ("attn_q_norm", "attn_k_norm")}
# Qwen3: Qwen2's block without biases, with the per-head q/k norms
QWEN3_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    """How one llama.cpp architecture maps onto a transformers class."""

    model_type: str
    hf_class: str
    permute_qk: bool   # llama.cpp permuted the q/k rows (llama's convert step)
    qkv_bias: bool     # q/k/v projections carry biases (Qwen2)
    block: dict        # GGUF block tensor stem -> Hugging Face module
    norm_shift: float = 0.0   # GGUF norm weight = HF weight + this (Gemma stores 1 + w)
    extra_keys: tuple[str, ...] = ()   # <arch>.* keys this architecture adds to _ARCH_KEYS


ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", permute_qk=True, qkv_bias=False,
                  block=BLOCK_NAMES),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", permute_qk=False, qkv_bias=True,
                  block=BLOCK_NAMES),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", permute_qk=False, qkv_bias=False,
                  block=QWEN3_BLOCK_NAMES),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", permute_qk=False, qkv_bias=False,
                   block=GEMMA2_BLOCK_NAMES, norm_shift=1.0,
                   extra_keys=("attention.sliding_window", "attn_logit_softcapping",
                               "final_logit_softcapping")),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", permute_qk=False, qkv_bias=False,
                   block=GEMMA3_BLOCK_NAMES, norm_shift=1.0,
                   extra_keys=("attention.sliding_window", "attention.sliding_window_pattern")),
}

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
        if "split.count" in self.reader.fields:
            self.reader = self._join_shards()
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

    def _join_shards(self) -> _Reader:
        """A model split by llama.cpp's ``gguf-split`` (or ``GGUFWriter(split_max_...)``):
        ``PREFIX-00001-of-0000N.gguf`` holds the metadata and ``split.*`` keys, every shard
        some of the tensors. Opened from the first shard, the others found beside it by
        name; each must say it is shard k of N (``split.no`` k - 1, ``split.count`` N), and
        the tensors of all of them, each once, must number ``split.tensors.count``."""
        f = self.reader.fields

        def count(fields: dict, key: str, path: Path) -> int:
            v = fields.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SemzoError(f"{path}: metadata key {key!r}: expected a non-negative "
                                 f"integer, got {v!r}")
            return v

        n = count(f, "split.count", self.path)
        if n <= 1:
            return self.reader
        m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", self.path.name)
        if m is None or int(m.group(2)) != 1 or int(m.group(3)) != n \
                or count(f, "split.no", self.path) != 0:
            raise self.error(f"split.count {n}: open the first of the {n} shards, "
                             f"PREFIX-00001-of-{n:05d}.gguf")
        total = count(f, "split.tensors.count", self.path)
        tensors = list(self.reader.tensors)
        for k in range(2, n + 1):
            shard = self.path.with_name(f"{m.group(1)}-{k:05d}-of-{n:05d}.gguf")
            if not shard.is_file():
                raise self.error(f"shard {k} of {n} not found: {shard}")
            r = _open_reader(shard)
            if count(r.fields, "split.no", shard) != k - 1 or \
                    count(r.fields, "split.count", shard) != n:
                raise SemzoError(f"{shard}: split.no / split.count = "
                                 f"{r.fields.get('split.no')} / {r.fields.get('split.count')}, "
                                 f"expected {k - 1} / {n}")
            tensors += r.tensors
        names = [t.name for t in tensors]
        if len(set(names)) != len(names) or len(names) != total:
            raise self.error(f"split.tensors.count {total}: the {n} shards hold "
                             f"{len(names)} tensors ({len(set(names))} names)")
        return _Reader(f, tensors)

    # ---- metadata -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default=...):
        """A scalar or string metadata value (``default`` when absent; absent and no default:
        error naming the key). Arrays: :meth:`array`."""
        if key not in self.reader.fields:
            if default is ...:
                raise self.error(f"missing metadata key {key!r}")
            return default
        v = self.reader.fields[key]
        if isinstance(v, list | np.ndarray):
            raise self.error(f"metadata key {key!r}: expected a scalar, found an array")
        return v

    def array(self, key: str) -> list | None:
        """An array metadata value as a Python list (strings decoded), None when absent."""
        v = self.reader.fields.get(key)
        if v is None:
            return None
        if isinstance(v, np.ndarray):
            return v.tolist()
        if not isinstance(v, list):
            raise self.error(f"metadata key {key!r}: expected an array")
        return v

    def _int(self, key: str, default=...) -> int:
        """A non-negative integer (an integral float counts; NaN, infinities, fractions,
        strings and booleans do not: an error naming the key)."""
        v = self.value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or int(v) != v or v < 0:
            raise self.error(f"metadata key {key!r}: expected a non-negative integer, got {v!r}")
        return int(v)

    def _float(self, key: str, default=...) -> float:
        """A finite positive number (an error naming the key otherwise)."""
        v = self.value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v <= 0:
            raise self.error(f"metadata key {key!r}: expected a finite positive number, got "
                             f"{v!r}")
        return float(v)

    def token_id(self, key: str, n_vocab: int) -> int | None:
        """``tokenizer.ggml.<key>_token_id`` inside ``[0, n_vocab)``, None when absent."""
        name = f"tokenizer.ggml.{key}_token_id"
        if self.value(name, None) is None:
            return None
        i = self._int(name)
        if i >= n_vocab:
            raise self.error(f"{name}: {i} outside the vocabulary of {n_vocab}")
        return i

    # ---- config ---------------------------------------------------------------------------
    def hf_config(self) -> dict:
        """A transformers ``config.json`` dict for this file's architecture.

        Every ``<arch>.*`` key is mapped (table ``_ARCH_KEYS``) or refused by name; a ``llama``
        file's ``rope_freqs`` tensor (Llama 3.1 and later) becomes llama3 ``rope_scaling``
        (:meth:`_llama3`).
        """
        a = self.arch_name
        for key in self.reader.fields:
            sub = key[len(a) + 1:]
            if key.startswith(a + ".") and sub not in _ARCH_KEYS \
                    and sub not in self.arch.extra_keys:
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
        rope_scaling = None
        kind = self.value(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            rope_scaling = {"rope_type": "linear",
                            "factor": self._float(f"{a}.rope.scaling.factor")}
        elif kind != "none":
            raise self.error(f"{a}.rope.scaling.type: {kind!r} is not supported "
                             f"(none or linear)")
        if ROPE_FREQS in self.tensors:
            rope_scaling = self._llama3(kind, head_dim)
        embd = self.tensors.get("token_embd.weight")
        n_vocab = self._int(f"{a}.vocab_size", int(embd.shape[-1]) if embd is not None else 0)
        eps = self._float(f"{a}.attention.layer_norm_rms_epsilon")
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
            "rope_theta": self._float(f"{a}.rope.freq_base", 10000.0),
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
        elif self.arch.model_type == "qwen3":
            cfg.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg["num_hidden_layers"])
        elif self.arch.model_type == "gemma3_text":
            self._gemma3_config(cfg, rope_scaling)
        elif self.arch.model_type == "gemma2":
            self._gemma2_config(cfg)
        else:
            cfg.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg["num_hidden_layers"])
        for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                          ("pad_token_id", "padding")):
            cfg[name] = self.token_id(key, n_vocab)
        return cfg

    def _llama3(self, kind: str, head_dim: int) -> dict | None:
        """The llama3 ``rope_scaling`` of the file's ``rope_freqs.weight`` (Llama 3.1 and
        later: llama.cpp keeps the divisor of each rotary frequency, not the parameters;
        :func:`semzo.model.spec.llama3_from_factors` reads them back and checks that they
        give the file's frequencies); an error naming the tensor when they are not llama3's
        or the file is not a ``llama``."""
        if self.arch_name != "llama" or kind != "none":
            raise self.error(f"tensor {ROPE_FREQS!r}: frequency factors are read for llama "
                             f"files without rope.scaling.type (this one: "
                             f"{self.arch_name}, {kind})")
        t = self.tensors[ROPE_FREQS]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != (head_dim // 2,):
            raise self.error(f"tensor {ROPE_FREQS!r} has shape {shape}, the metadata implies "
                             f"{(head_dim // 2,)}")
        theta = self._float(f"{self.arch_name}.rope.freq_base", 10000.0)
        try:
            return llama3_from_factors(self.dequantize(ROPE_FREQS), theta, head_dim)
        except ValueError as exc:
            raise self.error(f"tensor {ROPE_FREQS!r}: {exc}") from None

    def _window(self, default=...) -> int:
        """``<arch>.attention.sliding_window``: at least 1 token."""
        key = f"{self.arch_name}.attention.sliding_window"
        w = self._int(key, default)
        if w < 1:
            raise self.error(f"metadata key {key!r}: a sliding window must be at least 1 "
                             f"token, got {w}")
        return w

    def _gemma2_config(self, cfg: dict) -> None:
        """Gemma 2 as llama.cpp runs it (``llama-model.cpp``, LLM_ARCH_GEMMA2): GeGLU with
        tanh GELU, a sliding window on every other layer from the first (the pattern
        llama.cpp hard-codes; ``attention.sliding_window``, default 4096 as there), the
        scores soft-capped by ``attn_logit_softcapping`` (default 50) and the logits by
        ``final_logit_softcapping`` (default 30), attention scale 1/sqrt(head_dim)
        (1/sqrt(hidden/heads) for the 46-block 27B), one rotary (the file's base and linear
        scaling) on every layer."""
        a = self.arch_name
        n = cfg["num_hidden_layers"]
        scalar = cfg["head_dim"]
        if n == 46:   # llama.cpp: LLM_TYPE_27B scales by hidden / heads
            scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh", attention_bias=False,
            query_pre_attn_scalar=scalar,
            sliding_window=self._window(4096),
            layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention"
                         for i in range(n)],
            attn_logit_softcapping=self._float(f"{a}.attn_logit_softcapping", 50.0),
            final_logit_softcapping=self._float(f"{a}.final_logit_softcapping", 30.0))
        cfg.pop("hidden_act")

    def _gemma3_config(self, cfg: dict, rope_scaling: dict | None) -> None:
        """Gemma 3 text as llama.cpp runs it (``llama-model.cpp``, LLM_ARCH_GEMMA3): GeGLU
        with tanh GELU, sliding windows on five of every six layers (the pattern llama.cpp
        hard-codes, or ``attention.sliding_window_pattern`` when the file has it), local
        rotary base 10000 (fixed by llama.cpp), the file's ``rope.freq_base`` (and linear
        scaling) on the global layers, attention scale 1/sqrt(head_dim) (1/sqrt(hidden/heads)
        for the 62-block 27B), no soft-capping. transformers' GGUF loader gives the same
        config through Gemma3TextConfig's defaults."""
        a = self.arch_name
        n = cfg["num_hidden_layers"]
        window = self._window()
        every = self._int(f"{a}.attention.sliding_window_pattern", 6)
        if every < 1:
            raise self.error(f"{a}.attention.sliding_window_pattern: {every} (need >= 1)")
        scalar = cfg["head_dim"]
        if n == 62:   # llama.cpp: LLM_TYPE_27B scales by hidden / heads
            scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
        full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        if rope_scaling is not None:
            full.update(rope_scaling)
        cfg.pop("rope_scaling")
        cfg.update(
            hidden_activation="gelu_pytorch_tanh", attention_bias=False,
            query_pre_attn_scalar=scalar, sliding_window=window,
            layer_types=["sliding_attention" if (i + 1) % every else "full_attention"
                         for i in range(n)],
            rope_parameters={"full_attention": full,
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}},
            attn_logit_softcapping=None, final_logit_softcapping=None,
            use_bidirectional_attention=False)
        cfg.pop("hidden_act")

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
        if "attn_q_norm" in self.arch.block:
            hd = cfg["head_dim"]
            block.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        if "post_ffw_norm" in self.arch.block:
            block.update({"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)})
        want: dict[str, tuple[str, tuple[int, ...]]] = {
            "token_embd.weight": ("model.embed_tokens.weight", (v, h))}
        for i in range(cfg["num_hidden_layers"]):
            for g, shape in sorted(block.items(), key=lambda kv: _hf_order(kv[0])):
                stem, kind = g.split(".")
                want[f"blk.{i}.{g}"] = (f"model.layers.{i}.{self.arch.block[stem]}.{kind}", shape)
        want["output_norm.weight"] = ("model.norm.weight", (h,))
        if not cfg["tie_word_embeddings"]:
            want["output.weight"] = ("lm_head.weight", (v, h))
        for name in self.tensors:
            if name not in want and name != ROPE_FREQS:     # (read by hf_config)
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
            arr = np.array(t.data.view(np.float32))
        else:
            arr = _gguf().quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)

    def hf_tensor(self, gguf_name: str, cfg: dict) -> np.ndarray:
        """:meth:`dequantize` plus the llama q/k un-permutation and the Gemma norm shift
        (``w - 1``): the Hugging Face tensor."""
        arr = self.dequantize(gguf_name)
        if self.arch.norm_shift and gguf_name.endswith("norm.weight"):
            arr = arr - np.float32(self.arch.norm_shift)   # as transformers' Gemma2 processor
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
    order = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
             "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "post_attention_norm", "ffn_norm",
             "post_ffw_norm"]
    stem, kind = gguf_suffix.split(".")
    return order.index(stem), 0 if kind == "weight" else 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ``shape`` in GGUF order (fastest dimension first, as
    ``gguf.GGUFReader``), ``data`` the raw bytes as uint8 ``(rows, bytes per row)``, memory-
    mapped."""

    name: str
    tensor_type: object        # gguf.GGMLQuantizationType
    shape: np.ndarray
    data_offset: int
    n_bytes: int
    data: np.ndarray


class _Truncated(Exception):
    pass


@dataclass
class _Reader:
    fields: dict            # key -> Python value (str, int, float, bool, list, np.ndarray)
    tensors: list


# GGUF value types (gguf.GGUFValueType): numpy dtype of each fixed-size one
_VT = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
       10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


def _read_gguf(path: Path) -> _Reader:
    """Parse a little-endian GGUF v2/v3 file: metadata into Python values (string arrays
    decoded in one pass: ``gguf.GGUFReader`` builds one memmap view per string, 10 CPU
    seconds for Gemma 3's 262k-token vocabulary), tensor infos, memory-mapped tensor bytes.
    Raises ``_Truncated`` past the end of the file, ValueError on a malformed one."""
    gguf = _gguf()
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    size = len(buf)
    pos = 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise _Truncated
        pos += n
        return buf[pos - n:pos]

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def text(what: str) -> str:
        raw = bytes(take(u64()))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what}: not UTF-8 ({exc.reason})") from None

    def scalar(vt: int):
        dt = np.dtype(_VT[vt])
        return np.frombuffer(take(dt.itemsize), dtype=dt)[0].item()

    take(4)   # magic, checked by the caller
    version = u32()
    if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = u64(), u64()
    fields: dict = {}
    for _ in range(n_kv):
        key = text("metadata key")
        vt = u32()
        if vt == _STRING:
            fields[key] = text(f"metadata key {key!r}")
        elif vt == _ARRAY:
            et, n = u32(), u64()
            if et == _STRING:
                vals = []
                for _ in range(n):
                    vals.append(text(f"metadata key {key!r}"))
                fields[key] = vals
            elif et in _VT:
                dt = np.dtype(_VT[et])
                if n > size:
                    raise _Truncated
                fields[key] = np.frombuffer(take(dt.itemsize * n), dtype=dt)
            else:
                raise ValueError(f"metadata key {key!r}: array of unknown type {et}")
        elif vt in _VT:
            fields[key] = scalar(vt)
        else:
            raise ValueError(f"metadata key {key!r}: unknown value type {vt}")
    infos = []
    for _ in range(n_tensors):
        name = text("tensor name")
        nd = u32()
        if nd > 8:
            raise ValueError(f"tensor {name!r}: {nd} dimensions")
        dims = [u64() for _ in range(nd)]
        raw_type = u32()
        offset = u64()
        try:
            qt = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{raw_type} is not a valid GGMLQuantizationType "
                             f"(tensor {name!r})") from None
        infos.append((name, qt, dims, offset))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = pos + (-pos % align)
    tensors = []
    for name, qt, dims, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        row = int(dims[0]) if dims else 1
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        if row % block:
            raise ValueError(f"tensor {name!r}: row of {row} is not a multiple of the "
                             f"{qt.name} block of {block}")
        row_bytes = row // block * type_size
        n_bytes = rows * row_bytes
        begin = start + offset
        if begin + n_bytes > size:
            raise _Truncated(f"tensor {name!r} ends at byte {begin + n_bytes}, the file has "
                             f"{size}")
        data = mm[begin:begin + n_bytes].reshape(rows, row_bytes)
        tensors.append(TensorInfo(name, qt, np.array(dims, dtype=np.int64), begin, n_bytes,
                                  data))
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("duplicate tensor names")
    return _Reader(fields, tensors)


def _open_reader(path: Path) -> _Reader:
    """:func:`_read_gguf` after checks that turn every malformed file into one line."""
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
    try:
        return _read_gguf(path)
    except _Truncated as exc:
        where = f": {exc}" if str(exc) else ""
        raise SemzoError(f"{path}: truncated GGUF file ({size} bytes){where}") from None
    except ValueError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "big-endian" in msg:
            raise SemzoError(f"{path}: {msg}") from None
        if "is not a valid GGMLQuantizationType" in msg:
            raise SemzoError(f"{path}: unknown tensor type ({msg}); semzo dequantizes "
                             f"{', '.join(SUPPORTED_TYPES)}") from None
        raise SemzoError(f"{path}: truncated or corrupt GGUF file ({msg})") from None
