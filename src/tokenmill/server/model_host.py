"""The models the server serves, loaded on demand as Ollama's scheduler does: a request naming an
installed model that is not loaded loads it (requests for it wait while it loads; requests for other
models keep being served); idle models unload when their keep_alive runs out, or, least recently used
first, when a load needs room under `max_loaded_models` or the memory budget. A model with requests in
flight is never unloaded; when nothing can make room, a request waits and then gets 503.

One model is the default: the one `serve` was started with (or /load switched to). It answers requests
that name no model, /health follows its load, and it stays loaded unless a request's keep_alive says
otherwise. Loads run one at a time on a worker thread and never block the event loop; a failed load
fails the requests waiting for it (and, for the default model, becomes the `error` status).
What unloads models (evictions, keep_alive, retiring a replaced default) is model_unloads.Unloader."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

from tokenmill.engine import AsyncEngine
from tokenmill.server.admission import RETRY_AFTER_SECONDS, Admission
from tokenmill.server.errors import APIError
from tokenmill.server.model_loads import (
    HostPolicy,
    NoRoomError,
    PendingLoad,
    load_error_status,
    load_pool,
    path_key,
    public_load_error,
    resolve_for_request,
    resolved_key,
    spec_names,
)
from tokenmill.server.model_unloads import Unloader
from tokenmill.server.served_model import Loaded, LoadSpec, Loader, ModelLease, ServedModel, default_loader
from tokenmill.store.blobs import is_blob_path
from tokenmill.store.derived import Profile, normalize_name
from tokenmill.store.pull import Fetcher

log = logging.getLogger("tokenmill.server")

KEEP_DEFAULT = object()  # acquire(): the request gave no keep_alive
DEFAULT_MODEL_KEEP_ALIVE = None  # the model the server was started with stays until a request says otherwise

__all__ = ["HostPolicy", "KEEP_DEFAULT", "LoadSpec", "Loaded", "ModelHost", "ServedModel", "default_loader",
           "normalize_name"]


class ModelHost:
    """Every model the server holds, loaded or loading; what handlers ask for a model to serve a request."""

    def __init__(self, *, max_queue: int = 256, loader: Loader = default_loader, retire_timeout: float = 30.0,
                 policy: HostPolicy | None = None, fetcher: Fetcher | None = None):
        self.admission = Admission(max_queue)
        self._fetcher = fetcher  # for pull_on_demand (None: pip)
        self.policy = policy or HostPolicy()
        self._loader = loader
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()    # one load at a time: its memory check sees the others
        self._models: dict[str, ServedModel] = {}
        self._pending: list[PendingLoad] = []
        self._default_key: str | None = None
        self._default_load: PendingLoad | None = None
        self._default_spec: LoadSpec | None = None
        self.error: str | None = None          # the default model's failed load
        self._waiting = 0
        self._closed = False
        # Evictions, keep_alive expiry and retiring: on this host's table, under this host's lock.
        self._unloader = Unloader(self._models, self._lock, retire_timeout)

    # --- what is loaded --------------------------------------------------------------------------
    @property
    def current(self) -> ServedModel | None:
        """The default model, if it is loaded."""
        with self._lock:
            return self._models.get(self._default_key) if self._default_key else None

    @property
    def loading(self) -> LoadSpec | None:
        """The default model's load in progress, if any."""
        load = self._default_load
        return load.spec if load is not None and not load.done.is_set() else None

    @property
    def progress(self) -> float:
        load = self._default_load
        return load.progress if load is not None else 1.0

    def loaded_models(self) -> list[ServedModel]:
        with self._lock:
            return list(self._models.values())

    @property
    def releasing(self) -> int:
        """Models already gone from loaded_models (and /api/ps) whose memory is not yet given back."""
        return self._unloader.releasing

    def find_loaded(self, name: str) -> ServedModel | None:
        with self._lock:
            return next((m for m in self._models.values() if m.matches(name)), None)

    # --- status ----------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """'loading' | 'ok' | 'error' | 'empty' — what /health reports. Never waits for the engine."""
        if self.loading is not None:
            return "loading"
        if self.error is not None:
            return "error"
        models = self.loaded_models()
        if any(not m.aengine.health().ok for m in models):
            return "error"
        if not models and self._default_spec is None:
            return "empty"
        return "ok"  # an idle server that unloaded its models still serves: it loads on demand

    @property
    def problem(self) -> str | None:
        """Why the status is `error`: the failed load, or what is wrong with a serving engine."""
        if self.error is not None:
            return self.error
        for m in self.loaded_models():
            health = m.aengine.health()
            if not health.ok:
                return f"{m.name}: {health.reason}" if len(self._models) > 1 else health.reason
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the default model's load finished (either way); True if it is being served."""
        load = self._default_load
        if load is not None:
            load.done.wait(timeout)
        return self.status == "ok" and self.current is not None

    # --- the default model (serve MODEL, /load) --------------------------------------------------
    def start_load(self, spec: LoadSpec, label: str = "") -> None:
        """Load `spec` as the default model; the previous default retires once the new one serves.
        label: the name clients are told, for a created model whose weights are a blob (spec.model its path)."""
        with self._lock:
            if self._closed:
                raise APIError(503, "server is shutting down")
            if self.loading is not None:
                raise APIError(409, f"model {self.loading.model!r} is still loading; try again when it is ready",
                               code="load_in_progress")
            names = spec_names(spec.model) | ({normalize_name(label)} if label else set())
            load = PendingLoad(spec, names, resolved_key(spec.model), True, None, label)
            self._pending.append(load)
            self._default_load, self._default_spec, self.error = load, spec, None
        self._start(load)

    # --- serving ---------------------------------------------------------------------------------
    async def acquire(self, requested: str | None, keep_alive: object = KEEP_DEFAULT, *,
                      scope: dict | None = None) -> ModelLease:
        """A lease on the model `requested` names (None/empty: the default model), loading it first
        if needed. With `scope`, the lease is released when the request's response has been sent."""
        if self._closed or self.admission.draining:
            raise APIError(503, "server is shutting down", code="shutting_down", retry_after=RETRY_AFTER_SECONDS)
        lease = None
        while lease is None:
            # None: unloaded between the look and the lease (keep_alive, or evicted for another
            # load); it is loaded again rather than run on its shut-down engine, which never answers.
            lease = await self._try_lease(requested or "", keep_alive)
        if scope is not None:
            scope.setdefault("tokenmill.leases", []).append(lease)
        return lease

    async def _try_lease(self, name: str, keep_alive: object) -> ModelLease | None:
        served = self.find_loaded(name) if name else self._default_served()
        if served is not None:
            return self._lease(served, served.name, Profile(), keep_alive)
        served, name, profile, held = await self._load_for(name)
        return self._lease(served, name, profile, keep_alive, held)

    def _default_served(self) -> ServedModel | None:
        served = self.current
        if served is not None:
            health = served.aengine.health()
            if health.status == "dead":  # fail fast: nothing would ever run the request
                raise APIError(503, f"the engine is not running: {health.reason}", code="engine_dead")
        return served

    def _lease(self, served: ServedModel, name: str, profile: Profile, keep_alive: object,
               held: bool = False) -> ModelLease | None:
        """None if `served` is no longer loaded. `held`: its load already counted this request (_wait)."""
        seconds = served.keep_alive if keep_alive is KEEP_DEFAULT else keep_alive
        with self._lock:
            if not held and served not in self._models.values():
                return None
            served.leases += 0 if held else 1
            served.last_used = time.monotonic()
            served.latest_keep_alive = seconds
            served.expires_at = None if seconds is None else time.time() + seconds

        def release(_: ModelLease) -> None:
            # The model's latest keep_alive, not this request's: an unload or a later request's
            # keep_alive received while this one ran is not undone by this one finishing last.
            with self._lock:
                served.leases -= 1
                served.last_used = time.monotonic()
                latest = served.latest_keep_alive
                served.expires_at = None if latest is None else time.time() + latest
            if latest is not None and latest <= 0:
                self._unloader.wake()

        return ModelLease(served, name, profile, release)

    async def _load_for(self, name: str) -> tuple[ServedModel, str, Profile, bool]:
        """Find or start the load that serves `name`, wait for it; (model, name to answer as, profile,
        whether this request already holds a lease on the model: see _wait)."""
        arrived = time.monotonic()
        deadline = arrived + self.policy.wait_timeout
        resolved = None
        while True:
            if not name:
                load, profile = self._default_reload(), Profile()
            elif (pending := self._pending_named(name)) is not None:
                load, profile = pending, Profile()
            elif self._calls_served_file(name):  # unloaded since (keep_alive): no store lookup finds it
                load, profile = self._default_reload(), Profile()
            else:
                resolved = resolved or await asyncio.to_thread(
                    resolve_for_request, name, self.served_files(), self.policy.pull_on_demand)
                load, profile = self._find_or_start(resolved), resolved.profile
            try:
                served, held = await self._wait(load, deadline)
            except APIError:
                # A load started before this request gave up on room: this request's own wait has
                # time left, so it tries again rather than inherit the earlier request's timeout.
                if load.no_room and load.started < arrived and time.monotonic() < deadline:
                    continue
                raise
            return served, resolved.name if resolved else served.name, profile, held

    def served_files(self) -> list[str]:
        """The GGUF paths the server was started with (or /load switched to): the only files outside
        the model store that a derived model a request names may be made from."""
        from tokenmill.store.local import looks_like_path

        spec = self._default_spec
        return [spec.model] if spec is not None and looks_like_path(spec.model) else []

    def _calls_served_file(self, name: str) -> bool:
        """Whether `name` is what the GGUF file `serve` was started with answers to (its stem)."""
        spec = self._default_spec
        return bool(self.served_files()) and normalize_name(name) in spec_names(spec.model)

    def _default_reload(self) -> PendingLoad:
        with self._lock:
            load = self._default_load
            if load is not None and not load.done.is_set():
                return load
            if self.error is not None:
                raise APIError(503, f"no model is loaded: the last load failed: {self.error}",
                               code="model_load_failed")
            spec = self._default_spec
            if spec is None:
                raise APIError(503, "no model is loaded; name one in the request or POST /load",
                               code="no_model")
        return self._find_or_start_spec(spec, spec_names(spec.model), resolved_key(spec.model),
                                        DEFAULT_MODEL_KEEP_ALIVE)

    def _pending_named(self, name: str) -> PendingLoad | None:
        with self._lock:
            return next((load for load in self._pending if normalize_name(name) in load.names), None)

    def _find_or_start(self, resolved) -> PendingLoad:
        key = path_key(resolved.path)
        default = self._default_spec
        if default is not None and key == self._default_key:
            return self._find_or_start_spec(default, spec_names(default.model), key, DEFAULT_MODEL_KEEP_ALIVE)
        # Not there yet: pulled on demand, by its catalog name.
        model = str(resolved.path) if resolved.path.exists() else resolved.name
        spec = LoadSpec(model, self.policy.engine, fetcher=self._fetcher)
        return self._find_or_start_spec(spec, {normalize_name(resolved.name)}, key, self.policy.keep_alive,
                                        label=resolved.name)

    def _find_or_start_spec(self, spec: LoadSpec, names: set[str], key: str | None,
                            keep_alive: float | None, label: str = "") -> PendingLoad:
        with self._lock:
            if self._closed:
                raise APIError(503, "server is shutting down", code="shutting_down")
            for load in self._pending:
                if (key is not None and load.key == key) or names & load.names:
                    return load
            served = self._models.get(key) if key else None
            if served is not None:  # loaded between the caller's look and now
                load = PendingLoad(spec, names, key, False, keep_alive, label, 1.0, served=served)
                load.done.set()
                return load
            load = PendingLoad(spec, names, key, False, keep_alive, label)
            self._pending.append(load)
        self._start(load)
        return load

    async def _wait(self, load: PendingLoad, deadline: float) -> tuple[ServedModel, bool]:
        """The model `load` serves, and whether this request holds a lease on it already: one that
        waited for the load gets it leased as it is served, so that no other load evicts it (idle)
        before this request, woken up to 20 ms later, has taken it."""
        if self._waiting >= self.admission.max_queue:
            raise APIError(503, f"server busy: {self._waiting} requests are waiting for models to load",
                           code="queue_full", retry_after=RETRY_AFTER_SECONDS)
        self._waiting += 1
        with self._lock:
            held = load in self._pending
            load.holds += held
        try:
            while not load.done.is_set():
                if time.monotonic() > deadline and load.waiting_for_room:
                    raise APIError(503, f"no room to load {load.label}: the loaded models are busy "
                                        f"(max_loaded_models {self.policy.max_loaded_models}, {load.room})",
                                   code="no_room", retry_after=RETRY_AFTER_SECONDS)
                if time.monotonic() > deadline:
                    raise APIError(503, f"model {load.label!r} is still loading", code="model_loading",
                                   retry_after=RETRY_AFTER_SECONDS)
                await asyncio.sleep(0.02)
        except BaseException:
            self._drop_hold(load, held)
            raise
        finally:
            self._waiting -= 1
        if load.no_room:
            raise APIError(503, load.error or "no room to load the model", code="no_room",
                           retry_after=RETRY_AFTER_SECONDS)
        if load.error is not None or load.served is None:
            if load.default:
                raise APIError(503, f"no model is loaded: the last load failed: {load.error}",
                               code="model_load_failed")
            raise APIError(load.error_status, load.error or f"model {load.label!r} could not be loaded",
                           code="model_load_failed")
        return load.served, held

    def _drop_hold(self, load: PendingLoad, held: bool) -> None:
        """A request that gave up waiting (timeout, client gone) returns the lease its load took for it."""
        if not held:
            return
        with self._lock:
            load.holds -= 1
            if load.served is not None:
                load.served.leases -= 1
                load.served.last_used = time.monotonic()

    # --- loading ---------------------------------------------------------------------------------
    def _start(self, load: PendingLoad) -> None:
        self._unloader.start_reaper()
        threading.Thread(target=self._run_load, args=(load,), name="tokenmill-load", daemon=True).start()

    def _report(self, load: PendingLoad, progress: float) -> None:
        load.progress = max(load.progress, min(progress, 1.0))

    def _run_load(self, load: PendingLoad) -> None:
        start = time.monotonic()
        try:
            with self._load_lock:
                # The pool is picked here, not in the Unloader: tests fake a GPU by patching this
                # module's load_pool.
                max_kv = self._unloader.make_room(load, load_pool(load.spec.engine), self.policy)
                loaded = self._loader(replace(load.spec, max_kv_bytes=max_kv), lambda p: self._report(load, p))
                served = self._serve(load, loaded)
        except BaseException as exc:  # noqa: BLE001 - any failure fails this load, never the server
            log.error("loading %s failed: %s", load.spec.model, f"{type(exc).__name__}: {exc}" if not str(exc) else exc)
            message = public_load_error(exc, load.label)  # what clients read: no path, no file bytes
            with self._lock:
                load.error, load.no_room = message, isinstance(exc, NoRoomError)
                load.error_status = load_error_status(exc)
                if load.default:
                    self.error = message
                self._pending.remove(load)
            load.done.set()
            return
        log.info("model %s ready (%s) in %.1fs, %.0f MiB", served.name, served.path, time.monotonic() - start,
                 served.size_bytes / 2**20)

    def _serve(self, load: PendingLoad, loaded: Loaded) -> ServedModel:
        from tokenmill.engine.memory import engine_bytes, gpu_bytes

        aengine = AsyncEngine(loaded.engine).start()
        key = path_key(loaded.path)
        names = {normalize_name(n) for n in (loaded.name, *loaded.aliases, load.spec.model, loaded.path.stem,
                                             loaded.path.name, str(loaded.path))}
        # A blob's file name is its digest: /api/ps shows the created model that loaded it instead (that
        # name stays out of `names`: requests for it go through its profile).
        shown = load.label if is_blob_path(loaded.path) and load.label else loaded.name
        served = ServedModel(shown, loaded.path, aengine, load.spec, time.time(), frozenset(names),
                             engine_bytes(loaded.engine), load.keep_alive, gpu_bytes=gpu_bytes(loaded.engine))
        retire = None
        with self._lock:
            closed = self._closed
            if load.default:
                old_key, self._default_key = self._default_key, key
                if old_key is not None and old_key != key:
                    retire = self._models.pop(old_key, None)
            replaced = self._models.get(key)
            if replaced is not None and replaced is not retire:
                retire = retire or replaced  # /load of a loaded file with new settings
            self._models[key] = served
            served.leases += load.holds  # the requests waiting for it: see _wait
            # Counted from now until a request takes it: one whose requests all gave up while it loaded
            # would otherwise stay loaded for good (a lease and its release set this again).
            served.expires_at = None if load.keep_alive is None else time.time() + load.keep_alive
            load.served, load.progress = served, 1.0
            self._pending.remove(load)
        load.done.set()
        if closed:  # shut down while we were loading
            aengine.shutdown()
        if retire is not None:
            self._unloader.retire(retire)
        return served

    # --- unloading -------------------------------------------------------------------------------
    def unload(self, name: str) -> bool:
        """Unload `name` as soon as it is idle (keep_alive 0); False if it is not loaded."""
        served = self.find_loaded(name)
        if served is None:
            return False
        self._unloader.unload_when_idle(served)
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            # Emptied in place, not replaced: the Unloader holds this same dict.
            models = list(self._models.values())
            self._models.clear()
            self._unloader.close()  # under the lock, with _closed: no reaper starts after this
        for m in models:
            m.aengine.shutdown()


async def model_for(request, name: str | None, keep_alive: object = KEEP_DEFAULT) -> ModelLease:
    """The model a request names, held until its response has been sent (see app.ReleaseLeases)."""
    return await request.app.state.host.acquire(name, keep_alive, scope=request.scope)
