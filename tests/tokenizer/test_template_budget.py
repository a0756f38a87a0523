"""A chat template is code from a model file a client may have pushed: its render is held to a budget
of steps and of bytes (tokenizer/template_budget.py), so a template that loops or recurses without
end, or builds a gigabyte, fails as the template's error, quickly and without the memory, while real
templates render exactly as before."""
from __future__ import annotations

import tracemalloc

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tiny_model import CHATML_TEMPLATE
from tokenmill.tokenizer import ChatTemplateError
from tokenmill.tokenizer import chat_template as ct
from tokenmill.tokenizer.chat_template import MAX_TEMPLATE_CHARS, ChatTemplate
from tokenmill.tokenizer.tokenizer import _GEMMA_CHAT_TEMPLATE

HUGE = 10**9
BIG = "{% set s = 'x' * 1000000 %}"  # a megabyte: within the budget by itself

LOOP40 = "{% for i in range(40) %}"
HOSTILE = {
    # CPU: each would run for hours (and held the server's event loop).
    "fan-out recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursive loop": "{% for x in range(99) recursive %}{{ loop(range(99)) }}{% endfor %}",
    # Memory: each would build a gigabyte or more.
    "repetition": f"{{{{ 'x' * {HUGE} }}}}",
    "doubling with ~": "{% set ns = namespace(s='x') %}" + LOOP40 + "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}" + LOOP40 + "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "printing shared references": BIG + "{{ [s] * 100000 }}",
    "join filter": BIG + "{{ ([s] * 100000) | join }}",
    "join separator": BIG + "{{ ([''] * 100000) | join(s) }}",
    "join method separator": BIG + "{{ s.join([''] * 100000) }}",
    "join method": BIG + "{{ ''.join([s] * 100000) }}",
    "join of a generator": BIG + "{{ ([s] * 100000) | map('string') | join }}",
    "tojson": BIG + "{{ ([s] * 100000) | tojson }}",
    "~ of a list": BIG + "{{ 'a' ~ ([s] * 100000) }}",
    "center filter": f"{{{{ 'x' | center({HUGE}) }}}}",
    "ljust method": f"{{{{ 'x'.ljust({HUGE}) }}}}",
    "format width": f"{{{{ '{{:>{HUGE}}}'.format('x') }}}}",
    "format width argument": f"{{{{ '{{:>{{w}}}}'.format('x', w={HUGE}) }}}}",
    "% width": f"{{{{ '%{HUGE}s' % 'x' }}}}",
    "% star width": f"{{{{ '%*s' % ({HUGE}, 'x') }}}}",
    "format filter": f"{{{{ '%{HUGE}s' | format('x') }}}}",
    "replace method": "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
    "replace filter": "{% set s = 'x' * 100000 %}{{ s | replace('x', s) }}",
    "expandtabs": "{% set s = '\t' * 100000 %}{{ s.expandtabs(100000) }}",
    "indent": "{% set s = '\n' * 100000 %}{{ s | indent(100000) }}",
    "wordwrap": BIG + "{{ s | wordwrap(1, true, 'y' * 100) }}",
    "tojson indent": BIG + "{{ ([1] * 100000) | tojson(indent=100000) }}",
    "translate": BIG + "{{ s.translate({120: s}) }}",
    "lipsum": "{{ lipsum(1000000) }}",
    "sum of lists": "{{ ([[1] * 10000] * 10000) | sum(start=[]) | length }}",
    "batch fill": f"{{{{ [1] | batch({HUGE}, 'x') | list | length }}}}",
    "dict.fromkeys": BIG + "{{ dict.fromkeys(range(100000), s) }}",
    "literal text in a loop": "{% for i in range(100000) %}" + "A" * 10000 + "{% endfor %}",
    "literal text in a macro": "{% macro m() %}{% for i in range(100000) %}" + "A" * 10000 + "{% endfor %}"
                               "{% endmacro %}{% set x = m() %}",
    "literal text in a set block": "{% set x %}{% for i in range(100000) %}" + "A" * 10000 + "{% endfor %}{% endset %}",
    "slices in a loop": BIG + "{% for i in range(1000) %}{% set t = s[1:] %}{% endfor %}",
    "filters in a loop": BIG + "{% for i in range(1000) %}{% set t = s | upper %}{% endfor %}",
    "squaring a number": "{% set ns = namespace(x=3) %}" + LOOP40 + "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "a huge power": "{{ 7 ** 10000000 }}",
    "strftime": "{{ strftime_now('%c' * 1000000) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_as_the_templates_error_without_the_memory(name):
    template = ChatTemplate(HOSTILE[name])
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as info:
            template.render([{"role": "user", "content": "hi"}])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, (name, peak)
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize("name", ["nested loops", "repetition", "doubling with ~"])
def test_the_message_says_which_budget_ran_out(name):
    with pytest.raises(ChatTemplateError, match="too many steps|too much text"):
        ChatTemplate(HOSTILE[name]).render([])


def plain_render(source: str, messages: list[dict], **variables) -> str:
    """The template rendered as before the budget: Jinja's immutable sandbox, the same globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ct._GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = ct._tojson
    env.globals.update(raise_exception=ct._raise_exception, strftime_now=ct._strftime_now, dict=ct._TemplateDict(),
                       namespace=ct._TemplateNamespace)
    return env.from_string(source).render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                          **variables)


@pytest.mark.parametrize("source", [CHATML_TEMPLATE, _GEMMA_CHAT_TEMPLATE])
def test_a_long_conversation_renders_as_without_the_budget(source):
    # 2,000 messages of ~3 KB: 6 MB of input, far past the fixed allowance, within the one for its size.
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "word " * 600}
                for i in range(2000)]
    rendered = ChatTemplate(source, bos_token="<bos>", eos_token="<eos>").render(messages)
    assert rendered == plain_render(source, messages, bos_token="<bos>", eos_token="<eos>")
    assert len(rendered) > 6_000_000


def test_everyday_template_features_render_as_before():
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{{ loop.index }}/{{ loop.length }} {{ m.role | upper }}: {{ m.content | trim }}"
              "{{ ' [%s]' % m.role }}{{ '{:>6}'.format(m.role) }}{{ m.content[:3] ~ '|' }}{% endfor %}"
              "{{ messages | map(attribute='role') | join(', ') }} {{ ns.n }} {{ messages | tojson }}"
              "{{ 'x' * 3 }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ 'a b'.split() }}{{ '  y '.strip() }}"
              "{{ ((messages[1].content ~ ' ') * 20) | wordwrap(12) }}{{ messages[0].content | replace('l', 'L') }}"
              "{{ ', '.join(['a', 'b']) }}{{ messages | tojson(indent=2) }}{{ 'x' | center(9) }}")
    messages = [{"role": "user", "content": " hello "}, {"role": "assistant", "content": "hi there"}]
    assert ChatTemplate(source).render(messages) == plain_render(source, messages)


def test_a_template_too_long_or_too_deep_to_compile_is_refused():
    with pytest.raises(ChatTemplateError, match=f"limit is {MAX_TEMPLATE_CHARS}"):
        ChatTemplate("{{ x }}" * (MAX_TEMPLATE_CHARS // 7 + 1))
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        ChatTemplate("{% if true %}" * 2000 + "{% endif %}" * 2000)


def test_filters_folded_at_compile_time_are_still_counted():
    # Constant arguments: Jinja would run the filter while compiling, outside any render's budget.
    source = f"{{{{ 'x' | center({HUGE}) }}}}"
    tracemalloc.start()
    try:
        template = ChatTemplate(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    with pytest.raises(ChatTemplateError, match="center"):
        template.render([])
