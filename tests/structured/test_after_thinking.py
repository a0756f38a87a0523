"""A JSON grammar that waits for a thinking model's reasoning (GrammarSpec.after_thinking): the think
block is free text, the grammar holds from its close tag on. On a tiny Qwen3 tokenizer whose tags are one
token each (as the real one's), and on the plain tiny one, where they are several."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenmill.server.thinking import CLOSE, OPEN, after_thinking, grammar_can_wait
from tokenmill.structured import GrammarCompiler, GrammarError, GrammarSpec
from tokenmill.structured.grammar import ThinkingFirst
from tokenmill.structured.masks import TokenMasks, compute_masks
from tokenmill.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen_templates import OPEN_THINK_TEMPLATE, QWEN3_TEMPLATE  # noqa: E402
from tiny_model import CHATML_TEMPLATE, TinyLlamaSpec, write_tiny_qwen  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _tokenizer(folder: Path, template: str, tags_are_tokens: bool) -> Tokenizer:
    spec = TinyLlamaSpec(n_layers=1, added_tokens=(OPEN, CLOSE) if tags_are_tokens else ())
    folder.mkdir(parents=True, exist_ok=True)
    return Tokenizer.from_file(write_tiny_qwen(folder / "t.gguf", "qwen3", spec, chat_template=template))


@pytest.fixture(scope="module", params=[True, False], ids=["one-token tags", "tags of several tokens"])
def compiler(request, tmp_path_factory) -> GrammarCompiler:
    tok = _tokenizer(tmp_path_factory.mktemp("tok"), QWEN3_TEMPLATE, request.param)
    assert (len(tok.encode(CLOSE, add_special_tokens=False)) == 1) == request.param
    return GrammarCompiler(tok)


def walk(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> tuple[int, bool, list[bool]]:
    """Feed text's tokens through a fresh constraint: (how many it took, whether it ends complete, whether
    end of sequence was allowed before each)."""
    tok = compiler.tokenizer
    constraint = compiler.compile_now(spec).new_constraint()
    eos_allowed = []
    ids = tok.encode(text, add_special_tokens=False)
    for n, t in enumerate(ids):
        mask = TokenMasks([0], compute_masks([constraint])).allowed(tok.vocab_size)[0]
        eos_allowed.append(bool(mask[tok.eos_id]))
        if not mask[t] or not constraint.accept(t):
            return n, False, eos_allowed
    return len(ids), constraint.is_accepting, eos_allowed


def test_the_model_may_think_first_and_the_grammar_holds_from_the_close_tag(compiler):
    spec = GrammarSpec("json_schema", SCHEMA).after_thinking(ThinkingFirst(OPEN, CLOSE, inside=False))
    # Anything in the block, JSON-looking text and a stray opening tag too; a blank line; then the answer.
    text = '<think>\nthe user wants {"a": 1} <think> or so\n</think>\n\n{"a": 12}'
    n, complete, eos = walk(compiler, spec, text)
    assert complete and n == len(compiler.tokenizer.encode(text, add_special_tokens=False))
    assert not any(eos)  # no end of sequence before the answer is whole
    assert walk(compiler, spec, '{"a": 3}')[1]  # or no block at all: the answer at once
    # After the close tag only the grammar: text, an answer that breaks the schema, or too much whitespace
    for bad in ('<think>x</think> hello', '<think>x</think>{"b": 1}', '<think>x</think>\n\n\n\n\n{"a": 1}'):
        assert not walk(compiler, spec, bad)[1], bad
    assert not walk(compiler, spec, 'hmm</think>{"a": 4}')[1]  # the block is opened by the model or not at all


def test_inside_a_block_the_prompt_opened_the_output_starts_as_reasoning(compiler):
    spec = GrammarSpec("json").after_thinking(ThinkingFirst(OPEN, CLOSE, inside=True))
    n, complete, eos = walk(compiler, spec, 'first this {"a": 1}, then</think>\n\n{"x": [1, 2]}')
    assert complete and not any(eos)
    assert not walk(compiler, spec, '{"a": 3}')[1]  # JSON in the block is reasoning: no answer yet


def test_the_waiting_grammar_is_compiled_and_cached_apart_from_the_plain_one(compiler):
    plain = GrammarSpec("json_schema", SCHEMA)
    waiting = plain.after_thinking(ThinkingFirst(OPEN, CLOSE, inside=False))
    assert compiler.compile_now(plain) is not compiler.compile_now(waiting)
    assert compiler.compile_now(waiting) is compiler.compile_now(waiting)
    assert walk(compiler, waiting, '<think>x</think>{"a": 1}')[1] and not walk(compiler, plain, '<think>x</think>{"a": 1}')[1]
    with pytest.raises(GrammarError, match="JSON schema"):  # the request's own errors come first, as they were
        compiler.compile_now(GrammarSpec("json_schema", False).after_thinking(ThinkingFirst(OPEN, CLOSE, False)))
    with pytest.raises(GrammarError, match="single grammar"):
        ThinkingFirst(OPEN, CLOSE, False).wrap('{"grammars": [{"lark_grammar": "start: \\"a\\""}, '
                                               '{"lark_grammar": "start: \\"b\\""}]}')


def test_which_grammars_wait_and_where_the_block_starts(tmp_path, monkeypatch):
    qwen3 = _tokenizer(tmp_path / "a", QWEN3_TEMPLATE, True)
    assert grammar_can_wait(qwen3, GrammarSpec("json")) and grammar_can_wait(qwen3, GrammarSpec("json_schema", SCHEMA))
    # A client's regex, choice or grammar is the whole output (it may write the block itself)
    for kind, value in (("regex", "a+"), ("choice", ["a"]), ("grammar", 'start: "a"')):
        assert not grammar_can_wait(qwen3, GrammarSpec(kind, value))
    assert not grammar_can_wait(qwen3, None)
    assert not grammar_can_wait(_tokenizer(tmp_path / "b", CHATML_TEMPLATE, True), GrammarSpec("json"))  # no thinking
    # A tag that is a special token is outside every grammar's text: the block could never close
    monkeypatch.setattr(qwen3, "is_special", lambda token_id: True)
    assert not grammar_can_wait(qwen3, GrammarSpec("json"))
    monkeypatch.undo()
    always = _tokenizer(tmp_path / "c", OPEN_THINK_TEMPLATE, True)
    for tok, inside in ((qwen3, False), (always, True)):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False)
        assert after_thinking(tok, GrammarSpec("json"), ids).thinking == ThinkingFirst(OPEN, CLOSE, inside)
