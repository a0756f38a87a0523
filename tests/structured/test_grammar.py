"""Grammar specs, compilation and the tokenizer bridge, on the tiny byte-level vocabulary and the
two real ones (byte-level BPE and Gemma's SentencePiece)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tokenmill.structured import GrammarCompiler, GrammarError, GrammarSpec, grammar_tokenizer
from tokenmill.structured.grammar import MAX_SOURCE_CHARS
from tokenmill.structured.masks import TokenMasks, apply_token_masks, compute_masks
from tokenmill.tokenizer import Tokenizer


def walk(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """Feed `text`'s tokens through a fresh constraint, checking each is in the mask; True if complete."""
    constraint = compiler.compile_now(spec).new_constraint()
    for t in compiler.tokenizer.encode(text, add_special_tokens=False):
        mask = TokenMasks([0], compute_masks([constraint])).allowed(compiler.tokenizer.vocab_size)[0]
        assert mask[t], f"{compiler.tokenizer.decode([t])!r} not allowed in {text!r}"
        assert constraint.accept(t)
    return constraint.is_accepting


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer)


@pytest.mark.parametrize("spec, text", [
    (GrammarSpec("json"), '{"a": [1, 2, {"b": null}], "c": "d"}'),
    (GrammarSpec("json_schema", {"type": "object", "properties": {"x": {"enum": ["hello", "there"]}},
                                 "required": ["x"]}), '{"x": "hello"}'),
    (GrammarSpec("regex", r"[a-c]{3}-\d{2}"), "abc-42"),
    (GrammarSpec("choice", ["yes", "no"]), "no"),
    (GrammarSpec("grammar", 'root ::= "the " ("cat" | "dog")'), "the dog"),  # llama.cpp GBNF
    (GrammarSpec("grammar", 'start: "a"+ "b"'), "aaab"),  # Lark
])
def test_a_matching_text_walks_through_the_masks_to_completion(compiler, spec, text):
    assert walk(compiler, spec, text)


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", {"type": "bogus"}), "Invalid type: bogus"),
    (GrammarSpec("json_schema", {"type": "string", "pattern": "(("}), "unclosed group"),
    (GrammarSpec("json_schema", {"$ref": "#/definitions/missing"}), "does not exist"),
    (GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                                       "maximum": 1}}, "required": ["a"]}),
     "unsatisfiable"),
    (GrammarSpec("json_schema", [1, 2]), "must be an object"),
    (GrammarSpec("regex", "(("), "unclosed group"),
    (GrammarSpec("regex", ""), "non-empty string"),
    (GrammarSpec("choice", []), "non-empty list"),
    (GrammarSpec("choice", ["a", 3]), "non-empty list of non-empty strings"),
    (GrammarSpec("grammar", "root ::= (("), r"Expected '\)'"),
    (GrammarSpec("grammar", "start: undefined_rule"), "undefined_rule"),
    (GrammarSpec("regex", "a" * (MAX_SOURCE_CHARS + 1)), "at most"),
])
def test_bad_schemas_and_grammars_name_the_problem(compiler, spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile_now(spec)


def test_compiled_grammars_are_cached_and_each_constraint_is_independent(compiler):
    spec = GrammarSpec("choice", ["ab", "ac"])
    grammar = compiler.compile_now(spec)
    assert compiler.compile_now(GrammarSpec("choice", ["ab", "ac"])) is grammar
    first, second = grammar.new_constraint(), grammar.new_constraint()
    a = compiler.tokenizer.encode("a", add_special_tokens=False)
    assert first.accept(a[0])
    fork = first.fork()
    assert fork.accept(compiler.tokenizer.encode("b", add_special_tokens=False)[0]) and fork.is_complete
    assert not first.is_complete and not second.is_accepting


def test_compile_off_thread_reports_errors_and_timeouts(tiny_tokenizer):
    async def go(compiler, spec):
        return await compiler.compile(spec)

    ok = asyncio.run(go(GrammarCompiler(tiny_tokenizer), GrammarSpec("json")))
    assert ok.new_constraint().is_accepting is False
    with pytest.raises(GrammarError, match="Invalid type"):
        asyncio.run(go(GrammarCompiler(tiny_tokenizer), GrammarSpec("json_schema", {"type": "nope"})))
    with pytest.raises(GrammarError, match="longer than 0 s"):
        asyncio.run(go(GrammarCompiler(tiny_tokenizer, timeout_s=0), GrammarSpec("regex", "x+y")))


def test_masks_leave_other_rows_and_padding_ids_alone(compiler):
    constraint = compiler.compile_now(GrammarSpec("choice", ["hello"])).new_constraint()
    vocab = compiler.tokenizer.vocab_size
    logits = torch.randn(3, vocab + 5)  # an embedding padded past the tokenizer's vocabulary
    before = logits.clone()
    out = apply_token_masks(logits, TokenMasks([1], compute_masks([constraint])), in_place=False)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2]) and torch.equal(logits, before)
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all(compiler.tokenizer.decode([t]) in {"h", "he", "hell", "hello"} for t in allowed)
    assert not torch.isfinite(out[1, vocab:]).any()


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_bridge_spells_every_token_as_our_tokenizer_does(model, smollm2_path, gemma3_path):
    tok = Tokenizer.from_file(smollm2_path if model == "smollm2" else gemma3_path)
    lltok = grammar_tokenizer(tok)
    assert grammar_tokenizer(tok) is lltok  # cached per tokenizer
    assert lltok.vocab_size == tok.vocab_size
    for i in range(0, tok.vocab_size, 7):
        if not tok.is_special(i):
            assert lltok.decode_bytes([i]) == tok.token_bytes(i), i
    # Whole documents in the tokens our tokenizer picks, multi-byte characters included.
    compiler = GrammarCompiler(tok)
    doc = {"name": "Zoë Ångström", "city": "東京", "n": 3}
    assert walk(compiler, GrammarSpec("json"), json.dumps(doc, ensure_ascii=False))
