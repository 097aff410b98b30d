"""Chat templates and the token layout of instruction records, shared by ``semzo generate
--chat`` (:mod:`semzo.generate`) and the ``sft`` task (:mod:`semzo.tasks.sft`).

* :func:`chat_template` / :func:`render_chat`: the ``chat_template`` of tokenizer_config.json
  rendered by jinja2 in its immutable sandbox (no attribute access outside the sandbox's
  allow-list, no mutation of the inputs), ``raise_exception`` as in transformers.
* :func:`sft_tokens`: the token ids of one instruction record and the mask of the tokens the
  loss is computed on (the completion, or every assistant turn with the template's own end of
  turn), see its docstring for the layout.
* :func:`fit_left`: truncation that keeps the completion (the prompt is cut from the left).

Nothing here is collective.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from ..runtime import SemzoError, get_logger
from .tokenizer import Tokenizer
from .zoo import resolve_model_path

log = get_logger(__name__)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise SemzoError(f"{path}: not valid JSON ({exc})") from None


TEMPLATE_KEY = "tokenizer_config.json: chat_template"     # how errors name the template


def chat_template(tok_config: dict, what: str = "model") -> str | None:
    """The chat template of a tokenizer_config.json (a list of named ones: "default"), or
    None. Anything but a string or a list of ``{"name", "template"}`` objects is a
    :class:`SemzoError` naming ``what`` and the key."""
    tpl = tok_config.get("chat_template")
    if isinstance(tpl, list):      # named templates: take "default"
        if not all(isinstance(t, dict) for t in tpl):
            raise SemzoError(f"{what}: {TEMPLATE_KEY}: a list of templates must hold "
                             f"{{\"name\", \"template\"}} objects")
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if tpl is not None and not isinstance(tpl, str):
        raise SemzoError(f"{what}: {TEMPLATE_KEY}: must be a string, got "
                         f"{type(tpl).__name__}")
    return tpl or None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _special(tok_config: dict, key: str) -> str:
    v = tok_config.get(key)
    return v.get("content", "") if isinstance(v, dict) else (v or "")


class ChatRenderer:
    """A compiled chat template: ``render(messages, add_generation_prompt)`` -> str.

    The environment is transformers' (``_compile_jinja_template``), so templates in the wild
    render as there: the immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop
    controls (``{% break %}``, ``{% continue %}``), a ``tojson`` that does not escape HTML
    characters (``ensure_ascii=False`` and the ``indent``, ``separators``, ``sort_keys``
    options), ``raise_exception``, ``dict`` and a ``namespace`` that refuses underscore
    names, and the ``{% generation %}`` block (rendered as its body; :meth:`render_marked`
    also says where its text lies: the sft task's assistant turns). ``strftime_now`` (Llama 3.x writes today's date into the system
    turn) is defined only with ``today=True`` (``semzo generate --chat``): the sft task renders
    its records without it, so the tokens of a record do not depend on the day or the rank
    that renders them (the templates then take their own fallback date)."""

    def __init__(self, template: str, tok_config: dict, what: str, today: bool = False) -> None:
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:      # a runtime dependency; only chat models need it
            raise SemzoError("chat templates need the jinja2 package (a runtime dependency: "
                             "run make setup)") from None

        renderer = self

        class Generation(jinja2.ext.Extension):
            tags = frozenset({"generation"})

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                renderer.tracks = True
                return jinja2.nodes.CallBlock(self.call_method("_block"), [], [],
                                              body).set_lineno(lineno)

            def _block(self, caller):
                text = caller()
                return MARKS[0] + text + MARKS[1] if renderer._marking else text

        class Namespace(jinja2.utils.Namespace):
            def __init__(*args, **kwargs):
                self, args = args[0], args[1:]
                attrs = dict(*args, **kwargs)
                for name in attrs:
                    Namespace._check(name)
                jinja2.utils.Namespace.__init__(self, attrs)

            def __setitem__(self, name, value):
                Namespace._check(name)
                jinja2.utils.Namespace.__setitem__(self, name, value)

            @staticmethod
            def _check(name):
                if isinstance(name, str) and name.startswith("_"):
                    raise jinja2.exceptions.SecurityError(
                        f"a namespace attribute may not start with '_' ({name!r})")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def raise_exception(msg):
            raise SemzoError(f"{what}: chat template: {msg}")

        self.tracks, self._marking, self.logged = False, False, False
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                           dict=lambda *a, **k: dict(*a, **k))
        if today:
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.tpl = env.from_string(template)
        except jinja2.TemplateError as exc:       # TemplateSyntaxError and the like
            raise SemzoError(f"{what}: {TEMPLATE_KEY}: not a valid jinja2 template "
                             f"({_one_line(exc)})") from None
        self.what = what
        self.bos, self.eos = _special(tok_config, "bos_token"), _special(tok_config, "eos_token")

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               variables: dict | None = None) -> str:
        """The rendered conversation (``variables``: more template variables, as the keyword
        arguments of transformers' ``apply_chat_template``); a template that fails (its own
        ``raise_exception``, a division by zero, a call the sandbox refuses, an undefined
        test...) is a :class:`SemzoError` naming the template."""
        try:
            return self.tpl.render(**(variables or {}), messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos, eos_token=self.eos)
        except SemzoError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template is code from the model folder
            raise SemzoError(f"{self.what}: {TEMPLATE_KEY}: cannot render "
                             f"({type(exc).__name__}: {_one_line(exc)})") from None


    def render_marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation (no generation prompt) and the character spans of its
        ``{% generation %}`` blocks (templates that mark the assistant's text themselves)."""
        if any(c in str(m.get("content", "")) for m in messages for c in MARKS):
            raise SemzoError(f"{self.what}: a message holds U+FDD0 or U+FDD1, which semzo "
                             f"reserves to find the template's generation blocks")
        self._marking = True
        try:
            marked = self.render(messages, False)
        finally:
            self._marking = False
        text, spans, start = [], [], None
        n = 0
        for part in re.split(f"([{MARKS[0]}{MARKS[1]}])", marked):
            if part == MARKS[0]:
                start = n
            elif part == MARKS[1]:
                spans.append((start, n))
            else:
                text.append(part)
                n += len(part)
        return "".join(text), spans


#: noncharacters that wrap a {% generation %} block's text in :meth:`ChatRenderer.render_marked`
MARKS = ("\ufdd0", "\ufdd1")


def render_chat(tok_config: dict, messages: list[dict], add_generation_prompt: bool = True,
                what: str = "model", today: bool = False, variables: dict | None = None) -> str:
    """``messages`` through the model's chat template (``today``: ``strftime_now`` defined,
    see :class:`ChatRenderer`; ``variables``: more template variables). A model without a
    template, or no jinja2, is a :class:`SemzoError`."""
    tpl = chat_template(tok_config, what)
    if not tpl:
        raise SemzoError(f"{what}: the model has no chat_template in tokenizer_config.json")
    return ChatRenderer(tpl, tok_config, what, today).render(messages, add_generation_prompt,
                                                             variables)


def _enc(tk, text: str, special: bool) -> list[int]:
    return list(tk.encode(text, add_special_tokens=special).ids) if text else []


def _prefix_spans(renderer: ChatRenderer, msgs: list[dict], full: str
                  ) -> list[tuple[int, int]] | None:
    """Assistant turn i = the characters between the render of ``msgs[:i]`` with the
    generation prompt and the render of ``msgs[:i+1]``; None when those are not prefixes of
    each other and of ``full``."""
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        head = renderer.render(msgs[:i], True) if i else ""
        upto = renderer.render(msgs[:i + 1], False)
        if not (full.startswith(upto) and upto.startswith(head)):
            return None
        spans.append((len(head), len(upto)))
    return spans


def _content_spans(renderer: ChatRenderer, msgs: list[dict], full: str
                   ) -> list[tuple[int, int]] | None:
    """For templates that render a turn differently once another follows (Qwen3 drops the
    empty think block of earlier assistant turns): assistant turn i = its content where it
    first occurs in ``full`` after the part ``full`` shares with the render of ``msgs[:i]``
    (generation prompt included) and after the previous turn, plus the end of turn the
    template writes after it when it is the last turn, which must follow it in ``full``;
    None when a content is empty or not found, or the end of turn does not follow."""
    spans, pos = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        c = m["content"]
        upto = renderer.render(msgs[:i + 1], False)
        k = upto.rfind(c)
        if not c or k < 0:
            return None
        end = upto[k + len(c):]
        head = renderer.render(msgs[:i], True) if i else ""
        j = full.find(c, max(pos, len(os.path.commonprefix([full, head]))))
        if j < 0 or not full.startswith(end, j + len(c)):
            return None
        pos = j + len(c) + len(end)
        spans.append((j, pos))
    return spans


def sft_tokens(tk, rec: dict, renderer: ChatRenderer | None, eos_id: int | None
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids, loss, n_prompt)`` of one instruction record (a dict as
    :mod:`semzo.corpus.records` makes it): ``ids`` int64 (T,), ``loss`` bool (T,) True on the
    tokens the loss predicts, ``n_prompt`` the tokens before the first of them.

    * ``{"prompt", "completion"}``: the prompt's tokens (special tokens added as the tokenizer
      does), then the completion's, then ``eos_id`` (when the tokenizer has one, so that the
      model learns to stop); the completion and the end token are the loss tokens.
    * ``{"messages"}`` with a chat ``renderer``: the whole conversation rendered once; a
      token is a loss token when its first character lies in an assistant span: the
      template's own ``{% generation %}`` blocks when it has them; else the characters
      between the render of ``messages[:i]`` with the generation prompt and the render of
      ``messages[:i+1]`` (the template's end of turn included) when those renders are
      prefixes of each other (:func:`_prefix_spans`); else each assistant's content and end
      of turn found in the render (:func:`_content_spans`, logged once); else a
      :class:`SemzoError`.
    * ``{"messages"}`` without a template (plain concatenation): each system/user turn's
      content and a newline, each assistant turn's content and ``eos_id`` (the loss tokens).
    """
    if "messages" not in rec:
        p = _enc(tk, rec["prompt"], True)
        c = _enc(tk, rec["completion"], False) + ([int(eos_id)] if eos_id is not None else [])
        ids = np.array(p + c, np.int64)
        loss = np.zeros(len(ids), bool)
        loss[len(p):] = True
        return ids, loss, len(p)
    msgs = rec["messages"]
    if renderer is None:
        parts: list[int] = []
        flags: list[bool] = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                t = _enc(tk, m["content"], False) + ([int(eos_id)] if eos_id is not None else [])
            else:
                t = _enc(tk, m["content"] + "\n", i == 0)
            parts += t
            flags += [m["role"] == "assistant"] * len(t)
        ids, loss = np.array(parts, np.int64), np.array(flags, bool)
    else:
        full = renderer.render(msgs, False)
        if renderer.tracks:
            text, spans = renderer.render_marked(msgs)
            if text != full:
                raise SemzoError(f"{renderer.what}: chat template: renders differently with "
                                 f"its generation blocks marked")
        else:
            spans = _prefix_spans(renderer, msgs, full)
            if spans is None:
                spans = _content_spans(renderer, msgs, full)
                if spans is None:
                    raise SemzoError(f"{renderer.what}: chat template: the assistant turns "
                                     f"cannot be told from it (its renders of the first "
                                     f"turns are not prefixes of the conversation's, and an "
                                     f"assistant's content or end of turn is not found in it "
                                     f"as rendered last)")
                if not renderer.logged:
                    renderer.logged = True
                    log.info("%s: chat template not prefix-stable (a turn renders "
                             "differently once another follows): assistant turns found by "
                             "their content and end of turn", renderer.what)
        enc = tk.encode(full, add_special_tokens=False)
        ids = np.array(enc.ids, np.int64)
        starts = np.array([o[0] for o in enc.offsets], np.int64)
        loss = np.zeros(len(ids), bool)
        for a, b in spans:
            loss |= (starts >= a) & (starts < b)
    first = int(np.argmax(loss)) if loss.any() else len(ids)
    return ids, loss, first


def fit_left(ids: np.ndarray, loss: np.ndarray, n_prompt: int, max_len: int
             ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Cut ``ids``/``loss`` to ``max_len`` tokens from the left (the prompt goes first):
    ``(ids, loss, tokens cut)``, or None when that would cut a loss token or leave none of the
    prompt before the first (the completion alone does not fit)."""
    cut = len(ids) - max_len
    if cut <= 0:
        return ids, loss, 0
    if cut + 1 > n_prompt:
        return None
    return ids[cut:], loss[cut:], cut


def choice_tokens(tk, rec: dict) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(prompt ids, [ids of each choice])`` of a multiple-choice record: the prompt with the
    tokenizer's special tokens, each choice's own tokens (scored after the prompt)."""
    return (np.array(_enc(tk, rec["prompt"], True), np.int64),
            [np.array(_enc(tk, c, False), np.int64) for c in rec["choices"]])


def _eos_id(folder: Path, cfg: dict) -> int | None:
    """``eos_token_id`` of config.json (the first of a list), None when absent; an id that is
    not an integer (``true``, ``"2"``) or lies outside the vocabulary (``vocab_size``; the
    sft task appends it to every completion, the generations stop on it) is a
    :class:`SemzoError` naming the file and the key, as :func:`.tokenizer.pad_id_for` keeps
    the pad id inside it."""
    eos = cfg.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    vocab = cfg.get("vocab_size")
    for e in ids:
        if e is None and not isinstance(eos, list):
            return None
        if isinstance(e, bool) or not isinstance(e, int) or e < 0 or (
                isinstance(vocab, int) and e >= vocab):
            inside = f"[0, vocab_size = {vocab})" if isinstance(vocab, int) else "[0, 2**63)"
            raise SemzoError(f"{folder / 'config.json'}: 'eos_token_id' must be a token id (or "
                             f"a list of them) in {inside}, got {json.dumps(eos)[:60]}")
    return int(ids[0]) if ids else None


@dataclass
class InstructTokenizer:
    """What the ``sft`` and ``choice`` tasks need of a decoder's folder: the tokenizer (no
    truncation, no padding), pad and end-of-sequence ids, the chat renderer (None without a
    template)."""

    tk: object
    pad_id: int
    eos_id: int | None
    renderer: ChatRenderer | None
    what: str

    @classmethod
    def from_folder(cls, path) -> InstructTokenizer:
        folder = resolve_model_path(path)
        tok = Tokenizer.from_folder(folder, max_length=None)
        tok.tk.no_truncation()
        tc, cfg = _json(folder / "tokenizer_config.json"), _json(folder / "config.json")
        eos = _eos_id(folder, cfg)
        if eos is None:
            name = _special(tc, "eos_token")
            eos = tok.tk.token_to_id(name) if name else None
        tpl = chat_template(tc, str(folder))
        return cls(tok.tk, tok.pad_id, eos,
                   ChatRenderer(tpl, tc, str(folder)) if tpl else None, str(folder))

    def sft(self, rec: dict, max_len: int):
        """``(ids, loss, tokens cut)`` of an sft record within ``max_len`` tokens (prompt cut
        from the left), or None when its completion alone does not fit."""
        return fit_left(*sft_tokens(self.tk, rec, self.renderer, self.eos_id), max_len)

    def choice(self, rec: dict, max_len: int):
        """``(prompt ids, choice ids, tokens cut)`` with every choice after the prompt within
        ``max_len`` tokens (prompt cut from the left), or None when the longest choice alone
        (with one prompt token) does not fit. A choice of no tokens is a
        :class:`SemzoError`."""
        p, cs = choice_tokens(self.tk, rec)
        for i, c in enumerate(cs):
            if not len(c):        # its score would be no log-likelihood (np.add.reduceat)
                raise SemzoError(f"{self.what}: choices[{i}] {rec['choices'][i][:40]!r} is "
                                 f"no token of the tokenizer: a choice is scored by its "
                                 f"tokens, it needs one at least")
        longest = max(len(c) for c in cs)
        cut = max(0, len(p) + longest - max_len)
        if cut + 1 > len(p):
            return None
        return p[cut:], cs, cut
