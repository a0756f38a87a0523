"""Names a user or client gives a model, resolved to the GGUF to load and the profile to apply; and
the store operations on names (`rm`, `cp`), which treat base and derived models alike."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.store.catalog import StoreError, spec_for_filename
from tokenmill.store.derived import (
    ModelInUseError,
    Profile,
    check_name,
    delete_derived,
    dependents,
    find_derived,
    normalize_name,
    save_derived,
)
from tokenmill.store.local import manifest_path, models_dir, resolve_model


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
        return ResolvedModel(derived.name, resolve_model(derived.base), derived.profile, derived=True)
    path = resolve_model(name)
    return ResolvedModel(base_name(path), path)


def base_names(path: Path) -> set[str]:
    """Every name that resolves to this base file (derived records may use any of them)."""
    spec = spec_for_filename(path.name)
    names = {path.stem.lower(), path.name.lower(), str(path).lower()}
    if spec is not None:
        names |= {normalize_name(n) for n in spec.names}
    return names


def delete_model(name: str) -> ResolvedModel:
    """Remove a derived model's record, or a base model's file (refused while others derive from it)."""
    resolved = resolve_named(name)
    if resolved.derived:
        delete_derived(resolved.name)
        return resolved
    if resolved.path.parent.resolve() != models_dir().resolve():
        raise StoreError(f"{resolved.path} is not in the models directory; delete the file yourself")
    users = dependents(base_names(resolved.path))
    if users:
        raise ModelInUseError(f"model {resolved.name!r} is the base of {', '.join(users)}; remove those first")
    resolved.path.unlink()
    manifest_path(resolved.path).unlink(missing_ok=True)
    return resolved


def copy_model(source: str, destination: str) -> ResolvedModel:
    """A new name for the same weights and profile (Ollama's `cp`)."""
    resolved = resolve_named(source)
    dest = check_name(destination)
    in_store = resolved.derived or resolved.path.parent.resolve() == models_dir().resolve()
    base = resolved.name if in_store else str(resolved.path)
    save_derived(dest, base, Profile())
    return resolve_named(dest)
