"""Write a model as a GGUF file (llama.cpp, Ollama), with ``gguf.GGUFWriter``.

``export_gguf(model, path, gguf_type=...)``: the model's weights (LoRA merged,
:func:`semzo.model.export.merged_weights`), its config as ``<arch>.*`` metadata, the tokenizer
of its folder (``tokenizer.json``) as ``tokenizer.ggml.*`` metadata, and the chat template of
``tokenizer_config.json``. Tensor names, shapes and transforms follow llama.cpp's
``convert_hf_to_gguf.py``:

- ``llama`` (LlamaForCausalLM: SmolLM2, Llama 2/3; MistralForCausalLM without a sliding
  window shorter than its context, as llama.cpp's converter writes Mistral): q and k rows
  permuted for llama.cpp's rotary layout (:func:`semzo.model.gguf.permute_qk`, q with the
  attention heads, k with the KV heads); ``output.weight`` only when untied; linear rope scaling as metadata, llama3's
  as the tensor ``rope_freqs.weight`` of frequency divisors (F32, as llama.cpp's converter
  computes it: :func:`semzo.model.spec.llama3_rope_factors`);
- ``qwen2`` (Qwen2ForCausalLM: q/k/v biases) and ``qwen3`` (Qwen3ForCausalLM: q/k norms
  ``attn_q_norm`` / ``attn_k_norm``, the head size always written): rows as they are (llama.cpp
  runs them with NEOX rotary, transformers' ``rotate_half``); a sliding window, Qwen3's
  attention biases, rope types other than default and linear are refused;
- ``gemma2`` (Gemma2ForCausalLM): as Gemma 3 without q/k norms, the two soft-caps written
  (llama.cpp always applies them: a config without them is refused), a global layer every
  2nd, one rotary for every layer;
- ``gemma3`` (Gemma3ForCausalLM, text): every ``*norm.weight`` written as ``1 + w`` (float32),
  the four block norms and the q/k norms named as llama.cpp names them; the sliding window in
  ``gemma3.attention.sliding_window`` (the layer pattern, the local rotary base 10000 and the
  attention scale must be what llama.cpp hard-codes for Gemma 3, or the export is refused).

Types (``gguf_type``): ``f32``, ``f16``, ``bf16``, ``q8_0`` for the matrices; one-dimensional
tensors (norms) stay F32, as llama.cpp writes them; ``q8_0`` keeps a matrix whose rows are not
a multiple of 32 in F16 (named in the log). ``semzo convert gguf`` reads every one of them back
(``semzo.model.gguf``): F32 exactly, the others within the type's rounding.

Tokenizers: byte-level BPE (``tokenizer.ggml.model = gpt2``; the pre-tokenizer tag ``smollm``
for digits-then-ByteLevel, ``gpt2`` for plain ByteLevel, ``llama-bpe`` and ``qwen2`` for
Llama 3's and Qwen2's splits, with ``ignore_merges`` as llama.cpp runs each (on for
``llama-bpe`` only); Qwen's NFC normalizer is dropped, as llama.cpp's converter drops it;
tokens, merges, token types) and
SentencePiece BPE with byte fallback (``llama``, Gemma: tokens, scores decreasing with the id
of the normal tokens -- the order :mod:`semzo.model.gguf_tokenizer` and llama.cpp merge by --,
token types CONTROL / USER_DEFINED / BYTE / NORMAL). Anything else is refused by name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from semzo.model.base import TransformerBase
from semzo.model.export import merged_weights
from semzo.model.gguf import ARCHS, ROPE_FREQS, _gguf, permute_qk
from semzo.model.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT
from semzo.model.spec import llama3_rope_factors
from semzo.model.storage import to_float32
from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}     # llama_ftype
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-F]{2}>$")

# the Split regex of a byte-level tokenizer -> (llama.cpp's pre tag, its ignore_merges)
_SPLIT_TAGS = {LLAMA3_SPLIT: ("llama-bpe", True), QWEN2_SPLIT: ("qwen2", False)}
_ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma2": "gemma2", "gemma3_text": "gemma3"}


def _need(cfg: dict, key: str, ok, what: str) -> None:
    v = cfg.get(key)
    if not ok(v):
        raise SemzoError(f"GGUF export: config {key} = {v!r}: {what}")


def _metadata(cfg: dict) -> tuple[str, dict, dict]:
    """``(arch, {key: value}, {tensor: array})``: the ``<arch>.*`` keys and the tensors the
    config adds (llama3's ``rope_freqs.weight``); refuses what llama.cpp would run
    differently."""
    mt = cfg.get("model_type")
    arch = _ARCH_OF.get(mt)
    if arch is None:
        raise SemzoError(f"GGUF export: model_type {mt!r} is not supported "
                         f"({', '.join(_ARCH_OF)})")
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    n = int(cfg["num_hidden_layers"])
    m = {"context_length": int(cfg["max_position_embeddings"]), "embedding_length": h,
         "block_count": n, "feed_forward_length": int(cfg["intermediate_size"]),
         "attention.head_count": heads, "attention.head_count_kv": kv,
         "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
         "vocab_size": int(cfg["vocab_size"])}
    if hd != h // heads or arch in ("gemma2", "gemma3", "qwen3"):
        m["attention.key_length"] = m["attention.value_length"] = hd
    rope, extra = cfg.get("rope_parameters") or {}, {}
    if arch in ("llama", "qwen2", "qwen3"):
        if arch != "qwen2":         # (Qwen2's q/k/v biases are part of its architecture)
            _need(cfg, "attention_bias", lambda v: not v, "biases are not supported")
        if arch == "llama":
            _need(cfg, "mlp_bias", lambda v: not v, "biases are not supported")
            if mt == "mistral":         # written as llama, as llama.cpp's converter does
                _need(cfg, "sliding_window",
                      lambda v: v is None or int(v) >= int(cfg["max_position_embeddings"]),
                      "llama.cpp's llama has no sliding window")
        else:
            _need(cfg, "use_sliding_window", lambda v: not v,
                  f"llama.cpp's {arch} has no sliding window")
        _need(cfg, "hidden_act", lambda v: v in (None, "silu"), f"llama.cpp's {arch} is SiLU")
        if "rope_type" not in rope:
            rope = {"rope_theta": cfg.get("rope_theta", 10000.0),
                    **(cfg.get("rope_scaling") or {})}
        m["rope.dimension_count"] = hd
        m["rope.freq_base"] = float(rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "linear":
            m["rope.scaling.type"], m["rope.scaling.factor"] = "linear", float(rope["factor"])
        elif kind == "llama3" and arch == "llama":   # llama.cpp reads the divisors from a tensor
            try:
                extra = {ROPE_FREQS: llama3_rope_factors(
                    m["rope.freq_base"], hd, float(rope["factor"]),
                    float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                    int(rope.get("original_max_position_embeddings")
                        or cfg["max_position_embeddings"]))}
            except KeyError as exc:
                raise SemzoError(f"GGUF export: llama3 rope scaling lacks {exc.args[0]!r}") \
                    from None
        elif kind != "default":
            raise SemzoError(f"GGUF export: rope type {kind!r} is not supported for {arch} "
                             f"(default, linear{', llama3' if arch == 'llama' else ''})")
        return arch, m, extra
    # gemma2 / gemma3: what llama.cpp hard-codes must hold
    g3 = arch == "gemma3"
    name, every = ("Gemma 3", 6) if g3 else ("Gemma 2", 2)
    want_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                  for i in range(n)]
    _need(cfg, "layer_types", lambda v: v is None or list(v) == want_types,
          f"llama.cpp's {name} has one global layer in every {every}, the last")
    scalar = h // heads if n == (62 if g3 else 46) else hd
    _need(cfg, "query_pre_attn_scalar", lambda v: v is None or float(v) == scalar,
          f"llama.cpp scales attention by 1/sqrt({scalar})")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if g3:
            _need(cfg, k, lambda v: v is None, "llama.cpp's Gemma 3 has no soft-capping")
        else:       # llama.cpp's Gemma 2 always soft-caps, with the file's values
            _need(cfg, k, lambda v: isinstance(v, int | float) and v > 0,
                  "llama.cpp's Gemma 2 always soft-caps")
            m[k] = float(cfg[k])
    _need(cfg, "use_bidirectional_attention", lambda v: not v, "not supported")
    _need(cfg, "hidden_activation", lambda v: v in (None, "gelu_pytorch_tanh"),
          f"llama.cpp's {name} uses tanh GELU")
    _need(cfg, "attention_bias", lambda v: not v, "biases are not supported")
    if g3:
        full = rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1e6),
                                              **(cfg.get("rope_scaling") or {})}
        local = rope.get("sliding_attention") or {
            "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if float(local.get("rope_theta", 0)) != 10000.0 or \
                local.get("rope_type", "default") != "default":
            raise SemzoError(f"GGUF export: sliding-layer rope {local}: llama.cpp's Gemma 3 "
                             f"uses the default rope with base 10000")
    else:           # one rotary for every layer
        full = rope.get("full_attention") or rope or {
            "rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
        if rope.get("sliding_attention", full) != full:
            raise SemzoError(f"GGUF export: per-layer rope {rope}: llama.cpp's Gemma 2 has "
                             f"one rotary for every layer")
    m["rope.freq_base"] = float(full.get("rope_theta", 1e6 if g3 else 10000.0))
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        m["rope.scaling.type"], m["rope.scaling.factor"] = "linear", float(full["factor"])
    elif kind != "default":
        raise SemzoError(f"GGUF export: rope type {kind!r} is not supported (default, linear)")
    m["attention.sliding_window"] = int(cfg["sliding_window"])
    return arch, m, extra


def gguf_tensors(weights: dict[str, np.ndarray], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """Hugging Face tensors (float32) -> GGUF names and values (permuted / shifted)."""
    block = {v: k for k, v in ARCHS[arch].block.items()}
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        w = np.ascontiguousarray(to_float32(w), dtype=np.float32)
        if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            g = "token_embd.weight"
        elif name in ("model.norm.weight", "norm.weight"):
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings", True) and "model.embed_tokens.weight" in weights:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")
            if parts[0] == "model":
                parts = parts[1:]
            if parts[0] != "layers" or len(parts) < 4:
                raise SemzoError(f"GGUF export: tensor {name!r} has no GGUF name")
            i, module, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
            stem = block.get(module)
            if stem is None:
                raise SemzoError(f"GGUF export: tensor {name!r} has no GGUF name ({arch})")
            g = f"blk.{i}.{stem}.{kind}"
            if arch == "llama" and stem == "attn_q":
                w = permute_qk(w, heads)
            elif arch == "llama" and stem == "attn_k":
                w = permute_qk(w, kv)
        if ARCHS[arch].norm_shift and g.endswith("norm.weight"):
            w = w + np.float32(ARCHS[arch].norm_shift)
        out[g] = np.ascontiguousarray(w)
    return out


# ---- tokenizer ------------------------------------------------------------------------------
def _tokenizer_meta(folder: Path, cfg: dict, arch: str) -> dict:
    """``tokenizer.*`` metadata from ``folder``'s tokenizer.json and tokenizer_config.json."""
    f = folder / "tokenizer.json"
    if not f.is_file():
        raise SemzoError(f"GGUF export: {f}: not found (the GGUF file carries the tokenizer)")
    tj = json.loads(f.read_text(encoding="utf-8"))
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise SemzoError(f"GGUF export: {f}: tokenizer model {model.get('type')!r} is not "
                         f"supported (BPE)")
    vocab: dict[str, int] = model["vocab"]
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    n = int(cfg["vocab_size"])
    ids = set(vocab.values()) | set(added)
    if max(ids) >= n:
        raise SemzoError(f"GGUF export: {f}: token id {max(ids)} outside the model's "
                         f"vocabulary of {n}")
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    for i, t in added.items():
        tokens[i] = t["content"]
    missing = [i for i in range(n) if i not in ids]
    for i in missing:                       # padding rows of the embedding (Qwen-style)
        tokens[i] = f"[PAD{i}]"
    types = [NORMAL] * n
    for i, t in added.items():
        types[i] = CONTROL if t.get("special") else USER_DEFINED
    for i in missing:
        types[i] = USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict = {}
    byte_fallback = bool(model.get("byte_fallback"))
    norm = tj.get("normalizer") or {}
    if byte_fallback and norm.get("type") == "Replace" and \
            norm.get("content") == "\u2581" and (norm.get("pattern") or {}).get("String") == " ":
        # SentencePiece BPE (Gemma)
        for i, t in enumerate(tokens):
            if types[i] == NORMAL and _BYTE_TOKEN.match(t):
                types[i] = BYTE
        unk = model.get("unk_token")
        rank, scores = 0, []
        for i in range(n):
            if types[i] == NORMAL:
                scores.append(-float(rank))
                rank += 1
            else:
                scores.append(-1000.0 if types[i] == CONTROL else 0.0)
        meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                     "tokens": tokens, "scores": scores, "types": types,
                     "add_space_prefix": False, "unk": unk})
    elif not byte_fallback and (norm or {}).get("type") in (None, "NFC"):
        if norm:        # Qwen's; llama.cpp does not normalize (nor does its own converter)
            log.info("%s: the NFC normalizer is not kept (llama.cpp has none): text that is "
                     "not in NFC may tokenize differently there", f)
        pre = tj.get("pre_tokenizer") or {}
        seq = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
        kinds = [(p.get("type"), p.get("individual_digits"), p.get("use_regex"),
                  p.get("add_prefix_space")) for p in seq or []]
        split = (seq[0].get("pattern") or {}).get("Regex") if seq and seq[0] else None
        if kinds == [("Digits", True, None, None), ("ByteLevel", None, True, False)]:
            tag = "smollm"
        elif kinds == [("ByteLevel", None, True, False)]:
            tag = "gpt2"
        elif kinds == [("Split", None, None, None), ("ByteLevel", None, False, False)] \
                and split in _SPLIT_TAGS and seq[0].get("behavior") == "Isolated" \
                and not seq[0].get("invert"):
            tag, whole = _SPLIT_TAGS[split]
            if bool(model.get("ignore_merges")) != whole:
                raise SemzoError(f"GGUF export: {f}: ignore_merges = "
                                 f"{bool(model.get('ignore_merges'))} with the split of "
                                 f"llama.cpp's {tag!r}, which it runs with {whole}")
        else:
            raise SemzoError(f"GGUF export: {f}: pre-tokenizer {json.dumps(pre)[:120]} has "
                             f"no llama.cpp tag semzo knows (ByteLevel; Digits + ByteLevel; "
                         f"Llama 3's or Qwen2's Split + ByteLevel)")
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": tag,
                     "tokens": tokens, "types": types, "merges": merges, "unk": None})
    else:
        raise SemzoError(f"GGUF export: {f}: only byte-level BPE and SentencePiece BPE with "
                         f"byte fallback are supported")

    def tid(key: str) -> int | None:
        v = tcfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            i = vocab.get(v, next((k for k, t in added.items() if t["content"] == v), None))
            return None if i is None else int(i)
        return None

    meta["bos"] = tid("bos_token") if tid("bos_token") is not None else cfg.get("bos_token_id")
    meta["eos"] = tid("eos_token") if tid("eos_token") is not None else cfg.get("eos_token_id")
    meta["pad"] = tid("pad_token") if tid("pad_token") is not None else cfg.get("pad_token_id")
    unk = meta.pop("unk")
    meta["unk"] = vocab.get(unk) if unk is not None else tid("unk_token")
    pp = json.dumps(tj.get("post_processor") or {})
    default_bos = meta["tokenizer.ggml.model"] == "llama"
    meta["add_bos"] = bool(tcfg.get("add_bos_token", default_bos))
    meta["add_eos"] = bool(tcfg.get("add_eos_token", False))
    if meta["add_bos"] and meta["bos"] is not None and '"TemplateProcessing"' in pp \
            and tokens[meta["bos"]] not in pp:
        meta["add_bos"] = False
    meta["chat_template"] = tcfg.get("chat_template")
    return meta


def _write_tokenizer(w, meta: dict) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokens"])
    if "scores" in meta:
        w.add_token_scores(meta["scores"])
    w.add_token_types(meta["types"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    for key, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                    ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        if meta.get(key) is not None:
            fn(int(meta[key]))
    w.add_add_bos_token(meta["add_bos"])
    w.add_add_eos_token(meta["add_eos"])
    if "add_space_prefix" in meta:
        w.add_add_space_prefix(meta["add_space_prefix"])
    if meta.get("chat_template"):
        w.add_chat_template(meta["chat_template"])


# ---- the file -------------------------------------------------------------------------------
def _encode(gguf, name: str, w: np.ndarray, gguf_type: str):
    """``(data, raw_dtype or None)`` of one tensor in the asked type (1-D: F32)."""
    Q = gguf.GGMLQuantizationType
    if w.ndim == 1 or gguf_type == "f32":
        return w.astype(np.float32), None
    if gguf_type == "f16":
        return w.astype(np.float16), None
    if gguf_type == "bf16":
        return gguf.quants.quantize(w, Q.BF16), Q.BF16
    if w.shape[-1] % 32:
        log.info("%s: rows of %d are not a multiple of 32: written F16", name, w.shape[-1])
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0


def export_gguf(model: TransformerBase, path: str | Path, *, gguf_type: str = "f32",
                tokenizer_folder: str | Path | None = None, name: str | None = None) -> dict:
    """Write ``model`` (LoRA merged) to the GGUF file ``path``; returns a summary
    (``path``, ``arch``, ``type``, ``tensors``, ``bytes``). One process."""
    if gguf_type not in GGUF_TYPES:
        raise SemzoError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    gguf = _gguf()
    cfg = dict(model.config.raw)
    arch, arch_meta, extra = _metadata(cfg)
    folder = Path(tokenizer_folder) if tokenizer_folder is not None else model.source
    if folder is None:
        raise SemzoError("GGUF export: the model has no folder to take the tokenizer from")
    tok = _tokenizer_meta(Path(folder), cfg, arch)
    tensors = gguf_tensors(merged_weights(model), cfg, arch)
    tensors.update(extra)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(name or (Path(folder).name if folder else arch))
        w.add_file_type(_FILE_TYPE[gguf_type])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for k, v in arch_meta.items():
            key = f"{arch}.{k}"
            if isinstance(v, str):
                w.add_string(key, v)
            elif isinstance(v, float):
                w.add_float32(key, v)
            else:
                w.add_uint32(key, int(v))
        _write_tokenizer(w, tok)
        for g, arr in tensors.items():
            data, raw = _encode(gguf, g, arr, gguf_type)
            if raw is None:
                w.add_tensor(g, data)
            else:
                w.add_tensor(g, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    summary = {"path": str(path), "arch": arch, "type": gguf_type, "tensors": len(tensors),
               "bytes": path.stat().st_size}
    log.info("GGUF export: %s (%s, %s, %d tensors, %.1f MB)", path, arch, gguf_type,
             len(tensors), summary["bytes"] / 1e6)
    return summary
