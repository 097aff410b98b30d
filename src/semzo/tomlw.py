"""Writing TOML values: what :meth:`semzo.deck.Deck.to_toml` stores in every output file.

Strings are TOML basic strings with every character the spec requires escaped (``\\``, ``"``
and the control characters U+0000-U+001F, U+007F), so any text round-trips through
``tomllib`` (property-tested in tests/test_deck_toml.py).
"""

from __future__ import annotations

from typing import Any


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return _toml_string(str(v))


_TOML_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r",
                 '"': '\\"', "\\": "\\\\"}


def _toml_string(s: str) -> str:
    """A TOML basic string holding ``s`` exactly: ``\\``, ``"`` and every control character
    (U+0000-U+001F, U+007F) escaped as the TOML spec requires (short forms where it has them,
    ``\\uXXXX`` otherwise), so any text round-trips through ``tomllib``."""
    out = []
    for ch in s:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_comment(s: str) -> str:
    """``s`` safe inside a TOML comment (no control character but tab): escaped as in a
    string, without the quotes."""
    return _toml_string(s)[1:-1]
