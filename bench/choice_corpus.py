"""A second multiple-choice corpus that no deck or test uses, for checking the choice deck on
data it was not tuned on (issue 31): "Description: DESCRIPTION / Debian package name:" with 4
package names to choose from, the package's own and 3 others drawn with a fixed seed.

The packages are evenly spaced over this machine's apt index (short descriptions of 3 to 12
words), offset by a quarter of a spacing so that they are neither data/debian-sft.jsonl's
(offset 0) nor data/debian-choice.jsonl's (offset a half).

    python bench/choice_corpus.py /tmp/names-choice.jsonl [--n 600] [--seed 1]
    python bench/zo_convergence.py --task choice --corpus /tmp/names-choice.jsonl ...

``--sft``: the same packages as instruction records for the ``sft`` task, ``{"prompt": "Name
the Debian package: DESC\nPackage:", "completion": " NAME"}``.

``--topics science,art,...``: a corpus of another kind, from data/fortunes.jsonl (categories
no deck or test uses): "Fortune: TEXT / Topic:" with 4 of the listed categories to choose
from, the fortune's own and 3 others drawn with the seed, ``--n`` records split evenly over
the categories (fortunes of at most 300 characters, the first ones of each category).

    python bench/choice_corpus.py /tmp/topics-choice.jsonl --topics science,art,politics,\
        startrek,literature,work
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PROMPT = "Description: {desc}\nDebian package name:"


def _packages(dumpavail: str, n: int) -> tuple[dict[str, str], list[str], list[str]]:
    """(name -> short description, all names sorted, the n picked: a quarter spacing in)."""
    from semzo.corpus.convert import _short_descriptions

    seen = _short_descriptions(dumpavail)
    names = sorted(seen)
    picked = [names[(4 * i + 1) * len(names) // (4 * n)] for i in range(min(n, len(names)))]
    return seen, names, picked


def records(dumpavail: str, n: int, k: int = 4, seed: int = 1) -> list[dict]:
    seen, names, picked = _packages(dumpavail, n)
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(picked):
        others: list[str] = []
        while len(others) < k - 1:
            o = names[int(rng.integers(len(names)))]
            if o != name and o not in others and seen[o] != seen[name]:
                others.append(o)
        ans = int(rng.integers(k))
        choices = others[:ans] + [name] + others[ans:]
        out.append({"id": i, "prompt": PROMPT.format(desc=seen[name]),
                    "choices": [" " + c for c in choices], "answer": ans})
    return out


def sft_records(dumpavail: str, n: int) -> list[dict]:
    seen, _, picked = _packages(dumpavail, n)
    return [{"id": i, "prompt": f"Name the Debian package: {seen[name]}\nPackage:",
             "completion": " " + name} for i, name in enumerate(picked)]


TOPIC_PROMPT = "Fortune: {text}\nTopic:"


def topic_records(fortunes: str, topics: list[str], n: int, k: int = 4,
                  seed: int = 1) -> list[dict]:
    import json

    if len(set(topics)) < k:
        raise SystemExit(f"--topics: need at least {k} different categories")
    per = n // len(topics)
    texts: dict[str, list[str]] = {t: [] for t in topics}
    with open(fortunes, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            t = r.get("label")
            if t in texts and len(texts[t]) < per and len(r["text"]) <= 300:
                texts[t].append(" ".join(r["text"].split()))
    short = [t for t in topics if len(texts[t]) < per]
    if short:
        raise SystemExit(f"--topics: fewer than {per} short fortunes in {short}")
    rng = np.random.default_rng(seed)
    out = []
    for t in topics:
        for text in texts[t]:
            others = [o for o in topics if o != t]
            pick = [others[int(i)] for i in rng.permutation(len(others))[:k - 1]]
            ans = int(rng.integers(k))
            choices = pick[:ans] + [t] + pick[ans:]
            out.append({"id": len(out), "prompt": TOPIC_PROMPT.format(text=text),
                        "choices": [" " + c for c in choices], "answer": ans})
    order = rng.permutation(len(out))
    return [out[int(i)] for i in order]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sft", action="store_true", help="prompt/completion records instead")
    p.add_argument("--topics", default="", help="comma-separated fortune categories: the "
                   "topic corpus from data/fortunes.jsonl instead")
    p.add_argument("--fortunes", default=str(ROOT / "data" / "fortunes.jsonl"))
    a = p.parse_args()
    from semzo.corpus.convert import apt_dumpavail, write_jsonl_atomic

    if a.topics:
        recs = topic_records(a.fortunes, a.topics.split(","), a.n, seed=a.seed)
        print(f"{write_jsonl_atomic(a.out, recs)} records -> {a.out}")
        return

    dump = apt_dumpavail()
    recs = sft_records(dump, a.n) if a.sft else records(dump, a.n, seed=a.seed)
    print(f"{write_jsonl_atomic(a.out, recs)} records -> {a.out}")


if __name__ == "__main__":
    main()
