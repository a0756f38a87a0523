"""The models directory: where models live, which are installed and verified, and what they are.

Each model has a small manifest `<file>.json` beside it recording the sha256 it was verified against
and what `list` shows, together with the file's size and mtime; while those still match, the file
is trusted and described without rereading hundreds of MB on every `serve`, `run` or `list`."""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill.store.catalog import (
    ModelSpec,
    StoreError,
    UnknownModelError,
    find_spec,
    known_names,
    spec_for_filename,
)

CHUNK = 1 << 20


class ModelNotInstalledError(StoreError):
    """A known model whose file is missing or fails verification."""


def models_dir() -> Path:
    home = os.environ.get("TOKENMILL_HOME") or "~/.cache/tokenmill"
    return Path(home).expanduser() / "models"


def model_path(spec: ModelSpec) -> Path:
    return models_dir() / spec.filename


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def default_file_mode() -> int:
    # mkstemp creates files 0600; models and manifests are not secrets and may be shared.
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def read_manifest(path: Path) -> dict:
    """What is remembered about `path`, or {} if nothing is or the file changed since."""
    try:
        st = path.stat()
        record = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or (record.get("size"), record.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return {}
    return record


def update_manifest(path: Path, **fields: object) -> None:
    st = path.stat()
    record = {**read_manifest(path), **fields, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    manifest = manifest_path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=manifest.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, manifest)
    except OSError:
        # A read-only models directory (shared install) still works; we just recompute next time.
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_manifest(path: Path, spec: ModelSpec) -> None:
    """Record that `path`, as it is now, was verified against `spec`."""
    update_manifest(path, name=spec.name, sha256=spec.sha256)


def installed_path(spec: ModelSpec) -> Path | None:
    """The model's file if present and verified, else None."""
    path = model_path(spec)
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_size != spec.size_bytes:
        return None
    if read_manifest(path).get("sha256") == spec.sha256:
        return path
    # Copied in by hand or touched since verification: hash once, then remember the result.
    if sha256_file(path) != spec.sha256:
        return None
    write_manifest(path, spec)
    return path


def looks_like_path(name: str) -> bool:
    # A bare word is always a model name, so a stray file called "smollm2" in the cwd cannot shadow it;
    # so is a namespaced one (`user/model`, `host/ns/model:tag`): a path ends in .gguf or starts at
    # `/`, `~` or `.`. No name in the model-name grammar (model_name) looks like a path.
    return (name.endswith(".gguf") or name.startswith(("/", "~", "."))
            or (os.sep != "/" and os.sep in name))


def resolve_model(name_or_path: str) -> Path:
    """A GGUF path for a model name, alias, name of a file in the models directory, or path."""
    if looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if path.is_file():
            return path.absolute()
        raise UnknownModelError(f"no such model file: {path}")
    spec = find_spec(name_or_path)
    if spec is not None:
        path = installed_path(spec)
        if path is not None:
            return path
        state = "failed verification" if model_path(spec).exists() else "is not installed"
        raise ModelNotInstalledError(f"model {spec.name} {state}; run `tokenmill pull {name_or_path}`")
    local = models_dir() / f"{name_or_path}.gguf"
    try:
        if local.is_file():
            return local
    except OSError:  # a name too long for a file name names no file (and the message names no path)
        pass
    raise UnknownModelError(f"unknown model {name_or_path!r}; known models: {known_names()}")


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str
    context_length: int | None
    error: str | None = None  # set when the file is not a readable GGUF
    parameters: int | None = None  # weights' element count (Ollama's parameter_size)


def _read_info(path: Path) -> dict:
    from tokenmill.gguf import open_gguf  # numpy/gguf only when listing

    gguf_file = open_gguf(path)
    arch = gguf_file.architecture
    context = gguf_file.get(f"{arch}.context_length")
    return {
        "architecture": arch,
        "quantization": gguf_file.quantization_label(),
        "context_length": int(context) if context is not None else None,
        "parameters": sum(math.prod(t.shape) for t in gguf_file.tensors.values()),
    }


def describe(path: Path) -> InstalledModel:
    """What `list` shows about a GGUF file (remembered in its manifest)."""
    from tokenmill.gguf import GGUFError

    spec = spec_for_filename(path.name)
    name = spec.name if spec else path.stem
    size = path.stat().st_size
    info = read_manifest(path).get("info")
    if not isinstance(info, dict) or "parameters" not in info:  # (manifests written before it was kept)
        # Parsing a GGUF with a large vocabulary takes seconds; remember the answer beside the file.
        try:
            info = _read_info(path)
        except GGUFError as exc:
            return InstalledModel(name, path, size, "?", "?", None, error=str(exc))
        update_manifest(path, info=info)
    return InstalledModel(name, path, size, info["architecture"], info["quantization"], info["context_length"],
                          parameters=info["parameters"])


def list_models() -> list[InstalledModel]:
    """Every GGUF in the models directory, pulled or copied in, sorted by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted((describe(p) for p in root.glob("*.gguf") if p.is_file()), key=lambda m: m.name)
