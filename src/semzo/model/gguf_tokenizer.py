"""A ``tokenizers`` tokenizer (``tokenizer.json``) rebuilt from a GGUF file's vocabulary.

Supported: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: vocabulary, merges, token types,
special ids), which SmolLM/SmolLM2, Llama 3 and Qwen2 files use, and ``"llama"``
(SentencePiece BPE) for Gemma 3 (:func:`_sentencepiece`). The byte-level pre-tokenizer
follows llama.cpp's ``tokenizer.ggml.pre`` (``llama-vocab.cpp``):

- ``default``, ``gpt2``, ``gpt-2``: the GPT-2 split;
- ``smollm``, ``starcoder``, ``refact``, ``codeshell``: every digit on its own (``\\p{N}``),
  then the GPT-2 split -- what SmolLM2's own ``tokenizer.json`` does (``Digits`` then
  ``ByteLevel``). transformers 5 does not know this tag and keeps multi-digit runs whole;
- ``qwen2``: Qwen2's split; ``llama-bpe``/``llama3``: Llama 3's split, with llama.cpp's
  ``ignore_merges`` (a word found whole in the vocabulary is one token).

Any other tokenizer model or pre-tokenizer is refused by name. Tokens marked CONTROL (3) become
special added tokens, USER_DEFINED (4) plain added tokens, as llama.cpp matches both whole.

SentencePiece (``llama``, architectures ``gemma2`` and ``gemma3``): a BPE model with byte
fallback (the ``<0xNN>`` tokens), spaces written as ``▁`` by a normalizer (no prefix space: Gemma's
``add_space_prefix`` is false, and other values are refused), ``<unk>`` for what byte
fallback cannot reach, ``<bos>`` prepended when ``add_bos_token``. The file stores no merges:
they are recovered from the vocabulary (every split of a token into two tokens), ranked by
the merged token's position in the file -- for Gemma's normal tokens the score is exactly
minus that position (checked: normal tokens whose scores do not fall with their position are
refused), so this is the score order llama.cpp's SentencePiece merge loop uses,
and it is the order transformers' GGUF loader uses (``gemma_tokenizer``), so the two agree
token for token. Tokens of two or more spaces are stored with real spaces and respelled with
``▁`` (the normalizer has replaced every space before the model sees it), as transformers
does.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

if TYPE_CHECKING:
    from semzo.model.gguf import GGUFModel

_GPT2_PRE = ("default", "gpt2", "gpt-2")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT,
           "llama-v3": LLAMA3_SPLIT}
PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_PRE + tuple(_SPLITS)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer(g: GGUFModel, cfg: dict):
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` for ``g``; SemzoError if unsupported.

    ``cfg``: the model config from :meth:`GGUFModel.hf_config` (vocabulary size, context).
    """

    kind = g.value("tokenizer.ggml.model", None)
    if kind is None:
        raise g.error("no tokenizer (tokenizer.ggml.model missing)")
    if kind == "llama" and g.arch_name in ("gemma2", "gemma3"):
        return _sentencepiece(g, cfg)
    if kind != "gpt2":
        raise g.error(f"tokenizer.ggml.model {kind!r} is not supported (byte-level BPE 'gpt2'; "
                      f"SentencePiece 'llama' for gemma2 and gemma3)")
    pre = g.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise g.error(f"tokenizer.ggml.pre {pre!r} is not supported "
                      f"({', '.join(PRE_TOKENIZERS)})")
    tokens = g.array("tokenizer.ggml.tokens")
    merges = g.array("tokenizer.ggml.merges")
    types = g.array("tokenizer.ggml.token_type") or [1] * len(tokens or ())
    if not tokens or merges is None:
        raise g.error("tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
    if len(tokens) != cfg["vocab_size"] or len(types) != len(tokens):
        raise g.error(f"tokenizer.ggml.tokens: {len(tokens)} tokens and {len(types)} types, "
                      f"the model has a vocabulary of {cfg['vocab_size']}")
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    # a token written outside the byte alphabet is respelled from its UTF-8 bytes (as
    # transformers' GGUF loader does), so the BPE model can reach it
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise g.error(f"tokenizer.ggml.merges: merge {m!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    ignore_merges = pre in ("llama-bpe", "llama3", "llama-v3")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False,
                              byte_fallback=False, ignore_merges=ignore_merges))
    prefix = bool(g.value("tokenizer.ggml.add_space_prefix", False))
    if pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])
    elif pre in _DIGITS_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, s, ty in zip(tokens, spelled, types) if ty == CONTROL and t == s]
    user = [AddedToken(t, special=False, normalized=False)
            for t, s, ty in zip(tokens, spelled, types) if ty == USER_DEFINED and t == s]
    tk.add_special_tokens(special)
    tk.add_tokens(user)

    def tok(key: str) -> str | None:
        i = g.token_id(key, len(tokens))
        return None if i is None else tokens[i]

    bos, eos = tok("bos"), tok("eos")
    add_bos = bool(g.value("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(g.value("tokenizer.ggml.add_eos_token", False))
    for flag, t, key in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and t is None:
            raise g.error(f"tokenizer.ggml.add_{key}_token is set but there is no "
                          f"tokenizer.ggml.{key}_token_id")
    if add_bos or add_eos:
        single = " ".join([*(["$bos"] if add_bos else []), "$A", *(["$eos"] if add_eos else [])])
        pair = single + " " + single.replace("$A", "$B")
        sp = [(t, vocab[s]) for t, s, f in ((bos, bos, add_bos), (eos, eos, add_eos)) if f]
        tk.post_processor = processors.TemplateProcessing(
            single=single.replace("$bos", bos or "").replace("$eos", eos or ""),
            pair=pair.replace("$bos", bos or "").replace("$eos", eos or ""),
            special_tokens=sorted(set(sp)))
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": tok("unknown"),
        "pad_token": tok("padding"),
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "add_prefix_space": prefix,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    template = g.value("tokenizer.chat_template", None)
    if template is not None:
        tcfg["chat_template"] = template
    return tk, tcfg


SPACE = "\u2581"


def spm_merges(vocab: dict[str, int], rank: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a token into two
    tokens of the vocabulary, best (highest ``rank``) merged token first; ties by the pieces'
    lengths, within a token by the pieces' ids (transformers' ``generate_merges``, which this
    reproduces merge for merge)."""
    found = []
    for token, r in rank.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, r) for left, right in local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece(g: GGUFModel, cfg: dict):
    """A SentencePiece-BPE GGUF vocabulary (Gemma 3) as a ``tokenizers`` BPE (module doc)."""
    tokens = g.array("tokenizer.ggml.tokens")
    scores = g.array("tokenizer.ggml.scores")
    types = g.array("tokenizer.ggml.token_type")
    if not tokens or scores is None or types is None:
        raise g.error("tokenizer.ggml.tokens / scores / token_type missing")
    if not len(tokens) == len(scores) == len(types) == cfg["vocab_size"]:
        raise g.error(f"tokenizer.ggml.tokens: {len(tokens)} tokens, {len(scores)} scores, "
                      f"{len(types)} types; the model has a vocabulary of {cfg['vocab_size']}")
    if g.array("tokenizer.ggml.merges"):
        raise g.error("tokenizer.ggml.merges in a SentencePiece ('llama') vocabulary: "
                      "not supported")
    if g.value("tokenizer.ggml.add_space_prefix", False):
        raise g.error("tokenizer.ggml.add_space_prefix = true: not supported for a "
                      "SentencePiece vocabulary (Gemma writes false)")
    if g.has("tokenizer.ggml.precompiled_charsmap"):
        raise g.error("tokenizer.ggml.precompiled_charsmap: SentencePiece normalization is "
                      "not supported")
    normal = [float(sc) for sc, ty in zip(scores, types) if ty == NORMAL]
    if any(b >= a for a, b in itertools.pairwise(normal)):
        raise g.error("tokenizer.ggml.scores: the normal tokens' scores do not fall with their "
                      "position (semzo merges in the order of the positions, which is the "
                      "scores' order in Gemma's vocabularies)")

    def tok(key: str, default: str | None = None) -> str | None:
        i = g.token_id(key, len(tokens))
        return default if i is None else tokens[i]

    bos, eos, unk, pad = tok("bos"), tok("eos"), tok("unknown"), tok("padding")
    if unk is None:
        raise g.error("tokenizer.ggml.unknown_token_id missing (SentencePiece needs <unk>)")
    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    rank = {t: -i for i, t in enumerate(spelled)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(vocab, rank), dropout=None,
                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                            invert=False)
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    add_bos = bool(g.value("tokenizer.ggml.add_bos_token", True))   # llama.cpp's default
    add_eos = bool(g.value("tokenizer.ggml.add_eos_token", False))
    for flag, t, key in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and t is None:
            raise g.error(f"tokenizer.ggml.add_{key}_token is set but there is no "
                          f"tokenizer.ggml.{key}_token_id")
    if add_bos or add_eos:
        def seq(x: str, type_id: int) -> list[str]:
            return ([f"{bos}:{type_id}"] if add_bos else []) + [f"${x}:{type_id}"] \
                + ([f"{eos}:{type_id}"] if add_eos else [])
        tk.post_processor = processors.TemplateProcessing(
            single=seq("A", 0), pair=seq("A", 0) + seq("B", 1),
            special_tokens=sorted({(t, vocab[t]) for t, f in ((bos, add_bos), (eos, add_eos))
                                   if f}))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "add_eos_token": add_eos, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    template = g.value("tokenizer.chat_template", None)
    if template is not None:
        tcfg["chat_template"] = template
    return tk, tcfg
