"""Blobs, as Ollama keeps them: files in `<models>/blobs/sha256-<hex>` named by their content's
sha256, pushed by clients (`POST /api/blobs/sha256:<hex>`) or imported by `tokenmill create` from a
Modelfile's `FROM ./file.gguf`, and made into models by `create` with `files`.

A blob only appears under its name through one os.replace of a fully written file whose sha256
matched and whose GGUF structure passed gguf/validate.py; a failed or cut upload leaves nothing
behind but a temp file it removes itself. What was checked is remembered in a manifest beside the
blob (as for pulled models), so using a blob later does not re-read it."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict
from pathlib import Path

from tokenmill.store.catalog import StoreError
from tokenmill.store.local import (
    CHUNK,
    default_file_mode,
    manifest_path,
    models_dir,
    read_manifest,
    sha256_file,
    update_manifest,
)

# Ollama's forms: `sha256:<hex>` in URLs and requests, `sha256-<hex>` on disk, `@sha256:<hex>` in a
# Modelfile's FROM after its CLI pushed the file.
_DIGEST = re.compile(r"@?sha256[:-]([0-9a-fA-F]{64})")
_UPLOAD_PREFIX = ".upload-"
STALE_UPLOAD_SECONDS = 24 * 3600  # a temp file this old belongs to a server that was killed mid-upload


class BlobError(StoreError):
    """A blob operation a client asked for that cannot be done; the message says why."""


class InvalidDigestError(BlobError):
    pass


class BlobNotFoundError(BlobError):
    pass


class DigestMismatchError(BlobError):
    pass


class BlobTooLargeError(BlobError):
    pass


class InvalidBlobError(BlobError):
    """The blob is not a GGUF model (or LoRA adapter) tokenmill can use, or not the kind asked for."""


def is_digest(text: object) -> bool:
    return isinstance(text, str) and _DIGEST.fullmatch(text) is not None


def parse_digest(text: object) -> str:
    """The lowercase hex of a `sha256:<hex>` digest (or Ollama's other spellings of one)."""
    m = _DIGEST.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise InvalidDigestError("a blob digest is sha256:<64 hex digits>")
    return m.group(1).lower()


def digest_ref(hexdigest: str) -> str:
    return f"sha256:{hexdigest}"


def blobs_dir() -> Path:
    return models_dir() / "blobs"


def blob_path(hexdigest: str) -> Path:
    return blobs_dir() / f"sha256-{hexdigest}"


def is_blob_path(path: Path) -> bool:
    """Whether `path` is a blob of the store (a model made from it is listed under its created name)."""
    return re.fullmatch(r"sha256-[0-9a-f]{64}", path.name) is not None and path.parent.resolve() == blobs_dir().resolve()


def has_blob(hexdigest: str) -> bool:
    return blob_path(hexdigest).is_file()


def supported_architectures() -> tuple[str, ...]:
    # The loader's own table: a blob passes validation only if the loader has a model class for it.
    from tokenmill.model.registry import ARCHITECTURES

    return tuple(ARCHITECTURES)


@contextlib.contextmanager
def blob_lock() -> Iterator[None]:
    """Held while a model is made from a blob and while unused blobs are removed, so a blob is never
    removed between a create's check that it is there and the record that uses it."""
    blobs_dir().mkdir(parents=True, exist_ok=True)
    with (blobs_dir() / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _validate(path: Path, architectures: Collection[str] | None) -> dict:
    from tokenmill.gguf.validate import InvalidGGUF, validate_gguf

    try:
        return asdict(validate_gguf(path, architectures if architectures is not None else supported_architectures()))
    except InvalidGGUF as exc:
        raise InvalidBlobError(f"not a valid GGUF model: {exc}") from None


class BlobUpload:
    """A blob being written: bytes go to a temp file in the blobs directory while being hashed; commit()
    keeps it under its digest only if the sha256 is the expected one and the file is a valid GGUF.
    Leaving the `with` block without a commit removes the temp file."""

    def __init__(self, expected: str | None = None, max_bytes: int | None = None,
                 architectures: Collection[str] | None = None):
        self.expected = expected
        self.max_bytes = max_bytes
        self.architectures = architectures
        self.size = 0
        self._hash = hashlib.sha256()
        blobs_dir().mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=blobs_dir(), prefix=_UPLOAD_PREFIX, suffix=".tmp")
        self.tmp: Path | None = Path(tmp)
        self._file = os.fdopen(fd, "wb")

    def __enter__(self) -> "BlobUpload":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.max_bytes is not None and self.size > self.max_bytes:
            self.abort()
            raise BlobTooLargeError(f"the blob is larger than the limit of {self.max_bytes} bytes")
        self._hash.update(data)
        self._file.write(data)

    def commit(self) -> str:
        """The blob's hex digest, now held; DigestMismatchError or InvalidBlobError otherwise."""
        assert self.tmp is not None, "commit after abort"
        self._file.close()
        digest = self._hash.hexdigest()
        if self.expected is not None and digest != self.expected:
            raise DigestMismatchError(f"digest mismatch: the body's sha256 is {digest}, not the {self.expected} "
                                      "the request named")
        info = _validate(self.tmp, self.architectures)
        os.chmod(self.tmp, default_file_mode())
        final = blob_path(digest)
        os.replace(self.tmp, final)
        self.tmp = None
        update_manifest(final, sha256=digest, gguf=info)
        return digest

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def model_blob(hexdigest: str) -> Path:
    """The held blob `hexdigest` if it is a valid GGUF model (checked once, then remembered)."""
    return _checked_blob(hexdigest, "model")


def adapter_blob(hexdigest: str) -> Path:
    """The held blob `hexdigest` if it is a valid LoRA adapter (gguf/lora.py; checked once, then remembered)."""
    return _checked_blob(hexdigest, "adapter")


def _checked_blob(hexdigest: str, kind: str) -> Path:
    path = blob_path(hexdigest)
    if not path.is_file():
        raise BlobNotFoundError(f"blob {digest_ref(hexdigest)} not found; push it first (POST /api/blobs/"
                                f"{digest_ref(hexdigest)})")
    info = read_manifest(path).get("gguf")
    if info is None:  # copied in by hand, or changed since it was checked
        info = _validate(path, None)
        update_manifest(path, gguf=info)
    held = info.get("kind", "model")  # manifests written before adapters were all models'
    if held != kind:
        what = {"model": "a model", "adapter": "a LoRA adapter"}
        raise InvalidBlobError(f"blob {digest_ref(hexdigest)} is {what.get(held, held)}, not {what[kind]}")
    return path


# The hex sha256 of a file, read in pieces: the store's own (manifests verify pulled files with it).
file_digest = sha256_file


def import_file(path: Path, digest: str | None = None, max_bytes: int | None = None, kind: str = "model") -> str:
    """Copy a local GGUF file into the blobs (the in-process `create` with `FROM ./file.gguf` or
    `ADAPTER ./lora.gguf`, as Ollama's create copies it): its hex digest (`digest`, if the caller hashed
    it already). A file already held is not copied again. kind: "model" or "adapter"."""
    digest = digest or file_digest(path)
    if has_blob(digest):
        _checked_blob(digest, kind)
        return digest
    with path.open("rb") as f, BlobUpload(digest, max_bytes) as upload:
        while chunk := f.read(CHUNK):
            upload.write(chunk)
        digest = upload.commit()
    try:
        _checked_blob(digest, kind)
    except InvalidBlobError:  # a model given as an adapter, or the other way: not kept for nothing
        with blob_lock():
            remove_blob(digest)
        raise
    return digest


def remove_blob(hexdigest: str) -> bool:
    """Delete a blob and its manifest (the caller holds blob_lock and knows no model uses it)."""
    path = blob_path(hexdigest)
    manifest_path(path).unlink(missing_ok=True)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def remove_stale_uploads(max_age: float = STALE_UPLOAD_SECONDS) -> None:
    root = blobs_dir()
    if not root.is_dir():
        return
    cutoff = time.time() - max_age
    for p in root.glob(f"{_UPLOAD_PREFIX}*.tmp"):
        with contextlib.suppress(OSError):
            if p.stat().st_mtime < cutoff:
                p.unlink()
