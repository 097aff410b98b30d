"""Chat templates render as transformers renders them (its ``_compile_jinja_template``
environment): loop controls, a tojson that keeps HTML characters and non-ASCII text, the
hardened ``namespace`` and ``dict``, the ``{% generation %}`` block, and ``strftime_now``
only where the date may enter (``semzo generate --chat``), never in the sft task's records.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from semzo.model.chat import ChatRenderer, render_chat
from semzo.runtime import SemzoError

MSGS = [{"role": "system", "content": "sys <b>&' \"q\""},
        {"role": "user", "content": "héllo 日本 😀"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"}]

TEMPLATES = {
    "loop controls": ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
                      "{% endif %}[{{ m.content }}]{% if loop.index > 2 %}{% break %}{% endif %}"
                      "{% endfor %}"),
    "tojson": ("{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}"
               "|{{ messages[1] | tojson(ensure_ascii=True, separators=(',', ':')) }}"),
    "namespace": ("{% set ns = namespace(n=0, last='') %}{% for m in messages %}"
                  "{% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}{% endfor %}"
                  "{{ ns.n }} {{ ns.last }} {{ dict(a=1, b=2) | tojson }}"),
    "generation": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                   "<a>{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}"
                   "{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"),
    "llama3 date": ("{%- if strftime_now is defined %}{%- set date_string = "
                    "strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
                    "{%- endif %}Today Date: {{ date_string }}\n{{ messages[-1].content }}"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("gen", [False, True])
def test_same_text_as_transformers(name, gen):
    from transformers.utils.chat_template_utils import _compile_jinja_template
    tpl = TEMPLATES[name]
    want = _compile_jinja_template(tpl).render(messages=MSGS, add_generation_prompt=gen)
    got = render_chat({"chat_template": tpl}, MSGS, gen, today=True)
    assert got == want
    if name == "tojson":
        assert "<b>&'" in got and "日本" in got and "\\u65e5" in got      # both ensure_ascii
    if name == "llama3 date":
        assert datetime.now().strftime("%d %b %Y") in got


def test_no_date_in_training_records():
    """Without ``today`` (the sft task's renderer) a template takes its own fallback date,
    so a record's tokens do not depend on when or where it is rendered; a template that
    calls ``strftime_now`` unguarded is one error naming the template."""
    tpl = TEMPLATES["llama3 date"]
    assert render_chat({"chat_template": tpl}, MSGS, False).startswith("Today Date: 26 Jul 2024")
    r = ChatRenderer(tpl, {}, "m")
    assert r.render(MSGS) == render_chat({"chat_template": tpl}, MSGS, False)
    with pytest.raises(SemzoError, match="m: tokenizer_config.json: chat_template: cannot "
                                         "render .*strftime_now"):
        ChatRenderer("{{ strftime_now('%Y') }}", {}, "m").render(MSGS)


@pytest.mark.parametrize("tpl", [
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "{% set ns = namespace(x=1) %}{% set ns.__class__ = 2 %}",
    "{{ messages.__class__.__mro__ }}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_still_refuses(tpl):
    with pytest.raises(SemzoError, match="chat_template: cannot render"):
        render_chat({"chat_template": tpl}, [dict(m) for m in MSGS], False, today=True)
    assert MSGS[0]["role"] == "system"
