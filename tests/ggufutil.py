"""Test helpers: write small GGUF files with gguf.GGUFWriter, and reference decoders of the
K-quant, Q5_0 and Q8_0 blocks written from ggml's C code (``dequantize_row_q{4,5,6}_K``,
``dequantize_row_q5_0``, ``dequantize_row_q8_0``), independent of the gguf package semzo
calls."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from semzo.model.gguf import permute_qk

# a tiny byte-level BPE vocabulary: control token, the 256 byte symbols, a few merges
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n"]


def byte_symbols() -> list[str]:
    from semzo.model.gguf_tokenizer import _byte_alphabet
    return [_byte_alphabet()[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 0 = <|endoftext|> (control), 1 = <|im_start|>
    (control), 2 = <|im_end|> (control), then 256 byte symbols, then one token per merge."""
    merged = ["".join(m.split(" ")) for m in _MERGES]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_symbols(), *merged]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, list(_MERGES)


def add_tokenizer(w: gguf.GGUFWriter, pre: str = "smollm", template: str | None = None) -> int:
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    return len(tokens)


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict, *, tokenizer: bool = True,
               pre: str = "smollm", template: str | None = None,
               floats: dict | None = None, split_max_tensors: int = 0) -> Path:
    """``meta``: key (without the arch prefix) -> int/float/str; ``tensors``: GGUF name ->
    float array (float16 written F16, others F32) or ``(uint8 bytes, GGMLQuantizationType)``;
    ``floats``: full keys written last as float32 (replacing the tokenizer's);
    ``split_max_tensors``: shards of at most that many tensors (``PATH-0000k-of-0000N.gguf``,
    as llama.cpp's gguf-split names them)."""
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for k, v in meta.items():
        key = f"{arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_string(key, v)
    if tokenizer:
        add_tokenizer(w, pre, template)
    for k, v in (floats or {}).items():
        w.kv_data[0][k] = gguf.GGUFValue(value=v, type=gguf.GGUFValueType.FLOAT32)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            t = np.asarray(t)
            w.add_tensor(name, np.ascontiguousarray(
                t, dtype=np.float16 if t.dtype == np.float16 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_HF_TO_GGUF = {v: k for k, v in {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm"}.items()}


def hf_to_gguf(state: dict[str, np.ndarray], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """A Hugging Face Llama/Qwen2/Qwen3 state dict as GGUF tensors, permuted as llama.cpp's
    ``convert_hf_to_gguf.py`` does for llama (q with the heads, k with the KV heads)."""
    out = {}
    for name, w in state.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            stem = _HF_TO_GGUF[module]
            if arch == "llama" and stem == "attn_q":
                w = permute_qk(w, cfg["num_attention_heads"])
            elif arch == "llama" and stem == "attn_k":
                w = permute_qk(w, cfg["num_key_value_heads"])
            out[f"blk.{i}.{stem}.{kind}"] = w
    return out


def random_folder(cfg, out: Path, tokenizer_from: Path) -> Path:
    """A transformers model of config ``cfg`` with weights drawn from N(0, 0.2) (seed 0),
    saved in ``out`` with the tokenizer files of ``tokenizer_from`` beside it."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    m.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_from / f, out / f)
    return out


def tiny_config(vocab: int, tie: bool, max_positions: int = 64) -> dict:
    """The config fields of the tiny transformers decoders the GGUF tests build (hidden 64,
    2 blocks, 4 heads, 2 KV heads)."""
    return {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": tie, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 2}


def hf_meta(cfg: dict) -> dict:
    return {"block_count": cfg["num_hidden_layers"], "context_length":
            cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "rope.freq_base": float(cfg["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "vocab_size": cfg["vocab_size"]}


# ---- reference K-quant decoders (ggml-quants.c), one block at a time --------------------
def _f16(b: np.ndarray) -> np.float32:
    return np.float32(np.frombuffer(bytes(b), dtype=np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return (int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            int((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


def ref_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin, sc, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]
    y = []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        q = qs[32 * j:32 * j + 32]
        y += [np.float32(d * s1) * np.float32(v & 0xF) - np.float32(dmin * m1) for v in q]
        y += [np.float32(d * s2) * np.float32(v >> 4) - np.float32(dmin * m2) for v in q]
    return np.array(y, dtype=np.float32)


def ref_q5_k(block: np.ndarray) -> np.ndarray:
    d, dmin, sc = _f16(block[0:2]), _f16(block[2:4]), block[4:16]
    qh, qs = block[16:48], block[48:176]
    y = []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        ql, u1, u2 = qs[32 * j:32 * j + 32], 1 << (2 * j), 2 << (2 * j)
        y += [np.float32(d * s1) * np.float32((ql[i] & 0xF) + (16 if qh[i] & u1 else 0))
              - np.float32(dmin * m1) for i in range(32)]
        y += [np.float32(d * s2) * np.float32((ql[i] >> 4) + (16 if qh[i] & u2 else 0))
              - np.float32(dmin * m2) for i in range(32)]
    return np.array(y, dtype=np.float32)


def ref_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh = block[0:128].astype(int), block[128:192].astype(int)
    sc, d = block[192:208].view(np.int8).astype(int), _f16(block[208:210])
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for i in range(32):
            q1 = ((L[i] & 0xF) | (((H[i] >> 0) & 3) << 4)) - 32
            q2 = ((L[i + 32] & 0xF) | (((H[i] >> 2) & 3) << 4)) - 32
            q3 = ((L[i] >> 4) | (((H[i] >> 4) & 3) << 4)) - 32
            q4 = ((L[i + 32] >> 4) | (((H[i] >> 6) & 3) << 4)) - 32
            s = i // 16
            for off, q, k in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                y[128 * n + i + off] = np.float32(d * np.float32(S[s + k])) * np.float32(q)
    return y


def ref_q5_0(block: np.ndarray) -> np.ndarray:
    """``dequantize_row_q5_0``: f16 d, 32 high bits qh (little-endian), 16 bytes of nibbles;
    element j takes bit j of qh, element j + 16 bit j + 16; value (q - 16) * d."""
    d, qs = _f16(block[0:2]), block[6:22]
    qh = int.from_bytes(bytes(block[2:6]), "little")
    y = np.zeros(32, dtype=np.float32)
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        y[j] = np.float32(((int(qs[j]) & 0x0F) | xh0) - 16) * d
        y[j + 16] = np.float32(((int(qs[j]) >> 4) | xh1) - 16) * d
    return y


def ref_q8_0(block: np.ndarray) -> np.ndarray:
    """``dequantize_row_q8_0``: f16 d, 32 int8 values; value q * d."""
    return block[2:34].view(np.int8).astype(np.float32) * _f16(block[0:2])


def random_k_blocks(qtype: gguf.GGMLQuantizationType, n_blocks: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Random bytes for ``n_blocks`` quantized blocks (K-quants, Q5_0, Q8_0) with finite
    float16 scales."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        b[:, 208:210] = scales[:, :2]
    elif qtype in (gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q8_0):
        b[:, 0:2] = scales[:, :2]
    else:
        b[:, 0:4] = scales
    return b
