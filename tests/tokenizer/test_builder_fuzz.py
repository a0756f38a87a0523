"""Hostile tokenizer metadata: the builder, given a real vocabulary (byte-level BPE and SentencePiece)
with keys deleted, swapped for values of the wrong type, cut short or scrambled, either builds a
tokenizer that then encodes and decodes, or raises TokenizerError. Nothing else escapes."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_spm import tiny_spm_metadata
from tokenmill.gguf import open_gguf
from tokenmill.tokenizer import Tokenizer, TokenizerError

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64), st.floats(allow_nan=True), st.text(max_size=20),
    st.binary(max_size=8),
    st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=6), st.none()), max_size=12),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
KEYS = ["model", "pre", "tokens", "merges", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id",
        "padding_token_id", "add_bos_token", "add_eos_token", "scores", "eot_token_id"]


@st.composite
def mutation(draw):
    key = f"tokenizer.ggml.{draw(st.sampled_from(KEYS))}"
    kind = draw(st.sampled_from(["delete", "junk", "truncate", "shuffle", "scramble", "out_of_range"]))
    return key, kind, draw(JUNK), draw(st.integers(0, 2**31)), draw(st.randoms(use_true_random=False))


def mutate(metadata: dict, mutations) -> dict:
    out = dict(metadata)
    for key, kind, junk, n, rnd in mutations:
        value = out.get(key)
        if kind == "delete":
            out.pop(key, None)
        elif kind == "junk":
            out[key] = junk
        elif kind == "truncate" and isinstance(value, list):
            out[key] = value[: n % (len(value) + 1)]
        elif kind == "shuffle" and isinstance(value, list):
            value = list(value)
            rnd.shuffle(value)
            out[key] = value
        elif kind == "scramble" and isinstance(value, list) and value:
            value = list(value)
            i = n % len(value)
            value[i] = junk if not isinstance(value[i], str) else value[i][::-1] + "\x00"
            out[key] = value
        elif kind == "out_of_range":
            out[key] = n * 1000 + 10**9
    return out


@pytest.fixture(scope="module")
def bases(tiny_gguf):
    bpe = {k: v for k, v in open_gguf(tiny_gguf).metadata.items() if k.startswith("tokenizer.")}
    return {"bpe": bpe, "spm": dict(tiny_spm_metadata())}


@pytest.mark.parametrize("base", ["bpe", "spm"])
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation(), min_size=1, max_size=3), text=st.text(max_size=30))
def test_hostile_metadata_is_a_tokenizer_error_or_a_working_tokenizer(bases, base, mutations, text):
    metadata = mutate(bases[base], mutations)
    try:
        tok = Tokenizer.from_gguf_metadata(metadata)
    except TokenizerError:
        return
    try:
        ids = tok.encode(text)
        tok.decode(ids)
    except TokenizerError:
        pass
