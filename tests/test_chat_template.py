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


# ---- the assistant turns of a conversation (the sft task's loss mask) ------------------------
# ChatML with a think block on the assistant turns after the last user message only, the way
# Qwen3's template renders them: a turn renders differently once another follows, so the
# renders of the first turns are not prefixes of the conversation's
THINK = ("{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
         "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
         "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
         "{%- if m.role == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n"
         "{%- endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# the same with the assistant's text marked by the template ({% generation %})
MARKED = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n"
          "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>\n"
          "{% endgeneration %}{%- else %}{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
CONV = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "good"},          # the next answer's words, said first
        {"role": "assistant", "content": "good"},
        {"role": "user", "content": "sun or moon?"},
        {"role": "assistant", "content": "moon tree"}]


def _loss_text(tpl, msgs):
    from semzo.model import zoo
    from semzo.model.chat import sft_tokens
    from semzo.model.tokenizer import Tokenizer
    tk = Tokenizer.from_folder(zoo.resolve_model_path("smollm2"), max_length=None).tk
    ids, loss, _ = sft_tokens(tk, {"messages": msgs}, ChatRenderer(tpl, {}, "m"), None)
    return tk, ids, loss, tk.decode(ids[loss].tolist(), skip_special_tokens=False)


def test_turns_found_by_content_when_the_template_is_not_prefix_stable(caplog):
    r = ChatRenderer(THINK, {}, "m")
    assert not r.render(CONV).startswith(r.render(CONV[:3]))     # the case this is for
    tk, ids, loss, text = _loss_text(THINK, CONV)
    assert text == "good<|im_end|>\nmoon tree<|im_end|>\n"
    first = int(loss.argmax())          # the assistant's "good", not the user's before it
    assert tk.decode(ids[:first].tolist(), skip_special_tokens=False).endswith(
        "<|im_start|>assistant")
    assert "found by their content" in caplog.text
    # one turn: the renders are prefixes, so the think block the template writes before the
    # last answer is part of what is learned, as before
    _, _, _, one = _loss_text(THINK, CONV[:3])
    assert one == r.render(CONV[:3])[len(r.render(CONV[:2], True)):]
    assert one.startswith("<think>") and one.endswith("good<|im_end|>\n")


def test_generation_blocks_are_the_loss_tokens_as_in_transformers():
    from transformers import AutoTokenizer

    from semzo.model import zoo
    _, ids, loss, text = _loss_text(MARKED, CONV)
    assert text == "good<|im_end|>\nmoon tree<|im_end|>\n"
    hf = AutoTokenizer.from_pretrained(zoo.resolve_model_path("smollm2"))
    out = hf.apply_chat_template(CONV, chat_template=MARKED, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert out["input_ids"] == ids.tolist()
    assert out["assistant_masks"] == loss.astype(int).tolist()


def test_turns_that_cannot_be_found_are_one_error():
    from semzo.model import zoo
    from semzo.model.chat import sft_tokens
    from semzo.model.tokenizer import Tokenizer
    tk = Tokenizer.from_folder(zoo.resolve_model_path("smollm2"), max_length=None).tk
    # the content rewritten (upper case) and not prefix-stable: neither way finds the turns
    tpl = THINK.replace("{{ m.content }}", "{{ m.content | upper }}")
    with pytest.raises(SemzoError, match="m: chat template: the assistant turns cannot be told"):
        sft_tokens(tk, {"messages": CONV}, ChatRenderer(tpl, {}, "m"), None)
    bad = [dict(m) for m in CONV]
    bad[2]["content"] = "a \ufdd0 b"
    with pytest.raises(SemzoError, match="reserves"):
        sft_tokens(tk, {"messages": bad}, ChatRenderer(MARKED, {}, "m"), None)


# ---- template variables (semzo generate --chat --chat-var KEY=VALUE) ----------------------------
def test_chat_vars_parsed_as_transformers_keywords():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from semzo.generate import chat_vars
    got = chat_vars(["enable_thinking=false", "n=3", "name=Bob", 'q="x y"', "l=[1, 2]"], True)
    assert got == {"enable_thinking": False, "n": 3, "name": "Bob", "q": "x y", "l": [1, 2]}
    assert chat_vars([], False) == {}
    for bad, why in ((["novalue"], "expected KEY=VALUE"), (["1x=3"], "expected KEY=VALUE"),
                     (["messages=[]"], "set by semzo"), (["a=1", "a=2"], "given twice"),
                     (["bos_token=x"], "set by semzo")):
        with pytest.raises(ValueError, match=why):
            chat_vars(bad, True)
    with pytest.raises(ValueError, match="needs --chat"):
        chat_vars(["a=1"], False)
    # Qwen3's switch: the empty think block in the generation prompt when it is false
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
           "{% if enable_thinking is defined and enable_thinking is false %}"
           "<think>\n\n</think>\n\n{% endif %}{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    for v in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        want = _compile_jinja_template(tpl).render(messages=msgs, add_generation_prompt=True,
                                                    **v)
        assert render_chat({"chat_template": tpl}, msgs, True, variables=v) == want
    assert "<think>" in render_chat({"chat_template": tpl}, msgs, True,
                                    variables={"enable_thinking": False})


def test_chat_var_on_the_command_line_is_checked_before_loading():
    import subprocess
    import sys
    for extra, phrase in ((["--chat-var", "a=1"], "needs --chat"),
                          (["--chat", "--chat-var", "eos_token=x"], "set by semzo")):
        r = subprocess.run([sys.executable, "-m", "semzo", "generate", "no-such-model",
                            "--prompt", "x", *extra], capture_output=True, text=True,
                           timeout=120, check=False)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "--chat-var" in lines[0] and phrase in lines[0], lines
