"""The user documentation stays in step with the code.

(a) every deck key (``semzo.deck.SECTIONS``) is explained in docs/deck-guide.md, inside the
    part of the page that belongs to its section (or named there as ``section.key``);
(b) every subcommand of the CLI appears in docs/guide.md as ``semzo <cmd>``;
(c) every relative Markdown link in docs/*.md and README.md points to a file that exists, and
    an ``#anchor`` into a Markdown file to one of its headings;
(d) every ``section.key`` written in the user pages names a key that exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest
from mpiutil import ROOT

from semzo.cli import _parser
from semzo.deck import SECTIONS

DOCS = ROOT / "docs"
GUIDE = DOCS / "guide.md"
DECK_GUIDE = DOCS / "deck-guide.md"
USER_PAGES = [GUIDE, DECK_GUIDE, DOCS / "tuning.md", DOCS / "design.md"]
LINKED_PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SECTION_KEY = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, SECTIONS)) +
                         r")\.([A-Za-z_]\w*)")
# `model.h5`, `checkpoint.md` ...: file names, not deck keys
FILE_SUFFIXES = {"h5", "md", "png", "csv", "json", "jsonl", "toml", "py", "safetensors",
                 "txt", "sh", "tmp", "pbs", "sbatch", "yml"}


def _prose_lines(text: str) -> list[tuple[str, bool]]:
    """(line, inside a fenced code block) for every line."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            out.append((line, True))
            fenced = not fenced
            continue
        out.append((line, fenced))
    return out


def _headings(text: str) -> list[tuple[int, int, str]]:
    """(line number, level, heading text) of the headings outside code blocks."""
    out = []
    for i, (line, fenced) in enumerate(_prose_lines(text)):
        m = None if fenced else HEADING.match(line)
        if m:
            out.append((i, len(m.group(1)), m.group(2)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links keep their text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, _, h in _headings(text):
        s = _slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def _section_parts(text: str) -> dict[str, str]:
    """Deck section -> the text under every heading that names ``[section]``, down to the next
    heading of the same or a higher level."""
    lines = text.splitlines()
    heads = _headings(text)
    parts: dict[str, str] = {}
    for j, (i, level, h) in enumerate(heads):
        end = next((k for k, lv, _ in heads[j + 1:] if lv <= level), len(lines))
        for name in SECTIONS:
            if f"[{name}]" in h:
                parts[name] = parts.get(name, "") + "\n".join(lines[i:end]) + "\n"
    return parts


def _commands() -> list[str]:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    return []


DECK_KEYS = [(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


# ---------------------------------------------------------------------------- (a) deck keys
def test_deck_guide_has_a_part_per_section():
    parts = _section_parts(DECK_GUIDE.read_text(encoding="utf-8"))
    missing = [s for s in SECTIONS if s not in parts]
    assert not missing, f"docs/deck-guide.md has no heading naming [{'], ['.join(missing)}]"


@pytest.mark.parametrize("section,key", DECK_KEYS, ids=[f"{s}.{k}" for s, k in DECK_KEYS])
def test_every_deck_key_in_deck_guide(section, key):
    text = DECK_GUIDE.read_text(encoding="utf-8")
    named = {m.groups() for m in SECTION_KEY.finditer(text)}
    part = _section_parts(text).get(section, "")
    in_part = re.search(rf"`{re.escape(key)}(`| *=)", part) is not None
    assert (section, key) in named or in_part, (
        f"docs/deck-guide.md does not explain {section}.{key}: name it as `{key}` under the "
        f"[{section}] heading (or as {section}.{key})")


# ---------------------------------------------------------------------------- (b) commands
def test_cli_has_subcommands():
    cmds = _commands()
    assert "run" in cmds and "check" in cmds, cmds


@pytest.mark.parametrize("cmd", _commands())
def test_every_cli_command_in_guide(cmd):
    text = GUIDE.read_text(encoding="utf-8")
    assert re.search(rf"semzo {re.escape(cmd)}(?![\w-])", text), \
        f"docs/guide.md never shows `semzo {cmd}`"


# ---------------------------------------------------------------------------- (c) links
def _links(path) -> list[tuple[int, str]]:
    out = []
    for n, (line, fenced) in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
        if fenced:
            continue
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((n, m.group(1)))
    return out


@pytest.mark.parametrize("page", LINKED_PAGES, ids=[p.name for p in LINKED_PAGES])
def test_relative_links_resolve(page):
    bad = []
    for line, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):           # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}:{line}: {target} (no such file {dest})")
        elif anchor and dest.suffix == ".md" and \
                anchor not in _anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{page.name}:{line}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_link_checker_sees_links():
    """The checker must find links, anchors included (a regex that matches nothing would let
    every page pass), and skip links inside code."""
    guide = [t for _, t in _links(GUIDE)]
    deck_guide = [t for _, t in _links(DECK_GUIDE)]
    assert "deck-guide.md" in guide
    assert any(t.startswith("tuning.md#") for t in deck_guide)
    assert "the-sharding-experiment-experiment" in _anchors(DECK_GUIDE.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------- (d) stale keys
@pytest.mark.parametrize("page", USER_PAGES, ids=[p.name for p in USER_PAGES])
def test_user_pages_name_only_existing_keys(page):
    fields = {s: {f.name for f in dataclasses.fields(cls)} for s, cls in SECTIONS.items()}
    bad = sorted({f"{s}.{k}" for s, k in (m.groups() for m in SECTION_KEY.finditer(
        page.read_text(encoding="utf-8"))) if k not in FILE_SUFFIXES and k not in fields[s]})
    assert not bad, f"{page.name} names deck keys that do not exist: {', '.join(bad)}"
