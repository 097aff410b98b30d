"""GGUF reading and writing against the peers: transformers' GGUF loader and llama.cpp.

    .venv/bin/python bench/gguf_files.py [--repeat 2] [--no-llamacpp]

(Not bench/gguf.py: a script of that name would shadow the gguf package it reads with.)

1. **Reading**: the offline SmolLM2-135M-Instruct Q4_1 GGUF (``make setup``) converted into a
   Hugging Face folder by semzo (``convert_gguf``: dequantized, un-permuted, tokenizer.json
   rebuilt), against transformers loading the same file (``from_pretrained(gguf_file=...)``,
   its own dequantization into a model); best wall time of ``--repeat`` each, the ratio.
2. **Families through GGUF**: a tiny random model of each family semzo writes (Llama, Llama
   3.1+ with llama3 rope scaling, Mistral, Qwen2, Qwen3, Gemma 2) made by transformers, exported by
   semzo (F32), then run by llama.cpp (``bench/llamacpp_peer.py`` in ``$BENCHVENV``, default
   ``.venv-bench``: ``make bench-llamacpp``) and read by transformers' GGUF loader: each one's
   logits against semzo's on the same 31-token prompt (max difference over the largest
   logit; llama.cpp keeps its KV cache in F16, so about 1e-4..1e-3 is agreement), and
   whether the argmax agrees at every position.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))         # ggufutil: the tests' random tiny models

SMALL = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPT = "The capital of France is a city that many people visit every year, and " * 2


def families():
    import transformers as tf
    return {
        "llama": lambda: tf.LlamaConfig(**SMALL, tie_word_embeddings=True),
        "llama3": lambda: tf.LlamaConfig(**SMALL, tie_word_embeddings=False,
                                         rope_scaling=dict(LLAMA3)),
        "mistral": lambda: tf.MistralConfig(**SMALL, head_dim=32, sliding_window=None,
                                            tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**SMALL, tie_word_embeddings=False),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, head_dim=128, tie_word_embeddings=True),
        "gemma2": lambda: tf.Gemma2Config(**{**SMALL, "num_attention_heads": 2,
                                             "num_key_value_heads": 1},
                                          head_dim=256, query_pre_attn_scalar=256,
                                          sliding_window=3),
    }


def reading(repeat: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from semzo.model import zoo
    from semzo.model.convert import convert_gguf
    src = zoo.packaged_gguf("smollm2")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            t0 = time.perf_counter()
            convert_gguf(src, Path(tmp) / f"out{i}")
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch.float32)
            theirs.append(time.perf_counter() - t0)
            del m
    a, b = min(ours), min(theirs)
    print(f"reading {src.name} ({src.stat().st_size / 2**20:.0f} MiB): semzo convert_gguf "
          f"{a:.2f} s best of {repeat} (runs {', '.join(f'{x:.2f}' for x in ours)}); "
          f"transformers from_pretrained(gguf_file) {b:.2f} s (runs "
          f"{', '.join(f'{x:.2f}' for x in theirs)}); ratio transformers / semzo {b / a:.2f}x")


def through_gguf(use_llamacpp: bool, threads: int) -> None:
    import torch
    from ggufutil import random_folder
    from transformers import AutoModelForCausalLM

    from semzo.model import Tokenizer, load_model, zoo
    from semzo.model.gguf_export import export_gguf
    py = ROOT / os.environ.get("BENCHVENV", ".venv-bench") / "bin" / "python"
    if use_llamacpp and not py.exists():
        print(f"llama.cpp: no {py} (make bench-llamacpp builds it); its column is left out")
        use_llamacpp = False
    tok_src = zoo.resolve_model_path("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, make in families().items():
            folder = random_folder(make(), tmp / name, tok_src)
            model = load_model(folder)
            ids, mask = Tokenizer.from_folder(folder)([PROMPT])
            ours = model.logits(ids, mask)[0]
            gguf = tmp / f"{name}.gguf"
            # general.name "tiny": transformers takes a llama file named "...mistral..." for
            # its mistral architecture, which its gguf package does not know
            export_gguf(model, gguf, gguf_type="f32", name="tiny")
            cols = []
            if use_llamacpp:
                np.save(tmp / "ids.npy", ids)
                r = subprocess.run([str(py), str(ROOT / "bench" / "llamacpp_peer.py"),
                                    str(gguf), str(tmp / "ids.npy"), "--threads", str(threads),
                                    "--repeat", "1", "--logits", str(tmp / "lz.npy")],
                                   capture_output=True, text=True, timeout=600, check=False)
                if r.returncode:
                    cols.append(f"llama.cpp failed: {r.stderr.strip().splitlines()[-1:]}")
                else:
                    ver = json.loads(r.stdout.strip().splitlines()[-1])["version"]
                    cols.append(_agree(f"llama.cpp {ver}", np.load(tmp / "lz.npy"), ours))
            ref = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name,
                                                       dtype=torch.float32).eval()
            with torch.no_grad():
                tz = ref(input_ids=torch.from_numpy(ids)).logits[0].numpy()
            cols.append(_agree("transformers' GGUF loader", tz, ours))
            print(f"{name:7s} {model.config.family:7s} -> GGUF (F32, "
                  f"{gguf.stat().st_size / 2**20:.1f} MiB): " + "; ".join(cols))


def _agree(who: str, theirs: np.ndarray, ours: np.ndarray) -> str:
    d = float(np.max(np.abs(theirs - ours)) / np.max(np.abs(ours)))
    same = float(np.mean(theirs.argmax(-1) == ours.argmax(-1)))
    return f"{who} vs semzo {d:.1e} of the largest logit, argmax equal at {same:.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    a = ap.parse_args()
    from semzo.backend import cpu_model
    print(f"bench/gguf_files.py: CPU {cpu_model()}, {a.threads} threads for llama.cpp")
    reading(a.repeat)
    through_gguf(not a.no_llamacpp, a.threads)


if __name__ == "__main__":
    main()
