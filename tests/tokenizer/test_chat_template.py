"""Chat templates: prompts identical to transformers' apply_chat_template, and a sandbox that holds."""
from __future__ import annotations

from datetime import datetime

import pytest

from tokenmill.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer, TokenizerError

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Bonjour, ça va ? 🙂"},
        {"role": "assistant", "content": "Oui ! 日本語も話せます。"},
        {"role": "user", "content": "Write code:\n```py\nprint('x')\n```"},
    ],
    [{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"}],
    [{"role": "user", "content": "text with <|im_end|> inside and trailing spaces   \n\n"}],
]

# Exercises what real templates use: whitespace control, namespace, loop controls, tojson with options,
# dict(), string tests, the generation tag, special-token names, extra variables and dropped None keys.
RICH_TEMPLATE = """\
{%- set ns = namespace(system='', count=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {{ bos_token if loop.first else '' }}<|im_start|>{{ m.role }}
{% if m.content is not defined %}(no content)
{% elif m.content is string %}{{ m.content | trim }}
{% else %}
  {% for part in m.content %}
    {% if part.type == 'text' %}[{{ part.text }}]{% endif %}
  {% endfor %}
{% endif %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>
{% endif %}
{% for call in m.tool_calls | default([]) %}{{ call | tojson }}
{% endfor %}
<|im_end|>
  {% if loop.index >= 20 %}{% break %}{% endif %}
{%- endfor %}
{% if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% if ns.system %}System: {{ ns.system }}
{% endif %}
{{ dict(b=[1, 2], a='é<>') | tojson(sort_keys=True, separators=(',', ':')) }}
{% generation %}turns={{ ns.count }}{% endgeneration %}
{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ custom_flag | default('none') }}|{{ documents is none }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

RICH_MESSAGES = [
    {"role": "system", "content": "sys <b>&</b>"},
    {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "image"},
                                 {"type": "text", "text": "part two ✓"}]},
    {"role": "assistant", "content": None, "thinking": "hmm",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "  {\"temp\": 21}  "},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_tokenizer, smollm2_reference, add_generation_prompt):
    for messages in CONVERSATIONS:
        expected = smollm2_reference.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        got = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected
        # The ids of the prompt match too (templates are tokenized without an extra BOS).
        assert smollm2_tokenizer.encode(got, add_special_tokens=False) == smollm2_reference.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_tiny_template_matches_transformers(tiny_tokenizer, tiny_reference):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == \
                tiny_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_matches_transformers(tiny_reference, add_generation_prompt):
    ref = tiny_reference
    ours = ChatTemplate(RICH_TEMPLATE, bos_token=ref.bos_token, eos_token=ref.eos_token, unk_token=ref.unk_token,
                        pad_token=ref.pad_token)
    for kwargs in ({}, {"tools": TOOLS, "custom_flag": "on"}, {"documents": [{"title": "t", "text": "x"}]}):
        expected = ref.apply_chat_template(RICH_MESSAGES, chat_template=RICH_TEMPLATE, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        assert ours.render(RICH_MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs) == expected
    # Spot-check the behaviour the comparison relies on, so a shared mistake cannot pass unnoticed.
    rendered = ours.render(RICH_MESSAGES, tools=TOOLS)
    assert '"Weather <now> & later"' in rendered and '"city": "Zürich"' in rendered  # tojson: no HTML escapes
    assert "(no content)" in rendered and "<think>hmm</think>" in rendered
    assert '{"a":"é<>","b":[1,2]}' in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_missing_special_tokens_are_undefined():
    source = "{{ bos_token is defined }} {{ eos_token is defined }} {{ pad_token is defined }}"
    assert ChatTemplate(source, bos_token=None, eos_token="</s>").render([]) == "False True False"


def test_extra_variables_override_special_tokens():
    assert ChatTemplate("{{ bos_token }}{{ flag }}", bos_token="<s>").render([], bos_token="[B]", flag=1) == "[B]1"


def test_raise_exception_gives_the_templates_message():
    source = ("{% if messages[0]['role'] != 'user' %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}ok")
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert str(info.value) == "Conversation roles must alternate user/assistant/user/assistant/..."
    assert isinstance(info.value, TokenizerError)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (1).__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set ns = namespace(_hidden=1) %}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
    "{{ ''.format.__self__ }}{{ 'a'.format.__globals__['x'] }}",
])
def test_sandbox_escapes_fail_with_chat_template_error(source):
    template = ChatTemplate(source)
    with pytest.raises(ChatTemplateError, match="sandbox rule"):
        template.render([{"role": "user", "content": "x"}])


def test_unsafe_attributes_read_as_nothing_never_as_the_object():
    assert ChatTemplate("[{{ ''.__class__ }}][{{ raise_exception.__globals__ }}]").render([]) == "[][]"


@pytest.mark.parametrize(("source", "message"), [
    ("{% for %}", "does not compile"),
    ("{% if x %}unclosed", "does not compile"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[5].content }}", "failed"),
])
def test_broken_templates_raise_chat_template_error(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_messages_must_be_dicts():
    with pytest.raises(ChatTemplateError, match="dicts"):
        ChatTemplate("x").render(["hello"])


def test_strftime_now():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) == str(datetime.now().year)


def test_tokenizer_without_template(make_tokenizer_gguf):
    tok = Tokenizer.from_file(make_tokenizer_gguf("no-template", chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_tokenizer_with_broken_template_still_loads(make_tokenizer_gguf):
    tok = Tokenizer.from_file(make_tokenizer_gguf("bad-template", chat_template="{% if %}"))
    assert tok.decode(tok.encode("hi")) == "hi"  # still usable for raw completion
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
