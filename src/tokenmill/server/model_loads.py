"""The bookkeeping of model loads for the host: the policy that bounds them (keep_alive, how many
models, how much memory), one load in progress, what a model name or path stands for before its
load has finished, and what a client is told about a load (never a server path or a file's bytes)."""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine import EngineConfig
from tokenmill.server.errors import APIError
from tokenmill.server.served_model import LoadSpec, ServedModel
from tokenmill.store.derived import normalize_name

log = logging.getLogger("tokenmill.server")


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


# A model loaded onto a GPU holds its weights there in bf16, dequantized from the file's blocks: 3.2 to
# 3.6 times a 4- or 5-bit file, 1.9 times an 8-bit one. Counted at the high end, plus what loading and
# a step need beside the weights (model/gpu/memory.py's fixed workspace), before the load; the KV
# cache then gets what the budget has left (and at most what the device has free, engine/device.py).
GPU_BYTES_PER_FILE_BYTE = 4
GPU_LOAD_MARGIN = 512 * 2**20


@dataclass(frozen=True)
class MemoryPool:
    """The memory a load has to fit in: the machine's RAM under the memory budget, or, for a model
    going to a GPU, that GPU's memory."""
    gpu: str | None = None                # "cuda:0", or None for RAM
    utilization: float = 0.9              # a GPU's: the load's gpu_memory_utilization

    def load_bytes(self, model: str, draft: str | None = None) -> int:
        """What loading `model` (and the draft model it speculates with, if any) takes from this pool
        before its KV cache."""
        size = file_size(model) + (file_size(draft) if draft else 0)
        if self.gpu is None:
            return int(size * 1.1)  # the weights as the file holds them, plus dense copies and buffers
        return size * GPU_BYTES_PER_FILE_BYTE + GPU_LOAD_MARGIN

    def held_by(self, served: ServedModel) -> int:
        """What a loaded model holds in this pool."""
        if self.gpu is None:
            return served.host_bytes
        return served.gpu_bytes if served_gpu(served) == self.gpu else 0

    def budget(self, memory_budget: int, held: int) -> int:
        """RAM: the memory budget. A GPU: `utilization` of its memory that is free now plus what the
        loaded models there hold (`held`: a model that could be unloaded counts as room)."""
        if self.gpu is None:
            return memory_budget
        from tokenmill import gpu_info

        return int((gpu_info.device_memory(self.gpu).free_bytes + held) * self.utilization)

    def describe(self, budget: int) -> str:
        where = "memory budget" if self.gpu is None else f"{self.gpu} memory budget"
        return f"{where} {budget / 1e9:.2f} GB"


def load_pool(engine: EngineConfig) -> MemoryPool:
    """Where a model loaded with `engine` will live. A device that cannot be had counts as RAM: the
    load itself then fails with the reason."""
    if engine.device == "cpu":
        return MemoryPool()
    from tokenmill import gpu_info
    from tokenmill.model.gpu.device import DeviceUnavailable, resolve_device

    try:
        device = resolve_device(engine.device)
    except DeviceUnavailable:
        return MemoryPool()
    if device.type != "cuda":
        return MemoryPool()
    return MemoryPool(gpu_info.device_label(device), engine.gpu_memory_utilization)


def served_gpu(served: ServedModel) -> str | None:
    """The GPU a loaded model is on ("cuda:0"), or None."""
    device = served.engine.loaded.device
    if device.type != "cuda":
        return None
    from tokenmill import gpu_info

    return gpu_info.device_label(device)


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
    error_status: int = 500               # of a failed load: load_error_status
    no_room: bool = False
    waiting_for_room: bool = False        # every loaded model is busy: the load waits for one to idle
    room: str = ""                        # then: the budget it waits under ("memory budget 12.00 GB")
    started: float = field(default_factory=time.monotonic)
    served: ServedModel | None = None
    holds: int = 0                        # requests waiting for it: each gets a lease as it is served

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
    from tokenmill.store import UnknownModelError

    text = str(exc) or type(exc).__name__
    if isinstance(exc, UnknownModelError):  # its file went while it was waiting to load (/api/delete)
        reason = "its file is no longer there"
    elif "not a GGUF file" in text or "magic" in text:
        reason = "not a valid GGUF file"
    else:
        reason = _PATH_LIKE.sub("\0", text)
        reason = reason.removeprefix("\0: ").replace("\0", "the model file")
    return f"model {label!r} could not be loaded: {reason}"


def load_error_status(exc: BaseException) -> int:
    """The HTTP status of a failed load: 422 when the model's file is what is wrong with it (a model
    made from a blob a client pushed, whose tensors or tokenizer cannot be used), 404 when the model
    was deleted before it loaded, 500 when the failure is the server's (memory, a device, a bug)."""
    from tokenmill.gguf import GGUFError
    from tokenmill.model.registry import ModelFileError
    from tokenmill.store import UnknownModelError
    from tokenmill.tokenizer import TokenizerError

    if isinstance(exc, UnknownModelError):
        return 404
    return 422 if isinstance(exc, (ModelFileError, GGUFError, TokenizerError)) else 500


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


def resolve_for_request(name: str, served_files: list[str], pull_on_demand: bool):
    """The model a request names (store.names.ResolvedModel); 404 if it is not installed, unless
    pull_on_demand (then the catalog model, to be pulled by its load)."""
    from tokenmill.store import ModelNotInstalledError, UnknownModelError
    from tokenmill.store.names import resolve_requested

    try:
        # Clients name models; files on the server's disk are not theirs to load (but a model
        # made from the file `serve` was started with is served).
        return resolve_requested(name, served_files)
    except UnknownModelError:
        raise APIError(404, f"model \"{name}\" not found, try pulling it first", param="model",
                       code="model_not_found") from None
    except ModelNotInstalledError as exc:
        if not pull_on_demand:
            raise APIError(404, f"model \"{name}\" not found, try pulling it first", param="model",
                           code="model_not_found") from None
        from tokenmill.store.catalog import lookup
        from tokenmill.store.local import model_path
        from tokenmill.store.names import ResolvedModel

        log.info("%s; pulling it on demand", exc)
        spec = lookup(name)
        return ResolvedModel(spec.name, model_path(spec))
