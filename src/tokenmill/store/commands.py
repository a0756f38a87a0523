"""`tokenmill pull` and `tokenmill list`. Store errors are expected user-facing outcomes (typo,
no network), so they print one line and exit 1 instead of a traceback."""
from __future__ import annotations

import argparse
import sys
import time

from tokenmill.store.blobs import blob_path, is_digest, parse_digest
from tokenmill.store.catalog import StoreError, lookup
from tokenmill.store.derived import list_derived, normalize_name
from tokenmill.store.local import describe, installed_path, list_models, models_dir
from tokenmill.store.pull import pull


def human_size(n: int) -> str:
    # Decimal units, like pip's download bar and Ollama's list.
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        spec = lookup(args.model)
        existing = installed_path(spec)
        if existing is not None:
            print(f"{spec.name} is already installed and verified: {existing}")
            return 0
        start = time.monotonic()
        path = pull(spec.name)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{spec.name} pulled and verified in {time.monotonic() - start:.1f}s: {path} ({human_size(spec.size_bytes)})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    try:
        models = list_models()
    except OSError as exc:
        print(f"error: cannot read {models_dir()}: {exc}", file=sys.stderr)
        return 1
    if not models:
        print(f"no models in {models_dir()}; run `tokenmill pull smollm2`")
        return 0
    rows = [("NAME", "SIZE", "ARCH", "QUANT", "CONTEXT")]

    def row(name: str, m) -> tuple[str, ...]:
        context = str(m.context_length) if m.context_length is not None else "-"
        return (name, human_size(m.size_bytes), m.architecture, m.quantization, context)

    by_name = {}
    for m in models:
        rows.append(row(m.name, m))
        by_name[normalize_name(m.name)] = by_name[m.path.stem.lower()] = m
    for d in list_derived():  # made by `create` or `cp`: the base model's weights under another name
        base = by_name.get(normalize_name(d.base))
        if base is None and is_digest(d.base) and blob_path(parse_digest(d.base)).is_file():
            base = describe(blob_path(parse_digest(d.base)))  # made from a file, or with adapters merged in
        if base is not None:
            rows.append(row(d.name, base))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for m in models:
        if m.error:
            print(f"warning: {m.error}", file=sys.stderr)
    return 0
