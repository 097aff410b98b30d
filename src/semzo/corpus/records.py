"""Record formats of a corpus, by the task that reads it (``train.task``):

* ``text`` (every other task): ``{"text": str, "label": str | int (optional), "id": int
  (optional)}``, see :mod:`semzo.corpus.jsonl`;
* ``sft``: ``{"prompt": str, "completion": str}`` (TRL's prompt-completion records) or
  ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}`` (the
  conversational records of chat fine-tuning APIs; several turns allowed, at least one
  assistant turn); the completion and every content non-empty strings;
* ``choice``: ``{"prompt": str, "choices": [str, ...], "answer": int}``, 2 to 16 non-empty
  choices, ``answer`` an index into them.

Other keys are ignored; ``id`` works as for text records (``label`` is ignored). A structured
record is stored in the pipeline's files as its canonical JSON (:func:`canonical`) in place of
the text, and what the embed stage embeds for sharding is :func:`embed_text` of it (prompt and
completion, the conversation's contents, the prompt and the choices).

:func:`check_record` returns the record or an error message naming the field; the readers
(:mod:`.jsonl`, :mod:`.parquet`) add the file and line or row.
"""

from __future__ import annotations

import json

KINDS = ("text", "sft", "choice")
ROLES = ("system", "user", "assistant")
MAX_CHOICES = 16
SURROGATE = "holds a lone surrogate (a \\ud800-\\udfff escape): not valid Unicode"


def is_unicode(s: str) -> bool:
    """Whether ``s`` can be written as UTF-8 (JSON's ``\\ud800`` escapes parse to lone
    surrogates, which cannot)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def record_kind(task: str) -> str:
    """The record format a ``train.task`` reads."""
    return task if task in ("sft", "choice") else "text"


def _jtype(v: object) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number",
            str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _text(obj: dict, key: str, where: str = "") -> str | None:
    """An error message when ``obj[key]`` is missing, not a string or empty."""
    if key not in obj or obj[key] is None:
        return f"missing '{key}'{where}"
    if not isinstance(obj[key], str):
        return f"'{key}'{where} must be a string, got {_jtype(obj[key])}"
    if not obj[key].strip():
        return f"'{key}'{where} is empty"
    if not is_unicode(obj[key]):
        return f"'{key}'{where} {SURROGATE}"
    return None


def check_record(obj: dict, kind: str) -> dict | str:
    """The record's task fields (a new dict) or an error message. ``obj``: a parsed JSON
    object (or a Parquet row as a dict)."""
    if kind == "sft":
        if obj.get("messages") is not None:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs:
                return f"'messages' must be a non-empty array, got {_jtype(msgs)}"
            out = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict):
                    return f"messages[{i}] must be an object, got {_jtype(m)}"
                role = m.get("role")
                if role not in ROLES:
                    return (f"messages[{i}]: 'role' must be one of {', '.join(ROLES)}, got "
                            f"{role!r}")
                err = _text(m, "content", f" of messages[{i}]")
                if err:
                    return err
                out.append({"role": role, "content": m["content"]})
            if not any(m["role"] == "assistant" for m in out):
                return "'messages' has no assistant turn (nothing to learn)"
            return {"messages": out}
        if "prompt" not in obj and "completion" not in obj:
            return "missing 'messages' (or 'prompt' and 'completion')"
        for k in ("prompt", "completion"):
            err = _text(obj, k)
            if err:
                return err
        return {"prompt": obj["prompt"], "completion": obj["completion"]}
    if kind == "choice":
        err = _text(obj, "prompt")
        if err:
            return err
        ch = obj.get("choices")
        if ch is None:
            return "missing 'choices'"
        if not isinstance(ch, list):
            return f"'choices' must be an array, got {_jtype(ch)}"
        if not 2 <= len(ch) <= MAX_CHOICES:
            return f"'choices' must hold 2 to {MAX_CHOICES} strings, got {len(ch)}"
        for i, c in enumerate(ch):
            if not isinstance(c, str):
                return f"choices[{i}] must be a string, got {_jtype(c)}"
            if not c.strip():
                return f"choices[{i}] is empty"
            if not is_unicode(c):
                return f"choices[{i}] {SURROGATE}"
        a = obj.get("answer")
        if a is None:
            return "missing 'answer'"
        if isinstance(a, bool) or not isinstance(a, int):
            return f"'answer' must be an integer, got {_jtype(a)}"
        if not 0 <= a < len(ch):
            return f"'answer' {a} is out of range for {len(ch)} choices (0..{len(ch) - 1})"
        return {"prompt": obj["prompt"], "choices": list(ch), "answer": int(a)}
    raise ValueError(f"unknown record kind {kind!r}")


def canonical(rec: dict) -> str:
    """The stored form of a checked record: compact JSON, keys sorted."""
    return json.dumps(rec, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def parse_stored(text: str) -> dict:
    """A record from its stored form (:func:`canonical`)."""
    return json.loads(text)


def embed_text(rec: dict) -> str:
    """What the embed stage embeds of a structured record (for semantic sharding): the prompt
    and the completion, the conversation's contents one per line, or the prompt and the
    choices one per line."""
    if "messages" in rec:
        return "\n".join(m["content"] for m in rec["messages"])
    if "choices" in rec:
        return "\n".join([rec["prompt"], *rec["choices"]])
    return rec["prompt"] + "\n" + rec["completion"]
