"""Converters from corpora found on a Debian machine to semzo's JSONL format.

Each converter writes ``{"id": i, "text": ..., "label": ...}`` lines (ids ``0..N-1`` in a
stable order) atomically (temporary file in the same folder, fsync, rename) and returns the
number of records. They run on one process (not collective).

- :func:`fortunes`: the Debian ``fortunes`` package (about 15k quotes, 43 categories).
- :func:`debian`: package descriptions from ``apt-cache dumpavail`` (about 60k, label = Section).
- :func:`debian_sft`: instruction records (chat ``messages``, the ``sft`` task) from the same
  source: "What is the Debian package NAME for?" -> its one-line short description.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from glob import glob

import numpy as np

from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

FORTUNES_DIR = "/usr/share/games/fortunes"
APT_LISTS = "/var/lib/apt/lists"


def write_jsonl_atomic(out_path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write ``records`` as JSONL to ``out_path`` atomically; return how many were written.

    The data go to a temporary file next to ``out_path``, which is fsynced and renamed over it,
    so readers never see a half-written corpus. UTF-8, non-ASCII kept as is.
    """
    out_path = os.fspath(out_path)
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(out_path) + ".",
                               suffix=".tmp")
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False))
                f.write("\n")
                n += 1
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return n


# --- fortunes ------------------------------------------------------------------------------

def fortune_files(root: str = FORTUNES_DIR) -> list[str]:
    """Category files under ``root``: regular files (not symlinks) whose name has no dot.

    That leaves out the ``*.dat`` indexes and the ``*.u8`` symlinks (duplicates of the plain
    files); sub-folders (for instance ``off/``) are not entered. Sorted by name.
    """
    out = []
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if "." in name or os.path.islink(p) or not os.path.isfile(p):
            continue
        out.append(name)
    return out


def split_fortunes(content: str) -> list[str]:
    """Quotes of one fortune file: blocks separated by lines holding only ``%``.

    Leading and trailing blank lines and trailing whitespace are removed from each quote
    (indentation is kept: some quotes are ASCII art); empty blocks are dropped.
    """
    quotes, cur = [], []
    for line in content.split("\n"):
        if line.rstrip("\r") == "%":
            quotes.append(cur)
            cur = []
        else:
            cur.append(line.rstrip("\r"))
    quotes.append(cur)
    out = []
    for q in quotes:
        text = "\n".join(q).strip("\n").rstrip()
        if text.strip():
            out.append(text)
    return out


def iter_fortunes(root: str = FORTUNES_DIR) -> Iterator[dict]:
    """Records ``{"id", "text", "label"}`` of every quote, files by name, quotes in file order."""
    if not os.path.isdir(root):
        raise SemzoError(f"{root}: no such folder (install the Debian package 'fortunes')")
    i = 0
    for name in fortune_files(root):
        with open(os.path.join(root, name), "rb") as f:
            content = f.read().decode("utf-8", errors="replace")
        for text in split_fortunes(content):
            yield {"id": i, "text": text, "label": name}
            i += 1


def fortunes(out_path: str | os.PathLike, *, root: str = FORTUNES_DIR) -> int:
    """Convert the Debian ``fortunes`` corpus to JSONL at ``out_path``; return the count.

    label = category file name (``art``, ``computers``, ...); 15,217 quotes on Debian 12.
    """
    n = write_jsonl_atomic(out_path, iter_fortunes(root))
    log.info("wrote %d fortunes to %s", n, out_path)
    return n


# --- Debian package descriptions ----------------------------------------------------------

def iter_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Fields of each RFC 822 stanza of an apt index (``Packages``, ``Translation-*``).

    Continuation lines (starting with a space or a tab) are kept with their newline and
    leading space, so multi-line fields can be cleaned by the caller.
    """
    fields: dict[str, str] = {}
    key = None
    for line in text.split("\n"):
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, None
        elif line[0] in " \t":
            if key is not None:
                fields[key] += "\n" + line
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip()
            fields[key] = value.strip()
    if fields:
        yield fields


def clean_description(desc: str) -> str:
    """Short description, then the long one with Debian's markers removed.

    Long-description lines start with one space; a line holding only `` .`` is an empty line
    (paragraph break). Runs of blank lines are collapsed; the result is stripped.
    """
    first, *rest = desc.split("\n")
    lines = [first.strip()]
    for line in rest:
        body = line[1:] if line[:1] in (" ", "\t") else line
        lines.append("" if body.strip() == "." else body.rstrip())
    out: list[str] = []
    for line in lines:
        if line == "" and (not out or out[-1] == ""):
            continue
        out.append(line)
    return "\n".join(out).strip()


def translations_text(lists_dir: str = APT_LISTS) -> list[str]:
    """Contents of the English ``Translation-en`` indexes under ``lists_dir`` (maybe none).

    Debian keeps long descriptions there (keyed by ``Description-md5``) when apt downloads
    them (``Acquire::Languages`` includes ``en``); Docker images usually switch that off.
    Compressed indexes are read through ``apt-helper cat-file``.
    """
    out = []
    for p in sorted(glob(os.path.join(lists_dir, "*_i18n_Translation-en*"))):
        try:
            if p.endswith((".lz4", ".gz", ".xz", ".bz2", ".zst")):
                r = subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", p],
                                   capture_output=True, check=True)
                out.append(r.stdout.decode("utf-8", errors="replace"))
            else:
                with open(p, "rb") as f:
                    out.append(f.read().decode("utf-8", errors="replace"))
        except (OSError, subprocess.CalledProcessError) as exc:
            log.warning("cannot read %s: %s", p, exc)
    return out


def parse_debian(dumpavail: str, translations: Iterable[str] = ()) -> list[dict]:
    """Records ``{"id", "text", "label"}`` from ``apt-cache dumpavail`` output.

    text = cleaned description (short + long; the long part comes from the stanza itself or,
    if missing there, from ``translations`` by ``Description-md5``); label = ``Section``
    (``"unknown"`` when absent). The first stanza of each package name wins; stanzas without
    a description are skipped. Order: the order of ``dumpavail``.
    """
    long_by_md5: dict[str, str] = {}
    for tr in translations:
        for st in iter_stanzas(tr):
            md5, desc = st.get("Description-md5"), st.get("Description-en")
            if md5 and desc and md5 not in long_by_md5:
                long_by_md5[md5] = desc
    seen: set[str] = set()
    out: list[dict] = []
    for st in iter_stanzas(dumpavail):
        name, desc = st.get("Package"), st.get("Description")
        if not name or name in seen or not desc:
            continue
        seen.add(name)
        if "\n" not in desc:
            desc = long_by_md5.get(st.get("Description-md5", ""), desc)
        text = clean_description(desc)
        if not text:
            continue
        out.append({"id": len(out), "text": text, "label": st.get("Section", "unknown")})
    return out


def apt_dumpavail() -> str:
    """The text of ``apt-cache dumpavail`` (this machine's apt indexes)."""
    try:
        r = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SemzoError(f"apt-cache dumpavail failed: {exc}") from exc
    return r.stdout.decode("utf-8", errors="replace")


def debian(out_path: str | os.PathLike, *, dumpavail: str | None = None,
           lists_dir: str = APT_LISTS) -> int:
    """Convert Debian package descriptions to JSONL at ``out_path``; return the count.

    ``dumpavail``: the text of ``apt-cache dumpavail`` (run if not given). Without
    ``Translation-en`` indexes (``apt-get update -o Acquire::Languages=en``) only the short
    descriptions are available, and the texts are one line each.
    """
    dumpavail = apt_dumpavail() if dumpavail is None else dumpavail
    trans = translations_text(lists_dir)
    records = parse_debian(dumpavail, trans)
    if not records:
        raise SemzoError("apt-cache dumpavail lists no package descriptions "
                         "(run 'apt-get update' first)")
    n_long = sum("\n" in r["text"] for r in records)
    if not trans:
        log.warning("no Translation-en index under %s: short descriptions only", lists_dir)
    n = write_jsonl_atomic(out_path, records)
    log.info("wrote %d package descriptions (%d with a long description) to %s", n, n_long,
             out_path)
    return n


SFT_SYSTEM = "Answer in one short line."


def _short_descriptions(dumpavail: str) -> dict[str, str]:
    """Package name -> short description (3 to 12 words; the first stanza of each name)."""
    seen: dict[str, str] = {}
    for st in iter_stanzas(dumpavail):
        name, desc = st.get("Package"), st.get("Description")
        if not name or name in seen or not desc:
            continue
        short = desc.split("\n", 1)[0].strip()
        if 3 <= len(short.split()) <= 12:
            seen[name] = short
    return seen


def sft_records(dumpavail: str, n: int = 600) -> list[dict]:
    """Instruction records from ``apt-cache dumpavail`` output: for an evenly spaced subset of
    ``n`` packages (sorted by name; the first stanza of each name; short descriptions of 3 to
    12 words), ``{"id", "messages": [system, user question, assistant answer]}`` where the
    answer is the package's short description."""
    seen = _short_descriptions(dumpavail)
    names = sorted(seen)
    if n < len(names):
        names = [names[i * len(names) // n] for i in range(n)]
    return [{"id": i, "messages": [
        {"role": "system", "content": SFT_SYSTEM},
        {"role": "user", "content": f"What is the Debian package {name} for?"},
        {"role": "assistant", "content": seen[name]}]} for i, name in enumerate(names)]


def debian_sft(out_path: str | os.PathLike, *, dumpavail: str | None = None,
               n: int = 600) -> int:
    """Write :func:`sft_records` of this machine's apt indexes to ``out_path`` (offline once
    ``apt-get update`` has run, as ``make setup`` does); return the count."""
    dumpavail = apt_dumpavail() if dumpavail is None else dumpavail
    records = sft_records(dumpavail, n)
    if not records:
        raise SemzoError("apt-cache dumpavail lists no package descriptions "
                         "(run 'apt-get update' first)")
    n_out = write_jsonl_atomic(out_path, records)
    log.info("wrote %d instruction records (Debian package -> short description) to %s",
             n_out, out_path)
    return n_out


CHOICE_PROMPT = "Debian package: {name}\nWhat it is for:"


def choice_records(dumpavail: str, n: int = 600, k: int = 4, seed: int = 0) -> list[dict]:
    """Multiple-choice records from ``apt-cache dumpavail`` output: for ``n`` evenly spaced
    packages (sorted by name, offset by half a spacing from :func:`sft_records`' so that the
    two corpora share no package), ``{"id", "prompt": "Debian package: NAME\nWhat it is
    for:", "choices": [k short descriptions, each after a space], "answer"}``: the package's
    own short description and ``k - 1`` of other packages drawn at random (``seed``), the
    answer's position drawn too."""
    seen = _short_descriptions(dumpavail)
    names = sorted(seen)
    if len(names) < max(k, 2):
        return []
    if n < len(names):
        names_n = [names[(2 * i + 1) * len(names) // (2 * n)] for i in range(n)]
    else:
        names_n = names
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(names_n):
        own = seen[name]
        others: list[str] = []
        while len(others) < k - 1:
            d = seen[names[int(rng.integers(len(names)))]]
            if d != own and d not in others:
                others.append(d)
        ans = int(rng.integers(k))
        choices = others[:ans] + [own] + others[ans:]
        out.append({"id": i, "prompt": CHOICE_PROMPT.format(name=name),
                    "choices": [" " + c for c in choices], "answer": ans})
    return out


def debian_choice(out_path: str | os.PathLike, *, dumpavail: str | None = None,
                  n: int = 600) -> int:
    """Write :func:`choice_records` of this machine's apt indexes to ``out_path`` (offline once
    ``apt-get update`` has run, as ``make setup`` does); return the count."""
    dumpavail = apt_dumpavail() if dumpavail is None else dumpavail
    records = choice_records(dumpavail, n)
    if not records:
        raise SemzoError("apt-cache dumpavail lists too few package descriptions "
                         "(run 'apt-get update' first)")
    n_out = write_jsonl_atomic(out_path, records)
    log.info("wrote %d multiple-choice records (Debian package -> its short description "
             "among 4) to %s", n_out, out_path)
    return n_out


CONVERTERS: dict[str, Callable[..., int]] = {"fortunes": fortunes, "debian": debian,
                                             "debian-sft": debian_sft,
                                             "debian-choice": debian_choice}
