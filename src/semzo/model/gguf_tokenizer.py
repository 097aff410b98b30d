"""A ``tokenizers`` tokenizer (``tokenizer.json``) rebuilt from a GGUF file's vocabulary.

Supported: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: vocabulary, merges, token types,
special ids), which SmolLM/SmolLM2, Llama 3 and Qwen2 files use. The pre-tokenizer follows
llama.cpp's ``tokenizer.ggml.pre`` (``llama-vocab.cpp``):

- ``default``, ``gpt2``, ``gpt-2``: the GPT-2 split;
- ``smollm``, ``starcoder``, ``refact``, ``codeshell``: every digit on its own (``\\p{N}``),
  then the GPT-2 split -- what SmolLM2's own ``tokenizer.json`` does (``Digits`` then
  ``ByteLevel``). transformers 5 does not know this tag and keeps multi-digit runs whole;
- ``qwen2``: Qwen2's split; ``llama-bpe``/``llama3``: Llama 3's split, with llama.cpp's
  ``ignore_merges`` (a word found whole in the vocabulary is one token).

Any other tokenizer model or pre-tokenizer is refused by name. Tokens marked CONTROL (3) become
special added tokens, USER_DEFINED (4) plain added tokens, as llama.cpp matches both whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from semzo.model.gguf import GGUFModel

_GPT2_PRE = ("default", "gpt2", "gpt-2")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-v3": _LLAMA3_SPLIT}
PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_PRE + tuple(_SPLITS)
CONTROL, USER_DEFINED = 3, 4


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
    if kind != "gpt2":
        raise g.error(f"tokenizer.ggml.model {kind!r} is not supported (byte-level BPE 'gpt2')")
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
        i = g.value(f"tokenizer.ggml.{key}_token_id", None)
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise g.error(f"tokenizer.ggml.{key}_token_id: {i} outside the vocabulary")
        return tokens[int(i)]

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
