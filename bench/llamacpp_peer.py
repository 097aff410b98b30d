"""llama.cpp's prompt processing timed on given token ids: the peer of ``bench/decoder.py
--peer llamacpp`` (issue 36). Runs in the separate bench environment ``make bench-llamacpp``
builds (``.venv-bench``: llama-cpp-python compiled from source on this machine); imports only
llama_cpp and numpy, never semzo.

    .venv-bench/bin/python bench/llamacpp_peer.py MODEL.gguf IDS.npy --threads 2 --repeat 3

``IDS.npy``: an int array (B, T). Each of the B rows is one sequence: the context is cleared
and the row is decoded as one batch of T tokens (``n_batch = n_ubatch = T``) with the logits
of every position kept (``logits_all``: semzo's ``logits`` returns all of them too), so a
forward is B x T tokens through the whole model and the LM head, as semzo's. Prints one JSON
line: the times of each forward (``--repeat`` of them, after one warm-up) and the
llama_cpp version; ``--logits OUT.npy`` also saves row 0's logits (the check against semzo's).
``--decode N`` (the peer of ``bench/generate.py --peer llamacpp``): row 0 is a prompt, then N
tokens are generated greedily, one token a step; prints the steps' times and the tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("ids")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--logits", default="")
    ap.add_argument("--decode", type=int, default=0,
                    help="N: time the greedy generation of N tokens after row 0 instead")
    a = ap.parse_args()
    import llama_cpp
    from llama_cpp import Llama

    ids = np.load(a.ids)
    b, t = ids.shape
    if a.decode:
        decode(a, llama_cpp, [int(x) for x in ids[0]])
        return
    llm = Llama(model_path=a.gguf, n_ctx=t, n_batch=t, n_ubatch=t, n_threads=a.threads,
                n_threads_batch=a.threads, logits_all=True, verbose=False, seed=0)

    def forward() -> None:
        for row in ids:
            llm.reset()
            llm.eval([int(x) for x in row])

    forward()                                   # warm-up (weights paged in, buffers made)
    if a.logits:
        llm.reset()
        llm.eval([int(x) for x in ids[0]])
        np.save(a.logits, np.asarray(llm.scores[:t], dtype=np.float32))
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "version": llama_cpp.__version__, "batch": b, "seq": t,
                      "threads": a.threads}))


def decode(a, llama_cpp, prompt: list[int]) -> None:
    """``--decode N``: the prompt evaluated (not timed), then N tokens generated greedily,
    one ``eval`` of one token each (the argmax of the last logits, as semzo's loop): the
    times of the N steps, ``--repeat`` times after a warm-up, and the tokens."""
    n = a.decode
    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=len(prompt) + n + 1, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=a.threads,
                          n_threads_batch=a.threads, logits_all=True, verbose=False, seed=0)

    def run():
        llm.reset()
        llm.eval(prompt)
        out = []
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        return time.perf_counter() - t0, out

    run()
    runs = [run() for _ in range(a.repeat)]
    print(json.dumps({"times": [r[0] for r in runs], "tokens": runs[0][1],
                      "version": llama_cpp.__version__, "threads": a.threads}))


if __name__ == "__main__":
    main()
