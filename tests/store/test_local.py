from __future__ import annotations

import json
import os
import shutil

import pytest

from tokenmill.store import (
    ModelNotInstalledError,
    UnknownModelError,
    list_models,
    models_dir,
    pull,
    resolve_model,
)


def test_models_dir_follows_tokenmill_home(home, monkeypatch):
    assert models_dir() == home / "models"
    monkeypatch.delenv("TOKENMILL_HOME")
    assert models_dir() == models_dir().home() / ".cache" / "tokenmill" / "models"


def test_a_gguf_path_resolves_to_itself(tiny_gguf, home):
    assert resolve_model(str(tiny_gguf)) == tiny_gguf
    with pytest.raises(UnknownModelError, match="no such model file"):
        resolve_model(str(tiny_gguf.with_name("missing.gguf")))


def test_known_but_not_installed_says_how_to_pull(home):
    with pytest.raises(ModelNotInstalledError, match="tokenmill pull smollm2"):
        resolve_model("smollm2")


def test_unknown_name_lists_known_models(home):
    with pytest.raises(UnknownModelError, match="smollm2:135m"):
        resolve_model("mistral")


def test_installed_model_resolves_by_name_and_alias(home, make_model):
    model = make_model("fake:1b", aliases=("fake",))
    path = pull("fake", progress=False, fetcher=model.index)
    assert resolve_model("fake:1b") == path == resolve_model("fake")


def test_hand_copied_file_is_verified_once_then_trusted(home, make_model):
    model = make_model()
    models_dir().mkdir(parents=True)
    target = models_dir() / model.spec.filename
    target.write_bytes(model.data)
    assert resolve_model(model.spec.name) == target
    manifest = json.loads(target.with_name(target.name + ".json").read_text())
    assert manifest["sha256"] == model.spec.sha256


def test_damaged_install_is_not_trusted(home, make_model):
    model = make_model()
    path = pull(model.spec.name, progress=False, fetcher=model.index)
    path.write_bytes(b"\0" * model.spec.size_bytes)  # same size, new mtime, wrong bytes
    with pytest.raises(ModelNotInstalledError, match="failed verification"):
        resolve_model(model.spec.name)


def test_file_in_models_dir_resolves_by_stem(home, tiny_gguf):
    models_dir().mkdir(parents=True)
    shutil.copy(tiny_gguf, models_dir() / "tiny.gguf")
    assert resolve_model("tiny") == models_dir() / "tiny.gguf"


def test_list_models_reads_gguf_metadata(home, tiny_gguf):
    assert list_models() == []
    models_dir().mkdir(parents=True)
    shutil.copy(tiny_gguf, models_dir() / "tiny.gguf")
    (models_dir() / "broken.gguf").write_bytes(b"not a gguf")
    (models_dir() / "x.gguf.123.partial").write_bytes(b"ignored")
    broken, tiny = list_models()
    assert (tiny.name, tiny.architecture, tiny.quantization, tiny.context_length) == ("tiny", "llama", "F32", 256)
    assert tiny.size_bytes == os.path.getsize(tiny_gguf) and tiny.error is None
    assert broken.name == "broken" and broken.error and broken.architecture == "?"


def test_list_remembers_what_it_read_until_the_file_changes(home, tiny_gguf, monkeypatch):
    import tokenmill.gguf

    models_dir().mkdir(parents=True)
    target = models_dir() / "tiny.gguf"
    shutil.copy(tiny_gguf, target)
    first = list_models()
    with monkeypatch.context() as m:
        m.setattr(tokenmill.gguf, "open_gguf", lambda path: pytest.fail("should use the manifest"))
        assert list_models() == first
    os.utime(target, ns=(1, 1))
    assert list_models() == first  # re-read, same answer
    assert json.loads((models_dir() / "tiny.gguf.json").read_text())["mtime_ns"] == 1
