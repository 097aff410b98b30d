"""Helpers of the ZO fine-tuning tests: tiny random models written as Hugging Face folders
(numpy + safetensors + a word-level tokenizer.json, no torch), a small labelled corpus, and a
stand-in topology for one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = {
    0: "ship sail sea wave harbor captain anchor deck storm tide",
    1: "code bug compile linux kernel program debug python server disk",
    2: "cake bread sugar butter oven bake flour cream honey pie",
}
FILLER = "the a of and to in is it that was for on with as at by this be"


def corpus(n: int, seed: int = 0) -> list[dict]:
    """n records {id, text, label}: label-specific words mixed with filler words."""
    r = np.random.default_rng(seed)
    fill = FILLER.split()
    out = []
    for i in range(n):
        c = i % 3
        words = WORDS[c].split()
        k = int(r.integers(4, 12))
        toks = [words[j] if r.random() < 0.35 else fill[j % len(fill)]
                for j in r.integers(0, 10, size=k)]
        out.append({"id": i, "text": " ".join(toks), "label": f"class{c}"})
    return out


def write_corpus(path: Path, n: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus(n, seed)), encoding="utf-8")
    return path


def _tokenizer_json(folder: Path, vocab: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(folder / "tokenizer.json"))


def make_model(folder: Path, kind: str = "bert", layers: int = 2, hidden: int = 32,
               heads: int = 2, seed: int = 0) -> Path:
    """A random BERT (``kind="bert"``), GPT-2 (``"gpt2"``) or CausalLM (``"llama"`` untied,
    ``"llama_tied"``, ``"opt"``: see :func:`_causal`) folder the semzo loader reads."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]"] + sorted(set(" ".join([*WORDS.values(), FILLER]).split()))
    v = len(vocab)
    r = np.random.default_rng(seed)
    inter = 2 * hidden

    def w(*shape):
        return (r.normal(0.0, 0.2, size=shape)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    if kind in CAUSAL:
        cfg, t = _causal(kind, v, layers, hidden, heads, w)
    elif kind == "bert":
        cfg = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": v,
               "hidden_size": hidden, "num_hidden_layers": layers,
               "num_attention_heads": heads, "intermediate_size": inter,
               "max_position_embeddings": 64, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
               "hidden_act": "gelu", "pad_token_id": 0}
        e = "embeddings."
        t[f"{e}word_embeddings.weight"] = w(v, hidden)
        t[f"{e}position_embeddings.weight"] = w(64, hidden)
        t[f"{e}token_type_embeddings.weight"] = w(2, hidden)
        t[f"{e}LayerNorm.weight"] = np.ones(hidden, np.float32)
        t[f"{e}LayerNorm.bias"] = np.zeros(hidden, np.float32)
        for i in range(layers):
            p = f"encoder.layer.{i}."
            for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                      "attention.output.dense"):
                t[f"{p}{m}.weight"] = w(hidden, hidden)
                t[f"{p}{m}.bias"] = w(hidden)
            t[f"{p}intermediate.dense.weight"] = w(inter, hidden)
            t[f"{p}intermediate.dense.bias"] = w(inter)
            t[f"{p}output.dense.weight"] = w(hidden, inter)
            t[f"{p}output.dense.bias"] = w(hidden)
            for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
                t[f"{p}{ln}.weight"] = (1.0 + w(hidden)).astype(np.float32)
                t[f"{p}{ln}.bias"] = w(hidden)
        t["pooler.dense.weight"] = w(hidden, hidden)
        t["pooler.dense.bias"] = w(hidden)
    else:
        cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": v,
               "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": 64,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": inter,
               "pad_token_id": 0}
        t["wte.weight"] = w(v, hidden)
        t["wpe.weight"] = w(64, hidden)
        for i in range(layers):
            p = f"h.{i}."
            for ln in ("ln_1", "ln_2"):
                t[f"{p}{ln}.weight"] = (1.0 + w(hidden)).astype(np.float32)
                t[f"{p}{ln}.bias"] = w(hidden)
            t[f"{p}attn.c_attn.weight"] = w(hidden, 3 * hidden)
            t[f"{p}attn.c_attn.bias"] = w(3 * hidden)
            t[f"{p}attn.c_proj.weight"] = w(hidden, hidden)
            t[f"{p}attn.c_proj.bias"] = w(hidden)
            t[f"{p}mlp.c_fc.weight"] = w(hidden, inter)
            t[f"{p}mlp.c_fc.bias"] = w(inter)
            t[f"{p}mlp.c_proj.weight"] = w(inter, hidden)
            t[f"{p}mlp.c_proj.bias"] = w(hidden)
        t["ln_f.weight"] = np.ones(hidden, np.float32)
        t["ln_f.bias"] = np.zeros(hidden, np.float32)
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_file(t, str(folder / "model.safetensors"))
    _tokenizer_json(folder, vocab)
    return folder


CAUSAL = ("llama", "llama_tied", "opt")


def _causal(kind: str, v: int, layers: int, hidden: int, heads: int, w):
    """config.json and tensors of a tiny Llama (GQA: kv heads = heads / 2, untied or tied
    head) or OPT (pre-LN, learned positions, tied) for the CausalLM loader."""
    from semzo.model import families
    from semzo.model.causal import expected_tensors

    if kind == "opt":
        cfg = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "vocab_size": v,
               "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
               "ffn_dim": 2 * hidden, "max_position_embeddings": 64,
               "do_layer_norm_before": True, "pad_token_id": 0}
    else:
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": v,
               "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
               "num_key_value_heads": max(heads // 2, 1), "intermediate_size": 2 * hidden,
               "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": kind == "llama_tied", "pad_token_id": 0}
    spec = families.read_spec(families.find(cfg), cfg, Path("config.json"))
    pre = "model."
    t = {}
    for name, shape, _ in expected_tensors(spec, pre):
        t[name] = (1.0 + w(*shape)).astype(np.float32) if len(shape) == 1 and \
            name.endswith(("norm.weight", "layernorm.weight", "layer_norm.weight")) \
            else w(*shape)
    return cfg, t


class SoloComm:
    """The few communicator calls the engine makes, for one process without MPI."""

    def Get_size(self):
        return 1

    def Get_rank(self):
        return 0

    def Allgather(self, send, recv):
        recv[0] = send

    def Allreduce(self, send, recv=None, op=None):
        return None


class SoloTopo:
    """A one-rank stand-in for :class:`semzo.topology.Topology` (no MPI needed)."""

    rank, size, node_id, n_nodes, n_switches = 0, 1, 0, 1, 1
    world = SoloComm()

    def allreduce(self, buf, op=None):
        return buf

    def allgather(self, buf):
        return np.asarray(buf)[None].copy()

    def bcast(self, buf, root=0):
        return buf


class StopAt:
    """A stand-in :class:`~semzo.finetune.loop.StopRequest` that stops after one step (a
    signal): the resumed run's deck, train.steps included, is the uninterrupted one's."""

    def __init__(self, step: int) -> None:
        self.at, self.signum = step, 0

    def start(self, step: int) -> None:
        pass

    def agreed(self, step: int) -> int:
        self.signum = 10 if step == self.at else 0
        return self.signum
