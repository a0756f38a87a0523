"""A base model with LoRA adapters merged in, kept as a blob of its own: `create` with ADAPTER (or
`adapters`) makes it once, and the model it names is then an ordinary GGUF to every loader, keyed
by its own file as any other model is. The adapters come in as blobs too (pushed, or imported from
a Modelfile's `ADAPTER ./file.gguf` by the CLI): a request names them by digest, never by path."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenmill.gguf.lora import check_fits, merge, read_adapter
from tokenmill.gguf.reader import GGUFError, open_gguf
from tokenmill.gguf.rewrite import write_replaced
from tokenmill.store.blobs import BlobUpload, InvalidBlobError, adapter_blob, parse_digest


def merged_blob(base_path: Path, adapter_digests: Sequence[str]) -> str:
    """The hex digest of a blob holding the model at `base_path` with each adapter (a blob digest)
    merged in, in order. InvalidBlobError names what does not fit (never a path); nothing is kept then."""
    base = _open(base_path, "the base model")
    adapters = []
    for i, digest in enumerate(adapter_digests):
        label = f"adapter {i + 1} ({digest})"
        try:
            adapter = read_adapter(_open(adapter_blob(parse_digest(digest)), label))
            check_fits(adapter, base)
        except GGUFError as exc:
            raise InvalidBlobError(f"{label} cannot be applied: {exc}") from None
        adapters.append(adapter)
    try:
        with BlobUpload() as upload:  # the merged tensors are made as they are written
            write_replaced(base, merge(base, adapters), upload.write)
            return upload.commit()
    except GGUFError as exc:  # an update that is not finite: the upload is dropped, nothing kept
        raise InvalidBlobError(f"the adapters cannot be applied: {exc}") from None


def _open(path: Path, label: str):
    try:
        return open_gguf(path)
    except GGUFError as exc:  # the reader's messages start with the path, which a client never sees
        raise InvalidBlobError(str(exc).replace(str(path), label)) from None
