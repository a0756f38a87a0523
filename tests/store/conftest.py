"""Fixtures for store tests: a throwaway TOKENMILL_HOME and fake models shipped in fake wheels,
so pulls run end to end (fetch, extract, hash, install) without the network."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from fake_wheels import FakeIndex, build_wheel
from tokenmill.store import KNOWN_MODELS, ModelSpec, WheelPart


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("TOKENMILL_HOME", str(home))
    return home


@dataclass
class FakeModel:
    spec: ModelSpec
    data: bytes  # the whole GGUF, i.e. the parts concatenated in order
    index: FakeIndex


@pytest.fixture
def make_model(tmp_path, monkeypatch):
    """Register a fake catalog model split over `n_parts` wheels; returns a FakeModel."""

    def make(name: str = "fake:1b", n_parts: int = 3, part_size: int = 50_000, sha256: str | None = None,
             aliases: tuple[str, ...] = ()) -> FakeModel:
        wheel_dir = tmp_path / f"wheels-{name.replace(':', '-')}"
        wheel_dir.mkdir()
        stem = name.replace(":", "-")
        parts, payloads, wheels = [], [], {}
        for i in range(n_parts):
            pkg = f"{stem}-gguf-part{i + 1}"
            part = WheelPart(pkg, "1.0.0", f"{pkg.replace('-', '_')}/data/{stem}.gguf.part{i:02d}")
            # Distinct bytes per part, so concatenating out of order changes the hash.
            payload = bytes([i + 1]) * (part_size // 2) + hashlib.sha256(pkg.encode()).digest() * (part_size // 64)
            wheels[part.requirement] = build_wheel(wheel_dir, part, payload)
            parts.append(part)
            payloads.append(payload)
        data = b"".join(payloads)
        spec = ModelSpec(
            name=name,
            aliases=aliases,
            filename=f"{stem}.gguf",
            parts=tuple(parts),
            sha256=sha256 or hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
        )
        monkeypatch.setitem(KNOWN_MODELS, name, spec)
        return FakeModel(spec, data, FakeIndex(wheels))

    return make


def leftovers(home: Path) -> list[str]:
    """Files a pull may have left in the models dir, other than its lock file."""
    models = home / "models"
    if not models.exists():
        return []
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))
