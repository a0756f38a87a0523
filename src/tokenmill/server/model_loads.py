"""The bookkeeping of model loads for the host: the policy that bounds them (keep_alive, how many
models, how much memory), one load in progress, what a model name or path stands for before its
load has finished, and what a client is told about a load (never a server path or a file's bytes)."""
from __future__ import annotations

import os
import re
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
    label: str = ""                       # what clients are told the model is called (public_name)
    progress: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    no_room: bool = False
    waiting_for_room: bool = False        # every loaded model is busy: the load waits for one to idle
    started: float = field(default_factory=time.monotonic)
    served: ServedModel | None = None

    def __post_init__(self) -> None:
        self.label = self.label or public_name(self.spec.model)


def public_name(model: str) -> str:
    """A model as clients may read it named: the name as given, a file by its stem (no server path)."""
    from tokenmill.store.local import looks_like_path

    return Path(model).stem if looks_like_path(model) else model


# Anything shaped like a path of two or more parts (`/a/b`, `~/x/y`, `C:\\a\\b`).
_PATH_LIKE = re.compile(r"(?<![\w.])(?:~|[A-Za-z]:)?(?:[/\\][^\s'\"/\\:,;()]+){2,}[/\\]?")


def public_load_error(exc: BaseException, label: str) -> str:
    """What a client is told about a failed load: the reason without the file's path or bytes. The
    reader names the file and quotes its first bytes (`/etc/passwd: not a GGUF file (magic b'root'...)`),
    which helps on the command line and in the server's log, not in an answer to a request."""
    if isinstance(exc, NoRoomError):  # built by the host from public names and numbers
        return str(exc)
    text = str(exc) or type(exc).__name__
    if "not a GGUF file" in text or "magic" in text:
        reason = "not a valid GGUF file"
    else:
        reason = _PATH_LIKE.sub("\0", text)
        reason = reason.removeprefix("\0: ").replace("\0", "the model file")
    return f"model {label!r} could not be loaded: {reason}"


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
