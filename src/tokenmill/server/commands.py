"""`tokenmill serve [MODEL]`: settings from tokenmill.config (flags, env, file), bind first (a busy
port is a one-line error, not a traceback after a model load), start loading the model in the
background, serve until SIGTERM/SIGINT, then drain."""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import socket
import sys

from typing import TYPE_CHECKING

import uvicorn

from tokenmill.config import Config, ConfigError, load_config

if TYPE_CHECKING:  # imported when serving: they pull in torch, which --print-config does not need
    from tokenmill.server.model_host import ModelHost

log = logging.getLogger("tokenmill.server")


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT, turn new requests away (503) while uvicorn stops accepting
    connections and waits up to timeout_graceful_shutdown for in-flight ones."""

    def __init__(self, config: uvicorn.Config, host: ModelHost):
        super().__init__(config)
        self.model_host = host

    def handle_exit(self, sig, frame) -> None:
        if not self.model_host.admission.draining:
            self.model_host.admission.draining = True
            log.info("shutting down: draining %d in-flight request(s), up to %.0fs",
                     self.model_host.admission.in_flight, self.config.timeout_graceful_shutdown or 0)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal after shutting down; having drained, exit with 0 instead.
            self._captured_signals.clear()


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart right after a stop (TIME_WAIT)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def check_model_name(model: str) -> None:
    """Raise UnknownModelError for a name that is neither in the catalog nor a file, before serving,
    and StoreError for a path to a file that is no GGUF (a typo such as `serve ./notes.txt` used to
    start a server whose only model could never load)."""
    from tokenmill.store import ModelNotInstalledError, resolve_model
    from tokenmill.store.local import looks_like_path

    if _created_model(model) is not None:  # a created model, its weights there (else UnknownModelError)
        return
    try:
        path = resolve_model(model)
    except ModelNotInstalledError:
        return  # known: pulled in the background
    if looks_like_path(model):
        _check_gguf(model, path)


def _check_gguf(model: str, path) -> None:
    from tokenmill.store import StoreError

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise StoreError(f"cannot read {model}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise StoreError(f"{model} is not a GGUF file")


def check_draft(settings: Config) -> str | None:
    """Why --speculative draft:MODEL cannot work, or None. The draft is loaded with every model and
    never pulled, so a name that is unknown or not installed (or a file that is no GGUF) would fail
    every model's load after the server had started; it is refused before it starts."""
    if not settings.speculative.startswith("draft:"):
        return None
    from tokenmill.store import StoreError, resolve_model
    from tokenmill.store.local import looks_like_path

    name = settings.speculative[len("draft:"):].strip()
    try:
        path = resolve_model(name)
        if looks_like_path(name):
            _check_gguf(name, path)
    except StoreError as exc:
        return f"{settings.source('speculative')}: draft model {name!r}: {exc}"
    return None


def make_lora_models(settings: Config) -> str | None:
    """Make each --lora-modules NAME=FILE the model NAME: the served model with the adapter merged in,
    as `create` with ADAPTER makes it (the files are the operator's, named at startup); why not, or None.
    The base is pulled first if it is a known model not yet installed."""
    if not settings.lora_modules.strip():
        return None
    from pathlib import Path

    from tokenmill.store import StoreError, ensure_model
    from tokenmill.store.blobs import digest_ref, import_file
    from tokenmill.store.derived import Profile, find_derived, save_derived
    from tokenmill.store.local import looks_like_path

    where = settings.source("lora_modules")
    base = settings.model
    try:
        if looks_like_path(base):  # a file is made a blob, as `create` makes one of FROM ./file.gguf
            base = digest_ref(import_file(ensure_model(base)))
        elif find_derived(base) is None:
            ensure_model(base)  # a known model not installed yet is pulled now
        for entry in settings.lora_modules.split(","):
            name, sep, file = (part.strip() for part in entry.partition("="))
            if not sep or not name or not file:
                return f"{where}: {entry.strip()!r} is not NAME=FILE"
            path = Path(file).expanduser()
            if not path.is_file():
                return f"{where}: {name}: no such file {file}"
            adapter = digest_ref(import_file(path, kind="adapter"))
            made = find_derived(name)
            if made is not None and (made.adapted_from, made.adapters) == (base, (adapter,)):
                continue  # made by an earlier start from the same files: not merged again
            save_derived(name, base, Profile(), (adapter,))
            log.info("LoRA module %s: %s with %s merged in", name, settings.model, file)
    except StoreError as exc:
        return f"{where}: {exc}"
    return None


def check_tls(settings: Config) -> str | None:
    """Why the TLS settings cannot serve HTTPS, or None: both files or neither, each a readable PEM
    the server can load (checked before listening, not on the first connection)."""
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if not cert and not key:
        return None
    if not cert or not key:
        given, missing = ("ssl_certfile", "ssl_keyfile") if cert else ("ssl_keyfile", "ssl_certfile")
        return f"{given} is set ({settings.source(given)}) but {missing} is not: HTTPS needs both"
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use {cert} and {key} for HTTPS: {getattr(exc, 'strerror', None) or exc}"
    return None


def check_device(settings: Config) -> str | None:
    """Why the device asked for cannot be used here, or None: with --device cuda on a machine
    without CUDA no model could ever load, so the server refuses to start (a setting, not a model's fault)."""
    if settings.device != "cuda":
        return None
    from tokenmill.model.gpu.device import DeviceUnavailable, resolve_device

    try:
        resolve_device(settings.device)
    except DeviceUnavailable as exc:
        return f"{settings.source('device')}: {exc}"
    return None


def host_for(settings: Config) -> ModelHost:
    """The models' host for these settings, its first model loading (serve's, and batch's)."""
    from tokenmill.cpu_threads import configure_threads
    from tokenmill.server.model_host import HostPolicy, LoadSpec, ModelHost

    # Before any model loads, for the whole process: every model loaded on demand runs on this count
    # (configure_threads logs it).
    configure_threads(settings.threads)
    host = ModelHost(max_queue=settings.max_queue, retire_timeout=settings.drain_timeout,
                     policy=HostPolicy.from_settings(settings))
    model, label = settings.model, ""
    created = _created_model(model)
    if created is not None:  # a created model's weights load as its requests would load them
        model, label = str(created.path), created.name
    host.start_load(LoadSpec(model, settings.engine_config()), label)
    return host


def _created_model(model: str):
    """The created model (`create`, `cp`) `model` names, resolved, or None."""
    from tokenmill.store.derived import find_derived
    from tokenmill.store.local import looks_like_path
    from tokenmill.store.names import resolve_named

    if looks_like_path(model) or find_derived(model) is None:
        return None
    return resolve_named(model)


def build_server(settings: Config) -> tuple[DrainingServer, ModelHost]:
    from tokenmill.server.app import create_app
    from tokenmill.server.connections import protocol_with_timeout

    host = host_for(settings)
    config = uvicorn.Config(
        create_app(host, settings),
        http=protocol_with_timeout(settings.header_timeout),
        log_level=settings.log_level,
        timeout_keep_alive=int(settings.http_keep_alive),
        timeout_graceful_shutdown=int(settings.drain_timeout),
        lifespan="on",
        ssl_certfile=settings.ssl_certfile or None,
        ssl_keyfile=settings.ssl_keyfile or None,
    )
    return DrainingServer(config, host), host


def read_settings(args: argparse.Namespace) -> Config | int:
    """The settings to serve with, or the exit code when there is nothing to serve (a bad setting
    is one line on stderr; --print-config prints them)."""
    try:
        settings = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "print_config", False):
        print(settings.to_toml(), end="")
        return 0
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.store import StoreError

    settings = read_settings(args)
    if isinstance(settings, int):
        return settings
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = settings.model
    try:
        check_model_name(model)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    unusable = (check_device(settings) or check_draft(settings) or check_tls(settings)
                or make_lora_models(settings))
    if unusable:
        print(f"error: {unusable}", file=sys.stderr)
        return 1
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            reason = ("the address is already in use (another server running? pick one with --port or "
                      "TOKENMILL_HOST=host:port)")
        elif isinstance(exc, socket.gaierror):  # the host is no address or name this machine knows
            reason = f"{exc.strerror or exc} (check --host or TOKENMILL_HOST)"
        else:
            reason = exc.strerror or str(exc)
        print(f"error: cannot listen on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    server, _ = build_server(settings)
    from tokenmill.server.log_writer import LogWriter
    # After uvicorn.Config has set up its loggers: their lines are written off the event loop.
    LogWriter().take_over("", "uvicorn", "uvicorn.error", "uvicorn.access")
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    scheme = "https" if settings.ssl_certfile else "http"
    print(f"tokenmill listening on {scheme}://{host}:{port}, loading {model}", file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
