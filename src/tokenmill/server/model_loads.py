"""The bookkeeping of model loads for the host: the policy that bounds them (keep_alive, how many
models, how much memory), one load in progress, and what a model name or path stands for before
its load has finished."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine import EngineConfig
from tokenmill.server.served_model import LoadSpec, ServedModel
from tokenmill.store.derived import normalize_name


def default_memory_budget() -> int:
    """75% of the machine's RAM: the rest is for the OS, the server itself and page cache."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.75)
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class HostPolicy:
    engine: EngineConfig = field(default_factory=EngineConfig)  # for models loaded on demand
    keep_alive: float | None = 300.0      # seconds after the last request; None = forever
    max_loaded_models: int = 3
    memory_budget: int = field(default_factory=default_memory_budget)
    pull_on_demand: bool = False
    wait_timeout: float = 120.0           # for a load, or for room to load

    @classmethod
    def from_settings(cls, settings) -> "HostPolicy":
        budget = int(settings.max_memory_gb * 1e9) if settings.max_memory_gb else default_memory_budget()
        return cls(settings.engine_config(), settings.keep_alive_seconds(), settings.max_loaded_models, budget,
                   settings.pull_on_demand, settings.model_wait_timeout)


class NoRoomError(Exception):
    """Loading would exceed the limits and nothing can be unloaded in time."""


@dataclass(eq=False)
class PendingLoad:
    spec: LoadSpec
    names: set[str]
    key: str | None                       # the resolved file, when known before loading
    default: bool
    keep_alive: float | None
    progress: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    no_room: bool = False
    waiting_for_room: bool = False        # every loaded model is busy: the load waits for one to idle
    started: float = field(default_factory=time.monotonic)
    served: ServedModel | None = None


def path_key(path: Path) -> str:
    return str(path.resolve())


def spec_names(model: str) -> set[str]:
    """What requests may call a model given by name or path before it has loaded."""
    path = Path(model)
    return {normalize_name(model), normalize_name(path.name), normalize_name(path.stem)}


def resolved_key(model: str) -> str | None:
    """The file a model name stands for, if it is installed (else the load will pull it first)."""
    from tokenmill.store import StoreError
    from tokenmill.store.names import resolve_named

    try:
        return path_key(resolve_named(model).path)
    except (StoreError, OSError):
        return None


def file_size(model: str) -> int:
    try:
        return os.path.getsize(model)
    except OSError:
        key = resolved_key(model)
        return os.path.getsize(key) if key else 0
