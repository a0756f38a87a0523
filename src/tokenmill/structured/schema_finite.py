"""Whether a JSON schema allows any (finite) value at all, so that a recursive schema with no base
case (`{"$ref": "#"}`, an object that requires a child of its own kind) is a 400 when it is
compiled rather than a generation that can never finish.

The grammar compiler does not see this: its grammar compiles, and the parser either finds no first
token or lets the output nest deeper and deeper until it gives up. So the schema is checked here, as
the "productive symbols" test of a context-free grammar: a schema can be satisfied if some type it
allows can be built from parts that can (a primitive always can; an object needs its required
properties, an array its required items); a `$ref` as its target can. The least fixed point over the
document's refs, propagated through an and/or graph, takes time linear in the schema's size.

The test over-approximates: whatever it cannot judge (`not`, `if`, patterns, remote refs, numeric
bounds) counts as satisfiable, so a schema it rejects has no value at all, and one it passes may
still be rejected by the compiler."""
from __future__ import annotations

from typing import Any

from tokenmill.structured.schema_refs import has_nested_id, resolve_ref

_ALL_TYPES = ["null", "boolean", "number", "integer", "string", "object", "array"]


class _Node:
    """One and/or node: satisfiable once `need` of its children are (all of them for an "and",
    one for an "or"; an "or" of nothing never is)."""
    __slots__ = ("need", "parents", "ref")

    def __init__(self, need: int, ref: str | None = None):
        self.need = need
        self.parents: list[_Node] = []
        self.ref = ref


class _Graph:
    def __init__(self, root: Any):
        self.root = root
        self.nodes: list[_Node] = []
        self._of_schema: dict[int, _Node] = {}
        self._todo: list[tuple[Any, _Node]] = []

    def node(self, children: list[_Node], *, any_of: bool = False, ref: str | None = None) -> _Node:
        n = _Node(1 if any_of else len(children), ref)
        for c in children:
            c.parents.append(n)
        self.nodes.append(n)
        return n

    def schema(self, s: Any) -> _Node:
        """The node of a schema, built once per schema object (refs to it share it)."""
        if s is True or not isinstance(s, (dict, bool)):  # what is not a schema is the compiler's to judge
            return self.node([])
        if s is False:
            return self.node([], any_of=True)
        known = self._of_schema.get(id(s))
        if known is None:
            # Its children are built later (a queue, not recursion: ref chains can be long).
            known = self._of_schema[id(s)] = _Node(0)
            self.nodes.append(known)
            self._todo.append((s, known))
        return known

    def build(self) -> _Node:
        top = self.schema(self.root)
        while self._todo:
            s, n = self._todo.pop()
            parts = self._parts(s)
            n.need = len(parts)
            for p in parts:
                p.parents.append(n)
        return top

    def _parts(self, s: dict) -> list[_Node]:
        """What must all be satisfiable for `s` to be: its $ref, each allOf, one anyOf/oneOf, one type."""
        parts = []
        ref = s.get("$ref")
        if isinstance(ref, str):
            target = resolve_ref(self.root, ref)
            if target is not None:
                parts.append(self.node([self.schema(target)], ref=ref))
        if isinstance(s.get("allOf"), list):
            parts += [self.schema(b) for b in s["allOf"]]
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                parts.append(self.node([self.schema(b) for b in s[key]], any_of=True))
        parts.append(self._some_type(s))
        return parts

    def _some_type(self, s: dict) -> _Node:
        if "const" in s or "enum" in s:  # literal values: nothing to build
            return self.node([])
        types = s.get("type", _ALL_TYPES)
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or any(t not in ("object", "array") for t in types):
            return self.node([])  # a primitive type (or one the compiler will reject) needs nothing
        shapes = ([self._object(s)] if "object" in types else []) + ([self._array(s)] if "array" in types else [])
        return self.node(shapes, any_of=True)

    def _object(self, s: dict) -> _Node:
        required = s.get("required")
        names = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
        properties = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        parts = []
        for name in dict.fromkeys(names):
            if name in properties:
                parts.append(self.schema(properties[name]))
            elif not s.get("patternProperties"):  # a pattern may apply instead: not judged
                parts.append(self.schema(s.get("additionalProperties", True)))
        return self.node(parts)

    def _array(self, s: dict) -> _Node:
        least = s.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix, rest = s.get("prefixItems"), s.get("items", True)
        if isinstance(rest, list):  # drafts before 2020-12: items as a list, the rest in additionalItems
            prefix, rest = rest, s.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        parts = [self.schema(p) for p in prefix[:least]]
        if least > len(prefix):
            parts.append(self.schema(rest))
        if "contains" in s and s.get("minContains", 1) != 0:
            parts.append(self.schema(s["contains"]))
        return self.node(parts)


def unfinishable_refs(schema: Any) -> list[str] | None:
    """None if `schema` allows some value (or cannot be judged); else the refs that lead nowhere
    finite (empty when no ref is to blame: a required part is `false`)."""
    if not isinstance(schema, dict) or has_nested_id(schema):
        return None
    graph = _Graph(schema)
    top = graph.build()
    ready = [n for n in graph.nodes if n.need == 0]
    satisfiable: set[int] = set()
    while ready:
        n = ready.pop()
        if id(n) in satisfiable:
            continue
        satisfiable.add(id(n))
        for p in n.parents:
            p.need -= 1
            if p.need == 0:
                ready.append(p)
    if id(top) in satisfiable:
        return None
    return list(dict.fromkeys(n.ref for n in graph.nodes if n.ref is not None and id(n) not in satisfiable))
