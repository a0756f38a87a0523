"""A corpus of JSON Schemas on the real SmolLM2: every output validates with jsonschema, greedy and
sampled, all in one batch with unconstrained requests whose outputs stay exactly what they are
without the constrained ones."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine_helpers import make_engine, step_until_done
from schema_corpus import SCHEMAS
from tokenmill.engine import FinishReason, SamplingParams
from tokenmill.model import load_model
from tokenmill.structured import GrammarCompiler, GrammarSpec

pytestmark = pytest.mark.real_model

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
PLAIN_PROMPTS = ["Write a haiku about the sea.", "List three uses of a brick."]


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    return load_model(smollm2_path, "auto")


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_corpus_outputs_validate_greedy_and_sampled_beside_unchanged_plain_requests(loaded):
    assert len(SCHEMAS) >= 30
    plain = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=48, temperature=0.9, seed=3, ignore_eos=True)

    alone = make_engine(loaded)
    tok = alone.tokenizer
    plain_reqs = [(chat(tok, p), q) for p in PLAIN_PROMPTS for q in (plain, seeded)]
    ids = [alone.add_request(p, q) for p, q in plain_reqs]
    expected = step_until_done(alone, check_every_step=False)

    engine = make_engine(loaded)
    compiler = GrammarCompiler(engine.tokenizer)
    constrained = {}
    for i, (what, schema) in enumerate(SCHEMAS):
        grammar = compiler.compile_now(GrammarSpec("json_schema", schema))
        prompt = chat(tok, f"Give me {what} as JSON matching this schema: {json.dumps(schema)}")
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_tokens=160, temperature=temperature, seed=i, constraint=grammar)
            constrained[engine.add_request(prompt, params)] = (what, schema, temperature)
    mixed_ids = [engine.add_request(p, q) for p, q in plain_reqs]
    finish = {}
    outputs: dict = {}
    while engine.has_unfinished():
        for ev in engine.step():
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                finish[ev.request_id] = ev.finish_reason
    assert engine.blocks.num_used_blocks == 0

    assert [outputs[r] for r in mixed_ids] == [expected[(r, 0)] for r in ids]
    failures = []
    for rid, (what, schema, temperature) in constrained.items():
        text = tok.decode(outputs[rid], skip_special_tokens=True)
        try:
            assert finish[rid] is FinishReason.STOP, finish[rid]
            jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        except Exception as exc:  # noqa: BLE001 - collect them all for one readable failure
            failures.append(f"{what} (t={temperature}): {text!r}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not failures, "\n".join(failures)
