"""What the listing endpoints say about models (/api/tags, /api/show, /api/ps, /v1/models): the
installed ones from the store, plus the served one, which may be a GGUF outside the store."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tokenmill.server.model_host import ModelHost, ServedModel, normalize_name
from tokenmill.server.thinking import template_thinks
from tokenmill.store import list_models
from tokenmill.store.blobs import blob_path, is_blob_path, is_digest, parse_digest
from tokenmill.store.local import describe
from tokenmill.store.derived import DerivedModel, list_derived
from tokenmill.store.catalog import find_spec, spec_for_filename
from tokenmill.tokenizer.tokenizer import chat_template_source

# Metadata arrays as long as a vocabulary are left out of /api/show unless verbose is asked for.
_BULKY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
               "tokenizer.ggml.scores")


@dataclass
class ModelEntry:
    name: str
    path: Path
    size: int
    modified_at: float
    digest: str
    family: str
    quantization: str
    context_length: int | None
    parameter_size: str = ""
    derived: DerivedModel | None = None   # a name made by `create` or `cp`


def iso_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(path: Path) -> str:
    spec = spec_for_filename(path.name)
    return spec.sha256 if spec else ""


def parameter_size(served: ServedModel) -> str:
    return format_parameters(sum(int(np.prod(t.shape)) for t in served.engine.loaded.gguf.tensors.values()))


def format_parameters(n: int | None) -> str:
    """134515008 -> "134.5M", as Ollama's parameter_size."""
    if n is None:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0", "")
    return str(n)


def served_entry(served: ServedModel) -> ModelEntry:
    try:
        size, mtime = served.path.stat().st_size, served.path.stat().st_mtime
    except OSError:  # deleted while loaded: the engine still holds the weights
        size, mtime = served.size_bytes, served.loaded_at
    loaded = served.engine.loaded
    return ModelEntry(served.name, served.path, size, mtime, _digest(served.path),
                      loaded.config.architecture, loaded.gguf.quantization_label(),
                      loaded.config.context_length, parameter_size(served))


def installed_entries(host: ModelHost | None) -> list[ModelEntry]:
    """Loaded models first, then every installed and derived one. Blocking (may read GGUF headers):
    call from a worker thread. A blob is listed only under the names of the models made from it."""
    entries = [served_entry(m) for m in (host.loaded_models() if host is not None else [])
               if not is_blob_path(m.path)]
    loaded = {e.path.resolve() for e in entries}
    bases = {}
    for m in list_models():
        entry = ModelEntry(m.name, m.path, m.size_bytes, m.path.stat().st_mtime, _digest(m.path),
                           m.architecture, m.quantization, m.context_length, format_parameters(m.parameters))
        bases[normalize_name(m.name)] = bases[m.path.stem.lower()] = entry
        if m.path.resolve() not in loaded:
            entries.append(entry)
    listed = {e.path.resolve() for e in entries}
    for path in map(Path, host.served_files() if host is not None else []):
        # The file `serve` was started with, outside the store and unloaded since (keep_alive): it is
        # still served under its name, so it is still listed.
        if path.resolve() not in listed and not is_blob_path(path) and (entry := _file_entry(path, _digest(path))):
            entries.insert(0, entry)
    for d in list_derived():
        base = bases.get(normalize_name(d.base)) or next((e for e in entries if str(e.path) == d.base), None)
        if base is None and (spec := find_spec(d.base)) is not None:  # made FROM a catalog alias ("smollm2")
            base = bases.get(normalize_name(spec.name))
        if base is None and is_digest(d.base):
            base = bases[d.base] = bases.get(d.base) or _blob_entry(parse_digest(d.base))
        if base is not None:
            entries.append(replace(base, name=d.name, modified_at=d.created_at, digest=_record_digest(d),
                                   derived=d))
    return entries


def _blob_entry(digest: str) -> ModelEntry | None:
    return _file_entry(blob_path(digest), digest)


def _file_entry(path: Path, digest: str) -> ModelEntry | None:
    try:
        m = describe(path)
        mtime = path.stat().st_mtime
    except OSError:  # removed by hand: the models made from it are not listed
        return None
    if m.error:
        return None
    return ModelEntry(m.name, path, m.size_bytes, mtime, digest, m.architecture, m.quantization, m.context_length,
                      format_parameters(m.parameters))


def _record_digest(d: DerivedModel) -> str:
    return hashlib.sha256(json.dumps(d.to_json(), sort_keys=True).encode()).hexdigest()


def find_entry(host: ModelHost | None, name: str) -> ModelEntry | None:
    """The entry `name` means; host None: the store only (the CLI without a server)."""
    wanted = normalize_name(name)
    served = host.find_loaded(name) if host is not None else None
    if served is not None:
        return served_entry(served)
    entries = installed_entries(host)
    found = next((e for e in entries if normalize_name(e.name) == wanted or e.path.stem.lower() == wanted), None)
    if found is None:  # a catalog alias ("smollm2" for smollm2:135m), as `tokenmill run` and serve take it
        spec = find_spec(name)
        found = next((e for e in entries if spec is not None and normalize_name(e.name) == normalize_name(spec.name)
                      and e.derived is None), None)
    return found


def ollama_details(e: ModelEntry) -> dict:
    return {"parent_model": "", "format": "gguf", "family": e.family, "families": [e.family],
            "parameter_size": e.parameter_size, "quantization_level": e.quantization}


def ollama_tag(e: ModelEntry) -> dict:
    return {"name": e.name, "model": e.name, "modified_at": iso_time(e.modified_at), "size": e.size,
            "digest": e.digest, "details": ollama_details(e)}


def show(e: ModelEntry, verbose: bool = False, metadata: dict | None = None) -> dict:
    """Blocking (opens the GGUF unless its metadata is passed in): call from a worker thread."""
    if metadata is None:
        from tokenmill.gguf import open_gguf

        metadata = open_gguf(e.path).metadata
    info = {k: v for k, v in metadata.items()
            if not k.startswith("tokenizer.chat_template") and (verbose or k not in _BULKY_KEYS)}
    template = chat_template_source(metadata) or ""
    capabilities = ["completion", "embedding"]
    profile = e.derived.profile if e.derived else None
    if profile is not None and profile.template:
        template = profile.template
    if "tools" in template:
        capabilities.append("tools")
    if template_thinks(template):
        capabilities.append("thinking")
    return {
        "modelfile": modelfile_text(e),
        "parameters": "\n".join(f"{k} {json.dumps(v) if isinstance(v, str) else v}"
                                for k, v in _parameter_lines(profile)),
        "template": template,
        **({"system": profile.system} if profile is not None and profile.system else {}),
        "details": ollama_details(e),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": iso_time(e.modified_at),
    }


def _parameter_lines(profile) -> list[tuple[str, object]]:
    if profile is None:
        return []
    lines = []
    for k, v in profile.parameters.items():
        lines += [(k, x) for x in v] if isinstance(v, list) else [(k, v)]
    return lines


def modelfile_text(e: ModelEntry) -> str:
    """What `ollama show --modelfile` prints: enough to recreate the model."""
    if e.derived is None:  # its name, not its file: a client is not told where the server keeps models
        return f"# tokenmill serves this GGUF directly\nFROM {e.name}\n"
    p = e.derived.profile
    d = e.derived
    # With adapters, the model they were merged into and the adapters' blobs (the merged blob is theirs).
    out = [f"FROM {d.adapted_from}", *(f"ADAPTER {a}" for a in d.adapters)] if d.adapters else [f"FROM {d.base}"]
    out += [f"PARAMETER {k} {json.dumps(v) if isinstance(v, str) else v}" for k, v in _parameter_lines(p)]
    if p.system:
        out.append(f'SYSTEM """{p.system}"""')
    if p.template:
        out.append(f'TEMPLATE """{p.template}"""')
    out += [f'MESSAGE {m["role"]} """{m["content"]}"""' for m in p.messages]
    return "\n".join(out) + "\n"
