"""The one model-name grammar (Ollama's `[host/][namespace/]model[:tag]`): names users and the
catalog use pass, and everything a hostile client may send instead fails with a message that does
not repeat it."""
from __future__ import annotations

import pytest

from tokenmill.store.catalog import KNOWN_MODELS, StoreError
from tokenmill.store.derived import check_name
from tokenmill.store.local import looks_like_path
from tokenmill.store.model_name import (
    InvalidModelName,
    ModelName,
    check_model_reference,
    parse_model_name,
)

GOOD = {
    "smollm2": ModelName("smollm2"),
    "smollm2:135m": ModelName("smollm2", "135m"),
    "gemma3:270m": ModelName("gemma3", "270m"),
    "tiny-a": ModelName("tiny-a"),
    "Llama3.2:3B-instruct-Q4_K_M": ModelName("Llama3.2", "3B-instruct-Q4_K_M"),
    "me/french-tutor:v1": ModelName("french-tutor", "v1", "me"),
    "registry.ollama.ai/library/llama3.2:latest": ModelName("llama3.2", "latest", "library", "registry.ollama.ai"),
    "localhost:5000/team/model": ModelName("model", "", "team", "localhost:5000"),
    "_private": ModelName("_private"),
    "a" * 80 + ":" + "t" * 80: ModelName("a" * 80, "t" * 80),
}

BAD = [
    "", "\ud800", "model\udfff", "mod\x00el", "mod\nel", "tab\tname", "caf\u00e9", "\u202eevil", "a b",
    "a" * 201, "a" * 300, "a" * 81, "m:" + "t" * 81,
    "../../etc/passwd", "..", "a..b", "/etc/passwd", "~/.ssh/id_rsa", "~root", "C:\\Windows\\win.ini",
    "..\\..\\boot.ini", "%2e%2e/%2e%2e/etc/passwd", "tiny-a.gguf", "TINY.GGUF", "./tiny", ".hidden", "-rf",
    "a/b/c/d", "a//b", "/b", "a/", "x:", ":v1", "a:b:c", "ns.dots/model", "model@sha256:abc", "a;rm -rf",
]


@pytest.mark.parametrize("text", sorted(GOOD))
def test_names_users_and_the_catalog_use_pass(text):
    name = parse_model_name(text)
    assert name == GOOD[text] and str(name) == text


def test_every_catalog_name_and_alias_is_in_the_grammar():
    for spec in KNOWN_MODELS.values():
        for n in spec.names:
            parse_model_name(n)


@pytest.mark.parametrize("text", BAD)
def test_hostile_names_fail_without_being_echoed(text):
    with pytest.raises(InvalidModelName) as info:
        parse_model_name(text)
    message = str(info.value)
    assert message.startswith("invalid model name: ")
    if len(text) > 3:
        assert text not in message
    message.encode("utf-8")  # always sendable, whatever the name held
    assert isinstance(info.value, StoreError)  # the store's callers already turn these into 400s


def test_a_non_string_is_not_a_name():
    for value in (None, 3, ["x"], {"a": 1}):
        with pytest.raises(InvalidModelName):
            parse_model_name(value)


def test_what_a_model_is_made_from_may_also_be_a_blob_digest():
    digest = "sha256:" + "ab" * 32
    for ref in (digest, digest.replace(":", "-"), "@" + digest, "smollm2"):
        assert check_model_reference(ref) == ref
    for bad in ("/etc/passwd", "@sha256:xyz", "@smollm2"):
        with pytest.raises(InvalidModelName):
            check_model_reference(bad)


def test_stored_names_follow_the_same_grammar():
    assert check_name("Me/Tutor:V1") == "me/tutor:v1"
    assert check_name("tutor:latest") == "tutor"
    for bad in ("../x", "a" * 300, "x\ud800", "/abs"):
        with pytest.raises(StoreError):
            check_name(bad)


def test_no_name_in_the_grammar_is_taken_for_a_path():
    # resolve_model opens paths: a name that passed the grammar must never be one.
    for text in GOOD:
        assert not looks_like_path(text), text
    for path in ("/models/x.gguf", "./x", "~/x.gguf", "x.gguf", "dir/x.gguf"):
        assert looks_like_path(path), path
