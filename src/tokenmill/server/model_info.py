"""What the listing endpoints say about models (/api/tags, /api/show, /api/ps, /v1/models): the
installed ones from the store, plus the served one, which may be a GGUF outside the store."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.server.model_host import ModelHost, ServedModel, normalize_name
from tokenmill.store import list_models
from tokenmill.store.catalog import spec_for_filename
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


def iso_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(path: Path) -> str:
    spec = spec_for_filename(path.name)
    return spec.sha256 if spec else ""


def parameter_size(served: ServedModel) -> str:
    n = sum(int(np.prod(t.shape)) for t in served.engine.loaded.gguf.tensors.values())
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0", "")
    return str(n)


def served_entry(served: ServedModel) -> ModelEntry:
    st = served.path.stat()
    loaded = served.engine.loaded
    return ModelEntry(served.name, served.path, st.st_size, st.st_mtime, _digest(served.path),
                      loaded.config.architecture, loaded.gguf.quantization_summary(),
                      loaded.config.context_length, parameter_size(served))


def installed_entries(host: ModelHost) -> list[ModelEntry]:
    """Blocking (may read GGUF headers): call from a worker thread."""
    served = host.current
    entries = []
    for m in list_models():
        if served is not None and m.path.resolve() == served.path.resolve():
            continue
        entries.append(ModelEntry(m.name, m.path, m.size_bytes, m.path.stat().st_mtime, _digest(m.path),
                                  m.architecture, m.quantization, m.context_length))
    if served is not None:
        entries.insert(0, served_entry(served))
    return entries


def find_entry(host: ModelHost, name: str) -> ModelEntry | None:
    wanted = normalize_name(name)
    served = host.current
    if served is not None and served.matches(name):
        return served_entry(served)
    return next((e for e in installed_entries(host) if normalize_name(e.name) == wanted
                 or e.path.stem.lower() == wanted), None)


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
    if "tools" in template:
        capabilities.append("tools")
    return {
        "modelfile": f"# tokenmill serves this GGUF directly\nFROM {e.path}\n",
        "parameters": "",
        "template": template,
        "details": ollama_details(e),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": iso_time(e.modified_at),
    }
