"""The model the server serves: loading it in the background (with a status /health can report),
switching to another one, and handing the live engine to request handlers.

Loading never blocks the event loop and a failed load never takes the server down: the failure
becomes the `error` status. A switch keeps the old model serving until the new one is ready, then
retires it once its in-flight requests have finished."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine import AsyncEngine, EngineConfig, LLMEngine
from tokenmill.server.admission import RETRY_AFTER_SECONDS, Admission
from tokenmill.server.errors import APIError

log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class LoadSpec:
    model: str                     # catalog name, alias, models-dir name or GGUF path
    engine: EngineConfig = field(default_factory=EngineConfig)


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
    from tokenmill.store import ensure_model
    from tokenmill.store.catalog import spec_for_filename

    path = ensure_model(spec.model, progress=True)  # pulls a known model on first use
    report(0.1)
    engine = LLMEngine.from_path(path, spec.engine)
    # A catalog model keeps its catalog name even when given as a path to its file.
    catalog = spec_for_filename(path.name)
    if catalog is not None:
        return Loaded(engine, path, catalog.name, catalog.aliases)
    return Loaded(engine, path, path.stem)


def normalize_name(name: str) -> str:
    # Ollama clients append ":latest" to untagged names.
    n = name.strip().lower()
    return n.removesuffix(":latest")


@dataclass
class ServedModel:
    name: str
    path: Path
    aengine: AsyncEngine
    spec: LoadSpec
    loaded_at: float                      # wall clock, for modified_at/expires_at style fields
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    @property
    def load_seconds(self) -> float:
        return self.engine.loaded.load_seconds

    def matches(self, requested: str) -> bool:
        return normalize_name(requested) in self.names


class ModelHost:
    def __init__(self, *, max_queue: int = 256, loader: Loader = default_loader, retire_timeout: float = 30.0):
        self.admission = Admission(max_queue)
        self._loader = loader
        self._retire_timeout = retire_timeout
        self._lock = threading.Lock()
        self.current: ServedModel | None = None
        self.loading: LoadSpec | None = None
        self.progress = 0.0
        self.error: str | None = None
        self._ready = threading.Event()
        self._closed = False

    # --- status ----------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """'loading' | 'ok' | 'error' | 'empty' — what /health reports. Never waits for the engine."""
        with self._lock:
            current = self.current
            if self.loading is not None:
                return "loading"
            if self.error is not None:
                return "error"
        if current is None:
            return "empty"
        return "ok" if current.aengine.health().ok else "error"

    @property
    def problem(self) -> str | None:
        """Why the status is `error`: the failed load, or what is wrong with the serving engine."""
        with self._lock:
            current, error = self.current, self.error
        if error is not None:
            return error
        if current is not None:
            return current.aengine.health().reason
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the pending load finished (either way); True if a model is being served."""
        self._ready.wait(timeout)
        return self.status == "ok"

    # --- loading ---------------------------------------------------------------------------------
    def start_load(self, spec: LoadSpec) -> None:
        with self._lock:
            if self._closed:
                raise APIError(503, "server is shutting down")
            if self.loading is not None:
                raise APIError(409, f"model {self.loading.model!r} is still loading; try again when it is ready",
                               code="load_in_progress")
            self.loading, self.progress, self.error = spec, 0.0, None
            self._ready.clear()
        threading.Thread(target=self._load, args=(spec,), name="tokenmill-load", daemon=True).start()

    def _report(self, progress: float) -> None:
        self.progress = max(self.progress, min(progress, 1.0))

    def _load(self, spec: LoadSpec) -> None:
        start = time.monotonic()
        try:
            loaded = self._loader(spec, self._report)
        except BaseException as exc:  # noqa: BLE001 - any failure becomes the error status
            message = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
            log.error("loading %s failed: %s", spec.model, message)
            with self._lock:
                self.loading, self.error = None, message
            self._ready.set()
            return
        aengine = AsyncEngine(loaded.engine).start()
        names = {normalize_name(n) for n in (loaded.name, *loaded.aliases, spec.model, loaded.path.stem,
                                             loaded.path.name, str(loaded.path))}
        served = ServedModel(loaded.name, loaded.path, aengine, spec, time.time(), frozenset(names))
        with self._lock:
            old, self.current = self.current, served
            self.loading, self.progress = None, 1.0
            closed = self._closed
        self._ready.set()
        log.info("model %s ready (%s) in %.1fs", served.name, served.path, time.monotonic() - start)
        if closed:  # shut down while we were loading
            aengine.shutdown()
        if old is not None:
            threading.Thread(target=self._retire, args=(old,), name="tokenmill-retire", daemon=True).start()

    def _retire(self, old: ServedModel) -> None:
        deadline = time.monotonic() + self._retire_timeout
        while old.aengine.num_active and time.monotonic() < deadline:
            time.sleep(0.1)
        old.aengine.shutdown()
        log.info("retired model %s", old.name)

    # --- serving ---------------------------------------------------------------------------------
    def get(self, requested: str | None = None) -> ServedModel:
        """The served model for a request naming `requested` (None/empty = whatever is loaded)."""
        with self._lock:
            current, loading, error = self.current, self.loading, self.error
        if current is None:
            if loading is not None:
                raise APIError(503, f"model {loading.model!r} is loading", code="model_loading",
                               retry_after=RETRY_AFTER_SECONDS)
            if error is not None:
                raise APIError(503, f"no model is loaded: the last load failed: {error}", code="model_load_failed")
            raise APIError(503, "no model is loaded; POST /load first", code="no_model")
        health = current.aengine.health()
        if health.status == "dead":  # fail fast: nothing would ever run the request
            raise APIError(503, f"the engine is not running: {health.reason}", code="engine_dead")
        if requested and not current.matches(requested):
            raise APIError(404, f"model {requested!r} not found; this server serves {current.name!r}",
                           param="model", code="model_not_found")
        return current

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            current, self.current = self.current, None
        if current is not None:
            current.aengine.shutdown()
