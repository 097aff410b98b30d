"""Tiny decoders for the LLM tests: a random Llama (or GPT-2) saved by transformers with a
small byte-level BPE tokenizer trained on the test sentences (so label words such as " good"
are one token, as with GPT-2 and SmolLM2)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
WORDS = ["good", "bad", "great", "awful", "red", "blue", "green", "cat", "dog", "sun",
         "moon", "tree", "It", "was", "is", "the"]


def tiny_tokenizer(folder: Path, vocab: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = (DATA / "model_sentences.txt").read_text(encoding="utf-8").splitlines()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False)
    tk.train_from_iterator(texts + [" ".join(" " + w for w in WORDS)] * 20, tr)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    return tk


def tiny_llama(folder: Path, seed: int = 0, layers: int = 2, hidden: int = 32,
               tie: bool = True, chat_template: str | None = None) -> Path:
    """A random LlamaForCausalLM (GQA: 4 heads, 2 KV heads) + tokenizer; eos = pad = id 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tk = tiny_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tk.get_vocab_size(), hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=96, eos_token_id=0, bos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=tie)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tc = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
          "pad_token": "<|endoftext|>", "model_max_length": 96}
    if chat_template is not None:
        tc["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return folder


def tiny_gpt2_hf(folder: Path, seed: int = 0) -> Path:
    """A random GPT2LMHeadModel + the same tokenizer; eos = id 0."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tk = tiny_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=tk.get_vocab_size(), n_positions=96, n_embd=32, n_layer=2,
                     n_head=4, eos_token_id=0, bos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    return folder
