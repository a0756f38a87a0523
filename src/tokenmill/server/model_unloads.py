"""Giving loaded models back for the host: unloading idle ones (least recently used first) to make room
for a load, unloading ones whose keep_alive ran out (the reaper thread), retiring a default model a
/load replaced once its requests are done, and counting the models out of the tables whose engines
are still shutting down (their memory is not free yet, so a load waiting for room keeps waiting).

Split from model_host.py, which decides what to load; this decides what goes. Both work on the one
table of loaded models under the one lock: a load's room check, a lease and an eviction must see the
same table, so the host hands both over rather than each keeping its own."""
from __future__ import annotations

import gc
import logging
import threading
import time

from tokenmill import gpu_info
from tokenmill.kernels.huge_pages import return_freed_heap
from tokenmill.server.model_loads import HostPolicy, MemoryPool, NoRoomError, PendingLoad
from tokenmill.server.served_model import ServedModel

log = logging.getLogger("tokenmill.server")

_REAP_SECONDS = 0.25


class Unloader:
    """What unloads the host's models. `models` and `lock` are the host's (see the module docstring):
    every read or change of `models` here holds `lock`, as the host's own do."""

    def __init__(self, models: dict[str, ServedModel], lock: threading.Lock, retire_timeout: float):
        self._models = models
        self._lock = lock
        self._retire_timeout = retire_timeout
        self._releasing = 0  # models out of the tables whose engines are still shutting down
        self._closed = False
        self._wake_reaper = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="tokenmill-reaper", daemon=True)

    @property
    def releasing(self) -> int:
        with self._lock:
            return self._releasing

    def start_reaper(self) -> None:
        """With the first load: a host that never loads needs no thread."""
        with self._lock:
            if not self._reaper.is_alive() and not self._closed:
                self._reaper.start()

    def wake(self) -> None:
        """Look for expired models now, not at the next tick (a keep_alive of 0 ran out)."""
        self._wake_reaper.set()

    def close(self) -> None:
        """The host shuts down: the reaper ends, and a load waiting for room gives up."""
        self._closed = True
        self._wake_reaper.set()

    def make_room(self, load: PendingLoad, pool: MemoryPool, policy: HostPolicy) -> int:
        """Unload idle models (least recently used first) until `load` fits in `pool`; the KV bytes it
        may use. A model going to a GPU is held to that GPU's memory (model_loads.MemoryPool), one going
        to the CPU to the memory budget. `pool` comes from the host, which picks it (model_loads.load_pool)."""
        need = pool.load_bytes(load.spec.model, load.spec.engine.spec_config().draft_model)
        deadline = time.monotonic() + policy.wait_timeout
        while True:
            with self._lock:
                others = [m for k, m in self._models.items() if k != load.key]
                releasing = self._releasing
            used = sum(pool.held_by(m) for m in others)
            budget = pool.budget(policy.memory_budget, used)  # a GPU's free memory: asked outside the lock
            with self._lock:
                others = [m for m in others if m in self._models.values()]  # (the reaper may have run)
                fits = len(others) < policy.max_loaded_models and used + need <= budget
                victim = None if fits else min((m for m in others if m.idle), key=lambda m: m.last_used, default=None)
                if victim is not None:
                    self._forget(victim)
            if fits:
                return budget - used - need
            if victim is not None:
                log.info("unloading %s to make room for %s", victim.name, load.spec.model)
                handed, victim, others = [victim], None, []  # _shutdown holds the only reference
                self._shutdown(handed)
                continue
            if not others and not releasing:
                raise NoRoomError(f"model {load.label} needs {need / 1e9:.2f} GB, more than the "
                                  f"{pool.describe(budget)}")
            load.waiting_for_room, load.room = True, pool.describe(budget)
            if time.monotonic() > deadline or self._closed:
                raise NoRoomError(f"no room to load {load.label}: {len(others)} model(s) loaded and busy "
                                  f"(max_loaded_models {policy.max_loaded_models}, {pool.describe(budget)})")
            time.sleep(0.05)

    def unload_when_idle(self, served: ServedModel) -> None:
        """keep_alive 0: the reaper unloads `served` once no request holds it."""
        with self._lock:
            served.latest_keep_alive, served.expires_at = 0, time.time()
        self._wake_reaper.set()

    def _forget(self, *models: ServedModel) -> None:
        """Under the lock: take `models` out of the tables (their engines are shut down after, by _shutdown)."""
        for key, m in list(self._models.items()):
            if any(m is served for served in models):
                del self._models[key]
        self._releasing += len(models)

    def _shutdown(self, handed: list[ServedModel]) -> None:
        """Shut down the last model of `handed`, taking it out: the list holds the caller's only reference,
        so once the engine has stopped the model's memory goes with this frame's, before the collection
        and the heap trim below and before `releasing` says it has gone (held by a caller's local, it went
        when that returned: after the trim, and after a test reading RSS had seen it counted)."""
        served = handed.pop()
        name = served.name
        try:
            served.aengine.shutdown()
            del served
            gc.collect()  # the engine's tensors go now, not at some later collection
            # glibc keeps what a model's threads freed in its malloc arenas: without this, every
            # load/unload cycle of a 100 MB model left ~70 MB more resident
            return_freed_heap()
            gpu_info.release_cached_memory()  # and a GPU model's memory goes back to the driver
        finally:
            with self._lock:
                self._releasing -= 1
        log.info("unloaded model %s", name)

    def retire(self, old: ServedModel) -> None:
        """Shut `old` (a default model /load replaced, already out of the table) down on its own thread
        once its requests are done, or after retire_timeout."""
        threading.Thread(target=self._retire, args=(old,), name="tokenmill-retire", daemon=True).start()

    def _retire(self, old: ServedModel) -> None:
        deadline = time.monotonic() + self._retire_timeout
        # idle: no request running, nor holding it to run one (a lease taken before the switch)
        while not old.idle and time.monotonic() < deadline:
            time.sleep(0.1)
        old.aengine.shutdown()
        log.info("retired model %s", old.name)

    def _reap_loop(self) -> None:
        while not self._closed:
            self._wake_reaper.wait(_REAP_SECONDS)
            self._wake_reaper.clear()
            self._unload_expired()  # a call, so no local outlives it holding an unloaded model

    def _unload_expired(self) -> None:
        now = time.time()
        with self._lock:
            expired = [m for m in self._models.values() if m.expires_at is not None and m.expires_at <= now and m.idle]
            self._forget(*expired)
        while expired:
            log.info("model %s expired (keep_alive)", expired[-1].name)
            self._shutdown(expired)

