"""Schemas that allow no finite value (recursion without a base case) are refused when compiled,
while recursive schemas that can end compile and still accept their values."""
from __future__ import annotations

import pytest

from tokenmill.structured import GrammarCompiler, GrammarError, GrammarSpec, rebase_refs
from tokenmill.structured.masks import TokenMasks, compute_masks
from tokenmill.structured.schema_finite import unfinishable_refs

TREE = {"type": "object", "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["value"], "additionalProperties": False}
LINKED_LIST = {"$defs": {"node": {"type": "object", "required": ["value", "next"], "properties": {
    "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
    "$ref": "#/$defs/node"}
ENDLESS_CHAIN = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}

SATISFIABLE = [
    TREE,
    LINKED_LIST,
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["children"]},  # [] ends it
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: null, 1, "x" are values
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"x": {"$ref": "https://example.com/elsewhere"}}, "required": ["x"]},
    {"type": "object", "properties": {"t": {"$id": "http://x/node", "type": "object",
                                            "properties": {"k": {"$ref": "#"}}, "required": ["k"]}}},
]
UNSATISFIABLE = [
    ({"$ref": "#"}, ["#"]),
    (ENDLESS_CHAIN, ["#"]),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     ["#/$defs/a", "#/$defs/b"]),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, ["#"]),
    ({"type": "array", "items": [{"$ref": "#"}], "minItems": 1}, ["#"]),  # draft-07 tuple items
    ({"type": "array", "contains": {"$ref": "#"}}, ["#"]),
    ({"anyOf": [{"$ref": "#"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]}, ["#"]),
    ({"$defs": {"n": {"$anchor": "node", "type": "object", "properties": {"n": {"$ref": "#node"}},
                      "required": ["n"]}}, "$ref": "#node"}, ["#node"]),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, []),
]


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer)


@pytest.mark.parametrize("schema", SATISFIABLE)
def test_schemas_with_a_finite_value_pass(schema):
    assert unfinishable_refs(schema) is None


@pytest.mark.parametrize("schema, refs", UNSATISFIABLE)
def test_schemas_without_one_name_the_refs_to_blame(schema, refs):
    assert sorted(unfinishable_refs(schema)) == refs


@pytest.mark.parametrize("schema, refs", UNSATISFIABLE[:-1])
def test_the_compiler_refuses_recursion_without_a_base_case(compiler, schema, refs):
    with pytest.raises(GrammarError, match="recursive without a base case"):
        compiler.compile_now(GrammarSpec("json_schema", schema))


def test_a_long_chain_of_refs_is_judged_in_linear_time():
    # 20k definitions, each referring to the next: a fixed point found round by round would take
    # 20k rounds; propagation takes one pass.
    n = 20_000
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    assert unfinishable_refs({"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}) is None
    assert len(unfinishable_refs({"$defs": {**defs, f"d{n}": {"$ref": "#/$defs/d0"}}, "$ref": "#/$defs/d0"})) == n + 1


@pytest.mark.parametrize("schema, text", [
    (TREE, '{"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4, "children": []}]}]}'),
    (LINKED_LIST, '{"value": 1, "next": {"value": 2, "next": null}}'),
])
def test_recursive_schemas_that_can_end_still_compile_and_match(compiler, schema, text):
    constraint = compiler.compile_now(GrammarSpec("json_schema", schema)).new_constraint()
    for t in compiler.tokenizer.encode(text, add_special_tokens=False):
        assert TokenMasks([0], compute_masks([constraint])).allowed(compiler.tokenizer.vocab_size)[0][t]
        assert constraint.accept(t)
    assert constraint.is_accepting


def test_a_grammar_whose_start_never_ends_is_refused(compiler):
    with pytest.raises(GrammarError, match="allows no output"):
        compiler.compile_now(GrammarSpec("grammar", "start: a\na: a\n"))


def test_rebased_refs_point_where_they_did():
    schema = {"$defs": {"n": {"type": "integer"}}, "properties": {
        "a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#"}, "c": {"$ref": "#anchor"}, "d": {"$ref": "other.json#/x"},
        "$ref": {"const": {"$ref": "#"}}},  # a property named "$ref", and a value that only looks like a ref
        "items": [{"$ref": "#"}], "enum": [{"$ref": "#"}]}
    out = rebase_refs(schema, "#/$defs/tool_0")
    props = out["properties"]
    assert [props[k]["$ref"] for k in "abcd"] == ["#/$defs/tool_0/$defs/n", "#/$defs/tool_0", "#anchor",
                                                 "other.json#/x"]
    assert props["$ref"] == {"const": {"$ref": "#"}} and out["enum"] == [{"$ref": "#"}]
    assert out["items"] == [{"$ref": "#/$defs/tool_0"}]
