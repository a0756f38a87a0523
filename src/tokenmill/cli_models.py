"""`tokenmill ps`, `stop`, `show`, `rm`, `cp` and `create`, with Ollama's meaning. They talk to the
server at TOKENMILL_HOST when one answers (it may hold the model loaded); `rm`, `cp`, `create` and
`show` work on the model store directly when none does. `ps` and `stop` need a server."""
from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tokenmill.server_client import ServerError, answers, call, server_url
from tokenmill.store.commands import human_size


def user_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Expected failures (no server, unknown model, a bad Modelfile) print one line and exit 1."""
    @functools.wraps(command)
    def wrapper(args: argparse.Namespace) -> int:
        from tokenmill.store import StoreError

        try:
            return command(args)
        except (ServerError, StoreError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return wrapper


def _until(expires_at: str) -> str:
    import datetime as dt

    when = dt.datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()
    left = when - time.time()
    if left > 365 * 86400:
        return "Forever"
    if left < 1:
        return "Stopping..."
    for unit, size in (("hours", 3600), ("minutes", 60)):
        if left >= size:
            return f"{left / size:.0f} {unit} from now"
    return f"{left:.0f} seconds from now"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _need_server(base: str) -> None:
    if not answers(base):
        raise ServerError(f"no tokenmill server answers at {base} (start one with `tokenmill serve`, "
                          "or set TOKENMILL_HOST)")


@user_errors
def cmd_ps(args: argparse.Namespace) -> int:
    base = server_url()
    _need_server(base)
    rows = [("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")]
    for m in call(base, "GET", "/api/ps")["models"]:
        rows.append((m["name"], (m.get("digest") or "")[:12], human_size(m["size"]),
                     processor(m["size"], m.get("size_vram", 0)), str(m.get("context_length", "")),
                     _until(m["expires_at"])))
    _table(rows)
    return 0


def processor(size: int, size_vram: int) -> str:
    """Ollama's PROCESSOR column: where a loaded model's bytes are."""
    if size <= 0 or size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    gpu = round(100 * size_vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


@user_errors
def cmd_stop(args: argparse.Namespace) -> int:
    base = server_url()
    _need_server(base)
    call(base, "POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return 0


@user_errors
def cmd_rm(args: argparse.Namespace) -> int:
    base = server_url()
    for name in args.models:
        if answers(base):
            call(base, "DELETE", "/api/delete", {"model": name})
        else:
            from tokenmill.store.names import delete_model

            delete_model(name)
        print(f"deleted '{name}'")
    return 0


@user_errors
def cmd_cp(args: argparse.Namespace) -> int:
    base = server_url()
    if answers(base):
        call(base, "POST", "/api/copy", {"source": args.source, "destination": args.destination})
    else:
        from tokenmill.store.names import copy_model

        copy_model(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


@user_errors
def cmd_create(args: argparse.Namespace) -> int:
    """As `ollama create`: the Modelfile is read here, and a FROM naming a file (relative to the
    Modelfile's folder) is pushed to the server as a blob (HEAD first: a held one is not sent again),
    then /api/create gets the blob's digest in `files`. Without a server the file becomes a blob of
    the local store, and the model is made in-process from the same request, checked the same way
    (before anything is pushed or copied)."""
    from tokenmill.store.blobs import digest_ref, file_digest, is_digest
    from tokenmill.store.local import looks_like_path
    from tokenmill.store.modelfile import parse_modelfile

    modelfile = Path(args.file)
    text = _read_modelfile(modelfile)
    parsed = parse_modelfile(text)
    profile = parsed.profile
    body = {"model": args.model, "stream": False,
            **{k: v for k, v in (("system", profile.system), ("template", profile.template)) if v is not None},
            **({"parameters": profile.parameters} if profile.parameters else {}),
            **({"messages": list(profile.messages)} if profile.messages else {})}
    local = _local_file(parsed.base, modelfile.parent) if looks_like_path(parsed.base) else None
    if local is not None:
        body["files"] = {local.name: digest_ref(file_digest(local))}
    else:
        body["from"] = parsed.base
    # ADAPTER lines name files here (pushed as blobs, as FROM's) or blobs already held.
    named: dict[str, str] = {}
    adapter_files: dict[str, Path] = {}
    for i, adapter in enumerate(parsed.adapters):
        if is_digest(adapter):
            named[f"adapter-{i + 1}.gguf"] = adapter
        else:
            path = _local_file(adapter, modelfile.parent, "ADAPTER")
            digest = digest_ref(file_digest(path))
            named[f"{i + 1}-{path.name}"] = digest
            adapter_files[digest] = path
    if named:
        body["adapters"] = named
    create_model(body, text, local, adapter_files=adapter_files)
    print("success")
    return 0


def create_model(body: dict, modelfile_text: str = "", local: Path | None = None, server: str | None = None,
                 adapter_files: dict[str, Path] | None = None) -> None:
    """Make the model an /api/create body describes: through the server when one answers (the file
    FROM names, `local`, and the adapters' `adapter_files` by digest, pushed first as blobs), else on
    the local store, checked the same way before anything is sent or copied (errors naming the
    Modelfile's lines, given its text)."""
    from tokenmill.store.blobs import import_file
    from tokenmill.store.derived import save_derived

    made = _checked(body, modelfile_text)  # the request's checks, before anything is pushed
    adapter_files = adapter_files or {}
    server = server or server_url()
    if answers(server):
        if local is not None:
            _push(server, body["files"][local.name], local)
        for digest, path in adapter_files.items():
            _push(server, digest, path)
        call(server, "POST", "/api/create", body)
        return
    if local is not None:
        import_file(local, made.base.removeprefix("sha256:"))
    for digest, path in adapter_files.items():
        import_file(path, digest.removeprefix("sha256:"), kind="adapter")
    save_derived(body["model"], made.base, made.profile, made.adapters)


def _read_modelfile(path: Path) -> str:
    """The Modelfile's text, or one line saying why it cannot be read (not Python's errno text, and
    no traceback for a file that is not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ServerError(f"no Modelfile at {path} (name one with -f)") from None
    except IsADirectoryError:
        raise ServerError(f"{path} is a directory, not a Modelfile") from None
    except UnicodeDecodeError as exc:
        raise ServerError(f"{path} is not a text Modelfile: not UTF-8 at byte {exc.start}") from None
    except OSError as exc:
        raise ServerError(f"cannot read the Modelfile {path}: {exc.strerror or exc}") from None


def _local_file(base: str, folder: Path, directive: str = "FROM") -> Path:
    path = Path(base).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise ServerError(f"{directive} {base}: no such file")
    # Checked here, before it is pushed to a server (or copied into the store) only to be refused there.
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ServerError(f"{directive} {base}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ServerError(f"{directive} {base}: not a GGUF file")
    return path


def _checked(body: dict, text: str):
    """(base, profile) of a create request, or its error as a one-line message that says which
    Modelfile line holds the value (the parser reports its own errors by line; the values' ranges
    are checked after it, by the server's validator, which knows only the field)."""
    from tokenmill.server.errors import APIError
    from tokenmill.server.model_create import create_request

    try:
        return create_request(body)
    except APIError as exc:
        message = exc.message
        field = exc.param or ""
        if field.startswith("parameters."):
            name = field.removeprefix("parameters.")
            line = _directive_line(text, "PARAMETER", name)
            message = message.replace(f"parameters.{name}", f"PARAMETER {name}", 1)
        else:  # the one-valued directives; a message's index is not its line
            line = _directive_line(text, field.upper()) if field in ("system", "template") else None
        raise ServerError(f"line {line}: {message}" if line else message) from None


def _directive_line(text: str, directive: str, name: str | None = None) -> int | None:
    """The number of the Modelfile's last `directive` line (for PARAMETER, the one setting `name`):
    the value that counts, since a later line overrides an earlier one."""
    from tokenmill.store.modelfile import _lines

    found = None
    for number, line in _lines(text):
        words = line.split()
        if words and words[0].upper() == directive and (name is None or [w.lower() for w in words[1:2]] == [name]):
            found = number
    return found


def _push(server: str, digest: str, path: Path) -> None:
    """Send `path` to the server as the blob `digest`, unless it holds it already."""
    from tokenmill.server_client import has_blob, push_blob

    if not has_blob(server, digest):
        print(f"transferring model data ({human_size(path.stat().st_size)})", file=sys.stderr)
        push_blob(server, digest, path)


@user_errors
def cmd_show(args: argparse.Namespace) -> int:
    info = model_details(args.model)
    if args.modelfile:
        print(info.get("modelfile", ""), end="")
        return 0
    print_details(info)
    return 0


def model_details(model: str, server: str | None = None) -> dict:
    """What /api/show says of a model: from the server when one answers, else from the store."""
    base = server or server_url()
    return call(base, "POST", "/api/show", {"model": model}) if answers(base) else _show_local(model)


def print_details(info: dict) -> None:
    """`ollama show`'s table: the model's architecture, size, context and quantization, what it can do
    (completion, tools, thinking...), then its system prompt and parameters when it has them."""
    details = info.get("details", {})
    model_info = info.get("model_info", {})
    arch = model_info.get("general.architecture", details.get("family", ""))
    rows = [("  Model", ""), ("    architecture", arch),
            ("    parameters", details.get("parameter_size", "")),
            ("    context length", str(model_info.get(f"{arch}.context_length", ""))),
            ("    quantization", details.get("quantization_level", ""))]
    if info.get("capabilities"):
        rows += [("  Capabilities", "")] + [("    " + c, "") for c in info["capabilities"]]
    if info.get("system"):
        rows += [("  System", ""), ("    " + info["system"], "")]
    if info.get("parameters"):
        rows += [("  Parameters", "")] + [("    " + line, "") for line in info["parameters"].splitlines()]
    _table([("", "")] + rows)


def _show_local(name: str) -> dict:
    from tokenmill.server import model_info

    entry = model_info.find_entry(None, name)
    if entry is None:
        raise ServerError(f"model \"{name}\" not found")
    return model_info.show(entry)
