"""Every command's --help prints its usage and exits 0: argparse formats help strings with %, so one
stray "75%" in a setting's description used to crash `tokenmill serve --help`."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.bench import BENCHMARKS
from tokenmill.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(c for c in COMMANDS if c not in ("bench", "serve-ray")))
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tokenmill {command}")


def test_serve_help_shows_a_literal_percent(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "75% of" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_the_benchmarks(flag, capsys):
    assert main(["bench", flag]) == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert f"  {name} " in out


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_prints_its_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: tokenmill bench {name}")


def test_unknown_flags_are_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["list", "--bogus"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_version_says_how_many_threads_and_why():
    from tokenmill.cpu_threads import default_threads

    # A fresh process: tests before this one set the process-wide thread count, which --version reports.
    run = subprocess.run([sys.executable, "-c", "from tokenmill.cli import main; main(['--version'])"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    default = default_threads()
    assert f"\nthreads: {default.count} by default ({default.reason}); --threads overrides" in out
    assert "kernels: " in out


def test_serve_help_says_what_threads_0_means(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "0 = physical cores within affinity and cgroup quota" in " ".join(capsys.readouterr().out.split())


def test_a_benchmark_without_its_package_says_which_extra_installs_it(monkeypatch, capsys):
    # `make serve` installs no httpx; `tokenmill bench serve` then prints the install hint, no traceback.
    import sys

    for mod in [m for m in sys.modules if m == "httpx" or m.startswith(("httpx.", "tokenmill.bench."))]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx -> ModuleNotFoundError
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "needs the Python package 'httpx'" in err and "pip install 'tokenmill[bench]'" in err
