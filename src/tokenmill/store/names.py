"""Names a user or client gives a model, resolved to the GGUF to load and the profile to apply; and
the store operations on names (`rm`, `cp`), which treat base and derived models alike.

A name in a request (resolve_requested) is held to more than one on the command line: it never
stands for a path, and a derived model an older tokenmill made from a file outside the model store
resolves only if the server was started with that file. The server opens, or even looks at, no file
outside the store because a request named it."""
from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.store.blobs import (
    BlobError,
    blob_lock,
    blob_path,
    digest_ref,
    import_file,
    is_digest,
    model_blob,
    parse_digest,
)
from tokenmill.store.catalog import StoreError, UnknownModelError, spec_for_filename
from tokenmill.store.derived import (
    ModelInUseError,
    Profile,
    check_name,
    delete_derived,
    dependents,
    find_derived,
    normalize_name,
    remove_unused_blob,
    save_derived,
)
from tokenmill.store.local import looks_like_path, manifest_path, models_dir, resolve_model


@dataclass(frozen=True)
class ResolvedModel:
    name: str                  # canonical: the catalog name, the derived name, or the file's stem
    path: Path                 # the GGUF behind it
    profile: Profile = field(default_factory=Profile)
    derived: bool = False


def base_name(path: Path) -> str:
    spec = spec_for_filename(path.name)
    return spec.name if spec else path.stem


def resolve_named(name: str) -> ResolvedModel:
    """Raises UnknownModelError (no such name) or ModelNotInstalledError (known, not pulled)."""
    derived = find_derived(name)
    if derived is not None:
        return ResolvedModel(derived.name, _base_path(derived), derived.profile, derived=True)
    path = resolve_model(name)
    return ResolvedModel(base_name(path), path)


def resolve_local(name_or_path: str, *, progress: bool = True) -> ResolvedModel:
    """What `run` without a server runs in this process for a name or a path the user gave: a created
    model's weights and profile, else a known model, pulled first if need be, or a file."""
    if find_derived(name_or_path) is not None:
        return resolve_named(name_or_path)
    from tokenmill.store.pull import ensure_model

    path = ensure_model(name_or_path, progress=progress)
    return ResolvedModel(base_name(path), path)


def _base_path(derived) -> Path:
    if not is_digest(derived.base):
        return resolve_model(derived.base)
    try:
        return model_blob(parse_digest(derived.base))
    except BlobError as exc:
        raise UnknownModelError(f"model {derived.name!r} is made from a blob that cannot be used: {exc}") from None


def _absolute(path: str | Path) -> str:
    """`path` made absolute and normal from the string alone: nothing on disk is looked at."""
    return os.path.normpath(os.path.abspath(os.path.expanduser(str(path))))


def _in_store(path: str | Path) -> bool:
    return _absolute(path).startswith(_absolute(models_dir()) + os.sep)


def resolve_requested(name: str, served_files: Collection[str | Path] = ()) -> ResolvedModel:
    """resolve_named for a name a request gave: a path, a digest or anything with `..` is no model
    (UnknownModelError, whether or not such a file exists), and a derived model whose base is a file
    outside the store resolves only if that file is in `served_files` (what the server was started
    with). The same error for every case: the answer says nothing about the server's files."""
    if looks_like_path(name) or is_digest(name) or ".." in name or "\\" in name or "\0" in name:
        raise UnknownModelError(f"model {name!r} not found")
    derived = find_derived(name)
    if derived is not None and looks_like_path(derived.base) and not _in_store(derived.base):
        if _absolute(derived.base) not in {_absolute(p) for p in served_files}:
            raise UnknownModelError(f"model {derived.name!r} is made from a file outside the model store, which "
                                    "the server does not open; recreate it from a blob or an installed model")
    return resolve_named(name)


def base_names(path: Path) -> set[str]:
    """Every name that resolves to this base file (derived records may use any of them)."""
    spec = spec_for_filename(path.name)
    names = {path.stem.lower(), path.name.lower(), str(path).lower()}
    if spec is not None:
        names |= {normalize_name(n) for n in spec.names}
    return names


@dataclass(frozen=True)
class DeletedModel:
    name: str                  # canonical: the derived name or the catalog name / file stem
    derived: bool
    # The GGUF that went with it: a base model's file, or a derived model's blob that no other model
    # used. None when the weights stay: a copy of an installed model leaves its base's file alone.
    removed: Path | None


def delete_model(name: str) -> DeletedModel:
    """Remove a derived model's record (and its blob, if no other model uses it), or a base model's
    file (refused while others derive from it). Every check comes before anything is removed."""
    derived = find_derived(name)
    if derived is not None:  # not resolved first: a model whose blob is gone can still be removed
        delete_derived(derived.name)
        removed = remove_unused_blob(derived.base)
        for adapter in derived.adapters:
            remove_unused_blob(adapter)
        return DeletedModel(derived.name, True, blob_path(parse_digest(derived.base)) if removed else None)
    resolved = resolve_named(name)
    if resolved.path.parent.resolve() != models_dir().resolve():
        raise StoreError(f"{resolved.path} is not in the models directory; delete the file yourself")
    # Under the lock save_derived checks its base under: a model made from this one while it goes
    # either comes first (and the delete is refused) or finds it gone.
    with blob_lock():
        users = dependents(base_names(resolved.path))
        if users:
            raise ModelInUseError(f"model {resolved.name!r} is the base of {', '.join(users)}; remove those first")
        resolved.path.unlink()
        manifest_path(resolved.path).unlink(missing_ok=True)
    return DeletedModel(resolved.name, False, resolved.path)


def copy_model(source: str, destination: str) -> ResolvedModel:
    """A new name for the same weights and profile (Ollama's `cp`)."""
    resolved = resolve_named(source)
    dest = check_name(destination)
    in_store = resolved.derived or resolved.path.parent.resolve() == models_dir().resolve()
    # A file elsewhere (`tokenmill cp ./x.gguf y`) becomes a blob, as `create` makes one of it.
    base = resolved.name if in_store else digest_ref(import_file(resolved.path))
    save_derived(dest, base, Profile())
    return resolve_named(dest)
