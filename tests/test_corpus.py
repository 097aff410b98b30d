"""Corpus reader (byte-range split, parsing, errors under MPI) and converters."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpiutil import ROOT, check, mpirun

from semzo.corpus import convert
from semzo.corpus.jsonl import _byte_range, parse_line, read_lines
from semzo.runtime import SemzoError

SCRIPTS = ROOT / "tests" / "mpi"


# --- byte-range split (no MPI needed) -------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(lines=st.lists(st.text(alphabet=st.characters(blacklist_characters="\n",
                                                                 blacklist_categories=("Cs",)), max_size=40),
                      max_size=30),
       trailing_newline=st.booleans(), nranks=st.integers(1, 9))
def test_byte_ranges_cover_every_line_once(tmp_path_factory, lines, trailing_newline, nranks):
    content = "\n".join(lines) + ("\n" if trailing_newline and lines else "")
    path = tmp_path_factory.mktemp("split") / "f.jsonl"
    data = content.encode("utf-8")
    path.write_bytes(data)
    got = []
    for r in range(nranks):
        got += read_lines(str(path), *_byte_range(len(data), r, nranks))
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()
    assert got == expected


def test_byte_range_owner_is_the_rank_of_the_first_byte(tmp_path):
    # lines of 10 bytes, 4 ranks on 100 bytes: rank r owns bytes [25r, 25r+25)
    path = tmp_path / "f"
    path.write_bytes(b"".join(b"%09d\n" % i for i in range(10)))
    owners = [read_lines(str(path), *_byte_range(100, r, 4)) for r in range(4)]
    # line starts: 0,10,...,90; rank 0: 0,10,20; rank 1: 30,40; rank 2: 50,60,70; rank 3: 80,90
    assert [len(o) for o in owners] == [3, 2, 3, 2]


# --- line parsing ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    (b'{"text": "a"}', ("a", ..., ...)),
    (b'{"text": "a", "label": "x", "id": 3, "other": [1]}', ("a", "x", 3)),
    (b'{"text": "", "label": 7}\r', ("", "7", ...)),
    ('{"text": "é中😀"}'.encode(), ("é中😀", ..., ...)),
    (b"   ", None), (b"", None), (b"\r", None),
])
def test_parse_line_valid(raw, expected):
    assert parse_line(raw) == expected


@pytest.mark.parametrize("raw, fragment", [
    (b'{"text": "a"', "invalid JSON"),
    (b'{"text": "\xff"}', "invalid UTF-8"),
    (b'["text"]', "expected a JSON object, got list"),
    (b'{"label": "x"}', "missing 'text'"),
    (b'{"text": 3}', "'text' must be a string, got integer"),
    (b'{"text": null}', "'text' must be a string, got null"),
    (b'{"text": "a", "label": 1.5}', "'label' must be a string or an integer, got number"),
    (b'{"text": "a", "label": true}', "got boolean"),
    (b'{"text": "a", "label": null}', "got null"),
    (b'{"text": "a", "id": "3"}', "'id' must be an integer, got string"),
    (b'{"text": "a", "id": -1}', "'id' must lie in [0, 2**63)"),
    (b'{"text": "a", "id": 9223372036854775808}', "'id' must lie in [0, 2**63)"),
])
def test_parse_line_errors(raw, fragment):
    msg = parse_line(raw)
    assert isinstance(msg, str) and fragment in msg, msg


_ESCAPING_LINES = [     # lines that used to escape as tracebacks (or later as UnicodeEncodeError)
    (b'{"text": "a", "id": ' + b"7" * 5000 + b"}", "text", "an integer with too many digits"),
    (b"[" * 100_000 + b"]" * 100_000, "text", "nested too deeply"),
    (b'{"text": "a", "label": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "text",
     "nested too deeply"),
    (rb'{"text": "\ud800", "label": "\udc00"}', "text", "'text' holds a lone surrogate"),
    (rb'{"text": "ok", "label": "\udc00"}', "text", "'label' holds a lone surrogate"),
    (rb'{"prompt": "p", "completion": "x\ud800"}', "sft", "'completion' holds a lone surr"),
    (rb'{"messages": [{"role": "assistant", "content": "\udfff"}]}', "sft",
     "'content' of messages[0] holds a lone surrogate"),
    (rb'{"prompt": "p", "choices": ["a", "\ud800b"], "answer": 0}', "choice",
     "choices[1] holds a lone surrogate"),
]


@pytest.mark.parametrize("raw, kind, fragment", _ESCAPING_LINES)
def test_parse_line_errors_that_used_to_escape(raw, kind, fragment):
    msg = parse_line(raw, kind)
    assert isinstance(msg, str) and fragment in msg, msg


def test_escaping_lines_give_the_file_and_line(tmp_path):
    from mpi4py import MPI

    from semzo.corpus.jsonl import read_jsonl_slice
    for n, (raw, kind, fragment) in enumerate(_ESCAPING_LINES):
        path = tmp_path / f"bad{n}.jsonl"
        good = b'{"prompt": "p", "choices": ["a", "b"], "answer": 0}' if kind == "choice" \
            else b'{"prompt": "p", "completion": "c"}' if kind == "sft" else b'{"text": "t"}'
        path.write_bytes(good + b"\n\n" + raw + b"\n" + good + b"\n")
        with pytest.raises(SemzoError) as exc:
            read_jsonl_slice(path, MPI.COMM_SELF, kind)
        assert str(exc.value).startswith(f"{path}:3: ") and fragment in str(exc.value), exc.value
        assert "\n" not in str(exc.value)


# --- the reader under MPI -------------------------------------------------------------------

def _write_case(folder, name, lines, texts, labels, ids, **extra):
    (folder / f"{name}.jsonl").write_bytes(b"".join(lines))
    (folder / f"{name}.expected.json").write_text(
        json.dumps({"texts": texts, "labels": labels, "ids": ids, **extra}))


@pytest.fixture(scope="module")
def corpus_cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus_cases")
    # mixed: blank lines, CRLF, unicode, a long line, int labels, no final newline
    lines, texts, labels = [], [], []
    for i in range(60):
        t = f"record {i} é中😀 \"quoted\"\nsecond line" + ("x" * 5000 if i == 17 else "")
        lab = i % 3 if i % 5 == 0 else f"cat{i % 4}"
        end = b"\r\n" if i % 7 == 0 else b"\n"
        lines.append(json.dumps({"text": t, "label": lab, "extra": [i]}).encode() + end)
        if i % 9 == 4:
            lines.append(b"   \n" if i % 2 else b"\n")
        texts.append(t)
        labels.append(str(lab))
    lines[-1] = lines[-1].rstrip(b"\r\n")
    _write_case(d, "mixed", lines, texts, labels, list(range(60)))
    # explicit ids, no labels
    ids = [1000 - 7 * i for i in range(25)]
    _write_case(d, "ids", [json.dumps({"id": j, "text": f"t{j}"}).encode() + b"\n" for j in ids],
                [f"t{j}" for j in ids], None, ids)
    # fewer records than ranks, a blank first line
    _write_case(d, "tiny", [b"\n", b'{"text": "only"}\n', b'{"text": "two"}\n'],
                ["only", "two"], None, [0, 1])
    _write_case(d, "empty", [], [], None, [])
    _write_case(d, "blank_only", [b"\n", b"  \n", b"\n"], [], None, [])
    # equal-length lines: balanced slices
    lines = [json.dumps({"text": f"{i:06d}", "label": "a"}).encode() + b"\n" for i in range(400)]
    _write_case(d, "balanced", lines, [f"{i:06d}" for i in range(400)], ["a"] * 400,
                list(range(400)), balanced=True)
    return d


@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_read_jsonl_slice_mpi(corpus_cases, nranks):
    proc = check(mpirun(nranks, [str(SCRIPTS / "corpus_read.py"), str(corpus_cases)],
                        timeout=60))
    assert f"ok: 6 files on {nranks} ranks" in proc.stdout


def _bad_corpus(path, bad_lines, n=40, bad=b'{"text": 12}'):
    """n lines of equal length; the given 1-based lines replaced by ``bad`` (padded)."""
    width = 30
    out = []
    for i in range(1, n + 1):
        line = bad if i in bad_lines else json.dumps({"text": f"line {i}"}).encode()
        out.append(line.ljust(width) + b"\n")
    path.write_bytes(b"".join(out))
    return path


def _run_error(path, nranks):
    t0 = time.monotonic()
    proc = mpirun(nranks, [str(SCRIPTS / "corpus_error.py"), str(path)], timeout=30)
    return proc, time.monotonic() - t0


def test_malformed_line_read_by_rank_2_ends_all_ranks(tmp_path):
    # 40 lines of 31 bytes on 4 ranks: rank 2 owns lines 21..30
    path = _bad_corpus(tmp_path / "bad.jsonl", {25})
    proc, elapsed = _run_error(path, 4)
    assert proc.returncode != 0 and elapsed < 20, (proc.returncode, elapsed, proc.stderr)
    assert "no error raised" not in proc.stdout
    needle = f"{path}:25: 'text' must be a string, got integer"
    assert proc.stderr.count(needle) == 1, proc.stderr
    assert proc.stderr.count(f"{path}:") == 1, proc.stderr


def test_first_bad_line_of_the_file_is_reported(tmp_path):
    path = _bad_corpus(tmp_path / "bad2.jsonl", {36, 7}, bad=b'{"text": "a"')
    proc, elapsed = _run_error(path, 4)
    assert proc.returncode == 2 and elapsed < 20, (proc.returncode, proc.stderr)
    assert proc.stderr.count(f"{path}:7: invalid JSON") == 1, proc.stderr
    assert f"{path}:36" not in proc.stderr


def test_label_on_some_records_only_is_an_error(tmp_path):
    path = tmp_path / "mix.jsonl"
    lines = [json.dumps({"text": f"t{i}", **({"label": "a"} if i != 33 else {})})
             for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    proc, _ = _run_error(path, 2)
    assert proc.returncode == 2
    assert proc.stderr.count(f"{path}:34: record has no 'label' but line 1 has one") == 1, \
        proc.stderr


def test_missing_file(tmp_path):
    proc, _ = _run_error(tmp_path / "nope.jsonl", 2)
    assert proc.returncode == 2
    assert proc.stderr.count("nope.jsonl: no such file") == 1, proc.stderr


# --- converters -----------------------------------------------------------------------------

def test_split_fortunes():
    content = "first\n  quote\n%\n\n%\nsecond  \n\n%\n   art\n%\n"
    assert convert.split_fortunes(content) == ["first\n  quote", "second", "   art"]


def test_fortune_files_skip_dat_links_and_folders(tmp_path):
    for name in ("art", "zen", "art.dat", "zen.dat"):
        (tmp_path / name).write_text("a\n%\nb\n")
    os.symlink("art", tmp_path / "art.u8")
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "rude").write_text("x\n")
    assert convert.fortune_files(str(tmp_path)) == ["art", "zen"]
    out = tmp_path / "out" / "f.jsonl"
    assert convert.fortunes(out, root=str(tmp_path)) == 4
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs == [{"id": 0, "text": "a", "label": "art"}, {"id": 1, "text": "b", "label": "art"},
                    {"id": 2, "text": "a", "label": "zen"}, {"id": 3, "text": "b", "label": "zen"}]


def test_fortunes_real_corpus(tmp_path):
    out = tmp_path / "fortunes.jsonl"
    n = convert.fortunes(out)
    recs = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert n == len(recs) and 14000 < n < 17000, n     # 15,217 on Debian 12
    assert [r["id"] for r in recs] == list(range(n))
    labels = {r["label"] for r in recs}
    assert 40 <= len(labels) <= 50 and "computers" in labels and "art.dat" not in labels
    assert all(r["text"].strip() and "\n%\n" not in r["text"] for r in recs)
    assert os.listdir(tmp_path) == ["fortunes.jsonl"]          # no temporary file left


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    out = tmp_path / "c.jsonl"
    out.write_text("old\n")

    def records():
        yield {"id": 0, "text": "new"}
        raise RuntimeError("converter failed")

    with pytest.raises(RuntimeError):
        convert.write_jsonl_atomic(out, records())
    assert out.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["c.jsonl"]


DUMP = """Package: alpha
Version: 1
Description: Alpha tool
 Alpha does things.
 .
 It does them well.
Section: utils

Package: beta
Description: Beta library
Description-md5: 0123
Section: libs

Package: alpha
Description: Alpha again (second stanza, dropped)
Section: games

Package: gamma
Description: Gamma without a section

Package: nodesc
Section: misc
"""

TRANSLATION = """Package: beta
Description-md5: 0123
Description-en: Beta library
 Beta is a library
 .
 .
 with two paragraphs.
"""


def test_parse_debian():
    recs = convert.parse_debian(DUMP, [TRANSLATION])
    assert recs == [
        {"id": 0, "text": "Alpha tool\nAlpha does things.\n\nIt does them well.", "label": "utils"},
        {"id": 1, "text": "Beta library\nBeta is a library\n\nwith two paragraphs.",
         "label": "libs"},
        {"id": 2, "text": "Gamma without a section", "label": "unknown"},
    ]
    assert convert.parse_debian(DUMP)[1]["text"] == "Beta library"
    with pytest.raises(SemzoError, match="apt-get update"):
        convert.debian("/nonexistent/never-written.jsonl", dumpavail="")


def test_debian_real_corpus(tmp_path):
    out = tmp_path / "debian.jsonl"
    dump = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, check=True).stdout
    if b"Package:" not in dump:          # apt lists removed (slim images): a clear error
        with pytest.raises(SemzoError, match="apt-get update"):
            convert.debian(out)
        assert not out.exists()
        return
    n = convert.debian(out)
    recs = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert n == len(recs) and n > 30000, n                 # about 63k on Debian 12
    assert [r["id"] for r in recs] == list(range(n))
    assert len({r["label"] for r in recs}) > 20
    assert all(r["text"] and not r["text"].startswith(" ") for r in recs)


def _dump(n: int) -> str:
    """A dumpavail text of ``n`` packages with distinct short descriptions of 3+ words."""
    return "".join(f"Package: pkg{i:03d}\nDescription: tool number {i} for tests\n\n"
                   for i in range(n))


def test_choice_records_are_valid_and_disjoint_from_sft():
    from semzo.corpus.records import check_record
    dump = _dump(40)
    recs = convert.choice_records(dump, n=10, k=4, seed=3)
    assert [r["id"] for r in recs] == list(range(10))
    answers = set()
    for r in recs:
        name = r["prompt"].split(": ", 1)[1].split("\n")[0]
        own = f" tool number {int(name[3:])} for tests"
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4
        assert r["choices"][r["answer"]] == own            # the package's own description
        assert isinstance(check_record(r, "choice"), dict)
        answers.add(r["answer"])
    assert len(answers) > 1                                # the answer's position varies
    sft_names = {r["messages"][1]["content"].split()[4] for r in convert.sft_records(dump, 10)}
    assert not sft_names & {r["prompt"].split(": ", 1)[1].split("\n")[0] for r in recs}
    assert convert.choice_records(dump, n=10, k=4, seed=3) == recs       # deterministic
    assert convert.choice_records(_dump(3), n=10, k=4) == []               # too few packages
    with pytest.raises(SemzoError, match="apt-get update"):
        convert.debian_choice("/nonexistent/never-written.jsonl", dumpavail="")


def test_converters_registry():
    assert convert.CONVERTERS == {"fortunes": convert.fortunes, "debian": convert.debian,
                                  "debian-sft": convert.debian_sft,
                                  "debian-choice": convert.debian_choice}
