"""store/blobs.py and the names built on it: a blob is kept only whole, with the sha256 it was promised
and a valid GGUF inside; a model made from one resolves to it; removing the last model that uses a
blob removes the blob; and a name in a request never stands for a file outside the store."""
from __future__ import annotations

import hashlib
import json

import pytest

from crafted_gguf import crafted_variants
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.store import StoreError, UnknownModelError
from tokenmill.store.blobs import (
    BlobNotFoundError,
    BlobTooLargeError,
    BlobUpload,
    DigestMismatchError,
    InvalidBlobError,
    InvalidDigestError,
    blob_path,
    blobs_dir,
    import_file,
    model_blob,
    parse_digest,
)
from tokenmill.store.derived import Profile, find_derived, save_derived
from tokenmill.store.local import models_dir
from tokenmill.store.names import copy_model, delete_model, resolve_named, resolve_requested


@pytest.fixture
def gguf_bytes(tmp_path) -> bytes:
    """A valid tiny model, also written at tmp_path/src/m.gguf (a file outside the store)."""
    (tmp_path / "src").mkdir()
    return write_tiny_llama(tmp_path / "src" / "m.gguf").read_bytes()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _upload(data: bytes, expected: str | None, **kw) -> str:
    with BlobUpload(expected, **kw) as up:
        for i in range(0, len(data), 10_000):
            up.write(data[i:i + 10_000])
        return up.commit()


def _leftovers() -> list[str]:
    return sorted(p.name for p in blobs_dir().iterdir() if p.name != ".lock") if blobs_dir().is_dir() else []


@pytest.mark.parametrize("text, ok", [
    ("sha256:" + "a" * 64, True), ("sha256-" + "B" * 64, True), ("@sha256:" + "0" * 64, True),
    ("sha256:" + "a" * 63, False), ("sha256:" + "g" * 64, False), ("md5:" + "a" * 64, False),
    ("sha256:" + "a" * 64 + "/../x", False), ("", False), (None, False),
])
def test_digest_syntax(text, ok):
    if ok:
        assert parse_digest(text) == text[-64:].lower()
    else:
        with pytest.raises(InvalidDigestError):
            parse_digest(text)


def test_a_blob_is_kept_under_its_digest_with_what_was_checked(home, gguf_bytes):
    digest = _upload(gguf_bytes, _sha(gguf_bytes))
    assert blob_path(digest).read_bytes() == gguf_bytes
    manifest = json.loads(blob_path(digest).with_name(blob_path(digest).name + ".json").read_text())
    assert manifest["sha256"] == digest and manifest["gguf"]["architecture"] == "llama"
    assert model_blob(digest) == blob_path(digest)
    assert _leftovers() == [f"sha256-{digest}", f"sha256-{digest}.json"]


def test_wrong_digest_too_large_and_invalid_leave_nothing(home, gguf_bytes, tmp_path):
    with pytest.raises(DigestMismatchError):
        _upload(gguf_bytes, "0" * 64)
    with pytest.raises(BlobTooLargeError):
        _upload(gguf_bytes, _sha(gguf_bytes), max_bytes=len(gguf_bytes) - 1)
    for name, data in crafted_variants(tmp_path / "src" / "m.gguf").items():
        with pytest.raises(InvalidBlobError) as info:
            _upload(data, _sha(data))
        assert str(tmp_path) not in str(info.value), name
    assert _leftovers() == []


def test_models_from_a_blob_and_garbage_collection(home, gguf_bytes):
    digest = _upload(gguf_bytes, _sha(gguf_bytes))
    save_derived("mine", f"sha256:{digest}", Profile(system="be brief"))
    save_derived("also-mine", "mine", Profile(parameters={"temperature": 0.0}))  # inherits the blob
    assert find_derived("also-mine").base == f"sha256:{digest}"
    r = resolve_requested("mine")
    assert r.derived and r.path == blob_path(digest) and r.profile.system == "be brief"
    delete_model("mine")
    assert blob_path(digest).exists()  # also-mine still uses it
    delete_model("also-mine")
    assert not blob_path(digest).exists() and _leftovers() == []
    with pytest.raises(BlobNotFoundError):
        save_derived("late", f"sha256:{digest}", Profile())
    assert find_derived("late") is None


def test_a_blob_that_went_missing_is_an_unknown_model_that_can_still_be_removed(home, gguf_bytes):
    digest = _upload(gguf_bytes, _sha(gguf_bytes))
    save_derived("mine", f"sha256:{digest}", Profile())
    blob_path(digest).unlink()
    with pytest.raises(UnknownModelError):
        resolve_named("mine")
    delete_model("mine")
    assert find_derived("mine") is None


def test_paths_are_never_bases_and_files_are_imported_as_blobs(home, gguf_bytes, tmp_path):
    local = tmp_path / "src" / "m.gguf"
    with pytest.raises(StoreError, match="not a file path"):
        save_derived("x", str(local), Profile())
    digest = import_file(local)
    assert digest == _sha(gguf_bytes) and import_file(local) == digest  # held: not copied twice
    copy_model(str(local), "copied")  # `tokenmill cp ./m.gguf copied`
    assert find_derived("copied").base == f"sha256:{digest}"
    local.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(InvalidBlobError):
        import_file(local)
    assert sorted(_leftovers()) == [f"sha256-{digest}", f"sha256-{digest}.json"]


def test_a_request_name_is_never_a_path(home, tmp_path):
    models = models_dir()
    models.mkdir(parents=True, exist_ok=True)
    write_tiny_llama(models / "tiny-a.gguf", TinyLlamaSpec(seed=1))
    outside = write_tiny_llama(tmp_path / "outside.gguf", TinyLlamaSpec(seed=2))
    assert resolve_requested("tiny-a").path == models / "tiny-a.gguf"
    for name in (str(outside), str(tmp_path / "missing.gguf"), "/etc/passwd", "../models/tiny-a",
                 "~/x", "./tiny-a.gguf", "sha256:" + "a" * 64):
        with pytest.raises(UnknownModelError) as info:
            resolve_requested(name)
        assert str(tmp_path) not in str(info.value).replace(name, "")
    # Records an older tokenmill wrote, pointing at files: only inside the store, or what the server
    # was started with.
    (models / "derived").mkdir()
    for name, base in (("legacy-out", str(outside)), ("legacy-in", str(models / "tiny-a.gguf")),
                       ("legacy-etc", "/etc/passwd")):
        (models / "derived" / f"{name}.json").write_text(json.dumps({"name": name, "from": base}))
    assert resolve_requested("legacy-in").path == models / "tiny-a.gguf"
    with pytest.raises(UnknownModelError) as a:
        resolve_requested("legacy-out")
    with pytest.raises(UnknownModelError) as b:
        resolve_requested("legacy-etc")
    assert str(a.value).replace("legacy-out", "") == str(b.value).replace("legacy-etc", "")
    assert str(tmp_path) not in str(a.value) and "/etc" not in str(b.value)
    assert resolve_requested("legacy-out", served_files=[outside]).path == outside
    assert resolve_named("legacy-out").path == outside  # the command line may use any file


def test_a_model_is_not_named_as_a_blob_digest_or_an_installed_file(home, gguf_bytes):
    digest = _upload(gguf_bytes, _sha(gguf_bytes))
    for name in (f"sha256:{digest}", f"sha256-{digest.upper()}"):  # `from: <that>` would mean the blob
        with pytest.raises(StoreError, match="blob digest, not a model name"):
            save_derived(name, f"sha256:{digest}", Profile())
    (models_dir() / "Tiny-Model.Q8_0.gguf").write_bytes(gguf_bytes)
    with pytest.raises(StoreError, match="installed model file"):  # names fold case; the file's does not
        save_derived("tiny-model.q8_0", f"sha256:{digest}", Profile())
    assert [d.name for d in (find_derived(f"sha256:{digest}"), find_derived("tiny-model.q8_0")) if d] == []
