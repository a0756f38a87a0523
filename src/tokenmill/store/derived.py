"""Derived models: a name that stands for an installed GGUF plus defaults (system prompt, template,
sampling parameters, leading messages), as Ollama's `create` and `cp` make them. No weights are
copied: a record in `<models>/derived/` names the base model it was made FROM, which is always a
GGUF-backed name (deriving from a derived model copies its fields, so chains stay one link long)."""
from __future__ import annotations

import json
import os
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.store.blobs import (
    blob_lock,
    digest_ref,
    is_digest,
    model_blob,
    parse_digest,
    remove_blob,
    remove_stale_uploads,
)
from tokenmill.store.catalog import StoreError, find_spec
from tokenmill.store.local import looks_like_path, models_dir, resolve_model
from tokenmill.store.model_name import check_model_name


class ModelInUseError(StoreError):
    """A base model that derived models still point at."""


def normalize_name(name: str) -> str:
    # Ollama clients append ":latest" to untagged names; names compare case-insensitively.
    return name.strip().lower().removesuffix(":latest")


@dataclass(frozen=True)
class Profile:
    """What a derived model changes about its base: applied to each request that names it."""
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict, ...] = ()

    def merged(self, other: "Profile") -> "Profile":
        """`other` on top of self: its fields win, parameters merge."""
        return Profile(other.system if other.system is not None else self.system,
                       other.template if other.template is not None else self.template,
                       {**self.parameters, **other.parameters},
                       other.messages or self.messages)


@dataclass(frozen=True)
class DerivedModel:
    name: str
    base: str          # the GGUF-backed model's name, a blob's `sha256:<hex>` (or, in older records, a path)
    profile: Profile
    created_at: float
    # With LoRA adapters (blob digests, in the order applied), `base` is the blob they were merged into
    # (store/adapters.py) and `adapted_from` the model they were merged into it from.
    adapters: tuple[str, ...] = ()
    adapted_from: str | None = None

    def to_json(self) -> dict:
        p = asdict(self.profile)
        p["messages"] = list(self.profile.messages)
        extra = {"adapters": list(self.adapters), "adapted_from": self.adapted_from} if self.adapters else {}
        return {"name": self.name, "from": self.base, **p, **extra, "created_at": self.created_at}

    @classmethod
    def from_json(cls, d: dict) -> "DerivedModel":
        profile = Profile(d.get("system"), d.get("template"), dict(d.get("parameters") or {}),
                          tuple(d.get("messages") or ()))
        return cls(d["name"], d["from"], profile, float(d.get("created_at", 0.0)),
                   tuple(d.get("adapters") or ()), d.get("adapted_from"))

    @property
    def blobs(self) -> tuple[str, ...]:
        """The digests of the blobs the model uses: its base's, if a blob, and its adapters'."""
        return ((self.base,) if is_digest(self.base) else ()) + self.adapters


def derived_dir() -> Path:
    return models_dir() / "derived"


def _record_path(name: str) -> Path:
    return derived_dir() / (urllib.parse.quote(normalize_name(name), safe="") + ".json")


def check_name(name: str) -> str:
    """The name a new model is stored under: the one grammar (model_name), folded to lower case."""
    check_model_name(name.strip())
    return normalize_name(name)


def find_derived(name: str) -> DerivedModel | None:
    try:
        return DerivedModel.from_json(json.loads(_record_path(name).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_derived() -> list[DerivedModel]:
    root = derived_dir()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.glob("*.json")):
        try:
            out.append(DerivedModel.from_json(json.loads(p.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged record hides one name, never the listing
    return out


def save_derived(name: str, base: str, profile: Profile, adapters: tuple[str, ...] = ()) -> DerivedModel:
    """Create or replace `name`. `base` is an installed model's name, a blob digest, or a derived
    model (whose fields are inherited); never a path: a file becomes a blob first (blobs.import_file).
    `adapters` (LoRA adapters' blob digests) are merged into the base's weights, as a blob of its own."""
    name = check_name(name)
    # Names compare case-insensitively, files on disk do not: SmolLM2-...gguf is taken by smollm2-...
    if find_spec(name) is not None or any(p.stem.lower() == name for p in models_dir().glob("*.gguf")):
        raise StoreError(f"{name!r} is the name of an installed model file; choose another name")
    if is_digest(name):  # `from: sha256:<hex>` means the blob; a model of that name could never be named
        raise StoreError(f"{name!r} is a blob digest, not a model name; choose another name")
    replaced = find_derived(name)
    with blob_lock():  # the blob checked here stays until the record that uses it is written
        parent = find_derived(base)
        held, source = (), base
        if parent is not None:
            base, profile = parent.base, parent.profile.merged(profile)
            held, source = parent.adapters, parent.adapted_from or parent.base
        elif is_digest(base):
            base = digest_ref(parse_digest(base))
            model_blob(parse_digest(base))  # raises for a blob not held or not a valid GGUF
        elif looks_like_path(base):
            raise StoreError("a model is made from a model name or a blob digest, not a file path")
        else:
            resolve_model(base)  # raises for a base that is not installed
        if normalize_name(base) == name:
            raise StoreError(f"model {name!r} cannot be derived from itself")
        if adapters:
            from tokenmill.store.adapters import merged_blob  # the GGUF and torch machinery, only when asked

            adapters = tuple(digest_ref(parse_digest(a)) for a in adapters)
            base_path = model_blob(parse_digest(base)) if is_digest(base) else resolve_model(base)
            base = digest_ref(merged_blob(base_path, adapters))
            held += adapters
        record = _write_record(DerivedModel(name, base, profile, time.time(), held, source if held else None))
    # A model made again under its name may leave blobs no model uses (its old merged weights).
    for digest in set(replaced.blobs if replaced is not None else ()) - set(record.blobs):
        remove_unused_blob(digest)
    return record


def _write_record(record: DerivedModel) -> DerivedModel:
    path = _record_path(record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2))
    os.replace(tmp, path)  # a crash mid-write never leaves half a record
    return record


def remove_unused_blob(base: str) -> bool:
    """Remove the blob `base` names if no model is made from it (or adapted by it) any more, as Ollama
    prunes layers."""
    if not is_digest(base):
        return False
    digest = parse_digest(base)
    with blob_lock():
        if any(parse_digest(b) == digest for d in list_derived() for b in d.blobs if is_digest(b)):
            return False
        removed = remove_blob(digest)
        remove_stale_uploads()
    return removed


def delete_derived(name: str) -> bool:
    try:
        _record_path(name).unlink()
        return True
    except FileNotFoundError:
        return False


def dependents(base_names: set[str]) -> list[str]:
    """Names of derived models made from any of `base_names` (normalized)."""
    return [d.name for d in list_derived() if normalize_name(d.base) in base_names]
