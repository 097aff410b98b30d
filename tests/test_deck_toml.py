"""The deck's TOML writer (issue 12, defect 7): any string round-trips through
``Deck.to_toml`` and ``tomllib`` (every control character escaped, per the TOML spec)."""

from __future__ import annotations

import tomllib

from hypothesis import given, settings
from hypothesis import strategies as st

from semzo import deck as deckmod
from semzo.tomlw import _toml_value

# any text, control characters, quotes and backslashes favoured
TEXT = st.text(st.one_of(st.characters(), st.sampled_from('\x00\x01\x08\t\n\x0b\x0c\r\x1f\x7f"\\')))


@settings(max_examples=500, deadline=None)
@given(TEXT)
def test_any_string_round_trips(s):
    assert tomllib.loads(f"x = {_toml_value(s)}\n")["x"] == s


@settings(max_examples=200, deadline=None)
@given(TEXT, TEXT, st.lists(TEXT, max_size=3))
def test_deck_round_trips(output_dir, source, stages_like):
    d = deckmod.load(None, check_inputs=False)
    d = d.replace(run=d.run.__class__(**{**d.run.__dict__, "output_dir": output_dir}))
    d = deckmod.Deck(**{**d.__dict__, "source": source})     # the header comment too
    text = d.to_toml()
    again = deckmod.from_toml_text(text)
    assert again.run.output_dir == output_dir
    assert again.to_dict() == d.to_dict()
    assert tomllib.loads(f"x = {_toml_value(stages_like)}\n")["x"] == stages_like


def test_control_characters_use_spec_escapes():
    assert _toml_value('a\nb\t"\\\x00\x7f') == '"a\\nb\\t\\"\\\\\\u0000\\u007F"'
