"""HTTP serving: Ollama, OpenAI and llama-server style APIs over one AsyncEngine.

The names below are imported on first use: they pull in the engine (and torch), which
`tokenmill serve --print-config` and `--help` should not wait for."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"create_app": "tokenmill.server.app", "LoadSpec": "tokenmill.server.model_host",
            "ModelHost": "tokenmill.server.model_host"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
